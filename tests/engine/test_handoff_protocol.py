"""The handoff's two hazards, each three ways on two SimDevices (as tests/test_protocol_bugs.py):

- unprotected: the buggy sequence, sanitizer off -> wrong bytes (copies land DELAY late, host
  steps take microseconds: the order is deterministic);
- sanitized: the same sequence, sanitizer on -> LifecycleError;
- protocol: the waits the trackers hand out -> the right bytes.

Then the waits the handoff itself makes, and a randomized stress test with random delays.
"""

import random
import time

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import Handoff
from kvtier.lifecycle import Access, LifecycleError
from kvtier.reference import random_cache

DELAY = 0.15
L, NB, BS, H, D = 2, 8, 4, 2, 8
B = 2  # the block the scenarios move (same id on both sides)


class Rig:
    """GPU a (prefill) and GPU b (decode), each a cache of NB blocks, and a Handoff a -> b."""

    def __init__(self, sanitize, copy_delay=DELAY, seed=0):
        self.a, self.b = (
            SimDevice(copy_delay=copy_delay, seed=seed),
            SimDevice(copy_delay=copy_delay, seed=seed + 1),
        )
        self.ka = random_cache("vllm_flash", L, NB, BS, H, D, torch.float16, seed=1)
        self.kb = random_cache("vllm_flash", L, NB, BS, H, D, torch.float16, seed=2)
        for kv in (self.ka, self.kb):
            for x in kv.layers:
                x.zero_()
        self.h = Handoff(self.ka, self.kb, src_device=self.a, dst_device=self.b, sanitize=sanitize)

    def write_a(self, blocks, value, seconds=0.0, wait=True):
        """Compute on a writes `value` into `blocks`; returns the event after the write."""
        t = self.h.src.blocks
        waits = t.waits_for(Access.WRITE, blocks) if wait else []
        for e in waits:
            self.a.current_stream().wait_event(e)  # must not overwrite blocks a handoff still reads
        kv = self.ka

        def fill():
            time.sleep(seconds)
            for x in kv.layers:
                x[:, blocks] = value  # index assignment writes in place (x[:, list] would be a copy)

        self.a.launch(fill, self.a.current_stream())
        e = self.a.current_stream().record("e_write")
        t.compute_write(blocks, e, waited=waits)
        return e

    def read_b(self, blocks, seconds=0.0, wait=True):
        """Compute on b reads `blocks` (every layer) into a new tensor; returns (out, event)."""
        t = self.h.dst.blocks
        waits = t.waits_for(Access.READ, blocks) if wait else []
        for e in waits:
            self.b.current_stream().wait_event(e)  # attention must not read blocks before they land
        out = torch.zeros(L, 2, len(blocks), BS, H, D, dtype=torch.float16)
        kv = self.kb

        def read():
            time.sleep(seconds)
            for i, x in enumerate(kv.layers):
                out[i].copy_(x[:, blocks])

        self.b.launch(read, self.b.current_stream())
        e = self.b.current_stream().record("e_read")
        t.compute_read(blocks, e, waited=waits)
        return out, e

    def close(self):
        self.a.synchronize()
        self.b.synchronize()
        self.a.close()
        self.b.close()


def full(value, n=1):
    return torch.full((L, 2, n, BS, H, D), float(value), dtype=torch.float16)


# Each scenario runs the buggy sequence when `buggy`, the protocol otherwise; returns (observed, expected).


def decode_reads_before_handoff(r, buggy):
    e = r.write_a([B], 1)
    r.h.send([B], [B], after=e)  # the peer copy lands DELAY later
    out, _ = r.read_b([B], wait=not buggy)  # buggy: b's attention reads at once
    r.b.synchronize()
    return out, full(1)


def prefill_overwrites_before_copy(r, buggy):
    e = r.write_a([B, 5], 1)
    r.a.launch(lambda: time.sleep(DELAY), r.h.send_stream)  # earlier work keeps a's send stream busy
    r.h.send([B], [B], after=e)  # so this gather runs only after DELAY
    r.write_a([B], 7, wait=not buggy)  # buggy: a reuses the block for the next request at once
    r.a.synchronize()
    r.b.synchronize()
    return r.kb.layers[0][:, [B]].unsqueeze(0).expand(L, -1, -1, -1, -1, -1).clone(), full(1)


SCENARIOS = [decode_reads_before_handoff, prefill_overwrites_before_copy]
WHY = {  # what the sanitizer must say for each
    decode_reads_before_handoff: "read the block before the load",
    prefill_overwrites_before_copy: "overwrite the block before its save completed",
}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_unprotected_gives_wrong_data(scenario):
    r = Rig(sanitize=False)
    try:
        got, want = scenario(r, buggy=True)
        assert not torch.equal(got, want)
    finally:
        r.close()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_sanitizer_catches_it(scenario):
    r = Rig(sanitize=True)
    try:
        with pytest.raises(LifecycleError) as info:
            scenario(r, buggy=True)
        assert WHY[scenario] in str(info.value)
    finally:
        r.close()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_protocol_gives_right_data(scenario):
    r = Rig(sanitize=True)
    try:
        got, want = scenario(r, buggy=False)
        assert torch.equal(got, want)
    finally:
        r.close()


def test_handoff_waits_for_the_prefill_write():
    r = Rig(sanitize=True)
    try:
        e = r.write_a([B], 3, seconds=2 * DELAY)  # a slow prefill kernel writes the KV
        job = r.h.send([B], [B], after=e)
        job.wait(timeout=10)
        assert torch.equal(r.kb.layers[1][:, B], full(3)[1, :, 0])
    finally:
        r.close()


def test_handoff_waits_for_a_pending_read_on_b():
    r = Rig(sanitize=True)
    try:
        for x in r.kb.layers:
            x[:, B] = 4  # KV another request on b is attending over
        out, _ = r.read_b([B], seconds=2 * DELAY)
        r.h.send([B], [B], after=r.write_a([B], 1)).wait(timeout=10)
        assert torch.equal(out, full(4))  # the scatter waited for the read (vLLM #47282 class)
        assert torch.equal(r.kb.layers[0][:, B], full(1)[0, :, 0])
    finally:
        r.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stress_random_handoffs(seed):
    """Rounds of: prefill on a writes fresh values, hand off to random blocks of b, decode on b
    reads them — all through the trackers' waits, random copy delays, sanitizer on."""
    rng = random.Random(seed)
    r = Rig(sanitize=True, copy_delay=(0.0, 0.01), seed=seed)
    try:
        reads = []
        for round_ in range(30):
            n = rng.randint(1, 4)
            src, dst = rng.sample(range(NB), n), rng.sample(range(NB), n)
            value = round_ + 1
            e = r.write_a(src, value, seconds=rng.choice([0.0, 0.003]))
            job = r.h.send(src, dst, after=e, per_layer=rng.random() < 0.5)
            out, _ = r.read_b(dst, seconds=rng.choice([0.0, 0.002]))
            reads.append((out, value, n))
            if rng.random() < 0.2:
                job.wait(timeout=10)
        r.a.synchronize()
        r.b.synchronize()
        for out, value, n in reads:
            assert torch.equal(out, full(value, n))
        assert r.h.src.blocks.pending() == 0 and r.h.dst.blocks.pending() == 0
    finally:
        r.close()
