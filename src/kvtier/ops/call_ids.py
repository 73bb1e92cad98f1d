"""The block ids of one op call, as the kernel reads them: whatever the caller passed, on the
cache's device, with how the kernel must check them.

    given                      host work                                   kernel check
    BlockIds (checked)         none (a wait on its event from another stream)   none
    BlockIds (lazy)            as above                                    range (+ repeats: scatter)
    GPU tensor, check auto     none: the tensor is read as it is           range (+ repeats: scatter)
    GPU tensor, check eager    read back and checked (the host waits)      none
    list / CPU tensor / array  checked on the host as they are written into
                               a pinned slot (`ops/host_ids.py`, one pass),
                               copied from there (`ops/id_ring.py`)        none (lazy: range, repeats)

`finish` marks the pinned slot free once the current stream has got past the call's launches
(one event record); ids refused by the check give their slot back at once, nothing enqueued.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.layout import PagedKV
from kvtier.ops.checks import (
    INTERPRETING,
    BlockIds,
    block_ids,
    check_mode,
    check_num_tokens,
    device_ids,
    matched,
)
from kvtier.ops.host_ids import host_checker, host_ids
from kvtier.ops.id_ring import ring_for, write


class CallIds:
    """dev: int32/int64 [n] on the cache's device; check: the kernel's CHECK (0 host-checked, 1
    range, 2 range and repeats); slot: the pinned slot to free after the launches (or None)."""

    __slots__ = ("dev", "n", "last_valid", "check", "slot")

    def __init__(self, dev, n, last_valid, check, slot=None):
        self.dev, self.n, self.last_valid, self.check, self.slot = dev, n, last_valid, check, slot


def call_ids(kv: PagedKV, ids, unique: bool, num_tokens: int | None, check: str) -> CallIds:
    """The ids of one call (`unique` for writes), checked as `check` says (ops' `check=`)."""
    lazy_check = 2 if unique else 1
    if isinstance(ids, BlockIds):
        if check != "auto":
            raise ValueError("check: a BlockIds was checked when made (block_ids(..., check=...))")
        b = matched(kv, ids, unique, num_tokens)
        return CallIds(use_ids(b), b.dev.shape[0], b.last_valid, lazy_check if b.lazy else 0)
    check = check_mode(check)
    if isinstance(ids, torch.Tensor) and not ids.is_cpu:
        if check == "eager":
            b = block_ids(kv, ids, unique=unique, num_tokens=num_tokens, check="eager")
            return CallIds(use_ids(b), len(b.dev), b.last_valid, 0)
        dev = device_ids(kv, ids)
        return CallIds(dev, dev.shape[0], check_num_tokens(kv, dev.shape[0], num_tokens), lazy_check)
    if check == "lazy":
        return _lazy_host(kv, ids, unique, num_tokens, lazy_check)
    h = host_checker(kv)
    n = h.count(ids)
    if n is None:  # a container whose length only reading it says (a generator, a 2-D tensor...)
        ids = host_ids(kv, ids, unique, False)
        n = ids.shape[0]
    if INTERPRETING:
        a = np.empty(n, dtype=np.int32)
        h.fill(ids, n, unique, a)
        return CallIds(torch.from_numpy(a), n, check_num_tokens(kv, n, num_tokens), 0)
    slot = ring_for(kv).take(n)
    try:
        h.fill(ids, n, unique, slot.host_np)  # checked and written into the pinned slot at once
        last_valid = check_num_tokens(kv, n, num_tokens)
    except BaseException:
        slot.release()  # nothing enqueued reads it: kept, a refused call would use the ring up
        raise
    try:
        dev = slot.send(n)
    except BaseException:
        slot.done()  # whatever was enqueued must pass before the slot is written again
        raise
    return CallIds(dev, n, last_valid, 0, slot)


def _lazy_host(kv: PagedKV, ids, unique: bool, num_tokens, lazy_check: int) -> CallIds:
    """Host ids with check="lazy": not checked here, sent as they are for the kernel to check."""
    a = host_ids(kv, ids, unique, False)
    n = a.shape[0]
    last_valid = check_num_tokens(kv, n, num_tokens)
    if n and (a.min() < 0 or a.max() >= 2**31):
        a = np.where((a < 0) | (a >= 2**31), -1, a)  # int32 cannot hold them: still out of range
    if INTERPRETING:
        return CallIds(torch.from_numpy(a), n, last_valid, lazy_check)
    slot = ring_for(kv).take(n)
    try:
        write(slot, a)
        dev = slot.send(n)
    except BaseException:
        slot.done()  # whatever was enqueued must pass before the slot is written again
        raise
    return CallIds(dev, n, last_valid, lazy_check, slot)


def finish(ids: CallIds) -> None:
    """After the call's last launch, on the stream that ran it."""
    if ids.slot is not None:
        ids.slot.done()


def use_ids(ids: BlockIds) -> torch.Tensor:
    """ids.dev, made safe to read on the current stream: a stream other than the one that made it
    waits for its `ready` event, and keeps its memory from being handed out again before it read
    them. Inside a CUDA-graph capture nothing is recorded (an outside event cannot be waited on
    there): the ids must have landed already, and the graph's owner keeps them alive."""
    if ids.ready is not None:
        index = ids.dev.get_device()
        other = torch._C._cuda_getCurrentRawStream(index) != ids.stream
        if other and not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream(index)
            # The ids may have been copied to the GPU on another stream: read them only once landed.
            stream.wait_event(ids.ready)
            # And their memory must not be handed out again before this stream has read them.
            ids.dev.record_stream(stream)
    return ids.dev
