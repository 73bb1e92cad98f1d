"""Paged KV-cache layouts of serving engines, as one description the copy kernels can address.

Shapes accepted (per layer, or stacked into one cross-layer tensor with `num_layers` first):

    vLLM flash-attention    (2, num_blocks, block_size, num_kv_heads, head_dim)
    FlashInfer NHD          (num_blocks, 2, block_size, num_kv_heads, head_dim)
    FlashInfer HND          (num_blocks, 2, num_kv_heads, block_size, head_dim)
    MLA latent              (num_blocks, block_size, latent_dim)
    cross-layer blocks      (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)  one tensor

Any strides are accepted as long as one K or V block of one layer (a "piece") is contiguous
in memory, token-major (NHD: block_size, heads, dim) or head-major (HND: heads, block_size,
dim). So a vLLM cache whose logical shape is NHD but whose memory is HND (vLLM's
`get_kv_cache_stride_order`) is an HND piece. Pieces must not overlap.

Host chunk format (what gather writes and scatter reads, in GPU or host memory)::

    chunk[i, l, kv] = piece of block block_ids[i], layer l, K (kv=0) or V (kv=1)
    shape (n_blocks, num_layers, num_kv, *block_shape), contiguous, the cache's dtype

It is **block-major**: all layers of one block are adjacent, blocks in request order. Why:
(1) any run of consecutive blocks is one contiguous byte range, so the staged path moves a
chunk of any size with one large DMA and a chunk saved by the UVA kernel loads through the
staged path and vice versa — the chunk size is a tuning knob, not part of the format;
(2) a token prefix of a request is a byte prefix of its chunk, which is what a prefix store
keys on; (3) per-layer pipelined loads still work (strided reads, one piece per block).
Pieces keep the cache's physical order (`block_shape`: NHD (bs, heads, dim), HND (heads, bs,
dim), MLA (bs, latent)), so a copy is raw bytes. When the token count is not a multiple of
`block_size`, the last block keeps its full slot; tokens past the end are zero in the chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


@dataclass(frozen=True, slots=True, eq=False)
class PagedKV:
    """A paged KV cache described for the copy kernels; build it with the functions below.

    layers: per layer, a view (num_kv, num_blocks, block_size, num_heads, head_dim) of the
    engine's tensor (MLA: (1, num_blocks, block_size, 1, latent_dim)). Strides in elements.
    """

    format: str
    layers: tuple[torch.Tensor, ...]
    interior: str  # "NHD" (token-major piece) or "HND" (head-major piece)
    kv_stride: int  # elements from K to V of one block, one layer
    block_stride: int  # elements from block b to b + 1
    layer_offsets: tuple[int, ...]  # elements from layers[base] to each layer's (kv 0, block 0)
    base: int  # index of the layer at the lowest address
    plans: dict = field(default_factory=dict, repr=False)  # launch plans cached by ops, per alignment

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv(self) -> int:
        return self.layers[0].shape[0]

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[1]

    @property
    def block_size(self) -> int:
        return self.layers[0].shape[2]

    @property
    def num_heads(self) -> int:
        return self.layers[0].shape[3]

    @property
    def head_dim(self) -> int:
        return self.layers[0].shape[4]

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def is_mla(self) -> bool:
        return self.format == "mla"

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Physical shape of one K or V block of one layer (a piece)."""
        bs, h, d = self.block_size, self.num_heads, self.head_dim
        if self.is_mla:
            return (bs, d)
        return (h, bs, d) if self.interior == "HND" else (bs, h, d)

    @property
    def token_dim(self) -> int:
        """Index of the token axis in `block_shape`."""
        return 1 if self.interior == "HND" and not self.is_mla else 0

    @property
    def piece_numel(self) -> int:
        return self.block_size * self.num_heads * self.head_dim

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers, K and V: one block's slot in a chunk."""
        return self.num_layers * self.num_kv * self.piece_numel * self.dtype.itemsize

    def chunk_shape(self, n_blocks: int) -> tuple[int, ...]:
        return (n_blocks, self.num_layers, self.num_kv, *self.block_shape)

    def chunk_nbytes(self, n_blocks: int) -> int:
        return n_blocks * self.block_nbytes

    def block_view(self, layer: int) -> torch.Tensor:
        """Layer `layer` as (num_kv, num_blocks, *block_shape), physical order."""
        x = self.layers[layer]
        if self.interior == "HND":
            x = x.transpose(2, 3)
        return x.reshape(self.num_kv, self.num_blocks, *self.block_shape)


def vllm_flash(kv_caches: Sequence[torch.Tensor] | torch.Tensor) -> PagedKV:
    """vLLM flash-attention: per layer (2, num_blocks, block_size, num_kv_heads, head_dim),
    or one tensor (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).

    >>> kv = vllm_flash([torch.zeros(2, 64, 16, 8, 128, dtype=torch.bfloat16) for _ in range(32)])
    >>> kv.chunk_shape(4), kv.block_nbytes  # (n, layers, K/V, block_size, heads, dim); bytes per block
    ((4, 32, 2, 16, 8, 128), 2097152)
    """
    return _build("vllm_flash", _per_layer(kv_caches, 5, "kv_caches"), lambda x: x)


def flashinfer(kv_caches: Sequence[torch.Tensor] | torch.Tensor, kv_layout: str = "NHD") -> PagedKV:
    """FlashInfer: per layer (num_blocks, 2, block_size, heads, dim) for NHD or
    (num_blocks, 2, heads, block_size, dim) for HND; or one tensor with num_layers first.

    >>> kv = flashinfer(torch.zeros(32, 64, 2, 8, 16, 128, dtype=torch.float16), "HND")
    >>> kv.num_layers, kv.block_shape  # a piece keeps the cache's order: (heads, block_size, dim)
    (32, (8, 16, 128))
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    if kv_layout == "NHD":
        return _build("flashinfer_nhd", _per_layer(kv_caches, 5, "kv_caches"), lambda x: x.transpose(0, 1))
    canon = lambda x: x.transpose(0, 1).transpose(2, 3)  # (2, nb, H, bs, D) -> (2, nb, bs, H, D)
    return _build("flashinfer_hnd", _per_layer(kv_caches, 5, "kv_caches"), canon)


def mla(kv_caches: Sequence[torch.Tensor] | torch.Tensor) -> PagedKV:
    """MLA latent cache: per layer (num_blocks, block_size, latent_dim), or one tensor
    (num_layers, num_blocks, block_size, latent_dim). One "KV" per block (num_kv = 1).

    >>> kv = mla([torch.zeros(16, 64, 576, dtype=torch.bfloat16) for _ in range(61)])
    >>> kv.chunk_shape(2)  # (n, layers, 1, block_size, latent_dim)
    (2, 61, 1, 64, 576)
    """
    return _build("mla", _per_layer(kv_caches, 3, "kv_caches"), lambda x: x[None, :, :, None, :])


def cross_layer(kv_cache: torch.Tensor) -> PagedKV:
    """One tensor (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim): all layers
    of a block adjacent (vLLM's cross-layer KV blocks, LMCache's KV-blocks layout).

    >>> kv = cross_layer(torch.zeros(64, 32, 2, 16, 8, 128, dtype=torch.bfloat16))
    >>> kv.format, kv.chunk_shape(1)
    ('cross_layer', (1, 32, 2, 16, 8, 128))
    """
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 6:
        raise ValueError(
            "kv_cache: expected one 6-D tensor (num_blocks, num_layers, 2, block_size, heads, dim)"
        )
    layers = [kv_cache[:, layer] for layer in range(kv_cache.shape[1])]
    return _build("cross_layer", layers, lambda x: x.transpose(0, 1))


def _per_layer(kv_caches, ndim: int, name: str) -> list[torch.Tensor]:
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() != ndim + 1:
            raise ValueError(
                f"{name}: expected a {ndim + 1}-D cross-layer tensor, got {tuple(kv_caches.shape)}"
            )
        return list(kv_caches.unbind(0))
    layers = list(kv_caches)
    if not layers:
        raise ValueError(f"{name}: no layers")
    for i, x in enumerate(layers):
        if not isinstance(x, torch.Tensor) or x.dim() != ndim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}[{i}]: expected a {ndim}-D tensor, got {got}")
    return layers


def _build(fmt: str, tensors: list[torch.Tensor], canon) -> PagedKV:
    layers = tuple(canon(x) for x in tensors)
    first = layers[0]
    for i, x in enumerate(layers):
        if x.shape != first.shape or x.stride() != first.stride():
            raise ValueError(
                f"kv_caches[{i}]: shape/strides {tuple(x.shape)}/{x.stride()} differ from layer 0"
            )
        if x.dtype != first.dtype:
            raise ValueError(f"kv_caches[{i}]: dtype {x.dtype} differs from layer 0 ({first.dtype})")
        if x.device != first.device:
            raise ValueError(f"kv_caches[{i}]: device {x.device} differs from layer 0 ({first.device})")
    if first.dtype not in DTYPES:
        raise ValueError(f"kv_caches: dtype {first.dtype} not supported; expected one of {DTYPES}")
    nkv, nb, bs, h, d = first.shape
    if min(nkv, nb, bs, h, d) < 1:
        raise ValueError(f"kv_caches: empty dimension in {tuple(first.shape)}")
    skv, sb, st, sh, sd = first.stride()
    if d > 1 and sd != 1:
        raise ValueError(f"kv_caches: head_dim must be contiguous (stride 1), got stride {sd}")
    if (bs == 1 or st == h * d) and (h == 1 or sh == d):
        interior = "NHD"
    elif (h == 1 or sh == bs * d) and (bs == 1 or st == d):
        interior = "HND"
    else:
        raise ValueError(
            f"kv_caches: a block must be contiguous as (block_size, heads, dim) or (heads, block_size, dim); "
            f"strides (token {st}, head {sh}, dim {sd}) are neither"
        )
    piece = bs * h * d
    dims = [(nb, sb)] + ([(nkv, skv)] if nkv > 1 else [])
    esize = first.element_size()
    addrs = [x.data_ptr() for x in layers]
    for i, a in enumerate(addrs):
        if (a - addrs[0]) % esize:
            raise ValueError(f"kv_caches[{i}]: address not a whole number of elements from layer 0")
    base = min(range(len(layers)), key=lambda i: addrs[i])
    offsets = tuple((a - addrs[base]) // esize for a in addrs)
    if not _disjoint_layers(layers, offsets, dims, piece):
        raise ValueError(
            "kv_caches: pieces of the cache overlap (a layer given twice, or strides that alias)"
        )
    return PagedKV(fmt, layers, interior, skv if nkv > 1 else 0, sb, offsets, base)


def _disjoint_layers(layers, offsets, dims, piece) -> bool:
    """No two (layer, kv, block) pieces share an element (sufficient test, true for real layouts)."""
    if not _dims_disjoint(dims, piece):
        return False
    if len(layers) == 1:
        return True
    span = piece + sum((n - 1) * abs(s) for n, s in dims)
    lo = min(min(0, (n - 1) * s) for n, s in dims) if dims else 0
    ranges = sorted((o + lo, o + lo + span) for o in offsets)
    if all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:], strict=False)):
        return True  # separate allocations (vLLM's list of per-layer tensors)
    steps = {b - a for a, b in zip(offsets, offsets[1:], strict=False)}
    if len(steps) != 1 or len({x.untyped_storage().data_ptr() for x in layers}) != 1:
        return False
    return _dims_disjoint(dims + [(len(layers), steps.pop())], piece)  # one cross-layer tensor


def _dims_disjoint(dims: list[tuple[int, int]], piece: int) -> bool:
    extent = piece
    for n, s in sorted(((n, abs(s)) for n, s in dims if n > 1), key=lambda t: t[1]):
        if s < extent:
            return False
        extent = s * (n - 1) + extent
    return True


def gcd_bytes(pkv: PagedKV) -> int:
    """Largest power of two (<= 16) dividing every byte address and stride the kernels use."""
    esize = pkv.dtype.itemsize
    inner = pkv.head_dim if pkv.interior == "HND" and pkv.block_size > 1 else pkv.num_heads * pkv.head_dim
    base = pkv.layers[pkv.base]
    vals = [inner * esize, pkv.kv_stride * esize, pkv.block_stride * esize, base.data_ptr()]
    vals.append(base.untyped_storage().data_ptr())  # the kernel addresses the base through its storage
    vals += [o * esize for o in pkv.layer_offsets]
    g = 16
    for v in vals:
        g = math.gcd(g, v)
    return g
