"""ops refuse every bad argument with a ValueError naming it, before anything is launched."""

import pytest
import torch

from kvtier import ops
from kvtier.ops import kv_copy
from kvtier.reference import gather_ref, poison_, random_cache

if not ops.INTERPRETING and not torch.cuda.is_available():
    pytest.skip("kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cpu" if ops.INTERPRETING else "cuda"


@pytest.fixture
def kv():
    return random_cache("vllm_flash", 2, 8, 4, 2, 32, torch.bfloat16, DEV)


def chunk(kv, n, **kw):
    return torch.empty(kv.chunk_shape(n), dtype=kv.dtype, device=DEV, **kw)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([0, 8], r"block_ids\[1\] = 8 out of range"),
        ([-1, 2], r"block_ids\[0\] = -1 out of range"),
        ([[1, 2]], "flat"),
        (["a", 1], "sequence of ints"),
        (torch.tensor([1.0, 2.0]), "int32/int64"),
        (torch.tensor([[1, 2]]), "1-D"),
    ],
)
def test_bad_block_ids(kv, ids, match):
    with pytest.raises(ValueError, match=match):
        ops.gather(kv, ids, chunk(kv, 2))


def test_scatter_refuses_duplicates_gather_allows_them(kv):
    dst = poison_(chunk(kv, 2))
    ops.gather(kv, [3, 3], dst)
    assert torch.equal(dst.view(torch.int16), gather_ref(kv, [3, 3]).view(torch.int16))
    with pytest.raises(ValueError, match="duplicate"):
        ops.scatter(kv, [3, 3], dst)


@pytest.mark.parametrize("num_tokens", [0, 4, 9, -1, 2.5, True])
def test_bad_num_tokens(kv, num_tokens):
    with pytest.raises(ValueError, match="num_tokens"):
        ops.gather(kv, [1, 2], chunk(kv, 2), num_tokens=num_tokens)


def test_bad_chunks(kv):
    with pytest.raises(ValueError, match=r"dst: shape"):
        ops.gather(kv, [1, 2], chunk(kv, 3))
    with pytest.raises(ValueError, match=r"dst: dtype"):
        ops.gather(kv, [1, 2], torch.empty(kv.chunk_shape(2), dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"src: a uint8 buffer"):
        ops.scatter(kv, [1, 2], torch.empty(kv.chunk_nbytes(2) + 1, dtype=torch.uint8, device=DEV))
    with pytest.raises(ValueError, match=r"dst: must be contiguous"):
        ops.gather(kv, [1, 2], chunk(kv, 4)[::2])
    with pytest.raises(ValueError, match=r"dst: expected a torch.Tensor"):
        ops.gather(kv, [1, 2], None)


@pytest.mark.parametrize("max_ctas", [0, -3, 1.5, True])
def test_bad_max_ctas(kv, max_ctas):
    with pytest.raises(ValueError, match="max_ctas"):
        ops.gather(kv, [1], chunk(kv, 1), max_ctas=max_ctas)


def test_not_a_cache():
    with pytest.raises(ValueError, match="kv: expected a PagedKV"):
        ops.gather([torch.zeros(2, 4, 4, 1, 32)], [1], torch.empty(1))


def test_block_ids_checked_once(kv):
    ids = ops.block_ids(kv, [5, 1, 6], num_tokens=10)
    dst = poison_(chunk(kv, 3))
    ops.gather(kv, ids, dst)
    assert torch.equal(dst.view(torch.int16), gather_ref(kv, [5, 1, 6], 10).view(torch.int16))
    with pytest.raises(ValueError, match="num_tokens: already given"):
        ops.gather(kv, ids, dst, num_tokens=10)
    other = random_cache("vllm_flash", 2, 8, 4, 2, 32, torch.bfloat16, DEV)
    with pytest.raises(ValueError, match="another cache"):
        ops.gather(other, ids, dst)
    with pytest.raises(ValueError, match="unique=True"):
        ops.scatter(kv, ops.block_ids(kv, [1, 2, 3], unique=False), dst)


def test_staging_checks(kv):
    host = chunk(kv, 3, pin_memory=not ops.INTERPRETING)
    streams = (
        {} if ops.INTERPRETING else {"gather_stream": torch.cuda.Stream(), "copy_stream": torch.cuda.Stream()}
    )
    streams = streams or {"gather_stream": None, "copy_stream": None}
    with pytest.raises(ValueError, match="staging: expected two buffers"):
        ops.save_staged(
            kv, [1, 2, 3], host, staging=[torch.empty(10, dtype=torch.uint8, device=DEV)], **streams
        )
    small = [torch.empty(16, dtype=torch.uint8, device=DEV) for _ in range(2)]
    with pytest.raises(ValueError, match="one block"):
        ops.save_staged(kv, [1, 2, 3], host, staging=small, **streams)
    one = ops.make_staging(kv, 2)[0]
    with pytest.raises(ValueError, match="overlap"):
        ops.save_staged(kv, [1, 2, 3], host, staging=[one, one], **streams)
    with pytest.raises(ValueError, match="chunk_blocks"):
        ops.make_staging(kv, 0)


@pytest.mark.skipif(not ops.INTERPRETING, reason="interpreter rules")
def test_interpreter_takes_no_streams(kv):
    with pytest.raises(ValueError, match="must be None without CUDA"):
        ops.save_staged(
            kv, [1], chunk(kv, 1), staging=ops.make_staging(kv, 1), gather_stream=1, copy_stream=None
        )


@pytest.mark.parametrize("seg", [8, 20, 448, 560, 4096, 8192, 10240, 73728])
def test_tile_shape(seg):
    cols, rows = kv_copy.tile_shape(seg, 4096)
    assert cols * rows == 4096 and cols & (cols - 1) == 0
    assert -seg % cols <= max(seg // 8, cols // 2)  # little of each segment's last slice is wasted


def test_plan_picks_wide_units_where_aligned(kv):
    aligned = torch.empty(kv.chunk_nbytes(1) + 16, dtype=torch.uint8, device=DEV)
    plan = kv_copy.plan_for(kv, aligned.data_ptr())
    assert plan.unit == torch.int32 and plan.vec == 4  # 16-byte vectors
    plan = kv_copy.plan_for(kv, aligned[2:].data_ptr())
    assert plan.unit == torch.int16 and plan.vec == 1


def test_trusted_block_ids_equal_the_checked_path():
    """The engine's shortcut (ids it checked itself) gives what the checking path gives."""
    import torch

    from kvtier.ops.checks import block_ids, check_num_tokens, trusted_block_ids
    from kvtier.reference import random_cache

    kv = random_cache("vllm_flash", 2, 10, 4, 2, 8, torch.float16, seed=0)
    ids = torch.tensor([7, 2, 9], dtype=torch.int64)
    last = check_num_tokens(kv, len(ids), 10)  # what the engine's IdCheck hands the mover
    a, b = trusted_block_ids(kv, ids, True, last), block_ids(kv, ids, unique=True, num_tokens=10)
    assert torch.equal(a.dev, b.dev) and a.last_valid == b.last_valid == 2 and a.unique
    c = trusted_block_ids(kv, ids.to(torch.int32), True, last)  # the engine's int32 copy: the same BlockIds
    assert c.dev.dtype == torch.int32 and torch.equal(c.dev, b.dev) and c.cpu.dtype == torch.int64
    assert torch.equal(c.cpu, b.cpu) and c.last_valid == 2
    with pytest.raises(ValueError, match="num_tokens"):
        check_num_tokens(kv, len(ids), 13)  # 13 tokens do not fit 3 blocks of 4
