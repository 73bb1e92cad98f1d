"""Chunk payloads as flat byte views, without copies.

A payload is ``bytes`` / ``bytearray`` / ``memoryview`` or a contiguous CPU ``torch.uint8``
tensor (e.g. a pinned pool slot). Tiers only ever see the flat ``memoryview`` made here;
torch is imported by nobody in this package — a tensor is recognised by duck typing.
"""

from __future__ import annotations

import mmap

PAGE = 4096


def as_view(payload, name: str = "payload") -> memoryview:
    """A 1-D unsigned-byte ``memoryview`` over ``payload``'s memory (no copy)."""
    if type(payload).__module__.startswith("torch"):
        if payload.device.type != "cpu":
            raise ValueError(
                f"{name} must be a CPU tensor (copy GPU KV to a host slot first), got {payload.device}"
            )
        if str(payload.dtype) != "torch.uint8":
            raise ValueError(f"{name} must be a torch.uint8 tensor, got {payload.dtype}")
        if not payload.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        payload = payload.reshape(-1).numpy()  # shares memory with the tensor
    try:
        view = memoryview(payload)
    except TypeError:
        raise ValueError(
            f"{name} must be bytes-like or a uint8 tensor, got {type(payload).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError(f"{name} must be contiguous")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


def as_writable_view(dest, name: str = "dest") -> memoryview:
    """Like ``as_view`` but the memory must be writable (a destination of a read)."""
    view = as_view(dest, name)
    if view.readonly:
        raise ValueError(f"{name} must be writable (bytearray, writable memoryview or a uint8 tensor)")
    return view


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous buffer of ``nbytes`` rounded up to a page (for O_DIRECT)."""
    return mmap.mmap(-1, max(PAGE, round_up(nbytes, PAGE)))


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align
