"""put_many / contains_many: disk (one directory fsync per batch, O_DIRECT in place), Redis
(pipelined round trips), failures in the middle of a batch (whole chunks or misses, never torn),
the writer's batches and a KVStore lookup over Redis costing one round trip; Redis payloads sent
from the caller's memory."""

import errno
import mmap
import os
import tracemalloc

import pytest

from kvtier.store import chunkfile
from kvtier.store.disk import DiskTier
from kvtier.store.header import ChunkHeader
from kvtier.store.redis_tier import RedisTier
from kvtier.store.tier import contains_many, put_many

from store_redis_fixtures import redis_cluster, redis_server  # noqa: F401  (fixtures)
from test_kvstore import CT, Rig, toks

MIB = 1 << 20


def chunk(i: int, n: int = 5000):
    key = (7000 + i).to_bytes(16, "little")
    payload = bytes((i * 37 + j) % 249 for j in range(n))
    return key, ChunkHeader.for_payload(key, payload, (n,), "uint8", "flat"), payload


def intact_or_miss(tier, chunks) -> list[bool]:
    """Per chunk: True if the tier delivers it intact, False for a miss; a torn chunk fails."""
    out = []
    for key, header, payload in chunks:
        got = tier.get(key)
        assert got is None or (got.header == header and bytes(got.payload) == payload)
        out.append(got is not None)
    return out


# -- disk -------------------------------------------------------------------------------------


def test_disk_put_many_syncs_each_directory_once_and_only_then_reports(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 4 * MIB)
    chunks = [chunk(i) for i in range(12)]
    assert tier.put(*chunks[0])
    synced = []

    def sync_dir(directory):
        # Nothing of the batch is visible, nor reported, before its directory is synced.
        assert not any(tier.contains(k) for k, _, _ in chunks[1:])
        synced.append(directory)
        real_sync(directory)

    real_sync = chunkfile.sync_dir
    monkeypatch.setattr("kvtier.store.disk.sync_dir", sync_dir)
    assert tier.put_many(chunks + [chunks[3]]) == [True] * 13  # a key twice: written once
    dirs = {tier.chunk_path(k).parent for k, _, _ in chunks[1:]}  # chunk 0 was held already
    assert sorted(synced) == sorted(dirs)
    assert intact_or_miss(tier, chunks) == [True] * 12
    s = tier.stats()
    assert s["puts"] == 12 and s["puts_present"] == 1
    tier.close()
    assert intact_or_miss(DiskTier(tmp_path, 4 * MIB), chunks) == [True] * 12  # after a restart


def test_disk_a_failure_mid_batch_leaves_whole_chunks_or_misses(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 4 * MIB, failure_threshold=100)
    chunks = [chunk(i) for i in range(8)]
    real_write = chunkfile.write_temp

    def flaky(path, head, view, o_direct, fsync, align=chunkfile.PAGE):
        if path == tier.chunk_path(chunks[3][0]):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, head, view, o_direct, fsync, align)

    monkeypatch.setattr("kvtier.store.disk.write_temp", flaky)
    ok = tier.put_many(chunks)
    assert ok == [i != 3 for i in range(8)]
    assert intact_or_miss(tier, chunks) == ok and tier.stats()["errors_full"] == 1
    assert not [p for p in tmp_path.rglob("*.tmp")]  # the failed temp file is gone
    tier.close()
    assert intact_or_miss(DiskTier(tmp_path, 4 * MIB), chunks) == ok


def test_disk_a_failed_directory_sync_reports_its_chunks_not_durable(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 4 * MIB, failure_threshold=100)
    chunks = [chunk(i) for i in range(10)]
    bad = tier.chunk_path(chunks[2][0]).parent
    real_sync = chunkfile.sync_dir

    def sync_dir(directory):
        if directory == bad:
            raise OSError(errno.EIO, "Input/output error")
        real_sync(directory)

    monkeypatch.setattr("kvtier.store.disk.sync_dir", sync_dir)
    ok = tier.put_many(chunks)
    assert ok == [tier.chunk_path(k).parent != bad for k, _, _ in chunks] and not all(ok)
    assert intact_or_miss(tier, chunks) == ok
    assert not any(p.parent == bad for p in tmp_path.rglob("*.kvc"))  # removed, not left half-durable


@pytest.mark.parametrize("offset", [0, 1])
def test_o_direct_writes_an_aligned_payload_in_place(tmp_path, monkeypatch, offset):
    tier = DiskTier(tmp_path, 4 * MIB, o_direct=True)
    if not tier.stats()["o_direct"]:
        pytest.skip("this filesystem refuses O_DIRECT")
    # a payload size no other test uses: a bounce buffer of it cannot come from the reuse pool
    n = (61 + 6 * offset) * 4096
    src = mmap.mmap(-1, n + 4096)  # page-aligned, writable: like a pool slot
    view = memoryview(src)[offset : offset + n]
    view[:] = bytes((j * 7) % 251 for j in range(n))
    key = (42).to_bytes(16, "little")
    header = ChunkHeader.for_payload(key, view, (n,), "uint8", "flat")
    staged = []
    real = chunkfile.aligned_buffer
    monkeypatch.setattr(chunkfile, "aligned_buffer", lambda size: staged.append(size) or real(size))
    assert tier.put(key, header, view)
    # A payload-sized bounce buffer only when the payload is not aligned (a page-sized one for
    # the header may come from the buffers earlier puts kept, so it may or may not be made here).
    if offset == 0:
        assert set(staged) <= {chunkfile.PAGE}
    else:
        assert chunkfile.PAGE + n in staged
    assert bytes(tier.get(key).payload) == bytes(view)
    view.release()
    src.close()


# -- Redis ------------------------------------------------------------------------------------


class Counting:
    """A redis-py client wrapper counting round trips: each command, and each pipeline execute.
    ``fail_at``: the pipeline execute (counted from 1) that raises ConnectionError instead."""

    def __init__(self, client, fail_at: int | None = None) -> None:
        self._c, self.trips, self.fail_at, self.pipes = client, 0, fail_at, 0

    def pipeline(self, *a, **kw):
        outer, pipe = self, self._c.pipeline(*a, **kw)
        real_execute = pipe.execute

        def execute(*ea, **ekw):
            outer.trips += 1
            outer.pipes += 1
            if outer.pipes == outer.fail_at:
                import redis

                raise redis.exceptions.ConnectionError("connection lost mid-batch")
            return real_execute(*ea, **ekw)

        pipe.execute = execute
        return pipe

    def __getattr__(self, name):
        attr = getattr(self._c, name)
        if not callable(attr) or name == "close":
            return attr

        def call(*a, **kw):
            self.trips += 1
            return attr(*a, **kw)

        return call


def redis_tier(url, cluster=False, **kw):
    return RedisTier(url=url, cluster=cluster, part_bytes=4096, timeout_s=1.0, failure_threshold=100, **kw)


def redis_round_trips(tier, trips: int):
    """``trips``: the round trips of one put_many (one server 1, a cluster 2)."""
    tier.client = Counting(tier.client)
    chunks = [chunk(i, 3000) for i in range(20)]
    assert tier.put_many(chunks) == [True] * 20 and tier.client.trips == trips
    tier.client.trips = 0
    big = [chunk(100 + i, 4096 * 3 + 1 + i) for i in range(5)]  # 4 parts each
    assert tier.put_many(big) == [True] * 5 and tier.client.trips == trips
    tier.client.trips = 0
    keys = [k for k, _, _ in chunks + big] + [chunk(999)[0]]
    assert tier.contains_many(keys) == [True] * 25 + [False] and tier.client.trips == 1
    assert intact_or_miss(tier, chunks + big) == [True] * 25
    assert tier.put_many(chunks[:2] + big[:1]) == [True] * 3 and tier.stats()["puts_present"] == 3


def redis_failure_mid_batch(tier, fail_at: int):
    """A connection lost at round trip ``fail_at`` of a batch of small and split chunks."""
    chunks = [chunk(200 + i, 3000 if i % 2 else 4096 * 4 + 11) for i in range(8)]
    real = tier.client
    tier.client = Counting(real, fail_at=fail_at)
    ok = tier.put_many(chunks)
    tier.client = real
    assert ok == [False] * 8  # no chunk is reported stored after a loss
    assert intact_or_miss(tier, chunks) == ok  # reported stored = stored whole; the rest misses
    assert tier.stats()["errors_error"] > 0
    assert tier.put_many(chunks) == [True] * 8 and intact_or_miss(tier, chunks) == [True] * 8


def keys_of(tier, chunks) -> int:
    """The server keys ``chunks`` stored whole take: a manifest and its parts each."""
    return sum(1 + -(-len(payload) // tier.part_bytes) for _, _, payload in chunks)


@pytest.mark.redis
def test_redis_put_many_and_contains_many_are_pipelined(redis_server):  # noqa: F811
    redis_round_trips(redis_tier(redis_server.url), trips=1)


@pytest.mark.redis
def test_redis_failure_mid_batch_never_tears_a_chunk(redis_server):  # noqa: F811
    redis_failure_mid_batch(redis_tier(redis_server.url), fail_at=1)


class LosingOnePart:
    """A client whose pipelines send part 0 of ``victim`` under another name: the part is not
    there when its chunk is to be published (as a server that evicted it at once)."""

    def __init__(self, client, victim: bytes) -> None:
        self._c, self.victim = client, victim.hex()

    def pipeline(self, *a, **kw):
        pipe, victim = self._c.pipeline(*a, **kw), self.victim
        real_set = pipe.set

        def set_(name, value, **skw):
            lost = ":" in name and name.split(":")[1] == victim and name.endswith(":0")
            return real_set(name + ":elsewhere" if lost else name, value, **skw)

        pipe.set = set_
        return pipe

    def __getattr__(self, name):
        return getattr(self._c, name)


@pytest.mark.redis
def test_redis_a_part_missing_at_publish_fails_only_its_chunk(redis_server):  # noqa: F811
    tier = redis_tier(redis_server.url)
    chunks = [chunk(400 + i, 4096 * 3 + 5) for i in range(4)]
    tier.client = LosingOnePart(tier.client, chunks[2][0])
    assert tier.put_many(chunks) == [True, True, False, True]
    assert intact_or_miss(tier, chunks) == [True, True, False, True]
    assert tier.stats()["errors_error"] == 1
    stray = [k for k in tier.client.keys("*") if k.endswith(b":elsewhere")]
    assert len(stray) == 1  # only the misrouted part: the chunk's other parts were removed
    assert tier.client.dbsize() == keys_of(tier, chunks[:2] + chunks[3:]) + 1


@pytest.mark.redis
def test_redis_put_sends_the_payload_from_the_callers_memory(redis_server):  # noqa: F811
    tier = RedisTier(url=redis_server.url, timeout_s=10.0)  # the default parts: one a chunk
    payload = bytearray(os.urandom(8 * MIB))
    key = (77).to_bytes(16, "little")
    header = ChunkHeader.for_payload(key, payload, (len(payload),), "uint8", "flat")
    tracemalloc.start()
    try:
        assert tier.put(key, header, payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MIB  # no copy of the 8 MiB payload on its way to the socket
    assert bytes(tier.get(key).payload) == payload


@pytest.mark.redis
def test_redis_out_of_memory_mid_batch(redis_server):  # noqa: F811
    tier = redis_tier(redis_server.url)
    redis_server.cli("CONFIG", "SET", "maxmemory", str(tier.client.info("memory")["used_memory"] + 200_000))
    redis_server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
    chunks = [chunk(300 + i, 4096 * 3 if i % 2 else 3000) for i in range(40)]
    ok = tier.put_many(chunks)
    assert any(ok) and not all(ok) and tier.stats()["errors_full"] > 0
    assert intact_or_miss(tier, chunks) == ok
    assert tier.stats()["write_skipping"] == 0  # a full server is not a dead one
    stored = [c for c, good in zip(chunks, ok, strict=True) if good]
    assert tier.client.dbsize() == keys_of(tier, stored)  # a refused chunk left no part behind


@pytest.mark.redis
def test_cluster_put_many_contains_many_and_failure_mid_batch(redis_cluster):  # noqa: F811
    tier = redis_tier(redis_cluster.url, cluster=True)
    redis_round_trips(tier, trips=2)  # parts, then manifests: a pipeline keeps no order between nodes
    sizes = [int(node.cli("DBSIZE")) for node in redis_cluster.nodes]
    assert all(n > 0 for n in sizes), sizes  # the batch's chunks and parts spread over every master
    for fail_at in (1, 2):  # the parts' round trip, the manifests'
        for node in redis_cluster.nodes:
            node.cli("FLUSHALL")
        redis_failure_mid_batch(tier, fail_at)
    tier.close()


@pytest.mark.redis
def test_a_kvstore_lookup_over_redis_is_one_round_trip(redis_server):  # noqa: F811
    tier = redis_tier(redis_server.url)
    r = Rig(tiers=[tier])
    try:
        a = toks(11, 6 * CT)
        assert r.store.save(a, range(12), after=r.write(a, range(12))).wait_durable(5)
        assert r.store.evict() == 6
        tier.client = Counting(tier.client)
        assert r.store.lookup(a) == (6 * CT, ("redis",) * 6)
        assert tier.client.trips == 1
        b = a[: 3 * CT] + toks(12, 3 * CT)  # a prefix hit, then a miss
        assert r.store.lookup(b) == (3 * CT, ("redis",) * 3) and tier.client.trips == 2
    finally:
        r.close()


def test_writer_batches_write_through_pushes_and_waits_exactly(tmp_path):
    calls = []

    class Recording(DiskTier):
        def put_many(self, items):
            items = list(items)
            calls.append(len(items))
            return super().put_many(items)

    tier = Recording(tmp_path, 4 * MIB)
    r = Rig(tiers=[tier])
    try:
        a = toks(13, 8 * CT)
        h = r.store.save(a, range(16), after=r.write(a, range(16)))
        assert h.wait_durable(10) and sum(calls) == 8 and tier.stats()["puts"] == 8
        assert contains_many(tier, r.store.keys(a)) == [True] * 8
        assert put_many(tier, [chunk(1)]) == [True]
    finally:
        r.close()
