"""What `kvtier demo` shows: first, how much sooner the first token comes with kvtier than by
recomputing the prefix; then the table of its requests (TTFT with and without kvtier, the tier
each hit came from, bytes and GB/s loaded and saved, whether the tokens match) and the PNG plot of
TTFT over prefix length, recompute vs load. `demo.py` runs the requests; this only prints and
draws what they returned.
"""

from __future__ import annotations


def plot_ttft(points: list[dict], title: str, out: str) -> None:
    from kvtier.cli.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    n = [p["prefix"] for p in points]
    ax.plot(n, [p["recompute_ms"] for p in points], "-o", label="recompute (DynamicCache)")
    ax.plot(n, [p["load_ms"] for p in points], "-s", label="load from kvtier (host hit)")
    ax.set_xlabel("cached prefix (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def headline(d: dict) -> str | None:
    """The demo's news in one line: how much sooner the first token came with kvtier than by
    recomputing the prefix, per hit (None: no request hit)."""
    hits = [r for r in d["requests"] if r["hit_tokens"]]
    if not hits:
        return None
    x = [r["ttft_recompute_ms"] / r["ttft_ms"] for r in hits]
    span = f"{min(x):.1f}x" if f"{min(x):.1f}" == f"{max(x):.1f}" else f"{min(x):.1f}-{max(x):.1f}x"
    each = ", ".join(f"{r['tier']} {r['ttft_recompute_ms'] / r['ttft_ms']:.1f}x" for r in hits)
    return (
        f"First token {span} sooner with kvtier than recomputing the {d['prefix_tokens']}-token prefix "
        f"({each})"
    )


def print_report(d: dict) -> None:
    from kvtier.bench.terminal import compact_table, console, say

    con = console()
    m = d["model"]
    line = headline(d)
    con.print(f"[bold]{line}[/]" if line else "No request hit kvtier's store.")
    con.print(f"tokens identical to a run without kvtier: {'yes' if d['identical'] else '[bold red]NO[/]'}\n")
    say(
        f"random-weight Llama ({m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads / "
        f"{m['kv_heads']} KV heads, {m['params'] / 1e6:.1f}M params, {m['dtype']}) on {d['torch_device']}, "
        f"kvtier device {d['device']}; {len(d['requests'])} requests sharing a {d['prefix_tokens']}-token "
        f"prefix; chunks of {d['chunk_tokens']} tokens, blocks of {d['block_size']}; {d['new_tokens']} "
        "tokens generated each.",
        lead="",
    )
    t = compact_table(
        "", "request", "hit tokens", "from", "recompute ms", "kvtier ms", "sooner", "loaded MB",
        "load GB/s", "same tokens",
    )  # fmt: skip
    for r in d["requests"]:
        t.add_row(
            r["request"],
            str(r["hit_tokens"]),
            r["tier"],
            f"{r['ttft_recompute_ms']:.1f}",
            f"{r['ttft_ms']:.1f}",
            f"{r['ttft_recompute_ms'] / r['ttft_ms']:.1f}x" if r["hit_tokens"] else "-",
            _mb(r["loaded_bytes"]),
            _rate(r["load_gbps"]),
            "yes" if r["identical"] else "[bold red]NO[/]",
        )
    con.print(t)
    cold = d["requests"][0]
    saves = ", ".join(
        f"{r['request']} {_mb(r['saved_bytes'])} MB at {_rate(r['save_gbps'])} GB/s"
        for r in d["requests"]
        if r["saved_bytes"]
    )
    say(
        "recompute ms: time to first token through transformers' DynamicCache, the whole prompt "
        "prefilled (the faster of two runs); kvtier ms: the same prompt through kvtier, its lookup "
        "and load included; sooner: recompute / kvtier. The cold request found nothing and saved its "
        f"KV ({cold['ttft_ms']:.1f} ms, the save included). load GB/s: bytes / (lookup -> last byte "
        "landed, lower-tier reads included). Saved: "
        f"{saves or 'nothing'} (bytes / (request end -> copies landed in host pool slots), then "
        "pushed to the lower tiers). GB/s = 1e9 B/s.",
        lead="",
    )
    if d["device"] == "sim":
        say(
            "No GPU: SimDevice stands in for it (CPU threads as copy streams), so GB/s are host copies.",
            lead="",
        )


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}" if n else "-"


def _rate(x: float | None) -> str:
    return f"{x:.2f}" if x else "-"
