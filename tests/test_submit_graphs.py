"""A staged-graph replay without torch (graphs.py + graph_nodes.Launcher), on fakes: the ids are
written into the pinned buffer the exec's ids node reads and the launch is the one runtime call;
a buffer still read by a queued launch is never rewritten (the node is pointed at another), the
exec that serves a slot (one moved per job, or one per recent slot with slot_execs = 2), failures
fall back.
The real runtime calls: tests/test_engine_graphs_gpu.py and benchmarks/profile_submit.py."""

import numpy as np
import pytest
import torch

from kvtier.engine.graph_cache import Entry, Exec, HostBuf
from kvtier.engine.graph_nodes import NodeError
from kvtier.engine.graphs import StagedGraphs, graph_key
from kvtier.engine.ids import IdsBuffers
from kvtier.reference import random_cache

A, B, C = 0x7F00_0000_0000, 0x7F00_1000_0000, 0x7F00_2000_0000
STREAM = 0x5000


class FakeStream:
    cuda_stream, device_index = STREAM, 0


class FakeEvent:
    def __init__(self, log):
        self.log, self.done = log, True

    def record(self, stream):
        self.done = False
        self.log.append(("event", stream.cuda_stream))

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class FakeNodes:
    def __init__(self, log, base, name, fail=()):
        self.log, self.base, self.captured, self.name, self.fail = log, base, base, name, fail

    def retarget(self, base):
        self.log.append(("retarget", self.name, base))
        self.base = base

    def point_ids(self, ptr):
        if "point_ids" in self.fail:
            raise NodeError("cudaGraphExecMemcpyNodeSetParams failed (cudaError 1)")
        self.log.append(("point_ids", self.name, ptr))

    def for_exec(self, handle):
        return FakeNodes(self.log, self.captured, handle, self.fail)


class FakeLauncher:
    def __init__(self, log, fail=()):
        self.log, self.fail, self.made = log, set(fail), 0

    def _maybe_fail(self, what):
        if what in self.fail:
            raise NodeError(f"{what} failed (cudaError 1)")

    def h2d(self, dst, src, nbytes, stream):
        self._maybe_fail("h2d")
        self.log.append(("h2d", dst, src, nbytes, stream))

    def launch(self, handle, stream):
        self._maybe_fail("launch")
        self.log.append(("launch", handle, stream))

    def instantiate(self, graph):
        self._maybe_fail("instantiate")
        self.made += 1
        self.log.append(("instantiate", graph))
        return 0xE000 + self.made

    def destroy(self, handle):
        self.log.append(("destroy", handle))


class FakeGraph:
    def raw_cuda_graph(self):
        return 0x6000


def _buf(n):
    t = torch.zeros(n, dtype=torch.int32)
    return HostBuf(t, t.numpy(), t.data_ptr())


@pytest.fixture
def setup(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def make(slot_execs=1, fail=(), n=5):
        kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=0)
        g = StagedGraphs(kv, max_graphs=4, slot_execs=slot_execs)
        log = []
        g._launcher, g.direct = FakeLauncher(log, fail), True
        g._make_event = lambda: FakeEvent(log)
        nodes = FakeNodes(log, A, "main", fail)
        main = Exec(0xE000, nodes, ids=IdsBuffers(lambda: _buf(n), max_depth=4))
        entry = Entry(FakeGraph(), torch.zeros(n, dtype=torch.int32), FakeStream(), nodes, [main], main)
        key = graph_key("save", 4096, n, 4, ())
        g.cache.put(key, entry)
        return g, key, entry, log

    return make


def replay(g, key, slot, ids=(3, 1, 4, 1, 5)):
    return g.replay(key, torch.tensor(ids), FakeStream(), slot)


def test_fill_then_launch_then_event(setup):
    g, key, entry, log = setup()
    assert replay(g, key, A, (7, 0, 2, 6, 5))
    launch, ev = log
    assert launch == ("launch", 0xE000, STREAM) and ev == ("event", STREAM)  # guarded after the launch
    assert entry.main.ids.buffers[0].array.tolist() == [7, 0, 2, 6, 5]  # int64 ids, int32 in the buffer
    assert g.stats.replays == 1 and g.stats.retargets == 0


def test_the_execs_buffer_is_reused_once_its_launch_ran(setup):
    g, key, entry, log = setup()
    for k in range(3):
        assert replay(g, key, A, (k, k, k, k, k))
        entry.main.ids._guards[entry.main.ids.cur].done = True  # the launch ran
    assert len(entry.main.ids) == 1 and not any(e[0] == "point_ids" for e in log)
    assert entry.main.ids.buffers[0].array.tolist() == [2] * 5


def test_buffers_of_queued_launches_are_not_rewritten(setup):
    g, key, entry, log = setup()
    for k in range(3):
        assert replay(g, key, A, (k, k, k, k, k))
    own = entry.main.ids
    moves = [e[2] for e in log if e[0] == "point_ids"]
    assert moves == [own.buffers[1].ptr, own.buffers[2].ptr]  # each queued launch kept its buffer
    assert [b.array[0] for b in own.buffers] == [0, 1, 2]  # each still holds its ids
    assert log.index(("point_ids", "main", moves[0])) < [i for i, e in enumerate(log) if e[0] == "launch"][1]


def test_one_exec_moved_to_each_slot(setup):
    g, key, entry, log = setup(slot_execs=1)
    for slot in (A, B, B, A):
        assert replay(g, key, slot)
    moves = [e for e in log if e[0] == "retarget"]
    assert moves == [("retarget", "main", B), ("retarget", "main", A)]
    assert {e[1] for e in log if e[0] == "launch"} == {0xE000} and g.stats.retargets == 2


def test_two_execs_serve_two_slots_unmoved(setup):
    g, key, entry, log = setup(slot_execs=2)
    launched = []
    for slot in (A, B, A, B, A, B, C):
        assert replay(g, key, slot)
        launched.append(next(e[1] for e in reversed(log) if e[0] == "launch"))
    new = 0xE001
    assert launched == [0xE000, new, 0xE000, new, 0xE000, new, 0xE000]  # C moves the least recent
    moves = [e for e in log if e[0] == "retarget"]
    assert moves == [("retarget", new, B), ("retarget", "main", C)]
    assert g.stats.execs == 1 and g.stats.retargets == 2 and ("instantiate", 0x6000) in log
    other = next(x for x in entry.execs if x is not entry.main)
    made = [e for e in log if e[0] == "point_ids" and e[1] == new]
    assert made[0] == ("point_ids", new, other.ids.buffers[0].ptr)  # at creation: a buffer of its own
    assert log.index(made[0]) < log.index(("launch", new, STREAM))
    main_bufs = {b.ptr for b in entry.main.ids.buffers}
    assert not main_bufs & {b.ptr for b in other.ids.buffers}  # no buffer shared between execs
    g.clear()
    assert log[-1] == ("destroy", new)  # its own exec goes; torch's stays with the torch graph


def test_instantiate_failure_falls_back_to_moving_one_exec(setup):
    g, key, entry, log = setup(slot_execs=2, fail={"instantiate"})
    with pytest.warns(UserWarning, match="one per graph"):
        assert replay(g, key, B)
    assert g.slot_execs == 1 and g.stats.failures == 1
    assert [e for e in log if e[0] == "retarget"] == [("retarget", "main", B)]


@pytest.mark.parametrize("what", ["launch"])
def test_failed_runtime_call_is_a_miss(setup, what):
    g, key, entry, log = setup(fail={what})
    with pytest.warns(UserWarning, match="direct graph launch failed"):
        assert not replay(g, key, A)  # the job goes eager
    assert not g.direct and g.stats.misses == 1 and g.stats.failures == 1 and g.stats.replays == 0
    assert not any(e[0] == "launch" for e in log)


def test_failed_ids_move_drops_the_graph(setup):
    g, key, entry, log = setup(fail={"point_ids"})
    assert replay(g, key, A)  # its buffer is free: no move
    with pytest.warns(UserWarning, match="ids buffer failed"):
        assert not replay(g, key, A)  # the first launch still queued: a move, which fails
    assert key not in g.cache and g.stats.failures == 1 and g.stats.misses == 1
    assert sum(e[0] == "launch" for e in log) == 1


def test_slot_execs_checked():
    kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=0)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="slot_execs"):
            StagedGraphs(kv, slot_execs=bad)
    assert not StagedGraphs(kv).direct or torch.cuda.is_available()  # no runtime here: torch's path


def test_ids_buffer_cast_is_exact():
    buf = _buf(4)
    np.copyto(buf.array, np.array([0, 1, 2**31 - 1, 7], dtype=np.int64), casting="unsafe")
    assert buf.tensor.tolist() == [0, 1, 2**31 - 1, 7]
