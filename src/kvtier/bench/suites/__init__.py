"""Benchmark suites; importing this package registers them (see kvtier.bench.suite).

baseline: the ways peers move KV today (torch gather, gather + one copy, vLLM's per-block memcpy).
kv:       kvtier's own kernels and paths, beside the same ceilings.
engine:   the transfer engine (both directions at once; beside a matmul: interference; submit: P6).
store:    KVStore lookup cost and save/load throughput per tier (runs on the CPU too).
multi:    several GPUs: KV handoff GPU 0 -> GPU 1, host-link contention (skipped below two GPUs).
"""

import importlib

# module -> why it could not be imported; the runner reports these instead of crashing
IMPORT_ERRORS: dict[str, str] = {}

for _module in ("baseline", "kv", "engine", "submit", "interference", "store", "multi", "hf", "ttft"):
    try:
        importlib.import_module(f"{__name__}.{_module}")
    except Exception as e:  # one broken suite module must not take the others down
        IMPORT_ERRORS[_module] = f"{type(e).__name__}: {e}"
