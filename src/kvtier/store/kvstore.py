"""KVStore: the API a serving engine calls — lookup / save / load / prefetch over the tiers.

Tiers, top down: the host (pinned pool slots, `HostTier`), then the lower `Tier`s given (e.g.
`DiskTier`, `RedisTier`). Chunk i of a request (``chunk_tokens`` tokens, whole blocks) covers
``block_ids[i*bpc:(i+1)*bpc]`` and is keyed by the hash chain of its whole prefix (`keys.py`):
KV of another model, dtype, layout or TP rank never matches.

- ``lookup``: the longest prefix of chunks some tier holds (chunks after a gap are useless).
- ``save``: one engine save job per chunk not held yet, into a pool slot that becomes a host
  entry once its event completed; the request's new chunks go in one engine call
  (``engine.save_slots``). Write-through pushes each saved chunk down from the writer thread;
  write-back pushes it only when the host evicts it.
- ``load``: the walk, chunk by chunk from ``first_chunk``: a host hit is pinned; a lower-tier
  hit is read into a pool slot (``get_into``), its header checked against this cache's
  shape/dtype/layout, and promoted into the host. Then the copies: per layer across every
  chunk (``engine.load_slots``, one launch per layer) where loads take the kernel path; else
  a lower tier's chunk is submitted as soon as the walk holds it, and host hits go together
  (``engine.load_slots`` on the staged / batch path: one engine call) when the walk reaches a
  lower tier's chunk or ends. A job per chunk either way. The first chunk no tier delivers
  ends the load: ``handle.tokens`` is what will arrive; the caller recomputes the rest.
- ``prefetch`` / ``fetch``: the same walk in the background (or on the calling thread),
  promoting without loading; ``load(..., lower=False)`` then copies what the host holds.

Failures of tiers (errors, timeouts, full, bad checksum or header, a chunk its key ring cannot
open) are misses, counted and logged, never raised; bad arguments raise ValueError naming them.
With ``auth_keys`` (`StoreConfig`), the lower tiers other processes can write seal every chunk
they store and load only chunks a holder of the keys sealed (`auth`). Pins keep every slot a
transfer or push touches out of eviction until the event that ends the transfer completed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from kvtier.engine import Path, parse_path
from kvtier.lifecycle import LifecycleError, SlotState
from kvtier.pool import PoolExhausted

from .auth import adopt, note_unauthenticated
from .chunking import ChunkFormat, request_block_ids
from .config import StoreConfig
from .handles import LoadHandle, Lookup, SaveHandle
from .host import HostEntry, HostTier
from .keys import KeyExtra, chunk_keys
from .metrics import StoreMetrics
from .read_rate import ReadRate
from .reaper import Reaper
from .stats import StoreStats
from .tier import Tier
from .tier_walk import delete_everywhere, read_first, where
from .writer import Push, Writer

log = logging.getLogger(__name__)

# A request's first chunks go to the engine on their own (one submission), the rest in one more:
# the copy engine starts on them while the host prepares the rest (tens of microseconds a chunk),
# whose copies then follow without a gap. Four chunks of a Llama-3-8B request (32 MiB each at 256
# tokens) keep a PCIe link busy longer than the host needs for the rest of a 1 GiB request.
LEAD_CHUNKS = 4


class _Taken(NamedTuple):
    """A chunk ready to be read by one load: entry pinned for it (kind "load") or a temporary
    slot no index holds (kind "temp", released when the load completed); tier: its source.
    Kind "present" (prefetch only, entry None): another request is already filling it."""

    entry: HostEntry | None
    kind: str
    tier: str
    acquired: bool = False  # a host hit, counted with the request's others (`HostTier.count_hits`)


class KVStore:
    """A prefix-keyed KV store over one engine's cache: the host tier plus ``tiers`` below it.

    engine: a `TransferEngine` (its cache, pool and trackers). model: the model identity (any
    string that changes when the weights do). tiers: the lower tiers, fastest first, with
    distinct names other than "host". config: a `StoreConfig`, or its fields as keyword
    arguments. metrics: where the host tier and the store count (pass the same `StoreMetrics`
    to the tiers for one registry). on_evict(keys): told of the keys of every chunk the host
    tier drops (evicted, deleted, or a fill that failed), from whichever thread drops them and
    under the host's lock: it must only note them and return (a lower tier's own evictions
    reach whoever made its policy: `EvictionPolicy.on_gone`).

    Tokens are token ids, a sequence of ints or a 1-D integer tensor ``[num_tokens]``; block ids
    are the request's GPU blocks in order, a sequence of ints or a 1-D integer tensor
    ``[num_blocks]``; chunk i covers ``block_ids[i*bpc:(i+1)*bpc]`` (bpc = chunk_tokens //
    block_size).

    >>> import torch
    >>> from kvtier.device import SimDevice
    >>> from kvtier.engine import TransferEngine
    >>> from kvtier.pool import PinnedPool
    >>> from kvtier.reference import random_cache
    >>> from kvtier.store import KVStore
    >>> dev = SimDevice()
    >>> kv = random_cache("vllm_flash", 2, 32, 16, 2, 64, torch.float16)  # 2 layers, 32 blocks of 16
    >>> engine = TransferEngine(dev, kv, PinnedPool(dev, 8 * kv.chunk_nbytes(2)))
    >>> store = KVStore(engine, "my-model@rev1", chunk_tokens=32)
    >>> tokens = list(range(100))  # 3 full chunks of 32 tokens, and 4 tokens not stored
    >>> store.save(tokens, range(7)).wait(5)
    True
    >>> store.lookup(tokens)
    Lookup(tokens=96, tiers=('host', 'host', 'host'))
    >>> store.load(tokens, range(10, 17)).tokens
    96

    The methods' examples continue this session, in the order they appear here.
    """

    def __init__(
        self,
        engine,
        model: str,
        *,
        tiers: tuple[Tier, ...] | list[Tier] = (),
        config: StoreConfig | None = None,
        metrics: StoreMetrics | None = None,
        on_evict: Callable[[list[bytes]], None] | None = None,
        **options,
    ) -> None:
        if config is not None and options:
            raise ValueError(f"give config or options, not both (got {sorted(options)})")
        self.config = cfg = config if config is not None else StoreConfig(**options)
        kv, pool = engine.kv, engine.pool
        self.fmt = fmt = ChunkFormat.of(kv, cfg.chunk_tokens, pool.alignment)
        self._tiers = tuple(tiers)
        names = [getattr(t, "name", None) for t in self._tiers]
        if not all(isinstance(t, Tier) for t in self._tiers) or len({*names, "host"}) <= len(names):
            raise ValueError(f"tiers must be Tier objects with distinct names other than 'host', got {names}")
        adopt(self._tiers, cfg.auth_keys)  # tiers other processes can write seal what they hold
        note_unauthenticated(self._tiers)
        self.engine, self.kv = engine, kv
        self.extra = KeyExtra(model, fmt.dtype, fmt.layout, cfg.tp_rank, cfg.tp_size, cfg.salt)
        self.write_back, self.promote = cfg.write_policy == "write_back", cfg.promote
        self.fetch_wait_s, self.alloc_timeout_s = float(cfg.fetch_wait_s), float(cfg.alloc_timeout_s)
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self.host = HostTier(
            cfg.host_capacity(pool.capacity, fmt.span),
            cfg.host_policy,
            release=self._release_slot,
            spill=self._spill if self.write_back and self._tiers else None,
            metrics=self.metrics,
            on_gone=on_evict,
        )
        self._counts: Counter[str] = Counter()
        self._counts_lock = threading.Lock()
        self.read_rate = ReadRate()  # each lower tier's delivered GB/s, for the planner
        self._writer = Writer(fmt.header, self.host, self._release_slot, self._count)
        self._reaper = Reaper(self._completed, self._count)
        self._reap, self._track = self._reaper.reap, self._reaper.track
        self._track_many = self._reaper.track_many
        for state in ("capacity", "used", "in_flight"):  # read at scrape time, never stale
            self.metrics.pool_bytes.labels(state).set_function(lambda s=state: getattr(pool.stats(), s))
        self._prefetcher = ThreadPoolExecutor(cfg.prefetch_workers, thread_name_prefix="kvtier-prefetch")
        self._closed = False

    # -- API ---------------------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The lower tiers, fastest first (the host tier is ``self.host``)."""
        return self._tiers

    def keys(self, tokens) -> list[bytes]:
        """The keys of the full chunks of ``tokens`` (``[num_tokens]``), in chunk order: the
        names this store's chunks have in every tier. No side effects.

        >>> [len(k) for k in store.keys(range(100))]  # 3 full chunks of 32 tokens
        [16, 16, 16]
        """
        bs, name = self.kv.block_size, self.config.hash_name
        return chunk_keys(tokens, self.fmt.tokens, bs, extra=self.extra, hash_name=name)

    def lookup(self, tokens) -> Lookup:
        """The longest chunk prefix of ``tokens`` (``[num_tokens]``) that some tier holds, and
        where each chunk is. No side effects; a hint (a load may still deliver less).

        >>> store.lookup(range(100))
        Lookup(tokens=96, tiers=('host', 'host', 'host'))
        """
        t0 = self._check_open()
        found = where(self.keys(tokens), self.host.contains, self._tiers)
        hit, asked = len(found) * self.fmt.tokens, len(tokens)
        self._count(lookups=1, lookup_tokens=hit, lookup_tokens_asked=asked, _call=("lookup", t0))
        return Lookup(len(found) * self.fmt.tokens, tuple(found))

    def save(self, tokens, block_ids, *, after=None, stream=None) -> SaveHandle:
        """Save the full chunks of ``tokens`` (``[num_tokens]``) from GPU blocks ``block_ids``
        (``[num_blocks]``, the request's blocks in order; at least bpc per full chunk).
        ``after``: an event on the compute stream recorded after these blocks' KV was written.
        ``stream``: the copy stream (`TransferEngine.save_slots`; None: the engine's save
        stream): the handle's events wait only for what runs there before them. Asynchronous:
        the handle's events complete when the blocks have been read (only then may they be
        overwritten). A chunk already held is skipped; a full pool ends the save. A
        save never evicts the earlier chunks of its own prefix (saved now or held already): a
        prefix longer than the host keeps its head (what a later lookup can use), and the chunks
        past the room are counted as failed.

        >>> h = store.save(range(100), range(7), after=dev.current_stream().record())
        >>> h.wait(5), h.tokens, h.skipped  # held already: nothing copied
        (True, 96, 3)
        """
        t0 = self._check_open()
        keys = self.keys(tokens)
        ids = self._block_ids(block_ids, need=len(keys) * self.fmt.blocks)
        self._reap()
        handle = SaveHandle(_on_done=self._reap)
        through = not self.write_back and bool(self._tiers)
        held: list[HostEntry] = []  # this save's chunks, pinned until it returns (see above)
        try:
            self._save_chunks(keys, ids, after, handle, through, held, stream)
        finally:
            for e in held:
                self.host.unpin(e)  # the save is over: its chunks may be evicted like any other
        h = handle
        self._count(saves=1, save_chunks_saved=h.saved, save_chunks_skipped=h.skipped, _call=("save", t0))
        self._count(save_chunks_failed=h.failed)
        return handle

    def _save_chunks(self, keys, ids, after, handle: SaveHandle, through: bool, held: list, stream) -> None:
        """Reserve the chunks from the first and save the new ones in engine submissions
        (`engine.save_slots`: a slot and a job per chunk): the first LEAD_CHUNKS as soon as they
        are reserved, so their copies run while the host reserves and submits the rest (one
        call). The first chunk that gets no host entry or no pool slot ends the save; it and
        the chunks after it count as failed."""
        dirty = self.write_back and bool(self._tiers)
        plan: list[HostEntry | None] = []  # per chunk from 0: its new entry, or None (held already)
        stop, why, sent, cut = len(keys), "", 0, None
        for i, key in enumerate(keys):
            entry, status = self.host.reserve(key, self.fmt.span, dirty=dirty)
            if status == "present":  # held, or being saved or fetched by another request
                if (got := self.host.hold(key)) is not None:
                    held.append(got)  # the later chunks of this save must not evict it either
            elif entry is None:
                stop, why = i, "the host tier is full of pinned chunks"
                break
            plan.append(entry)
            if i + 1 == LEAD_CHUNKS < len(keys):
                cut, why_cut = self._save_new(plan, 0, ids, after, handle, through, held, stream)
                sent = len(plan)
                if cut is not None:  # the pool is full already: nothing more is reserved
                    break
        if cut is None:
            cut, why_cut = self._save_new(plan, sent, ids, after, handle, through, held, stream)
        if cut is not None:
            stop, why = cut, why_cut
        handle.skipped += sum(e is None for e in plan[:stop])
        handle.tokens += stop * self.fmt.tokens  # each chunk before `stop` is saved or held already
        if stop < len(keys):
            log.info("kvstore: save stops at chunk %d of %d: %s", stop, len(keys), why)
            handle.failed = len(keys) - stop

    def _save_new(
        self, plan: list, first: int, ids, after, handle: SaveHandle, through: bool, held: list, stream
    ):
        """One engine submission of the new chunks of ``plan[first:]``. Returns (None, "") when
        every one got a slot, else (the first chunk without one, why); the entries without a slot
        are cancelled."""
        new = [i for i in range(first, len(plan)) if plan[i] is not None]
        if not new:
            return None, ""
        jobs, why, cut = [], "", None
        counts, wait_s = [self.fmt.blocks] * len(new), self.alloc_timeout_s
        try:
            chunks = self._chunks(ids, new)
            jobs = self.engine.save_slots(chunks, counts, after=after, timeout=wait_s, stream=stream)
        except PoolExhausted as exc:  # back-pressure: the rest is recomputed next time
            why = str(exc)
        except BaseException:
            for i in new:
                self.host.cancel(plan[i])  # nothing was submitted into a slot of these entries
            raise
        if len(jobs) < len(new):
            cut, why = new[len(jobs)], why or "the pool is full"
            for i in new[len(jobs) :]:
                self.host.cancel(plan[i])  # no slot was allocated: nothing to wait for
        saved = [(job, plan[i], "save") for i, job in zip(new[: len(jobs)], jobs, strict=True)]
        for job, entry, _ in saved:  # the saved chunks: a prefix of the new ones
            self.host.attach(entry, job.slot, job)
            if through:
                self.host.add_pin(entry)  # the push reads the slot: it must not be evicted before
                handle.pushes.append(self._writer.submit(Push(entry, self._tiers, after=job)))
            self.host.add_pin(entry)  # the later chunks of this save must not evict it
            held.append(entry)
        self._track_many(saved)  # each entry READY (its fill's pin dropped) once e_save completed
        handle.jobs.extend(jobs)
        handle.saved += len(jobs)
        return cut, why

    def load(
        self,
        tokens,
        block_ids,
        *,
        per_layer: bool = True,
        first_chunk: int = 0,
        first_block: int = 0,
        path: str | None = None,
        flags=None,
        lower: bool = True,
        fetch_wait_s: float | None = None,
    ) -> LoadHandle:
        """Load the longest available chunk prefix of ``tokens`` (``[num_tokens]``) into
        ``block_ids`` (``[num_blocks]``, distinct GPU blocks of the request, in order; chunks
        beyond ``len(block_ids) // bpc`` are not loaded). Lower-tier reads happen here; the GPU
        copies are asynchronous: use ``handle.wait_layer(layer, stream)`` before attention reads
        a layer. ``per_layer``: one event per layer, so attention of layer 0 starts before the
        last layer landed.

        first_chunk: start there (the caller recomputes the chunks before); chunk first_chunk + i
        goes into ``block_ids[i*bpc:(i+1)*bpc]`` and ``handle.tokens`` counts from there.
        first_block: the cache holds the first blocks of chunk first_chunk already (a prefix the
        serving engine computed or shares, ending inside the chunk): only its blocks first_block..
        are loaded, into ``block_ids[:bpc - first_block]``, and every later chunk shifts down by
        first_block blocks; ``handle.tokens`` counts the tokens written.

        path: the engine's copy path for these loads (`kvtier.engine.paths`; None: the engine's
        own). A load running beside a forward (a split hit) passes "staged": its copies then hold
        no SM but the short scatters, where the per-layer kernel path would share the SMs.

        flags: a step of the engine's `layer_flags()` (`kvtier.engine.flags`): every engine load of
        this call joins it, so its flag l is set only once layer l of these chunks landed too.

        lower: False loads only what the host holds (no disk or remote read in this call: a
        chunk the host lacks ends the load, as a miss), for a caller whose thread must not wait
        on a lower tier; `fetch` reads chunks into the host beforehand, on another thread.
        fetch_wait_s: how long a chunk another request is still saving or reading into the host
        is waited for (None: the store's ``fetch_wait_s``; 0: a miss at once).

        >>> h = store.load(range(100), range(20, 24), first_chunk=1)  # chunks 1 and 2
        >>> h.wait(5), h.tokens, h.tiers
        (True, 64, ('host', 'host'))
        """
        t0 = self._check_open()
        keys, bpc = self.keys(tokens), self.fmt.blocks
        if type(first_chunk) is not int or not 0 <= first_chunk <= len(keys):  # a bool is no index
            raise ValueError(f"first_chunk: must be an int within [0, {len(keys)}], got {first_chunk!r}")
        if (
            type(first_block) is not int
            or not 0 <= first_block < bpc
            or (first_block and first_chunk == len(keys))
        ):
            raise ValueError(
                f"first_block: must be an int within [0, {bpc}) of a chunk of tokens, got {first_block!r}"
            )
        keys = keys[first_chunk:]
        path = None if path is None else parse_path(path)
        ids = self._block_ids(block_ids, need=0, unique=True)
        self._reap()
        handle = LoadHandle(num_layers=self.kv.num_layers, _on_done=self._reap)
        layer_major = per_layer and (path or self.engine.load_path(per_layer=True)) is Path.KERNEL
        tiers: list[str] = []
        if first_block:
            head = bpc - first_block
            if len(ids) >= head and self._load_head(
                keys[0], ids[:head], first_block, handle, layer_major, path, flags, (lower, fetch_wait_s)
            ):
                tiers.append(handle.tiers[0])
                keys, ids = keys[1:], ids[head:]
            else:
                keys = []  # the first chunk is missing: nothing after it is of use
        if keys:
            tiers += self._load_run(keys, ids, handle, layer_major, path, flags, (lower, fetch_wait_s))
        handle.tiers = tuple(tiers)
        handle.tokens = len(handle.jobs) * self.fmt.tokens - (
            first_block * self.kv.block_size if tiers else 0
        )
        chunks = Counter(f"load_chunks_{t}" for t in handle.tiers)
        # handle.tokens counts from chunk first_chunk's block first_block: so does what was asked
        asked = max(0, len(tokens) - first_chunk * self.fmt.tokens - first_block * self.kv.block_size)
        self._count(loads=1, load_tokens=handle.tokens, load_tokens_asked=asked, _call=("load", t0), **chunks)
        return handle

    def _load_head(
        self, key: bytes, ids, skip: int, handle: LoadHandle, layer_major: bool, path, flags, where: tuple
    ) -> bool:
        """A chunk whose first ``skip`` blocks the cache holds: its other blocks into ``ids``
        (one engine job reading the slot's byte suffix). False if no tier delivers it.
        where: (lower, fetch_wait_s) as `load` takes them."""
        got = self._take(key, *where)
        if got is None:
            return False
        try:
            per_layer = layer_major  # the layer-major path's own job; else the whole-job path's
            job = self.engine.load(
                got.entry.slot, ids, per_layer=per_layer, path=path, skip_blocks=skip, flags=flags
            )
        except BaseException:
            self._give_back([got])  # nothing was submitted from the slot
            raise
        finally:
            self.host.count_hits(int(got.acquired), int(got.acquired) * self.fmt.span)
        self._track(job, got.entry, got.kind)  # its pin drops once e_load completed
        handle.jobs.append(job)
        handle.tiers = (got.tier,)
        return True

    def _load_run(
        self, keys: list[bytes], ids, handle: LoadHandle, layer_major: bool, path, flags, where: tuple
    ) -> list[str]:
        """The walk over ``keys`` into ``ids`` (chunk i into ids[i*bpc:(i+1)*bpc]) and its copies,
        appended to ``handle.jobs``; returns the tier of each chunk loaded."""
        whole = None if layer_major else path or self.engine.load_path(per_layer=False)
        # The walk ends at the first chunk no tier delivers: the rest of the prefix is useless.
        got_all: list[_Taken] = []
        jobs = []
        try:
            for got in self._walk(keys[: len(ids) // self.fmt.blocks], *where):
                got_all.append(got)
                if not layer_major and (got.tier != "host" or len(got_all) == LEAD_CHUNKS):
                    # A lower tier's chunk goes as soon as the walk holds it, with the host hits
                    # held back before it: the next chunks' reads overlap its copy; so do the
                    # first LEAD_CHUNKS host hits, whose copies overlap the walk's rest. Other
                    # host hits wait for a lower tier's chunk or the walk's end, and then go in
                    # one engine call.
                    jobs += self._load_whole(got_all[len(jobs) :], ids, len(jobs), path, whole, flags)
            if not layer_major and len(jobs) < len(got_all):
                jobs += self._load_whole(got_all[len(jobs) :], ids, len(jobs), path, whole, flags)
        except BaseException:
            self._give_back(got_all[len(jobs) :])  # fetched, never submitted
            raise
        finally:
            hits = sum(got.acquired for got in got_all)
            self.host.count_hits(hits, hits * self.fmt.span)
        if layer_major and got_all:
            # Layer-major over every chunk (one launch per layer): layer 0 of the whole prefix
            # lands first, so attention of layer 0 starts after 1/L of the bytes, not all of them.
            try:
                if len(got_all) > 1:
                    slots = [got.entry.slot for got in got_all]
                    jobs = self.engine.load_slots(slots, ids[: len(got_all) * self.fmt.blocks], flags=flags)
                else:  # one chunk: its own launch and event per layer
                    slot = got_all[0].entry.slot
                    jobs = [self.engine.load(slot, self._chunk(ids, 0), path=path, flags=flags)]
            except BaseException:
                self._give_back(got_all)  # nothing was submitted from the slots
                raise
            for job, got in zip(jobs, got_all, strict=True):
                self._track(job, got.entry, got.kind)  # pins drop once e_load completed
        handle.jobs.extend(jobs)
        return [got.tier for got in got_all]

    def _load_whole(self, taken: list[_Taken], ids, first: int, path, whole, flags=None) -> list:
        """Submit the chunks ``taken`` (chunk ``first`` on) in one engine call on path ``whole``
        (every layer's event the job's own): ``engine.load_slots``, or ``engine.load`` for one
        chunk (``path``: the caller's, None for the engine's own). Returns their jobs, tracked."""
        block = ids[first * self.fmt.blocks : (first + len(taken)) * self.fmt.blocks]
        if len(taken) == 1:
            jobs = [self.engine.load(taken[0].entry.slot, block, per_layer=False, path=path, flags=flags)]
        else:
            jobs = self.engine.load_slots([got.entry.slot for got in taken], block, path=whole, flags=flags)
        # Their pins drop (temporary slots go back) only once e_load completed.
        self._track_many([(job, got.entry, got.kind) for job, got in zip(jobs, taken, strict=True)])
        return jobs

    def prefetch(self, tokens) -> Future:
        """Bring the chunks of ``tokens`` (``[num_tokens]``) from lower tiers into the host, in
        the background. The future's result: tokens of the prefix then held (or being filled)
        by the host. Never raises through the future: a failed read ends the prefix.

        >>> store.prefetch(range(100)).result(5)  # every chunk is in the host already
        96
        """
        self._check_open()
        self._count("prefetches")
        return self._prefetcher.submit(self._prefetch_keys, self.keys(tokens))

    def fetch(self, tokens) -> int:
        """Bring the chunks of ``tokens`` (``[num_tokens]``) from lower tiers into the host, as
        `prefetch` does, on the calling thread: the tokens of the prefix the host then holds (or
        another request is filling). Never raises for a tier's failure (a miss ends the prefix).

        >>> store.fetch(range(100))  # every chunk is in the host already: no read
        96
        """
        self._check_open()
        self._count("prefetches")
        return self._prefetch_keys(self.keys(tokens), fresh=True)

    def evict(self, tokens=None, *, lower: bool = False) -> int:
        """Evict from the host the chunks of ``tokens`` (``[num_tokens]``; None: every chunk)
        that no transfer uses, spilling dirty ones (write-back); ``lower``: also delete them
        from the lower tiers. Returns how many host chunks went.

        >>> store.evict(range(100))
        3
        """
        self._check_open()
        keys = None if tokens is None else self.keys(tokens)
        self._reap()  # loads that completed first: their pins drop, their chunks may go
        n = self.host.evict(keys)
        if lower and keys:
            delete_everywhere(keys, self._tiers)
        self._count("evicted", n)
        return n

    def stats(self) -> StoreStats:
        """Per tier (hits, misses, hit rate, bytes, time per chunk read and written, errors by
        kind, occupancy), the pool, and the store's own counters with the hit rate (tokens hit of
        tokens asked); a dict of dicts that prints as a table (`store/stats.py`); also exported
        through ``self.metrics``.

        >>> sorted(store.stats())
        ['host', 'pool', 'store']
        >>> print(store.stats())  # doctest: +SKIP
        kvtier store: 1 loads, 1 saves, 96 of 100 tokens hit (96.0%)
          tier  hits  misses  hit rate    read  ms/chunk  written  ms/chunk  errors  held
          ...
        """
        self._reap()
        out: dict[str, dict] = {"host": self.host.stats()}
        for tier in self._tiers:
            try:
                out[tier.name] = tier.stats()
                if (rate := self.read_rate.gbps(tier.name)) is not None:
                    out[tier.name]["read_gbps"] = rate  # as this store's loads saw it (read_rate.py)
            except Exception as exc:  # a tier's stats are a report; its failure must not hide the others
                log.warning("kvstore: stats of %s failed: %s", tier.name, exc)
        p = self.engine.pool.stats()
        out["pool"] = dict(capacity=p.capacity, used=p.used, in_flight=p.in_flight, slots=p.slots)
        with self._counts_lock:
            out["store"] = dict(self._counts, inflight=len(self._reaper), writer_backlog=self._writer.backlog)
        return StoreStats.of(out)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every push submitted so far (write-through, promotion, spill) finished;
        False on timeout.

        >>> store.flush(5)
        True
        """
        return self._writer.flush(timeout)

    def close(self, *, flush: bool = True, timeout: float = 30.0) -> None:
        """Finish the transfers and pushes in flight, spill dirty chunks (write-back, ``flush``),
        and give every slot back. The engine and the tiers stay open (the caller owns them).

        >>> store.close()
        >>> engine.close(); dev.close()  # the caller's, closed after the store
        """
        if self._closed:
            return
        self._closed = True
        self._prefetcher.shutdown(wait=True)
        for job in self._reaper.jobs():
            job.wait(timeout)  # slots are given back below only once their copies landed
        self._reap()
        if flush and self.write_back and self._tiers:
            for e in self.host.entries():
                if e.dirty and self.host.pin(e):  # the push reads the slot: pinned until it is done
                    self._writer.submit(Push(e, self._tiers))
        self._writer.close(timeout)
        self._reaper.close(timeout)
        for e in self.host.drain():
            if e.slot is not None:
                self.engine.release(e.slot)  # retired: freed once no copy touches it

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # every transfer in flight lands before its slot goes back

    # -- the walk: chunks held for a load, or promoted by a prefetch --------------------------

    def _walk(self, keys: list[bytes], lower: bool = True, wait_s: float | None = None):
        """Yield ``_take(key, lower, wait_s)`` for ``keys`` in order, up to the first miss. Once a
        chunk comes from a lower tier, the next ``read_ahead`` chunks are read in the background
        meanwhile (each a prefetch: the load finds it pending or ready in the host)."""
        ahead = None
        depth = self.config.read_ahead if self.promote and self._tiers and lower else 0
        for i, key in enumerate(keys):
            while ahead is not None and ahead < min(len(keys), i + 1 + depth):
                self._prefetcher.submit(self._prefetch_keys, [keys[ahead]], True)
                ahead += 1
            got = self._take(key, lower, wait_s)
            if got is None:
                return
            if ahead is None and depth and got.tier != "host":
                ahead = i + 1  # lower-tier reads have begun: the rest likely needs them too
            yield got

    def _take(self, key: bytes, lower: bool = True, wait_s: float | None = None) -> _Taken | None:
        """``key``'s chunk, held for one load: a host hit (one still being filled waited for
        ``wait_s``, None: ``fetch_wait_s``), else (``lower``) a lower-tier read (promoted into the
        host when ``promote``, else a temporary slot); None if no tier delivers it."""
        wait = self.fetch_wait_s if wait_s is None else wait_s
        entry = self.host.acquire(key, wait, settle=self._reap, count=False)
        if entry is not None:
            tier = entry.source if entry.fresh else "host"
            entry.fresh = False
            return _Taken(entry, "load", tier, True)
        if not lower:
            return None
        return self._fetch(key, keep_pin=True, temp_ok=not self.promote)

    def _fetch(self, key: bytes, *, keep_pin: bool, temp_ok: bool, fresh: bool = False) -> _Taken | None:
        """Read ``key``'s chunk from the first lower tier that has it into a pool slot. The
        tier verified the checksum and the header must describe exactly this cache's chunk;
        the CPU wrote the bytes synchronously, so the slot is READY at once. ``keep_pin``: the
        entry stays pinned for a load; ``temp_ok``: a slot no index holds will do."""
        if not self._tiers:
            return None
        entry, status = (None, "temp") if temp_ok else self.host.reserve(key, self.fmt.span)
        if status == "present":  # another request got there first: wait for its fill
            if not keep_pin:
                return _Taken(None, "present", "host")  # a prefetch needs no more
            got = self.host.acquire(key, self.fetch_wait_s, settle=self._reap)
            return None if got is None else _Taken(got, "load", "host")
        if status == "full":  # every host chunk is pinned by transfers
            self._count("fetch_host_full")
            if not keep_pin:
                return None
            entry = None  # a load still gets the chunk, through a temporary slot
        try:
            # Pool pressure evicts clean host chunks; spills and reads in flight use the headroom.
            room = self.host.make_room
            slot = self.engine.slots.alloc(self.fmt.nbytes, self.alloc_timeout_s, on_pressure=room)
        except PoolExhausted as exc:
            log.info("kvstore: no pool room for a read: %s", exc)
            self._count("fetch_pool_exhausted")
            if entry is not None:
                self.host.cancel(entry)  # no slot: nothing was read into it
            return None
        t0 = time.perf_counter()
        found = read_first(key, slot.tensor, self._tiers, self.fmt, self._count)
        if found is not None:
            self.read_rate.record(self._tiers[found].name, t0, time.perf_counter(), self.fmt.nbytes)
        if found is None:
            if entry is not None:
                self.host.attach(entry, slot)
                self.host.cancel(entry)  # releases the slot: no copy ever touched it
            else:
                self._release_slot(slot)  # ALLOCATED, no copy ever touched it
            return None
        tier = self._tiers[found]
        self.engine.slots.fill_host(slot)  # the CPU wrote the bytes synchronously: READY, no event
        if entry is None:
            temp = HostEntry(key, self.fmt.span, slot=slot, ready=True, source=tier.name)
            return _Taken(temp, "temp", tier.name)
        entry.source, entry.fresh = tier.name, fresh
        self.host.attach(entry, slot)
        self.host.ready(entry, keep_pin=keep_pin)
        if found > 0 and self.promote and self.host.pin(entry):  # the push reads the slot: pinned until done
            self._writer.submit(Push(entry, self._tiers[:found]))  # copy up to the faster lower tiers too
        self._count("promoted")
        return _Taken(entry, "load", tier.name)

    def _prefetch_keys(self, keys: list[bytes], ahead: bool = False, fresh: bool = False) -> int:
        """Walk ``keys`` from the first, promoting lower-tier chunks into the host; returns the
        tokens of the prefix the host then holds or is filling. ``ahead``: a load's read-ahead;
        it and ``fresh`` mark each chunk read so that the load that takes it next counts it as
        its tier's hit, not the host's. Never raises."""
        n = 0
        try:
            for key in keys:
                if self.host.contains(key):
                    n += 1
                    continue
                if self._fetch(key, keep_pin=False, temp_ok=False, fresh=ahead or fresh) is None:
                    break
                n += 1
        except Exception:  # a prefetch is a hint: a bug here must not reach the serving loop
            log.exception("kvstore: prefetch failed")
            self._count(background_errors=1)
        if ahead:
            self._count("read_ahead_chunks", n)
        else:
            self._count("prefetch_tokens", n * self.fmt.tokens)
        return n * self.fmt.tokens

    def _give_back(self, taken: list[_Taken]) -> None:
        """Chunks fetched for a load whose copies were never submitted: pins drop, temporary
        slots go back (nothing was read out of them)."""
        for got in taken:
            self._completed(None, got.entry, got.kind)

    # -- internals ---------------------------------------------------------------------------

    def _block_ids(self, block_ids, need: int, unique: bool = False):
        """The request's ids, checked once here; the chunks below slice this checked tensor."""
        num_blocks, bpc = self.kv.num_blocks, self.fmt.blocks
        return request_block_ids(block_ids, num_blocks=num_blocks, need=need, bpc=bpc, unique=unique)

    def _chunk(self, ids, i: int):
        """Block ids of chunk ``i``: block_ids[i*bpc:(i+1)*bpc]."""
        return ids[i * self.fmt.blocks : (i + 1) * self.fmt.blocks]

    def _chunks(self, ids, chunks: list[int]):
        """Block ids of ``chunks`` (ascending chunk indices), one after the other: a slice of
        ``ids`` where they are consecutive (the usual case), else the chunks' slices joined."""
        bpc = self.fmt.blocks
        if chunks[-1] - chunks[0] == len(chunks) - 1:
            return ids[chunks[0] * bpc : (chunks[-1] + 1) * bpc]
        return torch.cat([self._chunk(ids, i) for i in chunks])

    def _check_open(self) -> float:
        """The call's start time; a call after close() is a caller bug."""
        if self._closed:
            raise RuntimeError("KVStore is closed")
        return time.perf_counter()

    def _count(self, name: str | None = None, n: int = 1, _call=None, **counts: int) -> None:
        """Count events: ``_count("spills")``, ``_count("evicted", 3)`` or ``_count(a=1, b=2)``;
        ``_call=(op, t0)`` also records the call's latency."""
        if _call is not None:
            self.metrics.calls.labels(_call[0]).observe(time.perf_counter() - _call[1])
        if name is not None:
            counts[name] = n
        with self._counts_lock:
            self._counts.update({k: v for k, v in counts.items() if v})
        for k, v in counts.items():
            if v:
                self.metrics.events.labels(k).inc(v)

    def _completed(self, job, entry: HostEntry, kind: str) -> None:
        """A job's event has completed and the engine settled it (job None: a load that was never
        submitted): a saved entry turns READY, a load's pin drops, a temporary slot goes back."""
        if kind == "save":
            self.host.ready(entry)  # drops the fill's pin: the copy into the slot has landed
        elif kind == "temp":
            self._release_slot(entry.slot)  # a read-through slot no index holds; nothing reads it now
        else:
            self.host.unpin(entry)  # only once e_load completed (or nothing was submitted)

    def _release_slot(self, slot) -> None:
        """Give a slot back through the engine; with the sanitizer on, prove no copy uses it."""
        eng = self.engine
        if eng.sanitize and eng.slots.state(slot) not in (SlotState.READY, SlotState.ALLOCATED):
            why = "released from the store while a transfer still uses it (a pin was dropped early)"
            raise LifecycleError("evict", slot.name, eng.slots.state(slot).value, None, why)
        eng.release(slot)  # retire: the pool gets it back once no copy into/out of it is pending

    def _spill(self, entry: HostEntry) -> None:
        self._writer.spill(entry, self._tiers)  # the writer releases the slot once pushed
