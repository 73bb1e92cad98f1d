"""The C helper of the submit path (engine/_fast.c, engine/fast.py) on the CPU: `replay` against a
fake CUDA runtime made of ctypes callbacks (the order of its calls, the ids it hands the copy,
the step it names on a failure, the device it switches to and back, the timestamps of its traced
form), and the fused graph replay of graphs.py on it. The real runtime: the GPU graph tests
(tests/test_engine_graphs_gpu.py)."""

import ctypes
import time

import numpy as np
import pytest
import torch

from kvtier.engine.fastpath import fast
from kvtier.engine.fastpath.graph_cache import Entry, Exec
from kvtier.engine.fastpath.graphs import StagedGraphs, graph_key
from kvtier.engine.fastpath.ring import HostRing
from kvtier.reference import random_cache

pytestmark = pytest.mark.skipif(fast.fast is None, reason=f"C helper: {fast.why}")

STREAM, EXEC, EVENT, DEV32, GUARD = 0x5000, 0xE000, 0xEE00, 0xD000, 0xEF00
NOT_READY = 600
c_int, vp = ctypes.c_int, ctypes.c_void_p


class FakeRuntime:
    """cudaMemcpyAsync, cudaGraphLaunch, cudaEventRecord, cudaGetDevice, cudaSetDevice,
    cudaEventQuery as ctypes callbacks that log their arguments; `fail`: {name: cudaError} to
    return instead of 0; `busy`: event handles whose query says "not ready"."""

    def __init__(self, device=0, fail=None, busy=(), slow=None):
        self.log, self.device, self.fail, self.busy = [], device, dict(fail or {}), set(busy)
        slow = dict(slow or {})  # {name: seconds the call takes}

        def memcpy(dst, src, nbytes, kind, stream):
            ids = list(np.frombuffer(ctypes.string_at(src, nbytes), dtype=np.int32))  # what the copy reads
            self.log.append(("memcpy", dst, src, nbytes, kind, stream, ids))
            time.sleep(slow.get("memcpy", 0))
            return self.fail.get("memcpy", 0)

        def launch(ex, stream):
            self.log.append(("launch", ex, stream))
            time.sleep(slow.get("launch", 0))
            return self.fail.get("launch", 0)

        def record(ev, stream):
            self.log.append(("record", ev, stream))
            return self.fail.get("record", 0)

        def get_device(p):
            p[0] = self.device
            time.sleep(slow.get("get_device", 0))
            return 0

        def set_device(d):
            self.log.append(("set_device", d))
            self.device = d
            return self.fail.get("set_device", 0)

        def query(ev):
            self.log.append(("query", ev))
            time.sleep(slow.get("query", 0))
            return NOT_READY if ev in self.busy else self.fail.get("query", 0)

        self._cbs = [  # kept alive: the C side holds their addresses
            ctypes.CFUNCTYPE(c_int, vp, vp, ctypes.c_size_t, c_int, vp)(memcpy),
            ctypes.CFUNCTYPE(c_int, vp, vp)(launch),
            ctypes.CFUNCTYPE(c_int, vp, vp)(record),
            ctypes.CFUNCTYPE(c_int, ctypes.POINTER(c_int))(get_device),
            ctypes.CFUNCTYPE(c_int, c_int)(set_device),
            ctypes.CFUNCTYPE(c_int, vp)(query),
        ]

    def bind(self):
        fast.fast.set_runtime(*(ctypes.cast(cb, vp).value for cb in self._cbs))


@pytest.fixture
def runtime():
    made = []

    def make(**kw):
        rt = FakeRuntime(**kw)
        rt.bind()
        made.append(rt)
        return rt

    yield make
    fast.runtime_bound.cache_clear()
    fast.runtime_bound()  # the real runtime again (where there is one): engines made before use it


def ids32(*ids):
    """Checked block ids as the engine hands them to a replay: int32 (`IdCheck`)."""
    return torch.tensor(ids, dtype=torch.int32)


def _host(n):
    t = torch.full((n,), -1, dtype=torch.int32)
    return t, t.data_ptr()


def test_replay_fills_copies_launches_records_in_order(runtime):
    rt = runtime()
    ids = np.array([7, 0, 2**31 - 1, 6], dtype=np.int32)
    host, hp = _host(4)
    assert fast.fast.replay(ids, 4, hp, DEV32, EXEC, STREAM, EVENT, 0, 0) == 0
    assert rt.log == [
        ("memcpy", DEV32, hp, 16, 1, STREAM, [7, 0, 2**31 - 1, 6]),  # the ids are in place before the copy
        ("launch", EXEC, STREAM),
        ("record", EVENT, STREAM),
    ]
    assert host.tolist() == [7, 0, 2**31 - 1, 6]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 2047, 2048, 2049, 8191, 8192, 32768 + 5])
def test_replay_copies_every_id_streamed_in_groups_of_eight_and_the_rest(runtime, n):
    rt = runtime()
    ids = np.random.default_rng(n).integers(0, 2**31, n, dtype=np.int32)
    host, hp = _host(n + 1)  # one int32 more: the fill must not write past n
    assert fast.fast.replay(ids, n, hp, DEV32, EXEC, STREAM, 0, 0, 0) == 0
    assert host[:n].tolist() == ids.tolist() and host[n].item() == -1
    assert rt.log[0][:6] == ("memcpy", DEV32, hp, 4 * n, 1, STREAM)


@pytest.mark.parametrize("offset", [1, 2, 3])  # int32s past a 16-byte boundary: no streamed stores
@pytest.mark.parametrize("n", [2048, 8195])
def test_replay_fills_a_buffer_of_any_alignment(runtime, n, offset):
    runtime()
    ids = np.random.default_rng(n + offset).integers(0, 2**31, n, dtype=np.int32)
    host = torch.full((n + 8,), -1, dtype=torch.int32)
    assert host.data_ptr() % 16 == 0
    hp = host.data_ptr() + 4 * offset
    assert fast.fast.replay(ids, n, hp, DEV32, EXEC, STREAM, 0, 0, 0) == 0
    got = host.tolist()
    assert got[offset : offset + n] == ids.tolist()  # every id, in order
    assert got[:offset] == [-1] * offset and got[offset + n :] == [-1] * (8 - offset)  # nothing around it


def test_replay_steps_times_each_step_on_the_trace_clock(runtime):
    rt = runtime(slow={"query": 0.003, "get_device": 0.001, "memcpy": 0.002, "launch": 0.004})
    ids, ns = np.array([3, 1, 4], dtype=np.int32), np.zeros(8, np.int64)
    host, hp = _host(3)
    t0 = time.perf_counter_ns()
    assert fast.fast.replay_steps(ids, 3, hp, DEV32, EXEC, STREAM, EVENT, 0, GUARD, ns) == 0
    t1 = time.perf_counter_ns()
    assert t0 <= ns[0] <= ns[1] <= ns[2] <= ns[3] <= ns[4] <= ns[5] <= ns[6] <= ns[7] <= t1  # perf_counter_ns
    assert ns[2] - ns[1] >= 3e6  # the guard's query
    assert ns[4] - ns[3] >= 1e6  # the device check
    assert ns[5] - ns[4] >= 2e6 and ns[6] - ns[5] >= 4e6  # the copy, then the launch
    assert ns[1] - ns[0] < 1e6 and ns[3] - ns[2] < 1e6 and ns[7] - ns[6] < 1e6  # args, the ids' fill, record
    assert [e[0] for e in rt.log] == ["query", "memcpy", "launch", "record"] and host.tolist() == [3, 1, 4]


def test_replay_steps_leaves_the_steps_not_reached_at_zero(runtime):
    runtime(fail={"launch": 1})
    ns = np.full(8, -1, np.int64)
    _, hp = _host(1)
    rc = fast.fast.replay_steps(np.array([1], np.int32), 1, hp, DEV32, EXEC, STREAM, EVENT, 0, 0, ns)
    assert rc == (2 << 32) | 1  # the launch failed
    assert 0 < ns[0] <= ns[1] <= ns[2] <= ns[3] <= ns[4] <= ns[5] and ns[6] == ns[7] == 0
    with pytest.raises(ValueError, match="buffer of 32 bytes, needs 64"):
        fast.fast.replay_steps(ids32(1).numpy(), 1, hp, DEV32, EXEC, STREAM, 0, 0, 0, np.zeros(4, np.int64))


def test_replay_takes_an_address_and_skips_a_null_event(runtime):
    rt = runtime()
    ids = ids32(3, 1, 4)
    host, hp = _host(3)
    assert fast.fast.replay(ids.data_ptr(), 3, hp, DEV32, EXEC, STREAM, 0, 0, 0) == 0
    assert [e[0] for e in rt.log] == ["memcpy", "launch"]  # no event: the caller records its own


def test_replay_switches_to_the_streams_device_and_back(runtime):
    rt = runtime(device=1)
    host, hp = _host(2)
    assert fast.fast.replay(np.array([1, 2], np.int32), 2, hp, DEV32, EXEC, STREAM, EVENT, 0, 0) == 0
    assert rt.log[0] == ("set_device", 0) and rt.log[-1] == ("set_device", 1) and rt.device == 1


@pytest.mark.parametrize(
    "fail, step, calls",
    [("query", 5, []), ("set_device", 4, ["set_device"]), ("memcpy", 1, ["memcpy"]),
     ("launch", 2, ["memcpy", "launch"]), ("record", 3, ["memcpy", "launch", "record"])],
)  # fmt: skip
def test_replay_names_the_failed_step(runtime, fail, step, calls):
    rt = runtime(device=1 if fail == "set_device" else 0, fail={fail: 700})
    host, hp = _host(2)
    rc = fast.fast.replay(np.array([1, 2], np.int32), 2, hp, DEV32, EXEC, STREAM, EVENT, 0, GUARD)
    assert (rc >> 32, rc & 0xFFFFFFFF) == (step, 700)
    assert [e[0] for e in rt.log] == ["query", *calls]  # nothing after the failed call


def test_replay_waits_for_nothing_while_its_buffer_is_still_read(runtime):
    rt = runtime(busy={GUARD})
    host, hp = _host(2)
    rc = fast.fast.replay(np.array([1, 2], np.int32), 2, hp, DEV32, EXEC, STREAM, EVENT, 0, GUARD)
    assert (rc >> 32, rc & 0xFFFFFFFF) == (5, NOT_READY)
    assert rt.log == [("query", GUARD)] and host.tolist() == [-1, -1]  # nothing written or enqueued


def test_bad_arguments_raise():
    f = fast.fast
    with pytest.raises(TypeError):
        f.check_ids(1, 2)
    with pytest.raises(ValueError, match="buffer of 4 bytes"):
        f.check_ids(np.zeros(2, np.int64), 1, 2, 10, None, np.zeros(1, np.int32))  # out too small
    with pytest.raises(ValueError):
        f.check_ids(np.zeros(2, np.int64), 1, -1, 10, None, np.zeros(2, np.int32))
    with pytest.raises(BufferError):
        f.check_ids(np.zeros(2, np.int64), 1, 2, 10, None, np.zeros(2, np.int32).tobytes())  # read-only out
    with pytest.raises(ValueError, match="null function address"):
        f.set_runtime(0, 1, 2, 3, 4, 5)
    with pytest.raises(TypeError):
        f.replay(np.array([1]), 1, np.zeros(1, np.int32), DEV32, EXEC, STREAM, 0, 0)  # no guard
    with pytest.raises(ValueError, match="8-byte items, needs 4-byte"):  # int64 ids read as int32: other ids
        f.replay(np.array([1, 2]), 2, np.zeros(2, np.int32), DEV32, EXEC, STREAM, 0, 0, 0)
    with pytest.raises(ValueError, match="8-byte items, needs 4-byte"):  # an int64 job copy
        f.check_ids(np.zeros(2, np.int64), 1, 2, 10, None, np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="4-byte items, needs 8-byte"):  # int32 ids said to be int64
        f.check_ids(np.zeros(4, np.int32), 1, 2, 10, None, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="num_blocks"):  # ids of a bigger cache would not fit int32
        f.check_ids(np.zeros(2, np.int64), 1, 2, 2**31 + 1, None, np.zeros(2, np.int32))


# ---- the fused graph replay (graphs.StagedGraphs._fused) on the fake runtime ------------------


class FakeStream:
    cuda_stream, device_index = STREAM, 0

    def __init__(self):
        self.synced = 0

    def synchronize(self):
        self.synced += 1


class TorchLikeEvent:
    """An event without a raw handle (as TorchEvent): the caller records it. Complete until recorded."""

    def __init__(self):
        self.stream, self.completed, self.seen = None, True, False

    def mark_recorded(self, stream):
        self.stream, self.completed, self.seen = stream, False, False

    def query(self):
        return self.completed

    @property
    def known_complete(self):  # as CudaEvent's: never recorded, or seen complete since
        return self.stream is None or self.seen


class RawEvent(TorchLikeEvent):
    """A raw event as CudaEvent: `handle` for the C helper to record, `mark_recorded` after."""

    handle = EVENT


class Nodes:
    base = captured = 0x7F00_0000_0000


def _graphs(n=4):
    """A graph cache with one entry, replayed fused. Make it before binding a fake runtime: on a GPU
    box StagedGraphs() binds the real one (whose calls must never see the fake handles)."""
    kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=0)
    g = StagedGraphs(kv, max_graphs=4)
    g.enabled = g.fused = True
    main = Exec(EXEC, Nodes())

    def buf():
        t = torch.zeros(n, dtype=torch.int32)
        from kvtier.engine.fastpath.graph_cache import HostBuf

        return HostBuf(t, t.numpy(), t.data_ptr())

    ring = HostRing(buf, RawEvent, depth=2, max_depth=4)
    entry = Entry(object(), torch.zeros(n, dtype=torch.int32), FakeStream(), Nodes(), ring, [main], main)
    key = graph_key("save", 4096, n, 4, ())
    g.cache.put(key, entry)
    return g, key, entry


def test_fused_replay_records_the_jobs_event_and_guards_the_buffer(runtime):
    g, key, entry = _graphs()
    rt = runtime()
    done, on = RawEvent(), object()
    assert g.replay(key, ids32(5, 1, 6, 2), FakeStream(), Nodes.base, done, on)
    buf = entry.ring.buffers[0]
    assert rt.log == [
        ("memcpy", entry.ids_dev.data_ptr(), buf.ptr, 16, 1, STREAM, [5, 1, 6, 2]),
        ("launch", EXEC, STREAM),
        ("record", EVENT, STREAM),
    ]
    assert done.stream is on  # the engine sees it recorded and records nothing more
    assert entry.ring.guards[0] is done  # buffer 0 is rewritten only after the job's event
    assert g.replay(key, np.array([0, 1, 2, 3], np.int32), FakeStream(), Nodes.base, RawEvent(), on)
    assert rt.log[3][2] == entry.ring.buffers[1].ptr  # buffer 0 still read: the next one
    assert g.stats.replays == 2


def test_fused_replay_leaves_a_torch_event_to_the_caller(runtime):
    g, key, _entry = _graphs()
    rt = runtime()
    done = TorchLikeEvent()
    assert g.replay(key, ids32(5, 1, 6, 2), FakeStream(), Nodes.base, done, object())
    assert [e[0] for e in rt.log] == ["memcpy", "launch"] and done.stream is None


@pytest.mark.parametrize("fail, armed", [("memcpy", False), ("launch", True)])
def test_fused_replay_failure_is_a_miss(runtime, fail, armed):
    g, key, entry = _graphs()
    runtime(fail={fail: 1})
    done = RawEvent()
    with pytest.warns(UserWarning, match="fused graph replay failed"):
        assert not g.replay(key, ids32(5, 1, 6, 2), FakeStream(), Nodes.base, done, object())
    assert not g.fused and g.stats.misses == 1 and g.stats.failures == 1 and done.stream is None
    # A copy that was enqueued still reads buffer 0: it waits for the job's event (recorded after
    # the eager path); one that was not leaves the buffer free.
    assert (entry.ring.guards[0] is done) == armed


def test_fused_replay_failed_record_raises_after_the_copy_ran(runtime):
    g, key, entry = _graphs()
    runtime(fail={"record": 2})
    stream = FakeStream()
    with pytest.raises(RuntimeError, match="cudaEventRecord"):
        g.replay(key, ids32(5, 1, 6, 2), stream, Nodes.base, RawEvent(), object())
    assert stream.synced == 1  # the queued copy has read the buffer before anyone may reuse it


@pytest.mark.parametrize("traced", [False, True])
def test_fused_replay_asks_the_guard_in_c_and_grows_the_ring_when_busy(runtime, traced):
    from kvtier.engine import SubmitTrace

    g, key, entry = _graphs()
    g.trace = SubmitTrace() if traced else None  # traced: replay_steps, the same guard and ring
    rt = runtime(busy={EVENT})
    on, first = object(), [RawEvent(), RawEvent()]
    for k, d in enumerate(first):
        assert g.replay(key, ids32(k, k, k, k), FakeStream(), Nodes.base, d, on)
    old = [b.ptr for b in entry.ring.buffers]
    rt.log.clear()
    assert g.replay(key, ids32(0, 1, 2, 3), FakeStream(), Nodes.base, RawEvent(), on)
    assert rt.log[0] == ("query", EVENT)  # buffer 0's copy may not have read it yet: not rewritten
    assert rt.log[1][0] == "memcpy" and rt.log[1][2] not in old and entry.ring.grown == 1
    assert sorted(b.array[0] for b in entry.ring.buffers) == [0, 0, 1]  # each still holds its ids
    rt.busy.clear()
    for d in first:
        d.completed = True
    rt.log.clear()
    assert g.replay(key, ids32(3, 2, 1, 0), FakeStream(), Nodes.base, RawEvent(), on)
    assert rt.log[0] == ("query", EVENT) and rt.log[1][2] == old[0]  # done now: rewritten in place


def test_fused_replay_skips_the_query_of_a_guard_seen_complete(runtime):
    """A guard a wait or poll already saw complete is not asked again (one runtime call fewer);
    one not seen is asked, busy or not."""
    g, key, entry = _graphs()
    rt = runtime(busy={EVENT})
    on, first = object(), [RawEvent(), RawEvent()]
    for d in first:
        assert g.replay(key, ids32(5, 1, 6, 2), FakeStream(), Nodes.base, d, on)
    old = [b.ptr for b in entry.ring.buffers]
    first[0].seen = True  # e.g. the engine's wait returned for that job
    rt.log.clear()
    assert g.replay(key, ids32(0, 1, 2, 3), FakeStream(), Nodes.base, RawEvent(), on)
    assert rt.log[0][0] == "memcpy" and rt.log[0][2] == old[0] and entry.ring.grown == 0
    rt.log.clear()  # buffer 1's guard was not seen complete: asked (busy here), a new buffer
    assert g.replay(key, ids32(3, 2, 1, 0), FakeStream(), Nodes.base, RawEvent(), on)
    assert rt.log[0] == ("query", EVENT) and rt.log[1][2] not in old and entry.ring.grown == 1


def test_fused_replay_asks_a_torch_guard_in_python(runtime):
    """A buffer guarded by an event without a raw handle (torch's): queried by the ring in Python
    (no cudaEventQuery of a handle it does not have), busy -> another buffer."""
    g, key, entry = _graphs()
    rt = runtime()
    guards = [TorchLikeEvent(), TorchLikeEvent()]
    for d in guards:
        assert g.replay(key, ids32(5, 1, 6, 2), FakeStream(), Nodes.base, d, object())
    old = [b.ptr for b in entry.ring.buffers]
    guards[0].completed = False  # its copy has not run yet
    rt.log.clear()
    assert g.replay(key, ids32(0, 1, 2, 3), FakeStream(), Nodes.base, TorchLikeEvent(), object())
    assert "query" not in [e[0] for e in rt.log]
    assert rt.log[0][2] not in old and entry.ring.grown == 1  # a new buffer, buffer 0 untouched


def test_traced_fused_replay_splits_the_call_into_its_runtime_calls(runtime):
    from kvtier.engine.trace import CALL_PHASES, SubmitTrace

    g, key, entry = _graphs()
    rt = runtime(slow={"memcpy": 0.006, "launch": 0.003, "get_device": 0.002})
    tr = g.trace = SubmitTrace()
    tr.begin("save")
    assert g.replay(key, ids32(5, 1, 6, 2), FakeStream(), Nodes.base, RawEvent(), object())
    tr.end()
    rec = tr.records[-1]
    steps = ("replay_prep", "replay_args", "guard", "ids_fill", "device", "ids_h2d", "launch", "event")
    assert {*steps, "replay_return"} <= set(rec)
    assert rec["ids_h2d"] >= 6e6 and 3e6 <= rec["launch"] < 6e6  # each call its own, not the other's
    assert 2e6 <= rec["device"] < 3e6 and rec["guard"] < 1e6 and rec["replay_prep"] < 2e6
    buf = entry.ring.buffers[0]
    assert rt.log == [  # the same calls as untraced
        ("memcpy", entry.ids_dev.data_ptr(), buf.ptr, 16, 1, STREAM, [5, 1, 6, 2]),
        ("launch", EXEC, STREAM),
        ("record", EVENT, STREAM),
    ]
    split = tr.split("save")
    assert split["calls_us"] == sum(rec[k] for k in CALL_PHASES) / 1e3 >= 11e3


def test_fused_replay_reads_the_device_streams_ints_not_torchs(runtime):
    """With the device stream given (`done_on`: `.handle` / `.index`, plain ints), the replay asks
    the torch stream nothing (its properties are slow on a cold host)."""

    class NoTorch(FakeStream):
        @property
        def cuda_stream(self):
            raise AssertionError("the torch stream's handle was read")

        @property
        def device_index(self):
            raise AssertionError("the torch stream's device was read")

    class DeviceStream:
        handle, index = STREAM, 0

    g, key, _entry = _graphs()
    rt = runtime()
    done, on = RawEvent(), DeviceStream()
    assert g.replay(key, ids32(5, 1, 6, 2), NoTorch(), Nodes.base, done, on)
    assert [e[0] for e in rt.log] == ["memcpy", "launch", "record"] and rt.log[0][5] == STREAM
    assert done.stream is on
