"""Eviction order of LRU and ARC against independent references; pins block eviction."""

import random

import pytest

from kvtier.store.policy import ARC, LRU, make_policy


class RefLRU:
    def __init__(self, c):
        self.c, self.items = c, []  # least recent first

    def request(self, x):
        if x in self.items:
            self.items.remove(x)
            self.items.append(x)
            return []
        evicted = []
        if len(self.items) == self.c:
            evicted.append(self.items.pop(0))
        self.items.append(x)
        return evicted


class RefARC:
    """ARC(c) transcribed from Megiddo & Modha, FAST 2003, Figure 4 (unit-size pages)."""

    def __init__(self, c):
        self.c, self.p = c, 0
        self.t1, self.t2, self.b1, self.b2 = [], [], [], []  # LRU first

    def _replace(self, x, evicted):
        if self.t1 and (len(self.t1) > self.p or (x in self.b2 and len(self.t1) == self.p)):
            y = self.t1.pop(0)
            self.b1.append(y)
        else:
            y = self.t2.pop(0)
            self.b2.append(y)
        evicted.append(y)

    def request(self, x):
        evicted = []
        if x in self.t1 or x in self.t2:  # case I
            (self.t1 if x in self.t1 else self.t2).remove(x)
            self.t2.append(x)
        elif x in self.b1:  # case II
            d = 1 if len(self.b1) >= len(self.b2) else len(self.b2) / len(self.b1)
            self.p = min(self.c, self.p + d)
            self._replace(x, evicted)
            self.b1.remove(x)
            self.t2.append(x)
        elif x in self.b2:  # case III
            d = 1 if len(self.b2) >= len(self.b1) else len(self.b1) / len(self.b2)
            self.p = max(0, self.p - d)
            self._replace(x, evicted)
            self.b2.remove(x)
            self.t2.append(x)
        else:  # case IV
            l1 = len(self.t1) + len(self.b1)
            total = l1 + len(self.t2) + len(self.b2)
            if l1 == self.c:
                if len(self.t1) < self.c:
                    self.b1.pop(0)
                    self._replace(x, evicted)
                else:
                    evicted.append(self.t1.pop(0))
            elif total >= self.c:
                if total == 2 * self.c:
                    self.b2.pop(0)
                self._replace(x, evicted)
            self.t1.append(x)
        return evicted


def trace(seed, n, universe):
    """Mixed recency / frequency: a hot set, scans, and one-off keys."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        r = rng.random()
        if r < 0.5:
            out.append(rng.randrange(universe // 8))
        elif r < 0.7:
            start = rng.randrange(universe)
            out.extend(range(start, start + rng.randrange(1, 12)))
        else:
            out.append(rng.randrange(universe))
    return [x.to_bytes(8, "little") for x in out[:n]]


def drive(policy, key):
    if key in policy:
        policy.touch(key)
        return []
    return policy.admit(key, 1)


@pytest.mark.parametrize("c", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_matches_reference(c, seed):
    ours, ref = LRU(c), RefLRU(c)
    for key in trace(seed, 3000, 4 * c + 5):
        assert drive(ours, key) == ref.request(key)
        assert ours.order() == ref.items
    assert ours.used_bytes == len(ref.items)


@pytest.mark.parametrize("c", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arc_matches_the_paper(c, seed):
    ours, ref = ARC(c), RefARC(c)
    for key in trace(seed, 3000, 4 * c + 5):
        assert drive(ours, key) == ref.request(key)
        assert ours.order() == ref.t1 + ref.t2
        assert ours.ghosts() == (ref.b1, ref.b2)
        assert ours.p == ref.p


def test_arc_keeps_a_frequent_set_through_a_scan():
    # The point of ARC over LRU: a one-pass scan does not flush keys used twice.
    arc, lru = ARC(10), LRU(10)
    hot = [i.to_bytes(8, "little") for i in range(5)]
    for policy in (arc, lru):
        for _ in range(2):
            for k in hot:
                drive(policy, k)
        for i in range(100, 130):
            drive(policy, i.to_bytes(8, "little"))
    assert all(k in arc for k in hot)
    assert not any(k in lru for k in hot)


@pytest.mark.parametrize("cls", [LRU, ARC])
def test_pinned_keys_are_never_evicted(cls):
    rng = random.Random(7)
    policy = cls(1000)
    pins: dict[bytes, int] = {}
    for step in range(5000):
        key = rng.randrange(60).to_bytes(8, "little")
        op = rng.random()
        if key in policy:
            if op < 0.3:
                policy.pin(key)
                pins[key] = pins.get(key, 0) + 1
            elif op < 0.6 and pins.get(key):
                policy.unpin(key)
                pins[key] -= 1
            elif op < 0.65 and not pins.get(key):
                policy.remove(key)
            else:
                policy.touch(key)
        else:
            size = rng.randrange(1, 200)
            victims = policy.admit(key, size)
            held = sum(policy.size_of(k) for k, n in pins.items() if n)
            if victims is None:
                assert held + size > 1000, step
                continue
            assert not any(pins.get(v) for v in victims), step
        live = [k for k in policy.order()]
        assert policy.used_bytes == sum(policy.size_of(k) for k in live) <= 1000
        assert policy.pinned_bytes == sum(policy.size_of(k) for k, n in pins.items() if n)


@pytest.mark.parametrize("cls", [LRU, ARC])
def test_admit_fails_cleanly_when_everything_is_pinned(cls):
    policy = cls(100)
    a, b = b"a" * 8, b"b" * 8
    assert policy.admit(a, 60) == []
    policy.pin(a)
    assert policy.admit(b, 50) is None  # only 40 unpinned bytes could be freed
    assert policy.order() == [a] and policy.used_bytes == 60
    assert policy.admit(b, 101) is None
    policy.unpin(a)
    assert policy.admit(b, 50) == [a]


def test_policy_errors_name_the_problem():
    policy = LRU(10)
    k = b"k" * 8
    with pytest.raises(ValueError, match="capacity_bytes"):
        LRU(0)
    with pytest.raises(ValueError, match="nbytes"):
        policy.admit(k, 0)
    policy.admit(k, 1)
    with pytest.raises(ValueError, match="already resident"):
        policy.admit(k, 1)
    with pytest.raises(ValueError, match="not pinned"):
        policy.unpin(k)
    policy.pin(k)
    with pytest.raises(ValueError, match="pinned"):
        policy.remove(k)
    with pytest.raises(ValueError, match="not resident"):
        policy.pin(b"x" * 8)
    with pytest.raises(ValueError, match="policy"):
        make_policy("fifo", 10)
    assert isinstance(make_policy("arc", 10), ARC)
