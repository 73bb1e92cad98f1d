"""Block ids given on the host (`ops/host_ids.py`): the C helper's single pass and numpy's passes
write the same int32 ids and refuse the same bad ids with a ValueError naming the argument, before
anything is launched; the ops take lists, tuples, ranges, CPU tensors and numpy arrays of any
length (8192 ids here) and copy the same blocks from each."""

import numpy as np
import pytest
import torch

from kvtier import ops
from kvtier.ops.host_ids import HOST_IDS_KEY, HostIds
from kvtier.reference import bits_equal, gather_ref, poison_, random_cache, snapshot

if not ops.INTERPRETING and not torch.cuda.is_available():
    pytest.skip("kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cpu" if ops.INTERPRETING else "cuda"
BLOCKS = 16384


def cache(native: bool, seed: int = 0):
    """A cache of BLOCKS tiny blocks whose ops check host ids with the C helper (where built) or
    with numpy alone."""
    kv = random_cache("vllm_flash", 1, BLOCKS, 1, 1, 8, torch.bfloat16, DEV, seed=seed)
    kv.plans[HOST_IDS_KEY] = HostIds(kv, native=native)
    return kv


def scratch_clear(kv) -> bool:
    """The C check's bit mask is all zero between calls (numpy's marks need no clearing)."""
    h = kv.plans[HOST_IDS_KEY]
    return h.bits is None or not h.bits.any()


def chunk(kv, n):
    return poison_(torch.empty(kv.chunk_shape(n), dtype=kv.dtype, device=DEV))


IDS = [9, 0, 16383, 4, 77]


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("unique", [True, False])
@pytest.mark.parametrize(
    "given",
    [
        list(IDS),
        tuple(IDS),
        torch.tensor(IDS),
        torch.tensor(IDS, dtype=torch.int32),
        torch.tensor([x for i in IDS for x in (i, -1)])[::2],  # strided
        np.array(IDS),
        np.array(IDS, dtype=np.int32),
        np.array(IDS, dtype=np.int16),
        np.array([x for i in IDS for x in (i, -1)])[::2],  # strided
        [np.int64(x) for x in IDS],  # numpy scalars: ints, not Python's
    ],
)
def test_every_kind_writes_the_same_int32_ids(native, unique, given):
    kv = cache(native)
    h = kv.plans[HOST_IDS_KEY]
    n = h.count(given)
    assert n == len(IDS)
    out = np.full(n + 2, -7, dtype=np.int32)
    h.fill(given, n, unique, out)
    assert out[:n].tolist() == IDS and out[n:].tolist() == [-7, -7]
    assert scratch_clear(kv)


def test_a_range_and_a_generator_are_ids_too():
    kv = cache(True)
    want = gather_ref(kv, list(range(3, 9)))
    for given in (range(3, 9), (i for i in range(3, 9))):
        dst = chunk(kv, 6)
        ops.gather(kv, given, dst)
        assert bits_equal(dst, want)


BAD = [
    ([0, BLOCKS], rf"block_ids\[1\] = {BLOCKS} out of range"),
    ([-1, 2], r"block_ids\[0\] = -1 out of range"),
    (np.array([3, -2]), r"block_ids\[1\] = -2 out of range"),
    (torch.tensor([5, 2**40]), rf"block_ids\[1\] = {2**40} out of range"),
    (torch.tensor([5, -3], dtype=torch.int32), r"block_ids\[1\] = -3 out of range"),
    ([2**70], rf"block_ids\[0\] = {2**70} out of range"),
    (np.array([2**63], dtype=np.uint64), rf"block_ids\[0\] = {2**63} out of range"),
    ([4, 1.0], r"block_ids\[1\]: expected a flat sequence of ints, got float"),
    (np.array([1.0, 2.0]), r"block_ids\[0\]: expected a flat sequence of ints, got float64"),
    (torch.tensor([1.0, 2.0]), "expected a 1-D int32/int64 tensor, got torch.float32"),
    (torch.tensor([[1, 2]]), "expected a 1-D int32/int64 tensor"),
    (["a", 1], r"block_ids\[0\]: expected a flat sequence of ints, got str"),
    ([[1, 2]], r"block_ids\[0\]: expected a flat sequence of ints, got list"),
    (None, "block_ids: expected a flat sequence of ints, got NoneType"),
]


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("op", ["gather", "scatter"])
@pytest.mark.parametrize("given, match", BAD)
def test_bad_ids_are_refused_naming_the_argument(native, op, given, match):
    kv = cache(native)
    before = snapshot(kv)
    n = 2
    dst = chunk(kv, n)
    want = dst.clone()
    with pytest.raises(ValueError, match=match):
        getattr(ops, op)(kv, given, dst)
    assert bits_equal(dst, want)  # nothing was launched
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(kv), strict=True))
    assert scratch_clear(kv)


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize(
    "given",
    [[4, 9, 4], np.array([7, 7]), torch.tensor([1, 2, 3, 1]), list(range(8192)) + [5]],
    ids=["list", "numpy", "tensor", "8193"],
)
def test_scatter_refuses_a_repeated_id_gather_reads_it(native, given):
    kv = cache(native)
    n = len(given)
    dst = chunk(kv, n)
    ops.gather(kv, given, dst)
    assert bits_equal(dst, gather_ref(kv, torch.as_tensor(given)))
    before = snapshot(kv)
    with pytest.raises(ValueError, match="duplicate block ids"):
        ops.scatter(kv, given, dst)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(kv), strict=True))
    assert scratch_clear(kv)  # the repeat check leaves its mask clear, refused or not


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("kind", ["list", "tensor", "numpy"])
def test_8192_ids_round_trip(native, kind):
    kv = cache(native, seed=3)
    perm = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(4))
    src_ids, dst_ids = perm[:8192], perm[8192:]
    as_kind = {
        "list": lambda t: t.tolist(),
        "tensor": lambda t: t.clone(),
        "numpy": lambda t: t.numpy().copy(),
    }
    dst = chunk(kv, 8192)
    ops.gather(kv, as_kind[kind](src_ids), dst)
    assert bits_equal(dst, gather_ref(kv, src_ids))
    ops.scatter(kv, as_kind[kind](dst_ids), dst)
    assert bits_equal(gather_ref(kv, dst_ids), gather_ref(kv, src_ids))
    assert scratch_clear(kv)


def test_block_ids_object_checks_the_same_way():
    kv = cache(True)
    with pytest.raises(ValueError, match=r"block_ids\[2\] = -5 out of range"):
        ops.block_ids(kv, [1, 2, -5])
    with pytest.raises(ValueError, match="duplicate block ids"):
        ops.block_ids(kv, np.array([3, 8, 3]))
    assert ops.block_ids(kv, np.array([3, 8, 3]), unique=False).cpu.tolist() == [3, 8, 3]
    assert scratch_clear(kv)
