"""Paged KV-cache layouts of serving engines, as one description the copy kernels can address.

Shapes accepted (per layer, or stacked into one cross-layer tensor with `num_layers` first):

    vLLM flash-attention    (2, num_blocks, block_size, num_kv_heads, head_dim)
    FlashInfer NHD          (num_blocks, 2, block_size, num_kv_heads, head_dim)
    FlashInfer HND          (num_blocks, 2, num_kv_heads, block_size, head_dim)
    MLA latent              (num_blocks, block_size, latent_dim)
    cross-layer blocks      (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)  one tensor
    vLLM 0.33               [num_blocks, num_kv_heads, block_size, K||V] in one of six physical
                            orders (LBHNC ... BHLNC; MLA: its latent); see `vllm_paged`

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

# uint8 / int8: pages vLLM hands over as raw bytes (fp8 e4m3/e5m2, its quantized KV); a copy moves bits.
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int8)


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


# ---- vLLM 0.33: per-layer [num_blocks, num_kv_heads, block_size, K||V] views --------------

VLLM_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
_VLLM_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names of the two L-first ones


def vllm_paged(
    kv_caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | torch.Tensor,
    order: str = "LBHNC",
    *,
    mla: bool = False,
) -> PagedKV:
    """vLLM 0.33's KV cache as its workers hand it to a connector's `register_kv_caches`.

    kv_caches: per layer a 4-D view ``[B, H, N, C]`` (num_blocks, num_kv_heads, block_size, C),
        with C = 2 * head_size elements, K then V in the last dimension (no leading 2); a dict
        layer name -> view (vLLM's, in layer order), a sequence of views, or one tensor: 5-D
        ``[L, B, H, N, C]`` (every layer) or 4-D (one layer). MLA: H = 1 and C the latent
        (kv_lora_rank + rope dim, e.g. 576), or the squeezed 3-D ``[B, N, C]`` attention binds.
        bf16, fp16, fp32, fp8 (uint8 as vLLM allocates it, or float8_e4m3fn) and int8 pages.
    order: the physical order, a `KVCacheLayout` name (or the enum itself); "NHD" / "HND" are
        vLLM's aliases of LBNHC / LBHNC. Checked against the strides: ValueError naming
        `kv_caches` and `order` when they disagree, with the orders the strides do fit.
    mla: the cache is MLA's latent (4-D views with H = 1); 3-D views imply it.

    Each order, per layer, in elements (P = H*N*C, one layer's page of a block). vLLM carves
    every layer out of one buffer; a B-first order may pad the block stride when several KV
    cache groups share a block, and any larger, non-overlapping stride is accepted:

        order  memory            per-layer strides (B, H, N, C)   layer l starts at
        LBHNC  [L, B, H, N, C]   (P,     N*C,     C,   1)          l * B*P
        LBNHC  [L, B, N, H, C]   (P,     C,       H*C, 1)          l * B*P
        LHBNC  [L, H, B, N, C]   (N*C,   B*N*C,   C,   1)          l * B*P
        BLHNC  [B, L, H, N, C]   (L*P,   N*C,     C,   1)          l * P
        BLNHC  [B, L, N, H, C]   (L*P,   C,       H*C, 1)          l * P
        BHLNC  [B, H, L, N, C]   (L*P,   L*N*C,   C,   1)          l * N*C

    The host chunk (module docstring) depends only on where H sits against N, so a chunk saved
    under one order loads under another exactly when their chunk bytes agree:

        head-major  LBHNC LHBNC BLHNC BHLNC  num_kv = H pieces (N, 1, C)  block: [L, H, N, C]
        token-major LBNHC BLNHC              one piece (N, H, C)          block: [L, N, H, C]
        MLA         every order              one piece (N, C)             block: [L, N, C]

    Within a family chunks are interchangeable (and `store.chunk_layout` names them alike);
    across the two families only when H = 1. LHBNC and BHLNC keep a block's heads apart, so each
    head's (N, C) is a piece of its own, and LBHNC / BLHNC are cut the same way to share their
    chunks. MLA chunks also equal `mla()`'s. `contiguous_block_run` tells when a block is one
    DMA-able run. A uint8 cache's chunk goes to `kvtier.ops` as 1-D bytes (they read any uint8
    chunk so).

    Hazards on the caller's side: vLLM puts a layer that shares another's KV under both names
    (one tensor twice: drop the sharing layers first, or this refuses the overlap); and where it
    splits a block into a backend's smaller kernel blocks (L-first orders), its views address
    kernel blocks, so block b is kernel blocks b * r ... b * r + r - 1 (r = block_size / kernel's).

    >>> buf = torch.zeros(64, 32, 8, 16, 256, dtype=torch.bfloat16)  # BLHNC: [B, L, H, N, C]
    >>> kv = vllm_paged([buf[:, layer] for layer in range(32)], "BLHNC")
    >>> kv.chunk_shape(2), contiguous_block_run(kv)  # (n, L, H, N, 1, C); bytes of a block's run
    ((2, 32, 8, 16, 1, 256), 2097152)
    """
    name = _vllm_order(order)
    views, _ = _vllm_views(kv_caches)
    if views[0].dim() == 3:
        mla, views = True, [x.unsqueeze(1) for x in views]
    if mla and views[0].shape[1] != 1:
        raise ValueError(f"kv_caches: an MLA view is [B, 1, N, latent], got {tuple(views[0].shape)}")
    step = _layer_step(views)
    fits = _vllm_orders_fitting(views[0], len(views), step)
    if name not in fits:
        where = f"layer step {step}" if step is not None else "layers in separate buffers"
        raise ValueError(
            f"kv_caches: strides {views[0].stride()} ({where}) of {tuple(views[0].shape)} views are not "
            f"order={name!r}; they fit {', '.join(fits) or 'none of ' + ', '.join(VLLM_ORDERS)}"
        )
    if mla:
        return _build("mla", [x[:, 0] for x in views], lambda x: x[None, :, :, None, :])
    if name.index("H") < name.index("N"):  # head-major: each head's (N, C) a piece, heads as num_kv
        canon = lambda x: x.permute(1, 0, 2, 3).unsqueeze(3)  # noqa: E731 - (H, B, N, 1, C)
    else:  # token-major: the block's (N, H, C) one piece
        canon = lambda x: x.transpose(1, 2).unsqueeze(0)  # noqa: E731 - (1, B, N, H, C)
    return _build(f"vllm_{name.lower()}", views, canon)  # layer i of a dict: kv_caches[i] in messages


def contiguous_block_run(pkv: PagedKV) -> int | None:
    """Bytes of one block's run when every piece of a block (all layers, K and V) lies in one
    contiguous run in exactly the chunk's order, so that one plain DMA per block (or per run of
    consecutive ids, when `pkv.block_stride` equals the run) moves it to or from a chunk; else
    None. vLLM's BLHNC and BLNHC, `cross_layer`, MLA in B-first orders, and any one-layer cache
    give `pkv.block_nbytes`. BHLNC gives None (H > 1 and L > 1): its block is contiguous, but
    as [H, L, N, C], not the chunk's [L, H, N, C]. A partial last block is not a whole run:
    a DMA of it would copy, or overwrite, the tokens past `num_tokens`.

    >>> contiguous_block_run(cross_layer(torch.zeros(8, 4, 2, 16, 2, 64)))  # 4*2*16*2*64 floats
    65536
    """
    step, at = pkv.piece_numel, None
    for layer in range(pkv.num_layers):
        for k in range(pkv.num_kv):
            a = pkv.layer_offsets[layer] + k * pkv.kv_stride
            if at is not None and a != at + step:
                return None
            at = a
    return pkv.block_nbytes


def _vllm_order(order) -> str:
    name = getattr(order, "name", order)  # vLLM's KVCacheLayout member, or its name
    if not isinstance(name, str) or _VLLM_ALIASES.get(name, name) not in VLLM_ORDERS:
        raise ValueError(f"order: expected one of {VLLM_ORDERS} (or 'NHD' / 'HND'), got {order!r}")
    return _VLLM_ALIASES.get(name, name)


def _vllm_views(kv_caches) -> tuple[list[torch.Tensor], list[str]]:
    """(per-layer 4-D or 3-D views, the name of each in messages)."""
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() not in (3, 4, 5):
            raise ValueError(
                f"kv_caches: expected [L, B, H, N, C] or one layer's [B, H, N, C], "
                f"got {tuple(kv_caches.shape)}"
            )
        views = list(kv_caches.unbind(0)) if kv_caches.dim() == 5 else [kv_caches]
        return views, [str(i) for i in range(len(views))]
    if isinstance(kv_caches, Mapping):
        names, views = [repr(k) for k in kv_caches], list(kv_caches.values())
    else:
        views = list(kv_caches)
        names = [str(i) for i in range(len(views))]
    if not views:
        raise ValueError("kv_caches: no layers")
    for name, x in zip(names, views, strict=True):
        if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"kv_caches[{name}]: expected a 4-D [B, H, N, C] view (MLA: or [B, N, C]), got {got}"
            )
        if x.dim() != views[0].dim():
            raise ValueError(f"kv_caches[{name}]: {x.dim()}-D, layer {names[0]} is {views[0].dim()}-D")
    return views, names


def _layer_step(views: list[torch.Tensor]) -> int | None:
    """Elements from one layer's first element to the next one's, when the layers are views of
    one buffer at a uniform step (as vLLM allocates them); else None."""
    if len(views) < 2 or len({x.untyped_storage().data_ptr() for x in views}) != 1:
        return None
    es = views[0].element_size()
    steps = {b.data_ptr() - a.data_ptr() for a, b in zip(views, views[1:], strict=False)}
    if len(steps) != 1 or (s := steps.pop()) % es or s == 0:
        return None
    return s // es


def _vllm_orders_fitting(x: torch.Tensor, num_layers: int, step: int | None) -> list[str]:
    """The orders whose nesting the strides show: along the order, from outside in, each axis
    (of size > 1) steps over the whole extent of the next. Size-1 axes fit anywhere."""
    sizes = dict(zip("BHNC", x.shape, strict=True), L=num_layers)
    strides = dict(zip("BHNC", x.stride(), strict=True), L=step)
    fits = []
    for order in VLLM_ORDERS:
        if num_layers > 1 and step is None and order[0] != "L":
            continue  # a B-first order holds a block's layers together: one buffer, one step
        axes = [a for a in order if sizes[a] > 1 and strides[a] is not None]
        if all(abs(strides[o]) >= abs(strides[i]) * sizes[i] for o, i in zip(axes, axes[1:], strict=False)):
            fits.append(order)
    return fits


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
