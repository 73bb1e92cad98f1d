"""What the scheduler side sends the workers each step, and what the workers send back.

    KVTierMetadata        scheduler -> workers: loads, saves, prefetches, preempted requests,
                          finished requests to release once their saves completed
    KVTierWorkerMetadata  workers -> scheduler: the tier keys each rank's local tiers now hold or
                          lost, each load's outcome per rank, finished prefetches, the key fields
                          (merged over ranks by ``aggregate``)

Plain data (lists, bytes, ints): vLLM serialises both between processes. Without vLLM (the
`vllm` bench suite replaying the worker's hooks) the classes stand on plain bases.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # no vLLM (a replay of the worker's hooks): the same data without its bases

    class KVConnectorMetadata:  # noqa: D101 - stands in for vLLM's empty base
        pass

    class KVConnectorWorkerMetadata:  # noqa: D101
        pass


@dataclass
class ChunkRun:
    """Chunks ``ids`` of request ``req_id`` to move into / out of ``block_ids`` (bpc blocks per
    chunk, in order). Loads only: ``skip``, the first chunk's blocks vLLM holds already (its
    local prefix cache ends inside the chunk): ``block_ids`` starts at that chunk's block
    ``skip``; ``tag``, the number the workers report the load's outcome under; ``background``,
    an asynchronous load (vLLM's ``load_kv_async``): the request waits out of the batch until the
    workers report it received, so no forward waits for it."""

    req_id: str
    ids: list[bytes]
    block_ids: list[int]
    skip: int = 0
    tag: int = 0
    background: bool = False


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[ChunkRun] = field(default_factory=list)
    saves: list[ChunkRun] = field(default_factory=list)
    prefetches: list[ChunkRun] = field(default_factory=list)  # block_ids empty: into the host only
    preempted: set[str] = field(default_factory=set)
    release: set[str] = field(default_factory=set)  # finished, no save to come: report once saved


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """held / lost: tier keys (each names one rank's chunk) that a rank's local tiers (host,
    disk) now hold / no longer hold; loaded / failed: load tag -> bit mask of the ranks whose
    load delivered every block / not; prefetched: req id -> mask of the ranks whose prefetch
    finished; extra: (model, kv_dtype, layout, tp_size, salt) of the ranks' keys, once.
    ``aggregate`` merges two ranks' reports."""

    held: set[bytes] = field(default_factory=set)
    lost: set[bytes] = field(default_factory=set)
    loaded: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    prefetched: dict[str, int] = field(default_factory=dict)
    extra: tuple | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        return KVTierWorkerMetadata(
            self.held | other.held,
            self.lost | other.lost,
            _or(self.loaded, other.loaded),
            _or(self.failed, other.failed),
            _or(self.prefetched, other.prefetched),
            self.extra or other.extra,
        )

    def is_empty(self) -> bool:
        return not (self.held or self.lost or self.loaded or self.failed or self.prefetched or self.extra)


def _or(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, m in b.items():
        out[k] = out.get(k, 0) | m
    return out
