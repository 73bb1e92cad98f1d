"""The id checks of a submit (engine/ids.py `IdCheck`): numpy passes or one call of the C helper
(every test runs both), the same errors (naming the argument), and ids the job owns (the caller
may reuse its buffer right away)."""

import numpy as np
import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.engine.fastpath import fast
from kvtier.engine.ids import IdCheck
from kvtier.lifecycle import Access
from kvtier.lifecycle.blocks import CheckedBlocks
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, random_cache

FAST = fast.fast


USE_C = [True]  # the checks this test makes: with the C helper, or the numpy passes


def id_check(num_blocks: int, block_size: int, **kw) -> IdCheck:
    return IdCheck(num_blocks, block_size, native=USE_C[0], **kw)


@pytest.fixture(autouse=True, params=["c", "c-scalar", "numpy"])
def native(request):
    """Every test three times: with the C helper's check (where built) -- its AVX2 pass where the
    CPU has one, then its scalar pass -- and with the numpy passes."""
    if request.param != "numpy" and FAST is None:
        pytest.skip(f"C helper: {fast.why}")
    USE_C[0] = request.param != "numpy"
    if request.param == "c-scalar":
        was = FAST.set_simd(False)
        yield request.param
        FAST.set_simd(was)
    else:
        yield request.param


@pytest.mark.parametrize(
    "ids",
    [[3, 1, 2], (3, 1, 2), range(3, 0, -2), np.array([3, 1, 2]), np.array([3, 1, 2], np.int32),
     torch.tensor([3, 1, 2]), torch.tensor([3, 1, 2], dtype=torch.int32), "iter"],
)  # fmt: skip
def test_accepted_forms(ids):
    ids = iter([3, 1, 2]) if isinstance(ids, str) else ids  # a fresh iterator for each run
    check = id_check(10, 4)
    want = [3, 1] if isinstance(ids, range) else [3, 1, 2]
    t, blocks = check.check(ids, unique=True, num_tokens=4 * len(want) - 3)
    assert t.dtype == torch.int64 and t.tolist() == want  # `check`'s tensor: int64, for its callers
    assert isinstance(blocks, CheckedBlocks) and blocks.bound == 10
    assert blocks.ids.dtype == np.int32 and blocks.ids.tolist() == want  # the job's own: int32
    assert not np.shares_memory(blocks.ids, t.numpy())


@pytest.mark.parametrize(
    "bad, match",
    [
        ([10], "block_ids: out of range"),
        ([-1], "block_ids: out of range"),
        (np.array([3, -2]), "block_ids: out of range"),
        (torch.tensor([0, 10], dtype=torch.int32), "block_ids: out of range"),
        (np.array([2**63], dtype=np.uint64), "block_ids: out of range"),
        ([2**70], "block_ids: expected a sequence of ints"),
        ([], "block_ids: expected a non-empty"),
        (torch.zeros(0, dtype=torch.int64), "block_ids: expected a non-empty"),
        (torch.zeros(2, 2, dtype=torch.int64), "block_ids: expected 1-D int32/int64"),
        (torch.zeros(2), "block_ids: expected 1-D int32/int64"),
        (torch.zeros(2, dtype=torch.bool), "block_ids: expected 1-D int32/int64"),
        (["a"], "block_ids: expected a sequence of ints"),
        ([1.5, 2.0], "block_ids: expected a sequence of ints"),
        ([[1, 2]], "block_ids: expected a non-empty flat sequence"),
        (np.zeros((2, 2), np.int64), "block_ids: expected a non-empty flat sequence"),
        (5, "block_ids: expected a sequence of ints"),
    ],
)
def test_errors_name_the_argument(bad, match):
    check = id_check(10, 4)
    with pytest.raises(ValueError, match=match):
        check(bad, unique=False)


def test_duplicates_and_num_tokens():
    check = id_check(10, 4)
    assert check([1, 2, 1], unique=False).tolist() == [1, 2, 1]  # a save may read a block twice
    for dup in ([1, 2, 1], np.array([9, 9]), torch.tensor([0, 5, 0], dtype=torch.int32)):
        with pytest.raises(ValueError, match="block_ids: duplicate ids"):
            check(dup, unique=True)
    with pytest.raises(ValueError, match="num_tokens"):
        check([1, 2], unique=True, num_tokens=4)  # two blocks of 4 hold 5..8 tokens
    for bad in (9, True, 5.0, "6"):
        with pytest.raises(ValueError, match="num_tokens"):
            check([1, 2], unique=True, num_tokens=bad)
    assert check([1, 2], unique=True, num_tokens=5).tolist() == [1, 2]


def test_duplicate_check_matches_unique_at_scale():
    check = id_check(40_000, 16)
    rng = np.random.default_rng(0)
    for n in (1, 2, 512, 8192, 32_768):
        ids = rng.permutation(40_000)[:n]
        assert not check.has_duplicates(ids)
        if n > 1:
            ids[rng.integers(n)] = ids[rng.integers(n)]
            assert check.has_duplicates(ids) == (len(np.unique(ids)) != n)


def test_the_job_owns_its_ids():
    check = id_check(10, 4)
    for mine in (torch.tensor([1, 2, 3]), np.array([1, 2, 3]), [1, 2, 3]):
        t = check(mine, unique=True)
        mine[0] = 7  # the caller reuses its buffer
        assert t.tolist() == [1, 2, 3]


def test_engine_protects_the_submitted_blocks_when_the_caller_reuses_its_tensor():
    dev = SimDevice(copy_delay=0.05)
    kv = random_cache("vllm_flash", 2, 16, 4, 2, 8, torch.bfloat16, seed=3)
    pool = PinnedPool(dev, 2 * kv.chunk_nbytes(3))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True))
    ids = torch.tensor([5, 1, 6])
    want = gather_ref(kv, [5, 1, 6])
    job = eng.save(ids, after=None)
    ids[:] = torch.tensor([7, 8, 9])  # reused for the next request right after the submit
    assert job.blocks.tolist() == [5, 1, 6]
    # A compute write to the saved blocks must still wait for the save (and not for 7, 8, 9).
    compute = dev.current_stream()
    assert eng.blocks.waits_for(Access.WRITE, [1], stream=compute) == [job.event]
    assert eng.blocks.waits_for(Access.WRITE, [7, 8, 9], stream=compute) == []
    assert job.wait() and bits_equal(job.slot.view(kv.dtype, kv.chunk_shape(3)), want)
    eng.release(job.slot)
    eng.close()
    pool.close()
    dev.close()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_random_ids_as_numpy_would_check_them(dtype):
    """Random ids, some sets with a repeat or one id out of range: the same verdict and copy as a
    plain numpy check (np.unique / bounds), and the duplicate scratch all clear after each."""
    check = id_check(5000, 16)
    rng = np.random.default_rng(7)
    for trial in range(60):
        n = int(rng.integers(1, 3000))
        a = rng.integers(-3 if trial % 7 == 0 else 0, 5003 if trial % 5 == 0 else 5000, n)
        narrow = np.int64 if dtype == torch.int64 else np.int32
        src = torch.from_numpy(a).to(dtype) if trial % 2 else a.astype(narrow)
        in_range = bool(((a >= 0) & (a < 5000)).all())
        distinct = len(np.unique(a)) == n
        for unique in (False, True):
            if not in_range or (unique and not distinct):
                with pytest.raises(ValueError, match="out of range" if not in_range else "duplicate"):
                    check(src, unique=unique)
            else:
                got = check(src, unique=unique)
                assert got.dtype == torch.int64 and np.array_equal(got.numpy(), a)
            assert check.scratch_clear


@pytest.mark.parametrize("num_blocks", [64, 1 << 20])
def test_repeat_check_leaves_the_mask_clear(num_blocks):
    """The C check clears its mask by one sweep where the mask is small against the ids it marked,
    else id by id: either way all clear after a pass, a repeat found late and one found early."""
    check = id_check(num_blocks, 16)
    rng = np.random.default_rng(num_blocks)
    ids = rng.permutation(num_blocks)[:48].astype(np.int64)
    assert np.array_equal(check(ids, unique=True).numpy(), ids)
    assert check.scratch_clear
    for at in (47, 1):  # the repeat is the last id, then the second
        bad = ids.copy()
        bad[at] = bad[0]
        with pytest.raises(ValueError, match="duplicate"):
            check(bad, unique=True)
        assert check.scratch_clear


def test_repeats_in_runs_of_neighbouring_ids():
    """Runs of neighbouring ids (the C check gathers a run's marks before writing them): a repeat
    inside a run, in a later run of the same mask byte, in the last run, or none, over shuffled
    ranges -- the verdict of np.unique each time, and the mask all clear after."""
    check = id_check(4096, 16)
    rng = np.random.default_rng(11)
    cases = [[0, 1, 0], [0, 1, 9, 0], [0, 9, 1, 0], [5, 6, 7, 5], [7, 8, 7], [3], [3, 3], list(range(64))]
    for _ in range(200):
        starts = rng.choice(4096 // 32, size=int(rng.integers(1, 8)), replace=False) * 32
        runs = [np.arange(s, s + int(rng.integers(1, 32))) for s in starts]
        ids = np.concatenate(runs)
        if rng.random() < 0.5:  # one id again, somewhere after its first place
            at = int(rng.integers(0, len(ids)))
            ids = np.insert(ids, int(rng.integers(at + 1, len(ids) + 1)), ids[at])
        cases.append(ids.tolist())
    for ids in cases:
        a = np.array(ids, dtype=np.int64)
        if len(np.unique(a)) == len(a):
            assert np.array_equal(check(a, unique=True).numpy(), a)
        else:
            with pytest.raises(ValueError, match="duplicate"):
                check(a, unique=True)
        assert check.scratch_clear, ids


def test_rising_ids_skip_the_mask_and_equal_neighbours_still_repeat():
    """A strictly rising list cannot repeat: the C check skips its mask (a sorted request costs
    what a save's check does); equal neighbours are not rising and are caught, at either end."""
    check = id_check(1 << 16, 16)
    rising = np.arange(0, 3 * 8192, 3, dtype=np.int64)
    assert np.array_equal(check(rising, unique=True).numpy(), rising)
    for a in ([1, 2, 2], [4, 4, 5], [0, 1, 2, 3, 3, 4], [9, 8, 9], list(range(100)) + [99]):
        with pytest.raises(ValueError, match="duplicate"):
            check(np.array(a, dtype=np.int64), unique=True)
        with pytest.raises(ValueError, match="duplicate"):
            check(torch.tensor(a, dtype=torch.int32), unique=True)  # the 32-bit source too
        assert check.scratch_clear, a


def test_strided_and_foreign_inputs_take_the_numpy_path():
    check = id_check(10, 4)
    t = torch.tensor([1, 9, 2, 9, 3, 9])[::2]  # not contiguous
    assert check(t, unique=True).tolist() == [1, 2, 3]
    big_endian = np.array([4, 5], dtype=">i8")
    assert check(big_endian, unique=True).tolist() == [4, 5]
    assert check(np.array([6, 7], dtype=np.int16), unique=True).tolist() == [6, 7]


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_repeats_in_a_big_cache(dtype):
    """A big cache (4M blocks: 512 KiB of mask): the verdict of np.unique for random ids of many
    lengths, a repeat first, last or in between, or none; the mask all clear after."""
    check = id_check(1 << 22, 1)
    rng = np.random.default_rng(17)
    for n in [1, 2, 3, 7, 64, 1000, 4097, 8192]:
        ids = rng.choice(1 << 22, size=n, replace=False).astype(dtype)
        assert np.array_equal(check(ids, unique=True).numpy(), ids)
        for at in {0, n // 2, n - 1} if n > 1 else ():
            bad = ids.copy()
            bad[at] = bad[(at + 1) % n]
            with pytest.raises(ValueError, match="duplicate"):
                check(bad, unique=True)
            assert check(bad, unique=False).tolist() == bad.tolist()  # a save may name a block twice
        assert check.scratch_clear
    top = np.array([(1 << 22) - 1, 0, (1 << 22) - 1], dtype=dtype)  # the largest id, repeated
    with pytest.raises(ValueError, match="duplicate"):
        check(top, unique=True)


@pytest.mark.parametrize("n", [3, 2048])  # 2048: the job's array from spares
def test_lists_and_tuples_of_ints_check_as_arrays_do(n):
    """A caller's list of ints (vLLM's block ids) is checked in one C call where the helper is
    built: the same copy and errors as an array; an item that is no plain int (a numpy scalar, a
    bool, one past 64 bits) leaves the list to the numpy path, as without the helper."""
    check = id_check(3 * n, 4)
    ids = np.random.default_rng(n).permutation(3 * n)[:n].tolist()
    for form in (ids, tuple(ids), sorted(ids)):
        for unique in (False, True):
            got = check.checked(form, unique)
            assert got.ids.dtype == np.int32 and got.ids.tolist() == list(form)
    with pytest.raises(ValueError, match="duplicate"):
        check.checked([*ids[:-1], ids[0]], unique=True)
    assert check.checked([*ids[:-1], ids[0]], unique=False).ids[-1] == ids[0]  # a save may repeat
    for bad in (3 * n, -1):
        with pytest.raises(ValueError, match="out of range"):
            check.checked([*ids[:-1], bad], unique=False)
    mixed = [*ids[:-1], np.int64(ids[-1])]  # a numpy scalar: the numpy path, the same result
    assert check.checked(mixed, unique=True).ids.tolist() == ids
    with pytest.raises(ValueError, match="expected a sequence of ints"):
        check.checked([*ids[:-1], 2**70], unique=False)
    assert check.checked(ids, unique=True).ids.tolist() == ids  # the mask left clear by the errors


def test_list_ids_past_one_digit_check_as_small_ones():
    """Ints of 2**30 and up take two 30-bit digits in CPython: the C pass reads one-digit ints
    directly and converts the others; both give the same copy and errors."""
    check = id_check(2**30 + 16, 1)
    ids = [0, 5, 2**30 - 1, 2**30, 2**30 + 15]
    assert check.checked(ids, unique=True).ids.tolist() == ids
    for bad in (2**30 + 16, -1, -(2**40)):
        with pytest.raises(ValueError, match="out of range"):
            check.checked([*ids, bad], unique=False)
    with pytest.raises(ValueError, match="duplicate"):
        check.checked([*ids, 2**30], unique=True)
