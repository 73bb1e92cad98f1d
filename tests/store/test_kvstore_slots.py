"""KVStore.save / load submit a request's chunks together (issue #28): a save's new chunks in one
`engine.save_slots`, a load's host hits in one `engine.load_slots` (staged and batch paths), while
a lower tier's chunk is submitted as soon as the walk holds it, so the next chunk's read overlaps
its copy; with the lead on (`kvstore.LEAD_CHUNKS`, the default), a request's first chunks go in a
submission of their own first. Every loaded byte checked; failures give every pin and slot back."""

import pytest
import torch

from kvtier import layout
from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_blocks_
from kvtier.store import KVStore, kvstore
from kvtier.store.throttle import MemoryTier

from test_kvstore import CT, Rig, toks


@pytest.fixture(autouse=True)
def no_lead(request, monkeypatch):
    """A request's chunks in one submission (the lead off), but where a test asks for the lead."""
    if "lead" not in request.keywords:
        monkeypatch.setattr(kvstore, "LEAD_CHUNKS", 1 << 30)


class Calls:
    """Records the engine's submissions (and the lower tier's reads) in order, by name."""

    def __init__(self, monkeypatch, eng, tier=None):
        self.log = []
        for name in ("save", "save_slots", "load", "load_slots"):
            self._wrap(monkeypatch, eng, name)
        if tier is not None:
            self._wrap(monkeypatch, tier, "get_into")

    def _wrap(self, monkeypatch, obj, name):
        real = getattr(obj, name)

        def call(*args, **kwargs):
            n = len(args[0]) if name == "load_slots" else len(args[1]) if name == "save_slots" else 1
            self.log.append((name, n))
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, call)

    def names(self):
        return [name for name, _ in self.log]


def test_a_save_is_one_engine_call_and_a_host_load_is_one(monkeypatch):
    r = Rig()
    try:
        a = toks(1, 6 * CT)
        calls = Calls(monkeypatch, r.eng)
        h = r.store.save(a, range(12), after=r.write(a, range(12)))
        assert calls.log == [("save_slots", 6)] and h.saved == 6 and len(h.jobs) == 6
        assert len({id(j.slot) for j in h.jobs}) == 6  # a slot per chunk
        assert h.wait(5)
        calls.log.clear()
        r.poison(range(40, 52))
        lh = r.store.load(a, range(40, 52))
        assert calls.log == [("load_slots", 6)]  # six host hits, one engine call
        assert len(lh.jobs) == 6 and lh.tiers == ("host",) * 6
        assert lh.wait(5) and r.check(a, range(40, 52), 6)
        assert r.store.stats()["host"]["pinned_bytes"] == 0  # every pin dropped once e_load completed
        calls.log.clear()
        b = a[: 2 * CT] + toks(2, 3 * CT)  # two chunks held, three new
        h = r.store.save(b, range(20, 30), after=r.write(b, range(20, 30)))
        assert calls.log == [("save_slots", 3)] and (h.skipped, h.saved, h.tokens) == (2, 3, 5 * CT)
        assert h.wait(5)
    finally:
        r.close()


def test_a_save_with_held_chunks_in_between_saves_the_others_from_their_own_blocks(monkeypatch):
    r = Rig()
    try:
        a = toks(3, 5 * CT)
        assert r.store.save(a, range(10), after=r.write(a, range(10))).wait(5)
        keys = r.store.keys(a)
        for i in (0, 2, 4):
            assert r.store.host.delete(keys[i])  # chunks 0, 2, 4 to be saved again; 1, 3 held
        calls = Calls(monkeypatch, r.eng)
        r.write(a, range(30, 40))
        h = r.store.save(a, range(30, 40), after=r.compute.record())
        assert calls.log == [("save_slots", 3)] and (h.saved, h.skipped, h.tokens) == (3, 2, 5 * CT)
        assert [list(j.ids) for j in h.jobs] == [[30, 31], [34, 35], [38, 39]]
        assert h.wait(5)
        r.poison(range(50, 60))
        lh = r.store.load(a, range(50, 60))
        assert lh.wait(5) and r.check(a, range(50, 60), 5)
    finally:
        r.close()


def test_host_and_lower_tier_chunks_in_one_load(monkeypatch):
    """Chunks 0, 1 in the host, 2 and 3 only in a MemoryTier, 4 and 5 in the host: the host hits
    before a lower tier's chunk go with it, its read comes before the next chunk's, and the host
    hits after it go together at the end."""
    tier = MemoryTier()
    r = Rig(tiers=[tier], read_ahead=0)
    try:
        a = toks(4, 6 * CT)
        assert r.store.save(a, range(12), after=r.write(a, range(12))).wait_durable(5)
        keys = r.store.keys(a)
        for i in (2, 3):
            assert r.store.host.delete(keys[i])
        assert r.store.lookup(a).tiers == ("host", "host", "memory", "memory", "host", "host")
        calls = Calls(monkeypatch, r.eng, tier)
        r.poison(range(40, 52))
        lh = r.store.load(a, range(40, 52))
        assert calls.log == [
            ("get_into", 1),  # chunk 2 read...
            ("load_slots", 3),  # ...and submitted with the host hits before it
            ("get_into", 1),  # chunk 3 read while chunk 2's copy may run
            ("load", 1),
            ("load_slots", 2),  # chunks 4, 5 at the walk's end
        ]
        assert lh.tiers == ("host", "host", "memory", "memory", "host", "host") and len(lh.jobs) == 6
        assert lh.wait(5) and r.check(a, range(40, 52), 6)
        assert r.store.stats()["host"]["pinned_bytes"] == 0
    finally:
        r.close()


def test_a_load_through_temporary_slots_gives_them_back():
    """promote=False: lower-tier chunks come through temporary slots no index holds; mixed with
    host hits in one submission, each goes back to the pool once e_load completed."""
    tier = MemoryTier()
    r = Rig(tiers=[tier], promote=False)
    try:
        a = toks(5, 4 * CT)
        assert r.store.save(a, range(8), after=r.write(a, range(8))).wait_durable(5)
        assert r.store.host.delete(r.store.keys(a)[1])
        used = r.pool.stats().used
        r.poison(range(40, 48))
        lh = r.store.load(a, range(40, 48))
        assert lh.tiers == ("host", "memory", "host", "host")
        assert lh.wait(5) and r.check(a, range(40, 48), 4)
        r.store.stats()  # reaps
        assert r.pool.stats().used == used  # the temporary slot went back
        assert r.store.stats()["host"]["pinned_bytes"] == 0
    finally:
        r.close()


@pytest.mark.parametrize("fail_on", ["first", "last"])
def test_a_failed_submission_gives_every_fetched_chunk_back(monkeypatch, fail_on):
    """load_slots fails on the first submission (host hits with a lower tier's chunk) or the last
    (the host hits after it): every chunk fetched and not submitted is unpinned, a temporary slot
    goes back; what was submitted lands and is unpinned when it completed. No pin or slot leaks."""
    tier = MemoryTier()
    r = Rig(tiers=[tier], promote=False)
    try:
        a = toks(6, 5 * CT)
        assert r.store.save(a, range(10), after=r.write(a, range(10))).wait_durable(5)
        assert r.store.host.delete(r.store.keys(a)[2])
        used = r.pool.stats().used
        real, seen = r.eng.load_slots, []

        def flaky(slots, *args, **kwargs):
            seen.append(len(slots))
            if (fail_on == "first") == (len(seen) == 1):
                raise RuntimeError("submission failed")
            return real(slots, *args, **kwargs)

        monkeypatch.setattr(r.eng, "load_slots", flaky)
        with pytest.raises(RuntimeError, match="submission failed"):
            r.store.load(a, range(40, 50))
        assert seen == ([3] if fail_on == "first" else [3, 2])
        r.dev.synchronize()  # what was submitted has landed
        st = r.store.stats()
        assert st["host"]["pinned_bytes"] == 0 and st["store"]["inflight"] == 0
        assert r.pool.stats().used == used  # the temporary slot went back
        monkeypatch.undo()
        r.poison(range(40, 50))
        lh = r.store.load(a, range(40, 50))  # every chunk is still there, and loadable
        assert lh.wait(5) and r.check(a, range(40, 50), 5)
    finally:
        r.close()


def test_a_full_pool_ends_a_save_and_counts_the_rest_failed():
    r = Rig(pool_chunks=3, host_capacity_bytes=3 * 1024)
    try:
        a = toks(7, 5 * CT)
        h = r.store.save(a, range(10), after=r.write(a, range(10)))
        assert (h.saved, h.failed, h.tokens) == (3, 2, 3 * CT) and len(h.jobs) == 3
        assert h.wait(5)
        st = r.store.stats()
        assert st["store"]["save_chunks_failed"] == 2 and st["host"]["pending"] == 0
        assert r.store.lookup(a).tokens == 3 * CT  # the head was kept
        r.poison(range(40, 46))
        assert r.store.load(a, range(40, 50)).wait(5) and r.check(a, range(40, 46), 3)
        assert r.store.stats()["host"]["pinned_bytes"] == 0
    finally:
        r.close()


def test_a_pool_without_room_for_every_new_chunk_ends_the_save_there():
    """The host index has room for three chunks, the pool for two (a slot is taken outside the
    store): the engine saves two, the third entry is cancelled, and three chunks count as failed."""
    r = Rig(pool_chunks=3, host_capacity_bytes=3 * 1024)
    try:
        other = r.eng.save([90, 91], after=None)  # a slot the store does not know of
        assert other.wait(5)
        a = toks(10, 5 * CT)
        h = r.store.save(a, range(10), after=r.write(a, range(10)))
        assert (h.saved, h.failed, h.tokens) == (2, 3, 2 * CT) and h.wait(5)
        st = r.store.stats()
        assert st["store"]["save_chunks_failed"] == 3 and st["host"]["pending"] == 0
        assert st["host"]["pinned_bytes"] == 0 and r.store.lookup(a).tokens == 2 * CT
        r.eng.release(other.slot)
    finally:
        r.close()


def test_a_failed_save_submission_cancels_every_entry(monkeypatch):
    r = Rig()
    try:
        a = toks(8, 4 * CT)

        def broken(*args, **kwargs):
            raise RuntimeError("submission failed")

        monkeypatch.setattr(r.eng, "save_slots", broken)
        with pytest.raises(RuntimeError, match="submission failed"):
            r.store.save(a, range(8), after=r.write(a, range(8)))
        assert r.store.lookup(a).tokens == 0 and r.pool.stats().used == 0
        st = r.store.stats()["host"]
        assert st["pinned_bytes"] == 0 and st["pending"] == 0
        monkeypatch.undo()
        assert r.store.save(a, range(8), after=r.compute.record()).wait(5)
        assert r.store.lookup(a).tokens == 4 * CT
    finally:
        r.close()


# -- the batch path (a SimDevice emulating cudaMemcpyBatchAsync), vLLM's orders ---------------


def vllm_cache(order, L, B, H, N, C, dtype):
    """vLLM 0.33's per-layer views `[blocks, kv_heads, tokens, K||V]` of one buffer laid out in
    `order` (C: K and V elements per token and head), random values, as a PagedKV."""
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C}
    g = torch.Generator().manual_seed(5)
    buf = torch.randn([sizes[a] for a in order], generator=g).to(dtype)
    logical = buf.permute(*[order.index(a) for a in "LBHNC"])
    return layout.vllm_paged({f"model.layers.{i}.self_attn.attn": logical[i] for i in range(L)}, order)


@pytest.mark.parametrize("order", layout.VLLM_ORDERS)
def test_batch_store_round_trip_in_every_vllm_order(order, monkeypatch):
    L, B, H, N, D, per = 3, 40, 2, 4, 8, 2  # per: blocks per chunk
    kv = vllm_cache(order, L, B, H, N, 2 * D, torch.bfloat16)
    dev = SimDevice(batch_copy=True, copy_delay=(0.0, 0.003), seed=2)
    pool = PinnedPool(dev, 16 * kv.chunk_nbytes(per))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, path="batch"))
    store = KVStore(eng, "m", chunk_tokens=per * N)
    try:
        calls = Calls(monkeypatch, eng)
        tokens = toks(9, 5 * per * N)
        src, dst = list(range(0, 10)), [39, 12, 30, 14, 25, 16, 20, 18, 33, 11]
        want = gather_ref(kv, src)
        h = store.save(tokens, src, after=dev.current_stream().record())
        assert [j.path for j in h.jobs] == ["batch"] * 5 and h.wait(5)
        poison_blocks_(kv, dst)
        lh = store.load(tokens, dst)
        assert [j.path for j in lh.jobs] == ["batch"] * 5 and lh.wait(5)
        assert bits_equal(gather_ref(kv, dst), want)
        assert calls.names() == ["save_slots", "load_slots"]
        store.close()
        eng.close()
        assert pool.stats().used == 0
    finally:
        dev.close()


@pytest.mark.lead
def test_the_first_chunks_go_first_and_the_rest_in_one_more_call(monkeypatch):
    """The lead: the first LEAD_CHUNKS chunks' copies start while the host prepares the rest;
    held chunks count towards it; a request no longer than the lead is one call."""
    assert kvstore.LEAD_CHUNKS == 4
    r = Rig()
    try:
        a = toks(1, 6 * CT)
        calls = Calls(monkeypatch, r.eng)
        h = r.store.save(a, range(12), after=r.write(a, range(12)))
        assert calls.log == [("save_slots", 4), ("save_slots", 2)] and h.saved == 6 and h.tokens == 6 * CT
        assert h.wait(5)
        calls.log.clear()
        r.poison(range(40, 52))
        lh = r.store.load(a, range(40, 52))
        assert calls.log == [("load_slots", 4), ("load_slots", 2)] and lh.tiers == ("host",) * 6
        assert lh.wait(5) and r.check(a, range(40, 52), 6)
        calls.log.clear()
        b = a[: 2 * CT] + toks(2, 3 * CT)  # two held, three new: two of the lead's four are new
        h = r.store.save(b, range(20, 30), after=r.write(b, range(20, 30)))
        assert calls.log == [("save_slots", 2), ("save_slots", 1)] and (h.skipped, h.saved) == (2, 3)
        assert h.wait(5)
        calls.log.clear()
        c = toks(3, 4 * CT)
        assert r.store.save(c, range(30, 38), after=r.write(c, range(30, 38))).wait(5)
        assert calls.log == [("save_slots", 4)]
    finally:
        r.close()


@pytest.mark.lead
def test_a_full_pool_in_the_lead_ends_the_save_there(monkeypatch):
    r = Rig()
    try:
        a = toks(4, 6 * CT)
        real, left = r.eng.save_slots, [3]

        def short(block_ids, counts, **kw):  # the pool has room for three slots, then none
            n = min(len(counts), left[0])
            left[0] -= n
            return real(block_ids[: sum(counts[:n])], counts[:n], **kw) if n else []

        monkeypatch.setattr(r.eng, "save_slots", short)
        h = r.store.save(a, range(12), after=r.write(a, range(12)))
        assert (h.saved, h.failed, h.tokens) == (3, 3, 3 * CT)
        assert h.wait(5)
        assert r.store.lookup(a).tokens == 3 * CT  # the three saved chunks, held; nothing leaked
        assert r.store.stats()["host"]["pinned_bytes"] == 0
    finally:
        r.close()
