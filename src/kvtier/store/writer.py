"""The store's background writer: pushes host chunks down to the lower tiers.

Three kinds of push, one queue, one thread (tier puts are blocking IO; the serving loop must
never wait for them):

- write-through: a freshly saved chunk, once its save event has completed;
- promotion: a chunk found in a lower tier, copied to the tiers above it;
- write-back spill: a dirty chunk evicted from the host, whose slot is released after.

The submitter pins the entry (or, for a spill, owns its slot) for the push's duration, so the
slot's bytes cannot be released and reused while a tier is reading them — that would store
another chunk's KV under this key with a valid checksum: wrong KV, undetectable later.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .header import ChunkHeader
from .host import HostEntry, HostTier
from .tier import Tier

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Push:
    """entry: its slot holds the bytes. tiers: where to put them. after: the engine SaveJob whose
    copy fills the slot (None: the bytes are there). spill: the entry was evicted; its slot is
    released after the push. done: set when finished; ok: every tier holds the chunk."""

    entry: HostEntry
    tiers: list[Tier]
    after: object | None = None
    spill: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class Writer:
    """header(key, payload) -> ChunkHeader: the header of a chunk's bytes. host: whose entries
    are pushed (unpinned after a push). release(slot): gives a spilled entry's slot back.
    count(**events): the store's counters."""

    def __init__(
        self,
        header: Callable[[bytes, object], ChunkHeader],
        host: HostTier,
        release: Callable[[object], None],
        count: Callable[..., None],
        *,
        wait_slice_s: float = 0.05,
    ) -> None:
        self._header, self._host, self._release, self._count = header, host, release, count
        self._wait_slice_s = wait_slice_s
        self._q: queue.SimpleQueue[Push | None] = queue.SimpleQueue()
        self._abort = threading.Event()  # set by close() on timeout: stop waiting for saves
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-store-writer", daemon=True)
        self._thread.start()

    def submit(self, push: Push) -> Push:
        with self._idle:
            self._pending += 1
        self._q.put(push)
        return push

    def spill(self, entry: HostEntry, tiers: list[Tier]) -> None:
        """Write-back: an evicted dirty entry; its slot is released once the tiers have it."""
        self._count(spills=1)
        self.submit(Push(entry, tiers, spill=True))

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every push submitted so far has finished; False on timeout."""
        with self._idle:
            # Durability and close need every push done, not merely queued.
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the queued pushes, then stop the thread."""
        self._q.put(None)
        self._thread.join(timeout)  # queued pushes finish first: their slots are released after them
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(1.0)

    @property
    def backlog(self) -> int:
        with self._idle:
            return self._pending

    def _run(self) -> None:
        while (push := self._q.get()) is not None:
            try:
                self._push(push)
            except Exception:  # never kill the thread: a failed push is a chunk not pushed
                log.exception("store writer: push of %s failed", push.entry.key.hex())
                push.ok = False
            try:
                self._finish(push)
            except Exception:  # e.g. the sanitizer refusing a release: counted, and tests check it
                log.exception("store writer: finishing the push of %s failed", push.entry.key.hex())
                self._count(background_errors=1)
            push.done.set()
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _push(self, push: Push) -> None:
        if push.after is not None:
            # The slot is read only after its save event: before it, the copy may not have
            # landed and the tier would store (and checksum) half-copied KV.
            while not push.after.event.synchronize(self._wait_slice_s):
                if self._abort.is_set():  # shutting down: the chunk is not pushed, nothing is read
                    return
        payload = push.entry.slot.tensor
        header = self._header(push.entry.key, payload)
        ok = True
        for tier in push.tiers:
            try:
                # A tier that holds the key already answers True without rewriting it.
                stored = tier.put(push.entry.key, header, payload)
            except Exception:
                log.exception("store writer: tier %s raised on put", getattr(tier, "name", tier))
                stored = False
            ok = ok and stored
        push.ok = ok

    def _finish(self, push: Push) -> None:
        """The tiers have read the slot's bytes (or failed to)."""
        self._count(pushes=1, push_failures=int(not push.ok))
        if push.spill:
            self._release(push.entry.slot)  # evicted, and no tier reads it any more
            return
        if push.ok:
            self._host.clean(push.entry)  # a lower tier holds it: evicting it needs no spill
        self._host.unpin(push.entry)  # the push's pin: nothing reads the slot for it any more
