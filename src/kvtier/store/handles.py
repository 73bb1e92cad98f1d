"""What `KVStore.lookup` / `save` / `load` return.

A handle is *submitted* work: its engine jobs complete when their events do. Waiting on a
handle never releases anything by itself; the store applies completions (unpins, READY slots)
only once the events have completed, and a timeout leaves everything in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.device.base import Event, Stream


class Lookup(NamedTuple):
    """tokens: the matched prefix (whole chunks). tiers: per matched chunk, the tier holding it
    ("host" or a lower tier's name), in chunk order. A hint: a load may still deliver less."""

    tokens: int
    tiers: tuple[str, ...]


def _wait_all(jobs: list, timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    for job in jobs:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not job.wait(left):  # engine wait: settles on completion, releases nothing on timeout
            return False
    return True


@dataclass(eq=False)
class SaveHandle:
    """tokens: the prefix now stored or being stored (skipped + saved chunks, from chunk 0 up to
    the first that could not be saved). saved / skipped / failed: chunk counts (skipped: already
    held or being saved by another request). jobs: the engine SaveJobs; ``events`` complete when
    the GPU blocks have been read (only then may the serving engine overwrite them)."""

    tokens: int = 0
    saved: int = 0
    skipped: int = 0
    failed: int = 0
    jobs: list = field(default_factory=list, repr=False)
    pushes: list = field(default_factory=list, repr=False)  # write-through pushes (writer.Push)
    _on_done: Callable[[], object] | None = field(default=None, repr=False)

    @property
    def events(self) -> list[Event]:
        return [j.event for j in self.jobs]

    def done(self) -> bool:
        """True once every save copy has landed in its slot."""
        finished = all(j.done() for j in self.jobs)  # event queries: completion, not submission
        if finished and self._on_done is not None:
            self._on_done()  # the saved chunks become READY for lookups now
        return finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every save copy has landed; False on timeout (nothing is released)."""
        ok = _wait_all(self.jobs, timeout)
        if ok and self._on_done is not None:
            self._on_done()  # make the saved chunks READY for lookups now, not at the next poll
        return ok

    def wait_on(self, stream: Stream) -> None:
        """Later work on ``stream`` (e.g. compute overwriting these blocks) waits for the saves.
        The jobs of one engine call share their event: it is waited for once."""
        last = None
        for j in self.jobs:
            if j.event is not last:
                j.wait_on(stream)  # the blocks must not be overwritten before their copy read them
                last = j.event

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Write-through: block until every saved chunk was pushed to the lower tiers; True only
        if every tier stored every chunk (False on timeout or any failed put)."""
        if not self.wait(timeout):  # a push reads the slot only after its save landed
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in self.pushes:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not p.done.wait(left):  # durable means put returned, not queued
                return False
        return all(p.ok for p in self.pushes)


@dataclass(eq=False)
class LoadHandle:
    """tokens: how many tokens of the request will be delivered (whole chunks from token 0);
    the caller computes the rest. tiers: per loaded chunk, where it came from. jobs: the engine
    LoadJobs, one per chunk, in order; block ids of chunk i are block_ids[i*bpc:(i+1)*bpc]."""

    tokens: int = 0
    tiers: tuple[str, ...] = ()
    jobs: list = field(default_factory=list, repr=False)
    num_layers: int = field(default=0, repr=False)
    _on_done: Callable[[], object] | None = field(default=None, repr=False)
    # Per layer: (jobs to wait, (engine, events) to note), planned on the first wait_layer.
    _layer_plan: list | None = field(default=None, repr=False)
    _last_wait: tuple | None = field(default=None, repr=False)  # (stream, {id: event}) last waited for

    @property
    def events(self) -> list[Event]:
        return [j.event for j in self.jobs]

    def wait_layer(self, layer: int, stream: Stream) -> None:
        """Later work on ``stream`` waits until layer ``layer`` of every loaded chunk has landed
        (the host does not block). Call before attention of that layer reads the blocks."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        if self._layer_plan is None:
            self._layer_plan = [_plan_layer(self.jobs, i) for i in range(self.num_layers)]
        waits, notes = self._layer_plan[layer]
        last = self._last_wait
        if last is not None and last[0] == stream:
            # Layers sharing one event (a whole-chunk copy): `stream` waits for it already.
            waits = [j for j in waits if id(j.layer_events[layer]) not in last[1]]
        for j in waits:
            j.wait_layer(layer, stream)  # attention must not read a block before its bytes land
        if waits:  # the values keep the events alive: their ids are not reused meanwhile
            self._last_wait = (stream, {id(j.layer_events[layer]): j.layer_events[layer] for j in waits})
        for engine, events in notes:
            engine.note_waits(stream, events)  # ordered before the waited event of its stream

    def done(self) -> bool:
        """True once every chunk has landed in its GPU blocks."""
        finished = all(j.done() for j in self.jobs)  # event queries: landed, not just submitted
        if finished and self._on_done is not None:
            self._on_done()  # the slots' pins may drop now: every e_load has completed
        return finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every chunk has landed; False on timeout (the slots stay pinned)."""
        ok = _wait_all(self.jobs, timeout)
        if ok and self._on_done is not None:
            self._on_done()  # every e_load has completed: the slots' pins may drop
        return ok


def _plan_layer(jobs: list, layer: int) -> tuple[list, list]:
    """(jobs whose layer event a reader waits for, (engine, events) it only notes) for one layer.

    One wait per copy stream, on its last job: a stream runs in order, so that job's layer event
    follows every earlier job's on the same stream (one wait per chunk cost ~4,000 stream waits per
    32K-token request). The earlier events are noted for the sanitizer, each once (the jobs of one
    `load_slots` share their events), and only where it is on: nothing else reads the notes."""
    last: dict = {}
    for j in jobs:
        last[j.layer_events[layer].stream] = j
    waits = [j for s, j in last.items() if s is not None]
    seen, notes = {id(j.layer_events[layer]) for j in waits}, {}
    for j in jobs:
        ev = j.layer_events[layer]
        if ev.stream is not None and id(ev) not in seen and j.engine.sanitize:
            seen.add(id(ev))
            notes.setdefault(j.engine, []).append(ev)
    return waits, list(notes.items())
