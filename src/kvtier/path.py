"""The hop-by-hop data path of moving a KV range between GPU memory and a tier, and the
load-vs-recompute trade (break-even prefix length, split point). Pure Python.

A transfer is pipelined through its hops, so its time is bytes / (slowest hop) plus the fixed
latency of each hop. A hop that several GPUs share (a PCIe switch, one NIC) gives each of
them 1 / shared_by of its bandwidth (seed section 5.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.models import ModelSpec
from kvtier.roofline import prefill
from kvtier.specs import GPU, Link, get_link

TIERS = ("host", "disk", "remote")


@dataclass(frozen=True, slots=True)
class Hop:
    name: str
    gbps: float
    latency_us: float
    source: str

    def to_json(self) -> dict:
        return {"name": self.name, "gbps": self.gbps, "latency_us": self.latency_us, "source": self.source}


@dataclass(frozen=True, slots=True)
class Path:
    tier: str
    direction: str  # "load" (tier -> GPU) or "save" (GPU -> tier)
    hops: tuple[Hop, ...]
    gpudirect: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def bottleneck(self) -> Hop:
        return min(self.hops, key=lambda h: h.gbps)

    @property
    def latency_us(self) -> float:
        return sum(h.latency_us for h in self.hops)

    def transfer_ms(self, nbytes: float) -> float:
        if nbytes < 0:
            raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
        return nbytes / (self.bottleneck.gbps * 1e9) * 1e3 + self.latency_us / 1e3

    def to_json(self, nbytes: float) -> dict:
        return {
            "tier": self.tier,
            "direction": self.direction,
            "gpudirect": self.gpudirect,
            "hops": [h.to_json() | {"time_ms": nbytes / (h.gbps * 1e9) * 1e3} for h in self.hops],
            "bottleneck": self.bottleneck.name,
            "bottleneck_gbps": self.bottleneck.gbps,
            "latency_us": self.latency_us,
            "transfer_ms": self.transfer_ms(nbytes),
            "notes": list(self.notes),
        }


def _hop(link: Link, label: str | None = None, shared_by: int = 1) -> Hop:
    name = label or link.name
    if shared_by > 1:
        name += f" (shared by {shared_by})"
    return Hop(name, link.typical_gbps / shared_by, link.latency_us, link.source)


def build_path(
    gpu: GPU,
    tier: str = "host",
    host_link: Link | str | None = None,
    direction: str = "load",
    nic: str = "nic200",
    disk: str = "nvme",
    gpudirect: bool = False,
    shared_by: int = 1,
) -> Path:
    """The hops of one transfer between `gpu`'s memory and `tier`, in data-flow order.

    host_link: the GPU's link to the host (a key of LINKS); default from the GPU's PCIe gen.
    gpudirect: GPUDirect Storage (disk) / RDMA (remote): data skips host DRAM.
    shared_by: GPUs sharing the host link / NIC / disk at once.
    """
    if tier not in TIERS:
        raise ValueError(f"tier: unknown tier {tier!r}; known: {', '.join(TIERS)}")
    if direction not in ("load", "save"):
        raise ValueError(f"direction: must be 'load' or 'save', got {direction!r}")
    if shared_by < 1:
        raise ValueError(f"shared_by: must be >= 1, got {shared_by}")
    link = host_link if isinstance(host_link, Link) else get_link(host_link or f"pcie{gpu.pcie_gen}")
    # A KV copy reads (or writes) HBM once per byte moved; HBM is never the bottleneck of a PCIe path.
    hbm = Hop(f"{gpu.name} HBM", gpu.mem_bw_gbps, 0.0, gpu.source)
    hops: list[Hop] = [hbm, _hop(link, f"{link.name} (GPU <-> host)", shared_by)]
    notes: list[str] = []
    if tier == "host" or not gpudirect:
        hops.append(_hop(get_link("dram"), "host DRAM (pinned buffer)"))
    elif gpudirect:
        notes.append("GPUDirect: data goes peer-to-peer over PCIe and skips host DRAM")
    if tier == "disk":
        hops.append(_hop(get_link(disk), shared_by=shared_by))
    elif tier == "remote":
        hops.append(_hop(get_link(nic), shared_by=shared_by))
    if tier != "host" and not gpudirect:
        notes.append("bounce through host DRAM: one extra copy per byte (no GPUDirect)")
    if direction == "load":
        hops.reverse()
    return Path(tier, direction, tuple(hops), gpudirect and tier != "host", tuple(notes))


# ---- load vs recompute ----------------------------------------------------------------


def load_ms(model: ModelSpec, path: Path, tokens: int, kv_dtype: str = "bf16") -> float:
    return path.transfer_ms(tokens * model.kv_bytes_per_token(kv_dtype))


def recompute_ms(
    model: ModelSpec, gpu: GPU, tokens: int, dtype: str = "bf16", efficiency: float = 1.0
) -> float:
    """Compute time of prefilling `tokens` prefix tokens: the FLOPs over the (scaled) peak.

    This is the marginal cost inside a request's prefill: its new tokens read the weights
    anyway, so recomputing the prefix adds FLOPs, not another pass over the weights.
    """
    return prefill(model, gpu, tokens, dtype=dtype, efficiency=efficiency).compute_ms if tokens > 0 else 0.0


def break_even_tokens(
    model: ModelSpec,
    gpu: GPU,
    path: Path,
    kv_dtype: str = "bf16",
    efficiency: float = 1.0,
    limit: int = 1 << 22,
) -> int | None:
    """Shortest prefix from which loading is at least as fast as recomputing, for every longer
    prefix too (recompute grows quadratically, load linearly). None if not within `limit`."""

    def load_wins(n: int) -> bool:
        return load_ms(model, path, n, kv_dtype) <= recompute_ms(model, gpu, n, efficiency=efficiency)

    if not load_wins(limit):
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if load_wins(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True, slots=True)
class Split:
    tokens: int
    recompute_tokens: int  # [0, s) computed from the front
    load_tokens: int  # [s, n) loaded from the back
    recompute_ms: float
    load_ms: float

    @property
    def ms(self) -> float:
        return max(self.recompute_ms, self.load_ms)

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "recompute_tokens": self.recompute_tokens,
            "load_tokens": self.load_tokens,
            "recompute_ms": self.recompute_ms,
            "load_ms": self.load_ms,
            "time_ms": self.ms,
        }


def split_point(
    model: ModelSpec, gpu: GPU, path: Path, tokens: int, kv_dtype: str = "bf16", efficiency: float = 1.0
) -> Split:
    """Compute [0, s) while [s, n) loads at the same time; the best s makes both take equally long.
    (Computing [0, s) needs no loaded KV, so the two run independently.)"""
    if tokens <= 0:
        raise ValueError(f"tokens: must be positive, got {tokens}")

    def at(s: int) -> Split:
        return Split(
            tokens,
            s,
            tokens - s,
            recompute_ms(model, gpu, s, efficiency=efficiency),
            load_ms(model, path, tokens - s, kv_dtype) if s < tokens else 0.0,
        )

    lo, hi = 0, tokens  # recompute time rises with s, load time falls: bisect the crossing
    while lo < hi:
        mid = (lo + hi) // 2
        cur = at(mid)
        if cur.recompute_ms < cur.load_ms:
            lo = mid + 1
        else:
            hi = mid
    return min((at(s) for s in {max(lo - 1, 0), lo}), key=lambda x: x.ms)
