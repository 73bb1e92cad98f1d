"""Holdings: what one worker's local tiers hold, as the changes the scheduler side is told of.

A rank's chunk is held while its host tier or a watched lower tier (one whose eviction policy
reports what leaves it: the disk) holds the chunk's tier key, in the host or below it (the
scheduler plans a read for a chunk below); it is lost once none does. Redis is not watched: the
scheduler asks it directly.

    watch(tier, policy)     a lower tier whose `EvictionPolicy` reports its departures here
    gone(keys)              a tier dropped ``keys`` (the store's ``on_evict``, a policy's
                            ``on_gone``): from any thread, under that tier's lock: noted only
    held(keys)              a save landed or a read brought chunks into the host
    take(host) -> (held, below, lost)  the changes since the last take: keys the host holds, key
                            -> the watched tier holding it without the host, keys lost; the
                            first also reports every key a watched tier holds already (a disk
                            across a restart); a key lost while a watched tier may still be
                            writing it (a spill, a push) is looked for again over the next
                            RECHECKS takes
"""

from __future__ import annotations

from collections import deque

# Takes a key the host dropped is looked for again in the watched tiers: a write-back spill or a
# write-through push may still be writing it there (a file counts only once written).
RECHECKS = 16
HOST = "host"


class Holdings:
    def __init__(self) -> None:
        # tier key -> where it is held, as last seen since the last take: HOST, a watched tier's
        # name, or None (lost)
        self._keys: dict[bytes, str | None] = {}
        self._gone: deque[bytes] = deque()  # dropped by one tier: held by another, or lost
        self._watched: list = []
        self._recheck: dict[bytes, int] = {}  # lost keys a watched tier may still be writing -> takes left
        self._started = False

    def watch(self, tier, policy) -> None:
        """``tier`` (made with ``policy``): its evictions and deletions count as departures."""
        policy.on_gone = self.gone
        self._watched.append(tier)

    def gone(self, keys) -> None:
        self._gone.extend(keys)  # an append (thread-safe): the caller holds its tier's lock

    def held(self, keys) -> None:
        self._keys.update(dict.fromkeys(keys, HOST))

    def take(self, host) -> tuple[set[bytes], dict[bytes, str], set[bytes]]:
        """(keys the host now holds, key -> the watched tier now holding it without the host,
        keys now lost) since the last call; ``host``: the store's host tier."""
        watched = self._watched
        if not self._started:  # what a watched tier held before this process started
            self._started = True
            for tier in watched:
                self._keys.update(dict.fromkeys(tier.resident_keys(), tier.name))
        for key, left in list(self._recheck.items()):
            if (below := _below(key, watched)) is not None:
                self._keys[key] = below  # written down since: held again
                del self._recheck[key]
            elif left > 1:
                self._recheck[key] = left - 1
            else:
                del self._recheck[key]
        while self._gone:
            key = self._gone.popleft()
            if host.contains(key, pending=False):
                continue  # held again (one being filled is reported once it is, by whoever fills it)
            self._keys[key] = below = _below(key, watched)
            if below is None and watched:  # no local tier holds it: unless one is still writing it
                self._recheck[key] = RECHECKS
        held = {k for k, v in self._keys.items() if v == HOST}
        below = {k: v for k, v in self._keys.items() if v is not None and v != HOST}
        lost = {k for k, v in self._keys.items() if v is None}
        self._keys = {}
        return held, below, lost


def _below(key: bytes, watched: list) -> str | None:
    """The name of the first watched tier holding ``key``, or None."""
    return next((t.name for t in watched if t.contains(key)), None)
