"""Where the time to first token of a host hit goes (the `ttft` suite's "load host" case).

For each prefix n: one cold request saves the prefix, then per warm request the phases

    lookup     store.lookup of the prompt
    cache      kvt.cache(ids): lookup + block allocation + store.load (every copy submitted)
    ttft       request start -> first new token out of generate (GPU synchronized)
    landed     request start -> the last loaded byte landed (events on the load stream)
    layers     per layer: when its bytes landed and when attention read it (ms from start)

beside two floors: `forward` (the same generate over a DynamicCache that already holds the
prefix: no transfer at all) and `copy` (the KV bytes at this run's pinned H2D rate), and
recompute (generate with no cache). Last, a torch.profiler table of one warm request.

    PYTHONPATH=src python benchmarks/profile_ttft.py [--shape llama-3-8b] [--tokens 8192 32768]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def generate(model, ids, cache=None, new=1):
    from kvtier.integrations.hf import cache_kwarg

    extra = {} if cache is None else {cache_kwarg(model): cache}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **extra)
    sync()  # the token exists once the GPU made it
    return out


def prefilled(model, ids, n):
    """A DynamicCache holding the KV of ids[:, :n] (made by a forward; not timed)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :n], past_key_values=cache, use_cache=True)
    sync()
    return cache


def h2d_gbps(nbytes: int) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    sync()
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


CPU_MS: dict[str, float] = {}  # host ms per wrapped function, summed over one request


def timed(owner, name: str, label: str) -> None:
    """Wrap owner.name so its host time adds up in CPU_MS[label]."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CPU_MS[label] = CPU_MS.get(label, 0.0) + (time.perf_counter() - t0) * 1e3

    setattr(owner, name, wrapper)


def wrap_phases() -> None:
    """The host-side phases of a hit: the store's lookup and load, the engine's submit, the mover's
    launches, and the per-layer reads in attention (`_arrive`, its `wait_layer`)."""
    from kvtier.engine import cuda_mover, engine
    from kvtier.integrations import hf
    from kvtier.ops import slots
    from kvtier.store import handles, kvstore

    timed(kvstore.KVStore, "lookup", "store.lookup")
    timed(kvstore.KVStore, "load", "store.load")
    timed(engine.TransferEngine, "load_slots", "engine.load_slots")
    timed(cuda_mover.CudaMover, "load_slots", "mover.load_slots")
    timed(cuda_mover, "slot_sources", "ops.slot_sources")
    timed(cuda_mover, "scatter_slots", "ops.scatter_slots (all layers)")
    timed(handles.LoadHandle, "wait_layer", "LoadHandle.wait_layer (all layers)")
    timed(hf.KVTierCache, "_arrive", "KVTierCache._arrive (all layers)")
    del slots


def one(kvt, model, ids, n, events: dict):
    """A warm request; (phases in ms, per-layer landed / read ms)."""
    t0 = time.perf_counter()
    hit = kvt.store.lookup(ids[0, :-1].tolist())
    t_lookup = time.perf_counter()
    CPU_MS.clear()
    cache = kvt.cache(ids)
    t_cache = time.perf_counter()
    out = generate(model, ids, cache)
    t_first = time.perf_counter()
    landed = cache.load_seconds()
    layers = []
    if cache.load is not None and torch.cuda.is_available():
        start = cache._start
        for layer in range(kvt.kv.num_layers):
            ev = cache.load.jobs[-1].layer_events[layer]
            read = events.get(layer)
            layers.append(
                (start.elapsed_ms(ev), start.elapsed_ms(read) if read is not None else float("nan"))
            )
    h = cache.finish(out)
    if h is not None:
        h.wait(60)
    ms = dict(lookup=(t_lookup - t0) * 1e3, cache=(t_cache - t_lookup) * 1e3, ttft=(t_first - t_lookup) * 1e3,
              landed=(landed or 0.0) * 1e3, hit_tokens=hit.tokens)  # fmt: skip
    ms |= {f"cpu {k}": v for k, v in CPU_MS.items()}
    return ms, layers


def main() -> None:
    from kvtier.bench.llama_rig import build_llama
    from kvtier.integrations import hf
    from kvtier.integrations.hf import KVTier

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="a torch.profiler table of one warm request")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = build_llama(a.shape, dev, dtype, attn_implementation="sdpa")
    chunk, bs = 256, 16
    top = max(a.tokens)
    kv_tok = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * model.config.head_dim * 2
    blocks = -(-(top + a.new + 1) // bs) + 8
    # Attention reads of each layer: the compute-stream event _arrive records, kept by layer.
    events: dict[int, object] = {}
    orig = hf.KVTierCache._arrive

    def arrive(self, layer, like):
        out = orig(self, layer, like)
        events[layer] = self.owner.compute.record(f"profile-read{layer}")
        return out

    hf.KVTierCache._arrive = arrive
    if dev == "cuda":
        wrap_phases()
    rate = h2d_gbps(1 << 30)
    print(f"device {dev}, model {a.shape} {dtype}, pinned H2D {rate:.1f} GB/s, new tokens {a.new}")
    for n in a.tokens:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(1, model.config.vocab_size, (1, n + a.new), generator=g).to(dev)
        pool = int(1.25 * n * kv_tok) + (64 << 20)
        kvt = KVTier.for_model(model, num_blocks=blocks, block_size=bs, pool_bytes=pool,
                               model_id=f"profile/{a.shape}", chunk_tokens=chunk)  # fmt: skip
        try:
            cold = kvt.cache(ids)
            out = generate(model, ids, cold)
            cold.finish(out).wait(600)
            generate(model, ids)  # warm-up of the no-cache path
            rec = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                generate(model, ids)
                rec.append((time.perf_counter() - t0) * 1e3)
            fwd = []
            for _ in range(a.reps + 1):
                c = prefilled(model, ids, n)
                t0 = time.perf_counter()
                generate(model, ids, c)
                fwd.append((time.perf_counter() - t0) * 1e3)
            runs = [one(kvt, model, ids, n, events) for _ in range(a.reps + 1)][1:]
            med = {k: statistics.median(r[0][k] for r in runs) for k in runs[0][0]}
            copy_ms = n * kv_tok / (rate * 1e9) * 1e3
            print(f"\n== {n} tokens, {n * kv_tok / 2**30:.2f} GiB of KV (hit {med['hit_tokens']:.0f} tokens)")
            print(f"recompute {statistics.median(rec):8.1f} ms   (generate, no cache)")
            fw = statistics.median(fwd[1:])
            print(f"forward   {fw:8.1f} ms   (generate over a DynamicCache holding the prefix)")
            print(f"copy      {copy_ms:8.1f} ms   (the KV at {rate:.1f} GB/s)")
            print(f"lookup    {med['lookup']:8.2f} ms")
            print(f"cache()   {med['cache']:8.2f} ms   (lookup + store.load: every copy submitted)")
            print(f"landed    {med['landed']:8.1f} ms   (start -> last byte on the GPU)")
            print(f"ttft      {med['ttft']:8.1f} ms   (start -> first token; recompute / ttft = "
                  f"{statistics.median(rec) / med['ttft']:.1f}x)")  # fmt: skip
            for k in sorted(k for k in med if k.startswith("cpu ")):
                print(f"{k[4:]:38s} {med[k]:8.2f} ms of host time")
            layers = runs[-1][1]
            if layers:
                pick = sorted({0, 1, 2, len(layers) // 2, len(layers) - 2, len(layers) - 1})
                print("layer  landed ms  read ms   (from the request's start event)")
                for i in pick:
                    print(f"{i:5d} {layers[i][0]:10.2f} {layers[i][1]:8.2f}")
            if a.profile:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
                with profile(activities=acts) as prof:
                    one(kvt, model, ids, n, events)
                print(
                    prof.key_averages().table(
                        sort_by="cpu_time_total", row_limit=22, max_name_column_width=48
                    )
                )
        finally:
            kvt.close()
    hf.KVTierCache._arrive = orig


if __name__ == "__main__":
    main()
