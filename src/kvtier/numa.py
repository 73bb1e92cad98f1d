"""Best-effort NUMA placement of pinned memory near the GPU: allocate and first-touch the pages
from a thread bound to the node's CPUs (Linux sysfs + sched_setaffinity); elsewhere, a warning."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch


def _numa_cpus(node: int) -> set[int] | None:
    """CPUs of NUMA `node` from sysfs, or None where that is unavailable."""
    try:
        with open(f"/sys/devices/system/node/node{node}/cpulist") as f:
            text = f.read().strip()
    except OSError:
        return None
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus or None


def allocate_near(
    alloc: Callable[[int], torch.Tensor], sizes: list[int], node: int | None
) -> tuple[list[torch.Tensor], bool]:
    """(buffers of `sizes` from `alloc`, whether they were placed on NUMA `node`)."""
    cpus = _numa_cpus(node) if node is not None else None
    if node is not None and (cpus is None or not hasattr(os, "sched_setaffinity")):
        warnings.warn(f"NUMA node {node} unknown here; slab not placed", stacklevel=4)
        cpus = None
    old = os.sched_getaffinity(0) if cpus else None
    old_threads = torch.get_num_threads()
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
            # One thread: torch's worker threads have their own affinity and would
            # first-touch pages on their nodes.
            torch.set_num_threads(1)
        chunks = [alloc(n) for n in sizes]
        if cpus:
            for c in chunks:
                c.zero_()  # first touch decides the page's node
        return chunks, bool(cpus)
    finally:
        if old is not None:
            os.sched_setaffinity(0, old)
            torch.set_num_threads(old_threads)
