"""Where a lean split's time goes: one split hit (host tier) traced with torch's profiler.

    python -m lab.trace_split [--tokens 8192] [--split 512] [--shape llama-3-8b] [--out DIR]

For each prefix: the front alone (the forward over [0, s)), the back alone ([s, n) loaded, then
the tail's forward, the front's KV given), and the split, each timed (median of --reps after a
warm-up); then one split run under the profiler. Writes `<out>/split-<n>.trace.json.gz` (Chrome
trace: open in Perfetto) and prints, per stream, when its GPU work ran relative to the split's
first GPU activity: the phases (front kernels, copy-engine DMAs, scatters, the tail).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.trace_split", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--split", type=int, default=512, help="s, the front's tokens (a chunk multiple)")
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and a.shape != "tiny":
        raise SystemExit("trace_split: needs a CUDA GPU (on a CPU: --shape tiny, a smoke test)")
    from kvtier.bench.llama_rig import build_llama
    from kvtier.integrations.hf import KVTier
    from kvtier.integrations.lean import LeanRunner

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_llama(a.shape, "cuda", torch.bfloat16) if cuda else build_llama("tiny", "cpu")
    lean = LeanRunner(model)
    top = max(a.tokens)
    dev = None
    if not cuda:
        from kvtier.device import SimDevice

        dev = SimDevice()
    blocks, pool = (top + 64) // 16 + 8, int(1.3 * kv_bytes(model, top)) + 8 * kv_bytes(model, 256)
    kvt = KVTier.for_model(model, device=dev, num_blocks=blocks, pool_bytes=pool)
    try:
        for n in a.tokens:
            trace_one(model, lean, kvt, n, a.split, a.reps, out)
    finally:
        kvt.close()
        if dev is not None:
            dev.close()


def trace_one(model, lean, kvt, n: int, s: int, reps: int, out: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    from kvtier.bench.suites.ttft_checks import first_token
    from kvtier.integrations.hf_split import split_cache

    dev = next(model.parameters()).device
    ids = torch.randint(1, model.config.vocab_size, (1, n + 1), device=dev)
    cache = kvt.cache(ids)  # a cold request through generate: its prefix is saved at finish
    out_ids, _, _ = first_token(model, ids, cache, 1)
    h = cache.finish(out_ids)
    if h is None or not h.wait(600):  # the lookups below must not race the save
        raise SystemExit(f"trace_split: the {n}-token prefix was not saved")
    front_kv = lean.prefill_kv(ids[:, :s])

    def split():
        tok, _, c = lean.split_first_token(kvt, ids, s)
        c.finish(None)
        return tok

    def front():
        lean.prefill_kv(ids[:, :s])
        sync()  # the host clock covers the front's kernels

    def back():
        c = split_cache(kvt, model, ids, s, front=lambda _: front_kv)
        tok, _ = lean.first_token(ids, c)
        c.finish(None)
        return tok

    times = {name: timed(fn, reps) for name, fn in (("front", front), ("back", back), ("split", split))}
    longer = max(times["front"], times["back"])
    print(
        f"{n} tokens, s={s}: front alone {times['front']:.1f} ms, back alone {times['back']:.1f} ms, "
        f"split {times['split']:.1f} ms = {times['split'] / longer:.2f}x the longer half",
        flush=True,
    )
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        split()
        sync()  # every kernel of the split lands in the trace
    path = out / f"split-{n}.trace.json.gz"
    prof.export_chrome_trace(str(path))
    print(f"  trace: {path}")
    for line in phases(prof):
        print("  " + line)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kv_bytes(model, n: int) -> int:
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * hd * 2 * n


def timed(fn, reps: int) -> float:
    fn()  # warm-up: graph captures, allocator
    samples = []
    for _ in range(reps):
        sync()  # the previous run's GPU work is not billed to this one
        t0 = time.perf_counter()
        fn()
        sync()  # the host clock covers this run's GPU work
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def phases(prof) -> list[str]:
    """Per GPU stream: its first start, last end and busy ms (relative to the first GPU event),
    kernels and memcpys apart."""
    gpu = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not gpu:
        return ["no GPU events"]
    t0 = min(e.time_range.start for e in gpu)
    groups: dict[tuple, list] = {}
    for e in gpu:
        kind = "memcpy" if "memcpy" in e.name.lower() or "Memcpy" in e.name else "kernel"
        groups.setdefault((getattr(e, "device_resource_id", 0), kind), []).append(e)
    lines = []
    for (stream, kind), es in sorted(groups.items(), key=lambda kv: min(e.time_range.start for e in kv[1])):
        start = (min(e.time_range.start for e in es) - t0) / 1e3
        end = (max(e.time_range.end for e in es) - t0) / 1e3
        busy = sum(e.time_range.end - e.time_range.start for e in es) / 1e3
        top = max(es, key=lambda e: e.time_range.end - e.time_range.start).name[:60]
        lines.append(
            f"stream {stream} {kind:6s} {len(es):5d} ops  {start:8.2f} -> {end:8.2f} ms  busy {busy:7.2f} ms"
            f"  (longest: {top})"
        )
    return lines


if __name__ == "__main__":
    main()
