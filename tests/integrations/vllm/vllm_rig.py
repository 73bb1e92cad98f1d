"""A real vLLM 0.33 `Scheduler` with kvtier's connector (configs from `vllm_utils.py`), on the CPU.
The earlier, simpler rig (`vllm_harness.py` drives both schedulers, TP ranks and a checked model).

Requests run whole: ``step()`` schedules, plays the worker side of every rank on CPU tensors
(a mock model runner: the "forward" writes each computed token's KV as a function of the
token prefix, so a loaded block can be compared with what recomputing writes), and feeds the
output back into the scheduler.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from vllm_utils import (
    BLOCK,
    HEAD_DIM,
    HEADS,
    NUM_LAYERS,
    _computed_of,
    create_kv_cache_config,
    create_request,
    create_scheduler,
    create_vllm_config,
)


def make_scheduler(tmp: Path, extra: dict, num_blocks: int = 64, tp_size: int = 1, policy: str = "recompute"):
    """(VllmConfig, KVCacheConfig, Scheduler) of one worker's view (the workers' TP rank and size
    are set on each `Worker`)."""
    cfg = create_vllm_config(tmp, extra, policy=policy)
    kcc = create_kv_cache_config(num_blocks)
    return cfg, kcc, create_scheduler(cfg, kcc)


def make_request(rid: str, tokens: list[int], max_tokens: int = 2):
    return create_request(rid, tokens, max_tokens)


def kv_value(tokens: list[int], pos: int, layer: int) -> float:
    """The mock forward's KV of token ``pos``: a function of the whole prefix (exact in fp32)."""
    h = 0
    for i, t in enumerate(tokens[: pos + 1]):
        h = (h * 31 + t * (i + 1)) % 100003
    return float(h + layer * 100003)


class Worker:
    """One rank's worker connector over CPU caches in vLLM's per-layer [B, H, N, C] views."""

    def __init__(
        self,
        cfg,
        kcc,
        num_blocks: int,
        order: str = "LBHNC",
        tiers=None,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
    ):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvtier.device import SimDevice
        from kvtier.integrations.vllm import KVTierConnector

        self.conn = KVTierConnector(cfg, KVConnectorRole.WORKER, kcc)
        ws = self.conn.worker_side
        ws._tiers, ws.tp_rank, ws.tp_size, ws.order = tiers, tp_rank, tp_size, order
        ws._device = self.dev = device or SimDevice()
        self.names = kcc.kv_cache_groups[0].layer_names
        sizes = dict(L=NUM_LAYERS, B=num_blocks, H=HEADS, N=BLOCK, C=2 * HEAD_DIM)
        buf = torch.full([sizes[a] for a in order], -1.0)
        perm = [order.index(a) for a in "LBHNC"]  # logical [L, B, H, N, C] view of the buffer
        self.cache = buf.permute(*perm)
        self.conn.register_kv_caches({n: self.cache[i] for i, n in enumerate(self.names)})

    def step(self, so, requests: dict):
        from vllm.v1.outputs import KVConnectorOutput

        c = self.conn
        c.bind_connector_metadata(so.kv_connector_metadata)
        c.handle_preemptions(so.kv_connector_metadata)
        c.start_load_kv(None)
        blocks = _blocks_of(so)
        for li, name in enumerate(self.names):
            c.wait_for_layer_load(name)
            self.dev.current_stream().synchronize()  # the mock forward runs on the host
            for rid, n in so.num_scheduled_tokens.items():
                req, start = requests[rid], _computed_of(so, rid)
                for p in range(start, start + n):
                    b = blocks[rid][p // BLOCK]
                    self.cache[li, b, :, p % BLOCK, :] = kv_value(req.all_token_ids, p, li)
        c.wait_for_save()
        sending, recving = c.get_finished(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=c.get_block_ids_with_load_errors(),
            kv_connector_stats=c.get_kv_connector_stats(),
            kv_connector_worker_meta=c.build_connector_worker_meta(),
        )
        c.clear_connector_metadata()
        return out

    def check(self, req, block_ids: list[int], upto: int) -> None:
        """Every token < ``upto`` of ``req`` holds the KV the mock forward computes."""
        for li in range(NUM_LAYERS):
            for p in range(upto):
                got = self.cache[li, block_ids[p // BLOCK], :, p % BLOCK, :]
                want = kv_value(req.all_token_ids, p, li)
                assert torch.all(got == want), f"layer {li} token {p}: {got.flatten()[0]} != {want}"


_BLOCKS: dict[str, list[int]] = {}


def _blocks_of(so) -> dict[str, list[int]]:
    for new in so.scheduled_new_reqs:
        _BLOCKS[new.req_id] = list(new.block_ids[0])
    cr = so.scheduled_cached_reqs
    for i, rid in enumerate(cr.req_ids):
        nb = cr.new_block_ids[i]
        if rid in cr.resumed_req_ids:
            _BLOCKS[rid] = list(nb[0]) if nb else []
        elif nb:
            _BLOCKS[rid] = _BLOCKS.get(rid, []) + list(nb[0])
    return _BLOCKS


def run_step(sched, workers: list, requests: dict, sample: int = 7):
    """One engine step: schedule, every rank's worker, the output back into the scheduler."""
    from vllm.v1.outputs import ModelRunnerOutput

    so = sched.schedule()
    outs = [w.step(so, requests) for w in workers]
    kv = outs[0]
    for o in outs[1:]:  # what vLLM's KVOutputAggregator does for the fields used here
        kv.invalid_block_ids |= o.invalid_block_ids
        if o.kv_connector_worker_meta is not None:
            kv.kv_connector_worker_meta = (
                o.kv_connector_worker_meta
                if kv.kv_connector_worker_meta is None
                else kv.kv_connector_worker_meta.aggregate(o.kv_connector_worker_meta)
            )
    ids = list(so.num_scheduled_tokens)
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[sample] for _ in ids],
        kv_connector_output=kv,
    )
    sched.update_from_output(so, mro)
    return so, kv


def free_blocks(sched) -> int:
    """Blocks vLLM's pool can hand out now (its cached-but-unused blocks count as free)."""
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def drain(sched, workers: list, requests: dict, timeout_s: float = 30.0) -> None:
    """Empty steps until every request finished and vLLM got every block back: the workers'
    saves have completed (vLLM frees a finished request's blocks only then) and were reported."""
    total = sched.kv_cache_manager.block_pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
    deadline = time.monotonic() + timeout_s
    while True:
        run_step(sched, workers, requests)
        if not sched.has_requests() and free_blocks(sched) == total:
            run_step(sched, workers, requests)  # one more report: every settled chunk is now known
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not drained in {timeout_s}s: {free_blocks(sched)} of {total} blocks free")
        time.sleep(0.002)  # copies land on the SimDevice's threads meanwhile
