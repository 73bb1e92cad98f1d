"""Suites of several GPUs (issue #9), run where two or more CUDA devices are present.

  handoff   GPU 0's paged KV -> GPU 1's (`kvtier.engine.Handoff`): 8K and 32K tokens of the
            Llama-3-8B shape (1 and 4 GiB), pipelined in 128 MiB pieces (with and without events
            per group of layers on b) and as one piece, vs the same-run
            peer copy of 1 GiB (`peer_copy`); each row also carries that peer copy against the
            spec of the link NVML reports between the two GPUs (NVLink 4 or PCIe Gen5).
  contention  every GPU copying to / from pinned host memory at once vs alone (seed §5.2):
            per-GPU GB/s together, their sum, and the ratio to the same GPU alone.

Handoffs are timed with device events on GPU 1 from before the submit (its start event is waited
by GPU 0's streams) to after the job's last scatter, one job at a time, after a warm-up.
"""

from __future__ import annotations

import torch

from kvtier.bench.stats import summarize
from kvtier.bench.suite import Context, GiB, SkipSuite, register

TOKENS = (8192, 32768)
BLOCK = 16


def _two(ctx: Context) -> None:
    if not ctx.on_gpu or torch.cuda.device_count() < 2:
        raise SkipSuite(f"needs two CUDA GPUs (this run has {torch.cuda.device_count()})")


def link_spec(topo: str) -> tuple[str, float]:
    """(link key, per-direction GB/s of its spec) for an nvidia-smi topology name between two GPUs."""
    from kvtier.specs import get_link

    key = "nvlink4" if topo.upper().startswith("NV") else "pcie5"
    return key, get_link(key).theoretical_gbps


def _topology() -> str:
    from kvtier.bench.probe_multi import topology

    matrix, _numa, err = topology(2)
    return "unknown" if err else matrix[0][1]


def _caches(tokens: int):
    from kvtier.models import get_model
    from kvtier.reference import random_cache

    m = get_model("llama-3-8b")
    nb = tokens // BLOCK
    a = random_cache(
        "vllm_flash", m.layers, nb, BLOCK, m.kv_heads, m.head_dim, torch.bfloat16, device="cuda:0", seed=1
    )
    b = random_cache(
        "vllm_flash", m.layers, nb, BLOCK, m.kv_heads, m.head_dim, torch.bfloat16, device="cuda:1", seed=2
    )
    return a, b


def _time_handoff(h, src, dst, reps: int, per_layer: bool, warmup: int = 2):
    """Device-event ms on GPU 1 from before the submit to after e_done, one job at a time."""
    from kvtier.engine.handoff import cross_wait

    b_cur = h.dst.device.current_stream()
    samples = []
    for i in range(warmup + reps):
        start = b_cur.record("bench:start")
        # a's streams start no earlier than the clock: the gathers wait the start event
        cross_wait(h.send_stream, h.src.device, start)
        job = h.send(src, dst, after=None, per_layer=per_layer)
        b_cur.wait_event(job.event)  # the end event must follow the last scatter, or it under-reports
        end = b_cur.record("bench:end")
        end.synchronize()  # elapsed time is known only once the end event completed
        job.wait()
        if i >= warmup:
            samples.append(start.elapsed_ms(end))
    return summarize(samples, "cuda_events")


@register("handoff", description="GPU 0 -> GPU 1 KV handoff, 8K/32K tokens of Llama-3-8B, vs the peer copy")
def handoff_suite(ctx: Context):
    _two(ctx)
    from kvtier.device import CudaDevice
    from kvtier.engine import Handoff
    from kvtier.reference import bits_equal, gather_ref

    topo = _topology()
    link, spec = link_spec(topo)
    peer = ctx.ceiling("peer_copy", nbytes=GiB)
    common = dict(
        topology=topo,
        link=link,
        link_spec_gbps=spec,
        peer_copy_gbps=peer,
        peer_vs_spec=peer / spec,
        peer_access=torch.cuda.can_device_access_peer(0, 1),
    )
    da, db = CudaDevice(0), CudaDevice(1)
    tokens_list = TOKENS[:1] if ctx.quick else TOKENS
    for tokens in tokens_list:
        ka, kb = _caches(tokens)
        n = tokens // BLOCK
        g = torch.Generator().manual_seed(tokens)
        src, dst = torch.randperm(n, generator=g), torch.randperm(n, generator=g)
        variants = (  # (piece bytes, per-layer events, name)
            (128 << 20, False, "pieces 128MiB"),
            (128 << 20, True, "pieces 128MiB, layer events"),
            (ka.chunk_nbytes(n), False, "one piece"),
        )
        for piece, per_layer, name in variants:
            h = Handoff(ka, kb, src_device=da, dst_device=db, piece_bytes=piece)
            reps = 3 if ctx.quick else 10
            if ctx.on_progress:
                ctx.on_progress(f"handoff {tokens} {name}")
            t = _time_handoff(h, src, dst, reps, per_layer)
            for x in kb.layers:
                x.fill_(float("nan"))  # poison: the check below must see this run's bytes
            h.send(src, dst, after=None).wait()
            ok = bits_equal(gather_ref(kb, dst).cpu(), gather_ref(ka, src).cpu())
            h.close()
            yield ctx.row(
                f"{tokens // 1024}K tokens {name}",
                ka.chunk_nbytes(n),
                t,
                "peer_copy",
                correct=ok,
                tokens=tokens,
                blocks=n,
                piece_bytes=piece,
                per_layer=per_layer,
                route=h.route,
                layer_group=h.layer_group,
                **common,
            )
        del ka, kb
        for i in (0, 1):
            with torch.cuda.device(i):
                torch.cuda.empty_cache()  # the next size's caches need the room
    da.close()
    db.close()


@register("contention", description="every GPU to/from pinned host memory at once vs alone (seed §5.2)")
def contention_suite(ctx: Context):
    _two(ctx)
    from kvtier.bench.probe_multi import host_device

    n = torch.cuda.device_count()
    size = 256 << 20 if ctx.quick else GiB
    reps = 3 if ctx.quick else 8
    for d, ceiling in (("h2d", "h2d_pinned"), ("d2h", "d2h_pinned")):
        ctx.ceiling(ceiling)  # GPU 0 alone, the run's own probe
        alone = [host_device([i], size, d, reps)[0] for i in range(n)]
        together = host_device(list(range(n)), size, d, reps)
        for i in range(n):
            t = summarize([reps * size / (together[i] * 1e9) * 1e3], "cuda_events")
            yield ctx.row(
                f"{d} gpu{i} all at once",
                reps * size,
                t,
                ceiling,
                gpus=n,
                alone_gbps=alone[i],
                together_gbps=together[i],
                vs_alone=together[i] / alone[i],
                total_together_gbps=sum(together),
                total_alone_gbps=sum(alone),
            )
