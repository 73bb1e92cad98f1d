"""SimDevice at interpreter exit: work still queued never aborts the process (issue #32).

A worker thread inside a torch op when the interpreter finalizes is killed while it takes the
GIL back, through a C++ frame that may not unwind: "terminate called without an active
exception", SIGABRT. An exit hook closes every open SimDevice first (queued work cancelled, the
running item finished, the workers joined)."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kvtier.device import SimDevice

SCRIPT = textwrap.dedent(
    """
    import torch
    from kvtier.device import SimDevice

    dev = SimDevice()
    for s in [dev.new_stream(f"s{i}") for i in range(3)]:
        for _ in range(20000):  # the workers are in torch ops when the program ends
            dev.launch(lambda: torch.as_tensor([1, 2, 3]).sum(), s)
    """
)


@pytest.mark.slow
def test_exit_with_work_queued_is_clean():
    for i in range(4):
        p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "terminate called" not in p.stderr, f"run {i}: {p.returncode} {p.stderr}"


def test_close_cancels_queued_work_and_joins_the_workers():
    d = SimDevice()
    s = d.new_stream("s")
    ran = []
    d.launch(lambda: time.sleep(0.2), s)
    for i in range(100):
        d.launch(lambda i=i: ran.append(i), s)
    ev = s.record("tail")
    t0 = time.monotonic()
    d.close()
    assert time.monotonic() - t0 < 2.0 and not s.worker_alive
    assert ran == []  # not started before close: cancelled
    assert not ev.query() and not ev.synchronize(timeout=0.1)  # cancelled work never completes
    d.synchronize()  # closed: nothing can run any more, so nothing to wait for
    d.close()  # twice: nothing more to do


def test_a_closed_device_refuses_new_work():
    d = SimDevice()
    d.close()
    try:
        d.copy(torch.zeros(4), torch.ones(4), d.current_stream())
    except RuntimeError as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("a closed SimDevice accepted a copy")
