"""Holdings: what one worker's local tiers hold, as the changes the scheduler side is told of.

A rank's chunk is held while its host tier or a watched lower tier (one whose eviction policy
reports what leaves it: the disk) holds the chunk's tier key; it is lost once none does. Redis is
not watched: the scheduler asks it directly.

    watch(tier, policy)     a lower tier whose `EvictionPolicy` reports its departures here
    gone(keys)              a tier dropped ``keys`` (the store's ``on_evict``, a policy's
                            ``on_gone``): from any thread, under that tier's lock: noted only
    held(keys) / lost(key)  a save landed or a read brought chunks in / a load found none
    take(host) -> (held, lost)  the changes since the last take; the first also reports every
                            key a watched tier holds already (a disk across a restart); a key
                            lost while a watched tier may still be writing it (a spill, a push)
                            is looked for again over the next RECHECKS takes
"""

from __future__ import annotations

from collections import deque

# Takes a key the host dropped is looked for again in the watched tiers: a write-back spill or a
# write-through push may still be writing it there (a file counts only once written).
RECHECKS = 16


class Holdings:
    def __init__(self) -> None:
        self._keys: dict[bytes, bool] = {}  # tier key -> held, as last seen (since the last take)
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
        self._keys.update(dict.fromkeys(keys, True))

    def lost(self, key: bytes) -> None:
        self._keys[key] = False

    def take(self, host) -> tuple[set[bytes], set[bytes]]:
        """(keys now held, keys now lost) since the last call; ``host``: the store's host tier."""
        if not self._started:  # what a watched tier held before this process started
            self._started = True
            for tier in self._watched:
                self.held(tier.resident_keys())
        watched = self._watched
        for key, left in list(self._recheck.items()):
            if any(t.contains(key) for t in watched):
                self._keys[key] = True  # written down since: held again
                del self._recheck[key]
            elif left > 1:
                self._recheck[key] = left - 1
            else:
                del self._recheck[key]
        while self._gone:
            key = self._gone.popleft()
            if not (host.contains(key) or any(t.contains(key) for t in watched)):
                self._keys[key] = False  # no local tier holds it (one filling it reports it when done)
                if watched:
                    self._recheck[key] = RECHECKS
        held = {k for k, v in self._keys.items() if v}
        lost = set(self._keys) - held
        self._keys = {}
        return held, lost
