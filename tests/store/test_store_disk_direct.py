"""DiskTier O_DIRECT reads into the caller's memory: an aligned destination takes the payload
straight from the file (no payload-sized bounce buffer), an unaligned one through the bounce;
either way the bytes are verified where they landed, and a bad file is a miss."""

import mmap

import pytest

from kvtier.store import chunkfile
from kvtier.store.disk import DiskTier
from kvtier.store.header import ChunkHeader
from kvtier.store.payload import PAGE
from kvtier.store.tier import DestTooSmall

MIB = 1 << 20
POISON = 0xA5


def chunk(i: int, n: int):
    key = (900 + i).to_bytes(16, "little")
    payload = bytes((i * 13 + j * 7) % 253 for j in range(n))
    return key, ChunkHeader.for_payload(key, payload, (n,), "uint8", "flat"), payload


def direct_tier(root) -> DiskTier:
    tier = DiskTier(root, 8 * MIB, o_direct=True)
    if not tier.stats()["o_direct"]:
        pytest.skip("this filesystem refuses O_DIRECT")
    return tier


@pytest.fixture
def bounces(monkeypatch):
    """The sizes of the payload-sized bounce buffers reads and writes asked for."""
    sizes, real = [], chunkfile._STAGING.buffer
    monkeypatch.setattr(chunkfile._STAGING, "buffer", lambda n: sizes.append(n) or real(n))
    return sizes


class Slot:
    """Page-aligned poisoned memory, like a pool slot or an SGLang host page; ``offset`` moves
    the view off the alignment."""

    def __init__(self, nbytes: int, offset: int = 0) -> None:
        self._mem = mmap.mmap(-1, nbytes + offset + PAGE)
        self._mem.write(bytes([POISON]) * len(self._mem))
        self.view = memoryview(self._mem)[offset : offset + nbytes]

    def close(self) -> None:
        self.view.release()  # before the unmap: a live view would make close() raise
        self._mem.close()


@pytest.mark.parametrize("n", [16 * PAGE, 16 * PAGE + 123, 100, 0])
@pytest.mark.parametrize("room", [0, PAGE + 5])
def test_an_aligned_dest_is_read_in_place(tmp_path, bounces, n, room):
    tier = direct_tier(tmp_path)
    key, header, payload = chunk(1, n)
    assert tier.put(key, header, payload)
    bounces.clear()  # the put's copy of an unaligned bytes payload is not the read's business
    slot = Slot(n + room)
    try:
        assert tier.get_into(key, slot.view) == header
        assert bytes(slot.view[:n]) == payload
        assert bytes(slot.view[n:]) == bytes([POISON]) * room  # nothing past the payload written
        assert bounces == [] or n + room == 0  # straight into the slot (an empty one has no address)
    finally:
        slot.close()


@pytest.mark.parametrize("n", [16 * PAGE, 5000])
def test_an_unaligned_dest_goes_through_the_bounce(tmp_path, bounces, n):
    tier = direct_tier(tmp_path)
    key, header, payload = chunk(2, n)
    assert tier.put(key, header, payload)
    bounces.clear()
    slot = Slot(n, offset=1)
    try:
        assert tier.get_into(key, slot.view) == header and bytes(slot.view) == payload
        assert len(bounces) == 1 and bounces[0] >= PAGE + n
    finally:
        slot.close()


@pytest.mark.parametrize("where", ["first_page", "last_page", "tail"])
def test_a_flipped_payload_bit_read_in_place_is_a_miss(tmp_path, where):
    tier = direct_tier(tmp_path)
    n = 8 * PAGE + 300
    key, header, payload = chunk(3, n)
    assert tier.put(key, header, payload)
    path = tier.chunk_path(key)
    data = bytearray(path.read_bytes())
    data[PAGE + {"first_page": 0, "last_page": 8 * PAGE - 1, "tail": n - 1}[where]] ^= 0x10
    path.write_bytes(data)
    slot = Slot(n)
    try:
        assert tier.get_into(key, slot.view) is None  # the bytes in the slot are not to be used
        s = tier.stats()
        assert s["errors_corrupt"] == 1 and not tier.contains(key) and not path.exists()
    finally:
        slot.close()


def test_a_torn_file_read_in_place_is_a_miss(tmp_path):
    tier = direct_tier(tmp_path)
    n = 8 * PAGE
    key, header, payload = chunk(4, n)
    assert tier.put(key, header, payload)
    path = tier.chunk_path(key)
    path.write_bytes(path.read_bytes()[: PAGE + 3 * PAGE])  # a page-multiple file, too short
    slot = Slot(n)
    try:
        assert tier.get_into(key, slot.view) is None and tier.stats()["errors_corrupt"] == 1
    finally:
        slot.close()


def test_a_dest_too_small_is_raised_before_any_byte_lands(tmp_path):
    tier = direct_tier(tmp_path)
    key, header, payload = chunk(5, 4 * PAGE)
    assert tier.put(key, header, payload)
    slot = Slot(3 * PAGE)
    try:
        try:  # not pytest.raises: its kept traceback would hold a view of the slot past close
            tier.get_into(key, slot.view)
            pytest.fail("a dest too small must raise")
        except DestTooSmall:
            pass
        assert bytes(slot.view) == bytes([POISON]) * (3 * PAGE)
        assert tier.get_into(key, memoryview(bytearray(4 * PAGE))) == header  # the chunk stays
    finally:
        slot.close()


def test_an_unpadded_buffered_file_is_read_in_place(tmp_path):
    n = 5 * PAGE + 77
    key, header, payload = chunk(6, n)
    assert DiskTier(tmp_path, 8 * MIB).put(key, header, payload)  # buffered: not page-padded
    tier = direct_tier(tmp_path)
    assert tier.chunk_path(key).stat().st_size == PAGE + n
    slot = Slot(n)
    try:
        assert tier.get_into(key, slot.view) == header and bytes(slot.view) == payload
    finally:
        slot.close()
