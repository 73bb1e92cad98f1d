"""Randomized multi-threaded stress: every loaded byte checked, accounting consistent at the end."""

import random
import threading
from collections import Counter

import pytest

from kvtier.store.chunkfile import SUFFIX
from kvtier.store.disk import DiskTier
from kvtier.store.disk_folder import MARKER
from kvtier.store.header import ChunkHeader
from kvtier.store.payload import PAGE

from store_redis_fixtures import redis_server  # noqa: F401  (a fixture)

THREADS = 4
OPS_PER_THREAD = 2500  # 10,000 operations in all
UNIVERSE = 120


def content(i: int) -> tuple[bytes, ChunkHeader, bytes]:
    """Same key, same bytes (as with real KV): the expected payload of key i, sized 1..24 KiB."""
    rng = random.Random(i)
    payload = rng.randbytes(rng.randrange(1, 24 * 1024))
    key = (i + 1).to_bytes(16, "big")
    return key, ChunkHeader.for_payload(key, payload, (len(payload),), "uint8", "flat"), payload


CHUNKS = [content(i) for i in range(UNIVERSE)]


def hammer(tier, seed: int, tally: Counter, wrong: list, errors: list) -> None:
    rng = random.Random(seed)
    dest = bytearray(24 * 1024)
    try:
        for _ in range(OPS_PER_THREAD):
            i = min(int(rng.expovariate(1 / 25)), UNIVERSE - 1)  # skewed: some keys are hot
            key, header, payload = CHUNKS[i]
            op = rng.random()
            if op < 0.35:
                got = tier.get(key)
                tally["get"] += 1
                if got is not None and (got.header != header or bytes(got.payload) != payload):
                    wrong.append(i)
            elif op < 0.5:
                got = tier.get_into(key, dest)
                tally["get"] += 1
                if got is not None and (got != header or dest[: len(payload)] != payload):
                    wrong.append(i)
            elif op < 0.85:
                tier.put(key, header, payload)
                tally["put"] += 1
            elif op < 0.92:
                tier.delete(key)
                tally["delete"] += 1
            else:
                tier.contains(key)
                tally["contains"] += 1
    except Exception as exc:  # a tier must never raise into its caller
        errors.append(exc)


def run_threads(tier) -> Counter:
    tallies = [Counter() for _ in range(THREADS)]
    wrong, errors = [], []
    threads = [
        threading.Thread(target=hammer, args=(tier, s, tallies[s], wrong, errors)) for s in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # every operation finished before the books are checked
    assert not errors, errors[:3]
    assert not wrong, f"wrong bytes loaded for keys {sorted(set(wrong))[:10]}"
    total = sum(tallies, Counter())
    assert sum(total.values()) == THREADS * OPS_PER_THREAD
    return total


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_disk_stress(tmp_path, policy):
    capacity = 40 * (PAGE + 12 * 1024)  # about a third of the key space: constant eviction
    tier = DiskTier(tmp_path, capacity, policy=policy)
    total = run_threads(tier)
    s = tier.stats()
    assert s["hits"] + s["misses"] == total["get"]
    assert s["puts"] + s["puts_present"] + s["put_failures"] == total["put"]
    assert s["hits"] > 0 and s["evictions"] > 0 and s["put_failures"] == 0
    assert s["errors_corrupt"] == s["errors_error"] == 0
    # The books match the disk: no pins left, no temp files, no orphans, sizes add up.
    files = {p.name.removesuffix(SUFFIX): p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()}
    del files[MARKER]  # the tier's mark on its folder
    assert s["pinned_bytes"] == 0
    assert not [n for n in files if n.endswith(".tmp")]
    assert sorted(files) == sorted(k.hex() for k in tier.resident_keys())
    assert s["used_bytes"] == sum(files.values()) <= capacity and s["entries"] == len(files)
    # A restart rebuilds the same index, and every chunk in it is intact.
    tier.close()
    again = DiskTier(tmp_path, capacity, policy=policy)
    assert again.scan_removed == 0 and sorted(again.resident_keys()) == sorted(tier.resident_keys())
    for key in again.resident_keys():
        i = int.from_bytes(key, "big") - 1
        assert bytes(again.get(key).payload) == CHUNKS[i][2]


@pytest.mark.slow
@pytest.mark.redis
def test_redis_stress(redis_server):  # noqa: F811
    redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
    from kvtier.store.redis_tier import RedisTier

    tier = RedisTier(url=redis_server.url, part_bytes=4096)  # most chunks are split into parts
    total = run_threads(tier)
    s = tier.stats()
    assert s["hits"] + s["misses"] == total["get"]
    assert s["puts"] + s["puts_present"] + s["put_failures"] == total["put"]
    assert s["hits"] > 0 and s["put_failures"] == 0
    assert s["errors_corrupt"] == s["errors_error"] == s["errors_timeout"] == 0
    # No orphans: every key on the server is a live manifest or one of its parts.
    r = redis.Redis.from_url(redis_server.url)
    expected = 0
    for key, _, payload in CHUNKS:
        if tier.get(key) is not None:
            expected += 1 + -(-len(payload) // 4096)  # the manifest and its parts
    assert r.dbsize() == expected
