"""DiskTier: hits and misses, restart, torn / corrupted files, capacity, pins, full disk, O_DIRECT."""

import errno
import os
import subprocess
import threading

import pytest

from kvtier.store import chunkfile
from kvtier.store.disk import DiskTier
from kvtier.store.disk_folder import MARKER
from kvtier.store.header import ChunkHeader
from kvtier.store.keys import KeyExtra, chunk_keys
from kvtier.store.metrics import StoreMetrics
from kvtier.store.payload import PAGE
from kvtier.store.tier import DestTooSmall, Tier

MIB = 1 << 20


def chunk(i: int, n: int = 5000):
    key = i.to_bytes(16, "little")
    payload = bytes((i * 31 + j) % 251 for j in range(n))
    return key, ChunkHeader.for_payload(key, payload, (n,), "uint8", "flat"), payload


def files(root):
    """The files the tier wrote: its marker aside."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MARKER)


def test_put_get_miss_present(tmp_path):
    tier = DiskTier(tmp_path, MIB)
    assert isinstance(tier, Tier)
    key, header, payload = chunk(1)
    assert tier.get(key) is None and not tier.contains(key)
    assert tier.put(key, header, payload)
    assert tier.put(key, header, payload)  # already held: nothing rewritten
    got = tier.get(key)
    assert got.header == header and bytes(got.payload) == payload
    dest = bytearray(len(payload) + 100)
    assert tier.get_into(key, dest) == header and dest[: len(payload)] == payload
    with pytest.raises(DestTooSmall):
        tier.get_into(key, bytearray(10))
    s = tier.stats()
    assert (s["hits"], s["misses"], s["puts"], s["puts_present"]) == (2, 1, 1, 1)
    assert s["entries"] == 1 and s["used_bytes"] == PAGE + len(payload) and s["pinned_bytes"] == 0
    assert tier.delete(key) and not tier.delete(key) and tier.get(key) is None and files(tmp_path) == []


def test_tensor_payload_and_get_into_a_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    tier = DiskTier(tmp_path, MIB)
    src = torch.randint(0, 256, (3000,), dtype=torch.uint8)
    key = b"t" * 16
    assert tier.put(key, ChunkHeader.for_payload(key, src, (3000,), "uint8", "flat"), src)
    dst = torch.zeros(4096, dtype=torch.uint8)
    assert tier.get_into(key, dst) is not None
    assert torch.equal(dst[:3000], src)


def test_another_model_or_layout_never_matches(tmp_path):
    tier = DiskTier(tmp_path, MIB)
    tokens = list(range(512))
    a = KeyExtra(model="llama-8b", kv_dtype="bfloat16", layout="vllm_flash")
    for key in chunk_keys(tokens, extra=a):
        assert tier.put(key, ChunkHeader.for_payload(key, b"kv" * 100, (200,), "uint8", "flat"), b"kv" * 100)
    assert all(tier.get(k) is not None for k in chunk_keys(tokens, extra=a))
    for other in (
        KeyExtra(model="llama-70b", kv_dtype="bfloat16", layout="vllm_flash"),
        KeyExtra(model="llama-8b", kv_dtype="fp8_e4m3", layout="vllm_flash"),
        KeyExtra(model="llama-8b", kv_dtype="bfloat16", layout="flashinfer_nhd"),
    ):
        assert all(tier.get(k) is None for k in chunk_keys(tokens, extra=other))


def test_files_survive_a_restart_with_lru_order(tmp_path):
    tier = DiskTier(tmp_path, MIB)
    chunks = [chunk(i) for i in range(5)]
    for key, header, payload in chunks:
        assert tier.put(key, header, payload)
    tier.get(chunks[0][0])  # a hit refreshes the file's mtime, so recency survives the restart
    order = tier.resident_keys()
    key, header, payload = chunks[1]
    leftover = tier.chunk_path(key).with_name(f".{key.hex()}.kvc.{'7' * 32}.tmp")
    leftover.write_bytes(header.pack() + b"half a chunk")  # a put killed mid-write
    tier.close()
    again = DiskTier(tmp_path, MIB)
    assert again.scan_removed == 1
    assert again.resident_keys() == order
    for key, _, payload in chunks:
        assert bytes(again.get(key).payload) == payload


@pytest.mark.parametrize("damage", ["truncate", "payload_bit", "empty", "header_bit", "foreign"])
def test_torn_or_corrupted_file_is_a_miss(tmp_path, damage):
    """A file whose header names its key is kvtier's and is removed; one whose header does not
    (emptied, flipped, another key's) is not provably kvtier's: left alone, counted."""
    tier = DiskTier(tmp_path, MIB)
    key, header, payload = chunk(3)
    tier.put(key, header, payload)
    path = files(tmp_path)[0]
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: PAGE + len(payload) // 2]
    elif damage == "payload_bit":
        data[PAGE + 777] ^= 0x04
    elif damage == "header_bit":
        data[30] ^= 0x01
    elif damage == "foreign":  # a whole, valid chunk — of another key — under this key's name
        k2, h2, p2 = chunk(4)
        data = bytearray(h2.pack().ljust(PAGE, b"\0") + p2)
    else:
        data = bytearray()
    path.write_bytes(data)
    assert tier.get(key) is None
    s = tier.stats()
    assert s["errors_corrupt"] == 1 and s["entries"] == 0 and s["used_bytes"] == 0
    assert not tier.contains(key)
    ours = damage in ("truncate", "payload_bit")
    assert files(tmp_path) == ([] if ours else [path]) and s["foreign_files"] == (0 if ours else 1)
    if ours:
        assert tier.put(key, header, payload) and bytes(tier.get(key).payload) == payload
    else:  # never overwritten: the put fails, the file keeps its bytes
        assert not tier.put(key, header, payload) and path.read_bytes() == data


def test_corrupt_header_found_at_restart_is_left_alone(tmp_path):
    tier = DiskTier(tmp_path, MIB)
    key, header, payload = chunk(5)
    tier.put(key, header, payload)
    path = files(tmp_path)[0]
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF
    path.write_bytes(data)
    tier.close()
    again = DiskTier(tmp_path, MIB)
    assert again.scan_removed == 0 and again.get(key) is None and files(tmp_path) == [path]
    assert again.stats()["foreign_files"] == 1 and path.read_bytes() == data


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_capacity_evicts_in_policy_order(tmp_path, policy):
    size = PAGE + 5000
    tier = DiskTier(tmp_path, 3 * size, policy=policy)
    c = [chunk(i) for i in range(4)]
    for key, header, payload in c[:3]:
        tier.put(key, header, payload)
    tier.get(c[0][0])
    tier.put(*c[3])
    assert not tier.contains(c[1][0])  # LRU: 1 is oldest; ARC: 1 is in T1 while 0 moved to T2
    assert all(tier.contains(c[i][0]) for i in (0, 2, 3))
    assert len(files(tmp_path)) == 3 and tier.stats()["evictions"] == 1
    big = chunk(9, n=4 * size)
    assert not tier.put(*big)  # larger than the tier: a failed put, counted as full
    assert tier.stats()["errors_full"] == 1


def test_nothing_is_evicted_while_a_read_holds_it(tmp_path, monkeypatch):
    size = PAGE + 5000
    tier = DiskTier(tmp_path, 2 * size)
    a, b, c = chunk(1), chunk(2), chunk(3)
    tier.put(*a)
    tier.put(*b)
    reading, release = threading.Event(), threading.Event()
    real_read = chunkfile.read_chunk_file

    def slow_read(*args):
        reading.set()
        assert release.wait(10)  # holds the read open so the put below runs during it
        return real_read(*args)

    monkeypatch.setattr("kvtier.store.disk.read_chunk_file", slow_read)
    result = []
    reader = threading.Thread(target=lambda: result.append(tier.get(a[0])))
    reader.start()
    assert reading.wait(10)  # the reader has pinned chunk a
    assert tier.stats()["pinned_bytes"] == size
    assert tier.put(*c)  # needs room: must evict b, the only unpinned chunk, not a
    assert tier.contains(a[0]) and not tier.contains(b[0])
    assert not tier.put(*chunk(4, n=6000))  # would need a's room too: refused, nothing evicted
    assert tier.contains(a[0]) and tier.contains(c[0])
    release.set()
    reader.join()  # the read must finish before its result is checked
    assert bytes(result[0].payload) == a[2]
    assert tier.stats()["pinned_bytes"] == 0


def test_delete_while_reading_waits_for_the_reader(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, MIB)
    a = chunk(1)
    tier.put(*a)
    reading, release = threading.Event(), threading.Event()
    real_read = chunkfile.read_chunk_file

    def slow_read(*args):
        reading.set()
        assert release.wait(10)  # keeps the file open while delete() runs
        return real_read(*args)

    monkeypatch.setattr("kvtier.store.disk.read_chunk_file", slow_read)
    result = []
    reader = threading.Thread(target=lambda: result.append(tier.get(a[0])))
    reader.start()
    assert reading.wait(10)  # the reader holds its pin before delete() runs
    assert tier.delete(a[0]) and not tier.contains(a[0]) and len(files(tmp_path)) == 1
    release.set()
    reader.join()  # only after the read completes may the file go
    assert bytes(result[0].payload) == a[2] and files(tmp_path) == []


def test_enospc_is_a_failed_put_and_trips_the_write_breaker(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, MIB, failure_threshold=2, cooldown_s=60)
    real_write = os.write

    def full_write(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_write)
    assert not tier.put(*chunk(1))
    assert not tier.put(*chunk(2))
    assert not tier.put(*chunk(3))  # skipped without touching the disk
    monkeypatch.setattr(os, "write", real_write)
    s = tier.stats()
    assert s["errors_full"] == 2 and s["errors_skipped"] == 1 and s["write_skipping"] == 1
    assert s["used_bytes"] == 0 and s["entries"] == 0 and files(tmp_path) == []


def test_read_errors_trip_the_read_breaker(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, MIB, failure_threshold=2, cooldown_s=60)
    a = chunk(1)
    tier.put(*a)

    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("kvtier.store.disk.read_chunk_file", eio)
    assert tier.get(a[0]) is None and tier.get(a[0]) is None and tier.get(a[0]) is None
    s = tier.stats()
    assert s["errors_error"] == 2 and s["errors_skipped"] == 1 and s["read_skipping"] == 1
    assert tier.contains(a[0])  # an IO error is not evidence the chunk is bad: it stays


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); ENOSPC is simulated elsewhere"
        )
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_disk(tiny_tmpfs):
    # The tier believes it has 10 MiB; the filesystem has 256 KiB: ENOSPC must be a miss.
    tier = DiskTier(tiny_tmpfs, 10 * MIB, o_direct=True)  # O_DIRECT where tmpfs takes it, else buffered
    results = [tier.put(*chunk(i, n=60_000)) for i in range(8)]
    assert results[0] and not all(results)
    s = tier.stats()
    assert s["errors_full"] >= 1 and s["entries"] == sum(results)
    assert not list(tiny_tmpfs.rglob("*.tmp"))
    for i, ok in enumerate(results):
        got = tier.get(chunk(i)[0])
        assert (got is not None) == ok and (got is None or bytes(got.payload) == chunk(i, n=60_000)[2])


def test_o_direct_round_trip(tmp_path):
    tier = DiskTier(tmp_path, MIB, o_direct=True)
    if not tier.stats()["o_direct"]:
        pytest.skip("this filesystem refuses O_DIRECT")
    key, header, payload = chunk(1, n=10_001)
    assert tier.put(key, header, payload)
    assert files(tmp_path)[0].stat().st_size % PAGE == 0
    assert bytes(tier.get(key).payload) == payload
    dest = bytearray(10_001)
    assert tier.get_into(key, dest) is not None and dest == payload
    tier.close()
    assert bytes(DiskTier(tmp_path, MIB).get(key).payload) == payload  # buffered reader, padded file


def test_metrics_and_bad_arguments(tmp_path):
    metrics = StoreMetrics()
    tier = DiskTier(tmp_path, MIB, metrics=metrics, name="nvme0")
    key, header, payload = chunk(1)
    tier.put(key, header, payload)
    tier.get(key)
    assert 'kvtier_tier_lookups_total{result="hit",tier="nvme0"} 1.0' in metrics.text().decode()
    with pytest.raises(ValueError, match="key"):
        tier.get(b"short")
    with pytest.raises(ValueError, match="header.key"):
        tier.put(b"x" * 16, header, payload)
    with pytest.raises(ValueError, match="payload"):
        tier.put(key, header, payload[:-1])
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskTier(tmp_path / "b", 0)


def test_pin_holds_a_chunk_from_lookup_to_load(tmp_path):
    size = PAGE + 5000
    tier = DiskTier(tmp_path, 2 * size)
    a, b, c = chunk(1), chunk(2), chunk(3)
    tier.put(*a)
    tier.put(*b)
    assert tier.pin(a[0]) and not tier.pin(c[0])
    assert tier.put(*c) and tier.contains(a[0]) and not tier.contains(b[0])  # b went, not pinned a
    assert tier.delete(a[0]) and not tier.contains(a[0]) and tier.get(a[0]) is None
    assert len(files(tmp_path)) == 2  # the pinned file stays until its unpin
    tier.unpin(a[0])
    assert len(files(tmp_path)) == 1 and tier.stats()["pinned_bytes"] == 0
    with pytest.raises(ValueError, match="not pinned"):
        tier.unpin(c[0])


def test_a_file_removed_behind_the_tiers_back_is_dropped(tmp_path):
    tier = DiskTier(tmp_path, MIB, failure_threshold=1)
    a, b = chunk(1), chunk(2)
    tier.put(*a)
    tier.put(*b)
    files(tmp_path)[0].unlink()
    results = [tier.get(a[0]), tier.get(b[0])]
    assert results.count(None) == 1 and tier.stats()["errors_corrupt"] == 1
    assert tier.stats()["read_skipping"] == 0  # not an IO failure: the tier stays in use


def test_o_direct_refused_falls_back_to_buffered_io(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.store.disk.o_direct_supported", lambda root: False)
    tier = DiskTier(tmp_path / "a", MIB, o_direct=True)
    assert tier.stats()["o_direct"] == 0
    assert tier.put(*chunk(1)) and bytes(tier.get(chunk(1)[0]).payload) == chunk(1)[2]


def test_o_direct_write_refused_midway_falls_back(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, MIB, o_direct=True)
    if not tier.stats()["o_direct"]:
        pytest.skip("this filesystem refuses O_DIRECT")
    real_write = chunkfile.write_temp

    def picky(path, head, view, o_direct, fsync, align=PAGE):
        if o_direct:  # e.g. a filesystem that opens O_DIRECT files but refuses the writes
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(path, head, view, o_direct, fsync, align)

    monkeypatch.setattr("kvtier.store.disk.write_temp", picky)
    key, header, payload = chunk(2)
    assert tier.put(key, header, payload)
    assert tier.stats()["o_direct"] == 0 and tier.stats()["put_failures"] == 0
    assert bytes(tier.get(key).payload) == payload
