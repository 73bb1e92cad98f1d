"""Which copy path a job takes: the rule, and the reasons behind it.

Paths (all move the same block-major chunk, so a chunk saved one way loads any way):

- "staged": a short GPU gather (HBM speed) into one of two staging buffers, then one large
  pinned DMA per buffer on the copy engine, pipelined (ops.save_staged / load_staged).
- "kernel": one Triton kernel reads/writes the pinned slot through UVA, on a persistent grid
  capped at `uva_ctas` CTAs (default: a quarter of the SMs).
- "batch": `cudaMemcpyBatchAsync` (CUDA >= 12.8): every piece handed to the copy engine in one
  call; no SM at all.

The rule of `path="auto"`:

- save -> "staged". Large pinned DMAs come closer to the link's ceiling than a UVA kernel, and
  during its DMAs the staged path holds no SM: a matmul beside bulk DMA barely slows, beside a
  full-grid UVA kernel it slows several times.
- load -> "staged" when compute runs beside (SMs only for the short HBM scatters); when nothing
  computes beside and per-layer events are asked, "kernel", whose per-layer launches give a true
  event per layer, so layer i can start as soon as it has arrived. Staged loads give every layer
  the job's final event.
- "batch" only for pieces (one K or V block of one layer) of at least `BATCH_MIN_PIECE` and when
  the API is present: its CPU cost is per piece, and small pieces stay well under the link's
  ceiling. At `BATCH_MIN_PIECE` the per-piece submit cost is a small fraction of the piece's
  transfer time.

`path=` (engine-wide in `EngineConfig`, or per job) overrides the rule.
"""

from __future__ import annotations

import enum


class Path(enum.StrEnum):
    AUTO = "auto"
    STAGED = "staged"
    KERNEL = "kernel"
    BATCH = "batch"


BATCH_MIN_PIECE = 4 << 20  # bytes; see the module docstring


def parse_path(path: str | Path, name: str = "path") -> Path:
    """`path` as a Path; ValueError naming `name` when it is none of them."""
    try:
        return Path(path)
    except ValueError:
        raise ValueError(f"{name}: expected one of {[p.value for p in Path]}, got {path!r}") from None


def choose_path(
    direction: str,
    *,
    piece_nbytes: int,
    per_layer: bool = False,
    compute_beside: bool = True,
    batch_ok: bool = False,
) -> Path:
    """The path `auto` picks for a "save" or "load" (rule and reasons: module docstring)."""
    if direction not in ("save", "load"):
        raise ValueError(f"direction: expected 'save' or 'load', got {direction!r}")
    if batch_ok and piece_nbytes >= BATCH_MIN_PIECE:
        return Path.BATCH
    if direction == "load" and per_layer and not compute_beside:
        return Path.KERNEL
    return Path.STAGED
