"""The batch path's copies (engine/fastpath/batch.py) over vLLM 0.33's six orders, on the CPU.

`batch.prepare` hands cudaMemcpyBatchAsync (dst, src, size) triples: copies adjacent in the cache
and in the chunk alike are joined, so a B-first block whose pieces lie in the chunk's order
(BLHNC, BLNHC, MLA) is one copy. Here the triples run through `ctypes.memmove` over CPU tensors
(what the copy engine does with them) and must give `kvtier.reference`'s bytes bit for bit, on
poisoned outputs. And `choose_path` weighs the merged copy, not the piece.
"""

import ctypes
import random

import pytest
import torch

from kvtier import layout
from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, Path, TransferEngine, choose_path
from kvtier.engine.fastpath import batch
from kvtier.engine.paths import BATCH_MIN_RUN
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_, poison_blocks_, scatter_ref, snapshot

ORDERS = layout.VLLM_ORDERS
HEAD_MAJOR = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.uint8}
# (layers, blocks, kv heads, block_size, head_size): odd counts, one head, and a Llama-3-8B page.
SHAPES = {
    "l3_h2_bs4": (3, 23, 2, 4, 8),
    "l5_h3_bs3": (5, 21, 3, 3, 16),
    "l3_h1_bs5": (3, 20, 1, 5, 8),
    "llama_page": (2, 20, 8, 16, 128),
}


def vllm_cache(order, L, B, H, N, C, dtype, *, seed=0, pad=0, mla=False, device="cpu"):
    """vLLM 0.33's per-layer views of one raw buffer in `order` (C elements per token and head;
    MLA: H = 1, C the latent), random bytes, and the PagedKV over them. pad: bytes after each
    block of a B-first order (a block stride longer than the block's run)."""
    es = dtype.itemsize
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C * es}
    phys = [sizes[a] for a in order]
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randint(-128, 128, shape, dtype=torch.int8, generator=g, device=device)  # noqa: E731
    if order[0] == "B":
        block = L * H * N * C * es
        buf = rnd(B, block + pad)[:, :block].view(*phys)
    else:
        buf = rnd(L * B * H * N * C * es).view(*phys)
    logical = buf.permute(*[order.index(a) for a in "LBHNC"])
    views = {f"model.layers.{i}.self_attn.attn": logical[i].view(dtype) for i in range(L)}
    return layout.vllm_paged(views, order, mla=mla)


def make(order, shape, dtype, *, mla=False, pad=0, seed=0):
    L, B, H, N, D = shape
    if mla:
        return vllm_cache(order, L, B, 1, N, 2 * D + 8, dtype, seed=seed, pad=pad, mla=True)
    return vllm_cache(order, L, B, H, N, 2 * D, dtype, seed=seed, pad=pad)


def emulate(dsts, srcs, sizes):
    for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)  # what the copy engine does with one descriptor


def block_copies(order, kv, mla):
    """Copies of a full block when no two blocks join: 1 where the block is one run in the
    chunk's order, else one per layer where a layer's page is (LBHNC, LBNHC), else per piece."""
    if layout.contiguous_block_run(kv) is not None:
        return 1
    per_layer = order in ("LBHNC", "LBNHC") or mla or kv.num_kv == 1
    return kv.num_layers * (1 if per_layer else kv.num_kv)


def partial_copies(order, kv, mla):
    """Copies of a partial last block: the valid rows of each piece (per head in head-major orders)."""
    return kv.num_layers * (kv.num_kv if order in HEAD_MAJOR and not mla else 1)


def spread_ids(B, n, seed):
    """n distinct ids, no two consecutive in value (so no blocks join in any order)."""
    ids = list(range(0, B, 2))
    assert len(ids) >= n, "a cache too small for the test"
    random.Random(seed).shuffle(ids)
    return ids[:n]


def round_trip(kv, src, dst, ntok):
    """Save `src` through the batch copies into a poisoned slot, load it into `dst` the same way;
    check both against the reference. Returns the save's sizes."""
    n = len(src)
    valid = kv.block_size if ntok is None else ntok - (n - 1) * kv.block_size
    host = poison_(torch.empty(kv.chunk_nbytes(n), dtype=torch.uint8))
    dsts, srcs, sizes = batch.prepare(kv, torch.tensor(src), valid, host, save=True)
    emulate(dsts, srcs, sizes)
    want = gather_ref(kv, src, ntok)  # zeros past num_tokens
    assert bits_equal(host.view(kv.dtype).view(kv.chunk_shape(n)), want)
    assert int(sizes.sum()) == (n - 1) * kv.block_nbytes + kv.block_nbytes * valid // kv.block_size

    poison_blocks_(kv, dst)  # a load that missed a byte leaves the poison
    before = snapshot(kv)
    emulate(*batch.prepare(kv, torch.tensor(dst), valid, host, save=False))
    got = snapshot(kv)
    for x, b in zip(kv.layers, before, strict=True):
        x.view(b.dtype).copy_(b)  # the poisoned cache again: now the reference loads into it
    scatter_ref(kv, dst, host.view(kv.dtype).view(kv.chunk_shape(n)), ntok)
    for a, b in zip(got, snapshot(kv), strict=True):
        assert bits_equal(a, b)  # dst as the reference writes it; past num_tokens and elsewhere untouched
    return sizes


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
@pytest.mark.parametrize("order", ORDERS)
def test_spread_ids_full_and_partial(order, mla, shape, dtype):
    kv = make(order, shape, dtype, mla=mla)
    B, N = shape[1], shape[3]
    for n, seed in ((3, 1), (5, 2)):  # odd block counts
        src, dst = spread_ids(B, 2 * n, seed)[:n], spread_ids(B, 2 * n, seed)[n:]
        for ntok in (None, (n - 1) * N + 1, n * N - 1):  # full; one token, all but one in the last
            sizes = round_trip(kv, src, dst, ntok)
            full = n if ntok is None else n - 1
            want = full * block_copies(order, kv, mla) + (
                0 if ntok is None else partial_copies(order, kv, mla)
            )
            assert len(sizes) == want, (order, n, ntok)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("order", ORDERS)
def test_b_first_block_is_one_copy_at_llama_shape(order, dtype):
    """Llama-3-8B's page (8 heads, 16 tokens, 128 dims): a B-first block whose pieces lie in the
    chunk's order is one copy of the whole block; the others keep their pages or pieces."""
    kv = make(order, SHAPES["llama_page"], dtype)
    _, hp, sizes = batch.pieces(kv, torch.tensor([5, 0, 3]), kv.block_size, 0)
    page = kv.num_kv * kv.piece_numel * dtype.itemsize  # one layer's page of a block, K and V
    if order in ("BLHNC", "BLNHC"):
        assert sizes.tolist() == [kv.block_nbytes] * 3
        assert batch.run_nbytes(kv) == kv.block_nbytes == layout.contiguous_block_run(kv)
    elif order in ("LBHNC", "LBNHC"):
        assert sizes.tolist() == [page] * (3 * kv.num_layers)
        assert batch.run_nbytes(kv) == page
    else:  # LHBNC, BHLNC: a head's (N, C) apart from the next head of its layer in the cache
        assert batch.run_nbytes(kv) == kv.piece_numel * dtype.itemsize
        assert len(sizes) == 3 * kv.num_layers * kv.num_kv
    assert hp.tolist() == sorted(hp.tolist())  # the chunk is written in order, never twice


@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
@pytest.mark.parametrize("order", ORDERS)
def test_adjacent_ids(order, mla):
    """Blocks adjacent in the cache join only when they are adjacent in the chunk too: ascending
    consecutive ids in a B-first order whose block is one run become one copy; descending ones
    (block 4 right before block 5 in the cache, after it in the chunk) and L-first orders (a
    layer's page of block 4 ends where block 5's begins, but the chunk holds block 4's next
    layer there) stay apart, and every byte lands where the reference puts it."""
    kv = make(order, SHAPES["l3_h2_bs4"], torch.bfloat16, mla=mla)
    per = block_copies(order, kv, mla)
    run = layout.contiguous_block_run(kv)
    for src, dst in (([3, 4, 5, 6], [8, 9, 10, 11]), ([6, 5, 4, 3], [11, 10, 9, 8])):
        sizes = round_trip(kv, src, dst, None)
        ascending = src[1] == src[0] + 1
        if run is not None and ascending:
            assert sizes.tolist() == [4 * kv.block_nbytes]  # adjacent on both sides: one copy
        elif order == "BHLNC" and not mla and ascending:
            assert (
                len(sizes) == 4 * per - 3
            )  # a block's last head-layer piece runs into the next block's first
        else:
            assert len(sizes) == 4 * per
        # the partial last block never joins past its valid rows
        sizes = round_trip(kv, src, dst, 3 * kv.block_size + 2)
        assert int(sizes.sum()) == 3 * kv.block_nbytes + kv.block_nbytes * 2 // kv.block_size


@pytest.mark.parametrize("order", ["BLHNC", "BLNHC"])
def test_padded_block_stride_keeps_blocks_apart(order):
    """Several KV cache groups pad a B-first block: consecutive ids then are not adjacent in the
    cache, and each block stays one copy of its own."""
    kv = make(order, SHAPES["l3_h2_bs4"], torch.bfloat16, pad=64)
    assert kv.block_stride * kv.dtype.itemsize == kv.block_nbytes + 64
    sizes = round_trip(kv, [3, 4, 5], [7, 8, 9], None)
    assert sizes.tolist() == [kv.block_nbytes] * 3
    sizes = round_trip(kv, [3, 4, 5], [7, 8, 9], 2 * kv.block_size + 1)
    assert len(sizes) == 2 + partial_copies(order, kv, False)


def test_choose_path_weighs_the_run():
    assert choose_path("save", run_nbytes=2 << 20, batch_ok=True) is Path.BATCH  # a B-first bf16 block
    assert choose_path("load", run_nbytes=BATCH_MIN_RUN, batch_ok=True) is Path.BATCH  # its fp8 twin
    assert choose_path("load", run_nbytes=BATCH_MIN_RUN - 1, batch_ok=True) is Path.STAGED
    assert choose_path("save", run_nbytes=64 << 10, batch_ok=True) is Path.STAGED  # an L-first page
    assert choose_path("save", run_nbytes=2 << 20, batch_ok=False) is Path.STAGED  # no API: never
    got = choose_path("load", run_nbytes=2 << 20, per_layer=True, compute_beside=False, batch_ok=True)
    assert got is Path.BATCH  # a block's layers travel as one run
    with pytest.raises(ValueError, match="direction"):
        choose_path("sideways", run_nbytes=0)


@pytest.mark.parametrize("order", ORDERS)
def test_engine_passes_the_run(order):
    """The engine weighs its mover's run: a B-first block of the Llama-3-8B shape takes the batch
    path where the mover has one, an L-first page stays staged. The sim mover has no batch path;
    here it is told it has one, with the run the CUDA mover computes."""
    L, B, H, N, D = 32, 3, 8, 16, 128
    kv = vllm_cache(order, L, B, H, N, 2 * D, torch.bfloat16)
    for has_batch in (False, True):
        dev = SimDevice()
        pool = PinnedPool(dev, kv.chunk_nbytes(1))
        eng = TransferEngine(dev, kv, pool, EngineConfig())
        try:
            assert eng.mover.batch_run_nbytes == 0  # the sim mover's: nothing to weigh
            if has_batch:
                eng.mover.batch_available, eng.mover.batch_run_nbytes = True, batch.run_nbytes(kv)
                eng.mover.check_path = lambda p: None
            b_first = has_batch and order in ("BLHNC", "BLNHC")
            assert eng.load_path() is (Path.BATCH if b_first else Path.STAGED)
        finally:
            eng.close()
            pool.close()
            dev.close()


def test_merge_joins_only_what_is_adjacent_on_both_sides():
    t = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    # 0-1 adjacent on both sides; 1-2 in the cache only; 2-3 in the chunk only; 3-4 on both
    paged, host, sizes = t(0, 10, 20, 100, 110), t(0, 10, 50, 60, 70), t(10, 10, 10, 10, 10)
    p, h, s = batch.merge(paged, host, sizes)
    assert p.tolist() == [0, 20, 100] and h.tolist() == [0, 50, 60] and s.tolist() == [20, 10, 20]
    p, h, s = batch.merge(t(5), t(7), t(3))  # one copy: as it is
    assert (p.tolist(), h.tolist(), s.tolist()) == ([5], [7], [3])
