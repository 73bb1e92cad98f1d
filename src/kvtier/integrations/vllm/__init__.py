"""kvtier's vLLM KV connector: ``kv_connector_module_path="kvtier.integrations.vllm"``.

    KVTierConnector   the class vLLM loads (`connector.py`), one per role
    SchedulerSide     lookup / alloc / metadata / finish, no tensors (`scheduler.py`)
    WorkerSide        loads, saves, preemptions through kvtier's store (`worker.py`)
    VllmSettings      ``kv_connector_extra_config``, checked (`settings.py`)

See README.md beside this file for the ``vllm serve`` line and what each setting costs.
"""

from .connector import KVTierConnector
from .settings import VllmSettings

__all__ = ["KVTierConnector", "VllmSettings"]
