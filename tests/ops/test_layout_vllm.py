"""vLLM 0.33's KV-cache orders (`layout.vllm_paged`) on the CPU, under Triton's interpreter.

Every cache is built the way vLLM 0.33 allocates it: one raw int8 buffer, viewed in the order's
physical shape, permuted to the logical [L, B, H, N, C] (C = K||V, in bytes), then per layer
`.view(dtype)` -> [B, H, N, C]. Random bytes, poisoned outputs, bit-exact against
`kvtier.reference`, and against the views themselves (what the chunk must hold).
"""

import random

import pytest
import torch

from kvtier import layout
from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, poison_, poison_blocks_, scatter_ref, snapshot
from kvtier.store.chunking import chunk_layout

ops = pytest.importorskip("kvtier.ops")
if not ops.INTERPRETING:
    pytest.skip("needs TRITON_INTERPRET=1 (CPU); CUDA runs test_layout_vllm_gpu.py", allow_module_level=True)

ORDERS = layout.VLLM_ORDERS
HEAD_MAJOR = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "fp32": torch.float32}
# (layers, blocks, kv heads, block_size, head_size): Llama-3-8B's per-layer page (8 heads, 16
# tokens, 128) with few blocks, and odd ones.
SHAPES = {
    "llama8b": (2, 5, 8, 16, 128),
    "bs1_h3_d64_l5": (5, 6, 3, 1, 64),
    "bs3_h1_d80_l2": (2, 7, 1, 3, 80),
    "bs3_h3_d80_l5": (5, 5, 3, 3, 80),
}


def vllm_cache(order, L, B, H, N, C, dtype, *, seed=0, pad=0, device="cpu"):
    """Per-layer views as vLLM 0.33 hands them to a connector: a dict name -> [B, H, N, C]
    (C elements; MLA: H = 1, C the latent), random bytes. pad: bytes after each block of a
    B-first order (a block stride larger than the block, as several KV cache groups give)."""
    es = dtype.itemsize
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": C * es}
    phys = [sizes[a] for a in order]
    g = torch.Generator(device=device).manual_seed(seed)
    if order[0] == "B":
        block = L * H * N * C * es
        raw = torch.randint(-128, 128, (B, block + pad), dtype=torch.int8, generator=g, device=device)
        buf = raw[:, :block].view(*phys)
    else:
        raw = torch.randint(
            -128, 128, (L * B * H * N * C * es,), dtype=torch.int8, generator=g, device=device
        )
        buf = raw.view(*phys)
    logical = buf.permute(*[order.index(a) for a in "LBHNC"])
    return {f"model.layers.{i}.self_attn.attn": logical[i].view(dtype) for i in range(L)}


def kv_of(order, shape, dtype, **kw):
    L, B, H, N, D = shape
    views = vllm_cache(order, L, B, H, N, 2 * D, dtype, **kw)
    return views, layout.vllm_paged(views, order)


def flat(t):
    return t.view(-1).view(torch.uint8)


def as_arg(kv, chunk):
    """The chunk as an op takes it: shaped, or 1-D bytes (the only form of a uint8 cache's)."""
    return flat(chunk) if kv.dtype == torch.uint8 else chunk


def expected_block(views, order, b):
    """What a chunk must hold for block b, read off the views: [L, H, N, C] for head-major
    orders, [L, N, H, C] for token-major ones."""
    xs = [x[b] if order in HEAD_MAJOR else x[b].transpose(0, 1) for x in views.values()]
    return torch.stack(xs).contiguous()


def id_sets(B, n, seed):
    rng = random.Random(seed)
    pick = rng.sample(range(B), n)
    pattern = [B - 1 - 2 * i for i in range(n)] if 2 * n <= B + 1 else list(reversed(range(n)))
    repeats = [pick[0], pick[-1], pick[0], pick[-1]][: max(n, 2)]
    return pick, pattern, repeats


def ntok_cases(N, n):
    return [None] if N == 1 else [None, (n - 1) * N + 1]


def check_gather(kv, ids, ntok):
    dst = poison_(torch.empty(kv.chunk_shape(len(ids)), dtype=kv.dtype))
    ops.gather(kv, ids, as_arg(kv, dst), num_tokens=ntok)
    assert bits_equal(dst, gather_ref(kv, ids, ntok))


def check_scatter(kv, ids, src, ntok):
    poison_blocks_(kv, ids)  # a piece the copy missed stays poisoned
    before = snapshot(kv)
    ops.scatter(kv, ids, as_arg(kv, src), num_tokens=ntok)
    got = snapshot(kv)
    restore(kv, before)
    scatter_ref(kv, ids, src, ntok)
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot(kv), strict=True))


def restore(kv, snap):
    for x, b in zip(kv.layers, snap, strict=True):
        x.view(b.dtype).copy_(b)


def random_chunk(kv, n, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (kv.chunk_nbytes(n),), dtype=torch.uint8, generator=g)
        .view(kv.dtype)
        .view(kv.chunk_shape(n))
    )


# ---- the description ------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
def test_describes_each_order(order):
    L, B, H, N, D = SHAPES["bs3_h3_d80_l5"]
    views, kv = kv_of(order, (L, B, H, N, D), torch.bfloat16)
    C = 2 * D
    assert (kv.num_layers, kv.num_blocks, kv.block_size, kv.dtype) == (L, B, N, torch.bfloat16)
    head_major = order in HEAD_MAJOR
    assert (kv.num_kv, kv.num_heads, kv.head_dim) == ((H, 1, C) if head_major else (1, H, C))
    assert kv.chunk_shape(2) == ((2, L, H, N, 1, C) if head_major else (2, L, 1, N, H, C))
    assert kv.block_nbytes == L * H * N * C * 2
    for b in (0, B - 1):  # the chunk's block is the views' block, in the family's order
        got = gather_ref(kv, [b])[0]
        assert bits_equal(got.reshape(expected_block(views, order, b).shape), expected_block(views, order, b))
    run = layout.contiguous_block_run(kv)
    assert run == (kv.block_nbytes if order in ("BLHNC", "BLNHC") else None)
    if run is not None:  # a plain copy of block b's run is its chunk
        for b in (0, 3):
            assert torch.equal(block_run(kv, b, run), flat(gather_ref(kv, [b])))


def block_run(kv, b, nbytes):
    """The `nbytes` bytes of the cache's memory from block b's first piece on."""
    base = kv.layers[kv.base]
    mem = torch.empty(0, dtype=torch.uint8, device=base.device).set_(base.untyped_storage())
    start = base.data_ptr() - mem.data_ptr() + b * kv.block_stride * kv.dtype.itemsize
    return mem[start : start + nbytes]


@pytest.mark.parametrize("order", ORDERS)
def test_legacy_names_enum_and_input_forms(order):
    views, kv = kv_of(order, SHAPES["bs3_h1_d80_l2"], torch.float16)
    seq = layout.vllm_paged(list(views.values()), order)
    assert seq.chunk_shape(3) == kv.chunk_shape(3) and seq.layer_offsets == kv.layer_offsets

    class KVCacheLayout:  # what vLLM passes: an enum member, read by its name
        name = order

    assert layout.vllm_paged(views, KVCacheLayout()).format == kv.format
    if order == "LBNHC":
        assert layout.vllm_paged(views, "NHD").format == "vllm_lbnhc"
    if order == "LBHNC":
        assert layout.vllm_paged(views, "HND").format == "vllm_lbhnc"
        stacked = torch.stack(list(views.values()))  # one [L, B, H, N, C] tensor
        assert (
            layout.vllm_paged(stacked, order).layer_offsets
            == layout.vllm_paged(list(stacked), order).layer_offsets
        )


@pytest.mark.parametrize("order", ORDERS)
def test_wrong_order_names_kv_caches_and_order(order):
    views, _ = kv_of(order, SHAPES["bs3_h3_d80_l5"], torch.bfloat16)
    for other in ORDERS:
        if other == order:
            continue
        with pytest.raises(ValueError, match=rf"kv_caches: .*not order='{other}'; they fit {order}$"):
            layout.vllm_paged(views, other)


def test_bad_arguments():
    views, _ = kv_of("LBHNC", SHAPES["bs3_h3_d80_l5"], torch.bfloat16)
    with pytest.raises(ValueError, match="order: expected one of"):
        layout.vllm_paged(views, "LBHCN")
    with pytest.raises(ValueError, match="no layers"):
        layout.vllm_paged({}, "LBHNC")
    with pytest.raises(ValueError, match=r"kv_caches\['mamba'\]: expected a 4-D"):
        layout.vllm_paged({**views, "mamba": torch.zeros(64, dtype=torch.int8)})
    with pytest.raises(ValueError, match="overlap"):  # vLLM's KV sharing: one tensor under two names
        layout.vllm_paged(
            {"a": views["model.layers.0.self_attn.attn"], "b": views["model.layers.0.self_attn.attn"]}
        )
    with pytest.raises(ValueError, match="MLA view"):
        layout.vllm_paged(views, mla=True)
    separate = [torch.zeros(4, 2, 3, 16) for _ in range(2)]  # layers in buffers of their own
    with pytest.raises(ValueError, match=r"layers in separate buffers.*not order='BLHNC'; they fit LBHNC"):
        layout.vllm_paged(separate, "BLHNC")
    assert layout.vllm_paged(separate, "LBHNC").num_layers == 2
    with pytest.raises(ValueError, match="dtype"):
        layout.vllm_paged([torch.zeros(4, 2, 3, 16, dtype=torch.int32)])


def test_padded_block_stride_and_run():
    for order in ("BLHNC", "BLNHC", "BHLNC"):
        views, kv = kv_of(order, SHAPES["bs3_h3_d80_l5"], torch.bfloat16, pad=64)
        assert kv.block_stride * 2 == kv.block_nbytes + 64
        run = layout.contiguous_block_run(kv)
        assert run == (None if order == "BHLNC" else kv.block_nbytes)
        if run is not None:
            assert torch.equal(block_run(kv, 2, run), flat(gather_ref(kv, [2])))
        check_gather(kv, [4, 0, 2], 7)
        check_scatter(kv, [1, 3], random_chunk(kv, 2, 5), 4)
    # one layer: every order's block is one run
    _, kv = kv_of("LBHNC", (1, 4, 2, 4, 8), torch.float16)
    assert layout.contiguous_block_run(kv) == kv.block_nbytes


# ---- kernels, staged ops -------------------------------------------------------------

# Every order on every odd shape in bf16; every dtype on one odd shape and on Llama's page.
CASES = [(o, s, "bf16") for o in ORDERS for s in SHAPES] + [
    (o, s, d) for o in ORDERS for s in ("bs3_h3_d80_l5", "llama8b") for d in DTYPES if d != "bf16"
]


@pytest.mark.parametrize("order, shape, dt", CASES)
def test_gather_scatter_bit_exact(order, shape, dt):
    views, kv = kv_of(order, SHAPES[shape], DTYPES[dt], seed=CASES.index((order, shape, dt)))
    B, N = kv.num_blocks, kv.block_size
    n = 3
    pick, pattern, repeats = id_sets(B, n, seed=len(order + shape + dt))
    for ntok in ntok_cases(N, n):
        check_gather(kv, pick, ntok)
        check_gather(kv, repeats, None if ntok is None else (len(repeats) - 1) * N + 1)
        check_scatter(kv, pattern, random_chunk(kv, n, 1), ntok)
    # the chunk holds the views' blocks, whatever the order of the family
    dst = torch.empty(kv.chunk_shape(n), dtype=kv.dtype)
    ops.gather(kv, pattern, as_arg(kv, dst))
    for i, b in enumerate(pattern):
        want = expected_block(views, order, b)
        assert bits_equal(dst[i].reshape(want.shape), want)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dt", ["bf16", "fp8"])
def test_staged_save_load_bit_exact(order, dt):
    _, kv = kv_of(order, SHAPES["bs3_h3_d80_l5"], DTYPES[dt], seed=4)
    staging = ops.make_staging(kv, 2)  # 5 blocks: chunks of 2, 2, 1
    ids, ntok = [4, 1, 3, 0, 2], 4 * kv.block_size + 2
    dst = poison_(torch.empty(kv.chunk_shape(5), dtype=kv.dtype))
    ops.save_staged(
        kv, ids, as_arg(kv, dst), staging=staging, gather_stream=None, copy_stream=None, num_tokens=ntok
    )
    assert bits_equal(dst, gather_ref(kv, ids, ntok))
    src, targets = random_chunk(kv, 5, 9), [2, 0, 4, 1, 3]
    poison_blocks_(kv, targets)
    before = snapshot(kv)
    ops.load_staged(
        kv, targets, as_arg(kv, src), staging=staging, copy_stream=None, scatter_stream=None, num_tokens=ntok
    )
    got = snapshot(kv)
    restore(kv, before)
    scatter_ref(kv, targets, src, ntok)
    assert all(torch.equal(a, b) for a, b in zip(got, snapshot(kv), strict=True))


# ---- MLA --------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(
    "dt, L, N, latent",
    [("bf16", 2, 16, 576), ("fp8", 5, 1, 656), ("fp16", 3, 3, 576)],  # fp8: fp8_ds_mla's 656-byte blob
)
def test_mla(order, dt, L, N, latent):
    dtype, B = DTYPES[dt], 5
    views = vllm_cache(order, L, B, 1, N, latent, dtype, seed=7)
    kv = layout.vllm_paged(views, order, mla=True)
    assert kv.is_mla and kv.chunk_shape(2) == (2, L, 1, N, latent)
    squeezed = layout.vllm_paged({k: x.squeeze(1) for k, x in views.items()}, order)  # attention's [B, N, C]
    assert squeezed.is_mla and squeezed.layer_offsets == kv.layer_offsets
    legacy = layout.mla([x.squeeze(1) for x in views.values()])  # same bytes as kvtier's mla()
    assert chunk_layout(kv) == chunk_layout(legacy) and bits_equal(
        gather_ref(kv, [3, 1]), gather_ref(legacy, [3, 1])
    )
    assert layout.contiguous_block_run(kv) == (kv.block_nbytes if order[0] == "B" else None)
    ntok = None if N == 1 else N + 1
    check_gather(kv, [3, 1], ntok)
    check_gather(kv, [2, 2, 2], None)
    check_scatter(kv, [4, 0], random_chunk(kv, 2, 3), ntok)


# ---- chunks across orders ---------------------------------------------------------------


@pytest.mark.parametrize("H", [3, 1])
def test_chunk_moves_across_orders_of_one_family(H):
    """A chunk saved under one order loads under another when their chunk bytes agree: within
    the head-major and the token-major families, and across them only for one KV head."""
    shape = (2, 4, H, 3, 8)
    caches = {o: kv_of(o, shape, torch.bfloat16, seed=i) for i, o in enumerate(ORDERS)}
    for src_order, (src_views, src) in caches.items():
        chunk = torch.empty(src.chunk_shape(2), dtype=src.dtype)
        ops.gather(src, [3, 0], chunk)
        for dst_order, (dst_views, dst) in caches.items():
            same = (src_order in HEAD_MAJOR) == (dst_order in HEAD_MAJOR) or H == 1
            assert (chunk_layout(src) == chunk_layout(dst)) == same
            if not same:
                continue
            ops.scatter(dst, [1, 2], chunk)
            for a, b in zip(src_views.values(), dst_views.values(), strict=True):
                assert bits_equal(b[1], a[3]) and bits_equal(b[2], a[0])


# ---- the engine --------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("path", ["staged", "kernel"])
@pytest.mark.parametrize("dt", ["bf16", "fp8"])
def test_engine_round_trip(order, path, dt):
    dev = SimDevice(copy_delay=0.002, launch_delay=0.001)
    try:
        _, kv = kv_of(order, SHAPES["bs3_h3_d80_l5"], DTYPES[dt], seed=11)
        pool = PinnedPool(dev, 4 * kv.chunk_nbytes(3))
        eng = TransferEngine(
            dev, kv, pool, EngineConfig(path=path, sanitize=True, staging_bytes=4 * kv.block_nbytes)
        )
        src, dst, ntok = [4, 0, 2], [1, 3, 0], 2 * kv.block_size + 1
        want = gather_ref(kv, src, ntok)
        others = [b for b in range(kv.num_blocks) if b not in dst]
        before_others = gather_ref(kv, others)
        save = eng.save(src, after=None, num_tokens=ntok)
        assert save.wait() and bits_equal(save.slot.view(kv.dtype, kv.chunk_shape(3)), want)
        poison_blocks_(kv, dst)
        load = eng.load(save.slot, dst, num_tokens=ntok)
        assert load.wait() and len(load.layer_events) == kv.num_layers
        assert bits_equal(gather_ref(kv, dst, ntok), want)
        assert bits_equal(gather_ref(kv, others), before_others)
        eng.release(save.slot)
        eng.close()
        pool.close()
    finally:
        dev.close()
