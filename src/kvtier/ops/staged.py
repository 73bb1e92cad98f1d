"""Staged save/load: a GPU gather into a staging buffer at HBM speed, then one large pinned DMA
per chunk on the copy engine (and the inverse), pipelined over two staging buffers.

Why: a kernel that stores into host memory holds its SMs for the whole PCIe-bound transfer,
and slows the model's compute beside it; the copy engine uses no SM, and one large DMA reaches
the pinned-copy ceiling where a DMA per block does not. The gather of chunk c + 1 overlaps the
DMA of chunk c.

The host side is the same block-major chunk as `ops.gather` writes (`kvtier.layout`), so a
chunk saved either way loads either way; a group of consecutive blocks is one byte range.

    gather stream:  [wait e_after] gather c0 -> buf0 | gather c1 -> buf1 | wait dma(c0) gather c2 -> buf0
    copy stream:             wait gathered(c0), DMA buf0 -> host | wait gathered(c1), DMA buf1 ...

Per chunk ("piece") of a call: one launch, one DMA, two event records (gathered / drained, or
arrived / freed; the second is skipped where nothing waits for it) and up to two stream waits;
per call, a stream wait on the other stream, three events reused by every piece, and for host
ids their copy to the GPU. The host's time per call therefore grows with the number of pieces,
n / blocks per staging buffer, whatever the checks cost.

Streams and events are torch objects; every call only submits. The returned event is the one
the lifecycle waits for: after it, the host chunk is complete (save) or the blocks hold the
data (load), and the staging buffers, the blocks (save) and the host chunk (load) are free.
Without CUDA (Triton interpreter) the same steps run in order and the result is None.
`save_chunks` / `load_chunks` are the same GPU sequences without validation or outside waits,
forked from and joined back into the copy stream: what `engine/graphs.py` captures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from kvtier.layout import PagedKV
from kvtier.ops.call_ids import call_ids, finish
from kvtier.ops.checks import INTERPRETING, BlockIds, check_chunk, check_max_ctas, known_cache
from kvtier.ops.launch import chunk_align, claim, launch_for


def make_staging(kv: PagedKV, chunk_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two staging buffers on the cache's device, each 1-D uint8 of kv.chunk_nbytes(chunk_blocks).

    chunk_blocks: blocks per staged chunk (a positive int): one DMA moves that many blocks.
    Keep them alive until the last event of every call that used them. Calls on the same pair of
    streams order themselves; a save and a load sharing buffers on different streams must be
    ordered by the caller (or get a pair each).

    >>> import torch
    >>> from kvtier import layout, ops
    >>> kv = layout.mla([torch.zeros(16, 64, 576, dtype=torch.bfloat16, device="cuda") for _ in range(61)])
    >>> [b.shape for b in ops.make_staging(kv, 8)]  # 8 blocks of 61 layers x 64 tokens x 576 x 2 B
    [torch.Size([35979264]), torch.Size([35979264])]
    """
    if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 1:
        raise ValueError(f"chunk_blocks: expected a positive int, got {chunk_blocks!r}")
    known_cache(kv)
    return tuple(
        torch.empty(kv.chunk_nbytes(chunk_blocks), dtype=torch.uint8, device=kv.device) for _ in range(2)
    )


def save_staged(
    kv: PagedKV,
    block_ids: BlockIds | torch.Tensor | Sequence[int],
    dst: torch.Tensor,
    *,
    staging: Sequence[torch.Tensor],
    gather_stream: torch.cuda.Stream | None,
    copy_stream: torch.cuda.Stream | None,
    wait_event: torch.cuda.Event | None = None,
    num_tokens: int | None = None,
    max_ctas: int | None = None,
    check: str = "auto",
) -> torch.cuda.Event | None:
    """Save blocks `block_ids` (n) of every layer into the pinned host chunk `dst`.

    kv: the paged cache (`kvtier.layout`) on a CUDA GPU (CPU under the interpreter).
    block_ids: n block ids, repeats allowed: a list/tuple of ints, an int32/int64 tensor [n] on
         the CPU or the cache's GPU (checked now), or a `BlockIds` (checked once).
    dst: (n, num_layers, num_kv, *kv.block_shape) of kv.dtype: (n, L, 2, bs, H, D) for
         vllm_flash / flashinfer NHD / cross_layer, (n, L, 2, H, bs, D) for HND, (n, L, 1, bs, C)
         for mla; or 1-D uint8 of kv.chunk_nbytes(n). Contiguous, pinned host memory.
    staging: two GPU buffers from `make_staging`; a chunk is as many blocks as one holds.
    gather_stream, copy_stream: torch.cuda.Streams of the cache's device (None without CUDA);
         the gathers run on the first, the DMAs on the second.
    wait_event: recorded after the KV of these blocks was written; the first gather waits for it.
    num_tokens, max_ctas, check: as in `gather`; a bad id checked lazily (on the device) leaves its
         block of `dst` holding whatever the staging buffer held (never bytes outside the cache).
    Returns the event recorded after the last DMA (None without CUDA): then `dst` holds the
    blocks, and the blocks and the staging buffers are free. Host time grows with the pieces
    (n / blocks per staging buffer): each is one launch, one DMA, two event records and up to
    two stream waits.

    >>> import torch
    >>> from kvtier import layout, ops
    >>> caches = [torch.randn(2, 256, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(32)]
    >>> kv = layout.vllm_flash(caches)
    >>> staging = ops.make_staging(kv, 64)  # chunks of 64 blocks, two in flight
    >>> dst = torch.empty(kv.chunk_nbytes(100), dtype=torch.uint8, pin_memory=True)
    >>> written = torch.cuda.current_stream().record_event()  # after the model wrote these blocks
    >>> done = ops.save_staged(kv, range(100), dst, staging=staging, gather_stream=torch.cuda.Stream(),
    ...                        copy_stream=torch.cuda.Stream(), wait_event=written)
    >>> done.synchronize()
    """
    known_cache(kv)
    _check_streams(kv, gather_stream, copy_stream, wait_event)
    with _on(gather_stream):  # ids live on the stream that reads them
        ids = call_ids(kv, block_ids, False, num_tokens, check)
        try:
            check_chunk(kv, dst, ids.n, "dst", host_only=True)
            check_max_ctas(max_ctas)
            bufs, per = _check_staging(kv, staging)
            host = dst.view(-1).view(torch.uint8)
            if not INTERPRETING:
                # Staging buffers may still be under DMA from the previous save on these streams.
                gather_stream.wait_stream(copy_stream)
                if wait_event is not None:
                    # The KV of these blocks must be written before we read it (else stale KV is saved).
                    gather_stream.wait_event(wait_event)
            return _save_loop(
                kv, ids.dev, ids.last_valid, host, bufs, per, gather_stream, copy_stream, max_ctas, ids.check
            )
        finally:
            finish(ids)  # on the gather stream: after its last gather, which read the ids


def load_staged(
    kv: PagedKV,
    block_ids: BlockIds | torch.Tensor | Sequence[int],
    src: torch.Tensor,
    *,
    staging: Sequence[torch.Tensor],
    copy_stream: torch.cuda.Stream | None,
    scatter_stream: torch.cuda.Stream | None,
    wait_event: torch.cuda.Event | None = None,
    num_tokens: int | None = None,
    max_ctas: int | None = None,
    check: str = "auto",
) -> torch.cuda.Event | None:
    """Load the pinned host chunk `src` into blocks `block_ids` (n distinct ids) of every layer.

    kv: the paged cache, as in `save_staged`.
    block_ids: as in `save_staged`, without duplicates (a `BlockIds` made with unique=True).
    src: shaped as `save_staged`'s dst: (n, num_layers, num_kv, *kv.block_shape) of kv.dtype
         ((n, L, 2, bs, H, D) for vllm_flash / flashinfer NHD / cross_layer, (n, L, 2, H, bs, D)
         for HND, (n, L, 1, bs, C) for mla) or 1-D uint8 of kv.chunk_nbytes(n); contiguous,
         pinned host memory; it must stay unchanged until the returned event.
    staging: two GPU buffers from `make_staging`.
    copy_stream, scatter_stream: torch.cuda.Streams of the cache's device (None without CUDA);
         the DMAs run on the first, the scatters on the second.
    wait_event: recorded after the last reader of the destination blocks; the first scatter waits.
    num_tokens, max_ctas, check: as in `scatter`.
    Returns the event recorded after the last scatter (None without CUDA): then the blocks hold
    the data, and `src` and the staging buffers are free. Host time: as `save_staged`'s, plus the
    claim kernel's launch for lazily checked ids.

    >>> import torch
    >>> from kvtier import layout, ops
    >>> kv = layout.cross_layer(torch.zeros(256, 32, 2, 16, 8, 128, dtype=torch.float16, device="cuda"))
    >>> src = torch.randn(kv.chunk_shape(4), dtype=kv.dtype, pin_memory=True)  # (4, 32, 2, 16, 8, 128)
    >>> done = ops.load_staged(kv, [8, 9, 10, 11], src, staging=ops.make_staging(kv, 2),
    ...                        copy_stream=torch.cuda.Stream(), scatter_stream=torch.cuda.Stream())
    >>> torch.cuda.current_stream().wait_event(done)  # attention reads the blocks only after it
    """
    known_cache(kv)
    _check_streams(kv, scatter_stream, copy_stream, wait_event)
    with _on(scatter_stream):  # ids live on the stream that reads them
        ids = call_ids(kv, block_ids, True, num_tokens, check)
        try:
            check_chunk(kv, src, ids.n, "src", host_only=True)
            check_max_ctas(max_ctas)
            bufs, per = _check_staging(kv, staging)
            host = src.view(-1).view(torch.uint8)
            if not INTERPRETING:
                # Staging buffers may still be read by the previous load's scatter on these streams.
                copy_stream.wait_stream(scatter_stream)
                if wait_event is not None:
                    # Pending readers of the destination blocks finish before we overwrite them.
                    scatter_stream.wait_event(wait_event)
            stamp = claim(kv, ids.dev) if ids.check == 2 else 0  # one mark for every chunk's scatter
            return _load_loop(
                kv,
                ids.dev,
                ids.last_valid,
                host,
                bufs,
                per,
                copy_stream,
                scatter_stream,
                max_ctas,
                ids.check,
                stamp,
            )
        finally:
            finish(ids)  # on the scatter stream: after its last scatter, which read the ids


def save_chunks(kv: PagedKV, ids_dev, last_valid: int, dst, *, staging, gather_stream, copy_stream) -> None:
    """The GPU sequence of `save_staged` alone, for CUDA-graph capture on `copy_stream`.

    Nothing is validated or waited on from outside: `ids_dev` (int32 [n] on the cache's device,
    checked by the caller) must hold the ids by the time `copy_stream` reaches this work, and
    `dst` must be a pinned chunk of n blocks. The gather stream forks from `copy_stream` and is
    joined back into it at the end, so every node follows the copy stream's earlier work and
    the copy stream's next work follows every node (a capture on `copy_stream` ends joined).
    """
    bufs, per = _check_staging(kv, staging)
    host = dst.view(-1).view(torch.uint8)
    # Fork: the gathers follow everything before on the copy stream (engine waits, earlier DMAs
    # out of these staging buffers). In a capture this makes the gather stream join it.
    gather_stream.wait_stream(copy_stream)
    _save_loop(kv, ids_dev, last_valid, host, bufs, per, gather_stream, copy_stream, None)
    # Join: later work on the copy stream (e_save, the next job) follows every gather.
    copy_stream.wait_stream(gather_stream)


def load_chunks(kv: PagedKV, ids_dev, last_valid: int, src, *, staging, copy_stream, scatter_stream) -> None:
    """The GPU sequence of `load_staged` alone, for CUDA-graph capture on `copy_stream` (the
    contract of `save_chunks`; ids distinct, checked by the caller). The scatter stream forks
    from `copy_stream` and joins back into it at the end."""
    bufs, per = _check_staging(kv, staging)
    host = src.view(-1).view(torch.uint8)
    # Fork: the scatters follow everything before on the copy stream (engine waits for readers
    # of the blocks). In a capture this makes the scatter stream join it.
    scatter_stream.wait_stream(copy_stream)
    _load_loop(kv, ids_dev, last_valid, host, bufs, per, copy_stream, scatter_stream, None)
    # Join: later work on the copy stream (e_load, the next job's H2D into staging) follows every scatter.
    copy_stream.wait_stream(scatter_stream)


def save_slot_chunks(
    kv: PagedKV, ids_dev, last_valid: int, dsts, counts, *, staging, gather_stream, copy_stream
) -> None:
    """The staged save of several chunks in one pipelined sequence: dsts[j] (a pinned 1-D uint8
    chunk) gets the next counts[j] blocks of `ids_dev`. Nothing is validated (the engine checked
    the ids: int32 on the cache's device, ready on `copy_stream`; the pool sized the chunks).

    Why not one staged save per chunk: each would start with its gather stream waiting for the
    copy stream's tail (the staging buffers' last DMA), and a CUDA-graph replay is one operation
    of the copy stream, so chunk j + 1's gather could not start before chunk j's DMA ended: a
    bubble of one gather per chunk on the link. Here chunk j + 1's gather only waits for the DMA
    that last read its staging buffer (two pieces back), as the pieces of one call do.
    Gathers on `gather_stream`, DMAs on `copy_stream`, the last DMA on `copy_stream` (the
    caller's event after it covers every piece). Without CUDA (the interpreter: streams None)
    the steps run in order.
    """
    bufs, per = _check_staging(kv, staging)
    if gather_stream is not None:
        # Fork: the gathers follow the engine's waits and earlier DMAs out of these staging buffers.
        gather_stream.wait_stream(copy_stream)
    pieces = _slot_pieces(kv, ids_dev, last_valid, dsts, counts, bufs, per, True)
    _run_save(pieces, gather_stream, copy_stream)


def load_slot_chunks(
    kv: PagedKV, ids_dev, last_valid: int, srcs, counts, *, staging, copy_stream, scatter_stream
) -> None:
    """The staged load of several chunks in one pipelined sequence (the contract and the reason
    of `save_slot_chunks`): srcs[j] goes into the next counts[j] blocks of `ids_dev` (distinct).
    DMAs on `copy_stream`, scatters on `scatter_stream`; joined back into `copy_stream` at the
    end, so the caller's event there follows every scatter."""
    bufs, per = _check_staging(kv, staging)
    if copy_stream is not None:
        # Staging buffers may still be read by the previous load's scatters on these streams.
        copy_stream.wait_stream(scatter_stream)
    pieces = _slot_pieces(kv, ids_dev, last_valid, srcs, counts, bufs, per, False)
    _run_load(pieces, copy_stream, scatter_stream, 0)
    if copy_stream is not None:
        # Join: e_load (recorded on the copy stream) and the next job follow every scatter.
        copy_stream.wait_stream(scatter_stream)


def _slot_pieces(kv, ids_dev, last_valid, hosts, counts, bufs, per, gather) -> list[tuple]:
    """`_pieces` over several host chunks: each chunk cut into pieces of at most `per` blocks,
    the staging buffers in turn across all of them; only the job's very last block may be
    partial (`last_valid`)."""
    bn, bs, total = kv.block_nbytes, kv.block_size, ids_dev.shape[0]
    align = math.gcd(chunk_align(bufs[0]), chunk_align(bufs[1]))  # one plan fits both buffers
    kw = dict(gather=gather, max_ctas=None, n_layers=len(kv.layers), check=0)
    runs: dict[int, object] = {}
    pieces, at = [], 0
    for host, count in zip(hosts, counts, strict=True):
        host = host.view(-1).view(torch.uint8)
        for lo in range(0, count, per):
            m = min(per, count - lo)
            if m not in runs:
                runs[m] = launch_for(kv, m, align, ids_dev.dtype, False, **kw)
            end = at + lo + m
            buf = bufs[len(pieces) % 2][: m * bn]
            valid = last_valid if end == total else bs
            pieces.append((ids_dev[at + lo : end], buf, host[lo * bn : (lo + m) * bn], runs[m], valid))
        at += count
    return pieces


def _save_loop(kv, ids_dev, last_valid, host, bufs, per, gather_stream, copy_stream, max_ctas, check=0):
    """Gathers on `gather_stream`, DMAs on `copy_stream`; returns the event after the last DMA."""
    if not ids_dev.shape[0]:
        return _record(copy_stream)
    return _run_save(
        _pieces(kv, ids_dev, last_valid, host, bufs, per, True, max_ctas, check), gather_stream, copy_stream
    )


def _run_save(pieces, gather_stream, copy_stream):
    """The pieces' gathers on `gather_stream`, their DMAs on `copy_stream`, pipelined over the two
    staging buffers; the event after the last DMA (None without CUDA)."""
    if gather_stream is None:  # the interpreter: every step runs to its end, in order
        for ids, buf, part, run, valid in pieces:
            run(ids, buf, valid)
            part.copy_(buf)
        return None
    last = len(pieces) - 1
    # One event per role, recorded again for each piece: a wait reads the record made before it.
    gathered, dma_done = torch.cuda.Event(), (torch.cuda.Event(), torch.cuda.Event())
    with torch.cuda.stream(copy_stream):  # torch's copies run on the current stream
        for c, (ids, buf, part, run, valid) in enumerate(pieces):
            if c >= 2:
                # Reuse a staging buffer only after its DMA has completed (else that DMA reads new data).
                gather_stream.wait_event(dma_done[c % 2])
            run(ids, buf, valid, 0, 0, gather_stream)
            gathered.record(gather_stream)  # marks: staging buffer filled
            # The DMA must not read the staging buffer before the gather has filled it.
            copy_stream.wait_event(gathered)
            part.copy_(buf, non_blocking=True)
            if c + 2 <= last or c == last:  # a gather two pieces on waits for it, or the caller does
                dma_done[c % 2].record(copy_stream)  # marks: buffer drained, host bytes written
    return dma_done[last % 2]


def _load_loop(
    kv, ids_dev, last_valid, host, bufs, per, copy_stream, scatter_stream, max_ctas, check=0, stamp=0
):
    """DMAs on `copy_stream`, scatters on `scatter_stream`; returns the event after the last scatter."""
    if not ids_dev.shape[0]:
        return _record(scatter_stream)
    pieces = _pieces(kv, ids_dev, last_valid, host, bufs, per, False, max_ctas, check)
    return _run_load(pieces, copy_stream, scatter_stream, stamp)


def _run_load(pieces, copy_stream, scatter_stream, stamp):
    """The pieces' DMAs on `copy_stream`, their scatters on `scatter_stream`, pipelined over the
    two staging buffers; the event after the last scatter (None without CUDA)."""
    if scatter_stream is None:  # the interpreter: every step runs to its end, in order
        for ids, buf, part, run, valid in pieces:
            buf.copy_(part)
            run(ids, buf, valid, 0, stamp)
        return None
    last = len(pieces) - 1
    # One event per role, recorded again for each piece: a wait reads the record made before it.
    arrived, freed = torch.cuda.Event(), (torch.cuda.Event(), torch.cuda.Event())
    with torch.cuda.stream(copy_stream):  # torch's copies run on the current stream
        for c, (ids, buf, part, run, valid) in enumerate(pieces):
            if c >= 2:
                # Overwrite a staging buffer only after the scatter that read it has completed.
                copy_stream.wait_event(freed[c % 2])
            buf.copy_(part, non_blocking=True)
            arrived.record(copy_stream)  # marks: staging buffer holds the chunk
            # The scatter must not read the staging buffer before the H2D copy has landed.
            scatter_stream.wait_event(arrived)
            run(ids, buf, valid, 0, stamp, scatter_stream)
            if c + 2 <= last or c == last:  # a copy two pieces on waits for it, or the caller does
                freed[c % 2].record(scatter_stream)  # marks: blocks written, buffer free again
    return freed[last % 2]


def _pieces(kv, ids_dev, last_valid, host, bufs, per, gather, max_ctas, check) -> list[tuple]:
    """The call cut into pieces of `per` blocks (the last may be shorter), planned once per call:
    per piece (its ids, its staging buffer -- the two in turn --, its host bytes, its `Launch`,
    its valid tokens in the last block)."""
    n, bn, bs = ids_dev.shape[0], kv.block_nbytes, kv.block_size
    ids = ids_dev.split(per)
    hosts = host[: n * bn].split(per * bn)  # a host buffer may be longer than the n blocks
    last, m = len(ids) - 1, n - (len(ids) - 1) * per  # the last piece holds m blocks
    full = (bufs[0][: per * bn], bufs[1][: per * bn])
    align = math.gcd(chunk_align(bufs[0]), chunk_align(bufs[1]))  # one plan fits both buffers
    kw = dict(gather=gather, max_ctas=max_ctas, n_layers=len(kv.layers), check=check)
    run = launch_for(kv, per, align, ids_dev.dtype, False, **kw)
    pieces = [(ids[c], full[c % 2], hosts[c], run, bs) for c in range(last)]
    run_m = run if m == per else launch_for(kv, m, align, ids_dev.dtype, False, **kw)
    pieces.append((ids[last], bufs[last % 2][: m * bn], hosts[last], run_m, last_valid))
    return pieces


def _check_staging(kv: PagedKV, staging) -> tuple[list[torch.Tensor], int]:
    """-> (the two buffers, blocks per chunk)."""
    if not isinstance(staging, (list, tuple)) or len(staging) != 2:
        raise ValueError("staging: expected two buffers (make_staging)")
    a, b = staging
    f = known_cache(kv)
    for i, t in enumerate(staging):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"staging[{i}]: expected a contiguous 1-D uint8 tensor")
        if t.device != f.device:
            raise ValueError(f"staging[{i}]: on {t.device}, expected the cache's {kv.device}")
    if a.numel() != b.numel() or a.numel() < kv.block_nbytes:
        raise ValueError(
            f"staging: two buffers of equal size >= one block ({kv.block_nbytes} bytes) expected"
        )
    lo, hi = sorted((a, b), key=lambda t: t.data_ptr())
    if lo.data_ptr() + lo.numel() > hi.data_ptr():
        raise ValueError("staging: the two buffers overlap")
    return [a, b], a.numel() // kv.block_nbytes


def _check_streams(kv: PagedKV, kernel_stream, copy_stream, wait_event) -> None:
    if INTERPRETING:
        if kernel_stream is not None or copy_stream is not None or wait_event is not None:
            raise ValueError("streams/wait_event: must be None without CUDA (the interpreter runs in order)")
        return
    index = known_cache(kv).index
    for name, s in (("kernel stream", kernel_stream), ("copy_stream", copy_stream)):
        if not isinstance(s, torch.cuda.Stream):
            raise ValueError(f"{name}: expected a torch.cuda.Stream, got {type(s).__name__}")
        if s.device_index != index:
            raise ValueError(f"{name}: on {s.device}, expected the cache's {kv.device}")
    if wait_event is not None and not isinstance(wait_event, torch.cuda.Event):
        raise ValueError(f"wait_event: expected a torch.cuda.Event or None, got {type(wait_event).__name__}")


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _record(stream) -> torch.cuda.Event | None:
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev
