"""Measured ceilings: the file `kvtier probe --save FILE` writes and `roofline` / `path` read
(`--ceilings FILE`) to replace datasheet figures with what this machine really does.

Format (JSON, version 1)::

    {
      "kvtier_ceilings": 1,
      "gpu": "NVIDIA H200",              # name as the driver reports it
      "gpu_key": "h200",                 # kvtier specs key, or null when unknown
      "measured_at": "2026-11-29T15:00:00Z",
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

Pure Python: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT_VERSION = 1

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
}


class CeilingsError(ValueError):
    """A ceilings file that cannot be used."""


@dataclass(slots=True)
class Ceilings:
    figures: dict[str, float] = field(default_factory=dict)
    gpu: str | None = None
    gpu_key: str | None = None
    measured_at: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        for name, value in self.figures.items():
            if name not in FIGURES:
                raise CeilingsError(f"figures: unknown figure {name!r}; known: {', '.join(FIGURES)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise CeilingsError(f"figures.{name}: expected a positive number, got {value!r}")

    def get(self, name: str) -> float | None:
        return self.figures.get(name)

    def to_json(self) -> dict:
        return {
            "kvtier_ceilings": FORMAT_VERSION,
            "gpu": self.gpu,
            "gpu_key": self.gpu_key,
            "measured_at": self.measured_at,
            "source": self.source,
            "figures": dict(self.figures),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: object, where: str = "ceilings") -> Ceilings:
        if not isinstance(data, dict) or data.get("kvtier_ceilings") != FORMAT_VERSION:
            raise CeilingsError(f'{where}: not a kvtier ceilings file (needs "kvtier_ceilings": 1)')
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
