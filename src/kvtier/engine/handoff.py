"""GPU-to-GPU KV handoff: blocks of device a's paged cache into device b's (prefill on a, decode on b).

One job, in the lifecycle protocol's order (DESIGN.md), on a copy stream of each device:

  a: wait `after` + pending writers/loaders of the source blocks -> gather into a contiguous
     chunk on a -> one peer copy chunk_a -> chunk_b -> record e_sent       (SAVE-like read on a)
  b: wait e_sent (an event of a: valid across devices in CUDA) + pending readers/writers/
     savers/loaders of the destination blocks -> scatter, an event per layer -> record e_done
     (LOAD on b)

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
from dataclasses import dataclass, field

import torch

from kvtier.device.base import Device, Event, Stream
from kvtier.engine.ids import IdCheck
from kvtier.layout import PagedKV
from kvtier.lifecycle import Access, BlockTracker, sanitize_enabled


@dataclass(slots=True)
class Side:
    """One end of a handoff: a device, its paged cache and the tracker of that cache's blocks.

    Pass the `blocks` tracker of the TransferEngine that serves the same cache (`side(engine)`)
    so handoffs and save/load jobs see each other's pending accesses.
    """

    device: Device
    kv: PagedKV
    blocks: BlockTracker

    def __post_init__(self) -> None:
        if not isinstance(self.kv, PagedKV):
            raise ValueError(f"kv: expected a PagedKV, got {type(self.kv).__name__}")
        if not isinstance(self.blocks, BlockTracker):
            raise ValueError(f"blocks: expected a BlockTracker, got {type(self.blocks).__name__}")


def side(obj, device: Device | None = None, sanitize: bool | None = None) -> Side:
    """A `Side` from a TransferEngine (its device, cache and tracker), a Side, or a PagedKV + device."""
    if isinstance(obj, Side):
        return obj
    if isinstance(obj, PagedKV):
        if device is None:
            raise ValueError("device: needed with a bare PagedKV")
        return Side(device, obj, BlockTracker(sanitize=sanitize, name=f"{device.name} block"))
    for attr in ("device", "kv", "blocks"):
        if not hasattr(obj, attr):
            raise ValueError(f"expected a TransferEngine, Side or PagedKV, got {type(obj).__name__}")
    return Side(obj.device, obj.kv, obj.blocks)


@dataclass(eq=False)
class HandoffJob:
    """A submitted handoff. `layer_events[l]` completes once layer l landed on b; `event` (e_done)
    once everything did; `sent` (e_sent, on a) once the source blocks were read."""

    sent: Event
    event: Event
    layer_events: list[Event]
    src_blocks: torch.Tensor  # int64 [n], CPU
    dst_blocks: torch.Tensor  # int64 [n], CPU
    nbytes: int
    route: str  # "p2p", "host" (CUDA without peer access), "same-device" or "sim"
    _buffers: list[torch.Tensor] = field(default_factory=list, repr=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until b has every block; False on timeout (the staging chunks are kept)."""
        if not self.event.synchronize(timeout):
            return False  # in flight: the copy may still read/write the staging chunks
        # e_done completed, and b waited e_sent before it: no stream touches the chunks any more.
        self._buffers.clear()
        return True

    def done(self) -> bool:
        if not self.event.query():
            return False
        self._buffers.clear()  # safe only now: the event says the copies landed
        return True


def cross_wait(stream: Stream, device: Device, event: Event) -> None:
    """Later work on `stream` (of `device`) waits for `event`, which may belong to another device."""
    if getattr(event, "_dev", None) is device:
        stream.wait_event(event)
        return
    from kvtier.device.sim import SimDevice

    if isinstance(device, SimDevice):
        # Two simulated devices share no event state: holding b's worker until a's event is
        # reached gives the same order as a device-side wait (the host does not block).
        device.launch(lambda: event.synchronize(), stream)
        return
    if event.stream is not None:
        stream.raw.wait_event(event.raw)  # CUDA events order work across devices of one process


class Handoff:
    """Moves blocks of `src`'s cache into `dst`'s cache (every layer, K and V).

    src, dst: a TransferEngine, a `Side`, or a PagedKV (then `src_device` / `dst_device`).
    sanitize: trackers made here raise LifecycleError on illegal moves (default: KVTIER_SANITIZE).
    """

    def __init__(self, src, dst, *, src_device=None, dst_device=None, sanitize: bool | None = None):
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
        src_ids = self._src_ids(src_blocks, False, num_tokens)
        dst_ids = self._dst_ids(dst_blocks, True, num_tokens)
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"dst_blocks: {len(dst_ids)} ids for {len(src_ids)} source blocks")
        a, b, sa, sb = self.src, self.dst, self.send_stream, self.recv_stream
        sset, dset = frozenset(src_ids.tolist()), frozenset(dst_ids.tolist())
        with self._lock:
            k = next(self._seq)
            waits_a = a.blocks.waits_for(Access.SAVE, sset, stream=sa)
            if after is not None:
                cross_wait(sa, a.device, after)  # the gather must not read KV still being written
            for e in waits_a:
                cross_wait(sa, a.device, e)  # nor blocks a load or a compute write still writes
            chunk_a, chunk_b = self._gather_and_copy(src_ids, num_tokens)
            e_sent = sa.record(f"e_sent#{k}")  # after it a may overwrite the source blocks
            a.blocks.begin_save(sset, e_sent, waited=waits_a + ([after] if after is not None else []))
            # b's waits come after the copy was enqueued: torch orders a peer copy after the tail
            # of b's current stream, and the copy into staging need not wait for b's readers.
            waits_b = b.blocks.waits_for(Access.LOAD, dset, stream=sb)
            for e in waits_b:
                cross_wait(sb, b.device, e)  # the scatter must not overwrite blocks still read (#47282)
            if not self.same:
                cross_wait(sb, b.device, e_sent)  # the scatter must not read chunk_b before it landed
            layers = self._scatter(dst_ids, chunk_b, num_tokens, per_layer, f"e_done#{k}")
            e_done = sb.record(f"e_done#{k}")  # after it b may read every destination block
            b.blocks.begin_load(dset, e_done, waited=waits_b + [e_sent])
        layer_events = [*layers, e_done] if layers else [e_done] * b.kv.num_layers
        n = len(src_ids)
        return HandoffJob(e_sent, e_done, layer_events, src_ids, dst_ids, a.kv.chunk_nbytes(n), self.route,
                          [chunk_a, chunk_b])  # fmt: skip

    # ---- the bytes -------------------------------------------------------------------------
    def _gather_and_copy(self, ids: torch.Tensor, num_tokens: int | None):
        a, b, sa = self.src, self.dst, self.send_stream
        n = len(ids)
        if a.kv.device.type == "cpu":
            from kvtier.reference import gather_ref

            chunk_a = torch.empty(a.kv.chunk_shape(n), dtype=a.kv.dtype)
            chunk_b = chunk_a if self.same else torch.empty(b.kv.chunk_shape(n), dtype=b.kv.dtype)
            a.device.launch(lambda: chunk_a.copy_(gather_ref(a.kv, ids, num_tokens)), sa)
            if not self.same:
                a.device.copy(chunk_b, chunk_a, sa)  # the "peer copy", landing late on purpose
            return chunk_a, chunk_b
        from kvtier import ops

        with torch.cuda.stream(sa.raw):
            chunk_a = torch.empty(a.kv.chunk_shape(n), dtype=a.kv.dtype, device=a.kv.device)
            ops.gather(a.kv, ids, chunk_a, num_tokens=num_tokens)
        if self.same:
            return chunk_a, chunk_a
        with torch.cuda.stream(self.recv_stream.raw):
            chunk_b = torch.empty(b.kv.chunk_shape(n), dtype=b.kv.dtype, device=b.kv.device)
        # Both streams current: torch runs the peer copy on a's stream and orders it after b's
        # stream (chunk_b's allocation) — no false dependency on either compute stream.
        with torch.cuda.stream(sa.raw), torch.cuda.stream(self.recv_stream.raw):
            chunk_b.copy_(chunk_a, non_blocking=True)
        chunk_b.record_stream(sa.raw)  # the allocator must not reuse chunk_b while a's stream writes it
        return chunk_a, chunk_b

    def _scatter(self, ids, chunk: torch.Tensor, num_tokens, per_layer: bool, label: str) -> list[Event]:
        """Enqueue the scatter on b; return the events of layers 0..L-2 (the caller records the last)."""
        b, sb = self.dst, self.recv_stream
        L = b.kv.num_layers
        if b.kv.device.type == "cpu":
            from kvtier.engine.movers import layer_kv
            from kvtier.reference import scatter_ref

            def part(layer):
                one, p = layer_kv(b.kv, layer), chunk[:, layer : layer + 1]
                return lambda: scatter_ref(one, ids, p, num_tokens)

            steps = [part(layer) for layer in range(L)] if per_layer else [
                lambda: scatter_ref(b.kv, ids, chunk, num_tokens)
            ]  # fmt: skip
        else:
            from kvtier import ops

            def part(layer):
                return lambda: ops.scatter(b.kv, ids, chunk, num_tokens=num_tokens, layers=(layer, 1))

            steps = [part(layer) for layer in range(L)] if per_layer else [
                lambda: ops.scatter(b.kv, ids, chunk, num_tokens=num_tokens)
            ]  # fmt: skip
        events = []
        for i, step in enumerate(steps):
            b.device.launch(step, sb)
            if per_layer and i < L - 1:
                events.append(sb.record(f"{label}:layer{i}"))  # layer i has landed on b
        return events

    def close(self) -> None:
        """Wait for every handoff submitted; the streams stay with their devices."""
        self.send_stream.synchronize()  # submitted is not done: the copies must land first
        self.recv_stream.synchronize()  # and the scatters on b, whose events the trackers hold


def handoff(src_kv, src_blocks, dst_kv, dst_blocks, *, after: Event | None, src_device=None,
            dst_device=None, num_tokens: int | None = None, per_layer: bool = True,
            sanitize: bool | None = None) -> HandoffJob:  # fmt: skip
    """One-shot `Handoff(src_kv, dst_kv, ...).send(...)`; see `Handoff` for the arguments."""
    h = Handoff(src_kv, dst_kv, src_device=src_device, dst_device=dst_device, sanitize=sanitize)
    return h.send(src_blocks, dst_blocks, after=after, num_tokens=num_tokens, per_layer=per_layer)


__all__ = ["Handoff", "HandoffJob", "Side", "cross_wait", "handoff", "side"]
