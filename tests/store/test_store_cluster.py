"""RedisTier on a real 3-master Redis Cluster (loopback): chunks and parts spread by slot."""

import time

import pytest

from kvtier.store.header import ChunkHeader
from kvtier.store.redis_tier import RedisTier

from store_redis_fixtures import packs_in_place, redis_cluster  # noqa: F401  (a module-scoped fixture)

pytestmark = pytest.mark.redis


def chunk(i: int, n: int):
    key = (1000 + i).to_bytes(16, "little")
    payload = bytes((i * 13 + j) % 253 for j in range(n))
    return key, ChunkHeader.for_payload(key, payload, (n,), "uint8", "flat"), payload


@pytest.fixture(scope="module")
def tier(redis_cluster):  # noqa: F811
    t = RedisTier(url=redis_cluster.url, cluster=True, part_bytes=4096, timeout_s=0.5, cooldown_s=0.2)
    yield t
    t.close()


def test_chunks_spread_over_every_master(tier, redis_cluster):  # noqa: F811
    chunks = [chunk(i, 500 + 300 * i) for i in range(40)]  # small ones and split ones
    for c in chunks:
        assert tier.put(*c)
    for key, header, payload in chunks:
        got = tier.get(key)
        assert got.header == header and bytes(got.payload) == payload
    sizes = [int(node.cli("DBSIZE")) for node in redis_cluster.nodes]
    assert all(n > 0 for n in sizes), sizes


def test_parts_of_one_chunk_land_on_several_nodes(tier, redis_cluster):  # noqa: F811
    key, header, payload = chunk(100, 4096 * 30)
    assert tier.put(key, header, payload)
    holders = [n for n in redis_cluster.nodes if n.cli("--scan", "--pattern", f"kvtier:{key.hex()}:*")]
    assert len(holders) >= 2
    dest = bytearray(len(payload))
    assert tier.get_into(key, dest) == header and dest == payload
    assert tier.delete(key) and tier.get(key) is None
    assert not any(n.cli("--scan", "--pattern", f"kvtier:{key.hex()}*") for n in redis_cluster.nodes)


def test_a_dead_master_makes_misses_never_errors(tier, redis_cluster):  # noqa: F811
    # Runs last in this module: it leaves the cluster without one master.
    chunks = [chunk(200 + i, 2000) for i in range(30)]
    for c in chunks:
        assert tier.put(*c)
    redis_cluster.nodes[1].kill()
    t0 = time.perf_counter()
    results = [tier.get(key) for key, _, _ in chunks]
    assert time.perf_counter() - t0 < 10
    for got, (_, _, payload) in zip(results, chunks, strict=True):
        assert got is None or bytes(got.payload) == payload
    assert any(r is None for r in results)
    s = tier.stats()
    assert s["errors_error"] + s["errors_timeout"] + s["errors_skipped"] > 0


def test_a_put_to_a_node_sends_its_value_from_the_callers_memory(redis_cluster):  # noqa: F811
    from kvtier.store.redis_client import make_client

    client = make_client(redis_cluster.url, cluster=True)
    try:
        assert packs_in_place(client.get_default_node().redis_connection.connection_pool)
    finally:
        client.close()
