"""What the scheduler grants is what the workers hold: evictions of the host and of the disk
reach its index (a pool smaller than the working set is never granted a chunk it lost), and
after a restart it knows what each rank's disk tier holds."""

from __future__ import annotations

import pytest
from vllm_harness import Engine

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
PROMPTS = [list(range(1000 * i + 1, 1000 * i + 101)) for i in range(6)]  # 3 chunks each, 18 in all
CHUNK = 2 * 2 * 2 * 16 * 32 * 4  # 2 blocks x 2 layers x (2 heads x 16 tokens x K||V 32) fp32


def _round(e, prefix: str, newest_first: bool = False) -> list[int]:
    """Each prompt once, one at a time (vLLM's own cache forgotten first); chunks loaded."""
    got = []
    for i in reversed(range(len(PROMPTS))) if newest_first else range(len(PROMPTS)):
        tokens = PROMPTS[i]
        e.sched.reset_prefix_cache()
        rid = f"{prefix}{i}"
        e.add(rid, tokens)
        e.settle()
        got += e.loads(rid)
    return got


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_host_smaller_than_the_working_set_is_granted_only_what_held(tmp_path, async_scheduling, tp_size):
    extra = {"chunk_tokens": 32, "host_bytes": 12 * CHUNK}  # the host index: 8 chunks of 18
    e = Engine(tmp_path, extra, tp_size=tp_size, async_scheduling=async_scheduling)
    try:
        _round(e, "first")
        loaded = _round(e, "again", newest_first=True)  # the last ones are still held
        assert not e.invalid_blocks(), e.invalid_blocks()  # every chunk granted was delivered
        assert sum(loaded) > 0 and not e.violations()
    finally:
        e.close()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_after_a_restart_the_disk_tier_is_hit(tmp_path, tp_size):
    extra = {"chunk_tokens": 32, "host_bytes": 12 * CHUNK, "disk_path": str(tmp_path / "disk")}
    e = Engine(tmp_path, extra, tp_size=tp_size)
    try:
        e.add("a", PROMPTS[0])
        e.settle()  # write-through: the chunks are on every rank's disk
    finally:
        e.close()
    e = Engine(tmp_path, extra, tp_size=tp_size)  # a new server: an empty host, the same disk
    try:
        e.add("b", PROMPTS[0])
        e.settle()
        assert e.loads("b") == [3], e.loads("b")
        assert not e.invalid_blocks() and not e.violations()
        assert e.outputs["b"][0] == e.first_token(PROMPTS[0])
    finally:
        e.close()


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_a_disk_smaller_than_the_working_set_is_granted_only_what_it_holds(tmp_path, write_policy):
    extra = {
        "write_policy": write_policy,  # write_back: a chunk reaches the disk as the host evicts it
        "chunk_tokens": 32,
        "host_bytes": 8 * CHUNK,  # the host index: 5 chunks
        "disk_path": str(tmp_path / "disk"),
        "disk_bytes": 12 * (CHUNK + 4096),  # about 12 chunk files (a header and padding each)
    }
    e = Engine(tmp_path, extra)
    try:
        _round(e, "first")
        loaded = _round(e, "again", newest_first=True)  # the last ones are still held
        if write_policy == "write_through":  # nothing granted that the disk dropped
            assert not e.invalid_blocks(), e.invalid_blocks()
        # (write_back: a load's own promotions spill the host's dirty chunks to the disk, which may
        # evict the load's next chunk there: a grant racing an eviction, recomputed by vLLM.)
        assert e.counts().get("hit_chunks_disk", 0) > 0  # what only the disk held was granted
        assert sum(loaded) > 0 and not e.violations()
    finally:
        e.close()
