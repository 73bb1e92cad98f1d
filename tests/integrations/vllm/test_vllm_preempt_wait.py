"""A preemption waits only for the saves that read the preempted request's blocks: another
request's save queued before them, whose copy is stuck, does not hold the step back; and the
preempted request's chunks are still saved whole before its blocks are reused."""

from __future__ import annotations

import threading
import time

import pytest
from vllm_harness import Engine

from kvtier.device import SimDevice

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")

pytestmark = pytest.mark.vllm
A = list(range(1, 97))  # 96 tokens: 6 blocks, 3 chunks of 32
B = list(range(501, 597))
STUCK_S = 6.0  # how long the other request's first copy is held (released early by the test)


class StuckCopy(SimDevice):
    """A SimDevice whose first copy after ``arm()`` does not start before ``release()`` (or
    STUCK_S): a slow copy of one request, queued before the others'."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.armed = threading.Event(), False

    def arm(self) -> None:
        self.armed = True

    def release(self) -> None:
        self.gate.set()

    def copy(self, dst, src, stream) -> None:
        if self.armed:
            self.armed = False
            gate = self.gate
            self.launch(lambda: gate.wait(STUCK_S), stream)  # the copy engine is busy with it
        super().copy(dst, src, stream)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preemption_does_not_wait_for_another_requests_save(tmp_path, async_scheduling):
    dev = StuckCopy()
    extra = {"chunk_tokens": 32, "host_bytes": 1 << 22}
    e = Engine(tmp_path, extra, num_blocks=13, device=lambda r: dev, async_scheduling=async_scheduling)
    try:
        e.add("a", A, max_tokens=14)  # a's save goes first: its first copy is stuck
        e.add("b", B, max_tokens=3)
        dev.arm()
        so = e.step()  # both prefilled (12 blocks: all there are), 6 chunks being saved
        assert [r.req_id for r in so.kv_connector_metadata.saves] == ["a", "b"]
        took = None
        for _ in range(4):  # a's decode needs a 7th block: b is preempted, its blocks go to a
            t0 = time.monotonic()
            so = e.step()
            if so is not None and "b" in (so.preempted_req_ids or ()):
                took = time.monotonic() - t0
                break
        assert took is not None, "b was not preempted"
        dev.release()
        assert took < STUCK_S / 3, f"the preempting step waited {took:.2f} s for a's stuck copy"
        e.settle()
        assert not e.violations()
        for rid, tokens in (("a2", A), ("b2", B)):  # b's chunks were read before a wrote its blocks
            e.sched.reset_prefix_cache()
            e.add(rid, tokens + [7])
            e.settle()
            assert e.loads(rid) == [3] and not e.violations(rid)
    finally:
        dev.release()
        e.close()
