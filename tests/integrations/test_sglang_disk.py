"""SGLang's HiCache over kvtier's disk tier when every rank is given the same ``disk_path``:
each rank is a backend built by SGLang's dynamic factory over SGLang's real host pools (several
in one process stand for the ranks' processes). An MLA server's ranks all hit what rank 0
wrote; ranks never evict each other, even after a restart; ``batch_exists`` never counts a
page whose files are gone; a backup after the folder was removed stores its pages; a
``disk_path`` holding a user's files is refused, every file untouched."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not installed (pip install kvtier[sglang])")

from test_sglang_real import PAGE, _attach, _config, _mha_pool, _mla_pool, _pages  # noqa: E402

pytestmark = pytest.mark.sglang

MHA_PAGE = 2 * (4096 + 3 * PAGE * 2 * 64 * 2)  # a page-first MHA page on disk: K and V chunks, headers


def _ranks(tmp_path, n: int, mla: bool, **extra):
    """n TP ranks of one server, each its own backend and pool, one ``disk_path``."""
    pools = [(_mla_pool if mla else _mha_pool)("page_first") for _ in range(n)]
    out = []
    for r in range(n):
        cfg = _config(tmp_path, tp_rank=r, tp_size=n, mla=mla)
        cfg.extra_config.update(extra)
        out.append(_attach(cfg, pools[r]))
    return out, pools


def _write(be, pool, keys: list[str]) -> list[torch.Tensor]:
    """Random pages backed up under ``keys``; each page's bytes."""
    src = pool.alloc(len(keys) * PAGE)
    pool.kv_buffer.view(torch.int16).random_()
    assert be.batch_set_v1(keys, src) == [True] * len(keys)
    want = _pages(pool, src)
    pool.free(src)
    return want


def _read(be, pool, keys: list[str], want: list[torch.Tensor]) -> list[bool]:
    """``batch_get_v1`` into poisoned pages: True per page read and equal bit for bit."""
    dst = pool.alloc(len(keys) * PAGE)
    pool.kv_buffer.view(torch.int16).fill_(0x5A5A)  # a page not read keeps these bytes
    got = be.batch_get_v1(keys, dst)
    out = [g and torch.equal(p, w) for g, p, w in zip(got, _pages(pool, dst), want, strict=True)]
    pool.free(dst)
    return out


def _kvc(tmp_path) -> set:
    return set((tmp_path / "kv").rglob("*.kvc"))


def test_mla_ranks_hit_what_rank_0_wrote_after_their_start(tmp_path):
    ranks, pools = _ranks(tmp_path, 2, mla=True)  # rank 1's disk tier has scanned: nothing yet
    keys = [f"mla-{i}" for i in range(4)]
    want = _write(ranks[0], pools[0], keys)
    assert [be.batch_exists(keys) for be in ranks] == [4, 4]  # SGLang takes the minimum over ranks
    assert _read(ranks[1], pools[1], keys, want) == [True] * 4
    assert ranks[1].batch_set_v1(["mla-x"], pools[1].alloc(PAGE)) == [True]  # not the writer: skipped
    assert ranks[1].batch_exists(["mla-x"]) == 0
    assert ranks[1].stats()["tiers"]["disk"]["writer"] == 0
    for be in ranks:
        be.close()


def test_ranks_never_evict_each_other_even_after_a_restart(tmp_path):
    gb = 4.5 * MHA_PAGE / 1e9  # four pages per rank
    ranks, pools = _ranks(tmp_path, 2, mla=False, disk_capacity_gb=gb)
    old = [f"old-{i}" for i in range(4)]
    want = [_write(be, pool, old) for be, pool in zip(ranks, pools, strict=True)]
    for be in ranks:
        be.close()
    ranks, pools = _ranks(tmp_path, 2, mla=False, disk_capacity_gb=gb)  # the server restarted
    assert [be.batch_exists(old) for be in ranks] == [4, 4]
    _write(ranks[1], pools[1], [f"new-{i}" for i in range(4)])  # rank 1 is full: evicts its own pages
    assert ranks[1].batch_exists(old) == 0
    assert ranks[0].batch_exists(old) == 4 and _read(ranks[0], pools[0], old, want[0]) == [True] * 4
    for be in ranks:
        be.close()


def test_batch_exists_counts_no_page_whose_files_are_gone(tmp_path):
    (be,), (pool,) = _ranks(tmp_path, 1, mla=False)
    keys, files, want = [f"p{i}" for i in range(4)], [], []
    for key in keys:  # one page at a time: each page's files known
        before = _kvc(tmp_path)
        want += _write(be, pool, [key])
        files.append(_kvc(tmp_path) - before)
    assert be.batch_exists(keys) == 4
    for f in files[2]:
        f.unlink()  # an operator, or another process
    assert be.batch_exists(keys) == 2
    for f in _kvc(tmp_path):
        f.unlink()
    assert be.batch_exists(keys) == 0
    assert be.batch_set_v1(keys, pool.alloc(4 * PAGE)) == [True] * 4  # stored again, not "held"
    assert be.batch_exists(keys) == 4 and len(_kvc(tmp_path)) == sum(len(f) for f in files)
    be.close()


def test_a_backup_after_the_folder_was_removed_stores_its_pages(tmp_path):
    import shutil

    (be,), (pool,) = _ranks(tmp_path, 1, mla=False)
    old, new = ["a", "b"], ["c", "d"]
    _write(be, pool, old)
    shutil.rmtree(tmp_path / "kv")
    want = _write(be, pool, old + new)  # True only where stored, "held" pages included
    assert be.batch_exists(old + new) == 4 and _read(be, pool, old + new, want) == [True] * 4
    assert (tmp_path / "kv" / "kvtier-disk.json").is_file()
    be.close()


def test_a_disk_path_of_user_files_is_refused_untouched(tmp_path):
    user = tmp_path / "kv"
    (user / "ab").mkdir(parents=True)
    (user / "ab" / "notes.txt").write_text("my notes")
    (user / "db").mkdir()
    (user / "db" / "users.sqlite").write_bytes(os.urandom(4096))
    before = {p: p.read_bytes() for p in user.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"extra_config\['disk_path'\] '.*/kv' is not empty"):
        _ranks(tmp_path, 1, mla=False)
    assert {p: p.read_bytes() for p in user.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in user.iterdir()) == ["ab", "db"]  # not even a marker
