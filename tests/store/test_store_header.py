"""Chunk header: round trip, and every torn or flipped byte is caught before it is trusted."""

import os

import pytest

from kvtier.store.header import ChunkHeader, HeaderError, payload_checksum
from kvtier.store.payload import as_view

KEY = bytes(range(16))
PAYLOAD = os.urandom(10_000)


def make(algo="xxh3_64"):
    return ChunkHeader.for_payload(KEY, PAYLOAD, (2, 4, 16, 8, 64), "bfloat16", "vllm_flash", algo=algo)


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32"])
def test_round_trip(algo):
    h = make(algo)
    packed = h.pack()
    back, n = ChunkHeader.unpack(packed + b"trailing payload")
    assert back == h and n == len(packed)
    assert h.verify(PAYLOAD)
    assert h.payload_len == len(PAYLOAD)


def test_group_round_trips_and_no_group_packs_as_before():
    h = make()
    g = ChunkHeader.for_payload(KEY, PAYLOAD, h.shape, h.dtype, h.layout, group=2**64 - 1)
    packed = g.pack()
    assert len(packed) == len(h.pack()) + 8 and ChunkHeader.unpack(packed)[0] == g
    assert ChunkHeader.unpack(h.pack())[0].group == 0  # a header without a group reads as before
    for bad in (-1, 2**64, True, 1.0):
        with pytest.raises(ValueError, match="group"):
            ChunkHeader.for_payload(KEY, PAYLOAD, h.shape, h.dtype, h.layout, group=bad)


@pytest.mark.parametrize("group", [0, 12345])
def test_any_flipped_bit_or_truncation_is_detected(group):
    packed = ChunkHeader.for_payload(KEY, PAYLOAD, (2, 4), "bfloat16", "vllm_flash", group=group).pack()
    for i in range(len(packed)):
        for bit in (0, 7):
            bad = bytearray(packed)
            bad[i] ^= 1 << bit
            with pytest.raises(HeaderError):
                ChunkHeader.unpack(bad)
    for cut in range(len(packed)):
        with pytest.raises(HeaderError):
            ChunkHeader.unpack(packed[:cut])


def test_payload_damage_fails_verify():
    h = make()
    bad = bytearray(PAYLOAD)
    bad[1234] ^= 0x10
    assert not h.verify(bad)
    assert not h.verify(PAYLOAD[:-1])


def test_tensor_payload_is_viewed_without_copy():
    torch = pytest.importorskip("torch")
    t = torch.frombuffer(bytearray(PAYLOAD), dtype=torch.uint8)
    view = as_view(t)
    assert view.nbytes == len(PAYLOAD) and bytes(view) == PAYLOAD
    t[0] ^= 1  # shares memory with the tensor
    assert view[0] == PAYLOAD[0] ^ 1
    assert payload_checksum(t) != payload_checksum(PAYLOAD)
    with pytest.raises(ValueError, match="uint8"):
        as_view(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        as_view(torch.zeros(4, 4, dtype=torch.uint8).t())


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(key=b"short"), "key"),
        (dict(shape=[1, 2]), "shape"),
        (dict(shape=(-1,)), "shape"),
        (dict(dtype=""), "dtype"),
        (dict(layout="x" * 300), "layout"),
        (dict(payload_len=-1), "payload_len"),
        (dict(checksum=2**64), "checksum"),
        (dict(algo="md5"), "algo"),
    ],
)
def test_bad_fields_name_themselves(kwargs, name):
    fields = dict(key=KEY, shape=(1,), dtype="uint8", layout="flat", payload_len=1, checksum=0)
    with pytest.raises(ValueError, match=name):
        ChunkHeader(**{**fields, **kwargs})
