"""Randomized multi-threaded stress of KVStore (SimDevice, late copies, sanitizer on, a small
host tier over a small disk tier, so eviction, promotion and spills run all the time):
10,000 operations, every loaded byte checked against what the saves wrote, accounting
consistent at the end."""

import random
import threading
from collections import Counter

import pytest
import torch

from kvtier.lifecycle import SlotState
from kvtier.reference import gather_ref
from kvtier.store.disk import DiskTier
from kvtier.store.redis_tier import RedisTier

from store_redis_fixtures import redis_server  # noqa: F401  (a fixture)
from test_kvstore import BPC, CT, Rig, expected, toks

THREADS = 4
OPS_PER_THREAD = 2500  # 10,000 operations in all (write-through; write-back runs a quarter)
DISK_BYTES = 40 * 4096  # ~30 chunks of files: the disk tier evicts too
AREA = 24  # GPU blocks per thread: 12 to save from, 12 to load into
MAX_CHUNKS = AREA // 2 // BPC


def documents() -> list[list[int]]:
    """Requests share prefixes (a system prompt, then a document), as real traffic does."""
    roots = [toks(100 + i, 2 * CT) for i in range(3)]
    return [roots[j % 3] + toks(200 + j, (MAX_CHUNKS - 2) * CT) for j in range(12)]


def hammer(rig, docs, seed: int, ops: int, tally: Counter, wrong: list, errors: list) -> None:
    rng = random.Random(seed)
    base = seed * AREA
    save_area, load_area = list(range(base, base + AREA // 2)), list(range(base + AREA // 2, base + AREA))
    st = rig.store
    try:
        for _ in range(ops):
            doc = docs[min(int(rng.expovariate(1 / 3)), len(docs) - 1)]  # some documents are hot
            tokens = doc[: rng.randint(1, MAX_CHUNKS) * CT + rng.randrange(CT)]
            op = rng.random()
            if op < 0.3:
                h = st.save(tokens, save_area, after=rig.write(tokens, save_area))
                # The next compute write into save_area must follow these copies (stream order).
                h.wait_on(rig.compute)
                tally["save"] += 1
                tally["save_chunks"] += len(tokens) // CT
            elif op < 0.65:
                rig.poison(load_area)
                lh = st.load(tokens, load_area)
                n = lh.tokens // CT
                if rng.random() < 0.5:
                    got = []
                    for layer in range(rig.kv.num_layers):
                        lh.wait_layer(layer, rig.compute)  # the "attention" of this layer follows it
                    rig.dev.launch(
                        lambda n=n, got=got: got.append(gather_ref(rig.kv, load_area[: n * BPC])), rig.compute
                    )
                    rig.compute.record().synchronize()  # the host reads what compute produced
                    ok = n == 0 or got[0].view(torch.uint8).reshape(-1).equal(expected(tuple(tokens), n))
                    assert lh.wait(10)
                else:
                    assert lh.wait(10)  # the bytes are there only once every chunk's event completed
                    ok = rig.check(tokens, load_area, n)
                if not ok:
                    wrong.append((seed, len(tokens), n, lh.tiers))
                tally["load"] += 1
                tally["load_tokens"] += lh.tokens
            elif op < 0.8:
                st.lookup(tokens)
                tally["lookup"] += 1
            elif op < 0.87:
                fut = st.prefetch(tokens)
                if rng.random() < 0.3:
                    fut.result(10)
                tally["prefetch"] += 1
            elif op < 0.95:
                st.evict(tokens if rng.random() < 0.9 else None)
                tally["evict"] += 1
            else:
                st.stats()
                tally["stats"] += 1
    except Exception as exc:  # nothing may raise into the serving loop
        errors.append(exc)
        raise


def run(tiers, ops: int, **options) -> None:
    """THREADS threads of ``ops`` operations on one store over ``tiers``; checks everything."""
    rig = Rig(
        tiers=tiers,
        pool_chunks=24,
        host_capacity_bytes=14 * 1024,
        delay=(0.0, 0.0001),
        fetch_wait_s=0.2,
        alloc_timeout_s=0.05,
        **options,
    )
    docs = documents()
    tallies = [Counter() for _ in range(THREADS)]
    wrong, errors = [], []
    threads = [
        threading.Thread(target=hammer, args=(rig, docs, i, ops, tallies[i], wrong, errors))
        for i in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally = sum(tallies, Counter())
    try:
        assert errors == [] and wrong == []
        kinds = ("save", "load", "lookup", "prefetch", "evict", "stats")
        assert sum(tally[k] for k in kinds) == THREADS * ops
        st = rig.store
        rig.dev.synchronize()  # every copy submitted has landed
        assert st.flush(10)
        st.prefetch([]).result(10)  # the prefetch workers are idle: earlier prefetches finished
        s = st.stats()
        store, host, pool = s["store"], s["host"], s["pool"]
        assert store["inflight"] == 0 and store["writer_backlog"] == 0 and "background_errors" not in store
        assert host["pinned_bytes"] == 0 and host["pending"] == 0
        assert store["saves"] == tally["save"] and store["loads"] == tally["load"]
        assert store["load_tokens"] == tally["load_tokens"] > 0
        chunks = sum(store.get(f"save_chunks_{k}", 0) for k in ("saved", "skipped", "failed"))
        assert chunks == tally["save_chunks"]
        names = ["host", *(t.name for t in tiers)]
        assert sum(store.get(f"load_chunks_{t}", 0) for t in names) * CT == tally["load_tokens"]
        # The pool holds exactly the host's chunks (spills and reads all finished), all READY.
        assert host["used_bytes"] == host["entries"] * 1024 <= host["capacity_bytes"]
        assert pool["used"] == host["used_bytes"] and pool["in_flight"] == 0
        live = rig.eng.slots.live()
        assert len(live) == host["entries"] and set(live.values()) <= {SlotState.READY}
        assert host["evictions"] > 0 and store.get("promoted", 0) > 0
        assert s[tiers[0].name]["hits"] > 0 and s[tiers[0].name]["used_bytes"] <= DISK_BYTES
    finally:
        rig.close()  # every slot back to the pool (asserted by the rig)


@pytest.mark.slow
@pytest.mark.parametrize(
    "write_policy, policy, ops",
    [("write_through", "lru", OPS_PER_THREAD), ("write_back", "arc", OPS_PER_THREAD // 4)],
)
def test_stress_every_loaded_byte_is_right(tmp_path, write_policy, policy, ops):
    run([DiskTier(tmp_path, DISK_BYTES, fsync=False)], ops, write_policy=write_policy, host_policy=policy)


@pytest.mark.slow
@pytest.mark.redis
def test_stress_over_disk_and_redis(tmp_path, redis_server):  # noqa: F811
    redis = RedisTier(url=redis_server.url, prefix="stress:", timeout_s=1.0)
    run([DiskTier(tmp_path / "disk", DISK_BYTES, fsync=False), redis], OPS_PER_THREAD // 10)  # beside redis/
    assert redis.stats()["puts"] > 0
