"""KVStore on SimDevice (copies land late, sanitizer on): hit / miss / partial prefix, skips,
isolation, per-layer readiness, eviction never under a transfer, policies, stats, bad arguments.

`Rig` is shared with the other test_kvstore* modules: KV content is a function of the token
prefix (as real KV is), so every loaded byte can be checked against what any save wrote.
"""

import threading
import time
from functools import lru_cache

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_, random_cache, scatter_ref
from kvtier.store import KVStore
from kvtier.store.config import StoreConfig

L, NB, BS, H, D = 2, 96, 4, 2, 8
CT = 8  # tokens per chunk: two blocks
BPC = CT // BS
DT = torch.float16


class Rig:
    """A simulated GPU cache of NB blocks, an engine (sanitizer on) and a KVStore over it."""

    def __init__(self, tiers=(), pool_chunks=16, delay=(0.0, 0.002), fmt="vllm_flash", model="m", **options):
        self.dev = SimDevice(copy_delay=delay, launch_delay=delay, seed=7)
        self.kv = random_cache(fmt, L, NB, BS, H, D, DT, seed=1)
        self.chunk_nbytes = self.kv.chunk_nbytes(BPC)
        self.pool = PinnedPool(self.dev, pool_chunks * self.chunk_nbytes)
        config = EngineConfig(sanitize=True, staging_bytes=4 * self.chunk_nbytes)
        self.eng = TransferEngine(self.dev, self.kv, self.pool, config)
        options.setdefault("chunk_tokens", CT)
        self.store = KVStore(self.eng, model, tiers=list(tiers), **options)
        self.compute = self.dev.current_stream()

    def write(self, tokens, blocks):
        """Compute writes the KV of ``tokens`` into ``blocks`` (late); returns its event."""
        n = len(tokens) // CT
        want = expected(tuple(tokens), n).view(DT).view(self.kv.chunk_shape(n * BPC))
        ids = list(blocks[: n * BPC])
        self.dev.launch(lambda: scatter_ref(self.kv, ids, want), self.compute)
        return self.compute.record("e_compute")

    def check(self, tokens, blocks, n_chunks) -> bool:
        """The first n_chunks chunks of ``blocks`` hold the KV of ``tokens``."""
        if n_chunks == 0:
            return True
        got = gather_ref(self.kv, list(blocks[: n_chunks * BPC]))
        return bits_equal(got.view(torch.uint8).reshape(-1), expected(tuple(tokens), n_chunks))

    def poison(self, blocks):
        ids = list(blocks)
        for x in self.kv.layers:
            x[:, ids] = poison_(torch.empty_like(x[:, ids]))  # indexing copies: assign the pattern

    def close(self):
        self.store.close()
        self.eng.close()
        assert self.pool.stats().used == 0  # every slot went back
        self.dev.close()


@lru_cache(maxsize=4096)
def chunk_bytes(prefix: tuple) -> torch.Tensor:
    """The KV bytes of the last chunk of ``prefix`` (a function of the whole prefix)."""
    g = torch.Generator().manual_seed(hash(prefix) & (2**62 - 1))
    n = BPC * L * 2 * BS * H * D * DT.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def expected(tokens: tuple, n_chunks: int) -> torch.Tensor:
    return torch.cat([chunk_bytes(tokens[: (i + 1) * CT]) for i in range(n_chunks)])


def toks(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def test_round_trip_lookup_and_partial_trailing_chunk(rig):
    tokens = toks(1, 3 * CT + 5)  # 3 full chunks; the trailing 5 tokens are never keyed
    assert rig.store.lookup(tokens) == (0, ())
    assert rig.store.load(tokens, range(40, 56)).tokens == 0  # a cold miss loads nothing
    h = rig.store.save(tokens, range(0, 8), after=rig.write(tokens, range(0, 8)))
    assert (h.tokens, h.saved, h.skipped, h.failed) == (3 * CT, 3, 0, 0) and len(h.events) == 3
    assert h.wait(5)
    assert rig.store.lookup(tokens) == (3 * CT, ("host",) * 3)
    rig.poison(range(40, 56))
    lh = rig.store.load(tokens, range(40, 56))
    assert (lh.tokens, lh.tiers) == (3 * CT, ("host",) * 3)
    assert lh.wait(5) and rig.check(tokens, range(40, 56), 3)
    s = rig.store.stats()
    assert s["host"]["hits"] == 3 and s["host"]["pinned_bytes"] == 0 and s["store"]["inflight"] == 0


def test_partial_prefix_hits_and_a_gap_ends_the_prefix(rig):
    a = toks(2, 4 * CT)
    rig.store.save(a, range(8), after=rig.write(a, range(8))).wait(5)
    b = a[: 2 * CT] + toks(3, 2 * CT)  # shares two chunks, then diverges
    assert rig.store.lookup(b).tokens == 2 * CT
    assert rig.store.lookup(toks(4, 1) + a[1:]).tokens == 0  # one token differs: nothing matches
    rig.store.evict(a[: 2 * CT])  # drop chunks 0 and 1 from the host: 2 and 3 are useless now
    assert rig.store.lookup(a).tokens == 0
    rig.store.save(a[:CT], range(8), after=rig.write(a, range(8))).wait(5)
    assert rig.store.lookup(a) == (CT, ("host",))  # chunk 1 missing: 2 and 3 are not reported
    rig.poison(range(20, 28))
    lh = rig.store.load(a, range(20, 28))
    assert lh.tokens == CT and lh.wait(5) and rig.check(a, range(20, 28), 1)
    assert rig.check(a, range(20, 28), 0)
    rest = rig.kv.layers[0][:, 22:28].reshape(-1).view(torch.uint8)
    assert bool((rest == 0xA5).all())  # blocks past the delivered prefix were not touched


def test_save_skips_chunks_already_stored_and_load_fits_the_blocks_given(rig):
    a = toks(5, 2 * CT)
    assert rig.store.save(a, range(4), after=rig.write(a, range(4))).saved == 2
    again = rig.store.save(a, range(4, 8))  # stored or being stored: no copy at all
    assert (again.saved, again.skipped, again.tokens, again.jobs) == (0, 2, 2 * CT, [])
    longer = a + toks(6, CT)
    h = rig.store.save(longer, range(6), after=rig.write(longer, range(6)))
    assert (h.saved, h.skipped, h.tokens) == (1, 2, 3 * CT) and h.wait(5)
    lh = rig.store.load(longer, range(30, 34))  # blocks for two chunks only
    assert lh.tokens == 2 * CT and lh.wait(5) and rig.check(longer, range(30, 34), 2)


def test_save_waits_for_the_compute_event():
    r = Rig(delay=0.0)
    try:
        r.dev.launch_delay = 0.1  # the compute "kernel" writing the KV lands late
        a = toks(7, 2 * CT)
        ev = r.write(a, range(4))
        h = r.store.save(a, range(4), after=ev)
        r.dev.launch_delay = 0.0
        assert h.wait(5) and r.store.load(a, range(50, 54)).wait(5)
        assert r.check(a, range(50, 54), 2)  # not the stale KV that was there before
    finally:
        r.close()


def test_wait_layer_orders_compute_after_each_layer(rig):
    a = toks(8, 2 * CT)
    rig.store.save(a, range(4), after=rig.write(a, range(4))).wait(5)
    rig.poison(range(60, 64))
    lh = rig.store.load(a, range(60, 64), per_layer=True)
    seen = []
    for layer in range(L):
        lh.wait_layer(layer, rig.compute)  # attention of this layer must follow its bytes
        rig.dev.launch(lambda layer=layer: seen.append(rig.kv.layers[layer][:, 60:64].clone()), rig.compute)
    rig.compute.synchronize()
    want = expected(tuple(a), 2).view(DT).view(rig.kv.chunk_shape(4))
    for layer in range(L):
        assert bits_equal(seen[layer].transpose(0, 1).contiguous(), want[:, layer].contiguous())
    assert lh.wait(5)
    with pytest.raises(ValueError, match="layer"):
        lh.wait_layer(L, rig.compute)


def test_nothing_is_evicted_while_a_load_reads_it():
    r = Rig(delay=0.0, host_capacity_bytes=4 * 1024, pool_chunks=8)
    try:
        a = toks(9, 3 * CT)
        r.store.save(a, range(6), after=r.write(a, range(6))).wait(5)
        r.dev.copy_delay = 0.15  # the load's copies are slow: its three slots stay in flight
        lh = r.store.load(a, range(40, 46))
        assert lh.tokens == 3 * CT and not lh.done()
        assert r.store.evict() == 0  # all three are pinned by the load
        b = toks(10, 2 * CT)
        r.dev.copy_delay = 0.0
        h = r.store.save(b, range(10, 14), after=r.write(b, range(10, 14)))
        assert (h.saved, h.failed) == (1, 1)  # one chunk of room; the pinned ones are not victims
        assert h.wait(5) and lh.wait(5) and r.check(a, range(40, 46), 3)
        assert r.store.stats()["host"]["pinned_bytes"] == 0
        assert r.store.evict() == 4  # unpinned once their loads completed
    finally:
        r.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_host_capacity_and_policy(policy):
    r = Rig(host_capacity_bytes=3 * 1024, host_policy=policy)
    try:
        seqs = [toks(20 + i, CT) for i in range(5)]
        for i, s in enumerate(seqs):
            r.store.save(s, range(2 * i, 2 * i + 2), after=r.write(s, range(2 * i, 2 * i + 2))).wait(5)
            if i == 2:
                assert r.store.load(seqs[0], range(80, 82)).wait(5)  # a hit: seqs[0] is recent/frequent
        held = [r.store.lookup(s).tokens == CT for s in seqs]
        assert sum(held) == 3 and held[0] and held[4]  # capacity in bytes; the hot chunk stays
        s = r.store.stats()["host"]
        assert s["evictions"] == 2 and s["used_bytes"] == 3 * 1024 <= s["capacity_bytes"]
    finally:
        r.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_save_longer_than_the_host_keeps_its_head(policy):
    """Five chunks into a host of three: the save keeps chunks 0-2 (what a lookup can use) and
    counts 3-4 as failed; evicting its own first chunks for its last would leave no prefix."""
    r = Rig(delay=0.0, host_capacity_bytes=3 * 1024, host_policy=policy)

    class Slow:  # the engine, each save 20 ms late: the chunks before it have landed and been reaped
        def __init__(self, eng):
            self._eng = eng

        def __getattr__(self, name):
            return getattr(self._eng, name)

        def save(self, *args, **kwargs):
            time.sleep(0.02)
            return self._eng.save(*args, **kwargs)

    r.store.close()
    r.store = KVStore(Slow(r.eng), "m", chunk_tokens=CT, host_capacity_bytes=3 * 1024, host_policy=policy)
    try:
        old = toks(30, CT)
        assert r.store.save(old, range(0, 2), after=r.write(old, range(0, 2))).wait(5)
        s = toks(31, 5 * CT)
        h = r.store.save(s, range(10, 20), after=r.write(s, range(10, 20)))
        assert h.wait(5) and (h.saved, h.failed, h.tokens) == (3, 2, 3 * CT)
        assert r.store.lookup(s).tokens == 3 * CT  # the head of the prefix is held
        assert r.store.lookup(old).tokens == 0  # an older request's chunk made room first
        r.poison(range(40, 46))
        assert r.store.load(s, range(40, 46)).wait(5) and r.check(s, range(40, 46), 3)
        assert r.store.stats()["host"]["pinned_bytes"] == 0  # the save's own pins are gone
        later = toks(32, CT)  # and its chunks are evictable again like any other
        assert r.store.save(later, range(60, 62), after=r.write(later, range(60, 62))).wait(5)
        assert r.store.lookup(later).tokens == CT
    finally:
        r.close()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_longer_save_does_not_evict_the_head_held_already(policy):
    """Chunks 0-2 held from an earlier request; a save of 0-4 into a host of three keeps them
    (skipped, held for the save's duration) and fails 3-4, instead of evicting its own head."""
    r = Rig(host_capacity_bytes=3 * 1024, host_policy=policy)
    try:
        s = toks(33, 5 * CT)
        assert r.store.save(s[: 3 * CT], range(0, 6), after=r.write(s[: 3 * CT], range(0, 6))).wait(5)
        h = r.store.save(s, range(10, 20), after=r.write(s, range(10, 20)))
        assert h.wait(5) and (h.skipped, h.saved, h.failed) == (3, 0, 2)
        assert r.store.lookup(s).tokens == 3 * CT
        assert r.store.stats()["host"]["pinned_bytes"] == 0  # the save's holds are gone
    finally:
        r.close()


def test_concurrent_saves_of_one_prefix_copy_it_once(rig):
    a = toks(11, 3 * CT)
    ev = rig.write(a, range(6))
    handles, start = [], threading.Barrier(4)

    def go():
        start.wait()
        handles.append(rig.store.save(a, range(6), after=ev))

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(h.saved for h in handles) == 3 and sum(h.skipped for h in handles) == 9
    assert all(h.wait(5) for h in handles)
    lh = rig.store.load(a, range(70, 76))  # waits for chunks another request is still saving
    assert lh.tokens == 3 * CT and lh.wait(5) and rig.check(a, range(70, 76), 3)


def test_stats_and_prometheus_export(rig):
    a = toks(12, 2 * CT)
    rig.store.save(a, range(4), after=rig.write(a, range(4))).wait(5)
    rig.store.load(a, range(10, 14)).wait(5)
    rig.store.lookup(a)
    s = rig.store.stats()
    assert s["store"]["saves"] == 1 and s["store"]["load_tokens"] == 2 * CT
    assert s["store"]["load_chunks_host"] == 2 and s["store"]["lookup_tokens"] == 2 * CT
    assert s["pool"]["used"] == 2 * 1024 and s["pool"]["in_flight"] == 0
    assert s["host"]["entries"] == 2 and s["host"]["bytes_read"] == 2 * 1024
    text = rig.store.metrics.text().decode()
    assert 'kvtier_tier_lookups_total{result="hit",tier="host"} 2.0' in text
    assert 'kvtier_store_events_total{event="load_tokens"} 16.0' in text
    assert 'kvtier_pool_bytes{state="used"} 2048.0' in text
    assert 'kvtier_store_call_seconds_count{op="load"} 1.0' in text


def test_host_occupancy_is_read_when_scraped(rig):
    """The host tier's occupancy gauges are read at scrape time (not set on every change): a
    scrape right after a save, with no stats() call between, sees its chunks."""
    a = toks(14, 3 * CT)
    before = rig.store.metrics.text().decode()
    assert 'kvtier_tier_entries{tier="host"} 0.0' in before
    rig.store.save(a, range(6), after=rig.write(a, range(6))).wait(5)
    text = rig.store.metrics.text().decode()
    assert 'kvtier_tier_entries{tier="host"} 3.0' in text
    assert 'kvtier_tier_used_bytes{tier="host"} 3072.0' in text
    assert rig.store.stats()["host"]["entries"] == 3 and rig.store.evict() == 3
    assert 'kvtier_tier_entries{tier="host"} 0.0' in rig.store.metrics.text().decode()


def test_bad_arguments_raise_value_errors_naming_them(rig):
    a = toks(13, 2 * CT)
    with pytest.raises(ValueError, match="block_ids"):
        rig.store.save(a, range(3))  # two chunks need four blocks
    with pytest.raises(ValueError, match="block_ids"):
        rig.store.save(a, [0, 1, 2, NB])
    with pytest.raises(ValueError, match="block_ids"):
        rig.store.load(a, [0, 1, 1, 2])
    with pytest.raises(ValueError, match="block_ids"):
        rig.store.load(a, [[0, 1]])
    with pytest.raises(ValueError, match="tokens"):
        rig.store.lookup([1, -2, 3])
    with pytest.raises(ValueError, match="chunk_tokens"):
        KVStore(rig.eng, "m", chunk_tokens=6)
    with pytest.raises(ValueError, match="write_policy"):
        StoreConfig(write_policy="sometimes")
    with pytest.raises(ValueError, match="host_capacity_bytes"):
        KVStore(rig.eng, "m", chunk_tokens=CT, host_capacity_bytes=10**9)
    with pytest.raises(ValueError, match="config or options"):
        KVStore(rig.eng, "m", config=StoreConfig(), chunk_tokens=CT)
    assert rig.store.stats()["pool"]["used"] == 0  # nothing was reserved by the failed calls


def test_closed_store_refuses_calls():
    r = Rig()
    a = toks(14, CT)
    r.store.save(a, range(2), after=r.write(a, range(2)))  # still in flight at close
    r.close()  # waits for the copy, then gives every slot back
    with pytest.raises(RuntimeError, match="closed"):
        r.store.lookup(a)


def test_load_timeout_keeps_the_slot_pinned(rig):
    a = toks(15, CT)
    rig.store.save(a, range(2), after=rig.write(a, range(2))).wait(5)
    rig.dev.copy_delay = 0.3
    lh = rig.store.load(a, range(30, 32))
    t0 = time.monotonic()
    assert not lh.wait(0.01) and time.monotonic() - t0 < 0.2  # a timeout releases nothing
    assert rig.store.stats()["host"]["pinned_bytes"] == 1024
    assert rig.store.evict() == 0
    assert lh.wait(5) and rig.store.stats()["host"]["pinned_bytes"] == 0


def test_delete_while_saving_or_loading_drops_the_chunk_after_the_transfer(rig):
    a = toks(16, CT)
    rig.dev.copy_delay = 0.1
    h = rig.store.save(a, range(2), after=rig.write(a, range(2)))
    assert rig.store.host.delete(rig.store.keys(a)[0])  # pending: dropped once its copy landed
    assert h.wait(5) and rig.store.lookup(a).tokens == 0
    assert rig.store.stats()["pool"]["used"] == 0  # its slot went back once the copy landed
    rig.dev.copy_delay = 0.0
    rig.store.save(a, range(2), after=rig.write(a, range(2))).wait(5)
    rig.dev.copy_delay = 0.1
    lh = rig.store.load(a, range(40, 42))
    assert rig.store.host.delete(rig.store.keys(a)[0])  # pinned by the load: dropped after it
    assert rig.store.lookup(a).tokens == 0 and rig.store.stats()["pool"]["used"] == 1024
    assert lh.wait(5) and rig.check(a, range(40, 42), 1)
    assert rig.store.stats()["pool"]["used"] == 0  # the slot went back once e_load completed
