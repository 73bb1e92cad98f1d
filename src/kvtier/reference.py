"""PyTorch references of every op in `kvtier.ops` and `kvtier.staged`: slow, obvious, and the
definition the kernels are tested against bit for bit (`torch.equal`).

Shapes are those of `kvtier.layout`: the chunk is (n_blocks, num_layers, num_kv, *block_shape),
block-major, with zeros after `num_tokens` in the last block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvtier.layout import PagedKV


def gather_ref(
    kv: PagedKV, block_ids: torch.Tensor | Sequence[int], num_tokens: int | None = None
) -> torch.Tensor:
    """-> a new chunk (n, num_layers, num_kv, *kv.block_shape) on the cache's device."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64).to(kv.device)
    n = len(ids)
    out = torch.empty(kv.chunk_shape(n), dtype=_bits(kv.dtype), device=kv.device)
    for layer in range(kv.num_layers):
        out[:, layer] = _as_bits(kv.block_view(layer))[:, ids].transpose(0, 1)
    valid = _last_valid(kv, n, num_tokens)
    if n and valid < kv.block_size:
        out[n - 1].narrow(2 + kv.token_dim, valid, kv.block_size - valid).zero_()
    return out.view(kv.dtype)


def scatter_ref(
    kv: PagedKV, block_ids: torch.Tensor | Sequence[int], src: torch.Tensor, num_tokens: int | None = None
) -> None:
    """Write the chunk `src` (n, num_layers, num_kv, *kv.block_shape) into blocks `block_ids`;
    cache tokens past `num_tokens` in the last block are left as they were."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64).to(kv.device)
    n = len(ids)
    if src.dtype == torch.uint8:  # a byte buffer, maybe at an address no wider type may start at
        src = src.clone().view(kv.dtype)
    src = _as_bits(src.to(kv.device).view(kv.chunk_shape(n)))
    valid = _last_valid(kv, n, num_tokens)
    full = n if valid == kv.block_size else n - 1
    for layer in range(kv.num_layers):
        view = _as_bits(kv.block_view(layer))
        view[:, ids[:full]] = src[:full, layer].transpose(0, 1)
        if full < n:
            axis = 1 + kv.token_dim  # token axis of one block, (num_kv, *block_shape)
            view[:, int(ids[n - 1])].narrow(axis, 0, valid).copy_(src[n - 1, layer].narrow(axis, 0, valid))


def _bits(dtype: torch.dtype) -> torch.dtype:
    """The integer type of the same width: a copy moves bits, and integer indexing works for fp8."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_bits(t.dtype))


def _last_valid(kv: PagedKV, n: int, num_tokens: int | None) -> int:
    return kv.block_size if num_tokens is None else num_tokens - (n - 1) * kv.block_size


# ---- test and benchmark inputs -----------------------------------------------------------

FORMATS = (
    "vllm_flash",
    "vllm_stacked",
    "vllm_hnd_memory",
    "flashinfer_nhd",
    "flashinfer_hnd",
    "mla",
    "cross_layer",
)


def random_cache(
    fmt: str,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedKV:
    """A cache of random bits (NaNs included: compare with `bits_equal`) in format `fmt`:

    vllm_flash       list of (2, nb, bs, H, D)
    vllm_stacked     one (L, 2, nb, bs, H, D)
    vllm_hnd_memory  list of (2, nb, bs, H, D) views whose memory is (2, nb, H, bs, D)
    flashinfer_nhd   list of (nb, 2, bs, H, D)
    flashinfer_hnd   list of (nb, 2, H, bs, D)
    mla              list of (nb, bs, D)  (num_heads ignored)
    cross_layer      one (nb, L, 2, bs, H, D)
    """
    from kvtier import layout

    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        n = math.prod(shape) * dtype.itemsize
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g, device=device)
        return x.view(dtype).view(shape)

    L, nb, bs, H, D = num_layers, num_blocks, block_size, num_heads, head_dim
    if fmt == "vllm_flash":
        return layout.vllm_flash([rnd(2, nb, bs, H, D) for _ in range(L)])
    if fmt == "vllm_stacked":
        return layout.vllm_flash(rnd(L, 2, nb, bs, H, D))
    if fmt == "vllm_hnd_memory":
        return layout.vllm_flash([rnd(2, nb, H, bs, D).transpose(2, 3) for _ in range(L)])
    if fmt == "flashinfer_nhd":
        return layout.flashinfer([rnd(nb, 2, bs, H, D) for _ in range(L)], "NHD")
    if fmt == "flashinfer_hnd":
        return layout.flashinfer([rnd(nb, 2, H, bs, D) for _ in range(L)], "HND")
    if fmt == "mla":
        return layout.mla([rnd(nb, bs, D) for _ in range(L)])
    if fmt == "cross_layer":
        return layout.cross_layer(rnd(nb, L, 2, bs, H, D))
    raise ValueError(f"fmt: unknown {fmt!r}; expected one of {FORMATS}")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill every byte with 0xA5 (a pattern no copy produces by accident), in place; the last
    dimension must have stride 1."""
    _as_bits(t).view(torch.uint8).fill_(0xA5)
    return t


def poison_blocks_(kv: PagedKV, block_ids) -> None:
    """Poison blocks `block_ids` of every layer in place (any layout): what a copy that missed
    them would leave. (`poison_(x[:, ids])` would poison a copy made by the indexing.)"""
    chunk = torch.empty(kv.chunk_shape(len(block_ids)), dtype=kv.dtype, device=kv.device)
    scatter_ref(kv, block_ids, poison_(chunk))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the raw bits (NaN payloads and fp8 included)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_as_bits(a), _as_bits(b))


def snapshot(kv: PagedKV) -> list[torch.Tensor]:
    """A copy of every layer's bits (to compare a cache before/after)."""
    return [_as_bits(x).clone() for x in kv.layers]
