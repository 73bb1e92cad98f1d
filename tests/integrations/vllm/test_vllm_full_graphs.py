"""`full_graphs` (with `layerwise`): the connector keeps vLLM's FULL CUDA graphs, each layer's wait
a device wait on the engine's per-layer "landed" flag (`kvtier.engine.flags`; SimDevice emulates
the flags), through vLLM's real Scheduler / AsyncScheduler and the stand-in model, on SimDevices
whose copies land late. Two forwards: "graph", one FULL graph captured at start and replayed in
every step (`vllm_harness`: no hook runs inside the forward), and "eager" (vLLM's piecewise graphs
or eager mode: wait_for_layer_load per layer). A wait left out shows as a wrong read.
"""

from __future__ import annotations

import pytest
from vllm_harness import Engine

from kvtier.device import SimDevice

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
A = list(range(1, 101))  # 3 full chunks of 32 (6 blocks)
A2 = list(range(2001, 2101))  # another prompt of 3 chunks
B = A + list(range(1001, 1101))  # 200 tokens: the forward runs 3 chunks past A's hit
EXTRA = {"chunk_tokens": 32, "host_bytes": 1 << 22, "full_graphs": True}
DELAY = 0.05  # seconds each copy and launch lands late: a read that does not wait sees poison


def late(rank: int) -> SimDevice:
    return SimDevice(copy_delay=DELAY, launch_delay=DELAY)


def armed(e: Engine) -> list[int]:
    """Steps each rank armed its flags for, past the one armed at start (the flags' first use)."""
    return [rk.ws.flags.tracker.generation - 1 for rk in e.ranks]


def in_step_loads(e: Engine) -> list[int]:
    """Per step run, the loads the scheduler sent to run in it (not in the background)."""
    return [sum(not r.background for r in so.kv_connector_metadata.loads) for so, _ in e.history]


def _hit(tmp_path, forward: str, extra=EXTRA, **kw) -> Engine:
    """A's chunks saved by one request, vLLM's own cache emptied: the next request with A hits kvtier."""
    e = Engine(tmp_path, extra, device=late, full_graph=forward == "graph", **kw)
    e.add("a", A, max_tokens=3)
    e.settle()
    e.sched.reset_prefix_cache()
    return e


def test_piecewise_graphs_are_asked_for_only_with_event_waits():
    from kvtier.integrations.vllm import KVTierConnector

    ask = KVTierConnector.requires_piecewise_for_cudagraph
    assert ask({}) is True  # layerwise, per-layer event waits between graph pieces
    assert ask({"full_graphs": True}) is False
    assert ask({"kvtier": {"layerwise": True, "full_graphs": True}}) is False
    assert ask({"layerwise": False}) is False and ask({"layerwise": False, "full_graphs": True}) is False
    with pytest.raises(ValueError, match=r"\['full_graphs'\]: true or false, got 'yes'"):
        ask({"full_graphs": "yes"})


@pytest.mark.parametrize("full_graphs", [True, False])
def test_a_capture_with_no_metadata_bound_still_calls_the_layer_waits(tmp_path, full_graphs):
    """vLLM captures its graphs with no connector metadata bound; with flag waits the connector
    answers has_connector_metadata True while a capture is on (only then)."""
    e = Engine(tmp_path, {**EXTRA, "full_graphs": full_graphs})
    try:
        conn, ws = e.ranks[0].conn, e.ranks[0].ws
        assert (ws.flags is not None) is full_graphs
        assert not conn.has_connector_metadata()  # no capture, nothing bound: vLLM skips the hooks
        ws.capturing = lambda: True
        assert conn.has_connector_metadata() is full_graphs
        del ws.capturing
        from kvtier.integrations.vllm.metadata import KVTierMetadata

        conn.bind_connector_metadata(KVTierMetadata())
        assert conn.has_connector_metadata()
        conn.clear_connector_metadata()
    finally:
        e.close()


def test_the_graph_holds_one_flag_wait_per_layer(tmp_path):
    e = Engine(tmp_path, EXTRA, tp_size=2, full_graph=True)
    try:
        assert all(len(nodes) == 1 for graph in e.graphs for nodes in graph)
    finally:
        e.close()


@pytest.mark.parametrize(
    "forward,async_scheduling,tp_size",
    [("graph", False, 1), ("graph", True, 2), ("graph", False, 2), ("eager", False, 1), ("eager", True, 2)],
)
def test_a_hit_reads_only_true_kv(tmp_path, forward, async_scheduling, tp_size):
    e = _hit(tmp_path, forward, tp_size=tp_size, async_scheduling=async_scheduling)
    try:
        assert armed(e) == [0] * tp_size  # no step loaded: the flags were never re-armed
        e.add("b", A, max_tokens=3)
        e.settle()
        assert e.loads("b") == [3] and e.scheduled("b")[0] == 4  # 96 tokens loaded, in the step
        assert not e.invalid_blocks() and not e.violations(), e.violations()
        assert e.outputs["b"] == e.outputs["a"] and e.outputs["b"][0] == e.first_token(A)
        assert sum(in_step_loads(e)) == 1 and armed(e) == [1] * tp_size  # its decode steps arm nothing
    finally:
        e.close()


@pytest.mark.parametrize("forward", ["graph", "eager"])
def test_several_loads_in_one_step(tmp_path, forward):
    e = _hit(tmp_path, forward, extra={**EXTRA, "load_async": "never"}, tp_size=2)
    try:
        e.add("a2", A2)
        e.settle()
        e.sched.reset_prefix_cache()
        e.add("b", A)
        e.add("c", A2)
        e.settle()
        assert max(in_step_loads(e)) == 2  # both hits loaded in one step, each a load of 3 chunks
        assert e.loads("b") == [3] and e.loads("c") == [3]
        assert not e.invalid_blocks() and not e.violations(), e.violations()
        assert e.outputs["b"][0] == e.first_token(A) and e.outputs["c"][0] == e.first_token(A2)
        assert armed(e) == [1, 1]  # one step re-armed the flags for both loads
    finally:
        e.close()


def test_a_background_load_never_arms_the_flags(tmp_path):
    e = _hit(tmp_path, "graph", extra={**EXTRA, "load_async": "always"})
    try:
        e.add("b", A)
        e.settle()
        assert e.loads("b") == [3] and sum(in_step_loads(e)) == 0  # loaded while b waited out of the batch
        assert armed(e) == [0]
        assert not e.invalid_blocks() and not e.violations() and e.outputs["b"][0] == e.first_token(A)
    finally:
        e.close()


def _keys(e, rank: int, tokens: list[int], chunks: list[int]) -> list[bytes]:
    from vllm_utils import create_request

    req = create_request("__keys__", tokens)
    ids = [bytes(req.block_hashes[2 * c + 1]) for c in chunks]  # 2 blocks a chunk: its last hash
    return e.ranks[rank].store.keys(ids)


@pytest.mark.parametrize("forward", ["graph", "eager"])
@pytest.mark.parametrize("tp_size,failing_rank", [(1, 0), (2, 1)], ids=["tp1", "tp2-rank1"])
def test_a_chunk_gone_before_its_load_is_recomputed(tmp_path, forward, tp_size, failing_rank):
    e = _hit(tmp_path, forward, tp_size=tp_size)
    try:

        def lose(so):  # the scheduler granted chunk 1 of A; the rank's host drops it before the load
            if so.kv_connector_metadata.loads and e.before_execute is lose:
                e.ranks[failing_rank].store.host.evict(_keys(e, failing_rank, A, [1]))
                e.before_execute = None

        e.before_execute = lose
        e.add("b", B, max_tokens=2)
        e.settle()
        assert e.loads("b") == [3] and e.invalid_blocks()  # reported: vLLM recomputed from chunk 1 on
        assert e.outputs["b"][0] == e.first_token(B)
        e.sched.reset_prefix_cache()
        e.add("c", B)
        e.settle()
        assert e.loads("c") == [6] and not e.violations("c"), e.violations("c")
        assert e.outputs["c"][0] == e.first_token(B)
    finally:
        e.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("forward", ["graph", "eager"])
def test_a_load_that_raises_after_joining_the_step_never_blocks_the_forward(tmp_path, forward):
    """The engine's copy submission fails after the load took its place in the step: the step's
    flags are set all the same (no replay waits forever) and vLLM recomputes the blocks."""
    e = _hit(tmp_path, forward)
    try:
        engine = e.ranks[0].store.engine

        def boom(*args, **kwargs):
            del engine.mover.load_slots  # once
            raise RuntimeError("copy submission failed")

        engine.mover.load_slots = boom
        e.add("b", A, max_tokens=2)
        e.settle()
        assert e.loads("b") == [3] and e.invalid_blocks() and e.counts().get("load_errors") == 1
        assert armed(e) == [1] and e.outputs["b"][0] == e.first_token(A)
        e.sched.reset_prefix_cache()
        e.add("c", A)
        e.settle()
        assert not e.violations("c") and e.outputs["c"][0] == e.first_token(A)
    finally:
        e.close()


def test_a_step_is_sealed_when_its_loads_raise(tmp_path):
    """start_load seals the step it armed whatever its loads do: its flags are set, no wait hangs."""
    e = _hit(tmp_path, "graph")
    try:
        ws = e.ranks[0].ws

        def fail(*args, **kwargs):
            raise RuntimeError("bookkeeping failed")

        ws._load = fail
        e.add("b", A)
        with pytest.raises(RuntimeError, match="bookkeeping failed"):
            e.step()
        step = ws.flags.live
        assert step.generation == 2 and step.sealed is not None and step.sealed.synchronize(10)
    finally:
        e.close()


def test_flag_waits_need_kvtier_as_vllms_connector(tmp_path, monkeypatch):
    """Inside another connector (a MultiConnector), vLLM asks that one whether to call the layer
    hooks during a capture: the graphs would hold no wait, so the worker refuses to start."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", object())
    with pytest.raises(ValueError, match=r"\['full_graphs'\]=true needs KVTierConnector"):
        Engine(tmp_path, EXTRA)


# -- a wait left out is caught -------------------------------------------------------------------


def test_a_graph_captured_without_the_waits_reads_kv_still_loading(tmp_path, monkeypatch):
    """vLLM's own check: a capture with no metadata bound calls no hook, so the graph holds no wait
    and the replay reads blocks whose copies have not landed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtier.integrations.vllm import KVTierConnector

    monkeypatch.setattr(KVTierConnector, "has_connector_metadata", KVConnectorBase_V1.has_connector_metadata)
    e = _hit(tmp_path, "graph")
    try:
        assert not any(e.graphs[0])  # nothing captured
        e.add("b", A)
        e.settle()
        assert e.loads("b") == [3] and e.violations("b")
    finally:
        e.close()


@pytest.mark.parametrize("forward", ["graph", "eager"])
def test_a_flag_wait_left_out_reads_kv_still_loading(tmp_path, monkeypatch, forward):
    from kvtier.engine import LayerFlags

    monkeypatch.setattr(LayerFlags, "wait", lambda self, layer, stream=None: None)
    e = _hit(tmp_path, forward)
    try:
        e.add("b", A)
        e.settle()
        assert e.loads("b") == [3] and e.violations("b")
    finally:
        e.close()
