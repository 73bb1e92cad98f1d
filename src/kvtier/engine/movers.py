"""The bytes of a job, per device. The engine owns the protocol (waits, events, trackers); a
mover only enqueues the copy work on the stream it is given (plus helper streams that it orders
before that stream's next record), so an event recorded on that stream after `save`/`load`
returns marks the whole job done.

    MoverContext  what a mover is given: the device, the cache, the engine's config
                  (the engine picks the mover for its device when it is made)
    SimMover      SimDevice: `kvtier.reference` gather/scatter launched as "kernels", and
                  `dev.copy` as the DMA, so the bytes really land late on the CPU (sim_mover.py)
    CudaMover     CudaDevice: `kvtier.ops` (Triton) -- staged, kernel (UVA), batch (cuda_mover.py)

Every mover takes the job's ids as `CheckedIds` (`engine/ids.py`), checked once at the engine's
entry: it trusts them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtier.device.base import Device
from kvtier.engine.config import EngineConfig
from kvtier.layout import PagedKV


@dataclass(frozen=True, slots=True)
class MoverContext:
    """What a mover needs of its engine, and nothing else."""

    device: Device
    kv: PagedKV
    config: EngineConfig


def layer_kv(kv: PagedKV, layer: int) -> PagedKV:
    """The one-layer cache of layer `layer` (for the reference scatter of one layer)."""
    return dataclasses.replace(kv, layers=(kv.layers[layer],), layer_offsets=(0,), base=0, plans={})
