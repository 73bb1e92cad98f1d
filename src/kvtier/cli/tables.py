"""Rich tables of the analysis reports (the dicts of `report.py`); units in every header or cell.
Tables keep to the terminal's width (80 columns when it is not a terminal): long texts such as
the source of each figure are numbered footnotes under their table, not a column."""

from __future__ import annotations

from rich.table import Table

from kvtier.bench.terminal import Footnotes, compact_table, console, say

GIB = 1 << 30

_console = console()


def _table(title: str, *cols: str) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold")
    for c in cols:
        t.add_column(c, overflow="fold")
    return t


def print_specs(d: dict) -> None:
    src = Footnotes()
    t = compact_table(
        "GPUs (dense rates)", "key", "SMs", "L2 MB", "mem GB", "HBM GB/s", "bf16 TF/s", "fp8 TF/s", "PCIe",
        "FLOP/B", "src",
    )  # fmt: skip
    for g in d["gpus"]:
        fp8 = "-" if g["fp8_tflops"] is None else f"{g['fp8_tflops']:.0f}"
        t.add_row(
            g["key"],
            str(g["sms"]),
            f"{g['l2_mb']:g}",
            f"{g['mem_gb']:g}",
            f"{g['mem_bw_gbps']:.0f}",
            f"{g['bf16_tflops']:.0f}",
            fp8,
            f"Gen{g['pcie_gen']}",
            f"{g['balance_flop_per_byte']:.0f}",
            src.ref(g["source"], g.get("sm_source")),
        )
    _console.print(t)
    names = ", ".join(f"{g['key']} = {g['name']}" for g in d["gpus"])
    say(f"FLOP/B: the balance point, bf16 FLOP/s over HBM bytes/s. {names}.")
    src.print_new()
    t = compact_table("Links (per direction)", "key", "name", "GB/s max", "GB/s typical", "latency us", "src")
    for x in d["links"]:
        t.add_row(
            x["key"],
            x["name"],
            f"{x['theoretical_gbps']:g}",
            f"{x['typical_gbps']:.1f}",
            f"{x['latency_us']:g}",
            src.ref(x["source"]),
        )
    _console.print(t)
    src.print_new()
    t = compact_table(
        "Models", "key", "params B", "active B", "weights GB", "KV KiB/token", "attention", "src"
    )
    for m in d["models"]:
        t.add_row(
            m["key"],
            f"{m['params'] / 1e9:.2f}",
            f"{m['active_params'] / 1e9:.2f}",
            f"{m['weight_bytes_bf16'] / 1e9:.1f}",
            f"{m['kv_bytes_per_token'] / 1024:.1f}",
            m["attention"],
            src.ref(m["source"]),
        )
    _console.print(t)
    say("Weights and KV in bf16; KV per token over all layers.")
    src.print_new()


def print_roofline(d: dict) -> None:
    if not d["fits"]["fits"]:
        return print_unfit(d)
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
        (f"fits in {g['mem_gb']:g} GB of GPU memory", fit_text(d["fits"])),
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


def fit_text(f: dict) -> str:
    """One line: weights + KV against the GPU's memory, and the largest batch at this context."""
    sizes = (
        f"{f['weights_bytes'] / 1e9:.1f} GB weights + {f['kv_bytes'] / 1e9:.1f} GB KV = "
        f"{f['total_bytes'] / 1e9:.1f} GB of {f['memory_bytes'] / 1e9:g} GB"
    )
    more = "" if f["max_batch"] is None else f"; up to batch {f['max_batch']:,} at {f['context']:,} tokens"
    return f"{'yes' if f['fits'] else 'NO'}: {sizes}{more}"


def fit_lines(d: dict) -> list[str]:
    """A configuration that does not fit (`report.unfit_json`): its numbers, what would fit, and
    why no time is printed."""
    f, m, g = d["fits"], d["model"], d["gpu"]
    name = m["name"] if isinstance(m, dict) else m
    gpu = g["name"] if isinstance(g, dict) else g
    n, ctx, mem = f["batch"], f["context"], f["memory_bytes"]
    free = max(0.0, mem - f["weights_bytes"])
    kv_req = f["kv_bytes"] / n if n else 0.0
    lines = [
        f"[bold red]Does not fit[/]: {name} on {gpu}, {mem / 1e9:g} GB of GPU memory",
        f"  weights ({d.get('dtype', 'bf16')}): {f['weights_bytes'] / 1e9:,.1f} GB",
        f"  KV ({d.get('kv_dtype', 'bf16')}), {n:,} x {ctx:,} tokens: {f['kv_bytes'] / 1e9:,.1f} GB"
        + (f" ({kv_req / 1e9:,.1f} GB per request)" if n > 1 else ""),
        f"  weights + KV: {f['total_bytes'] / 1e9:,.1f} GB, {f['total_bytes'] / mem:.1f}x the memory",
    ]
    if f["gpus_for_weights"] > 1:
        lines.append(f"  the weights alone need {f['gpus_for_weights']} GPUs")
    else:
        lines.append(f"  beside the weights: {free / 1e9:,.1f} GB for KV")
        if f["max_batch"] is not None and n > 1:
            lines.append(f"  at {ctx:,} tokens, the largest batch is {f['max_batch']:,}")
        if f.get("max_context") is not None:
            lines.append(f"  at batch {n:,}, the longest context is {f['max_context']:,} tokens")
    lines.append(f"  GPUs for weights + KV: {f['gpus_needed']} (activations not counted)")
    lines.append(
        "No time is predicted for it: it cannot run on one GPU. Fewer tokens, a smaller batch, "
        "fp8 (--dtype, --kv-dtype) or more GPUs would fit."
    )
    return lines


def print_unfit(d: dict) -> None:
    for line in fit_lines(d):
        _console.print(line)


def _bound_text(b: dict) -> str:
    return (
        f"{b['bound_ms']:.3f} ms, {b['bound']}-bound (memory {b['memory_ms']:.3f} ms, compute "
        f"{b['compute_ms']:.3f} ms; {b['intensity_flop_per_byte']:.1f} FLOP/byte)"
    )


def _batch_text(batch: int | None, context: int) -> str:
    return str(batch) if batch else f"never (KV of {context} tokens grows with the batch as fast as FLOPs)"


def print_path(d: dict) -> None:
    if not d["fits"]["fits"]:
        return print_unfit(d)
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
