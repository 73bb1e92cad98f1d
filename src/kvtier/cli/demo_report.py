"""What `kvtier demo` shows: the report table of its requests (TTFT with and without kvtier, the
tier each hit came from, bytes and GB/s loaded and saved, whether the tokens match) and the PNG
plot of TTFT over prefix length, recompute vs load. `demo.py` runs the requests; this only prints
and draws what they returned.
"""

from __future__ import annotations

import click


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


def print_report(d: dict) -> None:
    m = d["model"]
    click.echo(
        f"kvtier demo: random-weight Llama ({m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads / "
        f"{m['kv_heads']} KV heads, {m['params'] / 1e6:.1f}M params, {m['dtype']}) on {d['torch_device']}, "
        f"kvtier device {d['device']}"
    )
    click.echo(
        f"{len(d['requests'])} requests sharing a {d['prefix_tokens']}-token prefix; chunks of "
        f"{d['chunk_tokens']} tokens, blocks of {d['block_size']}; {d['new_tokens']} tokens generated each\n"
    )
    head = (
        "request",
        "prompt",
        "hit",
        "from",
        "TTFT recompute",
        "TTFT kvtier",
        "speedup",
        "loaded",
        "load GB/s",
        "saved",
        "save GB/s",
        "same tokens",
    )
    rows = [head]
    for r in d["requests"]:
        rows.append(
            (
                r["request"],
                str(r["prompt_tokens"]),
                str(r["hit_tokens"]),
                r["tier"],
                f"{r['ttft_recompute_ms']:.1f} ms",
                f"{r['ttft_ms']:.1f} ms",
                f"{r['ttft_recompute_ms'] / r['ttft_ms']:.2f}x" if r["hit_tokens"] else "-",
                _mb(r["loaded_bytes"]),
                _rate(r["load_gbps"]),
                _mb(r["saved_bytes"]),
                _rate(r["save_gbps"]),
                "yes" if r["identical"] else "NO",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    cold = d["requests"][0]["ttft_ms"]
    warm = [r for r in d["requests"] if r["hit_tokens"]]
    if warm:
        best = min(warm, key=lambda r: r["ttft_ms"])
        click.echo(
            f"\ncold TTFT {cold:.1f} ms; warm TTFT {best['ttft_ms']:.1f} ms ({best['tier']} hit, "
            f"{cold / best['ttft_ms']:.1f}x faster); hits by tier: "
            + ", ".join(f"{r['request']}: {r['tier']}" for r in warm)
        )
    click.echo(f"tokens identical to a run without kvtier: {'yes' if d['identical'] else 'NO'}")
    click.echo(
        "TTFT kvtier includes the lookup and the load. load GB/s: bytes / (lookup -> last byte landed, "
        "lower-tier reads included);\nsave GB/s: bytes / (request end -> copies landed in host pool slots), "
        "then pushed to the lower tiers. GB/s = 1e9 B/s."
    )
    if d["device"] == "sim":
        click.echo(
            "No GPU: SimDevice stands in for it (CPU threads as copy streams), so GB/s are host copies."
        )


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n else "-"


def _rate(x: float | None) -> str:
    return f"{x:.2f}" if x else "-"
