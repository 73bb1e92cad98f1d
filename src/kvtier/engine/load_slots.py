"""`TransferEngine.load_slots`: a request's chunks, each in its own READY slot, into its blocks,
layer by layer across all of them (layer-major), on the load stream.

    wait pending readers/writers/savers/loaders of the blocks
    -> per layer l: one UVA launch copying layer l of every slot -> record layer l's event
    -> record e_load; every slot READING(e_load); the blocks LOADING(e_load)

Chunk-major loads (one job per slot) land layer 0 of the request only when almost every byte has
landed; here layer 0 of every chunk lands first, so attention of layer 0 may start after 1/L of
the bytes and the copy hides under the forward. One `LoadJob` per slot (the store tracks chunks
one by one), all sharing the same layer events and e_load: each settles when e_load completes.
The copy is the kernel path (`paths.py`): per-layer events need a copy per layer, and one
launch per layer for the whole request keeps the CPU cost flat in the number of chunks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvtier.engine.jobs import LoadJob
from kvtier.lifecycle import Access, LifecycleError, SlotState
from kvtier.pool import Slot

if TYPE_CHECKING:
    from kvtier.engine.engine import TransferEngine


def load_slots(engine: TransferEngine, slots, block_ids, *, num_tokens: int | None = None) -> list[LoadJob]:
    t0 = time.perf_counter()
    engine._check_open()
    slots = list(slots) if not isinstance(slots, Slot) else None
    if not slots or not all(isinstance(s, Slot) for s in slots):
        raise ValueError("slots: expected a non-empty sequence of pool Slots")
    if len({id(s) for s in slots}) != len(slots):
        raise ValueError("slots: a slot appears twice; each chunk of a request has its own slot")
    ids, bset = engine._check_ids.check(block_ids, True, num_tokens)  # bset: the same ids, checked
    per_block = engine.kv.chunk_nbytes(1)
    counts = []
    for j, s in enumerate(slots):
        if s.nbytes % per_block:
            raise ValueError(f"slots[{j}]: holds {s.nbytes} B, not a whole number of {per_block} B blocks")
        counts.append(s.nbytes // per_block)
    if sum(counts) != len(ids):
        raise ValueError(f"block_ids: {len(ids)} ids for slots holding {sum(counts)} blocks")
    engine.poll()  # a save into one of these slots that has completed becomes READY now
    with engine._lock:
        if engine.sanitize:
            for s in slots:
                state = engine.slots.state(s)
                if state not in (SlotState.READY, SlotState.READING):
                    # Checked before submitting anything: a half-submitted job could not be undone.
                    why = "the slot holds no complete data yet: wait for its save job first"
                    raise LifecycleError("load", s.name, state.value, None, why)
        k = next(engine._seq)
        stream = engine.load_stream
        waits = engine.blocks.waits_for(Access.LOAD, bset, stream=stream)
        for e in waits:
            # The load must not overwrite blocks still read, written or saved (vLLM #47282).
            stream.wait_event(e)
        try:
            layers = engine.mover.load_slots(ids, counts, num_tokens, slots, stream, f"e_load#{k}")
        except BaseException:
            engine._quiesce(stream)  # its enqueued layers must not outlive the error (they read the slots)
            raise
        e_load = stream.record(f"e_load#{k}")
        for s in slots:
            engine.slots.begin_read(s, e_load)  # each slot may be freed only after e_load
        engine.blocks.begin_load(bset, e_load, waited=waits)
        events = [*layers, e_load]
        jobs, at = [], 0
        for s, c in zip(slots, counts, strict=True):
            part = bset.ids[at : at + c]
            jobs.append(LoadJob(engine, s, e_load, part, s.nbytes, "kernel", 0.0, layer_events=events))
            at += c
        engine._jobs.extend(jobs)
    spent = time.perf_counter() - t0
    for j in jobs:
        j.submit_s = spent / len(jobs)
    return jobs
