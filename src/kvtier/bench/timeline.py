"""A picture of the stream/event protocol (`kvtier trace`): a save and a layer-pipelined load beside
compute, placed on one clock from event timestamps (`Event.time_s()`), checked, and drawn.

Every step of interest is bracketed by events recorded on its own stream:

    compute: write KV |              | read old KV (dst) | [wait layer i] attention i | ...
    save:    [wait e_write] save job |  (the host waits for e_save: the slot is then READY)
    load:                              [wait e_read] layer 0 | layer 1 | ...  (a marker per layer event)

Facts checked (what the picture should make plain):
- compute_after_layer: for every layer i, attention i started no earlier than layer i's event;
- copy_waits_real: every event a copy stream was ordered after (the compute write before the
  save; the pending read of the destination blocks and the save before the load) was really
  recorded - a wait on an unrecorded event is a wait on nothing, CUDA treats it as complete - and
  had completed by the time the copy it guards finished.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

TOL_MS = 2e-3  # event timestamps have ~0.5 us resolution on CUDA


@dataclass(slots=True)
class Span:
    stream: str
    label: str
    kind: str  # "compute" | "copy" | "wait"
    start_ms: float
    end_ms: float


@dataclass(slots=True)
class Mark:
    stream: str
    label: str
    t_ms: float


@dataclass(slots=True)
class Trace:
    device: str
    params: dict
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    links: list[dict] = field(
        default_factory=list
    )  # {"layer", "from_ms" (layer event), "to_ms" (attn start)}
    facts: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(v for k, v in self.facts.items() if isinstance(v, bool))

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "params": self.params,
            "ok": self.ok,
            "facts": self.facts,
            "intervals": [asdict(s) for s in self.spans],
            "markers": [asdict(m) for m in self.marks],
            "links": self.links,
        }


def check_facts(layer_ms: list[float], attn_start_ms: list[float], waits: list[dict]) -> dict:
    """The ordering facts, from times alone (pure: testable on made-up timelines).

    layer_ms[i]: time of load layer i's event; attn_start_ms[i]: attention i started.
    waits: {"stream", "event", "recorded": bool, "t_ms": event time or None, "guards_end_ms"}.
    """
    late = [a - t >= -TOL_MS for t, a in zip(layer_ms, attn_start_ms, strict=True)]
    real = [
        w["recorded"] and w["t_ms"] is not None and w["t_ms"] <= w["guards_end_ms"] + TOL_MS for w in waits
    ]
    return {
        "compute_after_layer": all(late),
        "copy_waits_real": all(real),
        "per_layer": late,
        "waits": [w | {"ok": ok} for w, ok in zip(waits, real, strict=True)],
    }


def _work(device, compute_ms: float):
    """A stand-in for one layer's attention: a sleep on the simulator, bf16 matmuls on CUDA."""
    if device.name == "sim":
        return lambda: time.sleep(compute_ms / 1e3)  # runs on the stream's worker: a "sleep kernel"
    import torch

    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device.name)
    out = torch.empty_like(a)
    reps = max(1, round(compute_ms / 0.2))  # ~0.2 ms per 4096^3 matmul on a current data-center GPU
    return lambda: [torch.mm(a, a, out=out) for _ in range(reps)]


def collect(
    device,
    *,
    layers: int = 8,
    tokens: int = 128,
    block_size: int = 16,
    heads: int = 2,
    head_dim: int = 64,
    path: str = "auto",
    compute_ms: float = 2.0,
    read_ms: float = 10.0,
    wait_layers: bool = True,
) -> Trace:
    """Run one save and one layer-pipelined load beside compute on `device`; return the timeline.

    The cache is vLLM-flash per layer (2, 2 * n, block_size, heads, head_dim), bf16; the save
    reads blocks 0..n-1, the load writes blocks n..2n-1, which another request's decode (`read_ms`
    of compute) still reads when the load is submitted: the load stream visibly waits for it.
    `path` "auto" lets the engine pick the save's path and loads through "kernel": its per-layer
    launches give each layer its own event (a staged load gives every layer the job's final
    event). `wait_layers=False` skips
    `wait_layer` (broken on purpose: shows the fact turning false).
    """
    import torch

    from kvtier import layout
    from kvtier.engine import EngineConfig, TransferEngine
    from kvtier.pool import PinnedPool

    n = -(-tokens // block_size)
    load_path = "kernel" if path == "auto" else path
    caches = []
    for _ in range(layers):
        t = device.empty(2 * 2 * n * block_size * heads * head_dim * 2)
        t.random_(0, 256)  # random bits, never zeros
        caches.append(t.view(torch.bfloat16).view(2, 2 * n, block_size, heads, head_dim))
    kv = layout.vllm_flash(caches)
    device.synchronize()  # the fill ran on the default stream: no copy stream may read the cache before it
    src, dst = torch.arange(n), torch.arange(n, 2 * n)
    pool = PinnedPool(device, 2 * kv.chunk_nbytes(n) + (4 << 20))
    eng = TransferEngine(device, kv, pool, EngineConfig(path=path))
    work = _work(device, compute_ms)
    comp = device.new_stream("compute")  # compute on its own stream, as a serving engine's model
    try:
        ev: dict = {}
        ev["w0"] = comp.record("write:start")  # marker: where the write starts on the timeline
        device.launch(work, comp)  # prefill writes the KV of blocks src
        ev["e_write"] = comp.record("e_write")  # e_compute: the save must not read before it
        eng.compute_write(src, ev["e_write"])  # the save must follow this write (vLLM #31341)
        ev["s0"] = eng.save_stream.record("save:queued")  # marker: the save stream reached the save
        job = eng.save(src, after=ev["e_write"], num_tokens=tokens, path=None if path == "auto" else path)
        eng.wait(job)  # the slot holds complete data only once e_save has completed
        ev["r0"] = comp.record("read:start")  # marker: where the decode read starts
        device.launch(_work(device, read_ms), comp)  # another request's decode still reads blocks dst
        ev["e_read"] = comp.record("e_read")  # the load must not overwrite dst before it
        eng.compute_read(dst, ev["e_read"])  # the load must not overwrite them first (vLLM #47282)
        ev["l0"] = eng.load_stream.record("load:queued")  # marker: the load stream reached the load
        lj = eng.load(job.slot, dst, num_tokens=tokens, per_layer=True, path=load_path)
        pre, start, end = [], [], []
        for i in range(layers):
            pre.append(comp.record(f"attn{i}:queued"))  # marker: compute reached layer i (before its wait)
            if wait_layers:
                lj.wait_layer(i, comp)  # attention i must not read layer i before it arrived
            start.append(comp.record(f"attn{i}:start"))  # after the wait: when attention i really began
            device.launch(work, comp)
            end.append(comp.record(f"attn{i}:end"))  # the read of dst by attention i ends here
        eng.compute_read(dst, end[-1])  # later writers of dst must wait for this read
        device.synchronize()  # every event below has completed: its timestamp is known
        eng.wait(lj)  # settles the load: the slot's read ends only after e_load
        return _timeline(device, kv, tokens, path, job, lj, ev, pre, start, end)
    finally:
        device.synchronize()  # nothing may still touch the pool when it is closed
        eng.close()
        pool.close()


def _timeline(device, kv, tokens, path, job, lj, ev, pre, start, end) -> Trace:
    t0 = min(e.time_s() for e in (ev["w0"], ev["s0"], ev["l0"], pre[0]))
    ms = lambda e: (e.time_s() - t0) * 1e3
    params = dict(
        layers=kv.num_layers,
        tokens=tokens,
        block_size=kv.block_size,
        bytes=job.nbytes,
        path=path,
        save_path=job.path,
        load_path=lj.path,
    )
    tr = Trace(device.name, params)
    add = lambda s, lab, kind, a, b: tr.spans.append(Span(s, lab, kind, a, b)) if b > a else None
    add("compute", "write KV", "compute", ms(ev["w0"]), ms(ev["e_write"]))
    add("compute", "read old KV", "compute", ms(ev["r0"]), ms(ev["e_read"]))
    for i, (p, s, e) in enumerate(zip(pre, start, end, strict=True)):
        add("compute", f"wait L{i}", "wait", ms(p), ms(s))
        add("compute", f"attn {i}", "compute", ms(s), ms(e))
    save_go = max(ms(ev["s0"]), ms(ev["e_write"]))
    add("save", "wait e_write", "wait", ms(ev["s0"]), save_go)
    add("save", f"save ({job.path})", "copy", save_go, ms(job.event))
    load_go = max(ms(ev["l0"]), ms(ev["e_read"]), ms(job.event))
    add("load", "wait e_read", "wait", ms(ev["l0"]), load_go)
    prev = load_go
    layer_ms = [ms(e) for e in lj.layer_events]
    for i, t in enumerate(layer_ms):
        add("load", f"L{i}", "copy", prev, t)
        tr.marks.append(Mark("load", f"L{i}", t))
        prev = max(prev, t)
    attn_ms = [ms(s) for s in start]
    tr.links = [
        {"layer": i, "from_ms": a, "to_ms": b} for i, (a, b) in enumerate(zip(layer_ms, attn_ms, strict=True))
    ]
    first = layer_ms[0]
    waits = [
        _wait("save", ev["e_write"], ms, ms(job.event)),
        _wait("load", ev["e_read"], ms, first),
        _wait("load (host waited)", job.event, ms, first),
    ]
    tr.facts = check_facts(layer_ms, attn_ms, waits)
    return tr


def _wait(stream: str, event, ms, guards_end_ms: float) -> dict:
    recorded = event.stream is not None
    return {
        "stream": stream,
        "event": event.label,
        "recorded": recorded,
        "t_ms": ms(event) if recorded else None,
        "guards_end_ms": guards_end_ms,
    }


COLORS = {"compute": "#4c72b0", "copy": "#dd8452", "wait": "#d0d0d0"}


def draw(tr: Trace, out: str) -> None:
    """One lane per stream: bars for work, hatched bars for waits, ticks at per-layer events and
    an arrow from layer i's event to the start of attention i."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = ["compute", "save", "load"]
    y = {s: len(lanes) - 1 - i for i, s in enumerate(lanes)}
    end = max([s.end_ms for s in tr.spans] + [1e-3])
    fig, ax = plt.subplots(figsize=(12, 3.6), dpi=110)
    for s in tr.spans:
        hatch = "//" if s.kind == "wait" else None
        ax.barh(
            y[s.stream],
            s.end_ms - s.start_ms,
            left=s.start_ms,
            height=0.5,
            color=COLORS[s.kind],
            edgecolor="black",
            linewidth=0.4,
            hatch=hatch,
        )
        if s.kind != "wait" and s.end_ms - s.start_ms > end / 40:
            ax.text((s.start_ms + s.end_ms) / 2, y[s.stream], s.label, ha="center", va="center", fontsize=7)
    for m in tr.marks:
        ax.plot([m.t_ms, m.t_ms], [y[m.stream] - 0.32, y[m.stream] + 0.32], color="black", linewidth=1)
    for link, ok in zip(tr.links, tr.facts.get("per_layer", []), strict=False):
        ax.annotate(
            "",
            xy=(link["to_ms"], y["compute"] - 0.27),
            xytext=(link["from_ms"], y["load"] + 0.32),
            arrowprops=dict(arrowstyle="->", color="green" if ok else "red", lw=0.8),
        )
    from matplotlib.patches import Patch

    legend = [Patch(color=COLORS[k], label=k) for k in ("compute", "copy")]
    legend += [Patch(facecolor=COLORS["wait"], hatch="//", label="stream waits")]
    ax.legend(handles=legend, loc="upper right", fontsize=7, ncols=3)
    ax.set_yticks([y[s] for s in lanes], [f"{s} stream" for s in lanes])
    ax.set_xlabel("ms (event timestamps)")
    f = tr.facts
    verdict = lambda b: "yes" if b else "NO"
    ax.set_title(
        f"kvtier trace on {tr.device}: {tr.params['layers']} layers, {tr.params['tokens']} tokens, "
        f"save {tr.params['save_path']}, load {tr.params['load_path']} | compute waited for each layer: "
        f"{verdict(f.get('compute_after_layer'))} | copies waited on real events: "
        f"{verdict(f.get('copy_waits_real'))}",
        fontsize=8,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
