"""PNG plots of the analysis reports (matplotlib, no display needed)."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_roofline(d: dict, out: str) -> None:
    """Attainable TFLOP/s over arithmetic intensity, with decode (several batches) and prefill."""
    plt = _pyplot()
    g = d["gpu"]
    peak, bw = g["bf16_tflops"] * d["efficiency"], g["mem_bw_gbps"] / 1e3  # TFLOP/s, TB/s
    xs = [0.1 * 1.25**i for i in range(80)]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.loglog(xs, [min(peak, bw * x) for x in xs], color="black", lw=2, label=f"roof: {g['name']}")
    ax.axvline(
        g["balance_flop_per_byte"],
        color="gray",
        ls=":",
        label=f"balance {g['balance_flop_per_byte']:.0f} FLOP/B",
    )
    for p in d["decode_sweep"]:
        x = p["intensity_flop_per_byte"]
        ax.plot(x, min(peak, bw * x), "o", color="tab:blue")
        if p["batch"] in (1, 4, 16, 64, 256, 1024):  # fewer labels: large batches crowd together
            ax.annotate(
                f"B={p['batch']}",
                (x, min(peak, bw * x)),
                textcoords="offset points",
                xytext=(4, -10),
                fontsize=7,
            )
    ax.plot([], [], "o", color="tab:blue", label=f"decode, context {d['context']} (batch sweep)")
    pf = d["prefill"]
    x = pf["intensity_flop_per_byte"]
    ax.plot(x, min(peak, bw * x), "s", color="tab:red", ms=9, label=f"prefill {pf['tokens']} tokens")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("attainable bf16 TFLOP/s")
    ax.set_title(f"Roofline: {d['model']['name']} on {g['name']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_load_vs_recompute(d: dict, out: str) -> None:
    """Time to bring a prefix's KV in by loading, recomputing, or both at once, over its length."""
    plt = _pyplot()
    c = d["curve"]
    n = [p["tokens"] for p in c]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.loglog(n, [p["recompute_ms"] for p in c], "-o", label=f"recompute on {d['gpu']['name']}")
    ax.loglog(n, [p["load_ms"] for p in c], "-s", label=f"load via {d['path']['bottleneck']}")
    ax.loglog(n, [p["split_ms"] for p in c], "--^", label="both at once (split point)")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time (ms)")
    ax.set_title(
        f"Load vs recompute: {d['model']['name']}, KV {d['model']['kv_bytes_per_token'] / 1024:g} KiB/token"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
