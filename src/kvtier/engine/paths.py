"""Which copy path a job takes: the rule, with the measurements behind it.

Paths (all move the same block-major chunk, so a chunk saved one way loads any way):

- "staged": a short GPU gather (HBM speed) into one of two staging buffers, then one large
  pinned DMA per buffer on the copy engine, pipelined (ops.save_staged / load_staged).
- "kernel": one Triton kernel reads/writes the pinned slot through UVA, on a persistent grid
  capped at `uva_ctas` CTAs (default: a quarter of the SMs).
- "batch": `cudaMemcpyBatchAsync` (CUDA >= 12.8, through cuda-bindings): every piece handed
  to the copy engine in one call; no SM at all.

The rule of `path="auto"` (H200, benchmarks/results/nvidia-h200-2026-11-29.json):

- save -> "staged". It reached 98.7-99.1% of pinned D2H where the UVA kernel reached 93-95%,
  and during its DMAs it holds no SM: a matmul beside bulk DMA lost 0.9%, beside a full-grid
  UVA kernel it ran 5.4x slower.
- load -> "staged" when compute runs beside (~97% of pinned H2D, SMs only for the short HBM
  scatters); when nothing computes beside and per-layer events are asked, "kernel" (~90% of
  H2D), whose per-layer launches give a true event per layer, so layer i can start as soon as
  it has arrived. Staged loads give every layer the job's final event.
- "batch" only for pieces (one K or V block of one layer) of at least `BATCH_MIN_PIECE` and
  when the API is present: at 32 KiB pieces it ran at 56% of the ceiling with 0.75 us of CPU per
  piece. The 4 MiB threshold is not measured yet: it is where the per-piece submit cost falls
  under 1% of the piece's transfer time at 55 GB/s.

`path=` (engine-wide or per job) overrides the rule.
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


def job_path(engine, direction: str, path: str | None, per_layer: bool = False) -> Path:
    """The path of one of `engine`'s jobs: `path=` if given (checked against the mover), else the
    engine's own (`auto`: `choose_path` for its cache and options), decided and checked once per
    direction and per_layer and kept in `engine._auto` (kv and options are fixed)."""
    if path is None and (p := engine._auto.get((direction, per_layer))) is not None:
        return p
    p = parse_path(path) if path is not None else engine.path
    if p is Path.AUTO:
        kv, beside = engine.kv, engine.compute_beside
        piece = kv.piece_numel * kv.dtype.itemsize
        p = choose_path(direction, piece_nbytes=piece, per_layer=per_layer, compute_beside=beside,
                        batch_ok=engine.mover.batch_available)  # fmt: skip
    engine.mover.check_path(p)
    if path is None:  # the engine's own path: fixed, so decided and checked once
        engine._auto[(direction, per_layer)] = p
    return p
