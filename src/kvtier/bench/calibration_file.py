"""A calibration file (`kvtier calibrate --save`), plain Python: write, read and check it, the rates
its fits say the machine reaches, and what the planner takes from it."""

from __future__ import annotations

import json
from pathlib import Path

FORMAT_VERSION = 1


def save(doc: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load(path: str | Path) -> dict:
    """A calibration file written by `kvtier calibrate --save`; ValueError naming what is wrong."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"calibration: cannot read {str(path)!r}: {e}") from None
    if not isinstance(doc, dict) or doc.get("kvtier_calibration") != FORMAT_VERSION:
        raise ValueError(
            f'calibration: {str(path)!r} is not a kvtier calibration (needs "kvtier_calibration": 1)'
        )
    fits = doc.get("fits")
    ok = isinstance(fits, dict) and fits and isinstance(doc.get("gpu_spec"), dict)
    for f in fits.values() if ok else ():
        ok = ok and isinstance(f, dict) and all(_positive(f.get(k)) for k in ("efficiency", "fit_points"))
    if not ok or not isinstance(doc.get("ceilings"), dict):
        raise ValueError(f"calibration: {str(path)!r} lacks fits, gpu_spec or ceilings, or has bad ones")
    return doc


def _positive(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def effective_rates(doc: dict) -> dict[str, float]:
    """What the fits say the machine really reaches: prefill TFLOP/s, H2D GB/s, decode HBM GB/s."""
    fits, spec = doc["fits"], doc["gpu_spec"]
    out = {}
    if "prefill" in fits:
        out["prefill_tflops"] = spec["bf16_tflops"] * fits["prefill"]["efficiency"]
    if "h2d" in fits:
        out["h2d_gbps"] = doc["ceilings"]["h2d_pinned_gbps"] * fits["h2d"]["efficiency"]
    if "decode" in fits:
        out["decode_gbps"] = spec["mem_bw_gbps"] * fits["decode"]["efficiency"]
    return out


def planner_inputs(doc: dict, peak_tflops: float) -> dict[str, float]:
    """What `planner.plan` takes from a calibration: the fitted prefill rate as an efficiency of
    `peak_tflops` (the bf16 rate the planner's GPU has), the fixed cost of a forward, the least
    time a forward through `generate` takes (0 in files made before it was measured), and the
    fitted H2D rate when the file has one."""
    rates = effective_rates(doc)
    out = {
        "efficiency": min(1.0, rates.get("prefill_tflops", peak_tflops) / peak_tflops),
        "prefill_overhead_ms": float(doc["fits"].get("prefill", {}).get("overhead_ms", 0.0)),
        "forward_floor_ms": float(doc.get("forward_floor_ms") or 0.0),
    }
    if "h2d_gbps" in rates:
        out["h2d_gbps"] = rates["h2d_gbps"]
    return out
