"""KVTierPromMetrics: the workers' counters as Prometheus counters, labelled per engine."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics


class KVTierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_hit_chunks{tier=...}``, ``vllm:kvtier_miss_chunks``,
    ``vllm:kvtier_errors{op=load|save}``, ``vllm:kvtier_bytes{op=...}`` and
    ``vllm:kvtier_seconds{op=...}`` (bytes over seconds: GB/s)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        c = self._counter_cls
        self._hits = c("vllm:kvtier_hit_chunks", "Chunks loaded, by tier", labelnames=[*labelnames, "tier"])
        self._miss = c(
            "vllm:kvtier_miss_chunks", "Chunks a load expected but no tier delivered", labelnames=labelnames
        )
        self._errors = c(
            "vllm:kvtier_errors",
            "Failed loads / saves (recomputed / skipped)",
            labelnames=[*labelnames, "op"],
        )
        self._bytes = c("vllm:kvtier_bytes", "Bytes moved", labelnames=[*labelnames, "op"])
        self._seconds = c(
            "vllm:kvtier_seconds",
            "Device seconds the transfers ran (data ready to last copy; overlaps once)",
            labelnames=[*labelnames, "op"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for k, v in transfer_stats_data.items():
            if not v:
                continue
            if k.startswith("hit_chunks_"):
                self._hits.labels(*labels, k.removeprefix("hit_chunks_")).inc(v)
            elif k == "miss_chunks":
                self._miss.labels(*labels).inc(v)
            elif k.endswith("_errors"):
                self._errors.labels(*labels, k.removesuffix("_errors")).inc(v)
            elif k.endswith("_bytes"):
                self._bytes.labels(*labels, k.removesuffix("_bytes")).inc(v)
            elif k in ("load_busy_s", "save_busy_s"):
                self._seconds.labels(*labels, k.removesuffix("_busy_s")).inc(v)
