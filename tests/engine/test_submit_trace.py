"""The opt-in submit phase timer (jobs.py `SubmitTrace`): off by default, on through the engine
attribute or KVTIER_SUBMIT_TRACE=1, one record per job with the engine's phases."""

import time

import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.engine.trace import NO_TRACE, SubmitTrace
from kvtier.pool import PinnedPool
from kvtier.reference import random_cache


def _engine(dev):
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 8, torch.bfloat16, seed=2)
    pool = PinnedPool(dev, 2 * kv.chunk_nbytes(3))
    return TransferEngine(dev, kv, pool, EngineConfig(sanitize=True)), pool


def test_trace_records_each_phase(monkeypatch):
    monkeypatch.delenv("KVTIER_SUBMIT_TRACE", raising=False)
    dev = SimDevice()
    eng, pool = _engine(dev)
    assert eng.trace is None
    tr = eng.trace = SubmitTrace()
    assert eng.trace is tr
    for _ in range(3):
        save = eng.save([5, 1, 6], after=None)
        assert save.wait()
        load = eng.load(save.slot, [2, 3, 4])
        assert load.wait()
        eng.release(save.slot)
    assert [r["job"] for r in tr.records] == ["save", "load"] * 3
    s, ld = tr.records[0], tr.records[1]
    for phase in ("ids", "slot", "tracker_wait", "mover", "event", "tracker_begin", "total"):
        assert phase in s
    assert "poll" in ld and "slot" not in ld
    assert s["total"] == sum(v for k, v in s.items() if k not in ("job", "total"))
    med = tr.medians("save")
    assert set(med) >= {"ids", "mover", "total"} and all(v >= 0 for v in med.values())
    eng.trace = None
    eng.save([5, 1, 6], after=None).wait()
    assert len(tr.records) == 6  # off again
    eng.close()
    pool.close()
    dev.close()


def test_trace_from_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_SUBMIT_TRACE", "1")
    dev = SimDevice()
    eng, pool = _engine(dev)
    assert isinstance(eng.trace, SubmitTrace)
    eng.save([1], after=None).wait()
    assert len(eng.trace.records) == 1
    eng.close()
    pool.close()
    dev.close()


def test_no_trace_is_inert():
    NO_TRACE.begin("save")
    NO_TRACE.mark("ids")
    NO_TRACE.end()
    tr = SubmitTrace()
    tr.mark("ids")  # no record begun: nothing happens
    tr.end()
    assert not tr.records and tr.medians() == {}


def test_mark_steps_charges_each_stamp_to_its_phase_and_skips_zeros():
    tr = SubmitTrace()
    tr.begin("save")
    t = time.perf_counter_ns()
    tr.mark_steps(("start",), (t,))  # the phases below count from a stamp the test knows
    tr.mark_steps(("a", "b", "c", "d"), (t + 100, 0, t + 350, t + 1000))  # "b" not reached
    tr.mark_steps(("a",), (t + 1500,))  # a repeated phase adds up; counted from the last stamp
    tr.end()
    rec = tr.records[-1]
    assert set(rec) == {"job", "start", "a", "c", "d", "other", "total"}
    assert (rec["job"], rec["a"], rec["c"], rec["d"]) == ("save", 100 + 500, 250, 650)
    assert rec["total"] - rec["other"] == rec["start"] + 1500  # end() counted from the last stamp
    assert rec["total"] >= 1500
    NO_TRACE.mark_steps(("a",), (1,))  # inert without a trace


def test_split_separates_runtime_calls_from_python():
    tr = SubmitTrace()
    for total, h2d, launch, event in ((100, 10, 20, 5), (120, 12, 30, 8), (90, 8, 18, 4)):
        tr.records.append(
            {"job": "save", "ids": 5000, "ids_h2d": h2d * 1000, "launch": launch * 1000,
             "event": event * 1000, "total": total * 1000}
        )  # fmt: skip
    tr.records.append({"job": "load", "ids": 1000, "total": 40_000})  # an eager job: no call phase
    assert tr.split("save") == {"calls_us": 35.0, "py_us": 65.0, "total_us": 100.0}  # 35/50/30, 65/70/60
    assert tr.split("load") == {"calls_us": 0.0, "py_us": 40.0, "total_us": 40.0}
    assert SubmitTrace().split("save") == {"calls_us": None, "py_us": None, "total_us": None}
