"""DiskTier never deletes, truncates or overwrites a file it did not write: it works only in a
folder it created (or found empty) and marked, refuses any other, and inside its own folder
leaves every foreign file alone, byte for byte, through puts, evictions, deletes, restart scans
and a capacity shrink; no symlink is followed out of it."""

import hashlib
import json
import logging
import os
import threading

import pytest

from kvtier.store.disk import DiskTier
from kvtier.store.disk_folder import MARKER
from kvtier.store.header import ChunkHeader
from kvtier.store.payload import PAGE

MIB = 1 << 20
SIZE = PAGE + 5000  # one chunk's file


def chunk(i: int, n: int = 5000):
    key = i.to_bytes(16, "little")  # key i lives in the two-letter folder f"{i:02x}"
    payload = bytes((i * 31 + j) % 251 for j in range(n))
    return key, ChunkHeader.for_payload(key, payload, (n,), "uint8", "flat"), payload


def name(i: int) -> str:
    return chunk(i)[0].hex() + ".kvc"


def snapshot(paths) -> dict:
    """What each path is, without following a symlink: a file's bytes (hashed) and mode, a
    link's target, a folder's mode."""
    out = {}
    for p in paths:
        st = os.lstat(p)
        if os.path.islink(p):
            out[str(p)] = ("link", os.readlink(p))
        elif os.path.isdir(p):
            out[str(p)] = ("dir", st.st_mode)
        else:
            out[str(p)] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mode)
    return out


def tree(root) -> list:
    return sorted([root, *root.rglob("*")])  # rglob lists a symlink but does not descend into it


def outside_world(tmp_path):
    """Files outside any kvtier folder that symlinks inside point to: valid kvtier chunks of
    keys 2 and 5 (a tier that followed a link would take them for its own) and plain files."""
    out = tmp_path / "outside"
    maker = DiskTier(tmp_path / "maker", MIB)
    for i in (2, 5):
        maker.put(*chunk(i))
    (out / "dir").mkdir(parents=True)
    (out / "chunk2.kvc").write_bytes(maker.chunk_path(chunk(2)[0]).read_bytes())
    (out / "dir" / name(5)).write_bytes(maker.chunk_path(chunk(5)[0]).read_bytes())
    (out / "dir" / "photo.jpg").write_bytes(os.urandom(3000))
    maker.close()
    return out


def plant(folder, outside) -> list:
    """A user's files of every shape, in ``folder``; the paths planted."""
    other_key = chunk(9)
    files = {
        "ab/notes.txt": b"my notes",
        "db/users.sqlite": os.urandom(10_000),
        f"01/{name(1)}": b"not a chunk, under key 1's name" * 50,  # a name kvtier will want
        f"03/{name(3)}": other_key[1].pack().ljust(PAGE, b"\0") + other_key[2],  # another key's chunk
        f"01/.{name(1)}.{'e' * 32}.tmp": b"temp-file name, foreign bytes",
        "01/.leftover.tmp": b"",
        "03/readonly.bin": b"read only",
        "0a/" + "0a" * 16 + ".kvc": os.urandom(5000),
        "nested/deeper/ab/" + name(0xAB): os.urandom(2000),
        "cafe.kvc": b"hex-looking, top level",
        "0123456789abcdef0123456789abcdef.tmp": b"",
        f".odirect.{'c' * 32}.tmp": b"",
    }
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    (folder / "03/readonly.bin").chmod(0o444)
    (folder / "ee").mkdir()  # an empty two-letter folder
    (folder / "02").mkdir(exist_ok=True)
    (folder / "02" / name(2)).symlink_to(outside / "chunk2.kvc")  # a link under key 2's name
    (folder / "05").symlink_to(outside / "dir", target_is_directory=True)  # key 5's folder, a link
    (folder / "link-out").symlink_to(outside)
    return sorted(
        {folder / rel for rel in files}
        | {
            folder / rel
            for rel in ("ab", "db", "03", "0a", "nested", "ee", "02", "02/" + name(2), "05", "link-out")
        }
    )


def test_a_folder_of_user_files_is_refused_untouched(tmp_path):
    outside = outside_world(tmp_path)
    user = tmp_path / "user"
    user.mkdir()
    plant(user, outside)
    before, world = snapshot(tree(user)), snapshot(tree(outside))
    for kw in ({}, {"space": "tp0"}, {"writer": False, "space": "tp0"}, {"o_direct": True}):
        with pytest.raises(ValueError, match=r"root '.*/user' is not empty and has no kvtier-disk\.json"):
            DiskTier(user, MIB, **kw)
    with pytest.raises(ValueError, match=r"^extra_config\['disk_path'\] '.*/user' is not empty"):
        DiskTier(user, MIB, label="extra_config['disk_path']")
    assert snapshot(tree(user)) == before and snapshot(tree(outside)) == world  # not even a marker


def test_a_file_or_a_foreign_marker_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"data")
    with pytest.raises(ValueError, match="disk_path '.*/file' is not a folder"):
        DiskTier(f, MIB, label="disk_path")
    with pytest.raises(ValueError, match="disk_path '.*/file/kv' is not a folder"):
        DiskTier(f / "kv", MIB, label="disk_path")
    assert f.read_bytes() == b"data"
    other = tmp_path / "other"
    other.mkdir()
    (other / MARKER).write_text("{}")
    with pytest.raises(ValueError, match="not kvtier's marker"):
        DiskTier(other, MIB)
    (other / MARKER).write_text(json.dumps({"format": "kvtier-disk", "version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        DiskTier(other, MIB)
    assert sorted(os.listdir(other)) == [MARKER]


def test_a_kvtier_folder_without_its_marker_is_refused(tmp_path):
    """A folder of kvtier chunks without the marker (an older kvtier's) is not provably
    kvtier's: refused, every file kept."""
    tier = DiskTier(tmp_path / "kv", MIB)
    for i in range(3):
        tier.put(*chunk(i))
    tier.close()
    (tmp_path / "kv" / MARKER).unlink()
    before = snapshot(tree(tmp_path / "kv"))
    with pytest.raises(ValueError, match="not empty and has no kvtier-disk.json"):
        DiskTier(tmp_path / "kv", MIB)
    assert snapshot(tree(tmp_path / "kv")) == before


def test_a_new_or_empty_folder_is_marked(tmp_path):
    DiskTier(tmp_path / "a" / "b", MIB, space="tp0").close()  # made, parents too
    (tmp_path / "mnt" / "lost+found").mkdir(parents=True)  # a fresh filesystem's mount point
    DiskTier(tmp_path / "mnt", MIB).close()
    for folder in (tmp_path / "a" / "b", tmp_path / "a" / "b" / "tp0", tmp_path / "mnt"):
        assert json.loads((folder / MARKER).read_text()) == {"format": "kvtier-disk", "version": 1}
    with pytest.raises(ValueError, match="space must be a folder name"):
        DiskTier(tmp_path / "c", MIB, space="ab")  # two hex digits: a chunk folder's name
    with pytest.raises(ValueError, match="space must be a folder name"):
        DiskTier(tmp_path / "c", MIB, space="../escape")
    assert not (tmp_path / "c").exists()


def test_ranks_starting_together_all_claim_one_new_folder(tmp_path):
    root, errors, tiers = tmp_path / "kv", [], []
    start = threading.Barrier(8)

    def rank(r):
        start.wait()  # all at once: none may take another's half-made folder for a user's
        try:
            tiers.append(DiskTier(root, MIB, space=f"tp{r}of8"))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # every construction has returned or raised
    assert errors == [] and len(tiers) == 8
    assert sorted(os.listdir(root)) == sorted([MARKER] + [f"tp{r}of8" for r in range(8)])


def test_foreign_files_inside_the_folder_are_never_touched(tmp_path, caplog):
    outside = outside_world(tmp_path)
    root = tmp_path / "kv"
    tier = DiskTier(root, 4 * SIZE)
    assert tier.put(*chunk(4))
    planted = plant(root, outside)
    own_leftover = tier.chunk_path(chunk(6)[0]).parent / f".{name(6)}.{'7' * 32}.tmp"
    own_leftover.parent.mkdir(exist_ok=True)
    own_leftover.write_bytes(chunk(6)[1].pack() + b"a put that died")  # kvtier's: name and header
    before, world = snapshot(planted), snapshot(tree(outside))

    def untouched():
        assert snapshot(planted) == before and snapshot(tree(outside)) == world

    tier.close()
    with caplog.at_level(logging.WARNING, logger="kvtier.store.disk"):
        tier = DiskTier(root, 4 * SIZE)  # the restart scan
    untouched()
    assert tier.scan_removed == 1 and not own_leftover.exists()
    assert tier.resident_keys() == [chunk(4)[0]]
    foreign = tier.stats()["foreign_files"]
    assert foreign >= 12
    assert sum("left alone" in r.getMessage() for r in caplog.records) == 1  # logged once, then counted

    # Puts that evict, into folders holding foreign files; names held by them are refused.
    results = {i: tier.put(*chunk(i)) for i in range(12)}
    untouched()
    # Their names are held: 1 by foreign bytes, 2 by a link, 3 by another key's chunk; 5's folder is a link.
    assert [i for i, ok in results.items() if not ok] == [1, 2, 3, 5]
    assert tier.stats()["evictions"] > 0 and tier.stats()["used_bytes"] <= 4 * SIZE
    for i in (1, 2, 3, 5):
        assert not tier.contains(chunk(i)[0]) and tier.get(chunk(i)[0]) is None
    for key in tier.resident_keys():
        assert bytes(tier.get(key).payload) == chunk(int.from_bytes(key, "little"))[2]
    untouched()

    # Deletes, then a restart, then a restart into a smaller capacity (evictions at the scan).
    for key in tier.resident_keys()[:2]:
        assert tier.delete(key)
    untouched()
    for i in range(20, 26):
        tier.put(*chunk(i))
    held = tier.resident_keys()
    tier.close()
    tier = DiskTier(root, 4 * SIZE)
    assert tier.resident_keys() == held
    tier.close()
    tier = DiskTier(root, SIZE)
    assert tier.resident_keys() == held[-1:] and tier.stats()["used_bytes"] == SIZE
    untouched()
    assert tier.stats()["foreign_files"] == foreign


def test_no_symlink_is_followed_for_reading(tmp_path):
    """A link under a chunk's name, or a chunk folder that is a link, pointing at valid
    kvtier chunks outside: never read, by the writer or by a reader of the folder."""
    outside = outside_world(tmp_path)
    root = tmp_path / "kv"
    writer = DiskTier(root, MIB, space="w")
    reader = DiskTier(root, MIB, space="w", writer=False)
    (writer.folder / "02").mkdir()
    (writer.folder / "02" / name(2)).symlink_to(outside / "chunk2.kvc")
    (writer.folder / "05").symlink_to(outside / "dir", target_is_directory=True)
    for tier in (writer, reader):
        for i in (2, 5):
            assert not tier.contains(chunk(i)[0]) and tier.get(chunk(i)[0]) is None
            assert tier.get_into(chunk(i)[0], bytearray(6000)) is None
    assert reader.contains_many([chunk(2)[0], chunk(5)[0]]) == [False, False]
    writer.close()
    again = DiskTier(root, MIB, space="w")
    assert again.resident_keys() == [] and again.stats()["foreign_files"] == 2
