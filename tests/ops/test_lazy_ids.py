"""Block ids checked on the device (`check="lazy"`, the default for GPU ids): a bad id is neither
read nor written, the kernel counts it in the cache's flag, and `ops.check` raises it.

Under Triton's interpreter (TRITON_INTERPRET=1) the ids are CPU tensors, and `check="lazy"` takes
exactly the kernel's masked path and its flag; on a GPU the same tests run on GPU ids."""

import pytest
import torch

from kvtier import ops
from kvtier.ops.slots import scatter_slots, slot_sources
from kvtier.reference import bits_equal, gather_ref, poison_, random_cache

if not ops.INTERPRETING and not torch.cuda.is_available():
    pytest.skip("kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cpu" if ops.INTERPRETING else "cuda"
NB = 12


def cache(fmt="vllm_flash"):
    return random_cache(fmt, 3, NB, 4, 2, 16, torch.bfloat16, DEV, seed=5)


def ids_of(values, where):
    t = torch.tensor(values, dtype=torch.int64)
    return t if where == "host" else t.to(DEV)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()  # submitted is not done


def poisoned_blocks(kv, blocks):
    for layer in range(kv.num_layers):
        kv.block_view(layer).view(torch.uint8)[:, blocks] = 0xA5


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("fmt", ["vllm_flash", "flashinfer_hnd", "mla"])
def test_gather_skips_out_of_range_ids_and_flags_them(fmt, where):
    kv = cache(fmt)
    ids = [3, NB, 7, -1, 2**40]  # three bad ones, two of them anywhere
    dst = poison_(torch.empty(kv.chunk_shape(5), dtype=kv.dtype, device=DEV))
    ops.gather(kv, ids_of(ids, where), dst, num_tokens=4 * 4 + 3, check="lazy")
    sync()
    want = gather_ref(kv, [3, 0, 7, 0, 0], 4 * 4 + 3)
    for i in (0, 2):
        assert bits_equal(dst[i], want[i])
    for i in (1, 3, 4):  # never written: still poisoned
        assert bool((dst[i].view(torch.uint8) == 0xA5).all())
    with pytest.raises(ops.BlockIdError, match="3 out of range and 0 repeated") as e:
        ops.check(kv)
    assert e.value.out_of_range == 3 and e.value.repeated == 0
    ops.check(kv)  # cleared


@pytest.mark.parametrize("where", ["host", "device"])
def test_scatter_skips_every_copy_of_a_repeated_id(where):
    kv = cache()
    src = torch.randn(kv.chunk_shape(5), dtype=torch.float32, device=DEV).to(kv.dtype)
    poisoned_blocks(kv, [1, 4, 9])
    others = [b for b in range(NB) if b not in (1, 9)]
    before = gather_ref(kv, others)
    ops.scatter(kv, ids_of([4, 9, 4, 1, 99], where), src, check="lazy")
    sync()
    # block 1 written from src[3]; 4 (named twice) and 99 (out of range) not at all; 9 from src[1]
    got = gather_ref(kv, [1, 9])
    assert bits_equal(got[0], src[3]) and bits_equal(got[1], src[1])
    assert bits_equal(gather_ref(kv, others), before)  # every other block as it was
    assert bool((gather_ref(kv, [4]).view(torch.uint8) == 0xA5).all())  # still poisoned
    with pytest.raises(ops.BlockIdError) as e:
        ops.check(kv)
    assert (e.value.out_of_range, e.value.repeated) == (1, 1)


def test_lazy_block_ids_reused_per_layer_and_staged():
    kv = cache()
    b = ops.block_ids(kv, [5, 5, 2], check="lazy")
    assert b.lazy and len(b) == 3
    src = torch.randn(kv.chunk_shape(3), dtype=torch.float32, device=DEV).to(kv.dtype)
    poisoned_blocks(kv, [2, 5])
    for layer in range(kv.num_layers):
        ops.scatter(kv, b, src, layers=(layer, 1))
    sync()
    assert bits_equal(gather_ref(kv, [2])[0], src[2])
    assert bool((gather_ref(kv, [5]).view(torch.uint8) == 0xA5).all())
    with pytest.raises(ops.BlockIdError) as e:
        ops.check(kv)
    assert e.value.repeated == kv.num_layers  # once per call


@pytest.mark.skipif(not ops.INTERPRETING, reason="the staged paths take streams on CUDA")
def test_staged_load_and_slots_check_lazily():
    kv = cache()
    host = torch.randn(kv.chunk_shape(4), dtype=torch.float32).to(kv.dtype)
    poisoned_blocks(kv, [0, 3, 6])
    stg = ops.make_staging(kv, 1)  # one block per chunk: the repeat spans two chunks
    ops.load_staged(kv, [3, 0, 3, 6], host, staging=stg, copy_stream=None, scatter_stream=None, check="lazy")
    assert bits_equal(gather_ref(kv, [0, 6]), host[[1, 3]])
    assert bool((gather_ref(kv, [3]).view(torch.uint8) == 0xA5).all())
    with pytest.raises(ops.BlockIdError, match="0 out of range and 1 repeated"):
        ops.check(kv)
    poisoned_blocks(kv, [0, 3, 6])
    b = ops.block_ids(kv, [6, 0, 3, 40], check="lazy")
    src = slot_sources(kv, b, [host[:2].contiguous(), host[2:].contiguous()])
    scatter_slots(kv, src)
    assert bits_equal(gather_ref(kv, [6, 0, 3]), host[:3])
    with pytest.raises(ops.BlockIdError, match="1 out of range"):
        ops.check(kv)
    out = poison_(torch.empty(kv.chunk_shape(2), dtype=kv.dtype))
    ops.save_staged(kv, [1, 77], out, staging=stg, gather_stream=None, copy_stream=None, check="lazy")
    assert bits_equal(out[0], gather_ref(kv, [1])[0])  # out[1]: the staging buffer's old bytes, no read past
    with pytest.raises(ops.BlockIdError, match="1 out of range"):
        ops.check(kv)


def test_good_lazy_ids_copy_exactly_and_flag_nothing():
    kv = cache("flashinfer_hnd")
    dst = poison_(torch.empty(kv.chunk_shape(4), dtype=kv.dtype, device=DEV))
    ops.gather(kv, ids_of([11, 0, 5, 5], "device"), dst, num_tokens=14, check="lazy")
    sync()
    assert bits_equal(dst, gather_ref(kv, [11, 0, 5, 5], 14))
    ops.scatter(kv, ids_of([1, 2, 3, 4], "device"), dst, num_tokens=14, check="lazy")
    sync()
    assert bits_equal(gather_ref(kv, [1, 2, 3, 4], 14), gather_ref(kv, [11, 0, 5, 5], 14))
    ops.check(kv)


def test_check_argument_and_eager_path():
    kv = cache()
    dst = torch.empty(kv.chunk_shape(1), dtype=kv.dtype, device=DEV)
    with pytest.raises(ValueError, match="check: expected one of"):
        ops.gather(kv, [1], dst, check="later")
    with pytest.raises(ValueError, match=r"block_ids\[0\] = 12 out of range"):
        ops.gather(kv, ids_of([NB], "device"), dst, check="eager")
    with pytest.raises(ValueError, match="check: a BlockIds"):
        ops.gather(kv, ops.block_ids(kv, [1]), dst, check="lazy")
    with pytest.raises(ValueError, match="kv: expected a PagedKV"):
        ops.check("kv")
    ops.check(kv)  # nothing checked lazily yet: no flag, nothing to raise
