"""kvtier's own suites; importing this package registers them (see kvtier.bench.suite).

kv:     kvtier's kernels and paths on this machine (GPU <-> GPU, save, load, shapes), beside the
        same-run ceilings.
store:  KVStore lookup cost and save/load throughput per tier (runs on the CPU too).
multi:  several GPUs: KV handoff GPU 0 -> GPU 1, host-link contention (skipped below two GPUs).
ttft:   time to first token of a small model: recompute / load / split per tier, beside the planner.
sglang: the SGLang HiCache backend moving host pages per tier, beside the raw tier and SGLang's `file`.
op_cost: a caller's cost per op call (host us, GPU time alone and queued) per op and kind of ids.
vllm:   the vLLM connector's worker hooks replayed in vLLM 0.33's per-step order, every layout order.
sizes:  GB/s over the size of one transfer, 1 MiB - 1 GiB: copies and kvtier's paths (nvbandwidth's sweep).
"""

import importlib

# module -> why it could not be imported; the runner reports these instead of crashing
IMPORT_ERRORS: dict[str, str] = {}

for _module in ("kv", "store", "multi", "ttft", "op_cost", "sglang", "vllm", "sizes"):
    try:
        importlib.import_module(f"{__name__}.{_module}")
    except Exception as e:  # one broken suite module must not take the others down
        IMPORT_ERRORS[_module] = f"{type(e).__name__}: {e}"
