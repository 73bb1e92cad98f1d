"""One function per ceiling of the machine, each timed with `Timer` on buffers of random bytes.

Every function returns a `Rate`: GB/s (1e9 bytes/s) unless its name says otherwise, the median of
repeated runs, with the slowest and the fastest run's figure beside it. A device-to-device copy
counts bytes read + bytes written (as nvbandwidth and STREAM do): a 1 GiB copy moves 2 GiB. Host
and device transfers count the bytes that crossed the link, once.

`CEILINGS` maps the names benchmark rows compare against (`Context.ceiling`) to these functions.
The probes of the store's lower tiers (local disk, Redis on loopback) also need to be told where to
measure (`CeilingDef.needs`: the directory of the disk tier, the URL of the Redis server).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.bench.probes_io import (
    _pageable,
    disk_read,
    disk_write,
    redis_loopback_get,
    redis_loopback_set,
)
from kvtier.bench.stats import Rate
from kvtier.bench.timing import Timer


def _dev_bytes(n: int, device) -> torch.Tensor:
    t = torch.empty(n, dtype=torch.uint8, device=device)
    t.random_()  # never time on zeros: compressible data can flatter a path
    return t


def _pinned(n: int) -> torch.Tensor:
    t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    t.fill_(7)  # touch every page now, so no page fault lands in a timed run
    return t


def d2d_copy(timer: Timer, nbytes: int) -> float:
    """cudaMemcpyAsync device->device (torch copy_); bytes read + written."""
    a = _dev_bytes(nbytes, timer.device)
    b = torch.empty_like(a)
    return Rate.of(2 * nbytes, timer.time(lambda: b.copy_(a), name="probe/d2d_copy"), nbytes)


def h2d_pinned(timer: Timer, nbytes: int) -> float:
    g, h = _dev_bytes(nbytes, timer.device), _pinned(nbytes)
    return Rate.of(nbytes, timer.time(lambda: g.copy_(h, non_blocking=True), name="probe/h2d_pinned"), nbytes)


def d2h_pinned(timer: Timer, nbytes: int) -> float:
    g, h = _dev_bytes(nbytes, timer.device), _pinned(nbytes)
    return Rate.of(nbytes, timer.time(lambda: h.copy_(g, non_blocking=True), name="probe/d2h_pinned"), nbytes)


def h2d_pageable(timer: Timer, nbytes: int) -> float:
    g, h = _dev_bytes(nbytes, timer.device), _pageable(nbytes)
    return Rate.of(nbytes, timer.time(lambda: g.copy_(h), name="probe/h2d_pageable"), nbytes)


def d2h_pageable(timer: Timer, nbytes: int) -> float:
    g, h = _dev_bytes(nbytes, timer.device), _pageable(nbytes)
    return Rate.of(nbytes, timer.time(lambda: h.copy_(g), name="probe/d2h_pageable"), nbytes)


def bidir_pinned(timer: Timer, nbytes: int) -> float:
    """H2D and D2H at once on two streams, pinned; total bytes of both directions."""
    g_in, g_out = (
        torch.empty(nbytes, dtype=torch.uint8, device=timer.device),
        _dev_bytes(nbytes, timer.device),
    )
    h_in, h_out = _pinned(nbytes), _pinned(nbytes)
    up, down = torch.cuda.Stream(timer.device), torch.cuda.Stream(timer.device)

    def both() -> None:
        cur = torch.cuda.current_stream(timer.device)
        for s in (up, down):
            s.wait_stream(cur)  # the copies start after the timer's start event, not before it
        with torch.cuda.stream(up):
            g_in.copy_(h_in, non_blocking=True)
        with torch.cuda.stream(down):
            h_out.copy_(g_out, non_blocking=True)
        for s in (up, down):
            cur.wait_stream(s)  # the end event must wait for both copies, or it under-reports

    return Rate.of(2 * nbytes, timer.time(both, name="probe/bidir_pinned"), nbytes)


def sm_copies(timer: Timer, nbytes: int) -> dict[str, Rate]:
    """The same transfers done by an SM kernel (Triton) instead of the copy engine."""
    from kvtier.bench.smcopy import sm_copy

    dev = timer.device
    g, h = _dev_bytes(nbytes, dev), _pinned(nbytes)
    g2 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    out = {
        "d2d_sm_copy_gbps": Rate.of(
            2 * nbytes, timer.time(lambda: sm_copy(g2, g), name="probe/d2d_sm"), nbytes
        ),
        "d2h_sm_copy_gbps": Rate.of(nbytes, timer.time(lambda: sm_copy(h, g), name="probe/d2h_sm"), nbytes),
        "h2d_sm_copy_gbps": Rate.of(nbytes, timer.time(lambda: sm_copy(g2, h), name="probe/h2d_sm"), nbytes),
    }
    torch.cuda.synchronize(dev)  # the timer waited already; kept so the check below never races a kernel
    if not (torch.equal(h.to(dev), g) and torch.equal(g2, g)):
        raise RuntimeError("an SM copy through pinned memory did not reproduce its source")
    return out


def launch_us(timer: Timer, kernels: int = 200) -> dict[str, float]:
    """Microseconds per tiny kernel: launched one by one from Python vs replayed from a CUDA graph."""
    x = torch.zeros(1024, device=timer.device)

    def many() -> None:
        for _ in range(kernels):
            x.add_(1)

    eager = timer.time(many, name="probe/launch_eager").median_ms
    graph = timer.time(many, graph=True, name="probe/launch_graph").median_ms
    return {"launch_eager_us": eager * 1e3 / kernels, "launch_graph_us": graph * 1e3 / kernels}


def bf16_tflops(timer: Timer, n: int = 8192) -> float:
    """Dense bf16 n x n x n matmul, TFLOP/s, after a sustained warm-up (clocks settle under load)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=timer.device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=timer.device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=timer.device)
    for _ in range(20):
        torch.matmul(a, b, out=c)
    return Rate.of(
        2 * n**3, timer.time(lambda: torch.matmul(a, b, out=c), name="probe/bf16_matmul"), scale=1e12
    )


def peer_copy(timer: Timer, nbytes: int) -> float:
    """GPU 0 -> GPU 1 (torch copy_: P2P when peer access is on, else through host memory); bytes
    moved once. Timed on GPU 0's stream, where torch runs a copy between devices."""
    if torch.cuda.device_count() < 2:
        raise ValueError(f"peer_copy: needs two CUDA devices, found {torch.cuda.device_count()}")
    src, dst = _dev_bytes(nbytes, "cuda:0"), torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    return Rate.of(nbytes, timer.time(lambda: dst.copy_(src, non_blocking=True)), nbytes)


def host_memcpy(timer: Timer, nbytes: int) -> float:
    """Host memory to host memory (torch copy_, pageable), bytes copied (read + write = 2x that)."""
    host = timer if not timer.on_cuda else Timer("cpu", min_reps=timer.min_reps, budget_s=timer.budget_s)
    a, b = _pageable(nbytes), _pageable(nbytes)
    a.random_()
    return Rate.of(nbytes, host.time(lambda: b.copy_(a), name="probe/host_memcpy"), nbytes)


# -- lower tiers of the store: local disk, Redis on loopback ---------------------------------------


@dataclass(frozen=True, slots=True)
class CeilingDef:
    fn: Callable[..., Rate]  # fn(timer, nbytes, **needs) -> GB/s
    figure: str  # the kvtier.ceilings figure it fills
    counts: str  # what the GB/s counts
    needs_gpu: bool = True
    needs: tuple[str, ...] = ()  # keyword arguments the probe needs (`Context.ceiling(name, **where)`)


CEILINGS: dict[str, CeilingDef] = {
    "d2d_copy": CeilingDef(d2d_copy, "d2d_copy_gbps", "bytes read + written"),
    "h2d_pinned": CeilingDef(h2d_pinned, "h2d_pinned_gbps", "bytes moved host->device"),
    "d2h_pinned": CeilingDef(d2h_pinned, "d2h_pinned_gbps", "bytes moved device->host"),
    "h2d_pageable": CeilingDef(h2d_pageable, "h2d_pageable_gbps", "bytes moved host->device"),
    "d2h_pageable": CeilingDef(d2h_pageable, "d2h_pageable_gbps", "bytes moved device->host"),
    "bidir_pinned": CeilingDef(bidir_pinned, "bidir_pinned_gbps", "bytes of both directions"),
    "peer_copy": CeilingDef(peer_copy, "peer_copy_gbps", "bytes moved GPU 0 -> GPU 1"),
    "host_memcpy": CeilingDef(host_memcpy, "host_memcpy_gbps", "bytes copied", needs_gpu=False),
    "disk_write": CeilingDef(disk_write, "disk_write_gbps", "bytes written + fsync", False, ("root",)),
    "disk_read": CeilingDef(disk_read, "disk_read_gbps", "bytes read from the device", False, ("root",)),
    "redis_loopback_set": CeilingDef(
        redis_loopback_set, "redis_loopback_set_gbps", "payload bytes SET", False, ("url", "part_bytes")
    ),
    "redis_loopback_get": CeilingDef(
        redis_loopback_get, "redis_loopback_get_gbps", "payload bytes GET", False, ("url", "part_bytes")
    ),
}
