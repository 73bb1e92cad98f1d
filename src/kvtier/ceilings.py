"""Measured ceilings: the file `kvtier probe --save FILE` writes and `roofline` / `path` read
(`--ceilings FILE`) to replace datasheet figures with what this machine really does.

Format (JSON, version 1)::

    {
      "kvtier_ceilings": 1,
      "gpu": "NVIDIA H200",              # name as the driver reports it
      "gpu_key": "h200",                 # kvtier specs key, or null when unknown
      "measured_at": "<ISO 8601 UTC time>",
      "source": "kvtier probe 0.1.0, torch 2.11.0, ...",
      "figures": {                       # every figure optional; units in the name
        "d2d_copy_gbps": 4237.0,         # bytes read + bytes written per second
        "h2d_pinned_gbps": 55.4,
        "d2h_pinned_gbps": 55.3,
        "h2d_pageable_gbps": 8.6,
        "d2h_pageable_gbps": 15.4,
        "bidir_pinned_gbps": 101.0,      # both directions at once, total
        "bf16_tflops": 700.0,            # dense matmul rate
        "launch_eager_us": 6.2,
        "launch_graph_us": 1.15,
        "host_memcpy_gbps": 10.0,
        "disk_write_gbps": 2.0,          # local disk: sequential write + fsync
        "disk_read_gbps": 2.0,           # local disk: sequential read, page cache bypassed
        "redis_loopback_set_gbps": 3.0,  # payload SET / GET through redis-py, server on loopback
        "redis_loopback_get_gbps": 0.6
      }
    }

Version 2 (`kvtier probe --all-gpus`) adds, all optional, and loads version 1 files as they are::

      "figures": {
        "h2d_pinned_all_gpus_gbps": 160.0,  # every GPU copies host->device at once: total
        "d2h_pinned_all_gpus_gbps": 150.0,
        "peer_gbps": 48.0                   # slowest GPU->GPU pair, bytes moved once
      },
      "multi_gpu": {                         # what the figures above came from
        "gpus": 4,                           # how many GPUs copied at once
        "h2d_pinned_gbps": [55.1, ...],      # each GPU alone, per GPU
        "h2d_pinned_all_gpus_gbps": [40.2, ...],  # each GPU while all copy at once
        "d2h_pinned_gbps": [...], "d2h_pinned_all_gpus_gbps": [...],
        "peer_gbps": [[null, 48.0], [47.9, null]],  # row: source GPU, column: destination
        "peer_access": [[null, true], [true, null]],
        "topology": [["X", "NODE"], ["NODE", "X"]],  # nvidia-smi topo -m names (NVML)
        "numa_nodes": [0, 1]
      }

A file without multi-GPU data is still written as version 1, so older readers keep reading it.

Pure Python: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MULTI_GPU_VERSION = 2  # written when `multi_gpu` or a multi-GPU figure is present
READABLE_VERSIONS = (1, 2)

# name -> unit/meaning, the figures a ceilings file may carry
FIGURES: dict[str, str] = {
    "d2d_copy_gbps": "GB/s, device-to-device copy, bytes read + written",
    "h2d_pinned_gbps": "GB/s, host->device from pinned memory",
    "d2h_pinned_gbps": "GB/s, device->host into pinned memory",
    "h2d_pageable_gbps": "GB/s, host->device from pageable memory",
    "d2h_pageable_gbps": "GB/s, device->host into pageable memory",
    "bidir_pinned_gbps": "GB/s, both directions at once (total)",
    "bf16_tflops": "TFLOP/s, dense bf16 matmul",
    "launch_eager_us": "us per tiny kernel launched eagerly",
    "launch_graph_us": "us per tiny kernel replayed from a CUDA graph",
    "host_memcpy_gbps": "GB/s, host memcpy (bytes copied)",
    "disk_read_gbps": "GB/s, local disk sequential read",
    "disk_write_gbps": "GB/s, local disk sequential write",
    "redis_loopback_set_gbps": "GB/s, payload SET to one Redis server on loopback (redis-py, in parts)",
    "redis_loopback_get_gbps": "GB/s, payload GET from one Redis server on loopback (redis-py, in parts)",
    "h2d_pinned_all_gpus_gbps": "GB/s, host->device, pinned, every GPU at once (total)",
    "d2h_pinned_all_gpus_gbps": "GB/s, device->host, pinned, every GPU at once (total)",
    "peer_gbps": "GB/s, GPU->GPU copy of the slowest pair (bytes moved once)",
    "peer_copy_gbps": "GB/s, GPU 0 -> GPU 1 copy (bytes moved once)",
}
MULTI_GPU_FIGURES = ("h2d_pinned_all_gpus_gbps", "d2h_pinned_all_gpus_gbps", "peer_gbps", "peer_copy_gbps")
MULTI_GPU_KEYS = (
    "gpus",
    "h2d_pinned_gbps",
    "h2d_pinned_all_gpus_gbps",
    "d2h_pinned_gbps",
    "d2h_pinned_all_gpus_gbps",
    "peer_gbps",
    "peer_access",
    "topology",
    "numa_nodes",
)


class CeilingsError(ValueError):
    """A ceilings file that cannot be used."""


@dataclass(slots=True)
class Ceilings:
    figures: dict[str, float] = field(default_factory=dict)
    gpu: str | None = None
    gpu_key: str | None = None
    measured_at: str | None = None
    source: str | None = None
    multi_gpu: dict | None = None  # per-GPU figures and matrices of `probe --all-gpus` (see above)

    def __post_init__(self) -> None:
        if self.multi_gpu is not None:
            if not isinstance(self.multi_gpu, dict):
                raise CeilingsError(f"multi_gpu: expected an object, got {type(self.multi_gpu).__name__}")
            unknown = set(self.multi_gpu) - set(MULTI_GPU_KEYS)
            if unknown:
                raise CeilingsError(
                    f"multi_gpu: unknown keys {sorted(unknown)}; known: {', '.join(MULTI_GPU_KEYS)}"
                )
            n = self.multi_gpu.get("gpus")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise CeilingsError(f"multi_gpu.gpus: expected a positive int, got {n!r}")
        for name, value in self.figures.items():
            if name not in FIGURES:
                raise CeilingsError(f"figures: unknown figure {name!r}; known: {', '.join(FIGURES)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise CeilingsError(f"figures.{name}: expected a positive number, got {value!r}")

    def get(self, name: str) -> float | None:
        return self.figures.get(name)

    @property
    def gpus_measured(self) -> int | None:
        """How many GPUs copied at once for the `*_all_gpus_*` figures (None: not measured)."""
        return self.multi_gpu.get("gpus") if self.multi_gpu else None

    def shared_gbps(self, direction: str, shared_by: int) -> float | None:
        """Per-GPU host<->GPU rate when `shared_by` GPUs copy at once, from measured figures.

        The measured total of all GPUs at once is the capacity they share; one GPU never gets
        more than it did alone. None when the file lacks the figures this needs.
        """
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"direction: must be 'h2d' or 'd2h', got {direction!r}")
        total = self.get(f"{direction}_pinned_all_gpus_gbps")
        alone = self.get(f"{direction}_pinned_gbps")
        if total is None or shared_by < 1:
            return None
        share = total / shared_by
        return min(alone, share) if alone is not None else share

    def to_json(self) -> dict:
        multi = self.multi_gpu is not None or any(k in self.figures for k in MULTI_GPU_FIGURES)
        out = {
            "kvtier_ceilings": MULTI_GPU_VERSION if multi else FORMAT_VERSION,
            "gpu": self.gpu,
            "gpu_key": self.gpu_key,
            "measured_at": self.measured_at,
            "source": self.source,
            "figures": dict(self.figures),
        }
        if self.multi_gpu is not None:
            out["multi_gpu"] = self.multi_gpu
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: object, where: str = "ceilings") -> Ceilings:
        if not isinstance(data, dict) or data.get("kvtier_ceilings") not in READABLE_VERSIONS:
            raise CeilingsError(f'{where}: not a kvtier ceilings file (needs "kvtier_ceilings": 1 or 2)')
        figures = data.get("figures", {})
        if not isinstance(figures, dict):
            raise CeilingsError(f'{where}: "figures" must be an object')
        try:
            return cls(
                figures={
                    k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                    for k, v in figures.items()
                },
                gpu=data.get("gpu"),
                gpu_key=data.get("gpu_key"),
                measured_at=data.get("measured_at"),
                source=data.get("source"),
                multi_gpu=data.get("multi_gpu"),
            )
        except CeilingsError as e:
            raise CeilingsError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Ceilings:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise CeilingsError(f"ceilings file {str(p)!r} does not exist") from None
        except (OSError, json.JSONDecodeError) as e:
            raise CeilingsError(f"ceilings file {str(p)!r} is not readable JSON: {e}") from None
        return cls.from_json(data, where=str(p))
