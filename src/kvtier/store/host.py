"""HostTier: the pinned pool as the top tier — an index of chunk key → pool slot holding its KV.

An entry is *pending* from ``reserve`` until ``ready``: a save's copy into its slot, or a
lower-tier read into it, is in flight. Pending entries are counted against the capacity (the
bytes are about to be there) and pinned, so eviction never picks a slot a transfer writes.
Every other user of a slot pins its entry too: each load reading it (until its ``e_load`` has
completed) and each push to a lower tier reading its bytes. Eviction therefore only ever picks
READY, unpinned entries, whose slots no transfer touches; their slots go back through
``release`` (the engine), or, with write-back, to ``spill`` first (the writer pushes the bytes
down, then releases).

Plain bookkeeping under one lock (the store's index lock); slots are released outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .metrics import StoreMetrics
from .policy import EvictionPolicy, make_policy


@dataclass(eq=False, slots=True)
class HostEntry:
    """key: the chunk key. span: bytes counted against the capacity (the slot's aligned size).
    slot: the pool slot (None until attached). ready: the slot holds the chunk's bytes.
    dirty: held by no lower tier yet (write-back spills it before its slot is released).
    source: where the bytes came from ("save" or a lower tier's name).
    """

    key: bytes
    span: int
    slot: object | None = None
    ready: bool = False
    dirty: bool = False
    source: str = "save"
    doomed: bool = False  # deleted while pinned: dropped at the last unpin
    fresh: bool = False  # read ahead for a load: that load reports it by its source tier
    job: object | None = None  # the engine SaveJob while its copy is in flight


class HostTier:
    """capacity_bytes: pool bytes the index may hold (slot spans). policy: "lru", "arc" or an
    EvictionPolicy. release(slot): hand a slot back (through the engine). spill(entry): write-back
    only — push a dirty evicted entry down, then release its slot. on_gone(keys): told of every
    key that left the index (evicted, deleted, cancelled), under the index lock: note and return.
    """

    name = "host"

    def __init__(
        self,
        capacity_bytes: int,
        policy: str | EvictionPolicy = "lru",
        *,
        release: Callable[[object], None],
        spill: Callable[[HostEntry], None] | None = None,
        metrics: StoreMetrics | None = None,
        name: str = "host",
        on_gone: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        self.name = name
        self._policy = make_policy(policy, capacity_bytes)
        if on_gone is not None:
            self._policy.on_gone = on_gone
        self._release, self._spill = release, spill
        self._m = (metrics if metrics is not None else StoreMetrics()).tier(name)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # an entry became ready or went away
        self._entries: dict[bytes, HostEntry] = {}
        self._m.live_occupancy(self._occupancy)

    # -- filling -----------------------------------------------------------------------------

    def reserve(self, key: bytes, span: int, *, dirty: bool = False) -> tuple[HostEntry | None, str]:
        """A new pending entry, pinned once (the fill's pin), evicting as needed.

        Returns (entry, "reserved"), (None, "present") if the key is held or being filled, or
        (None, "full") if it cannot fit (everything else is pinned by transfers).
        """
        with self._lock:
            if key in self._entries:
                return None, "present"
            victims = self._policy.admit(key, span)
            if victims is None:
                self._m.put_failed("full")
                return None, "full"
            # Pinned from now: eviction must never pick a slot a copy is still filling.
            self._policy.pin(key)
            entry = HostEntry(key, span, dirty=dirty)
            self._entries[key] = entry
            gone = [self._entries.pop(v) for v in victims]
        self._dispose(gone)
        return entry, "reserved"

    def attach(self, entry: HostEntry, slot: object, job: object | None = None) -> None:
        with self._lock:
            entry.slot, entry.job = slot, job

    def ready(self, entry: HostEntry, *, keep_pin: bool = False) -> None:
        """The slot now holds the chunk (its fill event completed, or the CPU wrote it).
        keep_pin: the fill's pin passes to the caller (a load about to read the slot)."""
        with self._lock:
            entry.ready, entry.job = True, None
            self._m.stored(entry.span, 0.0)
            self._changed.notify_all()
            gone = None if keep_pin else self._unpin_locked(entry)
        if gone is not None:
            self._release(gone.slot)  # deleted while it filled: the fill has landed, nobody reads it

    def cancel(self, entry: HostEntry) -> None:
        """The fill failed: forget the entry; its slot (if any) goes back to the engine."""
        with self._lock:
            self._policy.unpin(entry.key)  # the fill's pin: nothing was (or will be) copied into it
            gone = self._drop_locked(entry) if not self._policy.is_pinned(entry.key) else None
            entry.doomed = gone is None  # a concurrent pin (cannot happen while pending) drops it later
            self._changed.notify_all()
        if gone is not None and gone.slot is not None:
            self._release(gone.slot)  # retired by the engine: freed once no copy touches it

    # -- reading -----------------------------------------------------------------------------

    def count_hits(self, n: int, nbytes: int) -> None:
        """``n`` hits of ``nbytes`` in all, acquired with count=False."""
        if n:
            self._m.hit(nbytes, 0.0, n)

    def acquire(
        self, key: bytes, wait_s: float = 0.0, settle: Callable[[], object] | None = None, count: bool = True
    ):
        """The READY entry of ``key``, pinned for the caller (unpin when its transfer has
        completed), or None (a miss). A pending entry is waited for up to ``wait_s``;
        ``settle()`` is called between waits to apply completed save events. count=False: the
        caller counts the hit itself (`count_hits`, once for a request's chunks)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                entry = self._entries.get(key)
                if entry is not None and entry.ready and not entry.doomed:
                    self._policy.touch(key)
                    self._policy.pin(key)  # the caller's transfer reads the slot until unpin
                    if count:
                        self._m.hit(entry.span, 0.0)
                    return entry
                left = deadline - time.monotonic()
                if entry is None or entry.doomed or left <= 0:
                    self._m.miss()
                    return None
                if settle is not None:
                    self._lock.release()  # settle() applies engine completions: never under the index lock
                    try:
                        settle()
                    finally:
                        self._lock.acquire()
                    if (e := self._entries.get(key)) is not None and e.ready:
                        continue
                # Bounded slices: a fill's completion may be applied by another thread's settle.
                self._changed.wait(min(left, 0.002))

    def pin(self, entry: HostEntry) -> bool:
        """Pin a still-resident READY entry (a push about to read its slot); False if gone."""
        with self._lock:
            if self._entries.get(entry.key) is not entry or not entry.ready or entry.doomed:
                return False
            self._policy.pin(entry.key)
            return True

    def hold(self, key: bytes) -> HostEntry | None:
        """Pin the entry of ``key`` (ready or still filling) without counting a hit; None if it
        is gone. The caller unpins it (a save keeping a prefix's chunks while it adds more)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.doomed:
                return None
            self._policy.pin(key)
            return entry

    def add_pin(self, entry: HostEntry) -> None:
        """One more pin on an entry the caller already holds pinned (e.g. pending)."""
        with self._lock:
            self._policy.pin(entry.key)

    def unpin(self, entry: HostEntry) -> None:
        with self._lock:
            gone = self._unpin_locked(entry)
        if gone is not None and gone.slot is not None:
            self._release(gone.slot)  # last pin of a deleted entry: no transfer uses it now

    def clean(self, entry: HostEntry) -> None:
        """A lower tier now holds the entry's bytes: eviction need not spill it."""
        with self._lock:
            entry.dirty = False

    # -- queries and removal -----------------------------------------------------------------

    def contains(self, key: bytes, pending: bool = True) -> bool:
        """Held (READY) or, with ``pending``, about to be."""
        with self._lock:
            e = self._entries.get(key)
            return e is not None and not e.doomed and (e.ready or pending)

    def delete(self, key: bytes) -> bool:
        """Drop ``key`` (no spill); a pinned entry goes at its last unpin."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.doomed:
                return False
            gone = None if self._policy.is_pinned(key) else self._drop_locked(entry)
            entry.doomed = gone is None
        if gone is not None and gone.slot is not None:
            self._release(gone.slot)  # unpinned: no transfer or push uses the slot
        return True

    def evict(self, keys: list[bytes] | None = None) -> int:
        """Evict unpinned READY entries (all, or those of ``keys``), spilling dirty ones."""
        with self._lock:
            order = self._policy.order() if keys is None else keys
            gone = []
            for key in order:
                e = self._entries.get(key)
                if e is not None and e.ready and not self._policy.is_pinned(key):
                    gone.append(self._drop_locked(e))
        self._dispose(gone)
        return len(gone)

    def make_room(self, nbytes: int) -> bool:
        """Pool pressure: evict clean, unpinned entries whose spans add up to ``nbytes``; True if
        any slot went back (a dirty entry would free nothing until its spill is written)."""
        with self._lock:
            gone, freed = [], 0
            for key in self._policy.order():
                e = self._entries[key]
                if freed < nbytes and e.ready and not e.dirty and not self._policy.is_pinned(key):
                    gone.append(self._drop_locked(e))
                    freed += e.span
        self._dispose(gone)
        return bool(gone)

    def drain(self) -> list[HostEntry]:
        """Forget every entry (close): the caller owns their slots, all transfers completed."""
        with self._lock:
            out = list(self._entries.values())
            self._entries.clear()
            for e in out:
                while self._policy.is_pinned(e.key):
                    self._policy.unpin(e.key)  # close: the store waited for every transfer first
                self._policy.remove(e.key)
            return out

    def entries(self) -> list[HostEntry]:
        with self._lock:
            return list(self._entries.values())

    def stats(self) -> dict[str, int | float]:
        with self._lock:
            pending = sum(not e.ready for e in self._entries.values())
            dirty = sum(e.dirty for e in self._entries.values())
        out = self._m.snapshot()
        out.update(pending=pending, dirty=dirty)
        return out

    # -- internals (lock held unless said) --------------------------------------------------

    def _unpin_locked(self, entry: HostEntry) -> HostEntry | None:
        self._policy.unpin(entry.key)  # callers unpin only once their transfer or push is done
        if entry.doomed and not self._policy.is_pinned(entry.key):
            return self._drop_locked(entry)
        return None

    def _drop_locked(self, entry: HostEntry) -> HostEntry:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self._policy.remove(entry.key)
        self._changed.notify_all()
        return entry

    def _dispose(self, gone: list[HostEntry]) -> None:
        """Evicted entries (no lock held): spill dirty ones, release the rest."""
        self._m.evicted(len(gone))
        for e in gone:
            if e.dirty and self._spill is not None:
                self._spill(e)  # write-back: the writer releases the slot after the push
            else:
                self._release(e.slot)  # unpinned and READY: no transfer reads or writes it

    def _occupancy(self) -> tuple[int, int, int, int]:
        """(used, capacity, entries, pinned bytes), read at scrape time without the lock: each a
        single read of a number the lock holders keep up to date."""
        p = self._policy
        return p.used_bytes, p.capacity_bytes, len(p), p.pinned_bytes
