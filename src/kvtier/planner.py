"""Load, recompute or both: the time to first token of a request whose first `matched_tokens`
tokens have KV in tier T, for each way of getting that KV, and the one to choose. Pure Python.

n = matched tokens (whole store chunks), m = new tokens (the rest of the prompt; at least one:
the first output token needs a forward), L = layers. All times are roofline lower bounds
(`roofline.prefill`: max(bytes / HBM bandwidth, FLOPs / peak x efficiency), or the forward times a
serving engine measured on its own steps: ``prefill_ms``) and pipelined
transfer times (`path`: bytes / slowest hop + hop latencies), with probed ceilings when given;
each forward is at least the forward floor (the fixed host cost of launching one; measured by
`kvtier calibrate`, or on first use by `integrations.hf_split.plan_request`), which grows with the
tokens already cached before it (`floor_ms_per_token`: the cache's per-layer appends and the
attention over the prefix cost host and device time that a short prefix does not show). A hit pays
a fixed host cost no forward hides (`hit_fixed_ms`: the lookup, the allocation, the copies'
submission, each layer's arrival).

- recompute: one prefill of n + m tokens.
- load: the KV of [0, n) moves through the tier's path while the m new tokens are prefilled;
  layer i of that prefill waits for layer i of the load (per-layer events), so the two overlap
  as a two-stage pipeline: ``overlap(X, C) = max(X + C / L, X / L + C)``, C at least the floor
  after n cached tokens; plus the hit's fixed cost. Where the copies land before the forward
  starts (``pipelined=False``: a serving engine's asynchronous load), X + C.
- split at s (a chunk boundary, 0 < s < n): the compute stream prefills [0, s) while [s, n) is
  read from the tier on a thread; the device copies of [s, n) then pipeline under the m new
  tokens: ``max(R_s, read_s) + overlap(copy_s, C)``. The front's KV is exact (attention of a
  token < s reads only keys < s). Only the tier's read (disk, network: no GPU, no host launches)
  is counted beside the front: the device copies and the front's forward are not assumed to
  overlap (the per-layer copies share the SMs and the host's launches with it), so on the host
  tier, whose load is all copies, a split is its two halves one after the other.

The choice: the fastest of load and recompute, or the split when it is predicted at least a margin
faster than both, so that a close call goes to the option with one forward. From the host the
margin is SPLIT_MARGIN: there the split's halves are both device work (its copies and the front
share the copy engine's bandwidth, the SMs and the host's launches) and slow each other in ways a
roofline does not see. From a lower tier it is SPLIT_MARGIN_READ: there the second half is a read
off the device, at the rate the store measured (`read_gbps`), on a thread beside the front.

The best split is found among the chunk boundaries in O(log(n / chunk)) evaluations: the split's
time is convex in s (a convex prefill, a linear read, a convex pipeline of a linear copy), so a
bisection on its slope finds the least one (`_best_split`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.ceilings import Ceilings
from kvtier.models import ModelSpec
from kvtier.path import Hop, Path, build_path
from kvtier.roofline import prefill
from kvtier.specs import GPU, Link, get_gpu, get_link, measured_host_link

MAX_TOKENS = 1 << 40  # the most tokens a request's prefix or new part may hold: beyond any context
CHOICES = ("load", "recompute", "split")  # in order of preference when two predict the same time
# A split is chosen only when predicted this much faster than both load and recompute (see the
# module docstring): from the host, whose split is two halves of device work that slow each other
# in ways the model does not see; from a lower tier, whose second half is a read off the device.
SPLIT_MARGIN = 0.2
SPLIT_MARGIN_READ = 0.05
TIER_ALIASES = {"host": "host", "disk": "disk", "remote": "remote", "redis": "remote"}
READ_SOURCE = "measured by the store on its own loads (KVStore.read_rate)"


@dataclass(frozen=True, slots=True)
class Option:
    """One way to get the prefix's KV, then prefill the new tokens (all times in ms)."""

    name: str
    recompute_tokens: int  # [0, s) prefilled from the front
    load_tokens: int  # [s, n) loaded
    recompute_ms: float  # prefill of [0, s) (recompute: of the whole prompt)
    load_ms: float  # transfer of [s, n)
    new_ms: float  # prefill of the new tokens after the prefix (0 for recompute: included above)
    ms: float  # predicted time to first token
    bound: str = ""  # what bounds `ms`, in words (e.g. "PCIe Gen5 x16-bound 21.5 + the last layer 0.1")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Plan:
    """choice: "load" | "recompute" | "split"; split_tokens: s, tokens [0, s) recomputed and
    [s, n) loaded (load: 0, recompute: n). predicted_ms: per option, None where it does not
    apply (no hit: nothing to load; a hit of one chunk: no boundary inside it)."""

    choice: str
    split_tokens: int
    matched_tokens: int
    new_tokens: int
    chunk_tokens: int
    predicted_ms: dict[str, float | None]
    options: dict[str, Option]
    path: Path
    kv_bytes_per_token: float
    reasons: tuple[str, ...]

    @property
    def ms(self) -> float:
        return self.options[self.choice].ms

    @property
    def why(self) -> str:
        """One line: the choice, then each option's predicted ms and what bounds it."""
        parts = []
        for name in CHOICES:
            o = self.options.get(name)
            if o is None:
                parts.append(
                    f"{name}: {'nothing to load' if not self.matched_tokens else 'no chunk boundary'}"
                )
                continue
            note = ""
            if name == "split" and self.choice != "split":
                margin = split_margin(self.path.tier)
                note = f", chosen only when {margin:.0%} faster than load and recompute"
            parts.append(f"{name}: {o.ms:.1f} ms ({o.bound}{note})")
        return f"chosen: {self.choice} | " + " | ".join(parts)

    def to_json(self) -> dict:
        load_bytes = (self.matched_tokens - self.split_tokens) * self.kv_bytes_per_token
        return {
            "choice": self.choice,
            "split_tokens": self.split_tokens,
            "matched_tokens": self.matched_tokens,
            "new_tokens": self.new_tokens,
            "chunk_tokens": self.chunk_tokens,
            "predicted_ms": dict(self.predicted_ms),
            "options": {k: o.to_json() for k, o in self.options.items()},
            "load_bytes": load_bytes,
            "path": self.path.to_json(load_bytes),
            "bottleneck": self.path.bottleneck.name,
            "bottleneck_gbps": self.path.bottleneck.gbps,
            "reasons": list(self.reasons),
            "why": self.why,
        }


def overlap(load: float, compute: float, layers: int) -> float:
    """Two stages, layer by layer: layer i of `compute` starts once layer i of `load` landed."""
    if load <= 0:
        return compute
    return max(load + compute / layers, load / layers + compute)


def tier_path(
    gpu: GPU,
    tier: str,
    ceilings: Ceilings | None = None,
    link: str | None = None,
    nic: str = "nic200",
    gpudirect: bool = False,
    shared_by: int = 1,
    read_gbps: float | None = None,
    read_fixed_ms: float = 0.0,
) -> Path:
    """The load path from `tier` ("host", "disk", "remote" or its alias "redis") to `gpu`, its
    hops replaced by measured figures where `ceilings` has them: pinned H2D for the PCIe hop
    (unless `link` names one), the disk's read rate, Redis' GET rate (an extra hop).
    read_gbps: the lower tier's read rate as the store measured it on its own loads
    (`KVStore.read_rate`), which replaces the disk hop or the GET hop: the rate a probe of the
    raw device gives is not what a load of chunk files or keys reaches. read_fixed_ms: the fixed
    part of such a load (`ReadRate.fit`), that hop's latency."""
    t = TIER_ALIASES.get(tier)
    if t is None:
        raise ValueError(f"tier: unknown tier {tier!r}; known: {', '.join(TIER_ALIASES)}")
    host_link: Link = get_link(link or f"pcie{gpu.pcie_gen}")
    if link is None:
        host_link = measured_host_link(host_link, ceilings, "h2d")
    p = build_path(gpu, t, host_link, "load", nic, "nvme", gpudirect, shared_by)
    if read_gbps is not None and (
        isinstance(read_gbps, bool)
        or not isinstance(read_gbps, int | float)
        or not 0 < read_gbps < float("inf")
    ):
        raise ValueError(f"read_gbps: must be a number > 0, got {read_gbps!r}")
    if (
        isinstance(read_fixed_ms, bool)
        or not isinstance(read_fixed_ms, int | float)
        or not (0 <= read_fixed_ms < float("inf"))
    ):
        raise ValueError(f"read_fixed_ms: must be a number >= 0, got {read_fixed_ms!r}")
    if ceilings is None and (read_gbps is None or t == "host"):
        return p
    hops = list(p.hops)
    nvme = get_link("nvme")
    lat_us = read_fixed_ms * 1e3 if read_gbps is not None else None
    disk_rate = (read_gbps, READ_SOURCE) if read_gbps is not None else None
    get_rate = disk_rate
    if ceilings is not None:
        where = f"measured by kvtier probe on {ceilings.gpu or 'this machine'}"
        if disk_rate is None and (rate := ceilings.get("disk_read_gbps")) is not None:
            disk_rate = (rate / shared_by, where)
        if get_rate is None and (rate := ceilings.get("redis_loopback_get_gbps")) is not None:
            get_rate = (rate, where)
    if t == "disk" and disk_rate is not None:
        hops = [
            Hop(h.name, disk_rate[0], h.latency_us if lat_us is None else lat_us, disk_rate[1])
            if h.name.startswith(nvme.name)
            else h
            for h in hops
        ]
    if t == "remote" and get_rate is not None:
        name = (
            "remote read (this store's loads)" if read_gbps is not None else "Redis GET (loopback, redis-py)"
        )
        hops.insert(0, Hop(name, get_rate[0], lat_us or 0.0, get_rate[1]))
    return dataclasses.replace(p, hops=tuple(hops))


def plan(
    model: ModelSpec | str,
    gpu: GPU | str,
    tier: str,
    matched_tokens: int,
    new_tokens: int,
    ceilings: Ceilings | None = None,
    efficiency: float = 1.0,
    link: str | None = None,
    *,
    chunk_tokens: int = 256,
    dtype: str = "bf16",
    kv_dtype: str = "bf16",
    nic: str = "nic200",
    gpudirect: bool = False,
    shared_by: int = 1,
    prefill_overhead_ms: float = 0.0,
    forward_floor_ms: float = 0.0,
    floor_ms_per_token: float = 0.0,
    tail_floor_ms: float | None = None,
    front_floor_ms: float | None = None,
    tail_overhead_ms: float | None = None,
    front_overhead_ms: float | None = None,
    hit_fixed_ms: float = 0.0,
    read_gbps: float | None = None,
    read_fixed_ms: float = 0.0,
    prefill_ms: Callable[[int, int], float] | None = None,
    pipelined: bool = True,
    kv_bytes_per_token: float | None = None,
) -> Plan:
    """Predict recompute, load and the best chunk-aligned split for one request; choose the fastest.

    matched_tokens: the prefix tier `tier` holds (a multiple of `chunk_tokens`, the store's chunk;
    0: no hit). new_tokens: prompt tokens after it (>= 1). efficiency: fraction of the (measured,
    with `ceilings`) bf16 peak a prefill reaches. link: the GPU <-> host link key (default: the
    GPU's PCIe generation, or the probed pinned H2D rate when `ceilings` has one). A `GPU`
    object is used as given (`specs.get_gpu(key, ceilings)` applies the measured figures).
    prefill_overhead_ms: the fixed cost of one forward (launches, framework), added to each one the
    option runs — a split runs two (`kvtier calibrate` fits it: `fits.prefill.overhead_ms`).
    forward_floor_ms: the least time one forward takes however little it computes (the host
    launching an eager model: `kvtier calibrate` measures it, `forward_floor_ms`); each forward
    is predicted at max(its prefill, its floor).
    floor_ms_per_token: how much the floor grows per token already cached before the forward
    (the cache's per-layer appends and the attention over it; `hf_costs` measures the floor at
    two cached lengths): a forward after `prefix` cached tokens has the floor
    ``forward_floor_ms + floor_ms_per_token * prefix``.
    tail_floor_ms: the floor, before that growth, of the forward over the new tokens after a hit
    (None: forward_floor_ms). A runner that replays that forward as CUDA graphs passes its own
    (e.g. 0) while its eager forwards from scratch (a split's front) keep forward_floor_ms.
    front_floor_ms: the same for a split's front, the forward over [0, s) (None:
    forward_floor_ms); a runner that replays its front as a CUDA graph passes its own.
    tail_overhead_ms, front_overhead_ms: prefill_overhead_ms for those two forwards (None:
    prefill_overhead_ms); a graph replay has no framework cost per forward (e.g. 0).
    hit_fixed_ms: the host cost of a hit that no forward hides (the lookup, the allocation, the
    submission of the copies, each layer's arrival), added once to a load and to a split.
    read_gbps: the tier's read rate as the store measured it on its loads (`KVStore.read_rate`;
    `hf_split.plan_request` passes it once the store has read from the tier); None: the probed
    ceiling or the datasheet. read_fixed_ms: the fixed part of such a read (`ReadRate.fit`).
    prefill_ms: ``prefill_ms(tokens, prefix)``, the ms one forward over `tokens` after `prefix`
    cached ones takes as measured where the request runs (a serving engine's own steps), in place
    of the roofline (`efficiency` then unused; floors and fixed costs still apply where given).
    pipelined: the copies of a load land layer by layer under the new tokens' forward (`overlap`);
    False: they all land before it starts (a whole-job load, as a serving engine's asynchronous
    load), so a load takes its read, its copies and the new tokens' forward one after the other.
    kv_bytes_per_token: the bytes a load moves per token (None: the model's in `kv_dtype`), e.g.
    one tensor-parallel rank's share where the ranks load theirs at once.
    """
    if isinstance(model, str):
        from kvtier.hfconfig import resolve_model

        model = resolve_model(model)
    g = get_gpu(gpu, ceilings) if isinstance(gpu, str) else gpu
    for name, v in (("chunk_tokens", chunk_tokens), ("new_tokens", new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_TOKENS:
            raise ValueError(f"{name}: must be an integer within [1, {MAX_TOKENS}], got {v!r}")
    n = matched_tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOKENS or n % chunk_tokens:
        raise ValueError(
            f"matched_tokens: must be a multiple of chunk_tokens={chunk_tokens} within [0, {MAX_TOKENS}], "
            f"got {n!r}"
        )
    if isinstance(efficiency, bool) or not isinstance(efficiency, int | float) or not 0 < efficiency <= 1:
        raise ValueError(f"efficiency: must be within (0, 1], got {efficiency!r}")
    if prefill_ms is not None and not callable(prefill_ms):
        raise ValueError(f"prefill_ms: a callable (tokens, prefix) -> ms, got {prefill_ms!r}")
    if kv_bytes_per_token is not None and (
        isinstance(kv_bytes_per_token, bool)
        or not isinstance(kv_bytes_per_token, int | float)
        or not 0 < kv_bytes_per_token < float("inf")
    ):
        raise ValueError(f"kv_bytes_per_token: must be a number > 0, got {kv_bytes_per_token!r}")
    tail_floor = forward_floor_ms if tail_floor_ms is None else tail_floor_ms
    front_floor = forward_floor_ms if front_floor_ms is None else front_floor_ms
    tail_fixed = prefill_overhead_ms if tail_overhead_ms is None else tail_overhead_ms
    front_fixed = prefill_overhead_ms if front_overhead_ms is None else front_overhead_ms
    for name, v in (
        ("prefill_overhead_ms", prefill_overhead_ms),
        ("forward_floor_ms", forward_floor_ms),
        ("floor_ms_per_token", floor_ms_per_token),
        ("tail_floor_ms", tail_floor),
        ("front_floor_ms", front_floor),
        ("tail_overhead_ms", tail_fixed),
        ("front_overhead_ms", front_fixed),
        ("hit_fixed_ms", hit_fixed_ms),
    ):
        if isinstance(v, bool) or not isinstance(v, int | float) or not (0 <= v < float("inf")):
            raise ValueError(f"{name}: must be a number >= 0, got {v!r}")
    p = tier_path(g, tier, ceilings, link, nic, gpudirect, shared_by, read_gbps, read_fixed_ms)
    layers, m = model.layers, new_tokens
    per_token = model.kv_bytes_per_token(kv_dtype) if kv_bytes_per_token is None else kv_bytes_per_token
    # the copies' own bottleneck (after a lower tier's read: the hops past the first), short name
    copy_hops = p.hops if p.tier == "host" or p.gpudirect or len(p.hops) < 2 else p.hops[1:]
    bottleneck = min(copy_hops, key=lambda h: h.gbps).name.split(" (")[0]

    def pre(
        tokens: int, prefix: int = 0, floor0: float = forward_floor_ms, overhead: float = prefill_overhead_ms
    ) -> tuple[float, str]:
        """(ms, what bounds it) of one forward over `tokens` after `prefix` cached ones."""
        if not tokens:
            return 0.0, "nothing"
        if prefill_ms is None:
            b = prefill(model, g, tokens, prefix, dtype, kv_dtype, efficiency)
            core, what = b.ms, f"{b.bound}-bound"
        else:
            core, what = float(prefill_ms(tokens, prefix)), "measured"
        ms = core + overhead
        floor = floor0 + floor_ms_per_token * prefix
        if floor > ms:
            return floor, f"forward floor {floor:.1f}"
        fixed = f" + fixed {overhead:.1f}" if overhead else ""
        return ms, f"{what} {core:.1f}{fixed}"

    new_ms, new_bound = pre(m, n, tail_floor, tail_fixed)
    hit = f" + hit {hit_fixed_ms:.1f}" if hit_fixed_ms else ""

    def landed(read: float, copy: float) -> tuple[float, str]:
        """The copies of a load under the new tokens' forward (or before it), after the tier's read."""
        head = f"read {read:.1f} + " if read else ""
        if not pipelined:
            return read + copy + new_ms, f"{head}{bottleneck}-bound {copy:.1f} + new tokens {new_bound}"
        t = overlap(copy, new_ms, layers)
        if copy + new_ms / layers >= copy / layers + new_ms:
            return read + t, f"{head}{bottleneck}-bound {copy:.1f} + the last layer {new_ms / layers:.1f}"
        return read + t, f"{head}the first layer {copy / layers:.1f} + new tokens {new_bound}"

    def split_at(s: int, name: str) -> Option:
        (r, r_bound), (read, copy) = pre(s, 0, front_floor, front_fixed), transfer_parts(p, n - s, per_token)
        tail, tail_bound = landed(0.0, copy)
        if not s:  # a load
            ms, bound = landed(read, copy)
            return Option(name, 0, n, 0.0, read + copy, new_ms, hit_fixed_ms + ms, bound + hit)
        front = max(r, read)
        side = f"front [0, {s}) {r_bound}" if r >= read else f"read of [{s}, {n}) {read:.1f}"
        ms = hit_fixed_ms + front + tail
        return Option(name, s, n - s, r, read + copy, new_ms, ms, f"{side}, then {tail_bound}{hit}")

    full, full_bound = pre(n + m)
    options = {"recompute": Option("recompute", n, 0, full, 0.0, 0.0, full, full_bound)}
    if n:
        options["load"] = split_at(0, "load")
    if n > chunk_tokens:  # a boundary inside the hit
        options["split"] = _best_split(lambda k: split_at(k * chunk_tokens, "split"), n // chunk_tokens)
    choice = min((c for c in ("load", "recompute") if c in options), key=lambda c: options[c].ms)
    if "split" in options and options["split"].ms <= (1 - split_margin(p.tier)) * options[choice].ms:
        choice = "split"
    best = options[choice]
    reasons = _reasons(options, choice, p, per_token, n, m, chunk_tokens)
    return Plan(
        choice=choice,
        split_tokens=best.recompute_tokens if choice != "recompute" else n,
        matched_tokens=n,
        new_tokens=m,
        chunk_tokens=chunk_tokens,
        predicted_ms={c: options[c].ms if c in options else None for c in CHOICES},
        options=options,
        path=p,
        kv_bytes_per_token=per_token,
        reasons=tuple(reasons),
    )


def split_margin(tier: str) -> float:
    """How much faster than load and recompute a split from `tier` must be predicted to be chosen."""
    return SPLIT_MARGIN if TIER_ALIASES.get(tier, tier) == "host" else SPLIT_MARGIN_READ


def _best_split(at, chunks: int) -> Option:
    """The split with the least predicted time over boundaries k = 1 .. chunks - 1 (``at(k)``: the
    split after k chunks), the smallest k among equals: what trying every boundary would pick.

    Its time is convex in k (module docstring), so its slope at k, ``at(k + 1) - at(k)``, never
    falls as k grows: the least k whose next boundary is no faster is the best. One bisection,
    O(log chunks) calls of ``at``."""
    lo, hi = 1, chunks - 1  # the answer lies in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid + 1).ms >= at(mid).ms:
            hi = mid
        else:
            lo = mid + 1
    return at(lo)


def transfer_parts(p: Path, tokens: int, per_token: float) -> tuple[float, float]:
    """(tier read ms, copy ms) of loading `tokens` along `p`. `KVStore.load` reads every chunk of a
    lower tier into the host before the layer-major copies start (store/load.py), so only the
    copies pipeline with the new tokens' layers; from the host (or with GPUDirect, one pipelined
    transfer) all of it does."""
    nbytes = tokens * per_token
    if not tokens:
        return 0.0, 0.0
    if p.tier == "host" or p.gpudirect or len(p.hops) < 2:
        return 0.0, p.transfer_ms(nbytes)
    read, copy = Path(p.tier, p.direction, p.hops[:1]), Path(p.tier, p.direction, p.hops[1:])
    return read.transfer_ms(nbytes), copy.transfer_ms(nbytes)


def _reasons(options: dict[str, Option], choice: str, p: Path, per_token: float, n: int, m: int, chunk: int):
    b = p.bottleneck
    out = [f"recompute: prefill of {n + m} tokens = {options['recompute'].ms:.3f} ms"]
    if n == 0:
        out.append("no prefix hit: nothing to load")
    else:
        o = options["load"]
        out.append(
            f"load: {n * per_token / 1e6:.1f} MB through {b.name} at {b.gbps:.1f} GB/s = {o.load_ms:.3f} ms, "
            f"layer by layer under the prefill of {m} new tokens ({o.new_ms:.3f} ms) = {o.ms:.3f} ms"
        )
    if "split" in options:
        o = options["split"]
        out.append(
            f"split: recompute [0, {o.recompute_tokens}) ({o.recompute_ms:.3f} ms) while reading "
            f"[{o.recompute_tokens}, {n}) from the tier, then its copies ({o.load_ms:.3f} ms with the read) "
            f"under {m} new tokens = {o.ms:.3f} ms; chosen only when {split_margin(p.tier):.0%} faster than "
            "load and recompute"
        )
    elif n:
        out.append(f"split: none, a hit of {n // chunk} chunk has no chunk boundary inside it")
    others = [options[c].ms for c in options if c != choice]
    if others:
        out.append(f"chosen: {choice}, {min(others) / options[choice].ms:.2f}x faster than the next best")
    return out
