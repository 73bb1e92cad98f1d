"""Layouts: every engine format described right (shapes, interior order, strides), bad ones refused."""

import pytest
import torch

from kvtier import layout
from kvtier.reference import FORMATS, random_cache

L, NB, BS, H, D = 3, 6, 4, 2, 32


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_describe_the_same_cache_shape(fmt):
    kv = random_cache(fmt, L, NB, BS, H, D, torch.bfloat16)
    heads, kvn = (1, 1) if fmt == "mla" else (H, 2)
    assert (kv.num_layers, kv.num_kv, kv.num_blocks, kv.block_size, kv.num_heads) == (L, kvn, NB, BS, heads)
    assert kv.head_dim == D and kv.dtype == torch.bfloat16
    assert kv.chunk_shape(5) == (5, L, kvn, *kv.block_shape)
    assert kv.chunk_nbytes(5) == 5 * L * kvn * BS * heads * D * 2
    hnd = fmt in ("flashinfer_hnd", "vllm_hnd_memory")
    assert kv.interior == ("HND" if hnd else "NHD")
    assert kv.block_shape == ((H, BS, D) if hnd else (BS, D) if fmt == "mla" else (BS, H, D))
    for layer in range(L):
        v = kv.block_view(layer)
        assert v.shape == (kvn, NB, *kv.block_shape)
        assert v[0, 0].is_contiguous()  # a piece is one contiguous run


def test_block_view_is_the_engine_tensor():
    t = [torch.randn(NB, 2, H, BS, D) for _ in range(L)]
    kv = layout.flashinfer(t, "HND")
    assert torch.equal(kv.block_view(1)[1, 4], t[1][4, 1])  # V of block 4, (heads, bs, dim)
    v = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    kv = layout.vllm_flash(v)
    assert torch.equal(kv.block_view(2)[0, 3], v[2][0, 3])
    m = torch.randn(L, NB, BS, 576)
    kv = layout.mla(m)
    assert kv.num_kv == 1 and torch.equal(kv.block_view(1)[0, 5], m[1, 5])


def test_layer_offsets_and_strides():
    x = torch.zeros(NB, L, 2, BS, H, D, dtype=torch.float16)
    kv = layout.cross_layer(x)
    piece = BS * H * D
    assert kv.kv_stride == piece and kv.block_stride == L * 2 * piece
    assert kv.layer_offsets == tuple(2 * piece * i for i in range(L)) and kv.base == 0
    layers = [torch.zeros(2, NB, BS, H, D) for _ in range(L)]
    kv = layout.vllm_flash(layers)
    assert kv.layer_offsets[kv.base] == 0 and min(kv.layer_offsets) == 0


def test_shapes_of_a_list_must_agree():
    with pytest.raises(ValueError, match=r"kv_caches\[1\]"):
        layout.vllm_flash([torch.zeros(2, NB, BS, H, D), torch.zeros(2, NB, BS, H, D + 1)])
    with pytest.raises(ValueError, match=r"kv_caches\[1\]: dtype"):
        layout.vllm_flash([torch.zeros(2, NB, BS, H, D), torch.zeros(2, NB, BS, H, D, dtype=torch.float16)])
    with pytest.raises(ValueError, match=r"kv_caches\[0\]: expected a 5-D"):
        layout.vllm_flash([torch.zeros(NB, BS, H, D)])
    with pytest.raises(ValueError, match="no layers"):
        layout.vllm_flash([])


def test_refuses_bad_strides_dtypes_and_aliasing():
    with pytest.raises(ValueError, match="contiguous"):
        layout.vllm_flash([torch.zeros(2, NB, BS, D, H).transpose(3, 4)])  # head_dim not innermost
    with pytest.raises(ValueError, match="neither"):
        layout.vllm_flash([torch.zeros(2, NB, BS, H, 2 * D)[..., :D]])  # gaps inside a block
    with pytest.raises(ValueError, match="dtype"):
        layout.vllm_flash([torch.zeros(2, NB, BS, H, D, dtype=torch.int32)])
    x = torch.zeros(2, NB, BS, H, D)
    with pytest.raises(ValueError, match="overlap"):
        layout.vllm_flash([x, x])  # one layer given twice: a scatter would race
    with pytest.raises(ValueError, match="overlap"):
        layout.vllm_flash([x[:, :1].expand(2, NB, BS, H, D)])  # every block is block 0
    with pytest.raises(ValueError, match="kv_layout"):
        layout.flashinfer([torch.zeros(NB, 2, BS, H, D)], "NDH")
    with pytest.raises(ValueError, match="6-D"):
        layout.cross_layer(torch.zeros(NB, L, 2, BS, H))


def test_size_one_dims_are_either_order():
    kv = layout.vllm_flash([torch.zeros(2, NB, 1, H, D)])  # one token per block
    assert kv.interior == "NHD" and kv.block_shape == (1, H, D)
    kv = layout.flashinfer([torch.zeros(NB, 2, 1, BS, D)], "HND")  # one head
    assert kv.interior == "NHD" and kv.block_shape == (BS, 1, D)
