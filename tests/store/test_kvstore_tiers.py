"""KVStore over lower tiers: write-through / write-back, promotion, prefetch, disk restart,
corrupt and foreign chunks, failing tiers, and Redis killed mid-run — every load checked."""

import threading
import time

import pytest
import torch

from kvtier.store.disk import DiskTier
from kvtier.store.header import ChunkHeader
from kvtier.store.redis_tier import RedisTier

from store_redis_fixtures import redis_server  # noqa: F401  (a fixture)
from test_kvstore import CT, Rig, toks

MIB = 1 << 20


def disk(path, **kw):
    return DiskTier(path, kw.pop("capacity", MIB), fsync=False, **kw)


def test_write_through_then_load_from_disk_promotes_to_host(tmp_path):
    r = Rig(tiers=[disk(tmp_path)])
    try:
        a = toks(1, 3 * CT)
        h = r.store.save(a, range(6), after=r.write(a, range(6)))
        assert h.wait_durable(5) and r.store.tiers[0].stats()["puts"] == 3
        assert r.store.evict() == 3 and r.store.lookup(a) == (3 * CT, ("disk",) * 3)
        r.poison(range(40, 46))
        lh = r.store.load(a, range(40, 46))
        assert lh.tiers == ("disk",) * 3 and lh.wait(5) and r.check(a, range(40, 46), 3)
        assert r.store.lookup(a).tiers == ("host",) * 3  # promoted on the hit
        assert r.store.stats()["store"]["promoted"] == 3
        assert lh.done() and r.store.evict(a, lower=True) == 3  # from every tier
        assert r.store.lookup(a).tokens == 0 and r.store.tiers[0].stats()["entries"] == 0
    finally:
        r.close()


def test_a_load_of_the_host_alone_reads_no_tier_and_fetch_reads_into_the_host(tmp_path):
    tier = disk(tmp_path)
    r = Rig(tiers=[tier])
    try:
        a = toks(7, 3 * CT)
        assert r.store.save(a, range(6), after=r.write(a, range(6))).wait_durable(5)
        assert r.store.evict() == 3  # the disk alone holds them
        reads = tier.stats()["hits"]
        lh = r.store.load(a, range(40, 46), lower=False)  # what a serving step may load: no disk read
        assert lh.tokens == 0 and tier.stats()["hits"] == reads
        assert r.store.fetch(a) == 3 * CT and tier.stats()["hits"] == reads + 3  # on this thread
        r.poison(range(40, 46))
        lh = r.store.load(a, range(40, 46), lower=False)
        assert lh.tiers == ("disk",) * 3 and lh.wait(5) and r.check(a, range(40, 46), 3)
        assert tier.stats()["hits"] == reads + 3  # the load read the host: counted as the disk's hits
    finally:
        r.close()


def test_write_back_spills_on_eviction_and_flushes_on_close(tmp_path):
    tier = disk(tmp_path)
    r = Rig(tiers=[tier], write_policy="write_back", host_capacity_bytes=2 * 1024)
    a, b = toks(2, 2 * CT), toks(3, 2 * CT)
    r.store.save(a, range(4), after=r.write(a, range(4))).wait(5)
    assert tier.stats()["puts"] == 0 and r.store.stats()["host"]["dirty"] == 2  # nothing written yet
    r.store.save(b, range(4, 8), after=r.write(b, range(4, 8))).wait(5)  # evicts a's chunks
    assert r.store.flush(5) and tier.stats()["puts"] == 2 and r.store.stats()["store"]["spills"] == 2
    assert r.store.lookup(a).tiers == ("disk", "disk")
    lh = r.store.load(a, range(50, 54))  # back from disk, clean now: evicting it spills nothing
    assert lh.wait(5) and r.check(a, range(50, 54), 2)
    r.close()  # b's dirty chunks are written on close (the host evicted b for a)
    assert tier.stats()["puts"] == 4 and set(tier.resident_keys()) >= set(r.store.keys(b))


def test_disk_chunks_survive_a_restart(tmp_path):
    r = Rig(tiers=[disk(tmp_path)])
    a = toks(4, 4 * CT)
    assert r.store.save(a, range(8), after=r.write(a, range(8))).wait_durable(5)
    r.close()
    r.store.tiers[0].close()  # the folder's writer is done: another may take it
    r2 = Rig(tiers=[disk(tmp_path)])  # a new process: new device, engine, pool, index scan
    try:
        assert r2.store.lookup(a) == (4 * CT, ("disk",) * 4)
        r2.poison(range(60, 68))
        lh = r2.store.load(a, range(60, 68))
        assert lh.tokens == 4 * CT and lh.wait(5) and r2.check(a, range(60, 68), 4)
    finally:
        r2.close()


def test_model_and_layout_isolation_and_foreign_headers(tmp_path):
    r = Rig(tiers=[disk(tmp_path)])
    a = toks(5, 2 * CT)
    assert r.store.save(a, range(4), after=r.write(a, range(4))).wait_durable(5)
    key0 = r.store.keys(a)[0]
    r.close()
    r.store.tiers[0].close()  # each rig below is the folder's next writer
    other = Rig(tiers=[disk(tmp_path)], model="another-model")
    assert other.store.lookup(a).tokens == 0
    other.close()
    other.store.tiers[0].close()
    hnd = Rig(tiers=[disk(tmp_path)], fmt="flashinfer_hnd")  # same sizes, other chunk bytes
    assert hnd.store.lookup(a).tokens == 0
    hnd.close()
    # A chunk of another shape under a key this store computes (a bug or a forged file): a miss.
    r2 = Rig(tiers=[disk(tmp_path / "x")])
    try:
        key = r2.store.keys(a)[0]
        assert key == key0
        payload = torch.zeros(r2.chunk_nbytes, dtype=torch.uint8)
        header = ChunkHeader.for_payload(key, payload, (r2.chunk_nbytes,), "uint8", "flat")
        assert r2.store.tiers[0].put(key, header, payload)
        assert r2.store.lookup(a).tokens == CT  # contains() is a hint
        lh = r2.store.load(a, range(10, 14))
        assert lh.tokens == 0 and r2.store.stats()["store"]["header_mismatches"] == 1
        big = torch.zeros(r2.chunk_nbytes + 512, dtype=torch.uint8)  # does not even fit a slot
        assert r2.store.tiers[0].delete(key)
        assert r2.store.tiers[0].put(
            key, ChunkHeader.for_payload(key, big, (len(big),), "uint8", "flat"), big
        )
        assert r2.store.load(a, range(10, 14)).tokens == 0
        assert r2.store.stats()["store"]["header_mismatches"] == 2 and r2.store.stats()["pool"]["used"] == 0
    finally:
        r2.close()


def test_corrupt_disk_chunk_ends_the_load_there(tmp_path):
    r = Rig(tiers=[disk(tmp_path)])
    try:
        a = toks(6, 3 * CT)
        assert r.store.save(a, range(6), after=r.write(a, range(6))).wait_durable(5)
        r.store.evict()
        path = next(p for p in tmp_path.rglob("*") if r.store.keys(a)[1].hex() in p.name)
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF  # one flipped payload bit
        path.write_bytes(bytes(data))
        lh = r.store.load(a, range(20, 26))
        assert lh.tokens == CT and lh.wait(5) and r.check(a, range(20, 26), 1)
        assert r.store.stats()["disk"]["errors_corrupt"] == 1
    finally:
        r.close()


def test_prefetch_brings_disk_chunks_into_the_host(tmp_path):
    r = Rig(tiers=[disk(tmp_path)])
    try:
        a = toks(7, 3 * CT)
        assert r.store.save(a, range(6), after=r.write(a, range(6))).wait_durable(5)
        r.store.evict()
        assert r.store.prefetch(a + toks(8, CT)).result(5) == 3 * CT  # stops at the first miss
        assert r.store.lookup(a).tiers == ("host",) * 3
        lh = r.store.load(a, range(30, 36))
        assert lh.tiers == ("host",) * 3 and lh.wait(5) and r.check(a, range(30, 36), 3)
    finally:
        r.close()


def test_without_promotion_reads_use_temporary_slots(tmp_path):
    r = Rig(tiers=[disk(tmp_path)], promote=False)
    try:
        a = toks(9, 2 * CT)
        assert r.store.save(a, range(4), after=r.write(a, range(4))).wait_durable(5)
        r.store.evict()
        lh = r.store.load(a, range(30, 34))
        assert lh.tiers == ("disk", "disk") and lh.wait(5) and r.check(a, range(30, 34), 2)
        assert r.store.lookup(a).tiers == ("disk", "disk")
        assert r.store.stats()["pool"]["used"] == 0  # the temporary slots went back after the load
    finally:
        r.close()


class Broken:
    """A tier that fails every way a tier can: raises, or returns garbage, never a chunk."""

    name = "broken"

    def put(self, key, header, payload):
        raise OSError("disk on fire")

    def get(self, key):
        raise TimeoutError

    def get_into(self, key, dest):
        raise OSError("EIO")

    def contains(self, key):
        return True

    def delete(self, key):
        raise OSError

    def stats(self):
        raise RuntimeError

    def close(self):
        pass


def test_a_failing_tier_is_a_miss_never_an_exception(tmp_path):
    r = Rig(tiers=[Broken(), disk(tmp_path)])
    try:
        a = toks(10, 2 * CT)
        h = r.store.save(a, range(4), after=r.write(a, range(4)))
        assert not h.wait_durable(5)  # the broken tier did not store them; disk did
        assert r.store.tiers[1].stats()["puts"] == 2
        r.store.evict(a, lower=True)  # delete raising in one tier is logged, not raised
        assert r.store.lookup(a).tiers == ("broken",) * 2  # its contains() lies
        assert r.store.load(a, range(40, 44)).tokens == 0
        s = r.store.stats()
        assert "broken" not in s and s["store"]["read_failures"] == 1
    finally:
        r.close()


@pytest.mark.redis
def test_redis_promotes_to_disk_and_host_and_survives_being_killed(tmp_path, redis_server):  # noqa: F811
    def redis_tier():
        return RedisTier(url=redis_server.url, timeout_s=0.3, failure_threshold=2, cooldown_s=0.2)

    d = disk(tmp_path / "disk")  # tmp_path holds the Redis server's files
    r = Rig(tiers=[d, redis_tier()])
    try:
        a, b = toks(11, 2 * CT), toks(12, 2 * CT)
        assert r.store.save(a, range(4), after=r.write(a, range(4))).wait_durable(5)
        r.store.evict()
        for key in r.store.keys(a):
            d.delete(key)  # only Redis holds a now (another host saved it)
        assert r.store.lookup(a).tiers == ("redis", "redis")
        lh = r.store.load(a, range(40, 44))
        assert lh.tiers == ("redis", "redis") and lh.wait(5) and r.check(a, range(40, 44), 2)
        assert r.store.flush(5) and all(d.contains(k) for k in r.store.keys(a))  # copied up to disk
        r.store.evict()
        redis_server.kill()  # mid-run: saves still work on host + disk, nothing raises
        h = r.store.save(b, range(8, 12), after=r.write(b, range(8, 12)))
        assert not h.wait_durable(5) and all(d.contains(k) for k in r.store.keys(b))
        r.store.evict(b)
        for key in r.store.keys(b):
            d.delete(key)
        assert r.store.load(b, range(50, 54)).tokens == 0  # a miss: the caller recomputes
        lh = r.store.load(a, range(50, 54))  # disk still serves a
        assert lh.tiers == ("disk", "disk") and lh.wait(5) and r.check(a, range(50, 54), 2)
        errors = r.store.stats()["redis"]
        assert errors["put_failures"] >= 1 and errors["errors_error"] + errors["errors_timeout"] >= 1
        redis_server.start()  # back (empty): after the cooldown the tier is used again
        r.store.tiers[1].client.connection_pool.disconnect()
        c = toks(13, CT)
        for _ in range(50):
            h = r.store.save(c, range(16, 18), after=r.write(c, range(16, 18)))
            if h.wait_durable(5):
                break
            r.store.evict(c)
            time.sleep(0.05)  # the breaker's cooldown: the next put probes the server again
        assert r.store.tiers[1].contains(r.store.keys(c)[0])
    finally:
        r.close()


class Slow:
    """Wraps a tier: every read takes 30 ms; records how many reads ran at once."""

    def __init__(self, inner):
        self.inner, self.name = inner, "slow"
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def get_into(self, key, dest):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.03)  # a remote round trip
        try:
            return self.inner.get_into(key, dest)
        finally:
            with self.lock:
                self.now -= 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("depth", [0, 4])
def test_read_ahead_overlaps_lower_tier_reads(tmp_path, depth):
    slow = Slow(disk(tmp_path))
    r = Rig(tiers=[slow], read_ahead=depth, prefetch_workers=3)
    try:
        a = toks(14, 6 * CT)
        assert r.store.save(a, range(12), after=r.write(a, range(12))).wait_durable(5)
        r.store.evict()
        r.poison(range(40, 52))
        lh = r.store.load(a, range(40, 52))
        assert lh.tiers == ("slow",) * 6 and lh.wait(5) and r.check(a, range(40, 52), 6)
        assert (slow.most > 1) == (depth > 0)  # reads overlapped only with read-ahead
        assert r.store.stats()["store"].get("read_ahead_chunks", 0) == (5 if depth else 0)
    finally:
        r.close()


def test_the_store_measures_a_tiers_read_rate_over_overlapping_reads(tmp_path):
    """The rate a load sees: a tier behind a 50 kB/s link (ThrottledTier: one link, reads in
    order) read with read-ahead. Summing each read's own time would count the reads queued on
    the link several times over and report a fraction of the link's rate."""
    from kvtier.store.throttle import ThrottledTier

    link = ThrottledTier(disk(tmp_path), 0.00005, name="remote")
    r = Rig(tiers=[link], read_ahead=4, prefetch_workers=3)
    try:
        a = toks(15, 8 * CT)
        assert r.store.save(a, range(16), after=r.write(a, range(16))).wait_durable(5)
        assert r.store.read_rate.gbps("remote") is None  # nothing read from it yet
        r.store.evict()
        lh = r.store.load(a, range(40, 56))
        assert lh.tiers == ("remote",) * 8 and lh.wait(5) and r.check(a, range(40, 56), 8)
        rate = r.store.read_rate.gbps("remote")
        assert 0.5 * 0.00005 < rate <= 1.05 * 0.00005, rate
        assert r.store.stats()["remote"]["read_gbps"] == rate
    finally:
        r.close()
