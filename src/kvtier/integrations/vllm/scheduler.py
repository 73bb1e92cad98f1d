"""SchedulerSide: the connector's half in vLLM's scheduler process (no torch tensors, no GPU).

It decides; the workers move. Per request it names the chunks by vLLM's block hashes
(`chunk_ids`) and answers vLLM from what it knows the workers hold:

    lookup(request, num_computed)      -> (tokens, False) | (None, False)   no side effects but
                                          one: a chunk only a shared lower tier holds starts a
                                          prefetch into the hosts, and vLLM asks again until it
                                          landed (or ``prefetch_timeout_s`` passed)
    after_alloc(request, blocks, n)       a hit becomes a load into the blocks vLLM allocated
    build_meta(scheduler_output)          loads, saves of newly computed full chunks, prefetches,
                                          preempted requests -> `KVTierMetadata`
    update(connector_output)              the workers' reports: chunks held / lost, prefetches done
    finished(request)                     True while its saves may still read its blocks

What the workers hold is an index fed by their reports: a chunk counts only once every TP rank
reported it (a rank alone cannot load a prefix). It is a hint: a chunk the hosts evicted since
(and no lower tier keeps) makes the load deliver less, and the worker reports those blocks
(`get_block_ids_with_load_errors`): vLLM recomputes them, never reads wrong KV.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .chunk_ids import chunk_ids, chunk_keys
from .metadata import ChunkRun, KVTierMetadata, KVTierWorkerMetadata
from .settings import VllmSettings

log = logging.getLogger(__name__)


@dataclass
class _Req:
    request: object
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # chunks of the prefix sent to be saved (or loaded: held already)
    load: ChunkRun | None = None
    any_save: bool = False


class SchedulerSide:
    """settings: `VllmSettings`. block_size / hash_block_size: vLLM's (tokens per block, per
    block hash). tp_size: workers per engine that must all hold a chunk. redis: a `RedisTier`
    shared with other instances, asked for chunks this instance's workers never reported
    (None: no such lookup)."""

    def __init__(
        self, settings: VllmSettings, block_size: int, hash_block_size: int, tp_size: int, redis=None
    ):
        self.settings = settings
        self.chunk_tokens = ct = settings.chunk_tokens_for(block_size)
        if ct % hash_block_size:
            raise ValueError(f"chunk_tokens={ct}: a multiple of vLLM's hash_block_size={hash_block_size}")
        self.hash_block_size, self.blocks_per_chunk = hash_block_size, ct // block_size
        self.hashes_per_chunk = ct // hash_block_size
        self.all_ranks = (1 << tp_size) - 1
        self.tp_size, self.redis = tp_size, redis
        self._held: OrderedDict[bytes, int] = OrderedDict()  # chunk id -> mask of ranks holding it
        self._reqs: dict[str, _Req] = {}
        self._hits: dict[str, int] = {}  # req id -> chunks of its last lookup's hit
        self._prefetching: dict[str, float] = {}  # req id -> deadline (0: settled)
        self._prefetch_done: dict[str, int] = {}
        self._prefetch_out: list[ChunkRun] = []
        self._extra: tuple | None = None  # the workers' key fields, for the shared-tier lookup

    # -- vLLM's hooks --------------------------------------------------------------------------

    def lookup(self, request, num_computed: int) -> tuple[int | None, bool]:
        rid, ct = request.request_id, self.chunk_tokens
        # vLLM computes at least the last prompt token itself: a hit stops before it.
        ids = chunk_ids(
            request.block_hashes, self.hashes_per_chunk, request.num_tokens - 1, self.hash_block_size
        )
        n = self._held_prefix(ids)
        if self.redis is not None and self._extra is not None and n < len(ids):
            deadline = self._prefetching.get(rid)
            if deadline is None:
                more = self._shared_prefix(ids[n:])
                if more:  # only a shared tier has them: into the hosts first, vLLM asks again
                    self._prefetching[rid] = time.monotonic() + self.settings.prefetch_timeout_s
                    self._prefetch_out.append(ChunkRun(rid, ids[: n + more], []))
                    return None, False
                self._prefetching[rid] = 0.0
            elif (
                deadline and self._prefetch_done.get(rid, 0) != self.all_ranks and time.monotonic() < deadline
            ):
                return None, False  # a lower tier is still being read
            else:
                self._prefetching[rid] = 0.0
        self._hits[rid] = n
        if num_computed % ct or n * ct <= num_computed:
            return 0, False  # a chunk is never loaded over blocks vLLM already computed or shares
        return n * ct - num_computed, False

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        st = self._reqs.setdefault(rid, _Req(request))
        st.request = request
        if num_external_tokens <= 0:
            return
        n, ct, bpc = self._hits.get(rid, 0), self.chunk_tokens, self.blocks_per_chunk
        first = n - num_external_tokens // ct
        ids = chunk_ids(request.block_hashes, self.hashes_per_chunk, n * ct, self.hash_block_size)
        block_ids = list(blocks.get_block_ids()[0])
        st.load = ChunkRun(rid, ids[first:n], block_ids[first * bpc : n * bpc])
        st.saved = max(st.saved, n)  # loaded chunks are held already: not saved again

    def build_meta(self, so) -> KVTierMetadata:
        meta = KVTierMetadata(preempted=set(so.preempted_req_ids or ()))
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # after a preemption: every block is new
                st.block_ids = list(nb[0]) if nb else []
            elif nb:
                st.block_ids.extend(nb[0])
            computed[rid] = cached.num_computed_tokens[i]
        for rid, before in computed.items():
            st = self._reqs[rid]
            if st.load is not None:
                meta.loads.append(st.load)
                st.load = None
            self._add_save(meta, st, rid, before + so.num_scheduled_tokens.get(rid, 0))
        for rid in meta.preempted:
            st = self._reqs.get(rid)
            if st is not None:
                st.block_ids, st.load = [], None
        meta.prefetches, self._prefetch_out = self._prefetch_out, []
        return meta

    def update(self, connector_output) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVTierWorkerMetadata):
            return
        if wm.extra is not None:
            self._extra = wm.extra
        for cid, mask in wm.held.items():
            self._held[cid] = self._held.get(cid, 0) | mask
            self._held.move_to_end(cid)
        for cid, mask in wm.lost.items():
            left = self._held.get(cid, 0) & ~mask
            if left:
                self._held[cid] = left
            else:
                self._held.pop(cid, None)
        while len(self._held) > self.settings.index_entries:
            self._held.popitem(last=False)
        for rid, mask in wm.prefetched.items():
            if rid in self._prefetching:
                self._prefetch_done[rid] = self._prefetch_done.get(rid, 0) | mask

    def finished(self, request) -> bool:
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        for d in (self._hits, self._prefetching, self._prefetch_done):
            d.pop(rid, None)
        return bool(st is not None and st.any_save)

    # -- internals -----------------------------------------------------------------------------

    def _add_save(self, meta: KVTierMetadata, st: _Req, rid: str, computed_after: int) -> None:
        """The full chunks whose KV this step completes: saved after the forward wrote them."""
        ids = chunk_ids(st.request.block_hashes, self.hashes_per_chunk, computed_after, self.hash_block_size)
        bpc = self.blocks_per_chunk
        n = min(len(ids), len(st.block_ids) // bpc)
        if n > st.saved:
            meta.saves.append(ChunkRun(rid, ids[st.saved : n], st.block_ids[st.saved * bpc : n * bpc]))
            st.saved, st.any_save = n, True

    def _held_prefix(self, ids: list[bytes]) -> int:
        n = 0
        for cid in ids:
            if self._held.get(cid, 0) != self.all_ranks:
                break
            n += 1
        return n

    def _shared_prefix(self, ids: list[bytes]) -> int:
        """How many of ``ids`` (from the first) the shared tier holds for every rank."""
        from kvtier.store.keys import KeyExtra

        model, dtype, layout, tp_size, salt = self._extra
        n = len(ids)
        try:
            for rank in range(tp_size):
                extra = KeyExtra(model, dtype, layout, rank, tp_size, salt)
                found = self.redis.contains_many(chunk_keys(ids[:n], extra, self.settings.hash_name))
                n = next((i for i, f in enumerate(found) if not f), len(found))
                if n == 0:
                    break
        except Exception as exc:  # a failing shared tier is a miss, never a scheduler crash
            log.warning("kvtier: shared-tier lookup failed: %s", exc)
            return 0
        return n
