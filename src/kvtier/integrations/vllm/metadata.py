"""What the scheduler side sends the workers each step, and what the workers send back.

    KVTierMetadata        scheduler -> workers: loads, saves, prefetches, preempted requests
    KVTierWorkerMetadata  workers -> scheduler: chunks each rank now holds or lost, finished
                          prefetches, the key fields (summed over ranks by ``aggregate``)

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
    """Chunks ``ids`` of request ``req_id`` to move into / out of ``block_ids`` (bpc blocks
    per chunk, in order)."""

    req_id: str
    ids: list[bytes]
    block_ids: list[int]


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[ChunkRun] = field(default_factory=list)
    saves: list[ChunkRun] = field(default_factory=list)
    prefetches: list[ChunkRun] = field(default_factory=list)  # block_ids empty: into the host only
    preempted: set[str] = field(default_factory=set)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """held / lost: chunk id -> bit mask of the TP ranks that now hold / lost it; prefetched:
    req id -> mask of the ranks whose prefetch finished; extra: (model, kv_dtype, layout,
    tp_size, salt) once a worker registered its cache. ``aggregate`` ORs the masks."""

    held: dict[bytes, int] = field(default_factory=dict)
    lost: dict[bytes, int] = field(default_factory=dict)
    prefetched: dict[str, int] = field(default_factory=dict)
    extra: tuple | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        return KVTierWorkerMetadata(
            _or(self.held, other.held),
            _or(self.lost, other.lost),
            _or(self.prefetched, other.prefetched),
            self.extra or other.extra,
        )

    def is_empty(self) -> bool:
        return not (self.held or self.lost or self.prefetched or self.extra)


def _or(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, m in b.items():
        out[k] = out.get(k, 0) | m
    return out
