"""The job's id array from spares (engine/ids.py, `_fast.check_ids` given a list): only an array
nothing but the list holds is written, the list stays in order of use and bounded, bad ids leave
it as it was, and an engine's jobs keep their own ids while anything holds them. Also the AVX2
and scalar passes of the check against numpy, on the lengths around the vector width."""

import gc

import numpy as np
import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.engine.fastpath import fast
from kvtier.engine.ids import SPARE_BYTES, SPARE_LENGTHS, SPARE_MIN, IdCheck
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, random_cache

FAST = fast.fast
pytestmark = pytest.mark.skipif(FAST is None, reason=f"C helper: {fast.why}")


def test_check_writes_only_a_spare_nothing_else_holds():
    spares = [np.full(4, -1, np.int32) for _ in range(3)]
    first, second, third = (id(a) for a in spares)  # ids only: a name would hold the array
    held = FAST.check_ids(np.arange(4), 1, 4, 10, None, spares)  # the first: free
    assert id(held) == first and held.tolist() == [0, 1, 2, 3]
    assert [id(a) for a in spares] == [second, third, first]  # moved to the end: in order of use
    view = torch.from_numpy(spares[0])  # a view holds the second array: it is someone's ids
    got = FAST.check_ids(np.arange(4, 8), 1, 4, 10, None, spares)
    assert id(got) == third and view.tolist() == [-1] * 4 and held.tolist() == [0, 1, 2, 3]
    assert FAST.check_ids(np.arange(4), 1, 4, 10, None, spares) is None  # all three held: no write
    assert [a.tolist() for a in spares] == [[-1] * 4, [0, 1, 2, 3], [4, 5, 6, 7]]
    del view
    gc.collect()
    again = FAST.check_ids(np.arange(2, 6), 1, 4, 10, None, spares)  # the second is free again
    assert id(again) == second and again.tolist() == [2, 3, 4, 5]


def test_check_skips_spares_of_another_length_and_probes_only_the_first_few():
    spares = [np.zeros(3, np.int32), np.zeros(2, np.int64), *(np.zeros(4, np.int32) for _ in range(4))]
    holders = spares[2:5]  # after a short one and one of int64 (its 16 bytes: not 4 int32), someone's
    assert FAST.check_ids(np.arange(4), 1, 4, 10, None, spares) is None  # the free one is the sixth
    want = id(spares[2])
    holders.clear()
    assert id(FAST.check_ids(np.arange(4), 1, 4, 10, None, spares)) == want
    assert spares[0].tolist() == [0, 0, 0] and spares[1].tolist() == [0, 0]


@pytest.mark.parametrize("bad, rc", [([1, 2, 10, 3], 1), ([1, 2, 1, 3], 2)])
def test_bad_ids_leave_the_spares_as_they_were(bad, rc):
    spares = [np.zeros(4, np.int32), np.zeros(4, np.int32)]
    order = [id(a) for a in spares]
    seen = np.zeros(1, np.uint64)
    assert FAST.check_ids(np.array(bad), 1, 4, 10, seen, spares) == rc
    assert [id(a) for a in spares] == order and not seen.any()


def test_a_refused_buffer_gives_the_taken_spare_back():
    """A spare is exported while the check writes it; when a later argument is refused (a source
    too short, a mask of the wrong item size) the export ends, so the spare is free again."""
    spares = [np.zeros(4, np.int32)]
    with pytest.raises(ValueError, match="buffer"):
        FAST.check_ids(np.arange(3), 1, 4, 10, None, spares)  # 3 int64 ids where 4 are read
    with pytest.raises(ValueError, match="buffer"):
        FAST.check_ids(np.arange(4), 1, 4, 10, np.zeros(1, np.int32), spares)
    got = FAST.check_ids(np.arange(4), 1, 4, 10, None, spares)
    assert got is spares[-1] and got.tolist() == [0, 1, 2, 3]
    got.resize(4, refcheck=False)  # numpy refuses to resize an array whose buffer is exported


@pytest.mark.parametrize("simd", [True, False])
def test_both_passes_match_numpy_around_the_vector_width(simd):
    """Lengths 1..40 and a few large ones, int64 and int32 sources, rising or not, one id out of
    range (first vector, middle, tail) or negative, a repeat of a neighbour or of a far id: the
    verdict of numpy and the same copy, the repeat mask clear after each (poisoned outputs)."""
    was = FAST.set_simd(simd)
    rng = np.random.default_rng(3)
    try:
        for n in [*range(1, 41), 511, 4097, 8192]:
            nb = 4 * n + 3
            for kind in ("rising", "shuffled", "neighbour", "far", "range", "negative"):
                a = np.sort(rng.choice(nb, n, replace=False)).astype(np.int64)
                if kind == "shuffled":
                    rng.shuffle(a)
                at = int(rng.integers(0, n))
                if kind == "neighbour" and n > 1:
                    a[max(at, 1)] = a[max(at, 1) - 1]
                elif kind == "far" and n > 1:
                    a[-1] = a[0]
                elif kind == "range":
                    a[at] = nb
                elif kind == "negative":
                    a[at] = -1
                for src in (a, a.astype(np.int32)):
                    for unique in (False, True):
                        seen = np.zeros((nb + 63) // 64, np.uint64) if unique else None
                        out = np.full(n, -7, np.int32)
                        rc = FAST.check_ids(src, src.dtype == np.int64, n, nb, seen, out)
                        bad = ((a < 0) | (a >= nb)).any()
                        want = 1 if bad else 2 if unique and len(np.unique(a)) != n else 0
                        assert rc == want, (n, kind, src.dtype, unique)
                        assert rc or np.array_equal(out, a)
                        assert seen is None or not seen.any()
    finally:
        FAST.set_simd(was)


def test_idcheck_reuses_a_job_array_once_nothing_holds_it():
    check = IdCheck(num_blocks=4 * SPARE_MIN, block_size=1)
    src = torch.arange(SPARE_MIN)
    a = check.checked(src, False).ids
    b = check.checked(src + 1, False).ids
    assert not np.shares_memory(a, b) and a.tolist() == src.tolist()
    kept = torch.from_numpy(b)  # the caller keeps job b's ids as a tensor
    del a, b
    gc.collect()
    c = check.checked(src + 2, True).ids  # reuses the first array, never b's
    assert kept.tolist() == (src + 1).tolist() and c.tolist() == (src + 2).tolist()
    assert check.spare_arrays() == {SPARE_MIN: 2}  # no new array was needed
    assert check.checked(src, False).ids is not c


def test_idcheck_spares_are_bounded():
    check = IdCheck(num_blocks=1 << 16, block_size=1)
    n = SPARE_MIN * 4
    held = [check.checked(torch.arange(n), False).ids for _ in range(SPARE_BYTES // (4 * n) + 5)]
    kept = check.spare_arrays()[n]
    assert kept * n * 4 <= SPARE_BYTES and len(held) > kept
    for k in range(SPARE_LENGTHS + 2):  # more lengths than kept: the oldest give theirs up
        check.checked(torch.arange(SPARE_MIN + k), False)
    lengths = check.spare_arrays()
    assert len(lengths) == SPARE_LENGTHS and n not in lengths
    small = IdCheck(num_blocks=64, block_size=1)
    small.checked(torch.arange(SPARE_MIN - 1 if SPARE_MIN <= 64 else 8), False)
    assert small.spare_arrays() == {}  # short jobs take a new array (malloc's bins are fast for them)
    off = IdCheck(num_blocks=1 << 16, block_size=1, spares=False)
    off.checked(torch.arange(n), False)
    assert off.spare_arrays() == {}


def test_engine_jobs_keep_their_ids_while_spares_are_reused():
    """Saves and loads of SPARE_MIN blocks on SimDevice with late copies, two jobs in flight at a
    time and jobs dropped at random moments: each live job's ids stay what was submitted, every
    loaded block holds what was saved, and few arrays serve many jobs."""
    rng = np.random.default_rng(5)
    n, half = SPARE_MIN, 2 * SPARE_MIN
    dev = SimDevice(copy_delay=(0.0, 0.002), seed=5)
    kv = random_cache("vllm_flash", 1, 2 * half, 1, 1, 4, torch.bfloat16, seed=5)
    pool = PinnedPool(dev, 4 * kv.chunk_nbytes(n))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True))
    live: list = []
    try:
        for _ in range(30):
            # from the lower half, which no load writes
            saves = [torch.from_numpy(rng.permutation(half)[:n]) for _ in range(2)]
            jobs = [eng.save(ids, after=None) for ids in saves]  # both in flight at once
            live += [(j, ids.clone()) for j, ids in zip(jobs, saves, strict=True)]
            for job, ids in zip(jobs, saves, strict=True):
                assert job.wait()
                if rng.random() < 0.5:
                    dst = torch.from_numpy(half + rng.permutation(half)[:n])
                    load = eng.load(job.slot, dst)
                    live.append((load, dst.clone()))
                    assert load.wait()
                    assert bits_equal(gather_ref(kv, dst), gather_ref(kv, ids))
                eng.release(job.slot)
            for job, ids in live:
                assert job.blocks.tolist() == ids.tolist()  # no spare was taken while its job lived
            rng.shuffle(live)
            del live[: int(rng.integers(0, len(live) + 1))]
        assert eng.spare_arrays()[n] < 30  # reused: 60+ jobs, fewer arrays
    finally:
        live.clear()
        eng.close()
        pool.close()
        dev.close()


@pytest.mark.parametrize("simd", [True, False])
def test_repeat_check_in_a_big_cache_clears_only_the_words_it_marked(simd):
    """A mask far bigger than the ids (2**20 blocks, 100 ids: the word-by-word clear): repeats of
    the same word, of a neighbour word and of a far id found, none where there is none, and the
    mask all zero again after each call (its poisoned neighbours untouched)."""
    was = FAST.set_simd(simd)
    try:
        nb, rng = 1 << 20, np.random.default_rng(7)
        seen = np.zeros((nb + 63) // 64 + 2, np.uint64)
        seen[-2:] = 0xFFFF  # past the mask: never read as marks, never cleared
        mask = seen[:-2]
        for trial in range(40):
            a = rng.choice(nb, 100, replace=False).astype(np.int64)
            kind = trial % 4
            if kind == 1:
                a[50] = a[49] ^ 1  # the same 64-bit word, another bit: no repeat
            elif kind == 2:
                a[99] = a[3]  # a far repeat
            elif kind == 3:
                a[10] = a[11]  # adjacent: the two chains of the loop see one word
            out = np.full(100, -7, np.int32)
            rc = FAST.check_ids(a, 1, 100, nb, mask, out)
            assert rc == (2 if kind in (2, 3) else 0) or (kind == 1 and len(np.unique(a)) != 100)
            assert not mask.any() and seen[-2:].tolist() == [0xFFFF, 0xFFFF]
    finally:
        FAST.set_simd(was)


def test_engine_jobs_keep_int32_ids_and_idcheck_refuses_a_cache_too_big_for_them():
    dev = SimDevice()
    kv = random_cache("vllm_flash", 1, 16, 2, 1, 8, torch.float16, seed=1)
    pool = PinnedPool(dev, 4 * kv.chunk_nbytes(3))
    eng = TransferEngine(dev, kv, pool, EngineConfig(path="staged"))
    try:
        job = eng.save(torch.tensor([5, 2, 7]), after=None)
        assert job.ids.dtype == np.int32 and job.ids.tolist() == [5, 2, 7]
        assert job.blocks.dtype == torch.int64 and job.blocks.tolist() == [5, 2, 7]
        assert job.wait()
        load = eng.load(job.slot, np.array([9, 12, 1], np.int32))
        assert load.ids.dtype == np.int32 and load.wait()
        assert bits_equal(gather_ref(kv, torch.tensor([9, 12, 1])), gather_ref(kv, torch.tensor([5, 2, 7])))
        eng.release(job.slot)
    finally:
        eng.close()
        pool.close()
    with pytest.raises(ValueError, match="num_blocks"):
        IdCheck(num_blocks=2**31 + 1, block_size=1)
