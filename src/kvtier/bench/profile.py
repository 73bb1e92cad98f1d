"""Seeing where time goes: named ranges (NVTX for Nsight Systems, record_function for the PyTorch
profiler) and a whole-run Chrome trace that opens in Perfetto (ui.perfetto.dev) or Nsight.

Without torch or without CUDA the ranges cost nothing and do nothing; NVTX calls on a CPU-only
torch build would raise, so they are used only when CUDA is there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """An NVTX range and a profiler range named `name` around the block."""
    torch = _torch()
    if torch is None:
        yield
        return
    nvtx = torch.cuda.is_available()
    with torch.profiler.record_function(name):
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


@contextlib.contextmanager
def chrome_trace(path: str | Path | None) -> Iterator[None]:
    """Record a PyTorch-profiler timeline of the block into `path` (Chrome trace JSON); None: no-op."""
    if path is None:
        yield
        return
    torch = _torch()
    if torch is None:
        raise ValueError("profile: writing a trace needs torch, which is not installed")
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise ValueError(f"profile: folder {str(path.parent)!r} does not exist")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False) as prof:
        yield
    prof.export_chrome_trace(str(path))
