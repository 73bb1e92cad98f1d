"""Tier walks for `KVStore`: where a chunk lives, bringing a lower-tier chunk into a pool slot,
dropping chunks from the lower tiers.

A lower-tier read lands in a pool slot straight from the tier (``get_into``); the tier has
verified the checksum, and here the header must describe exactly this cache's chunk (shape,
dtype, layout, length) — any mismatch or failure is a miss, never KV handed to the engine.
The CPU wrote the bytes synchronously, so the slot is READY at once (``fill_host``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from kvtier.pool import PoolExhausted

from .host import HostEntry
from .tier import DestTooSmall, contains_many
from .writer import Push

if TYPE_CHECKING:
    from .kvstore import KVStore

log = logging.getLogger(__name__)


class Taken(NamedTuple):
    """A chunk ready to be read by one load: entry pinned for it (kind "load") or a temporary
    slot no index holds (kind "temp", released when the load completed); tier: its source.
    Kind "present" (prefetch only, entry None): another request is already filling it."""

    entry: HostEntry
    kind: str
    tier: str


class Fetcher:
    def __init__(self, store: KVStore) -> None:
        self.s = store

    def where(self, keys: list[bytes]) -> list[str]:
        """Where each chunk of the longest prefix of ``keys`` that some tier holds lives: the
        first tier holding it ("host" included). One ``contains_many`` per lower tier (Redis: one
        round trip for the prompt, not one per chunk), for the keys the tiers above lack. A hint."""
        found: list[str | None] = ["host" if self.s.host.contains(key) else None for key in keys]
        for tier in self.s.tiers:
            missing = [i for i, name in enumerate(found) if name is None]
            if not missing:
                break
            try:
                held = contains_many(tier, [keys[i] for i in missing])
            except Exception as exc:  # a tier failure is a miss, never raised
                log.warning("kvstore: contains on %s failed: %s", tier.name, exc)
                continue
            for i, yes in zip(missing, held, strict=True):
                found[i] = tier.name if yes else None
        n = found.index(None) if None in found else len(found)
        return found[:n]  # a chunk after a gap is useless: its KV needs the missing one's

    def delete_lower(self, keys: list[bytes]) -> None:
        """Delete ``keys`` from every lower tier (failures logged, never raised)."""
        for key in keys:
            for tier in self.s.tiers:
                try:
                    tier.delete(key)
                except Exception as exc:
                    log.warning("kvstore: delete from %s failed: %s", tier.name, exc)

    def walk(self, keys: list[bytes]):
        """Yield ``take(key)`` for ``keys`` in order, up to the first miss. Once a chunk comes
        from a lower tier, the next ``read_ahead`` chunks are read in the background meanwhile
        (each a prefetch: the load finds it pending or ready in the host)."""
        s, ahead = self.s, None
        depth = s.config.read_ahead if s.promote and s.tiers else 0
        for i, key in enumerate(keys):
            while ahead is not None and ahead < min(len(keys), i + 1 + depth):
                s._prefetcher.submit(self.prefetch, [keys[ahead]], True)
                ahead += 1
            got = self.take(key)
            if got is None:
                return
            if ahead is None and depth and got.tier != "host":
                ahead = i + 1  # lower-tier reads have begun: the rest likely needs them too
            yield got

    def take(self, key: bytes) -> Taken | None:
        """``key``'s chunk, held for one load: a host hit, else a lower-tier read (promoted
        into the host when ``promote``, else a temporary slot); None if no tier delivers it."""
        s = self.s
        entry = s.host.acquire(key, s.fetch_wait_s, settle=s._reap)
        if entry is not None:
            tier = entry.source if entry.fresh else "host"
            entry.fresh = False
            return Taken(entry, "load", tier)
        return self.fetch(key, keep_pin=True, temp_ok=not s.promote)

    def fetch(self, key: bytes, *, keep_pin: bool, temp_ok: bool, fresh: bool = False) -> Taken | None:
        s = self.s
        if not s.tiers:
            return None
        entry, status = (None, "temp") if temp_ok else s.host.reserve(key, s.fmt.span)
        if status == "present":  # another request got there first: wait for its fill
            if not keep_pin:
                return Taken(None, "present", "host")  # a prefetch needs no more
            got = s.host.acquire(key, s.fetch_wait_s, settle=s._reap)
            return None if got is None else Taken(got, "load", "host")
        if status == "full":  # every host chunk is pinned by transfers
            s._count("fetch_host_full")
            if not keep_pin:
                return None
            entry = None  # a load still gets the chunk, through a temporary slot
        try:
            # Pool pressure evicts clean host chunks; spills and reads in flight use the headroom.
            slot = s.engine.slots.alloc(s.fmt.nbytes, s.alloc_timeout_s, on_pressure=s.host.make_room)
        except PoolExhausted as exc:
            log.info("kvstore: no pool room for a read: %s", exc)
            s._count("fetch_pool_exhausted")
            if entry is not None:
                s.host.cancel(entry)  # no slot: nothing was read into it
            return None
        found = self._read_into(key, slot)
        if found is None:
            if entry is not None:
                s.host.attach(entry, slot)
                s.host.cancel(entry)  # releases the slot: no copy ever touched it
            else:
                s._release_slot(slot)  # ALLOCATED, no copy ever touched it
            return None
        tier = s.tiers[found]
        s.engine.slots.fill_host(slot)  # the CPU wrote the bytes synchronously: READY, no event
        if entry is None:
            return Taken(
                HostEntry(key, s.fmt.span, slot=slot, ready=True, source=tier.name), "temp", tier.name
            )
        entry.source, entry.fresh = tier.name, fresh
        s.host.attach(entry, slot)
        s.host.ready(entry, keep_pin=keep_pin)
        if found > 0 and s.promote and s.host.pin(entry):  # the push reads the slot: pinned until done
            s._writer.submit(Push(entry, s.tiers[:found]))  # copy up to the faster lower tiers too
        s._count("promoted")
        return Taken(entry, "load", tier.name)

    def prefetch(self, keys: list[bytes], ahead: bool = False) -> int:
        """Walk ``keys`` from the first, promoting lower-tier chunks into the host; returns the
        tokens of the prefix the host then holds or is filling. ``ahead``: a load's read-ahead.
        Never raises."""
        s, n = self.s, 0
        try:
            for key in keys:
                if s.host.contains(key):
                    n += 1
                    continue
                if self.fetch(key, keep_pin=False, temp_ok=False, fresh=ahead) is None:
                    break
                n += 1
        except Exception:  # a prefetch is a hint: a bug here must not reach the serving loop
            log.exception("kvstore: prefetch failed")
            s._count(background_errors=1)
        s._count("read_ahead_chunks" if ahead else "prefetch_tokens", n if ahead else n * s.fmt.tokens)
        return n * s.fmt.tokens

    def _read_into(self, key: bytes, slot) -> int | None:
        """Index of the first lower tier that delivers ``key``'s chunk of this cache's format
        into ``slot``, or None."""
        s = self.s
        for i, tier in enumerate(s.tiers):
            try:
                header = tier.get_into(key, slot.tensor)
            except DestTooSmall as exc:  # a bigger chunk than this cache's: another format
                log.warning("kvstore: %s holds %s in another format (%s); a miss", tier.name, key.hex(), exc)
                s._count("header_mismatches")
                continue
            except Exception as exc:  # tiers do not raise, but a bug in one must stay a miss
                log.warning("kvstore: %s read of %s failed: %s", tier.name, key.hex(), exc)
                s._count("read_failures")
                continue
            if header is None:
                continue
            if s.fmt.matches(header):
                return i
            log.warning("kvstore: %s holds %s in another format (%s); a miss", tier.name, key.hex(), header)
            s._count("header_mismatches")
        return None
