"""KVStore with auth_keys over a real disk folder and a real redis-server: what a process without
the key plants is a miss counted ``forged`` and never loaded; sealed chunks load bit for bit;
keys rotate without a cold cache; a wrong key loads nothing; the key shows nowhere."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import kvtier
from kvtier.reference import gather_ref
from kvtier.store import KVStore, auth
from kvtier.store.auth import KeyRing
from kvtier.store.disk import DiskTier
from kvtier.store.header import ChunkHeader
from kvtier.store.metrics import StoreMetrics
from kvtier.store.redis_tier import RedisTier
from kvtier.store.redis_write import MANIFEST
from kvtier.store.throttle import MemoryTier

from store_redis_fixtures import redis_server  # noqa: F401  (a fixture)
from test_kvstore import BS, CT, Rig, toks

NEW, OLD, OTHER = "0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba98", "another tenants key 42"
EVIL = 0x5A  # every byte of the attacker's KV

# A process without the key: from public facts alone (model name, KV dtype and layout, the
# prompt's tokens) it derives the chunk keys and writes well-formed chunks with valid plain
# checksums, through kvtier's own tiers, as any keyless kvtier instance would.
ATTACKER = r"""
import json, sys
from kvtier.store.header import ChunkHeader
from kvtier.store.keys import KeyExtra, chunk_keys
a = json.loads(sys.argv[1])
extra = KeyExtra(a["model"], a["dtype"], a["layout"])
keys = chunk_keys(a["tokens"], a["chunk_tokens"], a["block_size"], extra=extra)
payload = bytes([a["byte"]]) * a["nbytes"]
shape, dtype, layout = tuple(a["shape"]), a["dtype"], a["layout"]
items = [(k, ChunkHeader.for_payload(k, payload, shape, dtype, layout), payload) for k in keys]
if a["disk"]:
    from kvtier.store.disk import DiskTier
    tier = DiskTier(a["disk"], 1 << 30, fsync=False)
else:
    from kvtier.store.redis_tier import RedisTier
    tier = RedisTier(url=a["redis"])
assert getattr(tier, "auth", None) is None and all(tier.put_many(items)), tier.stats()
tier.close()
"""


def plant(tokens, *, disk: Path | None = None, redis: str | None = None) -> None:
    fmt = Rig().store.fmt  # the model's chunk format: public (any instance of the model has it)
    args = dict(tokens=tokens, chunk_tokens=CT, block_size=BS, model="m", dtype=fmt.dtype, layout=fmt.layout)
    args |= dict(shape=list(fmt.shape), nbytes=fmt.nbytes, byte=EVIL, disk=disk and str(disk), redis=redis)
    env = {k: v for k, v in os.environ.items() if k != auth.ENV}
    env["PYTHONPATH"] = str(Path(kvtier.__file__).parents[1])
    subprocess.run([sys.executable, "-c", ATTACKER, json.dumps(args)], check=True, env=env, timeout=120)


def disk(path, **kw):
    return DiskTier(path, kw.pop("capacity", 1 << 20), fsync=False, **kw)


def redis(url, **kw):
    return RedisTier(url=url, timeout_s=5.0, **kw)


def blocks(r: Rig, ids) -> torch.Tensor:
    """The bytes of GPU blocks ``ids``, every layer."""
    return gather_ref(r.kv, list(ids)).view(torch.uint8).clone()


def load_into_poisoned(r: Rig, tokens, ids):
    """Load into poisoned blocks: the handle, and whether the blocks still hold only the poison."""
    r.poison(ids)
    before = blocks(r, ids)
    lh = r.store.load(tokens, ids)
    assert lh.wait(5)
    return lh, torch.equal(blocks(r, ids), before)


def save(r: Rig, tokens, ids) -> None:
    assert r.store.save(tokens, ids, after=r.write(tokens, ids)).wait_durable(5)
    r.store.evict()  # the host forgets them: the next load reads the lower tier


def test_without_a_key_a_planted_chunk_is_loaded_as_a_hit(tmp_path):
    """The threat: a keyless store loads what another process planted under a derivable key."""
    a = toks(1, 2 * CT)
    plant(a, disk=tmp_path)
    r = Rig(tiers=[disk(tmp_path)], auth_keys=None)
    try:
        lh, untouched = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == 2 * CT and not untouched
        assert bool((blocks(r, range(40, 44)) == EVIL).all())  # attention would run over it
    finally:
        r.close()


def test_disk_planted_chunks_are_forged_misses_and_heal_as_they_are_read(tmp_path):
    a = toks(2, 2 * CT)
    plant(a, disk=tmp_path)  # before the keyed instance starts: its scan indexes the files
    metrics = StoreMetrics()
    r = Rig(tiers=[disk(tmp_path, metrics=metrics)], auth_keys=[NEW], metrics=metrics)
    try:
        tier = r.store.tiers[0]
        assert tier.auth is not None and r.store.lookup(a).tiers == ("disk", "disk")  # a hint
        lh, untouched = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == 0 and untouched  # never loaded
        assert tier.stats()["errors_forged"] == 1 and not tier.chunk_path(r.store.keys(a)[0]).exists()
        assert 'kvtier_tier_errors_total{kind="forged",tier="disk"} 1.0' in r.store.metrics.text().decode()
        save(r, a, range(4))  # chunk 0 stored sealed; chunk 1's name still holds the planted file
        lh, _ = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == CT and r.check(a, range(40, 44), 1) and tier.stats()["errors_forged"] == 2
        save(r, a, range(4))
        lh, _ = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == 2 * CT and lh.tiers == ("disk", "disk") and r.check(a, range(40, 44), 2)
        for key in r.store.keys(a):  # sealed by the ring's key; no checksum besides the tag
            head = ChunkHeader.unpack(tier.chunk_path(key).read_bytes()[:4096])[0]
            assert head.seal.key_id == KeyRing([NEW]).key_ids[0] and head.algo == "none"
    finally:
        r.close()


@pytest.mark.redis
def test_redis_planted_chunks_are_forged_misses_dropped_and_stored_sealed(redis_server):  # noqa: F811
    a = toks(3, 2 * CT)
    plant(a, redis=redis_server.url)
    r = Rig(tiers=[redis(redis_server.url)], auth_keys=NEW)
    try:
        tier, keys = r.store.tiers[0], r.store.keys(a)
        assert r.store.lookup(a).tiers == ("redis", "redis")
        lh, untouched = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == 0 and untouched and tier.stats()["errors_forged"] == 1
        assert not tier.client.exists(tier.prefix + keys[0].hex())  # dropped: a put may store it sealed
        save(r, a, range(4))
        lh, _ = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == CT and r.check(a, range(40, 44), 1) and tier.stats()["errors_forged"] == 2
        save(r, a, range(4))
        lh, _ = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == 2 * CT and lh.tiers == ("redis", "redis") and r.check(a, range(40, 44), 2)
        for key in keys:
            rec = tier.client.get(tier.prefix + key.hex())
            assert ChunkHeader.unpack(rec[1 + MANIFEST.size :])[0].seal.key_id == KeyRing(NEW).key_ids[0]
    finally:
        r.close()


@pytest.mark.redis
def test_rotation_reads_old_chunks_and_writes_new_ones_under_the_new_key(redis_server):  # noqa: F811
    """Two instances on one Redis: one still seals with the old key, one rolled to the new."""
    a, b = toks(4, 2 * CT), toks(5, 2 * CT)
    old = Rig(tiers=[redis(redis_server.url)], auth_keys=[OLD])
    rolled = Rig(tiers=[redis(redis_server.url)], auth_keys=[NEW, OLD])
    new_only = Rig(tiers=[redis(redis_server.url)], auth_keys=[NEW])
    try:
        save(old, a, range(4))
        lh, _ = load_into_poisoned(rolled, a, range(40, 44))
        assert lh.tokens == 2 * CT and rolled.check(a, range(40, 44), 2)  # no cold cache
        save(rolled, b, range(4, 8))
        tier = rolled.store.tiers[0]
        for key in rolled.store.keys(b):
            rec = tier.client.get(tier.prefix + key.hex())
            assert ChunkHeader.unpack(rec[1 + MANIFEST.size :])[0].seal.key_id == KeyRing(NEW).key_ids[0]
        lh, _ = load_into_poisoned(new_only, b, range(40, 44))
        assert lh.tokens == 2 * CT and new_only.check(b, range(40, 44), 2)
        lh, untouched = load_into_poisoned(old, b, range(50, 54))  # not given the new key yet
        assert lh.tokens == 0 and untouched and old.store.stats()["redis"]["errors_forged"] == 1
    finally:
        for r in (old, rolled, new_only):
            r.close()


@pytest.mark.redis
@pytest.mark.parametrize("where", ["disk", "redis"])
def test_a_wrong_key_reads_nothing_as_a_hit(tmp_path, redis_server, where):  # noqa: F811
    def tier():
        return disk(tmp_path / "d") if where == "disk" else redis(redis_server.url)

    a = toks(6, 3 * CT)
    r = Rig(tiers=[tier()], auth_keys=[NEW], encrypt_chunks=True)
    save(r, a, range(6))
    r.close()
    r.store.tiers[0].close()
    w = Rig(tiers=[tier()], auth_keys=[OTHER])
    try:
        assert w.store.lookup(a).tokens == 3 * CT  # held, as a hint
        lh, untouched = load_into_poisoned(w, a, range(40, 46))
        assert lh.tokens == 0 and untouched and w.store.stats()[where]["errors_forged"] == 1
        assert w.store.stats()[where]["hits"] == 0
    finally:
        w.close()


def test_a_keyless_store_finds_sealed_chunks_unverifiable(tmp_path):
    a = toks(7, 2 * CT)
    r = Rig(tiers=[disk(tmp_path)], auth_keys=[NEW])
    save(r, a, range(4))
    r.close()
    r.store.tiers[0].close()
    k = Rig(tiers=[disk(tmp_path)])
    try:
        lh, untouched = load_into_poisoned(k, a, range(40, 44))
        assert lh.tokens == 0 and untouched and k.store.stats()["disk"]["errors_unverifiable"] == 1
    finally:
        k.close()


@pytest.mark.parametrize("o_direct", [False, True])
def test_encrypted_chunks_round_trip_and_store_no_plaintext(tmp_path, o_direct):
    a = toks(8, 2 * CT)
    r = Rig(tiers=[disk(tmp_path, o_direct=o_direct)], auth_keys=[NEW], encrypt_chunks=True)
    try:
        tier = r.store.tiers[0]
        assert tier.stats()["encrypted"] == 1
        save(r, a, range(4))
        kv = blocks(r, range(4)).reshape(-1)
        for key in r.store.keys(a):  # no 64-byte run of the chunk's KV is in its file
            data = tier.chunk_path(key).read_bytes()
            assert ChunkHeader.unpack(data)[0].encrypted
            assert all(bytes(kv[i : i + 64].numpy()) not in data for i in range(0, kv.numel(), 4096))
        lh, _ = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == 2 * CT and r.check(a, range(40, 44), 2)
    finally:
        r.close()
    tier.close()
    mac_only = Rig(tiers=[disk(tmp_path, o_direct=o_direct)], auth_keys=[NEW])  # same key, no encryption
    try:
        lh, _ = load_into_poisoned(mac_only, a, range(40, 44))
        assert lh.tokens == 2 * CT and mac_only.check(a, range(40, 44), 2)
    finally:
        mac_only.close()


@pytest.mark.redis
@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_chunks_round_trip_through_redis_parts(redis_server, encrypt):  # noqa: F811
    tier = redis(redis_server.url, part_bytes=4096, auth=KeyRing([NEW], encrypt=encrypt))
    chunks = {bytes([i]) * 16: os.urandom(4096 * 4 + 123 * i) for i in range(3)}  # several parts each
    items = [(k, ChunkHeader.for_payload(k, p, (len(p),), "uint8", "flat"), p) for k, p in chunks.items()]
    assert tier.put_many(items) == [True] * 3
    for key, payload in chunks.items():
        dest = bytearray(len(payload) + 7)
        assert tier.get_into(key, dest) == items[list(chunks).index(key)][1]  # as written: no seal
        assert bytes(dest[: len(payload)]) == payload and bytes(tier.get(key).payload) == payload
        parts = [
            v for name in tier.client.keys(tier.prefix + key.hex() + ":*") for v in [tier.client.get(name)]
        ]
        assert (
            len(parts) == -(-len(payload) // 4096) and (payload[:4096] in parts) != encrypt
        )  # ciphertext only, encrypted
    assert tier.stats()["hits"] == 6 and tier.stats()["errors_forged"] == 0
    tier.close()


def test_a_header_moved_onto_another_chunks_payload_on_disk_is_forged(tmp_path):
    a = toks(10, 2 * CT)
    r = Rig(tiers=[disk(tmp_path)], auth_keys=[NEW])
    try:
        tier = r.store.tiers[0]
        save(r, a, range(4))
        k0, k1 = (tier.chunk_path(k) for k in r.store.keys(a))
        swapped = k0.read_bytes()[:4096] + k1.read_bytes()[4096:]  # chunk 0's header, chunk 1's KV
        os.chmod(k0, 0o644)
        k0.write_bytes(swapped)
        lh, untouched = load_into_poisoned(r, a, range(40, 44))
        assert lh.tokens == 0 and untouched and tier.stats()["errors_forged"] == 1
    finally:
        r.close()


def test_the_store_gives_its_ring_to_tiers_built_without_one(tmp_path):
    ring = KeyRing([NEW])
    same = disk(tmp_path / "same", name="same", auth=KeyRing([NEW]))
    bare = disk(tmp_path / "bare")
    mem = MemoryTier()  # in this process only: nothing to seal
    r = Rig(tiers=[same, bare, mem], auth_keys=ring)
    try:
        assert bare.auth is ring and same.auth is not ring and not hasattr(mem, "auth")
        a = toks(12, CT)
        save(r, a, range(2))  # a tier that does not seal is among them: the chunk keeps its checksum
        assert ChunkHeader.unpack(bare.chunk_path(r.store.keys(a)[0]).read_bytes())[0].algo == "xxh3_64"
    finally:
        r.close()
    lone, other = disk(tmp_path / "lone"), disk(tmp_path / "other", name="disk2", auth=KeyRing([OTHER]))
    r = Rig()
    try:
        with pytest.raises(ValueError, match="tiers: disk2 was built with other keys"):
            KVStore(r.eng, "m", tiers=[lone, other], auth_keys=ring, chunk_tokens=CT)
        assert lone.auth is None  # refused before any tier was changed
        with pytest.raises(ValueError, match="auth must be a KeyRing"):
            DiskTier(tmp_path / "x", 1 << 20, auth=NEW)
    finally:
        r.close()


def test_unauthenticated_tiers_are_logged_once_per_process(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(auth.ENV, raising=False)
    monkeypatch.setattr(auth, "_noted", threading.Event())
    caplog.set_level(logging.WARNING, logger="kvtier.store.auth")
    keyed = Rig(tiers=[disk(tmp_path / "k")], auth_keys=[NEW])
    keyed.close()
    assert not caplog.records
    for i in range(2):
        Rig(tiers=[disk(tmp_path / f"p{i}")]).close()
    Rig().close()  # no lower tier: nothing to say
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["kvtier"]
    assert (
        "not authenticated" in caplog.records[0].getMessage() and auth.ENV in caplog.records[0].getMessage()
    )


def test_the_environment_variable_keys_every_store(tmp_path, monkeypatch):
    monkeypatch.setenv(auth.ENV, f"{NEW},{OLD}")
    r = Rig(tiers=[disk(tmp_path)])
    try:
        assert r.store.tiers[0].auth.key_ids == KeyRing([NEW, OLD]).key_ids
        assert r.store.config.auth_keys.key_ids == KeyRing([NEW, OLD]).key_ids
    finally:
        r.close()


@pytest.mark.redis
def test_no_key_in_reprs_stats_metrics_or_logs(tmp_path, redis_server, caplog):  # noqa: F811
    caplog.set_level(logging.DEBUG)
    a = toks(11, 2 * CT)
    plant(a, disk=tmp_path / "d")
    r = Rig(tiers=[disk(tmp_path / "d"), redis(redis_server.url)], auth_keys=[NEW, OLD], encrypt_chunks=True)
    w = Rig(tiers=[redis(redis_server.url, name="redis")], auth_keys=[OTHER])
    try:
        load_into_poisoned(r, a, range(40, 44))  # forged on disk
        save(r, a, range(4))
        load_into_poisoned(w, a, range(40, 44))  # forged under another key
        shown = [repr(r.store.config), str(r.store.config), json.dumps(r.store.stats(), default=str)]
        shown += [json.dumps(t.stats(), default=str) for t in r.store.tiers + w.store.tiers]
        shown += [
            r.store.metrics.text().decode(),
            w.store.metrics.text().decode(),
            repr(r.store.tiers[0].auth),
        ]
        shown += [rec.getMessage() for rec in caplog.records] + [str(rec.args) for rec in caplog.records]
        secrets = [NEW, OLD, OTHER] + [auth._master(k.encode()).hex() for k in (NEW, OLD, OTHER)]
        assert r.store.stats()["disk"]["errors_forged"] == 1
        assert not [s for s in secrets for text in shown if s in text]
    finally:
        r.close()
        w.close()
