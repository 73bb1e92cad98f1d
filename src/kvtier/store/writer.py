"""The store's background writer: pushes host chunks down to the lower tiers.

Three kinds of push, one queue, one thread (tier puts are blocking IO; the serving loop must
never wait for them):

- write-through: a freshly saved chunk, once its save event has completed;
- promotion: a chunk found in a lower tier, copied to the tiers above it;
- write-back spill: a dirty chunk evicted from the host, whose slot is released after.

Pushes queued together go down as one batch (up to ``batch_max``): each tier stores its share
through one ``put_many`` (one directory fsync, a few pipelined round trips), and a push is
done — ``wait_durable`` returns — only once its whole batch was stored.

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
from .tier import Tier, put_many

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
    """header(key, payload, algo) -> ChunkHeader: the header of a chunk's bytes. host: whose entries
    are pushed (unpinned after a push). release(slot): gives a spilled entry's slot back.
    count(**events): the store's counters."""

    def __init__(
        self,
        header: Callable[[bytes, object, str], ChunkHeader],
        host: HostTier,
        release: Callable[[object], None],
        count: Callable[..., None],
        *,
        wait_slice_s: float = 0.05,
        batch_max: int = 16,
    ) -> None:
        self._header, self._host, self._release, self._count = header, host, release, count
        self._wait_slice_s, self._batch_max = wait_slice_s, batch_max
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
        stop = False
        while not stop:
            batch = [self._q.get()]
            # Whatever else is queued rides along (up to batch_max): the tiers store it with
            # one directory fsync / one pipeline for all, instead of one each.
            while batch[-1] is not None and len(batch) < self._batch_max:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is None:
                stop = True
                batch.pop()
            try:
                self._push(batch)
            except Exception:  # never kill the thread: a failed push is a chunk not pushed
                log.exception("store writer: a batch of %d pushes failed", len(batch))
                for push in batch:
                    push.ok = False
            for push in batch:
                try:
                    self._finish(push)
                except Exception:  # e.g. the sanitizer refusing a release: counted, and tests check it
                    log.exception("store writer: finishing the push of %s failed", push.entry.key.hex())
                    self._count(background_errors=1)
                # Set only now: the batch's put_many returned, so the chunk is as durable as its batch.
                push.done.set()
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _push(self, batch: list[Push]) -> None:
        """Put each push's chunk into its tiers, a tier's share of the batch in one put_many."""
        items = {}
        for push in batch:
            push.ok = False
            if not self._landed(push):
                continue
            try:
                payload = push.entry.slot.tensor
                # A chunk only tiers that seal it store needs no checksum: its tag covers the payload.
                sealed = all(getattr(t, "auth", None) is not None for t in push.tiers)
                header = self._header(push.entry.key, payload, "none" if sealed else "xxh3_64")
                items[push] = (push.entry.key, header, payload)
                push.ok = True
            except Exception:  # this chunk is not pushed; the rest of the batch is
                log.exception("store writer: header of %s failed", push.entry.key.hex())
        tiers = {id(t): t for push in items for t in push.tiers}
        for tier in tiers.values():
            mine = [push for push in items if any(t is tier for t in push.tiers)]
            # A tier that holds a key already answers True without rewriting it.
            for push, stored in zip(mine, put_many(tier, [items[p] for p in mine]), strict=True):
                push.ok = push.ok and stored

    def _landed(self, push: Push) -> bool:
        """Whether the slot holds the chunk's bytes (False: the writer is aborting)."""
        if push.after is None:
            return True
        # The slot is read only after its save event: before it, the copy may not have landed
        # and the tier would store (and checksum) half-copied KV.
        while not push.after.event.synchronize(self._wait_slice_s):
            if self._abort.is_set():  # shutting down: the chunk is not pushed, nothing is read
                return False
        return True

    def _finish(self, push: Push) -> None:
        """The tiers have read the slot's bytes (or failed to)."""
        self._count(pushes=1, push_failures=int(not push.ok))
        if push.spill:
            self._release(push.entry.slot)  # evicted, and no tier reads it any more
            return
        if push.ok:
            self._host.clean(push.entry)  # a lower tier holds it: evicting it needs no spill
        self._host.unpin(push.entry)  # the push's pin: nothing reads the slot for it any more
