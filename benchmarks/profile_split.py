"""Where a lean split's time goes (the `ttft` suite's "lean split <tier>" rows): for each case
tier:n:s, medians over warm runs (the host emptied before each) of

    front alone   LeanRunner.prefill_kv over [0, s), GPU synchronized
    read alone    split_cache with a front that does nothing: the reader thread's KVStore.load of
                  [s, n) (tier read + copies submitted), then the last byte landed
    split         LeanRunner.split_first_token, with its phases from the request's start:
                  front queued (host), front done (GPU event), store.load start / end (reader
                  thread), split_cache returned, the last loaded byte landed, first token

    PYTHONPATH=src python benchmarks/profile_split.py [--cases remote:2048:1280 disk:8192:5888] [--o-direct]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from profile_ttft import generate


def main() -> None:
    from kvtier.bench.llama_rig import build_llama
    from kvtier.integrations import hf_split
    from kvtier.integrations.hf import KVTier
    from kvtier.integrations.lean import LeanRunner
    from kvtier.store import kvstore
    from kvtier.store.disk import DiskTier
    from kvtier.store.throttle import MemoryTier, ThrottledTier

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["remote:2048:1280", "disk:8192:5888", "remote:8192:5632"])
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--remote-gbps", type=float, default=2.0)
    ap.add_argument(
        "--o-direct", action="store_true", help="disk reads bypass the page cache (as the suite's)"
    )
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = build_llama(a.shape, dev, dtype, attn_implementation="sdpa")
    lean = LeanRunner(model)
    cfg, new, chunk, bs = model.config, 64, 256, 16
    kv_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    root = Path(os.environ.get("KVTIER_BENCH_DIR") or tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="kvtier-profile-split-", dir=root))
    marks: dict[str, float] = {}
    real_load, real_front = kvstore.KVStore.load, lean.prefill_kv

    def load(self, *args, **kwargs):  # the reader thread's store.load, timed
        marks["load start"] = time.perf_counter()
        try:
            return real_load(self, *args, **kwargs)
        finally:
            marks["load end"] = time.perf_counter()

    def front(ids):
        out = real_front(ids)
        marks["front queued"] = time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True) if dev == "cuda" else None
        if ev is not None:
            ev.record()
            marks["front event"] = ev
        return out

    kvstore.KVStore.load = load
    lean.prefill_kv = front
    try:
        for case in a.cases:
            tier, n, s = case.split(":")[0], *map(int, case.split(":")[1:])
            need = 2 * n * kv_tok + (64 << 20)
            tiers = (
                [DiskTier(work / f"disk{n}", need, o_direct=a.o_direct)] if tier == "disk"
                else [ThrottledTier(MemoryTier(need, name="remote"), a.remote_gbps)]
            )  # fmt: skip
            kvt = KVTier.for_model(model, num_blocks=-(-(n + new + 1) // bs) + 8, block_size=bs,
                                   pool_bytes=int(1.25 * n * kv_tok) + (64 << 20), tiers=tiers,
                                   model_id=f"profile-split/{a.shape}", chunk_tokens=chunk)  # fmt: skip
            try:
                g = torch.Generator().manual_seed(n)
                ids = torch.randint(1, cfg.vocab_size, (1, n + new), generator=g).to(dev)
                cold = kvt.cache(ids)
                h = cold.finish(generate(model, ids, cold))
                if h is not None:
                    h.wait_durable(600)
                rows = profile_case(kvt, lean, ids, s, marks, hf_split, a.reps, dev)
                print(f"\n== {tier} n={n} s={s}: read [s, n) = {(n - s) * kv_tok / 2**20:.0f} MiB")
                for k, v in rows.items():
                    print(f"{k:34s} {v:8.1f} ms")
            finally:
                kvt.close()
                for t in tiers:
                    t.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def profile_case(kvt, lean, ids, s, marks, hf_split, reps, dev) -> dict[str, float]:
    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    out: dict[str, list[float]] = {}

    def add(k, v):
        out.setdefault(k, []).append(v)

    for i in range(reps + 1):
        kvt.store.evict()  # every chunk from the tier
        sync()
        t0 = time.perf_counter()
        lean.prefill_kv(ids[:, :s])
        sync()
        t_front = (time.perf_counter() - t0) * 1e3
        kvt.store.evict()
        t0 = time.perf_counter()
        c = hf_split.split_cache(kvt, lean.model, ids, s, front=lambda x: None)
        t_read = (time.perf_counter() - t0) * 1e3
        landed = (c.load_seconds() or 0.0) * 1e3
        c.finish(None)
        kvt.store.evict()
        sync()
        marks.clear()
        start = torch.cuda.Event(enable_timing=True) if dev == "cuda" else None
        t0 = time.perf_counter()
        if start is not None:
            start.record()
        tok, _, c = lean.split_first_token(kvt, ids, s)
        t_first = (time.perf_counter() - t0) * 1e3
        split_landed = (c.load_seconds() or 0.0) * 1e3
        c.finish(None)
        if i == 0:
            continue  # warm-up (graphs captured)
        add("front alone (GPU done)", t_front)
        add("read alone: split_cache returned", t_read)
        add("read alone: last byte landed", landed)
        for k in ("front queued", "load start", "load end"):
            if k in marks:
                add(f"split: {k}", (marks[k] - t0) * 1e3)
        if "front event" in marks:
            add("split: front done (GPU)", start.elapsed_time(marks["front event"]))
        add("split: last byte landed", split_landed)
        add("split: first token", t_first)
    return {k: statistics.median(v) for k, v in out.items()}


if __name__ == "__main__":
    main()
