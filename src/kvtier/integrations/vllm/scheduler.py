"""SchedulerSide: the connector's half in vLLM's scheduler process (no torch tensors, no GPU).

It decides; the workers move. Per request it names the chunks by vLLM's block hashes
(`chunk_ids`) and each rank's copy of a chunk by its tier key (`chunk_keys`, from the key fields
the workers report once), and answers vLLM from what the workers say their tiers hold:

    lookup(request, num_computed)      -> (tokens, background) | (None, False): the tokens to load
                                          past vLLM's own hit, from the block it ends at (inside a
                                          chunk too), as the request's `Choice` says (`choice.py`:
                                          load every held chunk, the first ones, or none); None
                                          ("ask again") only before the workers' first report when
                                          a disk or shared tier may hold some; background: loaded
                                          while the request waits out of the batch (always when a
                                          chunk needs a lower tier's read; a hit the host holds as
                                          ``load_async`` says: by default while others run, or
                                          where the plan finds it lands sooner than in the step)
    after_alloc(request, blocks, n)       a hit becomes a load into the blocks vLLM allocated
    build_meta(scheduler_output)          loads, saves, preempted and released requests, the
                                          step's number -> `KVTierMetadata`
    update(connector_output)              the workers' reports: keys held / lost, load outcomes,
                                          tiers down / up, read and copy rates, the step's number
    finished(request)                     True while a save of it may still read its blocks
    choice(rid) / absent                  a request's latest choice; the lower tiers planned
                                          as absent now
    stats()                               per request with a hit: its choice, its first token
                                          planned and measured (vLLM's logged metrics, Prometheus)

The index holds the tier keys the workers' local tiers (host, disk) hold, each with the tier that
holds it (the host, else the worker's disk): a key arrives when a save landed, a load brought
the chunk into the host, or, at start, for every chunk a rank's disk holds; it moves to the disk
when the host drops it and the disk holds it, and leaves when no local tier of that rank holds it.
A chunk is held when every rank's key is in the index (a rank alone cannot load a prefix), in
the slowest of their tiers; past the chunks the workers hold, the shared tier (Redis) is asked.
A tier a worker found down or stalled is planned as absent (its chunks end the hit) until a
worker reports it answers again. The index stays a hint (an eviction can race a grant): the
worker then reports the blocks it did not load, and vLLM (kv_load_failure_policy="recompute")
recomputes them.

The choice per request uses this engine's own figures: its forward time per step, fitted from
the steps vLLM runs (`StepTimes`: each step's metadata is built here and its report comes back
here, with the step's number), the read rate each tier delivered to the workers' loads and the
rate of their copies into the GPU (reported by the workers). A load from a lower tier carries a
deadline from its plan (`ChunkRun.budget_s`): the workers abandon its reads past it.

Saves, and loads that fail, for any TP size: a chunk is saved only if every block before it held
valid KV when it was computed. In the step a request loads, every rank computes the tokens past
the hit from what attention read on every rank (TP's all-reduce), and no rank can know in that
step whether another's load failed. So while a load is unconfirmed, the request's newly computed
chunks are held back: they are sent to be saved once every rank reported its load complete
(``update``; a step later, two under AsyncScheduler, whose reports lag a step), its blocks the
request's until then (a request finished meanwhile has its free delayed). If any rank's load
failed, vLLM recomputes from the first block not loaded: what was held back is dropped, and the
request saves from the load's first chunk on as vLLM recomputes (the store skips chunks it
holds). A preemption drops what was held back (vLLM frees the blocks).

A background load (vLLM's asynchronous load) is sent in the step vLLM allocates its blocks; the
request waits out of the batch (WAITING_FOR_REMOTE_KVS) until every worker reported it received,
so no step of the requests running waits for it. Its outcome reaches ``update`` no later than the
report that it was received, so its saves, once vLLM schedules it, need no holding back.

A hybrid model (`GroupPlan`): the index holds each group's keys; a hit is the longest prefix
every group holds (a window group: the window before its end; a state group: the state at its
end), each load is one run per group (one tag), always in the background, a failure taking the
request back whole (vLLM recomputes it after asking again); saves are one run per group, a window
group's only where vLLM has not freed its blocks, a state group's of the states vLLM hands off in
the step (`SchedulerOutput.kv_connector_block_state`); and each step's metadata names the blocks
vLLM handed out (`KVTierMetadata.fresh`), for the workers to wait for saves still reading them.

A finished request whose free vLLM delayed is released (`KVTierMetadata.release`) once nothing of
it is held back here; each worker reports it finished once its saves have read the blocks.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.store.keys import KeyExtra

from .choice import HOST, Choice, Chooser
from .chunk_ids import chunk_ids, chunk_keys
from .first_tokens import FirstTokens
from .groups import GroupPlan
from .metadata import ChunkRun, KVTierMetadata, KVTierWorkerMetadata
from .settings import VllmSettings

log = logging.getLogger(__name__)


@dataclass
class _Req:
    request: object
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    computed: int = 0  # tokens whose KV the scheduled steps computed (as of the last one)
    before: int = 0  # tokens computed before the last step that scheduled it
    saved: int = 0  # chunks [0, saved) held already or sent to be saved
    load: list[ChunkRun] = field(default_factory=list)  # to send with the next metadata (a run per group)
    loading: int | None = None  # tag of the load whose outcome is not in yet: saves held back
    load_first: int = 0  # that load's first chunk: a failure re-saves from there
    background: bool = False  # that load is asynchronous: vLLM waits for it, not a forward
    any_save: bool = False


class SchedulerSide:
    """settings: `VllmSettings`. block_size / hash_block_size: vLLM's (tokens per block, per
    block hash). tp_size: workers per engine that must all hold a chunk. redis: a `RedisTier`
    shared with other instances, asked for chunks this instance's workers do not hold (None: no
    such lookup). spec: the model's `ModelSpec` for the planner (None: every held chunk is
    loaded, unplanned). step_tokens: vLLM's ``max_num_batched_tokens``. kv_dtype: the cache's
    dtype as the planner names it. plan: a hybrid model's `GroupPlan` (None: one KV cache group,
    block_size its block size); with one, every load is a background load (vLLM 0.33 takes a
    hybrid model's failed loads only as failed asynchronous receipts, recomputed whole), and the
    shared tier is asked for every group's keys at once. Where the workers
    report several kinds of layer in vLLM's one group (DeepSeek-V3.2's), their plan is taken
    from their first report; with ``await_groups`` no save is sent before it."""

    def __init__(
        self,
        settings: VllmSettings,
        block_size: int,
        hash_block_size: int,
        tp_size: int,
        redis=None,
        *,
        spec=None,
        step_tokens: int = 8192,
        kv_dtype: str = "bf16",
        plan: GroupPlan | None = None,
        await_groups: bool = False,
    ):
        self.settings = settings
        self.chunk_tokens = ct = settings.chunk_tokens_for(block_size)
        if ct % hash_block_size:
            raise ValueError(f"chunk_tokens={ct}: a multiple of vLLM's hash_block_size={hash_block_size}")
        self.block_size, self.hash_block_size = block_size, hash_block_size
        self.blocks_per_chunk, self.hashes_per_chunk = ct // block_size, ct // hash_block_size
        self.all_ranks = (1 << tp_size) - 1
        self.tp_size, self.redis = tp_size, redis
        self._held: OrderedDict[bytes, str] = OrderedDict()  # tier key -> the local tier holding it
        self._extras: list[KeyExtra] | None = None  # per rank, once the workers reported theirs
        self.plan, self._await_groups = plan, await_groups
        self._say_background()
        self._group_extras: list[list[KeyExtra]] = []  # per group, per rank (a hybrid model)
        self._fresh: set[int] = set()  # blocks vLLM allocated for loads since the last metadata
        self._keys: dict[str, tuple[list[bytes], list[tuple[bytes, ...]]]] = {}  # rid -> (ids, keys)
        self._reqs: dict[str, _Req] = {}
        self._hits: dict[str, int] = {}  # req id -> chunks of its last lookup's hit
        self._background: set[str] = set()  # req ids whose last lookup's hit loads in the background
        self._to_send: list[str] = []  # req ids whose background load goes with the next metadata
        self._running: set[str] = set()  # req ids the last step computed (decides `load_async` auto)
        self._asked: dict[str, float] = {}  # req id -> until when it waits for the first report
        self._tags = itertools.count(1)
        self._tag_req: dict[int, str] = {}  # load tag -> req id, until every rank reported it
        self._outcomes: dict[int, tuple[int, int]] = {}  # load tag -> (ranks ok, ranks failed)
        self._confirmed: set[str] = set()  # loads every rank completed: saves may be sent
        self._finishing: set[str] = set()  # finished, free delayed, not released yet
        self.chooser = Chooser(
            spec,
            block_size,
            self.chunk_tokens,
            step_tokens,
            kv_dtype=kv_dtype,
            cap_s=settings.prefetch_timeout_s,
            enabled=settings.choice == "auto",
        )
        if redis is not None:
            self.chooser.kinds[redis.name] = "remote"
        self._choices: dict[str, tuple[tuple, Choice]] = {}  # req id -> (what it was made of, choice)
        self._shared: dict[str, tuple[int, int]] = {}  # req id -> (chunks held locally, then shared)
        self._shared_keys: dict[str, tuple[int, set[bytes]]] = {}  # hybrid: (local hit, keys shared)
        self._absent: set[str] = set()  # tiers a worker found down or stalled: planned without
        self._step = 0  # the number of the latest step's metadata
        self._firsts = FirstTokens(on_first=self._first_token)

    # -- vLLM's hooks --------------------------------------------------------------------------

    def lookup(self, request, num_computed: int) -> tuple[int | None, bool]:
        rid, ct = request.request_id, self.chunk_tokens
        if self._extras is None:
            if self._may_hold() and time.monotonic() < self._asked.setdefault(rid, self._deadline()):
                return None, False  # the workers' first report (what their disks hold) is not in yet
            self._hits[rid] = 0
            return 0, False
        # vLLM computes at least the last prompt token itself: a hit stops before it.
        ids = chunk_ids(
            request.block_hashes, self.hashes_per_chunk, request.num_tokens - 1, self.hash_block_size
        )
        keys = self._keys_of(rid, ids)
        redis = self.redis if self.redis is not None and self.redis.name not in self._absent else None
        if self.plan is not None:
            tiers = self.plan.tiers(keys, self._where)
            if redis is not None and len(tiers) < len(ids):
                tiers = self._hybrid_shared(rid, keys, tiers, redis.name)
        else:
            tiers = self._held_tiers(keys)
        if self.plan is None and redis is not None and len(tiers) < len(ids):
            local, shared = self._shared.get(rid, (-1, 0))
            if local != len(tiers):  # asked once per request and local hit, not every step it waits
                shared = self._shared_prefix(keys[len(tiers) :])
                self._shared[rid] = (len(tiers), shared)
            tiers += [self.redis.name] * shared
        if num_computed % self.block_size or len(tiers) * ct <= num_computed:
            self._hits[rid] = len(tiers)
            return 0, False  # a load starts on a block: never over a block vLLM computed or shares
        in_step = self.plan is None and not self._in_background(rid)
        made_of = (tuple(tiers), num_computed, in_step)
        got = self._choices.get(rid)
        if got is None or got[0] != made_of:  # planned once per request and hit, not per step asked
            got = self._choices[rid] = (made_of, self._choose(request, tiers, num_computed, in_step))
        choice = got[1]
        self._firsts.asked(rid, choice)
        n = choice.chunks
        if self.plan is not None and n:  # a hybrid hit holds its window units only at its end: all or none
            n = len(tiers)
        self._hits[rid] = n
        if n * ct <= num_computed:
            return 0, False
        # A lower tier is never read in a step; a host hit loads there only where the plan found it faster.
        background = not (in_step and choice.in_step) or any(t != HOST for t in tiers[:n])
        (self._background.add if background else self._background.discard)(rid)
        return n * ct - num_computed, background

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _Req(request)
        st.request = request
        if num_external_tokens <= 0:
            return
        n, ct, bpc = self._hits.get(rid, 0), self.chunk_tokens, self.blocks_per_chunk
        first, within = divmod(n * ct - num_external_tokens, ct)  # where vLLM's own hit ends
        skip = within // self.block_size
        ids = chunk_ids(request.block_hashes, self.hashes_per_chunk, n * ct, self.hash_block_size)
        background = rid in self._background
        got = self._choices.get(rid)
        tiers, budget = (got[0][0][:n], got[1].budget_s) if got is not None else ((), None)
        tag = next(self._tags)
        if self.plan is None:
            block_ids = list(blocks.get_block_ids()[0])
            st.load = [
                ChunkRun(
                    rid,
                    ids[first:n],
                    block_ids[first * bpc + skip : n * bpc],
                    skip,
                    tag,
                    background,
                    tuple(tiers[first:n]),
                    budget,
                )
            ]
        else:
            table = blocks.get_block_ids()
            self._fresh.update(b for g in table for b in g)

            def make(g, c0, run_ids, bids, skip):
                return ChunkRun(rid, run_ids, bids, skip, tag, True, tuple(tiers[c0:n]), budget, group=g)

            st.load = self.plan.loads(ids, table, n * ct - num_external_tokens, n, make)
            for run in st.load:
                run.parts = len(st.load)
        st.load_first, st.background = first, background
        st.saved = max(st.saved, n)  # held already (a failed load takes this back)
        if background:  # vLLM does not schedule it until it is received: sent with the next metadata
            self._to_send.append(rid)

    def build_meta(self, so) -> KVTierMetadata:
        self._step += 1
        meta = KVTierMetadata(preempted=set(so.preempted_req_ids or ()), step=self._step)
        self.chooser.steps.built(self._step, *_step_work(so))
        for rid in meta.preempted:
            self._preempted(rid)
        for rid in self._to_send:
            st = self._reqs.get(rid)
            if st is not None and st.load:
                self._send_load(meta, st)
        self._to_send.clear()
        self._running = set(so.num_scheduled_tokens)
        if self.plan is not None and self.plan.volatile:
            meta.fresh = self._fresh_blocks(so)
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = [list(g) for g in new.block_ids]
                n = so.num_scheduled_tokens.get(new.req_id, 0)
                self._scheduled(meta, st, new.num_computed_tokens, new.num_computed_tokens + n)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # after a preemption: every block is new
                st.block_ids = [list(g) for g in nb] if nb else []
            elif nb:
                if not st.block_ids:
                    st.block_ids = [[] for _ in nb]
                for have, more in zip(st.block_ids, nb, strict=True):
                    have.extend(more)
            done = cached.num_computed_tokens[i]
            self._scheduled(meta, st, done, done + so.num_scheduled_tokens.get(rid, 0))
        if self.plan is not None:
            self._add_states(meta, so)
        for rid in self._confirmed:  # their loads completed on every rank: what was held back goes
            st = self._reqs.get(rid)
            if st is not None and st.loading is None and st.block_ids:
                self._add_save(meta, rid, st)
        self._confirmed.clear()
        awaiting = self._awaiting()
        for rid in list(self._finishing):
            st = self._reqs.get(rid)
            if awaiting:
                continue  # its saves wait for the workers' first report: its blocks stay held
            if st is None or st.loading is None:  # nothing of it held back: its last saves are sent
                if self._await_groups and st is not None and st.block_ids:
                    self._add_save(meta, rid, st)  # those held back until the workers' report
                meta.release.add(rid)
                self._forget(rid)
        if any(not run.background for run in meta.loads):  # its time is a forward's and a load's
            self.chooser.steps.loading(self._step)
        return meta

    def update(self, connector_output) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVTierWorkerMetadata):
            return
        if wm.step:  # the step's forward is over: its time, and the first tokens it made
            self.chooser.steps.reported(wm.step)
            self._firsts.reported(wm.step)
        if wm.extra is not None and self._extras is None:
            model, dtype, layout, tp_size, salt = wm.extra
            self._extras = [KeyExtra(model, dtype, layout, r, tp_size, salt) for r in range(tp_size)]
            self._group_extras = [
                [KeyExtra(model, dtype, layout, r, tp_size, salt) for r in range(tp_size)]
                for model, dtype, layout, tp_size, salt in wm.extras
            ]
            if wm.groups and self.plan is None:  # kinds of layer in one group: the workers know them
                self.plan = GroupPlan(list(wm.groups), self.chunk_tokens)
                self._say_background()
        if wm.chunk_bytes:
            self.chooser.chunk_bytes = wm.chunk_bytes
        if self.plan is not None and len(wm.group_bytes) == len(self.plan.groups):
            plan, unit_bytes = self.plan, wm.group_bytes
            self.chooser.load_bytes = lambda start, n: plan.load_bytes(start, n, unit_bytes)
        for key in wm.lost:
            self._held.pop(key, None)
        for key, tier in wm.below.items():
            self._held[key] = tier
            self.chooser.kinds[tier] = "disk"
        for key in wm.held:
            self._held[key] = HOST
            self._held.move_to_end(key)
        while len(self._held) > self.settings.index_entries:
            self._held.popitem(last=False)
        self.chooser.rates |= wm.rates
        if wm.down or wm.up:
            self._absent = (self._absent | wm.down) - (wm.up - wm.down)
            log.info("kvtier: tiers planned as absent: %s", sorted(self._absent) or "none")
        for tag, mask in wm.loaded.items():
            self._outcome(tag, mask, 0)
        for tag, mask in wm.failed.items():
            self._outcome(tag, 0, mask)

    def finished(self, request) -> bool:
        rid = request.request_id
        for d in (self._hits, self._asked, self._keys, self._choices, self._shared, self._shared_keys):
            d.pop(rid, None)
        self._firsts.forget(rid)
        st = self._reqs.get(rid)
        if st is None:
            return False
        st.load = []  # never sent: the request is done
        self._background.discard(rid)
        self._running.discard(rid)
        if st.background and st.loading is not None and not st.any_save:
            self._forget(rid)  # its load writes the blocks: vLLM itself frees them once received
            return False
        # await_groups: what the workers' first report held back is sent as it is released
        pending = st.loading is not None or rid in self._confirmed or self._await_groups
        if not st.block_ids or not (pending or st.any_save):
            self._forget(rid)  # no save reads its blocks (a preempted request has none)
            return False
        self._finishing.add(rid)  # freed once released and every worker's saves read them
        return True

    def choice(self, rid: str) -> Choice | None:
        """The choice the latest lookup of request ``rid`` made (None: none, or it finished)."""
        got = self._choices.get(rid)
        return None if got is None else got[1]

    @property
    def absent(self) -> frozenset[str]:
        """The lower tiers planned as absent now: a worker found each down or stalled, and none
        has reported it answering again since."""
        return frozenset(self._absent)

    def stats(self) -> dict:
        """What the scheduler side adds to vLLM's connector stats since the last call:
        ``first_tokens``, per request with a hit whose first token came, [choice, tier, planned
        ms (None: not planned), measured ms]; empty when none came."""
        done = self._firsts.take()
        return {"first_tokens": done} if done else {}

    # -- internals -----------------------------------------------------------------------------

    def _choose(self, request, tiers: list[str], computed: int, in_step: bool) -> Choice:
        prompt = getattr(request, "num_prompt_tokens", request.num_tokens)
        try:
            return self.chooser.choose(tiers, computed, prompt, in_step)
        except Exception as exc:  # a plan that cannot be made must not stop vLLM's scheduler
            log.warning("kvtier: no plan for %s (%s): every held chunk is loaded", request.request_id, exc)
            return Choice("held", len(tiers), HOST, None, None, self.settings.prefetch_timeout_s, str(exc))

    def _scheduled(self, meta: KVTierMetadata, st: _Req, before: int, computed_after: int) -> None:
        """A request the step computes tokens [before, computed_after) of: its load, and its saves
        unless a load of it is unconfirmed (they are held back until it is)."""
        rid = st.request.request_id
        if st.load:
            self._send_load(meta, st)
        if st.computed < _prompt(st.request) <= computed_after:  # this step makes its first token
            self._firsts.scheduled(rid, meta.step)
        st.computed, st.before = computed_after, before
        if st.loading is None:
            self._add_save(meta, rid, st)

    def _send_load(self, meta: KVTierMetadata, st: _Req) -> None:
        """The request's load, into this step's metadata; its saves wait for its outcome."""
        meta.loads.extend(st.load)
        tag = st.load[0].tag
        st.loading, self._tag_req[tag] = tag, st.request.request_id
        st.load = []

    def _first_token(self, choice: Choice, measured_ms: float) -> None:
        """A first token came: one loaded in the step teaches what such a load costs beyond the
        plan's overlap of its copies and its forward."""
        if choice.in_step and choice.predicted_ms is not None:
            self.chooser.steps.in_step_seen(measured_ms - (choice.predicted_ms - choice.step_extra_ms))

    def _say_background(self) -> None:
        """A hybrid model's hits load in the background whatever ``load_async`` says: tell an
        operator who asked for "never"."""
        if self.plan is not None and self.settings.load_async == "never":
            log.warning(
                'kvtier: load_async "never" does not hold for a hybrid model: its hits load in the '
                "background (vLLM 0.33 takes a failed load of several KV cache groups only as a "
                "failed asynchronous one)"
            )

    def _in_background(self, rid: str) -> bool:
        """Whether a hit of ``rid`` loads in the background (`VllmSettings.load_async`)."""
        mode = self.settings.load_async
        return mode == "always" or (mode == "auto" and bool(self._running - {rid}))

    def _add_save(self, meta: KVTierMetadata, rid: str, st: _Req) -> None:
        """The full chunks computed so far and not saved yet: saved after this step's forward."""
        if self._awaiting():
            return  # the workers' kinds of layer are not known yet: sent once they are
        ids = chunk_ids(st.request.block_hashes, self.hashes_per_chunk, st.computed, self.hash_block_size)
        if self.plan is not None:

            def make(g, run_ids, bids):
                return ChunkRun(rid, run_ids, bids, group=g)

            n, runs = self.plan.saves(ids, st.block_ids, st.saved, st.before, make)
            if n > st.saved:
                meta.saves.extend(runs)
                st.saved, st.any_save = n, st.any_save or bool(runs)
            return
        bpc, table = self.blocks_per_chunk, st.block_ids[0] if st.block_ids else []
        n = min(len(ids), len(table) // bpc)
        if n > st.saved:
            meta.saves.append(ChunkRun(rid, ids[st.saved : n], table[st.saved * bpc : n * bpc]))
            st.saved, st.any_save = n, True

    def _add_states(self, meta: KVTierMetadata, so) -> None:
        """The states vLLM handed off in this step (a state group's, `GroupPlan.states`): saved
        after this step's forward, which writes each of them (vLLM hands a state off in the step
        that computes it, or once a load into its block was received). None of a request whose
        load is unconfirmed (a state computed from what may not have loaded is not true) or that
        finished (vLLM dropped what it had not handed off)."""
        state = getattr(so, "kv_connector_block_state", None)
        offers = getattr(state, "boundary_state_offloads", None) or {}
        for rid, got in offers.items():
            st = self._reqs.get(rid)
            if st is None or st.loading is not None or rid in self._finishing or self._awaiting():
                continue
            top = max(tokens for _, _, tokens in got)
            ids = chunk_ids(st.request.block_hashes, self.hashes_per_chunk, top, self.hash_block_size)

            def make(g, run_ids, bids, rid=rid):
                return ChunkRun(rid, run_ids, bids, group=g)

            runs = self.plan.states(ids, got, make)
            if runs:
                meta.saves.extend(runs)
                st.any_save = True

    def _outcome(self, tag: int, ok: int, failed: int) -> None:
        """Ranks' outcomes of load ``tag``; once every rank's is in, the load is confirmed (its
        held-back saves go) or, if any failed, taken back (saves resume from its first chunk)."""
        have = self._outcomes.get(tag, (0, 0))
        have = (have[0] | ok, have[1] | failed)
        if (have[0] | have[1]) != self.all_ranks:
            self._outcomes[tag] = have
            return
        self._outcomes.pop(tag, None)
        rid = self._tag_req.pop(tag, None)
        st = self._reqs.get(rid) if rid is not None else None
        if st is None or st.loading != tag:
            return  # preempted or finished meanwhile: nothing was held back for it
        st.loading = None
        if have[1] and self.plan is not None:  # vLLM recomputes the request whole, in new blocks
            st.block_ids, st.saved, st.computed = [], 0, 0
        elif have[1]:  # vLLM recomputes from the first block some rank did not load
            st.saved = min(st.saved, st.load_first)
        else:
            self._confirmed.add(rid)

    def _preempted(self, rid: str) -> None:
        st = self._reqs.get(rid)
        if st is not None:  # vLLM freed its blocks: nothing held back may read them
            st.block_ids, st.load, st.loading, st.computed = [], [], None, 0
            st.saved = 0  # on resume its chunks are recomputed or loaded; saving held ones is skipped
        self._confirmed.discard(rid)

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self._finishing.discard(rid)
        self._confirmed.discard(rid)

    def _awaiting(self) -> bool:
        """Whether saves wait for the workers' first report (their kinds of layer, `await_groups`)."""
        return self._await_groups and self._extras is None

    def _may_hold(self) -> bool:
        """Whether a tier may hold chunks before any worker reported (a disk, a shared tier)."""
        return bool(self.settings.disk_path) or self.redis is not None

    def _deadline(self) -> float:
        return time.monotonic() + self.settings.prefetch_timeout_s

    def _keys_of(self, rid: str, ids: list[bytes]) -> list[tuple[bytes, ...]]:
        """Per chunk of ``ids``, every rank's tier key (computed once per request and chunk)."""
        known, keys = self._keys.get(rid, ([], []))
        if known != ids[: len(known)]:  # not a prefix of the chunks named before: start again
            known, keys = [], []
        if len(ids) > len(known):
            new, h = ids[len(known) :], self.settings.hash_name
            if self.plan is None:
                per_rank = [chunk_keys(new, x, h) for x in self._extras]
                more = list(zip(*per_rank, strict=True))
            else:  # chunk -> group -> rank
                per_group = [
                    list(zip(*[chunk_keys(new, x, h) for x in g], strict=True)) for g in self._group_extras
                ]
                more = list(zip(*per_group, strict=True))
            known, keys = known + new, keys + more
            self._keys[rid] = (known, keys)
        return keys[: len(ids)]

    def _held_tiers(self, keys: list[tuple[bytes, ...]]) -> list[str]:
        """The tier of each chunk of ``keys`` the workers hold, from the first: the host where
        every rank's host holds it, else a rank's lower tier; up to the first chunk some rank
        lacks, or holds only in a tier planned as absent."""
        held, absent, out = self._held, self._absent, []
        for ranks in keys:
            where = [held.get(k) for k in ranks]
            if None in where:
                break
            tier = next((t for t in where if t != HOST), HOST)
            if tier in absent:
                break
            out.append(tier)
        return out

    def _where(self, key: bytes) -> str | None:
        """The local tier holding ``key``, None where none does or it is planned absent."""
        tier = self._held.get(key)
        return None if tier is None or tier in self._absent else tier

    def _fresh_blocks(self, so) -> set[int]:
        """Every block id vLLM handed out for this step (any group; vLLM's null block 0 aside)."""
        fresh, self._fresh = self._fresh, set()
        for new in so.scheduled_new_reqs:
            for g in new.block_ids:
                fresh.update(g)
        for nb in so.scheduled_cached_reqs.new_block_ids:
            for g in nb or ():
                fresh.update(g)
        for copy in so.kv_cache_block_copies or ():
            fresh.add(getattr(copy, "dst_block_id", None) or copy[1])
        fresh.discard(0)
        return fresh

    def _hybrid_shared(self, rid: str, keys, local: list[str], name: str) -> list[str]:
        """A hybrid hit with the shared tier: the tier asked once per request and local hit, in
        one round trip, which of the keys (every group's, every rank's) no local tier holds it
        holds; the hit every group then holds, locally or there."""
        got = self._shared_keys.get(rid)
        if got is None or got[0] != len(local):
            ask = [k for chunk in keys for group in chunk for k in group if self._where(k) is None]
            try:
                found = self.redis.contains_many(ask) if ask else []
            except Exception as exc:  # a failing shared tier is a miss, never a scheduler crash
                log.warning("kvtier: shared-tier lookup failed: %s", exc)
                found = []
            got = self._shared_keys[rid] = (len(local), {k for k, f in zip(ask, found, strict=False) if f})
        shared = got[1]
        if not shared:
            return local
        return self.plan.tiers(keys, lambda k: self._where(k) or (name if k in shared else None))

    def _shared_prefix(self, keys: list[tuple[bytes, ...]]) -> int:
        """How many of the chunks of ``keys`` (from the first) the shared tier holds for every rank."""
        n = len(keys)
        try:
            for rank in range(self.tp_size):
                found = self.redis.contains_many([k[rank] for k in keys[:n]])
                n = next((i for i, f in enumerate(found) if not f), len(found))
                if n == 0:
                    break
        except Exception as exc:  # a failing shared tier is a miss, never a scheduler crash
            log.warning("kvtier: shared-tier lookup failed: %s", exc)
            return 0
        return n


def _prompt(request) -> int:
    return getattr(request, "num_prompt_tokens", request.num_tokens)


def _step_work(so) -> tuple[int, float]:
    """(tokens scheduled, attention's pairs: sum of n * (computed + n / 2) per request) of a step."""
    tokens, work, sched = 0, 0.0, so.num_scheduled_tokens
    computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    for rid, n in sched.items():
        tokens += n
        work += n * (computed.get(rid, 0) + n / 2)
    return tokens, work
