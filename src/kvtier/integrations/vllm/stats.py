"""KVTierStats: the workers' counters on vLLM's stats path (logged, and summed across ranks).

Keys: ``hit_chunks_<tier>`` (host, disk, redis, ...), ``miss_chunks``, ``load_errors`` (loads
that raised), ``save_errors`` (chunks not saved: a save that raised, or a full pool),
``loads`` / ``saves`` (settled transfers), ``load_bytes`` / ``save_bytes``,
``load_s`` / ``save_s`` (submit to observed completion: GB/s from these is a lower bound).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KVTierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = dict(self.data)
        for op in ("load", "save"):
            s = d.get(f"{op}_s", 0)
            if s:
                d[f"{op}_gbps"] = round(d.get(f"{op}_bytes", 0) / s / 1e9, 3)
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())
