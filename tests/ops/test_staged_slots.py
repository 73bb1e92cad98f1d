"""ops.staged.save_slot_chunks / load_slot_chunks: the staged save and load of several chunks in
one pipelined sequence (the engine's multi-slot staged jobs), bit for bit against the PyTorch
reference on poisoned outputs: chunks of odd sizes, chunks larger than a staging buffer (cut into
pieces), the job's last block partial; in vLLM 0.33's six orders. On the CPU (Triton
interpreter) the steps run in order; on CUDA the streams version runs in
tests/engine/test_engine_slots_gpu.py, through the engine."""

import pytest
import torch
from test_kernels import DEV

from kvtier import layout, ops
from kvtier.ops.call_ids import use_ids
from kvtier.ops.checks import trusted_block_ids
from kvtier.ops.staged import load_slot_chunks, save_slot_chunks
from kvtier.reference import FORMATS, bits_equal, gather_ref, poison_blocks_, random_cache

if not ops.INTERPRETING:
    pytest.skip("the streams version runs through the engine on CUDA", allow_module_level=True)

COUNTS = [3, 1, 5, 2]  # chunk sizes in blocks; staging buffers hold 2 blocks: cut into pieces


def _ids(kv, ids, unique, tokens):
    last = tokens - (len(ids) - 1) * kv.block_size if tokens is not None else kv.block_size
    return use_ids(trusted_block_ids(kv, torch.tensor(ids, dtype=torch.int64), unique, last)), last


def round_trip(kv, src, dst, tokens):
    n = len(src)
    want = gather_ref(kv, src, tokens)
    staging = ops.make_staging(kv, 2)
    chunks = [torch.full((kv.chunk_nbytes(c),), 0xA5, dtype=torch.uint8) for c in COUNTS]  # poison
    ids, last = _ids(kv, src, False, tokens)
    save_slot_chunks(kv, ids, last, chunks, COUNTS, staging=staging, gather_stream=None, copy_stream=None)
    at = 0
    for c, t in zip(COUNTS, chunks, strict=True):
        assert bits_equal(t.view(kv.dtype).view(kv.chunk_shape(c)), want[at : at + c])
        at += c
    assert at == n
    poison_blocks_(kv, dst)
    keep = [b for b in range(kv.num_blocks) if b not in dst]
    before = gather_ref(kv, keep)
    ids, last = _ids(kv, dst, True, tokens)
    load_slot_chunks(kv, ids, last, chunks, COUNTS, staging=staging, copy_stream=None, scatter_stream=None)
    assert bits_equal(gather_ref(kv, dst, tokens), want)
    assert bits_equal(gather_ref(kv, keep), before)  # no other block written


@pytest.mark.parametrize("tokens", [None, 10 * 4 + 3], ids=["full", "partial_last"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_slot_chunks_round_trip(fmt, tokens):
    kv = random_cache(fmt, 2, 26, 4, 2, 8, torch.bfloat16, DEV, seed=7)
    src = [9, 2, 4, 0, 7, 11, 13, 25, 1, 5, 6]
    dst = [3, 8, 10, 12, 14, 15, 16, 17, 18, 19, 20]
    round_trip(kv, src, dst, tokens)


@pytest.mark.parametrize("order", layout.VLLM_ORDERS)
def test_slot_chunks_round_trip_in_every_vllm_order(order):
    L, B, H, N, C = 3, 24, 2, 4, 16
    sizes = dict(L=L, B=B, H=H, N=N, C=C)
    buf = torch.randn([sizes[a] for a in order]).to(torch.bfloat16)
    logical = buf.permute(*[order.index(a) for a in "LBHNC"])
    kv = layout.vllm_paged({f"model.layers.{i}.self_attn.attn": logical[i] for i in range(L)}, order)
    src = [20, 2, 4, 0, 7, 11, 13, 23, 1, 5, 6]
    dst = [3, 8, 10, 12, 14, 15, 16, 17, 18, 19, 21]
    round_trip(kv, src, dst, 10 * N + 1)
