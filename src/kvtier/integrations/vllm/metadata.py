"""What the scheduler side sends the workers each step, and what the workers send back.

    KVTierMetadata        scheduler -> workers: loads, saves, preempted requests, finished
                          requests to release once their saves completed, the step's number
    KVTierWorkerMetadata  workers -> scheduler: the tier keys each rank's local tiers now hold or
                          lost, each load's outcome per rank, tiers down / up again, the rates
                          their loads measured, the step reported, the key fields (merged over
                          ranks by ``aggregate``)

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
    workers report it received, so no forward waits for it; ``tiers``, per chunk of ``ids``, the
    tier the scheduler found it in ("host" or a lower tier's name; empty: the host); ``budget_s``,
    how long a background load's lower-tier reads may run from the step that sends it (the
    plan's deadline; None: the ``prefetch_timeout_s`` setting). Several KV cache groups:
    ``group``, the group whose blocks these are (``ids`` name each chunk's unit there,
    `groups.Group`); ``parts``, the runs of one load (one per group, sharing its ``tag``)."""

    req_id: str
    ids: list[bytes]
    block_ids: list[int]
    skip: int = 0
    tag: int = 0
    background: bool = False
    tiers: tuple[str, ...] = ()
    budget_s: float | None = None
    group: int = 0
    parts: int = 1


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[ChunkRun] = field(default_factory=list)
    saves: list[ChunkRun] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    release: set[str] = field(default_factory=set)  # finished, no save to come: report once saved
    step: int = 0  # the scheduler's number of this step (0: none), reported back by the workers
    # Block ids vLLM handed out in this step (every group; only with a sliding-window group, whose
    # blocks vLLM frees while the request runs): pending saves reading any of them are waited for.
    fresh: set[int] = field(default_factory=set)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """held / lost: tier keys (each names one rank's chunk) that a rank's host now holds / that no
    local tier of it holds any more; below: tier key -> the name of the rank's lower local tier
    (its disk) that holds it while the host does not; loaded / failed: load tag -> bit mask of
    the ranks whose load delivered every block / not; down / up: lower tiers a rank found down or
    stalled / answering again; rates: tier -> (GB/s, fixed s) its loads measured ("host": their
    copies into the GPU); step: the scheduler's number of the step reported (0: none);
    chunk_bytes: one rank's bytes of a chunk and extra: (model, kv_dtype, layout, tp_size, salt)
    of the ranks' keys, once; extras / groups / group_bytes: with several KV cache groups (or kinds
    of layer in one), those fields per group (the layout carries the group), the `groups.Group`s
    and one rank's bytes of each group's unit of a chunk, once: the
    scheduler's own config may show one group where the workers' holds several kinds of layer
    (vLLM hands its scheduler one spec of a `UniformTypeKVCacheSpecs`). ``aggregate`` merges two
    ranks' reports."""

    held: set[bytes] = field(default_factory=set)
    lost: set[bytes] = field(default_factory=set)
    loaded: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    extra: tuple | None = None
    below: dict[bytes, str] = field(default_factory=dict)
    down: set[str] = field(default_factory=set)
    up: set[str] = field(default_factory=set)
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)
    step: int = 0
    chunk_bytes: int = 0
    extras: tuple = ()
    groups: tuple = ()
    group_bytes: tuple = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVTierWorkerMetadata):
            return self
        rates = dict(self.rates)
        for tier, (gbps, fixed) in other.rates.items():  # the slowest rank's: every rank must land
            mine = rates.get(tier)
            rates[tier] = (gbps, fixed) if mine is None else (min(mine[0], gbps), max(mine[1], fixed))
        return KVTierWorkerMetadata(
            self.held | other.held,
            self.lost | other.lost,
            _or(self.loaded, other.loaded),
            _or(self.failed, other.failed),
            self.extra or other.extra,
            self.below | other.below,
            self.down | other.down,
            self.up | other.up,
            rates,
            max(self.step, other.step),
            max(self.chunk_bytes, other.chunk_bytes),
            self.extras or other.extras,
            self.groups or other.groups,
            tuple(map(max, self.group_bytes, other.group_bytes)) or self.group_bytes or other.group_bytes,
        )

    def is_empty(self) -> bool:
        return not (
            self.held
            or self.lost
            or self.loaded
            or self.failed
            or self.extra
            or self.below
            or self.down
            or self.up
            or self.rates
            or self.step
        )


def _or(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, m in b.items():
        out[k] = out.get(k, 0) | m
    return out
