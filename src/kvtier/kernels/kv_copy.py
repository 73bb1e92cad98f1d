"""Paged KV cache <-> contiguous chunk, every layer (K and V) in one launch.

One kernel, two variants (`GATHER`): gather reads blocks of a paged cache and writes them
densely into a chunk; scatter is the inverse. The kernel moves raw bits in integer "units"
(int8/int16/int32, chosen by the wrapper from alignment), so bf16, fp16, fp8 and fp32 need no
special case and 16-byte vector loads/stores happen wherever the wrapper proved alignment
(`VEC` units = 16 bytes). Alignment reaches the compiler through arithmetic, not hints: every
runtime offset arrives in multiples of `VEC` units and is multiplied by the constexpr `VEC`
here, and segment lengths are constexpr multiples of it (a `tl.multiple_of` hint on a sum can
be folded away together with the sum it sits on).

Addressing (all in units). One K or V block of one layer ("piece") is `O` segments of
`BS * I` contiguous units: NHD blocks are one segment (O = 1, I = heads * dim), HND blocks are
one segment per head (O = heads, I = dim); tokens are `I` units apart inside a segment.

    paged piece (l, kv, block b):  paged + VEC * (layer_off[l] + kv * kv_stride + b * block_stride)
    chunk piece (i, l, kv):        chunk + ((i * num_layers + l) * KV + kv) * O * BS * I
    with TABLE (several chunks):   chunk + VEC * chunk_off[i] + (l * KV + kv) * O * BS * I

TABLE: the blocks of one call come from several chunks anywhere in memory (the pinned slots of a
request's chunks, one launch per layer for all of them): block i's pieces start `chunk_off[i]`
VEC-units from `chunk` (an offset, not a pointer: it may point into another allocation, which
UVA addresses like any other).

Block ids checked lazily (`CHECK`, ids still on the GPU when the call was made, never read back
by the host): an id out of range (CHECK 1 and 2) or, for a scatter, given more than once (CHECK 2,
after `block_id_claim_kernel` marked every id of the call in `claim`) is neither read nor written:
its rows are masked off and the bad ids are counted into the error flag `err` [2] (out of range,
repeated), which the host reads at its next completion check. CHECK 0: the host checked the ids.

A call may copy a range of layers (`layer0`, `n_layers`; all of them by default): the chunk
keeps its full block-major shape and only that layer range's pieces are touched.

Work is a list of rows (one segment, or one `COLS`-wide slice of it); a program copies
`ROWS x COLS` units per step and walks the tiles grid-stride, so the launch may use fewer
programs than tiles (a persistent grid that leaves SMs to other work). Only the first
`last_valid` tokens of the call's last block are real: gather writes zeros after them in the
chunk, scatter never touches them in the cache.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_blocks", "last_valid", "layer0", "n_layers", "stamp"])  # any size
def kv_copy_kernel(
    paged,  # *unit: base of the paged cache (the layer at the lowest address)
    layer_off,  # *int64 [num_layers]: VEC-units from `paged` to layer l's (kv 0, block 0)
    block_ids,  # *int32 or *int64 [n_blocks]: block ids (checked by the wrapper unless CHECK)
    chunk,  # *unit: contiguous chunk (n_blocks, num_layers, KV, O, BS, I), GPU or pinned host
    chunk_off,  # *int64 [n_blocks]: with TABLE, VEC-units from `chunk` to block i (else unused)
    err,  # *int32 [2]: with CHECK, bad ids counted here: out of range, repeated (else unused)
    claim,  # *int32 [num_blocks]: with CHECK 2, `stamp` where block b is named once (else unused)
    n_blocks,  # blocks in this call (>= 1)
    last_valid,  # valid tokens in the last block of this call, 1..BS
    num_layers,  # layers in the cache (and in each block of the chunk)
    layer0,  # first layer this call copies (a per-layer load copies one layer per launch)
    n_layers,  # layers this call copies: layer0 .. layer0 + n_layers - 1
    kv_stride,  # VEC-units from K to V of one block (unused when KV == 1)
    block_stride,  # VEC-units from block b to block b + 1
    num_blocks,  # blocks in the cache (the bound of a lazily checked id)
    stamp,  # with CHECK 2: this call's mark in `claim`
    KV: tl.constexpr,  # 2 (K and V) or 1 (MLA latent)
    O: tl.constexpr,  # segments per piece
    BS: tl.constexpr,  # tokens per block
    I: tl.constexpr,  # units per token inside a segment
    COLS: tl.constexpr,  # units per row slice (power of 2)
    ROWS: tl.constexpr,  # rows per tile (power of 2)
    VEC: tl.constexpr,  # alignment of every row start and token boundary, in units
    GATHER: tl.constexpr,  # True: paged -> chunk; False: chunk -> paged
    TABLE: tl.constexpr,  # True: block i of the chunk side starts at chunk_off[i] (several chunks)
    CHECK: tl.constexpr,  # 0: ids checked by the host; 1: range checked here; 2: range and claims
):
    SEG: tl.constexpr = BS * I
    NCT: tl.constexpr = (SEG + COLS - 1) // COLS  # row slices per segment
    lk_count = n_layers * KV
    n_rows = n_blocks * lk_count * (O * NCT)  # < 2**31, checked by the wrapper
    n_tiles = tl.cdiv(n_rows, ROWS)
    cols = tl.arange(0, COLS)
    tile = tl.program_id(0)
    # `while`, not `for ... in range(pid, n_tiles, nprog)`: the interpreter (numpy 2) cannot turn a
    # runtime loop bound into a Python int; the compiled loop is the same either way.
    while tile < n_tiles:
        r = tile * ROWS + tl.arange(0, ROWS)
        row_ok = r < n_rows
        ct = r % NCT
        s = r // NCT  # segment index among this call's: ((i * n_layers + l') * KV + kv) * O + o
        o = s % O
        lk = (s // O) % lk_count
        i = (s // O) // lk_count
        layer = layer0 + lk // KV
        blk = tl.load(block_ids + i, mask=row_ok, other=0).to(tl.int64)
        if CHECK > 0:
            id_ok = (blk >= 0) & (blk < num_blocks)
            if CHECK == 2:  # named once in this call (the claim kernel ran before, in stream order)
                mark = tl.load(claim + blk, mask=row_ok & id_ok, other=0)
                id_ok = id_ok & (mark == stamp)
            else:  # count each bad id once: at the first row of its block
                first = row_ok & (ct == 0) & (s % (O * lk_count) == 0)
                n_bad = tl.sum((first & ~id_ok).to(tl.int32))
                if n_bad > 0:
                    tl.atomic_add(err, n_bad)
            row_ok = row_ok & id_ok
            blk = tl.where(id_ok, blk, 0)
        loff = tl.load(layer_off + layer, mask=row_ok, other=0)
        src_row = (loff + (lk % KV).to(tl.int64) * kv_stride + blk * block_stride) * VEC
        src_row += o.to(tl.int64) * SEG
        # Segment in the chunk, which always holds every layer of a block (block-major).
        if TABLE:
            base = tl.load(chunk_off + i, mask=row_ok, other=0) * VEC
            dst_row = base + (((layer * KV + lk % KV) * O + o) * SEG).to(tl.int64)
        else:
            dst_row = (((i.to(tl.int64) * num_layers + layer) * KV + lk % KV) * O + o) * SEG
        nvalid = tl.where(i == n_blocks - 1, last_valid * I, SEG)
        c = (ct * COLS)[:, None] + cols[None, :]  # unit offset inside the segment
        valid = row_ok[:, None] & (c < nvalid[:, None])
        p_off = src_row[:, None] + c
        c_off = dst_row[:, None] + c
        if GATHER:
            x = tl.load(paged + p_off, mask=valid, other=0)
            tl.store(chunk + c_off, x, mask=row_ok[:, None] & (c < SEG))
        else:
            x = tl.load(chunk + c_off, mask=valid)
            tl.store(paged + p_off, x, mask=valid)
        tile += tl.num_programs(0)


@triton.jit(do_not_specialize=["n_blocks", "stamp"])
def block_id_claim_kernel(
    block_ids,  # *int32 or *int64 [n_blocks]: the ids of one scatter, not checked by the host
    claim,  # *int32 [num_blocks]: marks; earlier calls left smaller stamps
    err,  # *int32 [2]: bad ids counted here: out of range, repeated
    n_blocks,
    num_blocks,
    stamp,  # even, larger than every earlier call's: block b ends as stamp (named once) or stamp + 1
    BLOCK: tl.constexpr,
):
    """Before a lazily checked scatter (CHECK 2): mark every in-range id in `claim` and count the
    bad ones. An id named twice ends as stamp + 1, so the copy skips every copy of it."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_blocks
    blk = tl.load(block_ids + i, mask=live, other=0).to(tl.int64)
    ok = live & (blk >= 0) & (blk < num_blocks)
    blk = tl.where(ok, blk, 0)
    prev = tl.atomic_max(claim + blk, stamp, mask=ok)
    again = ok & (prev >= stamp)  # someone in this call named it first
    tl.atomic_max(claim + blk, stamp + 1, mask=again)
    n_out = tl.sum((live & ~ok).to(tl.int32))
    n_again = tl.sum(again.to(tl.int32))
    if n_out > 0:
        tl.atomic_add(err, n_out)
    if n_again > 0:
        tl.atomic_add(err + 1, n_again)
