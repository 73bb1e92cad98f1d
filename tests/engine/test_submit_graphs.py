"""A staged-graph replay without torch (graphs.py + graph_nodes.Launcher), on fakes: the ids go
through a ring buffer, the copy is enqueued before the ring's event and the launch, the exec that
serves a slot (one moved per job, or one per recent slot with slot_execs = 2), failures fall back.
The real runtime calls: tests/engine/test_engine_graphs_gpu.py."""

import numpy as np
import pytest
import torch

from kvtier.engine.fastpath.graph_cache import Entry, Exec, HostBuf
from kvtier.engine.fastpath.graph_nodes import NodeError
from kvtier.engine.fastpath.graphs import StagedGraphs, graph_key
from kvtier.engine.fastpath.ring import HostRing
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
    def __init__(self, log, base, name):
        self.log, self.base, self.captured, self.name = log, base, base, name

    def retarget(self, base):
        self.log.append(("retarget", self.name, base))
        self.base = base

    def for_exec(self, handle):
        return FakeNodes(self.log, self.captured, handle)


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
        log = []
        g = StagedGraphs(kv, max_graphs=4, slot_execs=slot_execs, launcher=FakeLauncher(log, fail))
        g.fused = False  # the launcher's replay, not the C helper's
        nodes = FakeNodes(log, A, "main")
        main = Exec(0xE000, nodes)
        ring = HostRing(lambda: _buf(n), lambda: FakeEvent(log), depth=2, max_depth=4)
        entry = Entry(FakeGraph(), torch.zeros(n, dtype=torch.int32), FakeStream(), nodes, ring, [main], main)
        key = graph_key("save", 4096, n, 4, ())
        g.cache.put(key, entry)
        return g, key, entry, log

    return make


def replay(g, key, slot, ids=(3, 1, 4, 1, 5)):
    return g.replay(key, torch.tensor(ids), FakeStream(), slot)


def test_copy_then_event_then_launch(setup):
    g, key, entry, log = setup()
    assert replay(g, key, A, (7, 0, 2, 6, 5))
    h2d, ev, launch = log
    assert h2d == ("h2d", entry.ids_dev.data_ptr(), entry.ring.buffers[0].ptr, 5 * 4, STREAM)
    assert ev == ("event", STREAM) and launch == ("launch", 0xE000, STREAM)  # the ring's event before
    assert entry.ring.buffers[0].array.tolist() == [7, 0, 2, 6, 5]  # int64 ids, int32 in the buffer
    assert g.stats.replays == 1 and g.stats.retargets == 0


def test_ring_buffers_in_flight_are_not_rewritten(setup):
    g, key, entry, log = setup()
    for k in range(3):
        assert replay(g, key, A, (k, k, k, k, k))
    srcs = [e[2] for e in log if e[0] == "h2d"]
    assert len(set(srcs)) == 3  # no copy completed: each replay filled another buffer
    assert sorted(b.array[0] for b in entry.ring.buffers) == [0, 1, 2]  # each still holds its ids


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
    g.clear()
    assert log[-1] == ("destroy", new)  # its own exec goes; torch's stays with the torch graph


def test_instantiate_failure_falls_back_to_moving_one_exec(setup):
    g, key, entry, log = setup(slot_execs=2, fail={"instantiate"})
    with pytest.warns(UserWarning, match="one per graph"):
        assert replay(g, key, B)
    assert g.slot_execs == 1 and g.stats.failures == 1
    assert [e for e in log if e[0] == "retarget"] == [("retarget", "main", B)]


@pytest.mark.parametrize("what", ["h2d", "launch"])
def test_failed_runtime_call_is_a_miss(setup, what):
    g, key, entry, log = setup(fail={what})
    with pytest.warns(UserWarning, match="direct graph launch failed"):
        assert not replay(g, key, A)  # the job goes eager
    assert not g.enabled and g.stats.misses == 1 and g.stats.failures == 1 and g.stats.replays == 0
    assert not any(e[0] == "launch" for e in log)


def test_slot_execs_checked():
    kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=0)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="slot_execs"):
            StagedGraphs(kv, slot_execs=bad)
    assert not StagedGraphs(kv).enabled or torch.cuda.is_available()  # no runtime here: graphs off


def test_ids_buffer_cast_is_exact():
    buf = _buf(4)
    np.copyto(buf.array, np.array([0, 1, 2**31 - 1, 7], dtype=np.int64), casting="unsafe")
    assert buf.tensor.tolist() == [0, 1, 2**31 - 1, 7]


@pytest.mark.parametrize("direction", ["save", "load"])
@pytest.mark.parametrize("num_tokens", [None, 33])
def test_the_movers_key_is_graph_key(num_tokens, direction):
    """CudaMover builds its graph keys inline (one call fewer per submit): the same tuple as
    graph_key, handed to the graphs' replay; with graphs off no replay is tried."""
    from types import SimpleNamespace

    from kvtier.engine.cuda_mover import CudaMover
    from kvtier.engine.ids import IdCheck
    from kvtier.engine.paths import Path

    keys = []

    def replay(key, ids, raw, slot_ptr, done, stream):
        keys.append((key, slot_ptr))
        return True  # replayed: the mover returns before any eager work

    mover = SimpleNamespace(
        kv=None,
        graphs=SimpleNamespace(enabled=True),
        _replay=replay,
        _save_staging=(),
        _load_staging=(),
        _staging_key={"save": (1, 2), "load": (3, 4)},
        _staged_on=lambda stream: None,  # the staging buffers' order across save streams: none here
    )
    slot, stream = SimpleNamespace(nbytes=4096, ptr=77), SimpleNamespace(raw="raw")
    ids = IdCheck(num_blocks=8, block_size=16).checked(np.arange(3), direction == "load", num_tokens)
    if direction == "save":
        CudaMover.save(mover, Path.STAGED, ids, slot, stream)
    else:
        assert CudaMover.load(mover, Path.STAGED, ids, slot, stream, False, "l") == []
    staging = (1, 2) if direction == "save" else (3, 4)
    assert keys == [(graph_key(direction, 4096, 3, 16 if num_tokens is None else 1, staging), 77)]
    mover.graphs.enabled = False  # then the eager path runs: it needs a real cache, absent here
    with pytest.raises(AttributeError):
        CudaMover.save(mover, Path.STAGED, ids, slot, stream)
    assert len(keys) == 1
