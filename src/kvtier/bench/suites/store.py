"""The `store` suite: what `KVStore` costs — lookups, and save / load throughput per tier.

Every row is timed on the host clock: each timed call blocks until its work is done (engine
events completed; write-through pushes stored: `wait_durable`).

  lookup 32K host hit   `KVStore.lookup` of a 32K-token prompt (128 chunks of 256 tokens, token ids a
                        Python list) whose every chunk is in the host tier
  chunk_keys 32K list / tensor    the key computation alone (`keys.chunk_keys`, sha256; the
                        tensor row not in quick mode)
  lookup <tier> hit     lookup of the save/load request below with its chunks only in that tier
                        (host cold): the keys plus one `contains` per chunk (Redis: a round trip);
                        not in quick mode
      The figures are params us_per_prompt and us_per_chunk (microseconds, median). A row's bytes
      are the token ids hashed (4 B a token), so its gbps is hashed token bytes per second and its
      ratio is that over host_memcpy: how far keying a prompt is from merely copying its token ids
      — a scale, not a target. The 32K prompt's store holds one layer of one KV head (a lookup
      never touches KV bytes, only keys and the tiers' indexes).
  save <tier> / load <tier>   `KVStore.save` (+ `wait_durable` for lower tiers, write-through) and
                        `KVStore.load` of one request: Llama-3-8B KV per layer (8 KV heads x 128,
                        bf16, 16-token blocks, random block ids), 32 layers x 4K tokens (512 MiB) on a
                        GPU, 2 layers x 16K tokens (128 MiB) on the CPU, 2 x 2K in quick mode. Tiers:
                        host (the pool alone); disk (a temp dir under $KVTIER_BENCH_DIR or the
                        system temp dir, O_DIRECT where the filesystem allows, loads after evicting
                        the host so every byte comes from the disk); redis (a redis-server started
                        here on a loopback port; skipped without redis-server on PATH or redis-py).
      GB/s of payload vs the ceiling of the slowest hop measured in this run: pinned D2H / H2D on a
      GPU, host_memcpy on the CPU (SimDevice, copy delay 0: the "GPU" is host memory and its copies
      are memcpys), disk_write / disk_read, redis_loopback_set / _get. Params `path_hops` is the
      `kvtier.path` model of the transfer with this run's figures in place of the hops it measured,
      `path_predicted_gbps` its prediction (bytes / bottleneck + hop latencies), `vs_path` the
      measured GB/s over it. Every loaded byte is checked once against the source blocks, on poisoned
      destination blocks; that check is `correct` for the tier's save and load rows.
  save <tier> mac / load <tier> mac   the same request through the same kind of tier with a key ring
                        (`kvtier.store.auth`, a random key): every chunk sealed on its put (an
                        AES-256-GCM tag over header and payload) and opened on its read, in place of
                        the plain checksum. The rows compare side by side: the three runs of a
                        tier (none, mac, encrypted) go round by round, one timed run of each
                        in turn, so a neighbour loading the host weighs on each alike. Params
                        ``auth``: "none", "mac" or "encrypted"; ``time_vs_none``: the median over
                        rounds of the run's time over the unsealed run's in the same round.
  save <tier> encrypted / load <tier> encrypted   the same with the payloads stored encrypted
                        (AES-256-GCM): what encryption at rest costs on top of the MAC.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from statistics import median

import torch

from kvtier.bench.probes_io import disk_io_mode
from kvtier.bench.stats import summarize
from kvtier.bench.suite import Context, Row, SkipSuite, register
from kvtier.bench.suites.store_rig import PROMPT_TOKENS, TIER_CEILINGS, Rig, path_model, redis_server


def _request(ctx: Context) -> tuple[int, int]:
    """(layers, tokens) of the save/load request."""
    if ctx.quick:
        return 2, 2048
    return (32, 4096) if ctx.on_gpu else (2, 16384)


def _key_rows(ctx: Context, stack: ExitStack):
    """Lookup of a 32K-token prompt held by the host, and the key computation alone."""
    from kvtier.store.keys import chunk_keys

    rig = Rig(ctx, stack, layers=1, tokens=PROMPT_TOKENS, heads=1, head_dim=128, seed=1)
    st = stack.enter_context(rig.store([]))
    h = st.save(rig.tokens, rig.src)
    if not h.wait(60) or h.saved != rig.chunks:
        raise RuntimeError(f"lookup prompt: saved {h.saved} of {rig.chunks} chunks")
    got = st.lookup(rig.tokens)
    t = ctx.time(lambda: st.lookup(rig.tokens), host=True, name="lookup/host_hit")
    ok = got.tokens == PROMPT_TOKENS and got.tiers == ("host",) * rig.chunks
    yield _lookup_row(ctx, "lookup 32K host hit", rig, t, ok, "lookup (host hit)")
    args = dict(chunk_tokens=rig.chunk_tokens, block_size=rig.kv.block_size, extra=st.extra)
    keys = chunk_keys(rig.tokens, **args)
    ids = torch.tensor(rig.tokens, dtype=torch.int64)
    ok = len(set(keys)) == rig.chunks and chunk_keys(ids, **args) == keys  # list and tensor agree
    t = ctx.time(lambda: chunk_keys(rig.tokens, **args), host=True, name="chunk_keys/list")
    yield _lookup_row(ctx, "chunk_keys 32K list", rig, t, ok, "chunk_keys", input="list[int]")
    if not ctx.quick:
        t = ctx.time(lambda: chunk_keys(ids, **args), host=True, name="chunk_keys/tensor")
        yield _lookup_row(ctx, "chunk_keys 32K tensor", rig, t, ok, "chunk_keys", input="int64 tensor")


def _lookup_row(ctx: Context, case: str, rig: Rig, t, ok: bool, path: str, **params) -> Row:
    us = t.median_ms * 1e3
    p = dict(path=path, prompt_tokens=len(rig.tokens), chunks=rig.chunks, chunk_tokens=rig.chunk_tokens)
    p |= dict(us_per_prompt=us, us_per_chunk=us / rig.chunks, hash="sha256", counts="token ids hashed (4 B)")
    return ctx.row(case, 4 * len(rig.tokens), t, "host_memcpy", correct=ok, **(p | params))


AUTH = ("none", "mac", "encrypted")  # the key ring's modes, each a pair of rows per lower tier
ROUNDS = {True: 3, False: 15}  # timed runs of each mode when several are interleaved (by ctx.quick)


class _Run:
    """One store over one stack of lower tiers (none: the host alone), as a pair of rows times it:
    ``save`` after ``fresh``, ``load`` after ``cold``. ``auth``: how the tiers seal (`AUTH`);
    ``extra``: the tier's params (``client``: a Redis tier's own database, flushed by ``fresh``)."""

    def __init__(self, rig: Rig, tier: str, tiers: list, workdir: Path, extra: dict, auth: str = "none"):
        self.rig, self.tier, self.tiers, self.workdir, self.extra, self.auth = (
            rig,
            tier,
            tiers,
            workdir,
            extra,
            auth,
        )
        self.lower = bool(tiers)
        self.cur = rig.store(tiers)
        self.saved: list[int] = []  # chunks each timed save stored (-1: not durable in time)
        self.sources: Counter[str] = Counter()  # where the chunks of the timed loads came from
        self.timed = False  # the warm-up runs get no setup: only runs after one are counted

    @property
    def case(self) -> str:
        return self.tier if self.auth == "none" else f"{self.tier} {self.auth}"

    def renew(self) -> None:
        # A store of its own for each run that reads the tier: the host starts cold, and close()
        # waits for the read-ahead the last load left queued (run after an evict, it would bring
        # chunks back into the host behind the next run's back).
        self.cur.close()
        self.cur = self.rig.store(self.tiers)
        _drop_cache(self.workdir, self.extra)

    def save(self) -> None:
        h = self.cur.save(self.rig.tokens, self.rig.src)
        done = h.wait_durable(120) if self.lower else h.wait(120)  # durable: every push stored, not queued
        if self.timed:
            self.saved.append(h.saved if done else -1)

    def fresh(self) -> None:  # each run saves every chunk anew
        self.timed = True
        self.cur.evict(self.rig.tokens, lower=self.lower and self.tier != "redis")
        if self.tier == "redis":
            self.extra["client"].flushdb()  # this run's own database: cheaper than a GET + DEL per chunk

    def load(self) -> None:
        lh = self.cur.load(self.rig.tokens, self.rig.dst)
        lh.wait(120)
        if self.timed:
            self.sources.update(lh.tiers)
            self.sources["missed"] += self.rig.chunks - len(lh.tiers)

    def cold(self) -> None:  # every chunk must come from the tier
        self.timed = True
        if self.lower:
            self.renew()

    def release(self) -> None:
        """The host's chunks go back to the pool, which the runs interleaved with this one share."""
        self.cur.evict()


def _time_runs(ctx: Context, runs: list[_Run], what: str) -> tuple[list, list[float | None]]:
    """The timing of ``what`` ("save" or "load") of each run, and the median over rounds of its
    time over the first run's in the same round (None for the first run, or a run alone).
    Several runs go round by round, one timed run of each in turn, each round starting with the
    next run: a neighbour loading the host weighs on each alike, so their rows compare side by
    side. One run alone: ``ctx.time``."""
    setup = "fresh" if what == "save" else "cold"
    if len(runs) == 1:
        r = runs[0]
        return [ctx.time(getattr(r, what), setup=getattr(r, setup), host=True, name=f"{what}/{r.case}")], [
            None
        ]
    if ctx.on_progress:
        ctx.on_progress(f"{what}/{runs[0].tier} ({', '.join(r.auth for r in runs)})")
    for r in runs:  # warm-up, neither timed nor counted
        getattr(r, what)()
        r.release()
    samples: list[list[float]] = [[] for _ in runs]
    for n in range(ROUNDS[bool(ctx.quick)]):
        # Each round starts with the next run: no run is always first, nor always after the same one.
        for i in range(n, n + len(runs)):
            r, got = runs[i % len(runs)], samples[i % len(runs)]
            getattr(r, setup)()
            t0 = time.perf_counter()
            getattr(r, what)()
            got.append((time.perf_counter() - t0) * 1e3)
            r.release()
    paired = [None] + [median([a / b for a, b in zip(got, samples[0], strict=True)]) for got in samples[1:]]
    return [summarize(got, "perf_counter") for got in samples], paired


def _tier_rows(ctx: Context, rig: Rig, runs: list[_Run]):
    """Save and load rows of each run of one tier (several: interleaved, `_time_runs`), and, for a
    lower tier without a key ring, the lookup row."""
    tier, tokens = runs[0].tier, rig.tokens
    try:
        t_save, vs_save = _time_runs(ctx, runs, "save")
        checks = []
        for r in runs:
            if r.lower:
                r.renew()  # the check below must read every byte from the tier
            ok, how = rig.check_load(r.cur, tier)
            if set(r.saved) != {rig.chunks}:  # every timed save must have stored every chunk
                ok, how = False, f"timed saves stored {sorted(set(r.saved))} of {rig.chunks} chunks; {how}"
            checks.append((ok, how))
            r.timed = False
            if len(runs) > 1:
                r.release()
        t_load, vs_load = _time_runs(ctx, runs, "load")
        for i, (r, (ok, how)) in enumerate(zip(runs, checks, strict=True)):
            public = {k: v for k, v in r.extra.items() if k != "client"}
            for direction, t, vs in (("save", t_save[i], vs_save[i]), ("load", t_load[i], vs_load[i])):
                ceiling, model = path_model(ctx, tier, direction, rig.nbytes)
                p = rig.params() | public | model | dict(path=f"{tier} tier {direction}", tier=tier)
                p["direction"], p["auth"] = direction, r.auth
                if len(runs) > 1:
                    p["timed"] = f"interleaved with {', '.join(o.case for o in runs if o is not r)}"
                if vs is not None:  # > 1: slower than the first run (no key ring) in the same rounds
                    p[f"time_vs_{runs[0].auth}"] = vs
                if direction == "load":
                    p["chunks_by_source"] = ", ".join(f"{k} {v}" for k, v in sorted(r.sources.items()) if v)
                p["check"] = how
                p["vs_path"] = t.gbps(rig.nbytes) / p["path_predicted_gbps"]
                yield ctx.row(f"{direction} {r.case}", rig.nbytes, t, ceiling, correct=ok, **p)
        r = runs[0]
        if r.lower and not ctx.quick and r.auth == "none":
            r.renew()  # nothing in the host: the lookup asks the tier for every chunk
            got = r.cur.lookup(tokens)
            t = ctx.time(lambda: r.cur.lookup(tokens), host=True, name=f"lookup/{tier}_hit")
            hit = got.tokens == len(tokens) and got.tiers == (tier,) * rig.chunks
            yield _lookup_row(ctx, f"lookup {tier} hit", rig, t, hit, f"lookup ({tier} hit)")
    finally:
        for r in runs:
            r.cur.close()


def _ring(auth: str):
    """The key ring of an `AUTH` mode, with a key made for this run (None: no ring)."""
    from kvtier.store.auth import KeyRing

    return None if auth == "none" else KeyRing(os.urandom(32), encrypt=auth == "encrypted")


def _drop_cache(workdir: Path, extra: dict) -> None:
    """Buffered disk tier: drop its files from the page cache, so reads come from the disk."""
    if extra.get("disk_io", "O_DIRECT") == "O_DIRECT":
        return
    for f in workdir.rglob("*.kvc"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced pages are clean: dropped
        finally:
            os.close(fd)


def _fs_type(path: Path) -> str:
    """The filesystem type of `path` (from /proc/mounts; "unknown" elsewhere)."""
    best, kind, where = "", "unknown", str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fs = line.split()[:3]
            inside = where == mount or where.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fs
    except OSError:
        pass
    return kind


@register("store", needs_gpu=False, description="KVStore: lookup cost; save/load GB/s per tier")
def store(ctx: Context):
    try:
        from kvtier.store.disk import DiskTier
        from kvtier.store.kvstore import KVStore  # noqa: F401 - its imports are the store's dependencies
        from kvtier.store.redis_tier import RedisTier
    except ImportError as e:
        raise SkipSuite(f"the store cannot be imported here: {e}") from None

    with ExitStack() as stack:
        root = Path(os.environ.get("KVTIER_BENCH_DIR") or tempfile.gettempdir())
        workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-store-", dir=root))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        with ExitStack() as keys_stack:  # the lookup rig's memory goes before the request's is made
            yield from _key_rows(ctx, keys_stack)
        layers, tokens = _request(ctx)
        rig = Rig(ctx, stack, layers=layers, tokens=tokens, heads=8, head_dim=128, seed=0)
        yield from _tier_rows(ctx, rig, [_Run(rig, "host", [], workdir, {})])

        io = disk_io_mode(workdir)
        disk = dict(disk_io=io, disk_fs=_fs_type(workdir), disk_dir=str(root))
        for name in TIER_CEILINGS["disk"]:
            ctx.ceiling(name, nbytes=rig.nbytes, root=workdir)
        cap, o_direct = 2 * rig.nbytes + (64 << 20), io == "O_DIRECT"
        tiers = [DiskTier(workdir / f"disk-{a}", cap, o_direct=o_direct, auth=_ring(a)) for a in AUTH]
        for tier in tiers:
            stack.callback(tier.close)
        yield from _tier_rows(
            ctx, rig, [_Run(rig, "disk", [t], workdir, disk, a) for t, a in zip(tiers, AUTH, strict=True)]
        )

        url, why = redis_server(stack, workdir / "redis")
        if url is None:
            cases = [f"{d} redis{'' if a == 'none' else ' ' + a}" for a in AUTH for d in ("save", "load")]
            for case in cases + ([] if ctx.quick else ["lookup redis hit"]):
                ctx.skip(case, why)
            return
        runs = []
        for db, auth in enumerate(AUTH):  # a database each: a run's fresh() flushes only its own
            tier = RedisTier(url=url.rsplit("/", 1)[0] + f"/{db}", timeout_s=10.0, auth=_ring(auth))
            stack.callback(tier.close)
            part = min(tier.part_bytes, rig.span)
            for name in TIER_CEILINGS["redis"]:
                ctx.ceiling(name, nbytes=rig.nbytes, url=url, part_bytes=part)
            info = tier.client.info("server")
            redis = dict(client=tier.client, redis_version=info.get("redis_version"), redis_part_bytes=part)
            redis |= dict(redis_timeout_s=10.0)
            runs.append(_Run(rig, "redis", [tier], workdir, redis, auth))
        yield from _tier_rows(ctx, rig, runs)
