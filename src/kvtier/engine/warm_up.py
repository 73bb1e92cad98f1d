"""warm_up: every copy path's first use, at start, so that no serving step pays it.

    warm_up(engine, block_ids, chunk_blocks, save_streams=(), load_paths=())

A path's first use compiles its Triton kernels, captures the staged path's CUDA graphs for a
chunk's shape, and makes the batched copy's first call: tenths of a second that would otherwise
stall the first step that saves or loads. ``warm_up`` saves two chunks of ``block_ids`` (blocks
that hold no request's KV yet) into the pool, once per save stream, loads them back into the same
blocks on each load path the engine chooses (whole-job and per-layer, one slot and several) and
each one the caller names (``load_paths``: a path its loads ask for by name, such as a layer-wise
load's "kernel"), waits for every copy, and gives the slots back: the blocks end as they began.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def warm_up(engine, block_ids, chunk_blocks: int, save_streams=(), load_paths=()) -> bool:
    """Run every path once over ``block_ids`` (a whole number of chunks of ``chunk_blocks``
    blocks: at most two are used); ``save_streams``: streams saves also run on (the engine's own
    save stream when empty); ``load_paths``: paths the caller's loads name, beside the engine's
    own. True once done; False, with a warning, if a path failed (a first use
    in a step then pays it: a warm-up is not worth failing a start)."""
    blocks = list(block_ids)[: 2 * chunk_blocks]
    blocks = blocks[: len(blocks) - len(blocks) % chunk_blocks]
    if not blocks:
        return True
    counts = [chunk_blocks] * (len(blocks) // chunk_blocks)
    stream = engine.device.current_stream()
    slots = []
    try:
        for lane in list(save_streams) or [None]:
            jobs = engine.save_slots(blocks, counts, after=stream.record(), stream=lane)
            for job in jobs:
                engine.wait(job)  # READY only once its copy landed: a load may read it then
            slots.extend(job.slot for job in jobs)
        mine = slots[-len(counts) :]
        paths = {engine.load_path(per_layer=True).value, engine.load_path(per_layer=False).value}
        for path in sorted(paths | {str(p) for p in load_paths if p}):
            for per_layer in (True, False):
                engine.wait(engine.load(mine[0], blocks[:chunk_blocks], per_layer=per_layer, path=path))
            if len(mine) > 1:
                for job in engine.load_slots(mine, blocks, path=path):
                    engine.wait(job)  # the next path's copies must not race these into the blocks
        return True
    except Exception as exc:
        log.warning("kvtier: warm-up at start failed (%s): a path's first use may slow a step", exc)
        return False
    finally:
        for slot in slots:
            engine.release(slot)  # freed once no copy into / out of it is pending
