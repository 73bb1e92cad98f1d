"""KVTierConnector: kvtier's tiers (pinned host, disk, Redis) behind vLLM's KV connector API.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_bytes": 17179869184, "redis_url": "redis://h:6379"}}'

vLLM makes one instance per role: the scheduler's delegates to `SchedulerSide` (no tensors),
each worker's to `WorkerSide` (the engine and the store). Settings: `VllmSettings`.

A best-effort cache (``requires_kv_delivery`` False): a save that does not happen is a later
miss; a load that does not happen (a chunk evicted between the grant and the load, a tier that
fails) is reported (``get_block_ids_with_load_errors``) and vLLM recomputes those blocks. That
needs ``kv_load_failure_policy="recompute"``: vLLM 0.33's default is "fail", under which each
such hit would end its request with FINISHED_ERROR, and a cache cannot promise that every hit
it grants is still there when the load runs. The connector refuses to start under "fail" (in
both roles, with a message naming the setting).

Hybrid models keep vLLM's hybrid allocator on (`SupportsHMA`): each KV cache group is planned
on its own (`groups.py`: what a chunk keeps and a hit needs per group), every load runs in the
background and a failed one is a failed receipt (vLLM 0.33 takes no failed block ids from a
model with several groups). A state group (Mamba, linear attention) keeps the state at each
chunk's end, as vLLM hands it off under prefix caching; its chunk is one block unless
``chunk_tokens`` says otherwise. A group of a kind not served (a state group without prefix
caching, among others: `groups.py`) leaves the connector idle, said once in the log.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .groups import STATE, GroupPlan, groups_of
from .metadata import KVTierMetadata
from .scheduler import SchedulerSide
from .settings import VllmSettings

log = logging.getLogger(__name__)
BLOCK_FIRST = "BLHNC"  # what kv_layout "auto" asks for: [H, N, C] pages, every layer's of a block together


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's ``(vllm_config, role, kv_cache_config)``. A model with several KV cache groups
    (vLLM's hybrid allocator) is served per group (`groups.py`: full attention, MLA and its DSA
    indexer, sliding window, Mamba and linear-attention state under prefix caching); one with a
    group of another kind leaves the connector idle (no hits, no saves), said once in the log."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _check_failure_policy(self._kv_transfer_config)
        self.settings = s = VllmSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        block_size = cc.block_size
        groups, refused = groups_of(kv_cache_config)
        # None: one group of KV, served as ever (a state group is served per group, even alone)
        self.groups = groups if len(groups) > 1 or any(g.kind == STATE for g in groups) else None
        self.idle = refused is not None
        if self.idle:
            log.warning("kvtier: the connector stays idle for this model: %s", refused)
        elif self.groups is not None:
            block_size = math.lcm(*(g.block_size for g in groups))  # vLLM's scheduler block size
            if s.chunk_tokens is None and any(g.kind == STATE for g in groups):
                # vLLM keeps a state only where a step ends on a block boundary: a chunk of one
                # block keeps every state it keeps, a longer one only those at its multiples.
                s.chunk_tokens = block_size
        model = s.model or f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}"
        tp_size = pc.tensor_parallel_size
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side = None
        if role == KVConnectorRole.SCHEDULER and not self.idle:  # idle: asked nothing, no sizes checked
            hash_bs = getattr(kv_cache_config, "hash_block_size", None) or block_size
            redis = None
            if s.redis_url:
                from kvtier.store.redis_tier import RedisTier

                redis = RedisTier(url=s.redis_url, cluster=s.redis_cluster)
            self.scheduler_side = SchedulerSide(
                s,
                block_size,
                hash_bs,
                tp_size,
                redis=redis,
                spec=_model_spec(mc),
                step_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                kv_dtype=_kv_dtype(cc, mc),
                plan=GroupPlan(groups, s.chunk_tokens_for(block_size)) if self.groups else None,
                await_groups=_may_hold_kinds(kv_cache_config),
            )
        elif role != KVConnectorRole.SCHEDULER:
            from .worker import WorkerSide

            order = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cc, "kv_cache_layout", None)
            self.worker_side = WorkerSide(
                s,
                model,
                tp_rank=_tp_rank(),
                tp_size=tp_size,
                order=order,
                block_size=block_size,
                groups=self.groups,
            )

    # -- properties and class hooks ------------------------------------------------------------

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True with ``layerwise`` and its per-layer event waits (host calls between graph pieces);
        False with ``full_graphs`` (the waits are flag waits a FULL graph holds) or without
        ``layerwise`` (one wait before the forward). vLLM asks once, in `VllmConfig.__post_init__`."""
        s = VllmSettings.from_extra(extra_config)
        return s.layerwise and not s.flag_waits

    def has_connector_metadata(self) -> bool:
        """vLLM calls wait_for_layer_load only where this is True (`maybe_transfer_kv_layer`,
        vllm/model_executor/layers/attention/kv_transfer_utils.py). A CUDA graph capture binds no
        metadata: neither `GPUModelRunner._dummy_run` (vllm/v1/worker/gpu_model_runner.py) nor the
        newer runner's `CudaGraphManager.capture` (vllm/v1/worker/gpu/cudagraph_utils.py) calls
        bind_connector_metadata. With flag waits, it is also True while torch's current
        stream captures, so the FULL graph holds each layer's flag wait; every replay runs it."""
        if self._connector_metadata is not None:
            return True
        ws = self.worker_side
        return ws is not None and ws.flags is not None and ws.capturing()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """The order the ``kv_layout`` setting asks for (kvtier reads every order; B-first ones
        move a block of every layer as one contiguous run). vLLM's engine core calls this once
        (``resolve_kv_cache_layout``); VLLM_KV_CACHE_LAYOUT wins over it, and an order some
        backend does not accept is dropped there with a warning."""
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        want = VllmSettings.from_extra(extra).kv_layout
        if want == "any":
            return None
        if want != "auto":
            return want
        return BLOCK_FIRST if BLOCK_FIRST in _accepted_layouts(vllm_config) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from .stats import KVTierStats

        return KVTierStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .prom import KVTierPromMetrics

        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        if self.idle:
            return
        if self.settings.flag_waits:
            _check_outermost(self, self.settings.where)
        self.worker_side.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        if isinstance(kv_connector_metadata, KVTierMetadata):
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVTierMetadata):
            self.worker_side.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # a chunk is saved whole (every layer, one job) in wait_for_save, after the forward

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, KVTierMetadata):
            self.worker_side.save(meta)  # async: blocks held via request_finished until copied

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's get_finished, and the background loads that failed (several KV cache groups:
        vLLM 0.33 refuses failed block ids then, and recomputes such a request whole)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker_side.failed_receipts() if self.worker_side is not None else set()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()), failed_recving=failed
        )

    def build_connector_worker_meta(self):
        return self.worker_side.report()

    def get_kv_connector_stats(self):
        if self.idle:
            return None
        side = self.worker_side if self.worker_side is not None else self.scheduler_side
        data = side.stats()  # the workers' transfers; the scheduler's choices and first tokens
        return self.build_kv_connector_stats(data) if data else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None and self.scheduler_side.redis is not None:
            self.scheduler_side.redis.close()

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.idle:
            return 0, False
        return self.scheduler_side.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if not self.idle:
            self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVTierMetadata:
        if self.idle:
            return KVTierMetadata()
        return self.scheduler_side.build_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        if not self.idle:
            self.scheduler_side.update(connector_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.idle:
            return False, None
        return self.scheduler_side.finished(request), None  # True: freed once its saves read them

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call for a SupportsHMA connector, once per request with every group's blocks;
        True holds them all until each worker's saves read them."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])


def _may_hold_kinds(kv_cache_config) -> bool:
    """Whether vLLM's one group may hold several kinds of layer the workers see and the scheduler
    does not (an MLA group leading a DSA indexer: vLLM gives its scheduler one spec of them)."""
    found = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return len(found) == 1 and bool(getattr(found[0].kv_cache_spec, "is_index_group_leader", False))


def _accepted_layouts(vllm_config) -> list[str]:
    """The orders every attention backend of this model accepts, as vLLM's workers report them
    (`get_supported_kv_cache_layouts`: a backend that declares none, FlashAttention's case, takes
    all six); [] when they cannot be found here (nothing is asked for then)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector import utils
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        backends = utils.get_current_attn_backends(vllm_config)
        return [x.name for x in get_supported_kv_cache_layouts(backends)]
    except Exception as exc:  # a layout preference is not worth failing vLLM's start-up
        log.info("kvtier: the attention backends' KV cache layouts not found (%s): no layout asked", exc)
        return []


def _check_outermost(connector, where: str) -> None:
    """Refuse flag waits when vLLM's connector is another one (kvtier inside a MultiConnector):
    vLLM then asks that one's has_connector_metadata during a capture, the FULL graphs would hold
    no flag wait, and a step's forward would read blocks still loading."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group() and get_kv_transfer_group() is not connector:
        outer = type(get_kv_transfer_group()).__name__
        raise ValueError(
            f"kvtier: {where}['full_graphs']=true needs KVTierConnector as vLLM's kv_connector itself, "
            f"not inside {outer}: vLLM would capture its FULL CUDA graphs without kvtier's layer waits; "
            "set full_graphs to false there (vLLM then uses PIECEWISE graphs)"
        )


def _model_spec(model_config):
    """The planner's `ModelSpec` of vLLM's model config; None (every held chunk is loaded,
    unplanned) where the planner cannot read it."""
    try:
        from kvtier.hfconfig import from_hf_dict

        return from_hf_dict(
            model_config.hf_config.to_dict(), "vLLM's model config", key=str(model_config.model)
        )
    except Exception as exc:  # a model the planner cannot read is served all the same
        log.warning("kvtier: the planner cannot read this model's config (%s): every held chunk loads", exc)
        return None


def _kv_dtype(cache_config, model_config) -> str:
    """The KV cache's dtype as the planner names it."""
    want = str(getattr(cache_config, "cache_dtype", "auto"))
    if want.startswith("fp8"):
        return "fp8"
    if want == "auto":
        want = str(getattr(model_config, "dtype", "bfloat16")).removeprefix("torch.")
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
        want, "bf16"
    )


def _check_failure_policy(kv_transfer_config) -> None:
    """Refuse what would fail requests: a cache's hit can be gone by the time its load runs."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise ValueError(
            f'kvtier: kv_transfer_config kv_load_failure_policy={policy!r} (vLLM\'s default is "fail") '
            "would end a request with an error whenever a chunk kvtier granted is evicted before its "
            'load; set "kv_load_failure_policy": "recompute" in --kv-transfer-config: vLLM then '
            "recomputes the blocks not loaded"
        )


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # no process group (one worker, or a test): rank 0
        return 0
