"""WorkerSide: the connector's half in each vLLM worker — moves chunks through kvtier's store.

Per step, in vLLM's call order (`KVTierMetadata` bound first):

    handle_preemptions(meta)   later compute waits for the pending saves of preempted requests'
                               blocks (vLLM may hand them to another request), and only for those:
                               requests' saves run on SAVE_LANES copy streams, each request's on
                               one no other request's save is queued on while one is idle
    start_load(meta)           each load in the step: the copies of what the host holds (never a
                               lower tier's read) on the copy stream, one event per layer (from
                               the block vLLM's own hit ends at); each background load: an event
                               recorded, the rest handed over (`BackgroundLoads`: a lower tier's
                               chunks read into the host on a reader thread, cut at the plan's
                               deadline, then whole-job DMA copies on the loader thread); what
                               did not arrive is reported as load errors (vLLM recomputes those
                               blocks), and each load's outcome to the scheduler. Flag waits
                               (``full_graphs``): a step with loads in it re-arms the per-layer
                               flags first, its loads join the step, the step is sealed after them
    wait_layer(name)           compute waits for that layer of the step's loads only (layerwise:
                               the engine's layer-major path, a true event per layer), no host
                               blocking; never for a background load. Flag waits: a wait on the
                               layer's flag, in a step that armed them or while a CUDA graph is
                               captured (the graph holds it); `capturing()` tells which
    save(meta)                 after the forward: an event recorded, the request's new full chunks
                               handed to the saver thread, whose copies wait for that event; blocks
                               held (the request's free delayed) until the copies' event completed
    finished(ids)              (released request ids whose saves have all read their blocks,
                               background loads whose copies landed)
    report() / stats()         for the scheduler: the tier keys this rank's local tiers (host,
                               disk) now hold or no longer hold (every eviction, and at start
                               what the disk holds), load outcomes, lower tiers down or answering
                               again (`TierProbe`), the read and copy rates its loads measured,
                               the step it ran; counters for vLLM's stats

A hybrid model: one store per KV cache group (`groups.Group`, its keys carrying the group) over
that group's layers, sharing the tiers; each run names its group. A state group's store keeps one
block per chunk (each layer's state bytes, not the page's padding). A load's outcome and its
receipt are reported once every group's run settled; a failure is a failed receipt
(`failed_receipts`), never failed block ids. handle_preemptions also waits for the saves still
reading a window or state group's blocks that vLLM hands out again in the step (``meta.fresh``).

Every tier failure is a miss (fewer tokens loaded, a save skipped), never an exception into
vLLM's forward. Block ids are vLLM's; chunk i of a run covers ``block_ids[i*bpc:(i+1)*bpc]``.

The forward thread pays microseconds per save or background load: an event and a hand-over. The
store's per-chunk work (keys, the host index, pool slots, the engine's submission) runs on two
`Mover` threads, the saver and the loader, each in the order vLLM asked. Every path's first use
(kernel compiles, CUDA graph captures, the batched copy's first call) happens in `register`, on
blocks no request holds yet. Stats time each transfer on the device: from the event that made
its data ready to its copies' last event, overlapping transfers counted once (``*_busy_s``).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter, deque
from functools import partial

from .background import BackgroundLoads
from .hash_store import HashKeyedStore
from .holdings import Holdings
from .metadata import ChunkRun, KVTierMetadata, KVTierWorkerMetadata
from .mover import Mover
from .settings import VllmSettings
from .tier_probe import TierProbe

log = logging.getLogger(__name__)
# Copy streams the saves spread over. A stream runs in order, so a save's event completes only
# after every save queued before it there: with one stream, a preemption's wait for one request's
# saves would wait for every request's.
SAVE_LANES = 4
COPY_RATES = 16  # the latest host-only loads the copy rate reported to the planner is taken over


class WorkerSide:
    """settings: `VllmSettings`. model: the identity keys are salted with. tp_rank / tp_size:
    this worker's rank (its keys are its own). order: vLLM's `KVCacheLayout` name of the cache.
    groups: a hybrid model's KV cache groups (`groups.Group`; None: one group): one store per
    group over that group's layers, each keeping a chunk's unit of that group (block_size is then
    the scheduler's, a multiple of each group's). tiers / device: override what ``settings``
    would build (tests: a `MemoryTier`, `SimDevice`)."""

    def __init__(
        self,
        settings: VllmSettings,
        model: str,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        order: str | None = None,
        block_size: int | None = None,
        groups=None,
        tiers=None,
        device=None,
    ) -> None:
        self.settings, self.model, self.order = settings, model, order
        self.tp_rank, self.tp_size, self.block_size = tp_rank, tp_size, block_size
        self.groups = groups
        self._tiers, self._device = tiers, device
        self.store: HashKeyedStore | None = None  # the first group's (the only one's) store
        self.stores: list[HashKeyedStore] = []  # per KV cache group, in vLLM's order
        self._parts: dict[int, tuple[int, bool]] = {}  # load tag -> (runs not settled, any failed)
        self._landed: dict[int, int] = {}  # load tag -> its background runs landed so far
        self._failed_recv: set[str] = set()  # background loads of a hybrid model that failed
        self._volatile_saves: dict[str, set[int]] = {}  # req id -> blocks its window, state saves read
        self._layer_index: dict[str, int] = {}
        self._loads: list = []  # (LoadHandle, ChunkRun, ready event) loaded in a step, not landed yet
        self._saves: dict[str, list] = {}  # req id -> [(SaveHandle, ChunkRun, ready event)], submitted
        # What the saver, loader and reader threads and the forward thread share: _saves, _queued,
        # _errors, _loaded, _failed, _counts, _busy, _copies and the holdings' changes.
        self._lock = threading.Lock()
        self._queued: Counter = Counter()  # req id -> its saves handed over, not submitted yet
        self._last_save: dict[str, int] = {}  # req id -> the saver's number of its last save
        self._background: BackgroundLoads | None = None  # made at register
        self._probe: TierProbe | None = None
        self._received: set[str] = set()  # background loads landed, not reported to vLLM yet
        self._saver: Mover | None = None
        self._loader: Mover | None = None
        self._busy: dict[str, float] = {}  # op -> device time (s) the latest transfer counted ended
        self._released: set[str] = set()  # finished requests reported once their saves are done
        self._errors: set[int] = set()
        self._holdings = Holdings()  # what the host and disk hold, for the scheduler's index
        self._loaded: dict[int, int] = {}  # load tag -> this rank's bit: every block delivered
        self._failed: dict[int, int] = {}
        self._extra_sent = False
        self._copies: deque[tuple[float, float]] = deque(maxlen=COPY_RATES)  # (bytes, s) host loads
        self._rates_sent: dict[str, tuple[float, float]] = {}
        self._rates_due = False  # a load settled since the last report: the rates may have moved
        self._step = 0  # the scheduler's number of the step this worker runs
        self._counts: Counter = Counter()
        self._owned: list = []  # what register_kv_caches made, closed in reverse at shutdown
        self._lanes: list = []  # the save streams, made at register
        self._lane_last: list = []  # per lane, the last save handle put on it
        self._lane_order: deque[int] = deque()  # lanes, least recently used first
        self.flags = None  # the engine's LayerFlags with flag waits (``full_graphs``), made at register
        self._armed = None  # the flags' step armed by this step's start_load, until its forward ended
        self._on_cuda = False

    # -- set-up ---------------------------------------------------------------------------------

    def register(self, kv_caches: dict) -> None:
        """Build the engine and store over vLLM's per-layer 4-D views (``{layer name: view}``)."""
        import torch

        from kvtier import layout
        from kvtier.engine import EngineConfig, TransferEngine, warm_up
        from kvtier.pool import PinnedPool
        from kvtier.store import StoreConfig

        names = list(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(names)}
        parts = self._parts_of(kv_caches, layout)
        sizes = [kv.chunk_nbytes(tokens // kv.block_size) for kv, tokens, _ in parts]
        self.settings.check_host_bytes(sum(sizes))  # before anything is allocated
        first = next(iter(kv_caches.values()))
        dev = self._device
        if dev is None:
            from kvtier.device import CudaDevice, SimDevice

            dev = CudaDevice(first.device.index or 0) if first.is_cuda else SimDevice()
            self._owned.append(dev)
        tiers = self._tiers if self._tiers is not None else self._make_tiers()  # shared by the groups
        s = self.settings
        for (kv, tokens, group), size in zip(parts, sizes, strict=True):
            # Each group's pinned pool: the host bytes shared in proportion to its chunk's bytes.
            pool = PinnedPool(dev, s.host_bytes * size // sum(sizes))
            engine = TransferEngine(
                dev, kv, pool, config=EngineConfig(path=s.engine_path, staging_bytes=s.staging_bytes)
            )
            self._owned += [pool, engine]
            cfg = StoreConfig(
                chunk_tokens=tokens,
                write_policy=s.write_policy,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                salt=s.salt.encode(),
                hash_name=s.hash_name,
                auth_keys=s.auth_keys,
            )
            # Every chunk a host drops is noted (a deque append, under the host's lock); `report`
            # tells the scheduler of those no local tier holds any more.
            label = None if group is None else group.label
            store = HashKeyedStore(
                engine, self.model, tiers=tiers, config=cfg, on_evict=self._holdings.gone, group=label
            )
            self.stores.append(store)
        self.store, kv = self.stores[0], self.stores[0].kv
        self.dev, self.kv, self.torch = dev, kv, torch
        self._lanes = [dev.new_stream(f"kvtier-save-{i}") for i in range(SAVE_LANES)]  # made at start
        self._lane_last = [None] * SAVE_LANES
        self._lane_order = deque(range(SAVE_LANES))
        # Every copy path's first use now, at start, on blocks no request holds yet (vLLM's block 0
        # is its null block): kernel compiles, the staged path's graphs, the batched copy, each lane.
        # Its loads' own paths too: a load in the step names the layer-major "kernel" path.
        paths = (self.load_path(background=False), self.load_path(background=True))
        for store in self.stores:
            warm_up(store.engine, range(1, store.kv.num_blocks), store.fmt.blocks, self._lanes, paths)
        self._on_cuda = first.is_cuda
        if self.settings.flag_waits and self.groups is None:  # a hybrid model loads only in the background
            self.flags = self.store.engine.layer_flags()
            self._warm_up_flags(self.flags)
        wanted = self.settings.gil_switch_interval_s
        if wanted and sys.getswitchinterval() > wanted:
            # The saver and loader threads run Python beside the forward thread: once the forward
            # thread wants the interpreter back (its step synced), it waits at most this long.
            log.info("kvtier: Python's switch interval %.2g s -> %.2g s", sys.getswitchinterval(), wanted)
            sys.setswitchinterval(wanted)
        self._saver = Mover(f"kvtier-saver-tp{self.tp_rank}")
        self._loader = Mover(f"kvtier-loader-tp{self.tp_rank}")
        self._probe = TierProbe(self.store.tiers, self.store.fmt.nbytes)
        self._background = BackgroundLoads(
            self.stores,
            self._loader,
            self._probe,
            self._load,
            cap_s=self.settings.prefetch_timeout_s,
            name=f"kvtier-reader-tp{self.tp_rank}",
        )

    def _parts_of(self, kv_caches: dict, layout) -> list:
        """(paged KV, tokens of a store's chunk, group) per store: the whole cache (one group), or
        each group's layers, checked against their strides, keeping that group's unit per chunk."""
        order = self.order or "LBHNC"
        if self.groups is None:
            kv = layout.vllm_paged(kv_caches, order)
            return [(kv, self.settings.chunk_tokens_for(self.block_size or kv.block_size), None)]
        ct, parts = self.settings.chunk_tokens_for(self.block_size), []
        for g in self.groups:
            kv = layout.vllm_paged({n: kv_caches[n] for n in g.layers}, order)
            if g.state_bytes is not None:
                _check_states(kv, g, kv_caches)
                parts.append((kv, 1, g))  # a store's chunk: one block, the state at the chunk's end
                continue
            if kv.block_size != g.block_size:
                raise ValueError(
                    f"kv_caches: group {g.index}'s views hold {kv.block_size} tokens per block, "
                    f"its spec says {g.block_size}"
                )
            parts.append((kv, g.unit(ct // g.block_size) * g.block_size, g))
        return parts

    def _make_tiers(self) -> list:
        s, tiers = self.settings, []
        if s.disk_path:
            from kvtier.store.disk import DiskTier
            from kvtier.store.policy import LRU

            policy = LRU(s.disk_bytes)  # its evictions and deletions reach the scheduler's index
            disk = DiskTier(
                s.disk_path, s.disk_bytes, policy=policy, space=f"tp{self.tp_rank}", label="disk_path"
            )
            self._holdings.watch(disk, policy)
            tiers.append(disk)
        if s.redis_url:
            from kvtier.store.redis_tier import RedisTier

            tiers.append(RedisTier(url=s.redis_url, cluster=s.redis_cluster))
        self._owned += tiers
        return tiers

    # -- per step -------------------------------------------------------------------------------

    def handle_preemptions(self, meta: KVTierMetadata) -> None:
        if self.store is None or not (meta.preempted or meta.fresh):
            return  # the common step: no device stream looked up
        waits = set(meta.preempted)
        if meta.fresh and self._volatile_saves:
            with self._lock:
                busy = set(self._saves) | set(self._queued)
            for rid, blocks in list(self._volatile_saves.items()):
                if rid not in busy:
                    del self._volatile_saves[rid]  # its saves read their blocks: nothing to wait for
                elif not blocks.isdisjoint(meta.fresh):
                    waits.add(rid)
        stream = self.dev.current_stream()
        for rid in waits:  # vLLM hands these blocks out again: no overwrite before the saves read them
            self.wait_saves(rid, stream)

    def wait_saves(self, req_id: str, stream) -> None:
        """Later work on ``stream`` waits for ``req_id``'s pending saves, and for nothing else
        (what runs before them on their lane). The host first waits until the saver thread has
        submitted the saves handed to it (their copies are then queued, not done)."""
        n = self._last_save.get(req_id)
        if n is not None:
            self._saver.wait(n)  # a save not submitted yet has no event for the stream to wait on
        with self._lock:
            handles = [h for h, _, _ in self._saves.get(req_id, ())]
        for h in handles:
            h.wait_on(stream)  # vLLM reuses these blocks: no overwrite before the copy read them

    def start_load(self, meta: KVTierMetadata) -> None:
        if self.store is None:
            return
        self._settle()
        self._armed = None
        if not meta.loads:
            return
        compute, step = self.dev.current_stream(), None
        if self.flags is not None and not all(run.background for run in meta.loads):
            # Re-armed on the compute stream before the forward: no "landed" of an earlier step can
            # pass this step's waits. Its event follows vLLM's zeroing of new blocks too.
            self._armed = step = self.flags.arm(compute)
            zeroed = step.armed
        else:
            # vLLM zeroes new blocks on the compute stream before the forward: a load must land after.
            zeroed = compute.record()
        try:
            for run in meta.loads:
                if run.background:
                    self._background.start(run, zeroed)  # received once read, copied and landed
                else:
                    self._load(run, zeroed, step=step)
        finally:
            if step is not None:
                step.seal()  # each flag set once its layer of every load landed or failed: no wait hangs
        if not self.settings.layerwise:
            stream = self.dev.current_stream()
            for h, _, _ in self._loads:
                for layer in range(self.kv.num_layers):
                    h.wait_layer(layer, stream)  # the forward must not read a layer before it landed

    def _load(self, run: ChunkRun, zeroed, chunks: int | None = None, cut: bool = False, step=None):
        """One load of the run's first ``chunks`` chunks (None: a load in the step, every chunk;
        else a background load's, on the loader thread) from what the host holds: its outcome,
        errors and counts; its handle (None: nothing submitted). cut: its deadline ended its reads.
        step: the flags' step its copies join (flag waits, a load in the step)."""
        background = chunks is not None
        ids = run.ids if chunks is None else run.ids[:chunks]
        store = self.stores[run.group]
        bpc, got, h, missing = store.fmt.blocks, 0, None, None
        try:
            if ids and self.groups is not None and 0 in run.block_ids:
                raise ValueError(f"group {run.group}: vLLM's null block among the blocks to fill")
            if ids:
                store.engine.compute_write(run.block_ids, zeroed)  # the copy waits for the zeroing
                path, per_layer = self.load_path(background), not background
                # The step's thread waits for no tier, nor for a chunk still being filled (a read
                # stalled in its tier may never fill it): what the host holds ready, or a miss.
                wait = None if background else 0.0
                h = store.load(
                    ids,
                    run.block_ids,
                    first_block=run.skip,
                    path=path,
                    per_layer=per_layer,
                    lower=False,
                    fetch_wait_s=wait,
                    flags=step,
                )
                got = len(h.jobs)  # chunks delivered (a job each), the first one from block run.skip on
        except Exception as exc:  # a failing load is a miss: vLLM recomputes what did not arrive
            log.warning("kvtier: load of %s failed: %s", run.req_id, exc)
            self._count(load_errors=1)
        if got < len(run.ids):
            missing = store.keys(run.ids[got : got + 1])[0]
        with self._lock:
            self._counts["deadline_cuts"] += int(cut)
            if h is not None:
                self._counts.update(f"hit_chunks_{t}" for t in h.tiers)
                if any(t != "host" for t in h.tiers):  # read into the host for this load: held there now
                    self._holdings.held(store.keys(ids[:got]))
                if not background:
                    self._loads.append((h, run, zeroed))
            self._outcome(run, missing is None)
            if missing is None:
                return h
            self._holdings.gone([missing])  # not in the host: a lower tier may still hold it
            self._counts["miss_chunks"] += len(run.ids) - got
            if self.groups is None:
                self._errors.update(run.block_ids[max(0, got * bpc - run.skip) :])
            else:  # vLLM 0.33 takes no failed blocks with several groups: the request is recomputed
                self._failed_recv.add(run.req_id)
        return h

    def _outcome(self, run: ChunkRun, ok: bool) -> None:
        """This rank's outcome of ``run`` (under the lock): the load's, once each of its runs (one
        per group) settled. The scheduler holds saves back until every rank's is in."""
        if run.parts > 1:
            left, bad = self._parts.get(run.tag, (run.parts, False))
            left, bad = left - 1, bad or not ok
            if left:
                self._parts[run.tag] = (left, bad)
                return
            del self._parts[run.tag]
            ok = not bad
        (self._loaded if ok else self._failed)[run.tag] = 1 << self.tp_rank

    def load_path(self, background: bool = False) -> str | None:
        """Layerwise: the engine's layer-major path ("kernel": one launch per layer over every
        chunk, so layer l's event completes after l + 1 of L layers' bytes, not all of them);
        else, and for a background load (no forward waits for its layers), the engine's whole-job
        path (staged / batch: DMA, closest to the link, no SM held beside the running requests).
        A path the settings name wins."""
        if self.settings.engine_path != "auto":
            return self.settings.engine_path
        return "kernel" if self.settings.layerwise and not background else None

    def wait_layer(self, layer_name: str) -> None:
        if self.flags is not None:
            self._wait_flag(layer_name)
            return
        if not self._loads or not self.settings.layerwise:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        stream = self.dev.current_stream()
        for h, _, _ in self._loads:
            h.wait_layer(layer, stream)  # attention of this layer must not read blocks still landing

    def _wait_flag(self, layer_name: str) -> None:
        """Flag waits: torch's current stream waits for the layer's flag (the stream attention's
        kernels go to; while a CUDA graph is captured, the capturing one). In an eager step that
        armed no flags there is nothing to wait for: every flag was set before the compute stream
        passed the last step's waits. The wait sits inline, before the layer's attention: one
        graph node per layer and no state. Waits on a side branch forked at the forward's start
        cost a decode step less on the GPU (`kvtier bench --suite vllm`, decode_full_graph's
        slowdown_pct_branch), but the fork must be joined inside the capture (torch refuses a
        graph with an unjoined stream), which holds only if vLLM calls every layer's hook once per
        forward on one stream; vLLM's micro-batching runs two forwards in one capture."""
        if self._armed is None and not self.capturing():
            return
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            # Attention of this layer must not read its blocks before this step's loads landed them.
            self.flags.wait(layer, self.flags.current_stream())

    def capturing(self) -> bool:
        """Whether torch's current stream is capturing a CUDA graph now (never off CUDA)."""
        return self._on_cuda and self.torch.cuda.is_current_stream_capturing()

    def save(self, meta: KVTierMetadata) -> None:
        self._armed = None  # the step's forward is enqueued, its flag waits with it
        self._step = meta.step  # reported back: the scheduler times the step by it
        self._released |= meta.release  # vLLM frees their blocks once we report them
        if self.store is None or not meta.saves:
            return
        after = self.dev.current_stream().record()  # the forward wrote the KV before this event
        for run in meta.saves:
            if self.groups is not None and self.groups[run.group].volatile:
                # vLLM frees a window's blocks and a state group's interior states while the
                # request runs: a step handing them out again waits for this save first
                # (handle_preemptions).
                self._volatile_saves.setdefault(run.req_id, set()).update(run.block_ids)
            with self._lock:
                self._queued[run.req_id] += 1  # its blocks stay the request's: not released before submitted
            self._last_save[run.req_id] = self._saver.submit(partial(self._save, run, after))

    def _save(self, run: ChunkRun, after) -> None:
        """One request's save, on the saver thread."""
        lane, h = self._lane(), None
        try:
            h = self.stores[run.group].save(run.ids, run.block_ids, after=after, stream=self._lanes[lane])
        except Exception as exc:  # a failed save is only a later miss
            log.warning("kvtier: save of %s failed: %s", run.req_id, exc)
        with self._lock:
            if h is None:
                self._counts["save_errors"] += 1
            else:
                self._lane_last[lane] = h
                self._counts["save_errors"] += h.failed  # the pool was full: those chunks are a later miss
                self._saves.setdefault(run.req_id, []).append((h, run, after))
            self._queued[run.req_id] -= 1
            if not self._queued[run.req_id]:
                del self._queued[run.req_id]

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(released requests (the scheduler sends no more saves of them) whose saves have all
        read their blocks: vLLM may hand the blocks on; background loads whose copies landed)."""
        self._settle()
        with self._lock:
            received, self._received = self._received, set()
            done = {rid for rid in self._released if rid not in self._saves and rid not in self._queued}
        self._released -= done
        return done or None, received or None

    def wait_submitted(self, timeout: float | None = None) -> bool:
        """Block until the saver and loader threads have submitted everything handed to them (the
        copies are then queued on the device, not done); False on timeout."""
        movers = [m for m in (self._saver, self._loader) if m is not None]
        return all(m.wait(m.asked, timeout) for m in movers)

    def failed_receipts(self) -> set[str]:
        """Background loads of a hybrid model that failed (vLLM's ``failed_recving``; it waits for
        their receipt, and then recomputes each request whole)."""
        with self._lock:
            out, self._failed_recv = self._failed_recv, set()
        return out

    def load_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def report(self) -> KVTierWorkerMetadata | None:
        if self.store is None:
            return None
        self._settle()
        with self._lock:
            host = self.store.host if len(self.stores) == 1 else _Hosts(self.stores)
            held, below, lost = self._holdings.take(host)
            wm = KVTierWorkerMetadata(held, lost, self._loaded, self._failed, below=below, step=self._step)
            self._loaded, self._failed = {}, {}
            copies = list(self._copies)
        wm.down, wm.up = self._probe.take()
        if self._rates_due:  # fitted only after loads: an idle step pays nothing for it
            self._rates_due = False
            rates = {}
            for store in self.stores:  # each lower tier its loads read from so far (the slowest group's)
                for tier in store.read_rate.snapshot():
                    if (fit := store.read_rate.fit(tier)) is not None:
                        have = rates.get(tier)
                        rates[tier] = fit if have is None else (min(have[0], fit[0]), max(have[1], fit[1]))
            if copies:
                rates["host"] = (sum(b for b, _ in copies) / sum(t for _, t in copies) / 1e9, 0.0)
            if rates != self._rates_sent:
                wm.rates = self._rates_sent = rates
        if not self._extra_sent:
            xs = [st.extra for st in self.stores]
            fields = [(x.model, x.kv_dtype, x.layout, x.tp_size, x.salt) for x in xs]
            wm.extra, self._extra_sent = fields[0], True
            wm.extras = tuple(fields) if self.groups is not None else ()
            wm.groups = tuple(self.groups or ())
            wm.chunk_bytes = sum(st.fmt.nbytes for st in self.stores)  # a chunk's units, every group
            wm.group_bytes = tuple(st.fmt.nbytes for st in self.stores) if self.groups is not None else ()
        return None if wm.is_empty() else wm

    def stats(self) -> dict:
        with self._lock:
            out, self._counts = dict(self._counts), Counter()
        return out

    def shutdown(self) -> None:
        if self._background is not None:
            self._background.close()
        if self._probe is not None:
            self._probe.close()
        for mover in (self._saver, self._loader):
            if mover is not None:
                mover.close()  # what was handed over is submitted before the store closes
        for store in self.stores:
            try:
                store.close()  # every copy in flight lands before its slot goes back
            except Exception as exc:
                log.warning("kvtier: store close failed: %s", exc)
        self.store, self.stores = None, []
        for thing in reversed(self._owned):
            try:
                thing.close()
            except Exception as exc:
                log.warning("kvtier: close of %s failed: %s", type(thing).__name__, exc)
        self._owned = []

    # -- internals ------------------------------------------------------------------------------

    def _lane(self) -> int:
        """The save stream for the next request's saves: the least recently used one whose last
        save has landed, else the least recently used (every lane busy: it queues behind one)."""
        order = self._lane_order
        lane = next((i for i in order if (h := self._lane_last[i]) is None or h.done()), order[0])
        order.remove(lane)
        order.append(lane)
        return lane

    def _settle(self) -> None:
        """Completed loads and saves: counted, reported, their requests released; the background
        loads landed (or delivering nothing) noted for `finished`; reads past their deadline cut."""
        if self.store is None:
            return
        keep = []
        for h, run, ready in self._loads:
            if h.done():  # event queries: the copies landed, the slots' pins drop
                self._account("load", h, ready, run, copies=True)
            else:
                keep.append((h, run, ready))
        self._loads = keep
        landed = self._background.poll()
        with self._lock:
            saves = {rid: list(v) for rid, v in self._saves.items()}
        done_saves = [(rid, x) for rid, v in saves.items() for x in v if x[0].done()]  # landed: not a submit
        with self._lock:
            for rid, x in done_saves:
                self._saves[rid].remove(x)
                if not self._saves[rid]:
                    del self._saves[rid]
            for ld in landed:
                self._land(ld.run)
                if ld.handle is not None:  # a load that read first: no copy rate from its time
                    read = any(t != "host" for t in ld.run.tiers)
                    self._account("load", ld.handle, ld.zeroed, ld.run, copies=not read)
            for _, (h, run, ready) in done_saves:
                self._account("save", h, ready, run)
                store = self.stores[run.group]
                if h.tokens:  # those the host holds ready (a chunk skipped as held may only be pending)
                    keys = store.keys(run.ids[: h.tokens // store.fmt.tokens])
                    self._holdings.held([k for k in keys if store.host.contains(k, pending=False)])

    def _land(self, run: ChunkRun) -> None:
        """A background run landed (under the lock): its request is received once every run of
        its load (one per group) has."""
        if run.parts > 1:
            n = self._landed.get(run.tag, 0) + 1
            if n < run.parts:
                self._landed[run.tag] = n
                return
            del self._landed[run.tag]
        self._received.add(run.req_id)

    def _account(self, op: str, h, ready, run: ChunkRun, copies: bool = False) -> None:
        """A transfer that completed: bytes, count, and its device time from ``ready`` (the event
        that made its data ready) to its last copy, overlapping transfers counted once. copies: a
        load of the host's chunks alone, whose time is its copies' (the planner's copy rate)."""
        jobs = h.jobs
        nbytes = (h.saved if op == "save" else len(jobs)) * self.stores[run.group].fmt.nbytes
        self._counts[f"{op}_bytes"] += nbytes
        self._counts[f"{op}s"] += 1
        self._rates_due |= op == "load"
        if not jobs:
            return
        try:
            start, end = ready.time_s(), max(j.event.time_s() for j in jobs)
        except Exception:  # an event without timing (e.g. torch's, created without): no device time
            return
        last = self._busy.get(op, float("-inf"))  # the end of the latest transfer counted
        self._counts[f"{op}_busy_s"] += max(0.0, end - max(start, last))
        self._busy[op] = max(last, end)
        if copies and end > start:
            self._copies.append((nbytes, end - start))

    def _count(self, **counts: int) -> None:
        with self._lock:
            self._counts.update(counts)

    def _warm_up_flags(self, flags) -> None:
        """The flags' first use at start: a step armed and sealed with no load, a wait on each
        flag; the compute stream then waits until they ran (the flags are set again after)."""
        compute = self.dev.current_stream()
        flags.arm(compute).seal()
        for layer in range(flags.num_layers):
            flags.wait(layer, compute)  # the seal set every flag: nothing holds the stream for long
        compute.synchronize()  # the first calls ran before any request's step


def _check_states(kv, group, kv_caches: dict) -> None:
    """A state group's views as vLLM's state layers read them: per layer ``[B, 1, 1, C]`` bytes,
    one state per block (``vllm_paged`` checked their strides against the order), C the layer's
    packed state tensors (the page's padding past them is never moved)."""
    first = kv_caches[group.layers[0]]
    width = first.shape[-1] * first.element_size()
    if (
        kv.block_size != 1
        or first.dim() != 4
        or tuple(first.shape[1:3]) != (1, 1)
        or width != group.state_bytes
    ):
        raise ValueError(
            f"kv_caches: group {group.index}'s state views are {tuple(first.shape)} {first.dtype}; its "
            f"spec packs {group.state_bytes} bytes of state per layer in a block: [B, 1, 1, "
            f"{group.state_bytes}] bytes expected"
        )


class _Hosts:
    """The host tiers of a hybrid model's stores, as `Holdings.take` asks one host: a key (each
    names its group) is held where its group's host holds it."""

    def __init__(self, stores) -> None:
        self._hosts = [st.host for st in stores]

    def contains(self, key: bytes, pending: bool = True) -> bool:
        return any(h.contains(key, pending=pending) for h in self._hosts)
