"""KVTierStats: the workers' counters and the scheduler's choices on vLLM's stats path (logged,
and summed across ranks).

Keys of ``data`` (summed across workers, what Prometheus observes): ``hit_chunks_<tier>`` (host,
disk, redis, ...), ``miss_chunks``, ``load_errors`` (loads that raised), ``save_errors`` (chunks
not saved: a save that raised, or a full pool), ``loads`` / ``saves`` (settled transfers),
``load_bytes`` / ``save_bytes``, ``load_busy_s`` / ``save_busy_s`` (the device time that
direction's transfers ran, from the event that made their data ready to their last copy,
overlapping transfers counted once), ``deadline_cuts`` (background loads whose lower-tier reads
ran past the plan's deadline: what was read went on, the rest was recomputed); from the
scheduler, ``first_tokens``: per request with a hit whose first token came, [choice, tier,
planned ms (None: not planned), measured ms] (lists join).

``reduce()`` is what vLLM logs every interval ("KV Transfer metrics: k=v, ..."): the interval's
hit rate first (``hit_rate_pct``, chunks loaded of chunks asked to load), then per tier its hits,
the misses, and per direction the transfers, MB, mean ms per transfer and GB/s, then per choice
(load, split, recompute, held) the requests and their mean first token planned and measured
(``choice_<kind>``, ``first_token_ms_planned_<kind>``, ``first_token_ms_<kind>``), then the
deadline cuts and the errors; three significant digits.
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
            self.data[k] = self.data.get(k, [] if isinstance(v, list) else 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        hits = {k: v for k, v in sorted(d.items()) if k.startswith("hit_chunks_")}
        asked = sum(hits.values()) + d.get("miss_chunks", 0)
        out: dict[str, int | float] = {}
        if asked:
            out["hit_rate_pct"] = round(100 * sum(hits.values()) / asked, 1)
        out |= hits
        if "miss_chunks" in d:
            out["miss_chunks"] = d["miss_chunks"]
        for op in ("load", "save"):
            n, nbytes, s = d.get(f"{op}s", 0), d.get(f"{op}_bytes", 0), d.get(f"{op}_busy_s", 0)
            if not n:
                continue
            out[f"{op}s"] = n
            out[f"{op}_MB"] = _sig(nbytes / 1e6)
            out[f"{op}_ms_mean"] = _sig(1e3 * s / n)
            if s:
                out[f"{op}_gbps"] = _sig(nbytes / s / 1e9)
        firsts = d.get("first_tokens") or []
        for kind in sorted({f[0] for f in firsts}):
            mine = [f for f in firsts if f[0] == kind]
            out[f"choice_{kind}"] = len(mine)
            planned = [f[2] for f in mine if f[2] is not None]
            if planned:
                out[f"first_token_ms_planned_{kind}"] = _sig(sum(planned) / len(planned))
            out[f"first_token_ms_{kind}"] = _sig(sum(f[3] for f in mine) / len(mine))
        for k in ("deadline_cuts", "load_errors", "save_errors"):
            if d.get(k):
                out[k] = d[k]
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())  # an empty list of first tokens counts as nothing


def _sig(x: float) -> float:
    """Three significant digits: 4194304 bytes -> 4.19 MB, 0.0123 s -> 12.3 ms."""
    return float(f"{x:.3g}")
