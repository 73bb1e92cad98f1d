"""The key ring: sealed chunks open only under a key that sealed them, every header field and
payload byte is covered, keys rotate, and no key shows in a repr, an error or a log line."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from kvtier.store import auth
from kvtier.store.auth import ENV, TAG, KeyRing, Rejected, open_chunk
from kvtier.store.header import ChunkHeader, HeaderError, Seal

KEY = bytes(range(16))
NEW, OLD, OTHER = "a new key of 32 bytes...........", "the old key still read", "another tenants key....."
PAYLOAD = os.urandom(100_000)


def header(payload=PAYLOAD, group=0, key=KEY) -> ChunkHeader:
    return ChunkHeader.for_payload(key, payload, (2, 4, len(payload) // 8), "uint8", "flat", group=group)


def stored_copy(sealed: ChunkHeader, stored) -> memoryview:
    """The stored payload as a tier holds it before opening: an encrypted one with room for its tag."""
    buf = bytearray(stored.nbytes + (TAG if sealed.encrypted else 0))
    buf[: stored.nbytes] = stored
    return memoryview(buf)


def reopen(ring, sealed, stored, dest=None):
    """What a tier does: the packed header back, then `open_chunk` on the stored bytes."""
    back, _ = ChunkHeader.unpack(sealed.pack())
    return open_chunk(ring, back, stored_copy(back, stored), dest)


@pytest.mark.parametrize("encrypt", [False, True])
def test_sealed_chunk_round_trips_bit_exact(encrypt):
    ring = KeyRing([NEW], encrypt=encrypt)
    h = header(group=77)
    sealed, stored = ring.seal(h, memoryview(PAYLOAD))
    assert sealed.seal is not None and sealed.encrypted == encrypt and sealed.seal.key_id == ring.key_ids[0]
    packed = sealed.pack()
    assert packed[4:6] == (2).to_bytes(2, "little")  # version 2: a reader of version 1 refuses it
    dest = bytearray(len(PAYLOAD))
    got, payload = reopen(ring, sealed, stored, memoryview(dest))
    assert got == h and bytes(payload) == PAYLOAD  # the header as written: unmasked, unsealed
    assert (bytes(stored) == PAYLOAD) != encrypt  # encrypted: the stored bytes are not the KV
    assert sealed.checksum != h.checksum and sealed.group != h.group  # masked as stored


def test_an_encrypted_chunk_opens_into_a_new_buffer_and_under_a_ring_that_only_macs():
    sealed, stored = KeyRing([NEW], encrypt=True).seal(header(), memoryview(PAYLOAD))
    got, payload = reopen(KeyRing([NEW]), sealed, stored)
    assert got == header() and bytes(payload) == PAYLOAD


@pytest.mark.parametrize("encrypt", [False, True])
def test_any_flipped_payload_bit_is_forged(encrypt):
    ring = KeyRing([NEW], encrypt=encrypt)
    sealed, stored = ring.seal(header(), memoryview(PAYLOAD))
    for i in (0, 1, 4095, 4096, 50_000, len(PAYLOAD) - 1):
        bad = bytearray(stored)
        bad[i] ^= 0x01
        with pytest.raises(Rejected) as err:
            reopen(ring, sealed, memoryview(bad))
        assert err.value.kind == "forged"


@pytest.mark.parametrize(
    "change",
    [
        dict(key=bytes(range(1, 17))),
        dict(shape=(2, 4, 12_501)),
        dict(dtype="int8"),
        dict(layout="other"),
        dict(checksum=1),
        dict(group=1),
        dict(algo="crc32"),
    ],
)
def test_every_header_field_is_covered(change):
    """A header changed and re-packed (its CRC valid again): the tag no longer matches."""
    ring = KeyRing([NEW])
    sealed, stored = ring.seal(header(), memoryview(PAYLOAD))
    moved = dataclasses.replace(sealed, **change)
    with pytest.raises(Rejected) as err:
        reopen(ring, moved, stored)
    assert err.value.kind == "forged"


def test_a_header_moved_onto_another_chunks_payload_is_forged():
    ring = KeyRing([NEW])
    other = os.urandom(len(PAYLOAD))
    sealed_a, stored_a = ring.seal(header(), memoryview(PAYLOAD))
    sealed_b, stored_b = ring.seal(header(other), memoryview(other))
    for h, stored in ((sealed_a, stored_b), (sealed_b, stored_a)):
        with pytest.raises(Rejected, match="tag mismatch"):
            reopen(ring, h, stored)
    seal_b = sealed_b.seal  # a's header with b's seal: the salt makes another key, the tag fails
    with pytest.raises(Rejected, match="tag mismatch"):
        reopen(ring, dataclasses.replace(sealed_a, seal=seal_b), stored_a)


def test_rotation_old_chunks_open_new_ones_are_sealed_with_the_new_key():
    old, rolled = KeyRing([OLD]), KeyRing([NEW, OLD])
    sealed_old, stored_old = old.seal(header(), memoryview(PAYLOAD))
    assert reopen(rolled, sealed_old, stored_old)[0] == header()  # no cold cache after the roll
    sealed_new, stored_new = rolled.seal(header(), memoryview(PAYLOAD))
    assert sealed_new.seal.key_id == KeyRing([NEW]).key_ids[0] != old.key_ids[0]
    assert reopen(KeyRing([NEW]), sealed_new, stored_new)[0] == header()
    with pytest.raises(Rejected, match="does not hold"):
        reopen(old, sealed_new, stored_new)  # an instance not yet given the new key


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_wrong_key_opens_nothing(encrypt):
    sealed, stored = KeyRing([OTHER], encrypt=encrypt).seal(header(), memoryview(PAYLOAD))
    with pytest.raises(Rejected) as err:
        reopen(KeyRing([NEW, OLD]), sealed, stored)
    assert err.value.kind == "forged"
    # the same key id copied onto a seal made by a key the ring does not hold: the tag fails
    forged = dataclasses.replace(
        sealed, seal=dataclasses.replace(sealed.seal, key_id=KeyRing([NEW]).key_ids[0])
    )
    with pytest.raises(Rejected, match="tag mismatch"):
        reopen(KeyRing([NEW]), forged, stored)


def test_plain_and_sealed_chunks_across_rings():
    h = header()
    with pytest.raises(Rejected) as err:  # what a process without the key writes: valid checksum, no tag
        open_chunk(KeyRing([NEW]), h, memoryview(PAYLOAD), None)
    assert err.value.kind == "forged"
    sealed, stored = KeyRing([NEW]).seal(h, memoryview(PAYLOAD))
    with pytest.raises(Rejected) as err:  # a reader without keys cannot tell it from a forgery
        reopen(None, sealed, stored)
    assert err.value.kind == "unverifiable"
    assert open_chunk(None, h, memoryview(PAYLOAD), None) == (h, memoryview(PAYLOAD))  # plain, as before
    bad = bytearray(PAYLOAD)
    bad[7] ^= 4
    with pytest.raises(Rejected) as err:
        open_chunk(None, h, memoryview(bad), None)
    assert err.value.kind == "corrupt"


@pytest.mark.parametrize("group", [0, 5])
def test_sealed_header_any_flipped_bit_or_truncation_is_caught(group):
    sealed, _ = KeyRing([NEW], encrypt=True).seal(header(group=group), memoryview(PAYLOAD))
    packed = sealed.pack()
    assert ChunkHeader.unpack(packed + b"payload")[0] == sealed
    for i in range(len(packed)):
        bad = bytearray(packed)
        bad[i] ^= 0x80
        with pytest.raises(HeaderError):
            ChunkHeader.unpack(bad)
    for cut in range(len(packed)):
        with pytest.raises(HeaderError):
            ChunkHeader.unpack(packed[:cut])


def test_a_sealed_header_read_as_version_1_does_not_parse():
    """The layout of version 2 under a version 1 label (CRC made valid): no field misread."""
    import zlib

    sealed, _ = KeyRing([NEW]).seal(header(), memoryview(PAYLOAD))
    head = bytearray(sealed.pack()[:-4])
    head[4:6] = (1).to_bytes(2, "little")
    head[7] = 0  # flags: none in version 1
    with pytest.raises(HeaderError):
        ChunkHeader.unpack(bytes(head) + zlib.crc32(head).to_bytes(4, "little"))


def test_seal_fields_are_checked():
    for kw, name in ((dict(key_id=b"x"), "key_id"), (dict(salt=b"x" * 15), "salt"), (dict(tag=None), "tag")):
        fields = dict(key_id=b"k" * 8, salt=b"s" * 16, tag=b"t" * 16) | kw
        with pytest.raises(ValueError, match=name):
            Seal(**fields)
    with pytest.raises(ValueError, match="seal"):
        ChunkHeader(KEY, (1,), "uint8", "flat", 1, 0, seal="yes")


# -- keys as an operator gives them ---------------------------------------------------------------


def test_keys_parse_and_rotate_by_order():
    assert KeyRing(f"{NEW},{OLD}").key_ids == KeyRing([NEW, OLD]).key_ids
    assert KeyRing([NEW.encode(), OLD]).key_ids == KeyRing([NEW, OLD]).key_ids
    assert KeyRing([NEW, OLD]).key_ids[0] == KeyRing([NEW]).key_ids[0] != KeyRing([OLD, NEW]).key_ids[0]


@pytest.mark.parametrize("keys", [["tooweak"], [NEW, "xq7"], [NEW, NEW], [], [3], "", "a,b"])
def test_bad_keys_name_the_setting_never_the_key(keys):
    with pytest.raises(ValueError) as err:
        KeyRing(keys, name="extra_config['auth_keys']")
    msg = str(err.value)
    assert "extra_config['auth_keys']" in msg
    for k in (NEW, "tooweak", "xq7"):
        assert k not in msg


def test_resolve_takes_the_setting_then_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert KeyRing.resolve(None) is None and KeyRing.resolve([]) is None
    with pytest.raises(ValueError, match=ENV):
        KeyRing.resolve(None, encrypt=True)
    monkeypatch.setenv(ENV, f" {NEW} , {OLD} ")
    assert KeyRing.resolve(None).key_ids == KeyRing([NEW, OLD]).key_ids
    assert KeyRing.resolve([OTHER]).key_ids == KeyRing([OTHER]).key_ids  # a setting wins
    ring = KeyRing([OTHER], encrypt=True)
    assert KeyRing.resolve(ring) is ring
    monkeypatch.setenv(ENV, f"{NEW},short")
    with pytest.raises(ValueError) as err:
        KeyRing.resolve(None)
    assert ENV in str(err.value) and NEW not in str(err.value)


def test_no_key_in_repr_str_or_logs(caplog):
    caplog.set_level(logging.DEBUG)
    ring = KeyRing([NEW, OLD], encrypt=True)
    sealed, stored = ring.seal(header(), memoryview(PAYLOAD))
    reopen(ring, sealed, stored)
    with pytest.raises(Rejected) as err:
        reopen(KeyRing([OTHER]), sealed, stored)
    secrets = [NEW, OLD, OTHER] + [auth._master(k.encode()).hex() for k in (NEW, OLD, OTHER)]
    shown = [repr(ring), str(ring), str(err.value), repr(sealed)] + [r.getMessage() for r in caplog.records]
    assert not [s for s in secrets for text in shown if s in text]
    assert repr(ring) == f"KeyRing(2 keys, seals with key id {ring.key_ids[0].hex()}, encrypt=True)"


def test_a_payload_the_aead_cannot_take_is_refused():
    class Big:  # a view that claims more bytes than one AEAD message holds
        nbytes = auth.MAX_PAYLOAD + 1

    with pytest.raises(ValueError, match="at most"):
        KeyRing([NEW]).seal(header(), Big())


def test_a_chunk_without_checksum_is_only_for_a_tier_that_seals_it(tmp_path):
    """algo "none": the store's writer skips the checksum where every tier seals (the tag covers
    the payload); a plain header without one never packs, parses or verifies."""
    from kvtier.store.disk import DiskTier

    bare = ChunkHeader.for_payload(KEY, PAYLOAD, (len(PAYLOAD),), "uint8", "flat", algo="none")
    assert bare.checksum == 0 and not bare.verify(PAYLOAD)
    with pytest.raises(ValueError, match="needs a checksum"):
        bare.pack()
    plain = bytearray(header().pack())
    plain[6] = 0  # algo 0 in a version 1 header, CRC made valid again
    import zlib

    plain[-4:] = zlib.crc32(plain[:-4]).to_bytes(4, "little")
    with pytest.raises(HeaderError):
        ChunkHeader.unpack(bytes(plain))
    with pytest.raises(ValueError, match="algo 'none'"):
        DiskTier(tmp_path / "plain", 1 << 20).put(KEY, bare, PAYLOAD)
    tier = DiskTier(tmp_path / "sealed", 1 << 20, auth=KeyRing([NEW]))
    assert tier.put(KEY, bare, PAYLOAD)
    got = tier.get(KEY)
    assert got.header == bare and bytes(got.payload) == PAYLOAD
    bad = bytearray(tier.chunk_path(KEY).read_bytes())
    bad[-1] ^= 1  # the tag alone guards the payload
    os.chmod(tier.chunk_path(KEY), 0o644)
    tier.chunk_path(KEY).write_bytes(bytes(bad))
    tier.close()
    tier = DiskTier(tmp_path / "sealed", 1 << 20, auth=KeyRing([NEW]))
    assert tier.get(KEY) is None and tier.stats()["errors_forged"] == 1
    tier.close()
