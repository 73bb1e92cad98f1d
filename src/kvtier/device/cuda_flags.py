"""Flags of CudaDevice: 32-bit words in device memory, written and waited on by CUDA's stream
memory operations, driven through ctypes from the CUDA driver (libcuda), as `cuda_events.py`
drives the runtime's event calls.

    memop_api() -> (calls, why)      cuStreamWaitValue32 / cuStreamWriteValue32 / cuStreamBatchMemOp
    CudaFlags                        the words: an int32 CUDA tensor, made once
    CudaFlagBatch                    a batch prepared once: its op array is built a single time
    write / wait / run               enqueue on a stream (CudaDevice.flag_write / flag_wait / flag_run)
    writer                           write(index, value) with the checks done once (a load's per-layer writes)

Why these calls. An event wait inside a CUDA graph is fixed to the event's record at capture; a
flag wait names an address and a value, both constants of the graph, and reads the word when the
replay reaches it. So a graph captured once with a wait per layer replays in every step, and the
load stream decides at run time when each layer's word is set. The driver turns each call made on
a capturing stream into a batch-memop node (stream capture of these calls: CUDA 11.7 and later).

Availability. The "v2" memop entry points (`cuStreamWaitValue32_v2`, ...) exist from CUDA 11.7 and
are enabled on every platform from CUDA 12.0; `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS` (92)
describes the legacy v1 calls only (they needed the driver parameter NVreg_EnableStreamMemOPs=1),
so it is no test for these. `memop_api` checks the driver version and the symbols instead.

Device memory, not host-mapped pinned memory. Every graph replay of every step runs the waits,
almost always on words already set: the GPU's front end then reads device memory, where a mapped
host word would cost a PCIe round trip per wait per step. Only streams write the words (the copy
stream, and the flag stream of `kvtier.engine.flags`), so the host never needs to store into them;
a load that fails on the host is unblocked by that same stream path (`LayerFlags` seals its step
in a `finally`), not by a host store.

Deadlock. CUDA cannot see the order a flag wait creates. Two streams sharing one hardware queue
(`CUDA_DEVICE_MAX_CONNECTIONS` small, e.g. 1) serialize: a wait enqueued before the write that
satisfies it, on a stream of the same queue, never returns. kvtier's protocol enqueues every write
before the waits it satisfies where it can (a load submitted before the forward) and orders its
streams by events besides (the load stream waits for the re-arm's event).
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import byref, c_char_p, c_int, c_uint, c_uint32, c_void_p
from types import SimpleNamespace

import numpy as np
import torch

from kvtier.device.base import FLAG_MASK, FlagBatch, FlagOp, Flags, Stream
from kvtier.device.cuda_events import OnDevice, event_api

_WRITE_32, _WAIT_32 = 2, 1  # CU_STREAM_MEM_OP_WRITE_VALUE_32, CU_STREAM_MEM_OP_WAIT_VALUE_32
_GEQ, _EQ = 0x0, 0x1  # CU_STREAM_WAIT_VALUE_GEQ (cyclic), CU_STREAM_WAIT_VALUE_EQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier first (earlier writes visible)
_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: this thread has no current context yet
_MAX_BATCH = 255  # cuStreamBatchMemOp takes fewer than 256 ops a call
_MIN_DRIVER = 11070  # the v2 memop calls and their stream capture

# One CUstreamBatchMemOpParams (a 48-byte union): the wait/write member's fields, padded.
OP_DTYPE = np.dtype(
    [
        ("operation", "<u4"),
        ("pad0", "<u4"),
        ("address", "<u8"),
        ("value", "<u8"),  # value (32-bit ops use the low word) / value64
        ("flags", "<u4"),
        ("pad1", "<u4"),
        ("alias", "<u8"),
        ("pad2", "<u8"),
    ]
)
assert OP_DTYPE.itemsize == 48


@functools.cache
def memop_api() -> tuple[SimpleNamespace | None, str]:
    """(the driver's stream memory operations as ctypes functions, why not usable or '')."""
    if not torch.cuda.is_available() or not torch.version.cuda:
        return None, "needs a CUDA build of torch and a GPU"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, f"libcuda.so.1 not found: {e}"
    ver = c_int(0)
    if lib.cuDriverGetVersion(byref(ver)) != 0 or ver.value < _MIN_DRIVER:
        return None, f"stream memory operations need a CUDA driver >= 11.7, found {ver.value}"

    def fn(name, *args):
        return ctypes.CFUNCTYPE(c_int, *args)((name, lib))

    try:
        api = SimpleNamespace(
            wait=fn("cuStreamWaitValue32_v2", c_void_p, ctypes.c_uint64, c_uint32, c_uint),
            write=fn("cuStreamWriteValue32_v2", c_void_p, ctypes.c_uint64, c_uint32, c_uint),
            batch=fn("cuStreamBatchMemOp_v2", c_void_p, c_uint, c_void_p, c_uint),
            error_string=fn("cuGetErrorString", c_int, ctypes.POINTER(c_char_p)),
            driver=ver.value,
        )
    except AttributeError as e:
        return None, f"the CUDA driver lacks a stream memory operation: {e}"
    return api, ""


def _error(api: SimpleNamespace, what: str, rc: int) -> RuntimeError:
    msg = c_char_p()
    name = msg.value.decode() if api.error_string(rc, byref(msg)) == 0 and msg.value else "?"
    return RuntimeError(f"{what} failed: CUresult {rc} ({name})")


class CudaFlags(Flags):
    """`n` int32 words of CUDA memory (read as unsigned 32-bit values)."""

    def __init__(self, device, n: int, value: int, label: str):
        self._dev, self.n, self.label = device, n, label
        signed = value - (1 << 32) if value >= 1 << 31 else value  # the same 32 bits in an int32
        self.words = torch.full((n,), signed, dtype=torch.int32, device=device._torch_device)
        device.synchronize()  # the fill landed before any other stream reads or writes a word
        self.ptr = self.words.data_ptr()  # word i lives at ptr + 4 * i

    def read(self) -> list[int]:
        self._dev.synchronize()  # every enqueued write has run
        return [v & FLAG_MASK for v in self.words.cpu().tolist()]


class CudaFlagBatch(FlagBatch):
    """The ops as the driver takes them: one array of CUstreamBatchMemOpParams, built once;
    `set_values` writes into it (no per-op Python work on the hot path)."""

    def __init__(self, flags: CudaFlags, ops: list[FlagOp]):
        self.flags = flags
        a = np.zeros(len(ops), dtype=OP_DTYPE)
        a["operation"] = [_WRITE_32 if op.write else _WAIT_32 for op in ops]
        a["address"] = [flags.ptr + 4 * op.index for op in ops]
        a["value"] = [op.value for op in ops]
        a["flags"] = [_WRITE_DEFAULT if op.write else _GEQ if op.geq else _EQ for op in ops]
        self.array = a

    def __len__(self) -> int:
        return len(self.array)

    @property
    def ops(self) -> tuple[FlagOp, ...]:
        a, ptr = self.array, self.flags.ptr
        return tuple(
            FlagOp(bool(op == _WRITE_32), (int(addr) - ptr) // 4, int(v), op != _WRITE_32 and f == _GEQ)
            for op, addr, v, f in zip(a["operation"], a["address"], a["value"], a["flags"], strict=True)
        )

    def set_values(self, positions: range, value: int) -> None:
        self._check_set(positions, value)
        self.array["value"][positions.start : positions.stop : positions.step] = value


def _call(api: SimpleNamespace, device, stream: Stream, what: str, fn, *args) -> None:
    """fn(stream handle, *args) with the stream's device current where the driver needs it: on the
    legacy default stream (handle 0, the current context's), and on a thread with no current
    context yet (then the runtime makes the device's primary context current, and one retry)."""
    rt = event_api()[0]
    if stream.handle or rt is None:
        rc = fn(stream.handle, *args)
    else:
        with OnDevice(rt, device.index):
            rc = fn(0, *args)
    if rc == _INVALID_CONTEXT and rt is not None:
        rt.set_device(device.index)  # the runtime binds this thread to the device's primary context
        rc = fn(stream.handle, *args)
    if rc != 0:
        raise _error(api, what, rc)


def write(api, device, flags: CudaFlags, index: int, value: int, stream: Stream) -> None:
    # The default flags put a memory barrier first: the stream's earlier writes are visible
    # before anyone can see this word change.
    _call(
        api, device, stream, "cuStreamWriteValue32", api.write, flags.ptr + 4 * index, value, _WRITE_DEFAULT
    )


def writer(api, device, flags: CudaFlags, stream: Stream):
    """`write(index, value)` on `stream` with every check done: one ctypes call per word (a load
    writes a word per layer). Bad indices or values are the caller's bug: the driver refuses them
    only where the address leaves the allocation."""
    fn, ptr, handle = api.write, flags.ptr, stream.handle

    def write_word(index: int, value: int) -> None:
        # After the stream's earlier work, its writes visible first (the default memory barrier).
        if not handle or fn(handle, ptr + 4 * index, value, _WRITE_DEFAULT) != 0:
            write(api, device, flags, index, value, stream)  # the careful path: context, errors

    return write_word


def wait(api, device, flags: CudaFlags, index: int, value: int, stream: Stream, geq: bool) -> None:
    _call(
        api,
        device,
        stream,
        "cuStreamWaitValue32",
        api.wait,
        flags.ptr + 4 * index,
        value,
        _GEQ if geq else _EQ,
    )


def run(api, device, batch: CudaFlagBatch, stream: Stream) -> None:
    a = batch.array
    for at in range(0, len(a), _MAX_BATCH):  # the driver copies the ops: the array may change after
        part = a[at : at + _MAX_BATCH]
        _call(api, device, stream, "cuStreamBatchMemOp", api.batch, len(part), part.ctypes.data, 0)
