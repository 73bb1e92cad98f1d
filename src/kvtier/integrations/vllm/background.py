"""BackgroundLoads: the worker's asynchronous loads (vLLM's ``load_kv_async``: the request waits
out of the batch until they landed). A lower tier is read only here, never on vLLM's forward
thread: the chunks a run names in a lower tier are read into the host on a reader thread, then
the loader thread copies what the host holds into the request's blocks.

    loads.start(run, zeroed)    (forward thread) reads first where the run names a lower tier,
                                else the copies at once
    loads.poll() -> [done]      (forward thread) reads past their deadline are cut; the loads
                                whose copies landed (or that copied nothing), each once
    loads.close(timeout_s)      readers still in a tier are waited for, at most ``timeout_s``

A run's reads have a deadline, ``run.budget_s`` after `start` (the plan's; ``cap_s`` where the
run gives none). A read still running then is cut (by the reader at its next chunk, or by `poll`
while the reader waits in a tier): the copies of the chunks read before it go on, the rest of
the run is reported failed (vLLM recomputes it). A tier that merely answers too slowly for
the plan is not reported (its measured rate plans the next loads); one whose read in flight at
the deadline has stalled (it has run STALL_FACTOR times this load's mean chunk read, and at least
STALL_MIN_S) is reported to the `TierProbe` (planned absent until it answers). A reader cut in
the middle of a read may stay blocked in its tier; what it reads afterwards lands in the host
only, for later hits.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from .metadata import ChunkRun

log = logging.getLogger(__name__)
READERS = 8  # runs read from lower tiers at once (each on its own thread, chunk after chunk)
STALL_MIN_S = 0.25  # a chunk read in flight at least this long at the deadline may have stalled
STALL_FACTOR = 4.0  # ... and at least this many times this load's mean chunk read
HOST = "host"


@dataclass(eq=False)
class Load:
    """One background load. read: chunks of the run the host holds so far, from the first;
    state: "reading" -> "copying" (handed to the loader) -> "copied" (``handle`` set: the
    store's `LoadHandle`, None when nothing was submitted); cut: its deadline ended its reads."""

    run: ChunkRun
    zeroed: object
    deadline: float
    read: int = 0
    state: str = "reading"
    cut: bool = False
    handle: object = None
    reading_since: float = 0.0  # when the chunk being read was asked of its tier
    read_s: float = 0.0  # the reads of the chunks read so far, in all

    def stalled(self, now: float) -> bool:
        """Whether the chunk being read has stalled in its tier, not merely come slowly."""
        mean = self.read_s / self.read if self.read else 0.0
        return now - self.reading_since >= max(STALL_MIN_S, STALL_FACTOR * mean)


class BackgroundLoads:
    """stores: the worker's `KVStore`s, one per KV cache group (a run names its ``group``).
    loader: the `Mover` whose thread copies (in the order vLLM
    asked). probe: the `TierProbe` told of a tier that failed a read. copy(run, zeroed, chunks,
    cut): the worker's load of the run's first ``chunks`` chunks from the host, with its
    outcome, errors and counts; returns its handle (None: nothing submitted). cap_s: a run's
    deadline when it names none. name: the reader threads' name."""

    def __init__(self, stores, loader, probe, copy, *, cap_s: float, name: str = "kvtier-reader") -> None:
        self._stores, self._loader, self._probe, self._copy_fn = stores, loader, probe, copy
        self.cap_s = cap_s
        self._lock = threading.Lock()
        self._loads: dict[tuple[str, int], Load] = {}  # (req id, group) -> its load
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix=name)
        self._reading = 0  # reader threads inside `_read`
        self._idle = threading.Condition(self._lock)

    def start(self, run: ChunkRun, zeroed) -> None:
        budget = self.cap_s if run.budget_s is None else min(run.budget_s, self.cap_s)
        now = time.monotonic()
        ld = Load(run, zeroed, now + budget, reading_since=now)
        with self._lock:
            self._loads[run.req_id, run.group] = ld
        if any(t != HOST for t in run.tiers):
            self._readers.submit(self._read, ld)
        else:  # the host holds every chunk: nothing to read
            ld.read = len(run.ids)
            self._hand_over(ld, cut=False)

    def poll(self) -> list[Load]:
        now = time.monotonic()
        with self._lock:
            loads = list(self._loads.values())
        for ld in loads:
            if ld.state == "reading" and now >= ld.deadline:
                i, stalled = ld.read, ld.stalled(now)  # the chunk being read: not in time
                if not self._hand_over(ld, cut=True) or i >= len(ld.run.ids) or _tier(ld.run, i) == HOST:
                    continue
                if stalled:  # a tier that stops answering: planned absent until its probe reads
                    key = self._stores[ld.run.group].keys(ld.run.ids[i : i + 1])[0]
                    self._probe.failed(_tier(ld.run, i), key)
        done = [ld for ld in loads if ld.state == "copied" and (ld.handle is None or ld.handle.done())]
        with self._lock:
            for ld in done:
                del self._loads[ld.run.req_id, ld.run.group]
        return done

    def close(self, timeout_s: float = 30.0) -> bool:
        """Start no more reads; wait, at most ``timeout_s``, for those running (each writes into a
        pool slot: the store must outlive them). False when one is still stalled in its tier."""
        self._readers.shutdown(wait=False, cancel_futures=True)
        with self._idle:
            done = self._idle.wait_for(lambda: self._reading == 0, timeout_s)
        if not done:
            log.warning("kvtier: %d background read(s) still wait in a tier at shutdown", self._reading)
        return done

    def _read(self, ld: Load) -> None:
        """On a reader thread: the run's chunks into the host, in order, until one no tier
        delivers or the deadline; then the copies of those read."""
        run, cut, store = ld.run, False, self._stores[ld.run.group]
        with self._lock:
            self._reading += 1
        try:
            for i, cid in enumerate(run.ids):
                t0 = time.monotonic()
                if t0 >= ld.deadline:
                    cut = True  # between two reads: the tier answers, only too slowly for this load
                    break
                ld.reading_since = t0
                if not store.fetch([cid]):  # no tier delivered it: the tier is down, or lost it
                    if _tier(run, i) != HOST:
                        self._probe.failed(_tier(run, i), store.keys([cid])[0])
                    break
                with self._lock:
                    if ld.state != "reading":
                        return  # cut meanwhile: the chunks read before went to be copied then
                    ld.read, ld.read_s = i + 1, ld.read_s + time.monotonic() - t0
        except Exception:  # a bug in a read must cost a recompute, never the load's report
            log.exception("kvtier: background read of %s failed", run.req_id)
        finally:
            with self._idle:
                self._reading -= 1
                self._idle.notify_all()
        self._hand_over(ld, cut)

    def _hand_over(self, ld: Load, cut: bool) -> bool:
        """The copies of the chunks read so far, to the loader thread, once per load; False when
        they went already."""
        with self._lock:
            if ld.state != "reading":
                return False
            ld.state, ld.cut, chunks = "copying", cut, ld.read
        self._loader.submit(partial(self._copy, ld, chunks))
        return True

    def _copy(self, ld: Load, chunks: int) -> None:
        h = None
        try:
            h = self._copy_fn(ld.run, ld.zeroed, chunks, ld.cut)
        finally:
            with self._lock:
                ld.handle, ld.state = h, "copied"  # received once its copies landed (poll)


def _tier(run: ChunkRun, i: int) -> str:
    return run.tiers[i] if i < len(run.tiers) else HOST
