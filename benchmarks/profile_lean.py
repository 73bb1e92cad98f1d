"""Where the time to first token of a host hit goes through `LeanRunner` (the `ttft` suite's
"lean load host" row), beside its floors.

For each prefix n, medians over warm requests of

    recompute   LeanRunner over the whole prompt (no cache)
    resident    LeanRunner over the tail with the prefix KV already on the GPU (no transfer),
                eager (a hit on CUDA replays per-layer graphs instead: the first one captures)
    launch      host time to queue that resident forward (no GPU wait): the host's share
    copy        the KV bytes at this run's pinned H2D rate
    cache()     kvt.cache(ids): lookup + block allocation + every copy submitted
    queued      cache() + the lean forward queued (host time until nothing is left to launch)
    landed      request start -> the last loaded byte on the GPU (load events)
    ttft        request start -> the first token on the host

then host ms per kvtier function in one hit and a torch.profiler table (self CPU time).

    PYTHONPATH=src python benchmarks/profile_lean.py [--shape llama-3-8b] [--tokens 2048 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from profile_ttft import CPU_MS, generate, h2d_gbps, prefilled, sync, wrap_phases


class Resident:
    """A cache-like object for LeanRunner whose prefix KV already sits on the GPU."""

    def __init__(self, dyn, n: int) -> None:
        layers = getattr(dyn, "layers", None)
        if layers is not None and hasattr(layers[0], "keys"):
            self.kv = [(lay.keys, lay.values) for lay in layers]
        else:  # transformers 4.x DynamicCache
            self.kv = list(zip(dyn.key_cache, dyn.value_cache, strict=True))
        self.hit_tokens = n

    def _arrive(self, layer, like):
        k, v = self.kv[layer]
        return k[:, :, : self.hit_tokens], v[:, :, : self.hit_tokens]


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def hit(kvt, lean, ids) -> dict:
    """One warm lean request from the host tier: phase times in ms."""
    CPU_MS.clear()
    t0 = time.perf_counter()
    cache = kvt.cache(ids)
    t1 = time.perf_counter()
    logits = lean.logits(ids, cache)
    t2 = time.perf_counter()
    int(logits.argmax())  # the host waits for the GPU's token
    t3 = time.perf_counter()
    landed = cache.load_seconds() or 0.0
    cache.finish(None)
    ms = dict(cache=(t1 - t0) * 1e3, queued=(t2 - t0) * 1e3, ttft=(t3 - t0) * 1e3, landed=landed * 1e3)
    return ms | {f"cpu {k}": v for k, v in CPU_MS.items()}


def main() -> None:
    from kvtier.bench.llama_rig import build_llama
    from kvtier.integrations.hf import KVTier
    from kvtier.integrations.lean import LeanRunner

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler table")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = build_llama(a.shape, dev, dtype, attn_implementation="sdpa")
    lean = LeanRunner(model)
    chunk, bs = 256, 16
    cfg = model.config
    kv_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    if dev == "cuda":
        wrap_phases()
    rate = h2d_gbps(1 << 30)
    print(f"device {dev}, model {a.shape} {dtype}, pinned H2D {rate:.1f} GB/s, tail {a.new} tokens")
    for n in a.tokens:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(1, cfg.vocab_size, (1, n + a.new), generator=g).to(dev)
        kvt = KVTier.for_model(model, num_blocks=-(-(n + a.new + 1) // bs) + 8, block_size=bs,
                               pool_bytes=int(1.25 * n * kv_tok) + (64 << 20),
                               model_id=f"profile-lean/{a.shape}", chunk_tokens=chunk)  # fmt: skip
        try:
            cold = kvt.cache(ids)
            cold.finish(generate(model, ids, cold)).wait(600)
            rec = median_ms(lambda ids=ids: lean.first_token(ids), a.reps)
            res = Resident(prefilled(model, ids, n), n)
            floor = median_ms(lambda ids=ids, res=res: lean.first_token(ids, res), a.reps)
            sync()
            launch = median_ms(lambda ids=ids, res=res: lean.logits(ids, res), a.reps)  # queued only
            sync()
            runs = [hit(kvt, lean, ids) for _ in range(a.reps + 1)][1:]
            med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
            print(f"\n== {n} tokens, {n * kv_tok / 2**30:.2f} GiB of KV")
            print(f"recompute {rec:8.1f} ms   (lean, no cache)")
            print(f"resident  {floor:8.1f} ms   (lean over the tail, prefix KV already on the GPU)")
            print(f"launch    {launch:8.1f} ms   (host time to queue that forward)")
            print(f"copy      {n * kv_tok / (rate * 1e9) * 1e3:8.1f} ms   (the KV at {rate:.1f} GB/s)")
            for k in ("cache", "queued", "landed", "ttft"):
                print(f"{k:9s} {med[k]:8.1f} ms")
            print(f"speedup   {rec / med['ttft']:8.1f} x   (recompute / ttft)")
            print(f"graphs {lean.graphs}, captures {lean.captures} ({lean.capture_s * 1e3:.0f} ms in all), "
                  f"gqa_flash {lean.gqa_flash}")  # fmt: skip
            for k in sorted(k for k in med if k.startswith("cpu ")):
                print(f"{k[4:]:38s} {med[k]:8.2f} ms of host time")
            if not a.no_profile:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
                with profile(activities=acts) as prof:
                    hit(kvt, lean, ids)
                tab = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                                max_name_column_width=44)  # fmt: skip
                print(tab)
        finally:
            lean.pieces.clear()  # its graphs hold this KVTier's pages
            kvt.close()


if __name__ == "__main__":
    main()
