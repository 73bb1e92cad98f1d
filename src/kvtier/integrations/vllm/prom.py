"""KVTierPromMetrics: the workers' counters as Prometheus counters, labelled per engine."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

# seconds: a hit from the host (milliseconds) up to a long prefill or a slow tier's deadline
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KVTierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_hit_chunks{tier=...}``, ``vllm:kvtier_miss_chunks``,
    ``vllm:kvtier_errors{op=load|save}``, ``vllm:kvtier_bytes{op=...}`` and
    ``vllm:kvtier_seconds{op=...}`` (bytes over seconds: GB/s); per request with a hit,
    ``vllm:kvtier_choices{choice=load|split|recompute|held, tier=...}`` and the histogram
    ``vllm:kvtier_first_token_seconds{choice=..., kind=planned|measured}``; and
    ``vllm:kvtier_deadline_cuts`` (background loads whose reads the plan's deadline ended)."""

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
        self._choices = c(
            "vllm:kvtier_choices",
            "Requests with a hit, by the choice made (load, split, recompute) and the tier read",
            labelnames=[*labelnames, "choice", "tier"],
        )
        self._first_token = self._histogram_cls(
            "vllm:kvtier_first_token_seconds",
            "First token of requests with a hit, as planned and as measured, by choice",
            labelnames=[*labelnames, "choice", "kind"],
            buckets=FIRST_TOKEN_BUCKETS,
        )
        self._cuts = c(
            "vllm:kvtier_deadline_cuts",
            "Background loads whose lower-tier reads ran past the plan's deadline (the rest recomputed)",
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for k, v in transfer_stats_data.items():
            if not v:
                continue
            if k == "first_tokens":
                for kind, tier, planned, measured in v:
                    self._choices.labels(*labels, kind, tier).inc()
                    if planned is not None:
                        self._first_token.labels(*labels, kind, "planned").observe(planned / 1e3)
                    self._first_token.labels(*labels, kind, "measured").observe(measured / 1e3)
            elif k == "deadline_cuts":
                self._cuts.labels(*labels).inc(v)
            elif k.startswith("hit_chunks_"):
                self._hits.labels(*labels, k.removeprefix("hit_chunks_")).inc(v)
            elif k == "miss_chunks":
                self._miss.labels(*labels).inc(v)
            elif k.endswith("_errors"):
                self._errors.labels(*labels, k.removesuffix("_errors")).inc(v)
            elif k.endswith("_bytes"):
                self._bytes.labels(*labels, k.removesuffix("_bytes")).inc(v)
            elif k in ("load_busy_s", "save_busy_s"):
                self._seconds.labels(*labels, k.removesuffix("_busy_s")).inc(v)
