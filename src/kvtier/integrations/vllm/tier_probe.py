"""TierProbe: the lower tiers a worker's loads found down or stalled, until they answer again.

    probe.failed(name, key)      a read of ``key`` from tier ``name`` delivered nothing, or was
                                 still running at its load's deadline: the tier is down from now,
                                 and a probe starts asking it
    probe.take() -> (down, up)   the changes since the last take, for the scheduler (which plans
                                 a down tier as absent: its chunks end a hit)
    probe.close()

The probe reads that key again every `PROBE_S`, on a thread of its own, into a buffer of its
own: the tier is up again once the read delivers the chunk, or once the tier, raising nothing and
with no read breaker open (``read_skipping`` in its stats: a disk or Redis tier that keeps
failing turns itself off for a while), says it no longer holds the key (it was evicted, and the
tier answers). A stalled tier keeps only its own probe thread waiting.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)
PROBE_S = 1.0  # seconds between a down tier's probes


class TierProbe:
    """tiers: the worker's lower tiers. chunk_bytes: the largest chunk a probe reads."""

    def __init__(self, tiers, chunk_bytes: int, interval_s: float = PROBE_S) -> None:
        self._tiers = {t.name: t for t in tiers}
        self.chunk_bytes, self.interval_s = chunk_bytes, interval_s
        self._lock = threading.Lock()
        self._down: set[str] = set()
        self._changes: dict[str, bool] = {}  # tier -> up (True) or down (False), since the last take
        self._closed = threading.Event()

    def failed(self, name: str, key: bytes) -> None:
        tier = self._tiers.get(name)
        if tier is None:
            return
        with self._lock:
            if name in self._down or self._closed.is_set():
                return
            self._down.add(name)
            self._changes[name] = False
        log.warning("kvtier: tier %s failed or stalled in a load: planned as absent until it answers", name)
        thread = threading.Thread(
            target=self._probe, args=(tier, key), name=f"kvtier-probe-{name}", daemon=True
        )
        thread.start()

    def down(self) -> set[str]:
        with self._lock:
            return set(self._down)

    def take(self) -> tuple[set[str], set[str]]:
        with self._lock:
            changes, self._changes = self._changes, {}
        return {n for n, up in changes.items() if not up}, {n for n, up in changes.items() if up}

    def close(self) -> None:
        self._closed.set()  # probes end at their next wake-up; a stalled one stays with its tier

    def _probe(self, tier, key: bytes) -> None:
        scratch = bytearray(self.chunk_bytes)  # never a pool slot: a stalled read may keep it forever
        while not self._closed.wait(self.interval_s):
            try:
                answered = tier.get_into(key, scratch) is not None or not (
                    tier.contains(key) or (tier.stats() or {}).get("read_skipping", 0)
                )
            except Exception as exc:  # still down: asked again at the next interval
                log.debug("kvtier: probe of tier %s: %s", tier.name, exc)
                continue
            if answered:
                with self._lock:
                    self._down.discard(tier.name)
                    self._changes[tier.name] = True
                log.info("kvtier: tier %s answers again", tier.name)
                return
