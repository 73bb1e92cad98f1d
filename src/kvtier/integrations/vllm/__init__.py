"""kvtier's vLLM KV connector: ``kv_connector_module_path="kvtier.integrations.vllm"``.

    KVTierConnector   the class vLLM loads (`connector.py`), one per role
    SchedulerSide     lookup / alloc / metadata / finish, no tensors (`scheduler.py`)
    WorkerSide        loads, saves, preemptions through kvtier's store (`worker.py`)
    Holdings          what a worker's host and disk hold, as changes for the scheduler (`holdings.py`)
    Chooser           per request: load, load the first chunks, or recompute, with kvtier's planner
                      and this engine's measured speeds (`choice.py`, `step_times.py`)
    BackgroundLoads   a worker's asynchronous loads: lower tiers read on reader threads, cut at the
                      plan's deadline (`background.py`); TierProbe: tiers down until they answer
    VllmSettings      ``kv_connector_extra_config``, checked (`settings.py`)
    Group, GroupPlan  a hybrid model's KV cache groups: what each keeps of a chunk, what a hit
                      needs of it, the loads and saves per group (`groups.py`)

See README.md beside this file for the ``vllm serve`` line and what each setting costs.
`KVTierConnector` is imported on first use: the worker side (`worker.py`) and its metadata import
without vLLM, so ``kvtier bench --suite vllm`` replays the worker's hooks where vLLM is absent.
"""

from .settings import VllmSettings

__all__ = ["KVTierConnector", "VllmSettings"]


def __getattr__(name: str):
    if name == "KVTierConnector":  # vLLM's loader: getattr(module, kv_connector)
        from .connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
