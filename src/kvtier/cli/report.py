"""The analysis reports as JSON-ready dicts; field names are documented in the README and every
number carries its unit in its name. `tables.py` prints them.

A configuration whose weights and KV do not fit the GPU's memory gets `unfit_json`: the inputs and
the fit (`roofline.memory_fit`), no predicted time."""

from __future__ import annotations

import dataclasses

from kvtier import path as kpath
from kvtier import roofline as rl
from kvtier.ceilings import Ceilings
from kvtier.hfconfig import resolve_model
from kvtier.models import MODELS, ModelSpec
from kvtier.specs import GPU, GPUS, LINKS, get_gpu, get_link, measured_host_link

GIB = 1 << 30
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BREAK_EVEN_LINKS = ("pcie3", "pcie4", "pcie5", "pcie6", "nic100", "nic200", "nic400", "nvme")


def _model_json(m: ModelSpec, kv_dtype: str = "bf16") -> dict:
    return {
        "key": m.key,
        "name": m.name,
        "params": m.params(),
        "active_params": m.params(active=True),
        "weight_bytes_bf16": m.weight_bytes("bf16"),
        "kv_dtype": kv_dtype,
        "kv_bytes_per_token_layer": m.kv_bytes_per_token_layer(kv_dtype),
        "kv_bytes_per_token": m.kv_bytes_per_token(kv_dtype),
        "attention": "MLA (latent KV)" if m.mla else ("GQA" if m.kv_heads < m.heads else "MHA"),
        "source": m.source,
    }


def _gpu_json(g: GPU) -> dict:
    return {
        "key": g.key,
        "name": g.name,
        "sms": g.sms,
        "l2_mb": g.l2_mb,
        "mem_gb": g.mem_gb,
        "mem_bw_gbps": g.mem_bw_gbps,
        "bf16_tflops": g.bf16_tflops,
        "fp16_tflops": g.fp16_tflops,
        "fp8_tflops": g.fp8_tflops,
        "pcie_gen": g.pcie_gen,
        "balance_flop_per_byte": g.balance,
        "measured": list(g.measured),
        "source": g.source,
        "sm_source": g.sm_source,
    }


def specs_json(ceilings: Ceilings | None = None) -> dict:
    return {
        "gpus": [
            _gpu_json(get_gpu(k, ceilings if ceilings and ceilings.gpu_key == k else None)) for k in GPUS
        ],
        "links": [
            {
                "key": x.key,
                "name": x.name,
                "kind": x.kind,
                "theoretical_gbps": x.theoretical_gbps,
                "typical_gbps": x.typical_gbps,
                "latency_us": x.latency_us,
                "source": x.source,
            }
            for x in LINKS.values()
        ],
        "models": [_model_json(m) for m in MODELS.values()],
        "units": {"gbps": "1e9 bytes/s, per direction", "tflops": "1e12 FLOP/s dense", "mem_gb": "1e9 bytes"},
    }


def roofline_json(
    model,
    gpu,
    batch,
    context,
    prefill_tokens,
    dtype="bf16",
    kv_dtype="bf16",
    efficiency=1.0,
    ceilings=None,
    amdahl=None,
) -> dict:
    m, g = resolve_model(model), get_gpu(gpu, ceilings)
    fit = rl.memory_fit(m, g, batch, context, dtype, kv_dtype)
    if not fit.fits:
        return unfit_json(m, g, fit, dtype, kv_dtype, batch=batch, context=context)
    weights = m.weight_bytes(dtype)
    kv_req = context * m.kv_bytes_per_token(kv_dtype)
    bw = g.mem_bw_gbps * 1e9
    step = rl.decode_step(m, g, batch, context, dtype, kv_dtype, efficiency)
    data = {
        "model": _model_json(m, kv_dtype),
        "gpu": _gpu_json(g),
        "dtype": dtype,
        "efficiency": efficiency,
        "balance_flop_per_byte": g.balance,
        "weights_bytes": weights,
        "weights_read_ms": weights / bw * 1e3,
        "kv_bytes_per_token": m.kv_bytes_per_token(kv_dtype),
        "context": context,
        "batch": batch,
        "kv_bytes_per_request": kv_req,
        "kv_read_ms_per_request": kv_req / bw * 1e3,
        "kv_read_ms": batch * kv_req / bw * 1e3,
        "decode": {"batch": batch, "context": context} | step.to_json(),
        "decode_batch1": rl.decode_step(m, g, 1, context, dtype, kv_dtype, efficiency).to_json(),
        "decode_sweep": [
            {"batch": b} | rl.decode_step(m, g, b, context, dtype, kv_dtype, efficiency).to_json()
            for b in SWEEP_BATCHES
        ],
        "fits": fit.to_json(),
        "turning_batch": rl.turning_batch(m, g, context, dtype, kv_dtype),
        "turning_batch_weights_only": rl.turning_batch(m, g, 0, dtype, kv_dtype),
        "prefill": {"tokens": prefill_tokens}
        | rl.prefill(m, g, prefill_tokens, 0, dtype, kv_dtype, efficiency).to_json(),
    }
    if amdahl:
        fraction, speedup = amdahl
        data["amdahl"] = {
            "fraction": fraction,
            "part_speedup": speedup,
            "overall_speedup": rl.amdahl(fraction, speedup),
        }
    return data


def path_json(
    model,
    tokens,
    link=None,
    tier="host",
    direction="load",
    gpu="h100-sxm",
    nic="nic200",
    gpudirect=False,
    shared_by=1,
    kv_dtype="bf16",
    efficiency=1.0,
    ceilings=None,
    dtype="bf16",
) -> dict:
    m, g = resolve_model(model), get_gpu(gpu, ceilings)
    host_link = get_link(link or f"pcie{g.pcie_gen}")
    fit = rl.memory_fit(m, g, 1, tokens, dtype, kv_dtype)  # the moved KV beside the weights, on one GPU
    if not fit.fits:
        return unfit_json(m, g, fit, dtype, kv_dtype, tokens=tokens, tier=tier, direction=direction)
    if ceilings is not None and link is None:
        host_link = measured_host_link(host_link, ceilings, "h2d" if direction == "load" else "d2h")
        host_link = _measured_sharing(host_link, ceilings, "h2d" if direction == "load" else "d2h", shared_by)
    p = kpath.build_path(g, tier, host_link, direction, nic, "nvme", gpudirect, shared_by)
    nbytes = tokens * m.kv_bytes_per_token(kv_dtype)
    load = kpath.load_ms(m, p, tokens, kv_dtype)
    recompute = kpath.recompute_ms(m, g, tokens, efficiency=efficiency)
    split = kpath.split_point(m, g, p, tokens, kv_dtype, efficiency)
    break_even = {
        key: kpath.break_even_tokens(
            m, g, _link_path(g, key, host_link, direction, gpudirect, shared_by), kv_dtype, efficiency
        )
        for key in BREAK_EVEN_LINKS
    }
    curve_tokens = sorted({1 << i for i in range(6, 18)} | {tokens})
    return {
        "model": _model_json(m, kv_dtype),
        "gpu": _gpu_json(g),
        "link": {
            "key": host_link.key,
            "name": host_link.name,
            "typical_gbps": host_link.typical_gbps,
            "source": host_link.source,
        },
        "tokens": tokens,
        "bytes": nbytes,
        "gib": nbytes / GIB,
        "fits": fit.to_json(),
        "path": p.to_json(nbytes),
        "transfer_ms": p.transfer_ms(nbytes),
        "bottleneck": p.bottleneck.name,
        "load_vs_recompute": {
            "load_ms": load,
            "recompute_ms": recompute,
            "faster": "load" if load <= recompute else "recompute",
            "load_speedup": recompute / load if load else None,
            "split": split.to_json(),
            "break_even_tokens": break_even,
            "efficiency": efficiency,
        },
        "curve": [
            {
                "tokens": n,
                "load_ms": kpath.load_ms(m, p, n, kv_dtype),
                "recompute_ms": kpath.recompute_ms(m, g, n, efficiency=efficiency),
                "split_ms": kpath.split_point(m, g, p, n, kv_dtype, efficiency).ms,
            }
            for n in curve_tokens
        ],
    }


def unfit_json(m: ModelSpec, g: GPU, fit: rl.MemoryFit, dtype: str, kv_dtype: str, **inputs) -> dict:
    """A configuration whose weights and KV do not fit the GPU's memory: what was asked and the
    fit's numbers, and no time (no run of it would take any: it cannot start)."""
    return {
        "model": _model_json(m, kv_dtype),
        "gpu": _gpu_json(g),
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        **inputs,
        "fits": fit.to_json(),
    }


def _link_path(g: GPU, key: str, host_link, direction: str, gpudirect: bool, shared_by: int) -> kpath.Path:
    """The path whose slowest hop is link `key`: PCIe to host, a NIC to remote, or an NVMe disk."""
    if key.startswith("pcie"):
        return kpath.build_path(g, "host", get_link(key), direction, shared_by=shared_by)
    if key.startswith("nic"):
        return kpath.build_path(
            g, "remote", host_link, direction, nic=key, gpudirect=gpudirect, shared_by=shared_by
        )
    return kpath.build_path(
        g, "disk", host_link, direction, disk=key, gpudirect=gpudirect, shared_by=shared_by
    )


def _measured_sharing(link, ceilings, direction: str, shared_by: int):
    """With `probe --all-gpus` figures, the host link of `shared_by` GPUs at once is what they
    measured together, not the datasheet divided: `build_path` divides the link by `shared_by`,
    so the link carries the measured capacity they share (per GPU: `Ceilings.shared_gbps`)."""
    share = ceilings.shared_gbps(direction, shared_by) if shared_by > 1 else None
    if share is None:
        return link
    n = ceilings.gpus_measured
    src = f"measured by kvtier probe --all-gpus ({n} GPUs at once): {share:.1f} GB/s per GPU for {shared_by}"
    return dataclasses.replace(link, typical_gbps=share * shared_by, source=src)
