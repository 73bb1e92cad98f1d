"""GPU-to-GPU KV handoff: blocks of device a's paged cache into device b's (prefill on a, decode on b).

One job, in the lifecycle protocol's order (`kvtier.lifecycle`), on a copy stream of each device:

  a: wait `after` + pending writers/loaders of the source blocks -> per piece of ~piece_bytes:
     gather into a contiguous chunk on a's send stream, then a peer copy chunk_a -> chunk_b on
     a's copy stream (the copy of piece k overlaps the gather of piece k+1); e_sent after the
     last gather                                                           (SAVE-like read on a)
  b: wait pending readers/writers/savers/loaders of the destination blocks -> per piece: wait
     its copy's event (an event of a: valid across devices in CUDA), scatter; the last piece
     layer by layer, an event per layer -> record e_done                   (LOAD on b)

Compute on a may overwrite the source blocks only after e_sent (the tracker of a hands it to
a later `waits_for(WRITE)`); compute on b may read the destination blocks only after the
layer's event or e_done. On CUDA the copy is `chunk_b.copy_(chunk_a, non_blocking=True)`:
direct (P2P over NVLink/PCIe) when `torch.cuda.can_device_access_peer(a, b)`, else the driver
bounces it through host memory; `HandoffJob.route` says which. On SimDevice the same steps
run on CPU worker threads with late copies, so a missing wait gives wrong data in tests.

Chunk: (n, num_layers, num_kv, *block_shape) of the cache dtype (`kvtier.layout`); the two
caches may use different layouts as long as that shape and the dtype agree.
"""

from __future__ import annotations

import itertools
import threading
import warnings

import torch

from kvtier.device.base import Event, Stream
from kvtier.engine.handoff_parts import HandoffJob, Side, cross_wait, side
from kvtier.engine.ids import IdCheck
from kvtier.layout import PagedKV
from kvtier.lifecycle import Access, sanitize_enabled


class Handoff:
    """Moves blocks of `src`'s cache into `dst`'s cache (every layer, K and V).

    src, dst: a TransferEngine, a `Side`, or a PagedKV (then `src_device` / `dst_device`).
    sanitize: trackers made here raise LifecycleError on illegal moves (default: KVTIER_SANITIZE).
    piece_bytes: bytes per piece of the pipeline (gather / peer copy / scatter overlap).
    layer_group: layers per scatter of the last piece, each group with its event (a per-layer
        scatter costs a launch of host time: one per layer of a deep model outlasts the copy).
    """

    def __init__(
        self,
        src,
        dst,
        *,
        src_device=None,
        dst_device=None,
        sanitize: bool | None = None,
        piece_bytes: int = 128 << 20,
        layer_group: int = 4,
    ):
        if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes <= 0:
            raise ValueError(f"piece_bytes: expected an int > 0, got {piece_bytes!r}")
        self.piece_bytes = piece_bytes
        if isinstance(layer_group, bool) or not isinstance(layer_group, int) or layer_group <= 0:
            raise ValueError(f"layer_group: expected an int > 0, got {layer_group!r}")
        self.layer_group = layer_group  # layers per scatter (and per event) of the last piece
        self.sanitize = sanitize_enabled(sanitize)
        self.src = side(src, src_device, self.sanitize)
        self.dst = side(dst, dst_device, self.sanitize)
        a, b = self.src.kv, self.dst.kv
        if a.chunk_shape(1) != b.chunk_shape(1) or a.dtype != b.dtype:
            raise ValueError(
                f"dst: a block is {b.chunk_shape(1)} {b.dtype} there, "
                f"{a.chunk_shape(1)} {a.dtype} in src; a handoff copies blocks as they are"
            )
        self.same = self.src.device is self.dst.device
        self.send_stream: Stream = self.src.device.new_stream("kvtier-handoff-send")
        self.recv_stream: Stream = (
            self.send_stream if self.same else self.dst.device.new_stream("kvtier-handoff-recv")
        )
        # a's second stream: the copy of piece k runs beside the gather of piece k+1
        self.copy_stream: Stream = (
            self.send_stream if self.same else self.src.device.new_stream("kvtier-handoff-copy")
        )
        # b's current stream while torch copies between the devices: it joins the copy with b's
        # current stream, and this one carries nothing else (no false wait on the scatters)
        self.land_stream: Stream = (
            self.recv_stream if self.same else self.dst.device.new_stream("kvtier-handoff-land")
        )
        self._src_ids = IdCheck(a.num_blocks, a.block_size)
        self._dst_ids = IdCheck(b.num_blocks, b.block_size)
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.route = self._route()

    def _route(self) -> str:
        if self.same:
            return "same-device"
        a, b = self.src.kv.device, self.dst.kv.device
        if a.type != "cuda":
            return "sim"
        return "p2p" if torch.cuda.can_device_access_peer(a.index, b.index) else "host"

    def send(
        self, src_blocks, dst_blocks, *, after: Event | None, num_tokens: int | None = None, per_layer=True
    ) -> HandoffJob:
        """Copy blocks `src_blocks` of src into blocks `dst_blocks` (n distinct ids) of dst.

        after: recorded on a's compute stream after these blocks' KV was written (None: no
            compute write is pending beyond those registered with src's tracker).
        num_tokens: tokens in these n blocks; dst tokens past it in the last block are untouched.
        """
        src_ids, sset = self._src_ids.check(src_blocks, False, num_tokens)  # sset: for the tracker
        dst_ids, dset = self._dst_ids.check(dst_blocks, True, num_tokens)
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"dst_blocks: {len(dst_ids)} ids for {len(src_ids)} source blocks")
        a, b, sa, sb = self.src, self.dst, self.send_stream, self.recv_stream
        pieces = self.pieces(len(src_ids), num_tokens)
        with self._lock:
            k = next(self._seq)
            waits_a = a.blocks.waits_for(Access.SAVE, sset, stream=sa)
            if after is not None:
                cross_wait(sa, a.device, after)  # the gather must not read KV still being written
            for e in waits_a:
                cross_wait(sa, a.device, e)  # nor blocks a load or a compute write still writes
            # b's waits are enqueued before any scatter: the copies into b's staging chunk need
            # not wait for b's readers, only the scatters into the destination blocks do.
            waits_b = b.blocks.waits_for(Access.LOAD, dset, stream=sb)
            for e in waits_b:
                cross_wait(sb, b.device, e)  # the scatter must not overwrite blocks still read (#47282)
            try:
                sent = self._gather_and_copy(src_ids, pieces, f"e_sent#{k}")
                chunk_a, chunk_b, landed, e_sent, ids_a = sent
                a.blocks.begin_save(sset, e_sent, waited=waits_a + ([after] if after is not None else []))
                layers, ids_b = self._scatter(dst_ids, chunk_b, pieces, landed, per_layer, f"e_done#{k}")
                e_done = sb.record(f"e_done#{k}")  # after it b may read every destination block
                b.blocks.begin_load(dset, e_done, waited=waits_b + [e_sent])
            except BaseException:
                self._quiesce()  # what it enqueued must not read a's or write b's blocks after the error
                raise
        layer_events = [*layers, e_done] if layers else [e_done] * b.kv.num_layers
        nbytes, keep = a.kv.chunk_nbytes(len(src_ids)), [chunk_a, chunk_b, ids_a, ids_b]
        return HandoffJob(e_sent, e_done, layer_events, src_ids, dst_ids, nbytes, self.route, keep)

    # ---- the bytes -------------------------------------------------------------------------
    def pieces(self, n: int, num_tokens: int | None) -> list[tuple[int, int, int | None]]:
        """How a send of `n` blocks is cut: (first block, end block, num_tokens of the piece) for
        pieces of ~piece_bytes."""
        per = max(1, self.piece_bytes // self.src.kv.block_nbytes)
        bs, out = self.src.kv.block_size, []
        for s in range(0, n, per):
            e = min(n, s + per)
            out.append((s, e, None if num_tokens is None or e < n else num_tokens - s * bs))
        return out

    def _gather_and_copy(self, ids: torch.Tensor, pieces, sent_label: str):
        """Piece by piece: gather on a's send stream, then copy to b on a's copy stream, so the
        gather of piece k+1 overlaps the copy of piece k. Returns the chunks, per piece the event
        after which its bytes are in chunk_b, and e_sent (after the last gather: the source blocks
        have been read)."""
        a, b, sa, sc = self.src, self.dst, self.send_stream, self.copy_stream
        n = len(ids)
        cpu = a.kv.device.type == "cpu"
        if cpu:
            from kvtier.reference import gather_ref

            chunk_a = torch.empty(a.kv.chunk_shape(n), dtype=a.kv.dtype)
            chunk_b = chunk_a if self.same else torch.empty(b.kv.chunk_shape(n), dtype=b.kv.dtype)
        else:
            with torch.cuda.stream(sa.raw):
                chunk_a = torch.empty(a.kv.chunk_shape(n), dtype=a.kv.dtype, device=a.kv.device)
            if self.same:
                chunk_b = chunk_a
            else:
                with torch.cuda.stream(self.recv_stream.raw):
                    chunk_b = torch.empty(b.kv.chunk_shape(n), dtype=b.kv.dtype, device=b.kv.device)
                # b's stream allocated chunk_b: the copies on a's copy stream must come after it.
                sc.raw.wait_stream(self.recv_stream.raw)
        landed, e_sent = [], None
        parts = [ids[s:e] for s, e, _ in pieces] if cpu else _piece_ids(a.kv, ids, pieces, False, sa)
        for i, ((s, e, nt), part_ids) in enumerate(zip(pieces, parts, strict=True)):
            if cpu:
                src = chunk_a[s:e]
                a.device.launch(lambda src=src, i=part_ids, nt=nt: src.copy_(gather_ref(a.kv, i, nt)), sa)
            else:
                from kvtier import ops

                with torch.cuda.stream(sa.raw):
                    ops.gather(a.kv, part_ids, chunk_a[s:e])
            last = i == len(pieces) - 1
            # after the last gather a may overwrite the source blocks (e_sent)
            gathered = sa.record(sent_label if last else f"handoff:gathered[{s}:{e}]")
            e_sent = gathered if last else None
            if self.same:
                landed.append(None)
                continue
            sc.wait_event(gathered)  # the copy must not read the piece before its gather wrote it
            if cpu:
                a.device.copy(chunk_b[s:e], chunk_a[s:e], sc)  # the "peer copy", landing late on purpose
            else:
                # torch runs a copy between devices on a's current stream (sc) and joins it with b's
                # current stream both ways: b's is the idle land stream, so the copy of piece k
                # does not wait for the scatter of piece k-1 queued on the recv stream.
                with torch.cuda.stream(sc.raw), torch.cuda.stream(self.land_stream.raw):
                    chunk_b[s:e].copy_(chunk_a[s:e], non_blocking=True)
            landed.append(sc.record(f"handoff:landed[{s}:{e}]"))
        if not cpu and not self.same:
            chunk_a.record_stream(sc.raw)  # the allocator must not reuse chunk_a while the copies read it
            chunk_b.record_stream(sc.raw)  # nor chunk_b while a's copy stream writes it
        return chunk_a, chunk_b, landed, e_sent, parts

    def _scatter(self, ids, chunk, pieces, landed, per_layer: bool, label: str) -> list[Event]:
        """Enqueue the scatters on b, piece by piece once each landed; the last piece layer by
        layer (when per_layer). Returns the events of layers 0..L-2 (the caller records the last):
        b's stream runs in order, so layer l's event also follows every earlier piece."""
        b, sb = self.dst, self.recv_stream
        L = b.kv.num_layers
        cpu = b.kv.device.type == "cpu"
        parts = [ids[s:e] for s, e, _ in pieces] if cpu else _piece_ids(b.kv, ids, pieces, True, sb)
        events = []
        for i, ((s, e, nt), ev, part_ids) in enumerate(zip(pieces, landed, parts, strict=True)):
            if ev is not None:
                cross_wait(sb, b.device, ev)  # the scatter must not read the piece before it landed on b
            last = i == len(pieces) - 1
            g = self.layer_group
            steps = [(l0, min(g, L - l0)) for l0 in range(0, L, g)] if per_layer and last else [None]
            for layers in steps:
                b.device.launch(self._scatter_step(part_ids, chunk[s:e], nt, layers), sb)
                if layers is None:
                    continue
                covered = min(layers[0] + layers[1], L - 1) - layers[0]  # the last layer's is e_done
                if covered > 0:
                    ev = sb.record(f"{label}:layers{layers[0]}+{layers[1]}")  # these layers landed on b
                    events.extend([ev] * covered)
        return events, parts

    def _scatter_step(self, ids, part, num_tokens, layers):
        b = self.dst
        if b.kv.device.type == "cpu":
            from kvtier.engine.movers import layer_kv
            from kvtier.reference import scatter_ref

            if layers is None:
                return lambda: scatter_ref(b.kv, ids, part, num_tokens)
            l0, c = layers

            def group():
                for layer in range(l0, l0 + c):
                    scatter_ref(layer_kv(b.kv, layer), ids, part[:, layer : layer + 1], num_tokens)

            return group
        from kvtier import ops

        return lambda: ops.scatter(b.kv, ids, part, layers=layers)  # ids: a BlockIds with its tokens

    def _quiesce(self) -> None:
        """After a failed send: wait until nothing it enqueued is in flight (a warning where even
        that fails: the device is lost)."""
        try:
            self.close()
        except Exception as e:  # the send's own error is the one to raise
            warnings.warn(f"kvtier: a failed handoff's copies could not be waited for ({e})", stacklevel=3)

    def close(self) -> None:
        """Wait for every handoff submitted; the streams stay with their devices."""
        self.send_stream.synchronize()  # submitted is not done: the gathers must finish first
        self.copy_stream.synchronize()  # and the copies to b must land
        self.recv_stream.synchronize()  # and the scatters on b, whose events the trackers hold


def _piece_ids(kv: PagedKV, ids: torch.Tensor, pieces, unique: bool, stream: Stream) -> list:
    """One BlockIds per piece from a single copy of `ids` (checked by `send`) to kv's device, on
    `stream`: the per-layer scatters and the per-piece gathers reuse them, no check per launch.
    The job keeps them until e_done: the device ids must outlive the kernels that read them,
    also where the allocator ignores record_stream (PYTORCH_NO_CUDA_MEMORY_CACHING=1)."""
    from kvtier.ops.checks import BlockIds, trusted_block_ids

    bs = kv.block_size
    with torch.cuda.stream(stream.raw):
        whole = trusted_block_ids(kv, ids, unique, bs)  # one H2D, its ready event on `stream`
    return [
        BlockIds(
            kv, ids[s:e], whole.dev[s:e], unique, bs if nt is None else nt - (e - s - 1) * bs, whole.ready
        )
        for s, e, nt in pieces
    ]


def handoff(
    src_kv,
    src_blocks,
    dst_kv,
    dst_blocks,
    *,
    after: Event | None,
    src_device=None,
    dst_device=None,
    num_tokens: int | None = None,
    per_layer: bool = True,
    sanitize: bool | None = None,
) -> HandoffJob:
    """One-shot `Handoff(src_kv, dst_kv, ...).send(...)`; see `Handoff` for the arguments."""
    h = Handoff(src_kv, dst_kv, src_device=src_device, dst_device=dst_device, sanitize=sanitize)
    return h.send(src_blocks, dst_blocks, after=after, num_tokens=num_tokens, per_layer=per_layer)


__all__ = ["Handoff", "HandoffJob", "Side", "cross_wait", "handoff", "side"]
