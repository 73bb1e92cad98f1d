"""Eviction policies with capacity in bytes: LRU and ARC, and pins that block eviction.

Plain bookkeeping, not thread-safe: the owning tier calls it under its own lock. The policy
decides *which* keys go; the tier deletes their bytes. A pinned key (a transfer is reading
or writing it) is never chosen as a victim — eviction skips to the next candidate.

Events: ``touch(key)`` on a hit, ``admit(key, nbytes)`` when a new chunk is stored (returns
the victims, already dropped from the accounting), ``remove(key)`` when a chunk is deleted.
``on_gone(keys)``, where set, hears of every key that left: an admit's victims and each removed
key (so whoever grants hits from what a tier holds learns of its evictions).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class EvictionPolicy:
    """Shared accounting: sizes, pins, capacity. Subclasses order the victims.

    on_gone: None, or called with the keys that left (an admit's victims, a removed key), under
    the owning tier's lock: it must only note them (e.g. append to a deque) and return.
    """

    on_gone: Callable[[list[bytes]], None] | None = None

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._size: dict[bytes, int] = {}
        self._pins: dict[bytes, int] = {}
        self.pinned_bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def size_of(self, key: bytes) -> int:
        return self._size[key]

    def pin(self, key: bytes) -> None:
        """Hold ``key`` resident (a transfer is using it); pins nest."""
        if key not in self._size:
            raise ValueError(f"key {key.hex()} is not resident, cannot pin it")
        n = self._pins.get(key, 0)
        if n == 0:
            self.pinned_bytes += self._size[key]
        self._pins[key] = n + 1

    def unpin(self, key: bytes) -> None:
        n = self._pins.get(key, 0)
        if n == 0:
            raise ValueError(f"key {key.hex() if isinstance(key, bytes) else key!r} is not pinned")
        if n == 1:
            del self._pins[key]
            self.pinned_bytes -= self._size[key]
        else:
            self._pins[key] = n - 1

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def admit(self, key: bytes, nbytes: int) -> list[bytes] | None:
        """Account ``key`` (``nbytes``) as resident, evicting as needed.

        Returns the evicted keys (the caller deletes their data), or None — and changes
        nothing — if the chunk cannot fit: larger than the capacity, or too much is pinned.
        """
        if not isinstance(nbytes, int) or nbytes < 1:
            raise ValueError(f"nbytes must be an int >= 1, got {nbytes!r}")
        if key in self._size:
            raise ValueError(f"key {key.hex()} is already resident (use touch)")
        if self.capacity_bytes - self.pinned_bytes < nbytes:
            return None
        victims = self._admit(key, nbytes)
        self._size[key] = nbytes
        self.used_bytes += nbytes
        if victims and self.on_gone is not None:
            self.on_gone(victims)
        return victims

    def touch(self, key: bytes) -> bool:
        """A hit on ``key``; False if it is not resident."""
        if key not in self._size:
            return False
        self._touch(key)
        return True

    def remove(self, key: bytes) -> bool:
        """Forget ``key`` (deleted, or found corrupt). A pinned key cannot be removed."""
        if key in self._pins:
            raise ValueError(f"key {key.hex()} is pinned, unpin it before removing")
        if key not in self._size:
            self._forget_ghost(key)
            return False
        self._drop(key)
        self.used_bytes -= self._size.pop(key)
        if self.on_gone is not None:
            self.on_gone([key])
        return True

    def _evict(self, key: bytes) -> None:
        self.used_bytes -= self._size.pop(key)

    def _first_unpinned(self, order: OrderedDict) -> bytes | None:
        """The least recently used key of ``order`` that no transfer holds."""
        return next((k for k in order if k not in self._pins), None)

    def order(self) -> list[bytes]:
        """Resident keys in the policy's order (LRU: next victim first; ARC: T1 then T2,
        each least recent first)."""
        raise NotImplementedError

    def _admit(self, key: bytes, nbytes: int) -> list[bytes]:
        raise NotImplementedError

    def _touch(self, key: bytes) -> None:
        raise NotImplementedError

    def _drop(self, key: bytes) -> None:
        raise NotImplementedError

    def _forget_ghost(self, key: bytes) -> None:
        pass


class LRU(EvictionPolicy):
    """Least recently used (a hit or an admit makes a key most recent)."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def order(self) -> list[bytes]:
        return list(self._order)

    def _admit(self, key: bytes, nbytes: int) -> list[bytes]:
        victims = []
        while self.used_bytes + nbytes > self.capacity_bytes:
            victim = self._first_unpinned(self._order)  # admit() checked that enough is unpinned
            del self._order[victim]
            self._evict(victim)
            victims.append(victim)
        self._order[key] = None
        return victims

    def _touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def _drop(self, key: bytes) -> None:
        del self._order[key]


class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003, Fig. 4), sizes in bytes.

    T1: resident, seen once recently; T2: resident, seen at least twice. B1 / B2: ghosts
    (keys and sizes only) of what was evicted from T1 / T2. ``p`` is the target size of T1;
    a re-admitted B1 ghost grows it (recency pays), a B2 ghost shrinks it (frequency pays).
    With every size 1 this is exactly the paper's algorithm (checked against a transcription
    in the tests); with sizes, "|X|" becomes bytes and REPLACE runs until the chunk fits.
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.p = 0.0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, int] = OrderedDict()
        self._b2: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = {"t1": 0, "b1": 0, "b2": 0}

    def order(self) -> list[bytes]:
        return list(self._t1) + list(self._t2)

    def ghosts(self) -> tuple[list[bytes], list[bytes]]:
        return list(self._b1), list(self._b2)

    def _admit(self, key: bytes, nbytes: int) -> list[bytes]:
        c, b = self.capacity_bytes, self._bytes
        victims: list[bytes] = []
        if key in self._b1:  # case II: recency would have hit; grow T1's target
            delta = nbytes * max(1.0, b["b2"] / b["b1"])
            self.p = min(float(c), self.p + delta)
            self._replace_until_fits(key, nbytes, victims)
            b["b1"] -= self._b1.pop(key)
            self._t2[key] = None
        elif key in self._b2:  # case III: frequency would have hit; shrink T1's target
            delta = nbytes * max(1.0, b["b1"] / b["b2"])
            self.p = max(0.0, self.p - delta)
            self._replace_until_fits(key, nbytes, victims)
            b["b2"] -= self._b2.pop(key)
            self._t2[key] = None
        else:  # case IV: a key never seen (or forgotten)
            if b["t1"] + b["b1"] + nbytes > c:  # IV.A: L1 = T1 ∪ B1 is full
                while self._b1 and b["t1"] + b["b1"] + nbytes > c:
                    b["b1"] -= self._b1.popitem(last=False)[1]
                # B1 empty and T1 alone too big: the paper drops T1's LRU with no ghost.
                while b["t1"] + nbytes > c and self.used_bytes + nbytes > c:
                    victim = self._first_unpinned(self._t1)
                    if victim is None:
                        break
                    self._evict_from("t1", victim, victims, ghost=False)
            else:  # IV.B: the directory (T1 ∪ T2 ∪ B1 ∪ B2) is bounded by 2c
                total = self.used_bytes + b["b1"] + b["b2"]
                while self._b2 and total + nbytes > 2 * c:
                    size = self._b2.popitem(last=False)[1]
                    b["b2"] -= size
                    total -= size
            self._replace_until_fits(key, nbytes, victims)
            self._t1[key] = None
            b["t1"] += nbytes
        # With unit sizes the paper's invariants keep the ghosts under 2c; with mixed sizes
        # they can drift, and ghosts are memory, so bound them explicitly.
        while b["b1"] + b["b2"] > 2 * c:
            ghosts, name = (self._b2, "b2") if self._b2 else (self._b1, "b1")
            b[name] -= ghosts.popitem(last=False)[1]
        return victims

    def _replace_until_fits(self, key: bytes, nbytes: int, victims: list[bytes]) -> None:
        """The paper's REPLACE(x, p), repeated while the chunk does not fit."""
        while self.used_bytes + nbytes > self.capacity_bytes:
            t1_victim = self._first_unpinned(self._t1)
            t2_victim = self._first_unpinned(self._t2)
            from_t1 = self._bytes["t1"] > self.p or (key in self._b2 and self._bytes["t1"] == self.p)
            # A list whose every key is pinned cannot give; take from the other one.
            if t1_victim is not None and (from_t1 or t2_victim is None):
                self._evict_from("t1", t1_victim, victims, ghost=True)
            else:
                self._evict_from("t2", t2_victim, victims, ghost=True)

    def _evict_from(self, which: str, victim: bytes, victims: list[bytes], ghost: bool) -> None:
        size = self._size[victim]
        if which == "t1":
            del self._t1[victim]
            self._bytes["t1"] -= size
            if ghost:
                self._b1[victim] = size
                self._bytes["b1"] += size
        else:
            del self._t2[victim]
            self._b2[victim] = size
            self._bytes["b2"] += size
        self._evict(victim)
        victims.append(victim)

    def _touch(self, key: bytes) -> None:  # case I: a hit makes the key frequent
        if key in self._t1:
            del self._t1[key]
            self._bytes["t1"] -= self._size[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def _drop(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._bytes["t1"] -= self._size[key]
        else:
            del self._t2[key]

    def _forget_ghost(self, key: bytes) -> None:
        if key in self._b1:
            self._bytes["b1"] -= self._b1.pop(key)
        elif key in self._b2:
            self._bytes["b2"] -= self._b2.pop(key)


POLICIES = {"lru": LRU, "arc": ARC}


def make_policy(policy: str | EvictionPolicy, capacity_bytes: int) -> EvictionPolicy:
    """A policy by name ("lru", "arc") or an instance passed through."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {tuple(POLICIES)} or an EvictionPolicy, got {policy!r}")
    return POLICIES[policy](capacity_bytes)
