"""kvtier's SGLang HiCache backend without SGLang: a host pool of CPU tensors with SGLang's
``get_page_buffer_meta`` contract, driven as SGLang's cache controller drives a backend
(batch_exists -> batch_set_v1 -> batch_get_v1), over real disk and Redis tiers."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from kvtier.integrations.sglang import KVTierHiCache
from kvtier.store.disk import DiskTier
from kvtier.store.redis_tier import RedisTier

from store_redis_fixtures import redis_cluster, redis_server  # noqa: F401 - fixtures


@dataclass
class Cfg:
    """The fields of SGLang's HiCacheStorageConfig the backend reads."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    model_name: str = "org/model"
    enable_storage_metrics: bool = True
    extra_config: dict = field(default_factory=dict)


class Pool:
    """A host KV pool of plain CPU tensors. MHA: ``(2, layers, size, heads, dim)`` layer-first,
    ``(2, size, layers, heads, dim)`` page-first; MLA: ``(layers, size, 1, dim)`` /
    ``(size, layers, 1, dim)``. Pieces per page as SGLang gives them: page-first K, V (MLA: one);
    layer-first K, V per layer (MLA: one per layer)."""

    def __init__(self, layout: str, mla: bool = False, layers=3, heads=2, dim=16, page_size=4, pages=16):
        self.layout, self.mla, self.page_size, self.dtype = layout, mla, page_size, torch.bfloat16
        self.layers, size = layers, page_size * pages
        self.size = size
        if mla:
            dims = (layers, size, 1, dim) if layout == "layer_first" else (size, layers, 1, dim)
        else:
            dims = (2, layers, size, heads, dim) if layout == "layer_first" else (2, size, layers, heads, dim)
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype)
        self.token_bytes = (1 if mla else heads) * dim * 2  # one token of one layer of K (or V)

    def get_page_buffer_meta(self, indices):
        base, t, layers, size = self.kv_buffer.data_ptr(), self.token_bytes, self.layers, self.size
        v_off = 0 if self.mla else layers * size * t
        ptrs, sizes = [], []
        for start in indices.tolist()[:: self.page_size]:
            if self.layout == "page_first":
                ptrs += [base + start * layers * t] + (
                    [] if self.mla else [base + start * layers * t + v_off]
                )
                sizes += [layers * t * self.page_size] * (1 if self.mla else 2)
            else:
                for layer in range(layers):
                    k = base + (layer * size + start) * t
                    ptrs += [k] + ([] if self.mla else [k + v_off])
                    sizes += [t * self.page_size] * (1 if self.mla else 2)
        return ptrs, sizes

    def view(self, page: int) -> torch.Tensor:
        """The bytes of page ``page`` (a view of the pool, as int16)."""
        sl, kv = slice(page * self.page_size, (page + 1) * self.page_size), self.kv_buffer.view(torch.int16)
        if self.mla:
            return kv[:, sl] if self.layout == "layer_first" else kv[sl]
        return kv[:, :, sl] if self.layout == "layer_first" else kv[:, sl]

    def page(self, page: int) -> torch.Tensor:
        return self.view(page).clone()


def _backend(tiers, layout="page_first", *, pool=None, extra=None, **cfg) -> tuple[KVTierHiCache, Pool]:
    # the test pools' pages are small: page-first pieces (768 B) in place, per-layer ones gathered
    extra = {
        "interface_v1": 1,
        "tiers": ["disk"],
        "disk_path": "/unused: tiers given",
        "gather_below_bytes": 512,
    } | (extra or {})
    be = KVTierHiCache(Cfg(extra_config=extra, **cfg), {}, tiers=tiers)
    pool = pool or Pool(layout, mla=cfg.get("is_mla_model", False))
    be.register_mem_pool_host(pool)
    return be, pool


def _indices(pool: Pool, pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * pool.page_size, (p + 1) * pool.page_size) for p in pages])


def _fill(pool: Pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, pool.kv_buffer.shape, generator=g))


def _disk(tmp_path: Path, name="disk") -> DiskTier:
    return DiskTier(tmp_path / name, 1 << 30, o_direct=True, fsync=True, name=name)


def _round_trip(
    be: KVTierHiCache, pool: Pool, keys: list[str], pages: list[int], dst_pages: list[int]
) -> list[bool]:
    """exists -> set_v1 -> exists -> get_v1 into other (poisoned) pages; True per page equal bit for bit."""
    assert be.batch_exists(keys) == 0
    src = _indices(pool, pages)
    assert be.batch_set_v1(keys, src) == [True] * len(keys)
    assert be.batch_exists(keys) == len(keys)
    want = [pool.page(p) for p in pages]
    for p in dst_pages:  # poisoned: a page not read keeps these bytes
        pool.view(p).fill_(0x5A5A)
    got = be.batch_get_v1(keys, _indices(pool, dst_pages))
    return [g and torch.equal(pool.page(p), w) for g, p, w in zip(got, dst_pages, want, strict=True)]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("mla", [False, True])
def test_disk_round_trip_bit_exact(tmp_path, layout, mla):
    be, pool = _backend([_disk(tmp_path)], layout, is_mla_model=mla)
    _fill(pool, 1)
    keys = [f"hash{i:03d}" for i in range(5)]
    assert _round_trip(be, pool, keys, [0, 1, 2, 3, 4], [9, 11, 10, 15, 8]) == [True] * 5
    # per-layer pieces are gathered into one chunk; page-first pieces are chunks of their own
    assert be.shape.gathered == (layout == "layer_first")
    assert be.stats()["tiers"]["disk"]["entries"] == 5 * (1 if be.shape.gathered else len(be.shape.sizes))
    be.close()


def test_chunks_per_page_follow_the_shape(tmp_path):
    disk = _disk(tmp_path)
    be, pool = _backend([disk], "page_first")
    _fill(pool, 2)
    be.batch_set_v1(["a", "b"], _indices(pool, [0, 1]))
    assert disk.stats()["entries"] == 4  # K and V of each page, in place
    be2, pool2 = _backend([_disk(tmp_path, "d2")], "layer_first")
    _fill(pool2, 2)
    be2.batch_set_v1(["a", "b"], _indices(pool2, [0, 1]))
    assert be2.tiers[0].stats()["entries"] == 2  # 2 x 3 layers of small pieces: one chunk a page
    be.close()
    be2.close()


def test_tp_ranks_kept_apart(tmp_path):
    disk = _disk(tmp_path)
    r0, pool0 = _backend([disk], tp_rank=0, tp_size=2)
    r1, pool1 = _backend([disk], tp_rank=1, tp_size=2)
    _fill(pool0, 3)
    _fill(pool1, 4)
    keys = ["k0", "k1", "k2"]
    assert r0.batch_set_v1(keys, _indices(pool0, [0, 1, 2])) == [True] * 3
    assert r1.batch_exists(keys) == 0  # rank 1 holds other heads: rank 0's pages are no hit
    assert _round_trip(r1, pool1, keys, [0, 1, 2], [5, 6, 7]) == [True] * 3
    want0 = pool0.page(0)
    pool0.kv_buffer.zero_()
    assert r0.batch_get_v1(keys[:1], _indices(pool0, [3])) == [True]
    assert torch.equal(pool0.page(3), want0)
    r0.close()


def test_mla_single_writer_shared_latent(tmp_path):
    disk = _disk(tmp_path)
    w, pw = _backend([disk], tp_rank=0, tp_size=2, is_mla_model=True)
    r, pr = _backend([disk], tp_rank=1, tp_size=2, is_mla_model=True)
    _fill(pr, 5)
    assert r.batch_set_v1(["x", "y"], _indices(pr, [0, 1])) == [True, True]
    assert disk.stats()["entries"] == 0  # only the writer writes
    _fill(pw, 6)
    assert w.batch_set_v1(["x", "y"], _indices(pw, [0, 1])) == [True, True]
    assert r.batch_exists(["x", "y"]) == 2  # the latent is the same on every rank: shared key
    assert r.batch_get_v1(["x", "y"], _indices(pr, [2, 3])) == [True, True]
    assert torch.equal(pr.page(2), pw.page(0))
    assert r.stats()["pages_set_skipped_not_writer"] == 2
    w.close()


def test_exists_counts_consecutive_hits(tmp_path):
    be, pool = _backend([_disk(tmp_path)])
    _fill(pool, 7)
    be.batch_set_v1(["a", "b", "d"], _indices(pool, [0, 1, 2]))
    assert be.batch_exists(["a", "b", "c", "d"]) == 2
    assert be.batch_exists(["c", "a"]) == 0
    assert be.exists("a") and not be.exists("c")
    be.close()


def test_corrupt_and_missing_disk_chunks_are_misses(tmp_path, caplog):
    disk = _disk(tmp_path)
    be, pool = _backend([disk])
    _fill(pool, 8)
    keys = ["p0", "p1", "p2", "p3"]
    assert be.batch_set_v1(keys, _indices(pool, [0, 1, 2, 3])) == [True] * 4
    files = {k: [disk.chunk_path(c) for c in be._chunks(k)] for k in keys}
    with open(files["p1"][1], "r+b") as f:  # flip a payload byte of p1's V
        f.seek(4096 + 10)
        b = f.read(1)
        f.seek(4096 + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    got = be.batch_get_v1(keys, _indices(pool, [8, 9, 10, 11]))
    assert got[:2] == [True, False]  # the page after a failed one is of no use to SGLang
    assert disk.stats()["errors_corrupt"] == 1
    files["p0"][0].unlink()  # a chunk file gone under the index
    assert be.batch_get_v1(keys[:1], _indices(pool, [12])) == [False]
    st = be.stats()
    assert st["chunks_missed"] >= 2 and st["pages_get_failed"] >= 2
    assert be.batch_exists(keys) == 0  # both bad chunks were dropped from the index
    be.close()


def test_bad_calls_are_misses_not_exceptions(tmp_path):
    be, pool = _backend([_disk(tmp_path)])
    assert be.batch_set_v1(["a", "b"], _indices(pool, [0])) == [
        False,
        False,
    ]  # one page of slots for two keys
    assert be.batch_get_v1(["a"], _indices(pool, [0, 1])) == [False]
    assert be.batch_set_v1([None], _indices(pool, [0])) == [False]
    fresh = KVTierHiCache(Cfg(extra_config={"tiers": ["disk"], "disk_path": str(tmp_path / "x")}), {})
    assert fresh.batch_get_v1(["a"], torch.arange(4)) == [False]  # no pool registered yet
    assert fresh.batch_exists(["a"]) == 0
    fresh.close()
    be.close()


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"tiers": ["disk"]}, "disk_path"),
        ({"tiers": ["redis"]}, "redis_url"),
        ({"tiers": ["tape"], "disk_path": "/never-built"}, "tiers"),
        ({"tiers": "disk", "disk_path": "/never-built"}, "tiers"),
        ({"disk_path": "/never-built", "io_thread": 2}, "unknown settings"),
        ({"disk_path": "/never-built", "io_threads": 0}, "io_threads"),
        ({"disk_path": "/never-built", "redis_ttl_s": -1}, "redis_ttl_s"),
    ],
)
def test_settings_are_checked_at_construction(extra, match):
    with pytest.raises(ValueError, match=match):
        KVTierHiCache(Cfg(extra_config=extra), {})


def test_settings_build_disk_then_redis(tmp_path, redis_server):  # noqa: F811
    extra = {
        "backend_name": "kvtier",
        "module_path": "m",
        "class_name": "c",
        "interface_v1": 1,
        "tiers": ["disk", "redis"],
        "disk_path": str(tmp_path / "d"),
        "disk_capacity_gb": 0.1,
        "redis_url": redis_server.url,
        "redis_ttl_s": 60,
    }
    be = KVTierHiCache(Cfg(extra_config=extra), {})
    assert [t.name for t in be.tiers] == ["disk", "redis"]
    pool = Pool("page_first")
    be.register_mem_pool_host(pool)
    _fill(pool, 9)
    assert _round_trip(be, pool, ["a", "b"], [0, 1], [4, 5]) == [True, True]
    # a chunk only in Redis is read from there (the disk misses it)
    be.tiers[0].delete(be._chunks("a")[0])
    assert be.batch_get_v1(["a"], _indices(pool, [6])) == [True]
    assert be.stats()["redis_chunk_hits"] >= 1
    be.close()


class _CountingClient:
    """A redis-py client whose pipelines count their round trips."""

    def __init__(self, inner) -> None:
        self.inner, self.trips = inner, 0

    def pipeline(self, *a, **kw):
        pipe, outer = self.inner.pipeline(*a, **kw), self

        class P:
            def __getattr__(self, name):
                return getattr(pipe, name)

            def execute(self, *a, **kw):
                outer.trips += 1
                return pipe.execute(*a, **kw)

        return P()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_exists_is_one_round_trip_per_tier(tmp_path, redis_server):  # noqa: F811
    redis = RedisTier(url=redis_server.url, timeout_s=5.0)
    be, pool = _backend([_disk(tmp_path), redis])
    _fill(pool, 10)
    keys = [f"k{i}" for i in range(40)]
    be.batch_set_v1(keys, _indices(pool, list(range(16)) * 2 + list(range(8))))
    be.tiers[0].delete(be._chunks("k3")[1])  # the disk misses one chunk: Redis is asked
    counting = _CountingClient(redis.client)
    redis.client = counting
    assert be.batch_exists(keys) == 40
    assert counting.trips == 1
    be.close()


def test_redis_killed_mid_batch(redis_server):  # noqa: F811
    tier = RedisTier(url=redis_server.url, timeout_s=0.3)
    be, pool = _backend([tier], extra={"io_threads": 1})  # one worker: pages read in order
    _fill(pool, 11)
    keys = [f"r{i}" for i in range(8)]
    assert be.batch_set_v1(keys, _indices(pool, list(range(8)))) == [True] * 8
    real_get, calls = tier.get_into, [0]

    def get_into(key, dest):  # the server dies after the third chunk read
        calls[0] += 1
        if calls[0] == 4:
            redis_server.kill()
        return real_get(key, dest)

    tier.get_into = get_into
    want = pool.page(0)
    got = be.batch_get_v1(keys, _indices(pool, list(range(8, 16))))
    assert got == [True] + [False] * 7  # page 1's V was the 4th read; the pages after it are skipped
    assert torch.equal(pool.page(8), want)
    assert be.batch_set_v1(["z"], _indices(pool, [0])) == [False]
    assert be.batch_exists(keys) == 0
    st = be.stats()["tiers"]["redis"]
    assert st["errors_error"] + st["errors_timeout"] + st["errors_skipped"] >= 1
    be.close()


def test_redis_hung_mid_batch(redis_server):  # noqa: F811
    tier = RedisTier(url=redis_server.url, timeout_s=0.3, cooldown_s=60.0)
    be, pool = _backend([tier], extra={"io_threads": 1})  # one worker: pages read in order
    _fill(pool, 12)
    keys = [f"h{i}" for i in range(6)]
    assert be.batch_set_v1(keys, _indices(pool, list(range(6)))) == [True] * 6
    pid = redis_server.proc.pid
    real_get, calls = tier.get_into, [0]

    def get_into(key, dest):  # the server stops answering after the second chunk read
        calls[0] += 1
        if calls[0] == 3:
            os.kill(pid, signal.SIGSTOP)
        return real_get(key, dest)

    tier.get_into = get_into
    try:
        got = be.batch_get_v1(keys, _indices(pool, list(range(8, 14))))
        assert got == [True] + [False] * 5
        assert be.batch_exists(keys) == 0  # still hung (or skipped by the breaker): no hit, no raise
    finally:
        os.kill(pid, signal.SIGCONT)  # resumed, so the fixture can stop it
    assert tier.stats()["errors_timeout"] >= 1
    be.close()


def test_redis_cluster_round_trip(redis_cluster):  # noqa: F811
    tier = RedisTier(url=redis_cluster.url, cluster=True, timeout_s=5.0)
    be, pool = _backend([tier], "layer_first")
    _fill(pool, 13)
    keys = [f"c{i}" for i in range(6)]
    assert _round_trip(be, pool, keys, list(range(6)), list(range(8, 14))) == [True] * 6
    be.close()


def test_copying_interface_and_stats(tmp_path):
    be, pool = _backend([_disk(tmp_path)])
    page = torch.randn(2, 3, 4, 2, 16).to(torch.bfloat16).flatten()
    assert be.batch_set(["f0"], [page]) is True
    out = torch.zeros_like(page)
    assert be.get("f0", out) is out and torch.equal(out, page)
    assert be.get("nope", torch.zeros_like(page)) is None
    be.batch_set_v1(["v"], _indices(pool, [0]))
    be.batch_get_v1(["v"], _indices(pool, [1]))
    m = be.get_stats()
    assert m.backup_pgs == [1] and m.prefetch_pgs == [1] and len(m.prefetch_bandwidth) == 1
    assert m.kvtier["pages_set_ok"] == 2 and m.kvtier["tiers"]["disk"]["hits"] >= 1
    assert be.get_stats().backup_pgs == []  # drained by the last call
    be.close()


def test_concurrent_backup_and_prefetch(tmp_path):
    be, pool = _backend([_disk(tmp_path)])
    _fill(pool, 14)
    errors = []

    def backup(base):
        try:
            for r in range(5):
                keys = [f"t{base}_{r}_{i}" for i in range(3)]
                assert be.batch_set_v1(keys, _indices(pool, [base, base + 1, base + 2])) == [True] * 3
                assert be.batch_get_v1(keys, _indices(pool, [base + 8, base + 9, base + 10])) == [True] * 3
        except Exception as exc:  # collected: an assert in a thread would be lost
            errors.append(exc)

    threads = [threading.Thread(target=backup, args=(b,)) for b in (0, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    be.close()


AUTH_KEY = "0123456789abcdef0123456789abcdef"


@pytest.mark.redis
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_page_planted_without_the_key_is_a_forged_miss(tmp_path, redis_server, layout):  # noqa: F811
    """A server without the key backs pages up into the shared Redis; a server with the key
    never loads them (counted forged), and its own pages load bit for bit."""
    planter_tier = RedisTier(url=redis_server.url, prefix="kvtier:sglang:", timeout_s=5.0)
    planter, attacker_pool = _backend([planter_tier], layout)
    _fill(attacker_pool, 21)
    assert planter.batch_set_v1(["p0", "p1"], _indices(attacker_pool, [0, 1])) == [True, True]
    extra = {"tiers": ["redis"], "redis_url": redis_server.url, "auth_keys": [AUTH_KEY]}
    keyed, pool = _backend(None, layout, extra=extra)
    redis = keyed.tiers[0]
    assert redis.auth is not None and keyed.batch_exists(["p0", "p1"]) == 2  # held, as a hint
    for p in (4, 5):
        pool.view(p).fill_(0x5A5A)
    poisoned = [pool.page(p) for p in (4, 5)]
    assert keyed.batch_get_v1(["p0", "p1"], _indices(pool, [4, 5])) == [False, False]
    assert all(torch.equal(pool.page(p), w) for p, w in zip((4, 5), poisoned, strict=True))  # never loaded
    assert redis.stats()["errors_forged"] >= 1 and redis.stats()["hits"] == 0
    _fill(pool, 22)
    assert _round_trip(keyed, pool, ["q0", "q1"], [0, 1], [6, 7]) == [True, True]
    planter.close()
    keyed.close()


def test_sealed_pages_round_trip_on_disk_encrypted(tmp_path):
    from kvtier.store.auth import KeyRing

    disk = DiskTier(
        tmp_path / "disk", 1 << 30, o_direct=True, name="disk", auth=KeyRing(AUTH_KEY, encrypt=True)
    )
    be, pool = _backend([disk], "page_first")
    _fill(pool, 23)
    keys = [f"enc{i}" for i in range(4)]
    assert _round_trip(be, pool, keys, [0, 1, 2, 3], [8, 9, 10, 11]) == [True] * 4
    assert disk.stats()["encrypted"] == 1 and disk.stats()["errors_forged"] == 0
    be.close()
