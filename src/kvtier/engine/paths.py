"""Which copy path a job takes: the rule, and the reasons behind it.

Paths (all move the same block-major chunk, so a chunk saved one way loads any way):

- "staged": a short GPU gather (HBM speed) into one of two staging buffers, then one large
  pinned DMA per buffer on the copy engine, pipelined (ops.save_staged / load_staged).
- "kernel": one Triton kernel reads/writes the pinned slot through UVA, on a persistent grid
  capped at `uva_ctas` CTAs (default: a quarter of the SMs).
- "batch": `cudaMemcpyBatchAsync` (CUDA >= 12.8): every copy of the job (a run of pieces adjacent
  in the cache and in the chunk) handed to the copy engine in one call; no SM at all.

The rule of `path="auto"`:

- save -> "staged". Large pinned DMAs come closer to the link's ceiling than a UVA kernel, and
  during its DMAs the staged path holds no SM: a matmul beside bulk DMA barely slows, beside a
  full-grid UVA kernel it slows several times.
- load -> "staged" when compute runs beside (SMs only for the short HBM scatters); when nothing
  computes beside and per-layer events are asked, "kernel", whose per-layer launches give a true
  event per layer, so layer i can start as soon as it has arrived. Staged loads give every layer
  the job's final event.
- before both: "batch" when the API is present and the job's copies are long runs:
  `run_nbytes`, the smallest copy of a full block once pieces adjacent in the cache and in the
  chunk alike are joined (`fastpath/batch.run_nbytes`: a block's whole run in vLLM's BLHNC /
  BLNHC, else a layer's adjacent pieces or one piece), at least `BATCH_MIN_RUN`. Each copy costs
  the host a fixed submit time and the copy engine a fixed setup, so short runs stay well under
  the link's ceiling; from `BATCH_MIN_RUN` on, a run's transfer time over a PCIe link dwarfs
  both, and the job then holds no SM and no staging buffer at all. The threshold sits a power
  of two below a 16-token bf16 block of Llama-3-8B in a B-first order (2 MiB), so such blocks
  and their fp8 twins (1 MiB) go straight to DMA while L-first orders' per-layer pages (tens of
  KiB) stay staged. Loads on "batch" give every layer the job's final event, as staged ones do.

`path=` (engine-wide in `EngineConfig`, or per job) overrides the rule.
"""

from __future__ import annotations

import enum


class Path(enum.StrEnum):
    AUTO = "auto"
    STAGED = "staged"
    KERNEL = "kernel"
    BATCH = "batch"


BATCH_MIN_RUN = 1 << 20  # bytes of a copy; the reason: the module docstring


def parse_path(path: str | Path, name: str = "path") -> Path:
    """`path` as a Path; ValueError naming `name` when it is none of them."""
    try:
        return Path(path)
    except ValueError:
        raise ValueError(f"{name}: expected one of {[p.value for p in Path]}, got {path!r}") from None


def choose_path(
    direction: str,
    *,
    run_nbytes: int,
    per_layer: bool = False,
    compute_beside: bool = True,
    batch_ok: bool = False,
) -> Path:
    """The path `auto` picks for a "save" or "load" (rule and reasons: module docstring);
    `run_nbytes`: the bytes of the smallest copy of a full block on the batch path."""
    if direction not in ("save", "load"):
        raise ValueError(f"direction: expected 'save' or 'load', got {direction!r}")
    if batch_ok and run_nbytes >= BATCH_MIN_RUN:
        return Path.BATCH
    if direction == "load" and per_layer and not compute_beside:
        return Path.KERNEL
    return Path.STAGED
