"""The `sglang` suite: kvtier's SGLang HiCache backend moving batches of host pages, beside the raw
tier moving the same bytes, and SGLang's own `file` backend on the same pages where SGLang imports.

The pages: a page-first MHA host pool as SGLang lays it out (`(2, tokens, layers, heads, dim)`,
K and V of a page each one run of bytes, `get_page_buffer_meta`'s two pieces a page), Llama-3-8B
shaped (32 layers, 8 KV heads x 128, bf16), 64-token pages: 4 MiB of K and 4 MiB of V a page. A
batch is 32 pages (256 MiB; 8 in quick mode), SGLang's storage batch for a 2K-token prefix. The pool
is page-aligned memory, so O_DIRECT moves the pieces in place.

  set <tier> / get <tier>      `batch_set_v1` / `batch_get_v1` of the batch (`get` into poisoned
                               pages, checked bit for bit once), `io_threads` workers
  raw <tier> write / read      the same chunks' bytes with nothing of kvtier: disk, one O_DIRECT
                               file per chunk written + fsynced / read back into the pool, on as
                               many threads; Redis, one pipelined SET / GET per chunk value, copied
                               into the pool (the backend: 4 MiB parts, one worker)
  sglang file set / get        SGLang's `HiCacheFile` on the same pages through its copying
                               interface (`batch_set` of flat page tensors, `batch_get` + scatter)

Each row's ratio is to the registered ceiling of its hop (disk_write / disk_read / redis loopback
SET / GET); params `vs_raw` is the backend's GB/s over its raw row's, the figure that says what
kvtier's bookkeeping (headers, checksums, atomic rename, index) costs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.bench.probes_io import disk_io_mode
from kvtier.bench.suite import Context, SkipSuite, register
from kvtier.bench.suites.store_rig import redis_server

LAYERS, HEADS, DIM, PAGE_TOKENS = 32, 8, 128, 64
IO_THREADS = {"disk": 4, "redis": 1}  # disk: several IOs in flight; Redis: one pipeline a call
REDIS_PART_BYTES = 4 << 20  # a page's piece is one part, sent as a view of the pool


class _HostPool:
    """A page-first MHA host pool in page-aligned memory, with SGLang's pointer contract."""

    def __init__(self, pages: int) -> None:
        from kvtier.store.payload import aligned_buffer

        self.page_size, self.layout, self.dtype = PAGE_TOKENS, "page_first", torch.bfloat16
        self.size = pages * PAGE_TOKENS
        shape = (2, self.size, LAYERS, HEADS, DIM)
        self._mem = aligned_buffer(2 * self.size * LAYERS * HEADS * DIM * 2)
        flat = torch.frombuffer(self._mem, dtype=torch.bfloat16)
        self.kv_buffer = flat[: 2 * self.size * LAYERS * HEADS * DIM].view(shape)
        self.bits = self.kv_buffer.view(torch.int16)  # compared as bits: random bf16 holds NaNs
        self.piece = PAGE_TOKENS * LAYERS * HEADS * DIM * 2

    def get_page_buffer_meta(self, indices):
        base, v_off, token = (
            self.kv_buffer.data_ptr(),
            self.size * LAYERS * HEADS * DIM * 2,
            LAYERS * HEADS * DIM * 2,
        )
        ptrs = []
        for start in indices.tolist()[:: self.page_size]:
            ptrs += [base + start * token, base + start * token + v_off]
        return ptrs, [self.piece] * len(ptrs)

    def indices(self, first: int, n: int) -> torch.Tensor:
        return torch.arange(first * PAGE_TOKENS, (first + n) * PAGE_TOKENS)

    def page_views(self, first: int, n: int) -> list[memoryview]:
        from kvtier.integrations.sglang_pages import byte_view

        ptrs, sizes = self.get_page_buffer_meta(self.indices(first, n))
        return [byte_view(p, s) for p, s in zip(ptrs, sizes, strict=True)]


@dataclass
class _Cfg:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    model_name: str = "bench/llama-3-8b"
    enable_storage_metrics: bool = False
    extra_config: dict | None = None


def _backend(tier, pool: _HostPool):
    from kvtier.integrations.sglang import KVTierHiCache

    extra = {
        "interface_v1": 1,
        "tiers": [tier.name],
        "disk_path": "/unused",
        "redis_url": "redis://unused",
        "io_threads": IO_THREADS[tier.name],
    }
    be = KVTierHiCache(_Cfg(extra_config=extra), {}, tiers=[tier])
    be.register_mem_pool_host(pool)
    return be


def _rows(ctx: Context, name: str, be, pool: _HostPool, n: int, raw_write, raw_read, clear, extra: dict):
    """set / get of the backend and the raw write / read of the same bytes."""
    keys = [f"bench-{i}" for i in range(n)]
    src, dst = pool.indices(0, n), pool.indices(n, n)
    nbytes = n * 2 * pool.piece
    want = pool.bits[:, : n * PAGE_TOKENS].clone()
    ok_set = [True]

    def put() -> None:
        ok_set[0] = ok_set[0] and all(be.batch_set_v1(keys, src))

    t_set = ctx.time(put, setup=clear, host=True, name=f"set/{name}")
    pool.bits[:, n * PAGE_TOKENS : 2 * n * PAGE_TOKENS].fill_(0x5A5A)  # poisoned: a page not read keeps it
    got = be.batch_get_v1(keys, dst)
    correct = (
        ok_set[0] and all(got) and torch.equal(pool.bits[:, n * PAGE_TOKENS : 2 * n * PAGE_TOKENS], want)
    )
    t_get = ctx.time(lambda: be.batch_get_v1(keys, dst), host=True, name=f"get/{name}")
    # like the backend's set, each raw write starts from an empty tier: overwriting is cheaper
    t_raw_w = ctx.time(raw_write, setup=clear, host=True, name=f"raw_write/{name}")
    t_raw_r = ctx.time(raw_read, host=True, name=f"raw_read/{name}")
    ceil_w, ceil_r = extra.pop("ceilings")
    p = (
        dict(pages=n, page_bytes=2 * pool.piece, chunk_bytes=pool.piece, io_threads=be.settings.io_threads)
        | extra
    )
    rw, rr = t_raw_w.gbps(nbytes), t_raw_r.gbps(nbytes)
    yield ctx.row(
        f"set {name}",
        nbytes,
        t_set,
        ceil_w,
        correct=correct,
        vs_raw=t_set.gbps(nbytes) / rw,
        raw_gbps=rw,
        **p,
    )
    yield ctx.row(
        f"get {name}",
        nbytes,
        t_get,
        ceil_r,
        correct=correct,
        vs_raw=t_get.gbps(nbytes) / rr,
        raw_gbps=rr,
        **p,
    )
    yield ctx.row(f"raw {name} write", nbytes, t_raw_w, ceil_w, **p)
    yield ctx.row(f"raw {name} read", nbytes, t_raw_r, ceil_r, **p)


def _disk_raw(pool: _HostPool, n: int, root: Path, o_direct: bool):
    """(write, read) of each chunk's bytes as one file, fsynced, on as many threads as the backend."""
    root.mkdir(parents=True, exist_ok=True)
    views = pool.page_views(0, n)
    into = pool.page_views(n, n)
    flag = os.O_DIRECT if o_direct else 0
    ex = ThreadPoolExecutor(IO_THREADS["disk"])

    def write_one(i: int) -> None:
        fd = os.open(root / f"{i}.raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
        try:
            os.write(fd, views[i])
            os.fsync(fd)  # durable, as a tier put is
        finally:
            os.close(fd)

    def read_one(i: int) -> None:
        fd = os.open(root / f"{i}.raw", os.O_RDONLY | flag)
        try:
            os.preadv(fd, [into[i]], 0)
        finally:
            os.close(fd)

    return (
        (lambda: list(ex.map(write_one, range(len(views))))),
        (lambda: list(ex.map(read_one, range(len(views))))),
        ex,
    )


def _redis_raw(client, pool: _HostPool, n: int):
    """(write, read) of each chunk's bytes as one value: one pipeline of SETs / GETs, copied in."""
    views, into = pool.page_views(0, n), pool.page_views(n, n)
    names = [f"raw:{i}" for i in range(len(views))]

    def write() -> None:
        pipe = client.pipeline(transaction=False)
        for name, v in zip(names, views, strict=True):
            pipe.set(name, v)
        pipe.execute()

    def read() -> None:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        for v, value in zip(into, pipe.execute(), strict=True):
            v[:] = value

    return write, read


def _sglang_file_rows(ctx: Context, pool: _HostPool, n: int, root: Path, ceilings: tuple[str, str]):
    """SGLang's own `file` backend on the same pages (its copying interface)."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
    except Exception as e:  # SGLang absent or broken here
        for case in ("sglang file set", "sglang file get"):
            ctx.skip(case, f"SGLang's HiCacheFile does not import: {type(e).__name__}: {e}")
        return
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/llama-3-8b",
        extra_config={"file_storage_path": str(root)},
    )
    be = HiCacheFile(cfg)
    keys = [f"bench-{i}" for i in range(n)]
    kv = pool.kv_buffer
    nbytes = n * 2 * pool.piece

    def put() -> None:  # as SGLang's generic backup: one flat copy of each page, then batch_set
        pages = [kv[:, i * PAGE_TOKENS : (i + 1) * PAGE_TOKENS].flatten() for i in range(n)]
        be.batch_set(keys, pages)

    def get() -> None:  # as SGLang's generic prefetch: into flat pages, then scattered into the pool
        dummies = [torch.empty(2 * PAGE_TOKENS * LAYERS * HEADS * DIM, dtype=kv.dtype) for _ in range(n)]
        for i, page in enumerate(be.batch_get(keys, dummies)):
            kv[:, (n + i) * PAGE_TOKENS : (n + i + 1) * PAGE_TOKENS] = page.view(
                2, PAGE_TOKENS, LAYERS, HEADS, DIM
            )

    t_set = ctx.time(put, setup=be.clear, host=True, name="set/sglang_file")
    put()
    pool.bits[:, n * PAGE_TOKENS : 2 * n * PAGE_TOKENS].fill_(0x5A5A)  # poisoned: a page not read keeps it
    t_get = ctx.time(get, host=True, name="get/sglang_file")
    correct = torch.equal(
        pool.bits[:, : n * PAGE_TOKENS], pool.bits[:, n * PAGE_TOKENS : 2 * n * PAGE_TOKENS]
    )
    p = dict(pages=n, page_bytes=2 * pool.piece, backend="sglang.HiCacheFile", fsync=False)
    yield ctx.row("sglang file set", nbytes, t_set, ceilings[0], correct=correct, **p)
    yield ctx.row("sglang file get", nbytes, t_get, ceilings[1], correct=correct, **p)


@register("sglang", needs_gpu=False, description="SGLang HiCache backend: pages per tier vs the raw tier")
def sglang(ctx: Context):
    try:
        from kvtier.integrations.sglang import KVTierHiCache  # noqa: F401
        from kvtier.store.disk import DiskTier
        from kvtier.store.redis_tier import RedisTier
    except ImportError as e:
        raise SkipSuite(f"the SGLang backend cannot be imported here: {e}") from None
    n = 8 if ctx.quick else 32
    with ExitStack() as stack:
        root = Path(os.environ.get("KVTIER_BENCH_DIR") or tempfile.gettempdir())
        workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-sglang-", dir=root))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        pool = _HostPool(2 * n)
        pool.bits.random_()  # never zeros: a disk may compress them
        nbytes = n * 2 * pool.piece

        o_direct = disk_io_mode(workdir) == "O_DIRECT"
        for c in ("disk_write", "disk_read"):
            ctx.ceiling(c, nbytes=nbytes, root=workdir)
        disk = DiskTier(workdir / "disk", 4 * nbytes, o_direct=o_direct)
        be = _backend(disk, pool)
        stack.callback(be.close)
        write, read, ex = _disk_raw(pool, n, workdir / "raw", o_direct)
        stack.callback(ex.shutdown)
        extra = dict(ceilings=("disk_write", "disk_read"), disk_io="O_DIRECT" if o_direct else "buffered")
        yield from _rows(ctx, "disk", be, pool, n, write, read, be.clear, extra)
        yield from _sglang_file_rows(ctx, pool, n, workdir / "sglang-file", ("disk_write", "disk_read"))

        url, why = redis_server(stack, workdir / "redis")
        if url is None:
            for case in ("set redis", "get redis", "raw redis write", "raw redis read"):
                ctx.skip(case, why)
            return
        tier = RedisTier(url=url, timeout_s=30.0, part_bytes=REDIS_PART_BYTES)
        rbe = _backend(tier, pool)
        stack.callback(rbe.close)
        for c in ("redis_loopback_set", "redis_loopback_get"):
            ctx.ceiling(c, nbytes=nbytes, url=url, part_bytes=pool.piece)
        write, read = _redis_raw(tier.client, pool, n)
        parser = "hiredis" if _has_hiredis() else "python"
        extra = dict(
            ceilings=("redis_loopback_set", "redis_loopback_get"),
            redis_parser=parser,
            redis_part_bytes=REDIS_PART_BYTES,
        )
        yield from _rows(ctx, "redis", rbe, pool, n, write, read, tier.client.flushdb, extra)


def _has_hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True
