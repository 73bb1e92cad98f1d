"""Hold a stream for a while: work queued behind it starts once the hold is over.

On CUDA this is torch's sleep kernel (a private torch helper, not kvtier's: the lab's rule on
private names is about kvtier); on kvtier's simulator, a sleep on the stream's thread.
"""

from __future__ import annotations

import functools
import time

import torch


def hold(dev, stream, ms: float) -> None:
    """Keep `stream` busy for about `ms` of device time: a sleep kernel on CUDA, a sleep on the
    simulator's stream thread. Work queued behind it on the stream starts once it is over."""
    if dev.name == "sim":
        dev.launch(lambda: time.sleep(ms / 1e3), stream)
        return
    cycles = int(ms * cycles_per_ms(torch.cuda.current_device()))
    dev.launch(lambda: torch.cuda._sleep(cycles), stream)


@functools.cache
def cycles_per_ms(device: int) -> float:
    """Clock cycles of `torch.cuda._sleep` per ms on this GPU, timed once with events."""
    n = 4_000_000
    with torch.cuda.device(device):
        torch.cuda._sleep(n // 8)  # warm-up: the kernel loaded, the clocks up
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()  # elapsed_time is known only once b completed
        return n / a.elapsed_time(b)
