"""A decode batch stand-in: the GPU work of one decode step of an 8B model over a paged cache.

What kvtier's transfers must not slow is the step that decodes the requests already running.
This stand-in does that step's work at the Llama-3-8B shape, so the copies beside it meet the
same demand on HBM and SMs as beside a real model:

    DecodeBatch(cache, tables, lengths)   the batch: its sequences' blocks in vLLM's 4-D view
    .step()                                one decode step (queued on the current stream)
    .capture() / .replay()                 the step as one CUDA graph, as vLLM replays it

Per layer (32): the projections of one token per sequence (q, k, v: [S, 4096] @ [4096, 6144];
the output projection; the MLP's [4096, 28672] and [14336, 4096]), and paged attention of each
sequence's new query over its whole context, read from the cache through its block table with a
Triton kernel (`paged_decode`). The layers share one set of weights: 436 MiB a layer, far past
the L2, so each layer reads its weights from HBM as distinct weights would, in 0.4 GiB of memory
instead of 14. The step reads the cache and writes nothing to it (one token per sequence and
layer would be a negligible write), so every step does the same work and replays one graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

HIDDEN, Q_HEADS, MLP = 4096, 32, 14336  # Llama-3-8B
GROUP_PAD = 16  # tl.dot's least M: a GQA group of query heads padded to it


@triton.jit
def paged_decode(
    q_ptr,  # [S, QH, D]
    out_ptr,  # [S, QH, D]
    cache_ptr,  # one layer of vLLM's 4-D view [B, H, N, K||V]
    table_ptr,  # [S, max_blocks] int32
    len_ptr,  # [S] int32
    stride_b,
    stride_h,
    stride_n,
    table_stride,
    scale,
    QH: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    N: tl.constexpr,
    BPI: tl.constexpr,
):
    """One program per (sequence, KV head): its G query heads over the sequence's context, BPI
    blocks a step, online softmax (flash decoding without the split)."""
    s, h = tl.program_id(0), tl.program_id(1)
    T: tl.constexpr = BPI * N
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    t = tl.arange(0, T)
    heads = h * G + g
    q = tl.load(q_ptr + (s * QH + heads)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
    length = tl.load(len_ptr + s)
    m = tl.full([GP], float("-inf"), tl.float32)
    lsum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    start = 0
    # `while`, not `for ... in range(0, length, T)`: the interpreter (numpy 2) cannot turn a
    # runtime loop bound into a Python int; the compiled loop is the same either way.
    while start < length:
        tok = start + t
        live = tok < length
        blk = tl.load(table_ptr + s * table_stride + tok // N, mask=live, other=0)
        row = cache_ptr + blk.to(tl.int64) * stride_b + h * stride_h + (tok % N) * stride_n
        k = tl.load(row[:, None] + d[None, :], mask=live[:, None], other=0.0)
        v = tl.load(row[:, None] + D + d[None, :], mask=live[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(live[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
        start += T
    o = acc / lsum[:, None]
    tl.store(
        out_ptr + (s * QH + heads)[:, None] * D + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=(g < G)[:, None],
    )


class DecodeBatch:
    """cache: vLLM 0.33's logical view ``[L, B, H, N, K||V]`` of the paged cache (any physical
    order; the last dim contiguous). tables: ``[S, max_blocks]`` int32 block ids of each sequence,
    on the cache's device. lengths: ``[S]`` int32 context tokens per sequence (at most
    ``max_blocks * N``). hidden / mlp / q_heads: the model's projections (default Llama-3-8B's;
    small ones for CPU tests)."""

    def __init__(
        self,
        cache: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
        *,
        hidden: int = HIDDEN,
        mlp: int = MLP,
        q_heads: int = Q_HEADS,
        blocks_per_iter: int = 4,
    ) -> None:
        L, _, H, N, C = cache.shape
        if cache.stride(-1) != 1:
            raise ValueError(f"cache: the K||V dim must be contiguous, got strides {cache.stride()}")
        if q_heads % H or q_heads // H > GROUP_PAD:
            raise ValueError(
                f"q_heads: a multiple of the {H} KV heads, at most {GROUP_PAD * H}, got {q_heads}"
            )
        if blocks_per_iter * N < 16:
            raise ValueError(
                f"blocks_per_iter: its tokens ({blocks_per_iter} x {N}) at least 16, tl.dot's least K"
            )
        if tables.dtype != torch.int32 or lengths.dtype != torch.int32:
            raise ValueError("tables, lengths: int32 tensors")
        if int(lengths.max()) > tables.shape[1] * N:
            raise ValueError(f"lengths: at most {tables.shape[1] * N} tokens (the tables' blocks)")
        self.cache, self.tables, self.lengths = cache, tables, lengths
        self.layers, self.heads, self.block, self.dim = L, H, N, C // 2
        self.q_heads, self.bpi = q_heads, blocks_per_iter
        S, dev, dt = tables.shape[0], cache.device, cache.dtype
        g = torch.Generator(device=dev).manual_seed(0)

        def w(i: int, o: int) -> torch.Tensor:
            return torch.randn(i, o, device=dev, dtype=dt, generator=g) / i**0.5

        qkv = (q_heads + 2 * H) * self.dim
        self.w_qkv, self.w_o = w(hidden, qkv), w(q_heads * self.dim, hidden)
        self.w_up, self.w_down = w(hidden, 2 * mlp), w(mlp, hidden)
        self.mlp = mlp
        self.x = torch.randn(S, hidden, device=dev, dtype=dt, generator=g)
        self.out = torch.empty_like(self.x)
        self.attn = torch.empty(S, q_heads, self.dim, device=dev, dtype=dt)
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def kv_bytes(self) -> int:
        """Bytes of cache one step reads (every sequence's context, every layer)."""
        per_token = self.layers * self.heads * 2 * self.dim * self.cache.element_size()
        return int(self.lengths.sum()) * per_token

    def step(self) -> None:
        """One decode step, queued on the current stream: every layer over the batch."""
        x = self.x
        for layer in range(self.layers):
            h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
            q = (h @ self.w_qkv)[:, : self.q_heads * self.dim]
            self.attend(layer, q.reshape(-1, self.q_heads, self.dim).contiguous())
            x = x + self.attn.view(x.shape[0], -1) @ self.w_o
            up = torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.w_up
            x = x + (torch.nn.functional.silu(up[:, : self.mlp]) * up[:, self.mlp :]) @ self.w_down
        self.out.copy_(x)

    def attend(self, layer: int, q: torch.Tensor) -> None:
        """Paged attention of ``q`` ``[S, QH, D]`` over layer ``layer``'s cache into self.attn."""
        view = self.cache[layer]  # [B, H, N, C]
        S = self.tables.shape[0]
        paged_decode[(S, self.heads)](
            q,
            self.attn,
            view,
            self.tables,
            self.lengths,
            view.stride(0),
            view.stride(1),
            view.stride(2),
            self.tables.stride(0),
            self.dim**-0.5,
            QH=self.q_heads,
            G=self.q_heads // self.heads,
            GP=GROUP_PAD,
            D=self.dim,
            N=self.block,
            BPI=self.bpi,
        )

    def capture(self) -> None:
        """The step as one CUDA graph (after a warm-up on a side stream, as torch asks)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())  # the warm-up reads what the caller's stream wrote
        with torch.cuda.stream(side):
            self.step()  # compiles the kernel, settles the allocator
        torch.cuda.synchronize()  # the warm-up is done before its buffers are captured over
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.step()

    def replay(self) -> None:
        """One step: the graph where captured, else the eager step."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()


def reference_attention(cache: torch.Tensor, tables, lengths, q: torch.Tensor, layer: int) -> torch.Tensor:
    """`paged_decode` in plain torch (fp32): the test's reference."""
    _, _, H, N, C = cache.shape
    D, QH = C // 2, q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for s in range(q.shape[0]):
        n = int(lengths[s])
        ids = tables[s, : -(-n // N)].long().cpu()
        kv = cache[layer, ids].float().cpu()  # [blocks, H, N, C]
        kv = kv.permute(1, 0, 2, 3).reshape(H, -1, C)[:, :n]  # [H, n, C]
        k, v = kv[..., :D], kv[..., D:]
        qs = q[s].float().cpu().view(H, QH // H, D)
        att = torch.softmax(qs @ k.transpose(1, 2) * D**-0.5, dim=-1)
        out[s] = (att @ v).reshape(QH, D)
    return out
