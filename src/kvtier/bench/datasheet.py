"""The datasheet figure each measured ceiling is compared with, from `kvtier.specs`.

Reached through this one adapter so that a GPU or link missing from the table (or specs fields
renamed) gives "no datasheet value" instead of a crash in the middle of a probe.
"""

from __future__ import annotations

from typing import Any


def gpu_spec(device_name: str | None) -> Any | None:
    """specs.GPU for a name as the driver reports it ("NVIDIA H200"), or None."""
    if not device_name:
        return None
    try:
        from kvtier.specs import gpu_from_device_name
    except ImportError:
        return None
    try:
        return gpu_from_device_name(device_name)
    except Exception:
        return None


def pcie_link(gen: Any, width: Any) -> dict | None:
    """{name, theoretical_gbps, typical_gbps, source} of PCIe `gen` scaled to `width` lanes (the
    table's figures are for x16, per direction), or None when unknown."""
    if not isinstance(gen, int) or gen <= 0:
        return None
    try:
        from kvtier.specs import LINKS
    except ImportError:
        return None
    link = LINKS.get(f"pcie{gen}")
    if link is None:
        return None
    lanes = width if isinstance(width, int) and width > 0 else 16
    scale = lanes / 16
    theo = getattr(link, "theoretical_gbps", None)
    typ = getattr(link, "typical_gbps", None)
    return {
        "name": f"PCIe Gen{gen} x{lanes}",
        "theoretical_gbps": theo * scale if theo else None,
        "typical_gbps": typ * scale if typ else None,
        "source": getattr(link, "source", None),
    }


def reference_values(gpu: Any | None, link: dict | None) -> dict[str, tuple[float, str]]:
    """figure name -> (datasheet value, what it is) for the figures a probe measures."""
    out: dict[str, tuple[float, str]] = {}
    hbm = getattr(gpu, "mem_bw_gbps", None) if gpu is not None else None
    if hbm:
        for name in ("d2d_copy_gbps", "d2d_sm_copy_gbps"):
            out[name] = (float(hbm), f"{gpu.name} HBM bandwidth (a copy reads and writes it)")
    tflops = getattr(gpu, "bf16_tflops", None) if gpu is not None else None
    if tflops:
        out["bf16_tflops"] = (float(tflops), f"{gpu.name} dense bf16")
    if link and link.get("theoretical_gbps"):
        one_way = float(link["theoretical_gbps"])
        for name in (
            "h2d_pinned_gbps",
            "d2h_pinned_gbps",
            "h2d_pageable_gbps",
            "d2h_pageable_gbps",
            "h2d_sm_copy_gbps",
            "d2h_sm_copy_gbps",
        ):
            out[name] = (one_way, f"{link['name']}, one direction")
        out["bidir_pinned_gbps"] = (2 * one_way, f"{link['name']}, both directions")
    return out
