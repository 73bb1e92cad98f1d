"""kvtier's connector driven through vLLM 0.33's real scheduler, as vLLM's own connector tests drive
theirs (configs, scheduler and requests from `vllm_utils.py`), with every TP rank's worker hooks
on CPU caches and a stand-in model whose attention reads are checked (`stand_in.py`).

    Rank      one TP rank's worker connector over its cache, on its own SimDevice
    Engine    the scheduler, the ranks and the model, stepped as vLLM's engine core steps them
              (sync, or async with a batch queue of two: schedule k+1 before update k); with
              ``full_graph``, every forward is the replay of one CUDA graph captured at start

A step, in vLLM 0.33's order (`gpu_model_runner.execute_model`, `kv_connector_model_runner_mixin`):
handle_preemptions -> CoW block copies -> bind metadata -> start_load_kv (before the forward if
the step has sync loads, else after it) -> per layer, every rank: wait_for_layer_load, then the
layer's forward -> wait_for_save -> get_transfer_results -> get_block_ids_with_load_errors ->
stats / events / build_connector_worker_meta -> clear metadata; the ranks' outputs through vLLM's
own `KVOutputAggregator`, then `update_from_output`. Each rank runs on its own `SimDevice`, whose
copies land late: a missing wait shows as a wrong read.

A FULL CUDA graph, simulated (``full_graph``): at start each rank's forward is captured as vLLM
captures it, with no connector metadata bound and the worker told a capture is on, its hooks
called where vLLM's `maybe_transfer_kv_layer` calls them (wait_for_layer_load only where
has_connector_metadata answers True); what they queue on the compute stream is kept per layer
(the graph's nodes) instead of run. Each step's forward then queues those nodes again before each
layer and calls no hook inside the forward, as a graph replay runs no Python.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import torch
from stand_in import P, StandIn
from vllm_utils import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    NUM_LAYERS,
    _computed_of,
    create_kv_cache_config,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
    layer_names,
)

POISON = -1.0  # what a block holds before anything wrote it: never a value of the stand-in
STALL_S = 30.0  # a compute stream blocked this long before a layer is a wait that never passes


class Rank:
    """One TP rank's worker connector over a CPU cache in vLLM's per-layer [B, H, N, C] views
    (physical order ``order``), on its own SimDevice (``device``: another one, e.g. slower)."""

    def __init__(self, cfg, kcc, rank: int, *, order: str = "LBHNC", tiers=None, device=None):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvtier.device import SimDevice
        from kvtier.integrations.vllm import KVTierConnector

        self.rank = rank
        self.conn = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
        ws = self.ws = self.conn.worker_side
        ws.tp_rank, ws.order = rank, order  # vLLM's process group names the rank; here we do
        if tiers is not None:
            ws._tiers = tiers
        self.dev = device or SimDevice()
        ws._device = self.dev
        self.names = layer_names()
        sizes = dict(L=NUM_LAYERS, B=kcc.num_blocks, H=HEADS, N=BLOCK, C=2 * HEAD_DIM)
        buf = torch.full([sizes[a] for a in order], POISON)
        self.cache = buf.permute(*[order.index(a) for a in "LBHNC"])  # logical [L, B, H, N, C]
        self.conn.register_kv_caches({n: self.cache[i] for i, n in enumerate(self.names)})

    @property
    def store(self):
        return self.ws.store

    def close(self) -> None:
        self.conn.shutdown()
        self.dev.close()


class Engine:
    """vLLM's scheduler with kvtier's connector, ``tp_size`` ranks and the stand-in model.

    extra: kv_connector_extra_config. num_blocks: vLLM's KV blocks (block 0 is its null block).
    policy: kv_load_failure_policy. async_scheduling: `AsyncScheduler` and a batch queue of two.
    tiers(rank): a rank's lower tiers (None: what the settings build). device(rank): its SimDevice.
    step_s_per_token: the stand-in's forward also takes this long per token scheduled (a model
    whose prefill costs time, as the planner's choice needs; 0: as fast as the stand-in runs).
    """

    def __init__(
        self,
        tmp: Path,
        extra: dict,
        *,
        num_blocks: int = 64,
        tp_size: int = 1,
        policy: str = "recompute",
        async_scheduling: bool = False,
        order: str = "LBHNC",
        tiers=None,
        device=None,
        full_graph: bool = False,
        step_s_per_token: float = 0.0,
        **config,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.cfg = create_vllm_config(
            tmp, extra, tp_size=tp_size, policy=policy, async_scheduling=async_scheduling, **config
        )
        self.kcc = create_kv_cache_config(num_blocks)
        self.sched = create_scheduler(self.cfg, self.kcc)
        self.ranks = [
            Rank(
                self.cfg,
                self.kcc,
                r,
                order=order,
                tiers=None if tiers is None else tiers(r),
                device=None if device is None else device(r),
            )
            for r in range(tp_size)
        ]
        self.model = StandIn([rk.cache for rk in self.ranks], BLOCK)
        self.graphs = [_capture(rk) for rk in self.ranks] if full_graph else None
        self.aggregator = KVOutputAggregator(tp_size)
        self.async_ = async_scheduling
        self.step_s_per_token = step_s_per_token
        self.queue: deque = deque()
        self.requests: dict[str, object] = {}
        self.prompts: dict[str, list[int]] = {}
        self.samples: dict[str, dict[int, int]] = {}  # req id -> position -> token sampled for it
        self.blocks: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}  # tokens vLLM delivered per request
        self.finished: dict[str, str] = {}  # req id -> finish reason
        self.history: list = []  # (scheduler output, aggregated KV connector output) per step run
        self.steps = 0
        self.before_execute = None  # f(scheduler output): runs after schedule, before the workers
        # (step, req id) whose reads need not be true: its load failed there (and, async, the step
        # already scheduled after it); vLLM drops their output and recomputes
        self.failed_loads: set[tuple[int, str]] = set()
        self.logged: dict = {}  # the connector's stats vLLM's scheduler hands its loggers, summed

    # -- requests -----------------------------------------------------------------------------

    hash_block_size = BLOCK  # tokens per block hash, as vLLM's engine core hashes requests

    def add(self, rid: str, tokens: list[int], max_tokens: int = 2):
        req = create_request(rid, tokens, max_tokens, self.hash_block_size)
        self.requests[rid], self.prompts[rid] = req, list(tokens)
        self.samples[rid] = {}
        self.model.forget(rid)
        self.sched.add_request(req)
        return req

    def tokens(self, rid: str, upto: int) -> list[int]:
        """The request's tokens 0..upto-1: its prompt, then what the model sampled for each position."""
        prompt, got = self.prompts[rid], self.samples[rid]
        return prompt[:upto] + [got[p] for p in range(len(prompt), upto)]

    # -- stepping -----------------------------------------------------------------------------

    def step(self):
        """One call of the engine core's step (sync) or step_with_batch_queue (async)."""
        s = self.sched
        if not self.async_:
            if not s.has_requests():
                return None
            so = s.schedule()
            out = self._execute(so)
            self._update(so, out)
            return so
        so = None
        if s.has_requests():
            so = s.schedule()
            out = self._execute(so)
            self.queue.appendleft((so, out))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.queue) < 2 and (executed or s.has_requests()):
                return so
        if not self.queue:
            return so
        old, out = self.queue.pop()
        self._update(old, out)
        return so

    def run(self, timeout_s: float = 60.0) -> None:
        """Steps until vLLM has nothing left (every request finished, every delayed free done)."""
        deadline = time.monotonic() + timeout_s
        while self.sched.has_requests() or self.queue:
            self.step()
            if time.monotonic() > deadline:
                raise AssertionError(f"not done in {timeout_s}s: {self.pending()}")
            time.sleep(0.001)  # copies land on the SimDevices' threads meanwhile

    def settle(self, timeout_s: float = 30.0) -> None:
        """`run`, then every copy landed and every rank reported its held chunks to the scheduler:
        what a server looks like some idle time after its last request."""
        self.run(timeout_s)
        for rk in self.ranks:
            rk.ws.wait_submitted()  # the saver and loader threads queued what they were handed
            rk.dev.synchronize()
            if rk.store is not None:
                rk.store.flush(timeout_s)
        self._idle_report()

    def loads(self, rid: str) -> list[int]:
        """Chunks of each load the scheduler sent for ``rid``, in step order."""
        return [
            len(r.ids) for so, _ in self.history for r in so.kv_connector_metadata.loads if r.req_id == rid
        ]

    def scheduled(self, rid: str) -> list[int]:
        """Tokens scheduled for ``rid`` in each step that scheduled it."""
        return [so.num_scheduled_tokens[rid] for so, _ in self.history if rid in so.num_scheduled_tokens]

    def invalid_blocks(self) -> set[int]:
        """Every block any rank reported as not loaded, over every step."""
        return set().union(*(kv.invalid_block_ids for _, kv in self.history if kv is not None))

    def counts(self) -> dict:
        """The workers' stats (vLLM's kv_connector_stats) summed over every step (lists joined)."""
        out: dict = {}
        for _, kv in self.history:
            if kv is not None and kv.kv_connector_stats is not None:
                for k, v in kv.kv_connector_stats.data.items():
                    out[k] = out.get(k, [] if isinstance(v, list) else 0) + v
        return out

    def violations(self, rid: str | None = None) -> list[str]:
        """Reads of KV that was not true, but for those of a step whose load failed (vLLM drops
        that step's output and recomputes: the protocol promises nothing of its reads)."""
        return [
            str(v)
            for v in self.model.violations
            if (rid is None or v.req_id == rid) and (v.step, v.req_id) not in self.failed_loads
        ]

    def first_token(self, tokens: list[int]) -> int:
        """The token the model samples after ``tokens`` from the true KV (a recompute's)."""
        t = self.model.truth("__reference__", tokens)
        top = [sum(t.values[-1][r][p] for r in range(t.ranks)) % P for p in range(len(tokens))]
        return self.model.sample(top)

    def pending(self) -> str:
        s = self.sched
        return f"{len(s.running)} running, {len(s.waiting)} waiting, {len(s.requests)} held by vLLM"

    def close(self) -> None:
        for rk in self.ranks:
            rk.close()
        self.sched.connector.shutdown()

    # -- internals ----------------------------------------------------------------------------

    def _execute(self, so):
        """Every rank's worker hooks and the model over one scheduler output, aggregated."""
        meta = so.kv_connector_metadata
        if self.before_execute is not None:
            self.before_execute(so)
        self.steps += 1
        self.model.step_no = self.steps
        self._track_blocks(so)
        for rk in self.ranks:
            rk.conn.handle_preemptions(meta)  # before the batch's state update, as vLLM calls it
            if so.kv_cache_block_copies:
                _cow(rk, so.kv_cache_block_copies)
        for rk in self.ranks:
            rk.conn.bind_connector_metadata(meta)
            if so.has_sync_kv_loads:
                rk.conn.start_load_kv(None)
        sampled = self._forward(so)
        time.sleep(so.total_num_scheduled_tokens * self.step_s_per_token)  # the model's own time
        outputs = []
        for rk in self.ranks:
            c = rk.conn
            if not so.has_sync_kv_loads:
                c.start_load_kv(None)  # no sync loads: submitted after the forward
            c.wait_for_save()
            res = c.get_transfer_results(so.finished_req_ids)
            from vllm.v1.outputs import KVConnectorOutput

            kv = KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=c.get_block_ids_with_load_errors(),
                kv_connector_stats=c.get_kv_connector_stats(),
                kv_cache_events=c.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=c.build_connector_worker_meta(),
            )
            c.clear_connector_metadata()
            outputs.append(create_model_runner_output(list(so.num_scheduled_tokens), sampled, kv))
        out = self.aggregator.aggregate(outputs)
        self.history.append((so, out.kv_connector_output))
        bad = out.kv_connector_output.invalid_block_ids if out.kv_connector_output else set()
        for rid in so.num_scheduled_tokens if bad else ():
            if bad & set(self.blocks[rid]):  # its load failed: this step read what never loaded
                self.failed_loads |= (
                    {(self.steps, rid), (self.steps + 1, rid)} if self.async_ else {(self.steps, rid)}
                )
        return out

    def _forward(self, so) -> dict[str, list[int]]:
        """The stand-in forward over every scheduled request, layer by layer on every rank."""
        work = []
        for rid, n in so.num_scheduled_tokens.items():
            start = _computed_of(so, rid)
            work.append((rid, self.tokens(rid, start + n), self.blocks[rid], start, n))
        below: dict = {}
        for li, name in enumerate(layer_names()):
            for r, rk in enumerate(self.ranks):
                compute = rk.dev.current_stream()
                if self.graphs is None:
                    rk.conn.wait_for_layer_load(name)
                else:
                    for node in self.graphs[r][li]:
                        compute._put(node)  # the replay runs what the capture queued before this layer
                if not compute.record().synchronize(STALL_S):  # the forward runs on the host, in stream order
                    for other in self.ranks:
                        other.dev.close()  # every blocked stream released: the test fails, not hangs
                    raise AssertionError(f"step {self.steps}: rank {r}'s forward blocked before layer {li}")
            if work:
                self.model.layer(li, work, below)
            for rk in self.ranks if self.graphs is None else ():
                rk.conn.save_kv_layer(name, rk.cache[li], None)
        sampled = {}
        for rid, _, _, start, n in work:
            if start + n >= len(self.prompts[rid]):  # the step reached the prompt's end: a token
                tok = self.model.sample(below[rid])
                self.samples[rid][start + n] = tok
                sampled[rid] = [tok]
        return sampled

    def _update(self, so, out) -> None:
        got = self.sched.update_from_output(so, out)
        for eco in got.values():
            stats = eco.scheduler_stats.kv_connector_stats if eco.scheduler_stats else None
            for k, v in (stats or {}).items():  # the workers' and the scheduler side's, as logged
                self.logged[k] = self.logged.get(k, [] if isinstance(v, list) else 0) + v
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = str(o.finish_reason)

    def _idle_report(self) -> None:
        """An empty step's worker reports, fed to the scheduler: what settled since is known."""
        from vllm.v1.outputs import KVConnectorOutput

        from kvtier.integrations.vllm.metadata import KVTierMetadata

        outs = []
        for rk in self.ranks:
            c = rk.conn
            c.bind_connector_metadata(KVTierMetadata())
            c.start_load_kv(None)
            c.wait_for_save()
            kv = KVConnectorOutput(kv_connector_worker_meta=c.build_connector_worker_meta())
            c.clear_connector_metadata()
            outs.append(create_model_runner_output([], {}, kv))
        out = self.aggregator.aggregate(outs)
        self.sched.connector.update_connector_output(out.kv_connector_output)

    def _track_blocks(self, so) -> None:
        for new in so.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[0])
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                self.blocks[rid] = list(nb[0]) if nb else []
            elif nb:
                self.blocks[rid] = self.blocks.get(rid, []) + list(nb[0])


def _capture(rk: Rank) -> list[list]:
    """Rank ``rk``'s forward captured as a FULL CUDA graph (module docstring): per layer, the
    nodes its hooks queued on the compute stream."""
    compute, graph = rk.dev.current_stream(), []
    rk.ws.capturing = lambda: True  # torch's current stream is capturing
    try:
        for name in rk.names:
            nodes: list = []
            compute._put = nodes.append  # captured: kept as the graph's nodes, not run
            try:
                if rk.conn.has_connector_metadata():  # vLLM's check (no attention metadata is None here)
                    rk.conn.wait_for_layer_load(name)
            finally:
                del compute._put
            graph.append(nodes)
    finally:
        del rk.ws.capturing
    return graph


def _cow(rk: Rank, copies) -> None:
    """vLLM's copy-on-write block copies, on the compute stream before the forward."""
    src = torch.tensor([c[0] for c in copies])
    dst = torch.tensor([c[1] for c in copies])

    def run() -> None:
        rk.cache[:, dst] = rk.cache[:, src]

    rk.dev.launch(run, rk.dev.current_stream())
