"""DiskTier folders shared by processes or ranks: one writer per folder, readers that see the
writer's new files and remove nothing, ``contains`` checked against the files, and a folder
removed under a running writer made again."""

import os
import shutil
import subprocess
import sys

import pytest

from kvtier.store.disk import DiskTier
from kvtier.store.disk_folder import MARKER
from kvtier.store.header import ChunkHeader
from kvtier.store.payload import PAGE

MIB = 1 << 20
SIZE = PAGE + 5000


def chunk(i: int, n: int = 5000):
    key = (0x20 + i).to_bytes(16, "little")  # key i in the two-letter folder f"{0x20 + i:02x}"
    payload = bytes((i * 17 + j) % 249 for j in range(n))
    return key, ChunkHeader.for_payload(key, payload, (n,), "uint8", "flat"), payload


def intact(tier, i: int) -> bool:
    dest = bytearray(5000)
    return tier.get_into(chunk(i)[0], dest) is not None and bytes(dest) == chunk(i)[2]


def test_one_writer_per_folder(tmp_path):
    w = DiskTier(tmp_path, MIB, space="tp0")
    with pytest.raises(ValueError, match=r"disk_path: '.*/tp0' is in use by another kvtier disk tier"):
        DiskTier(tmp_path, MIB, space="tp0", label="disk_path")
    code = f"from kvtier.store.disk import DiskTier; DiskTier({str(tmp_path)!r}, 1 << 20, space='tp0')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert other.returncode != 0 and "is in use by another kvtier disk tier" in other.stderr
    DiskTier(tmp_path, MIB, space="tp1").close()  # another rank's folder
    reader = DiskTier(tmp_path, MIB, space="tp0", writer=False)
    w.put(*chunk(0))
    w.close()
    again = DiskTier(tmp_path, MIB, space="tp0")  # the folder's next writer
    assert again.contains(chunk(0)[0]) and reader.contains(chunk(0)[0])


def test_a_reader_sees_the_writers_new_files_and_removes_nothing(tmp_path):
    reader = DiskTier(tmp_path, MIB, space="mla", writer=False)  # starts before its writer
    assert not (tmp_path / "mla").exists()  # a reader makes nothing in the writer's folder
    writer = DiskTier(tmp_path, 3 * SIZE, space="mla")
    assert [writer.put(*chunk(i)) for i in range(3)] == [True] * 3
    keys = [chunk(i)[0] for i in range(4)]
    assert reader.contains_many(keys) == [True, True, True, False]  # written after the reader's start
    assert all(intact(reader, i) for i in range(3))
    assert writer.put(*chunk(3))  # evicts chunk 0
    assert reader.contains_many(keys) == [False, True, True, True] and intact(reader, 3)
    assert reader.get(keys[0]) is None
    assert reader.stats()["writer"] == 0 and reader.stats()["evictions"] == 0

    # A reader writes, evicts and deletes nothing, even a corrupt file: the writer's to judge.
    files = sorted(p for p in (tmp_path / "mla").rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    assert not reader.put(*chunk(9)) and not reader.delete(keys[1])
    path = writer.chunk_path(keys[2])
    data = bytearray(path.read_bytes())
    data[PAGE + 10] ^= 1
    path.write_bytes(data)
    before[path] = bytes(data)
    assert not intact(reader, 2) and reader.stats()["errors_corrupt"] == 1
    reader.close()
    reread = DiskTier(tmp_path, MIB, space="mla", writer=False)  # a reader's restart scan
    assert sorted(reread.resident_keys()) == sorted(keys[1:])
    assert {p: p.read_bytes() for p in files} == before
    assert not intact(writer, 2) and not path.exists()  # the writer removes its own corrupt chunk


def test_contains_asks_the_filesystem(tmp_path):
    tier = DiskTier(tmp_path, MIB)
    for i in range(5):
        assert tier.put(*chunk(i))
    os.unlink(tier.chunk_path(chunk(1)[0]))  # an operator, or another process
    shutil.rmtree(tier.chunk_path(chunk(3)[0]).parent)
    keys = [chunk(i)[0] for i in range(5)]
    held = [tier.chunk_path(k).exists() for k in keys]
    assert held == [True, False, True, False, True] and tier.contains_many(keys) == held
    assert tier.contains(keys[0]) == held[0] and not tier.contains(keys[1])
    assert tier.stats()["entries"] == sum(held) and sorted(tier.resident_keys()) == sorted(
        k for k, h in zip(keys, held, strict=True) if h
    )
    assert tier.put(*chunk(1)) and tier.put(*chunk(3))  # stored again, not "already held"
    assert all(intact(tier, i) for i in range(5)) and tier.stats()["puts"] == 7


@pytest.mark.parametrize("space", [None, "tp0"])
def test_a_removed_folder_is_made_again(tmp_path, space):
    root, kw = tmp_path / "kv", {} if space is None else {"space": space}
    tier = DiskTier(root, MIB, **kw)
    assert tier.put(*chunk(0)) and tier.put(*chunk(1))
    shutil.rmtree(root)
    assert tier.put(*chunk(0))  # held before: written again, not reported held
    assert tier.chunk_path(chunk(0)[0]).is_file() and intact(tier, 0)
    assert (root / MARKER).is_file() and (tier.folder / MARKER).is_file()
    assert tier.put(*chunk(2)) and intact(tier, 2) and not tier.contains(chunk(1)[0])
    assert tier.stats()["entries"] == 2
    tier.close()
    assert sorted(DiskTier(root, MIB, **kw).resident_keys()) == sorted([chunk(0)[0], chunk(2)[0]])


def test_a_removed_marker_is_written_again(tmp_path):
    tier = DiskTier(tmp_path, MIB)
    assert tier.put(*chunk(0))
    (tmp_path / MARKER).unlink()
    assert tier.put(*chunk(1)) and (tmp_path / MARKER).is_file()
    assert intact(tier, 0) and intact(tier, 1)  # the same folder: its chunks are still kvtier's
    with pytest.raises(ValueError, match="in use"):
        DiskTier(tmp_path, MIB)  # the new marker is locked too


def test_a_folder_replaced_by_a_users_is_left_alone(tmp_path):
    root = tmp_path / "kv"
    tier = DiskTier(root, MIB, failure_threshold=1)
    assert tier.put(*chunk(0))
    shutil.rmtree(root)
    root.mkdir()
    (root / "thesis.tex").write_text("my thesis")
    assert not tier.put(*chunk(1)) and not tier.put(*chunk(0))
    assert sorted(os.listdir(root)) == ["thesis.tex"] and (root / "thesis.tex").read_text() == "my thesis"
    assert not tier.contains(chunk(0)[0]) and tier.stats()["put_failures"] == 2
