"""The analysis reports as JSON-ready dicts (field names documented in the README) and their
rich tables. Every number carries its unit in its field name or column header."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

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
) -> dict:
    m, g = resolve_model(model), get_gpu(gpu, ceilings)
    host_link = get_link(link or f"pcie{g.pcie_gen}")
    if ceilings is not None and link is None:
        host_link = measured_host_link(host_link, ceilings, "h2d" if direction == "load" else "d2h")
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


def analysis_json(model: str, gpu: str) -> dict:
    return {"roofline": roofline_json(model, gpu, 32, 8192, 8192), "path": path_json(model, 8192, gpu=gpu)}


# ---- tables ------------------------------------------------------------------------------

_console = Console()


def _table(title: str, *cols: str) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for c in cols:
        t.add_column(c, overflow="fold")
    return t


def print_specs(d: dict) -> None:
    t = _table(
        "GPUs (dense rates)",
        "key",
        "name",
        "SMs",
        "L2 MB",
        "mem GB",
        "mem GB/s",
        "bf16 TFLOPS",
        "fp8 TFLOPS",
        "PCIe",
        "balance FLOP/B",
        "source",
    )
    for g in d["gpus"]:
        fp8 = "-" if g["fp8_tflops"] is None else f"{g['fp8_tflops']:.0f}"
        t.add_row(
            g["key"],
            g["name"],
            str(g["sms"]),
            f"{g['l2_mb']:g}",
            f"{g['mem_gb']:g}",
            f"{g['mem_bw_gbps']:.0f}",
            f"{g['bf16_tflops']:.0f}",
            fp8,
            f"Gen{g['pcie_gen']}",
            f"{g['balance_flop_per_byte']:.0f}",
            g["source"],
        )
    _console.print(t)
    t = _table(
        "Links (per direction)", "key", "name", "theoretical GB/s", "typical GB/s", "latency us", "source"
    )
    for x in d["links"]:
        t.add_row(
            x["key"],
            x["name"],
            f"{x['theoretical_gbps']:g}",
            f"{x['typical_gbps']:.1f}",
            f"{x['latency_us']:g}",
            x["source"],
        )
    _console.print(t)
    t = _table(
        "Models", "key", "params B", "active B", "weights GB (bf16)", "KV KiB/token (bf16)", "attention"
    )
    for m in d["models"]:
        t.add_row(
            m["key"],
            f"{m['params'] / 1e9:.2f}",
            f"{m['active_params'] / 1e9:.2f}",
            f"{m['weight_bytes_bf16'] / 1e9:.1f}",
            f"{m['kv_bytes_per_token'] / 1024:.1f}",
            m["attention"],
        )
    _console.print(t)


def print_roofline(d: dict) -> None:
    g, m = d["gpu"], d["model"]
    t = _table(f"Roofline: {m['name']} on {g['name']} ({d['dtype']})", "quantity", "value")
    rows = [
        ("balance point", f"{d['balance_flop_per_byte']:.0f} FLOP/byte"),
        ("weights", f"{d['weights_bytes'] / 1e9:.2f} GB, read in {d['weights_read_ms']:.2f} ms"),
        ("KV per token", f"{d['kv_bytes_per_token'] / 1024:.1f} KiB ({m['attention']})"),
        (
            f"KV per request ({d['context']} tokens)",
            f"{d['kv_bytes_per_request'] / GIB:.3f} GiB, read in {d['kv_read_ms_per_request']:.3f} ms",
        ),
        (f"KV of the batch ({d['batch']} requests)", f"read in {d['kv_read_ms']:.2f} ms"),
        (f"decode step, batch {d['batch']}", _bound_text(d["decode"])),
        ("decode step, batch 1", _bound_text(d["decode_batch1"])),
        ("turns compute-bound at batch", _batch_text(d["turning_batch"], d["context"])),
        ("... weights only (no KV)", _batch_text(d["turning_batch_weights_only"], 0)),
        (f"prefill {d['prefill']['tokens']} tokens", _bound_text(d["prefill"])),
    ]
    if "amdahl" in d:
        a = d["amdahl"]
        rows.append(
            (
                f"Amdahl: {a['fraction']:.0%} of time {a['part_speedup']:g}x faster",
                f"{a['overall_speedup']:.3f}x overall ({(a['overall_speedup'] - 1) * 100:.1f}% faster)",
            )
        )
    for r in rows:
        t.add_row(*r)
    _console.print(t)


def _bound_text(b: dict) -> str:
    return (
        f"{b['bound_ms']:.3f} ms, {b['bound']}-bound (memory {b['memory_ms']:.3f} ms, compute "
        f"{b['compute_ms']:.3f} ms; {b['intensity_flop_per_byte']:.1f} FLOP/byte)"
    )


def _batch_text(batch: int | None, context: int) -> str:
    return str(batch) if batch else f"never (KV of {context} tokens grows with the batch as fast as FLOPs)"


def print_path(d: dict) -> None:
    p = d["path"]
    t = _table(
        f"Path: {d['direction'] if 'direction' in d else p['direction']} {d['gib']:.3f} GiB "
        f"({d['tokens']} tokens of {d['model']['name']}) tier={p['tier']}",
        "hop (data-flow order)",
        "GB/s",
        "time ms alone",
    )
    for h in p["hops"]:
        mark = "  <- bottleneck" if h["name"] == p["bottleneck"] else ""
        t.add_row(h["name"] + mark, f"{h['gbps']:.1f}", f"{h['time_ms']:.2f}")
    _console.print(t)
    lr = d["load_vs_recompute"]
    s = lr["split"]
    _console.print(f"transfer: {d['transfer_ms']:.2f} ms through {p['bottleneck']}")
    for note in p["notes"]:
        _console.print(f"  note: {note}")
    _console.print(
        f"load {lr['load_ms']:.2f} ms vs recompute {lr['recompute_ms']:.2f} ms on {d['gpu']['name']} "
        f"(at {lr['efficiency']:.0%} of peak): {lr['faster']} is faster"
    )
    _console.print(
        f"split: recompute tokens [0, {s['recompute_tokens']}) while loading [{s['recompute_tokens']}, "
        f"{s['tokens']}) -> {s['time_ms']:.2f} ms"
    )
    be = ", ".join(f"{k}: {'never' if v is None else v}" for k, v in lr["break_even_tokens"].items())
    _console.print(f"break-even prefix per link (tokens; loading wins from there on): {be}")
    _console.print(
        "(recompute = prefill FLOPs of the prefix at peak; sources of every figure: `kvtier specs`)"
    )
