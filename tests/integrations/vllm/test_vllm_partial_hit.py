"""vLLM's own prefix cache ends inside a chunk kvtier holds: the blocks past vLLM's hit are loaded
from the chunk (never a block vLLM computed or shares), not recomputed."""

from __future__ import annotations

import pytest
from vllm_harness import Engine

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
A = list(range(1, 101))  # 3 chunks of 32 tokens (2 blocks each)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("layerwise", [True, False])
def test_a_local_hit_ending_inside_a_chunk_loads_the_rest(tmp_path, async_scheduling, tp_size, layerwise):
    extra = {"chunk_tokens": 32, "host_bytes": 1 << 22, "layerwise": layerwise}
    e = Engine(tmp_path, extra, tp_size=tp_size, async_scheduling=async_scheduling)
    try:
        e.add("a", A)
        e.settle()  # kvtier holds A's 3 chunks
        e.sched.reset_prefix_cache()
        e.add("c", A[:50], max_tokens=1)  # vLLM's cache then holds A's first 3 blocks (48 tokens)
        e.settle()
        e.add("b", A, max_tokens=2)
        e.settle()
        assert e.loads("b") == [2], e.loads("b")  # chunk 1's second block and chunk 2
        assert e.scheduled("b")[0] == 4  # 48 local + 48 loaded: 4 tokens computed
        assert not e.invalid_blocks() and not e.violations(), e.violations()
        assert e.outputs["b"] == e.outputs["a"]
    finally:
        e.close()
