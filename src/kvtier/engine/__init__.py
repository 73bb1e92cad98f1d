"""The transfer engine: save (GPU blocks -> pinned slot) and load (slot -> GPU blocks) jobs on
copy streams, in the lifecycle protocol's order (`kvtier.lifecycle`), with a per-device mover for
the bytes themselves.

`TransferEngine(device, kv, pool, config=EngineConfig(...))` offers, to a serving engine or the
store (`kvtier.store.KVStore`):

    save(block_ids, after) -> SaveJob      gather blocks into a new slot; READY once its event completed
    load(slot, block_ids)  -> LoadJob      scatter a READY slot (from block skip_blocks on) into blocks;
                                           one event per layer
    save_slots(block_ids, counts, after) -> [SaveJob]  blocks into several new slots, one submission
    load_slots(slots, block_ids) -> [LoadJob]  several slots into one request's blocks, one submission
                                           (kernel path: layer-major; batch: one batched copy)
    compute_read / compute_write(blocks, event)  what compute does to the blocks; later jobs wait for it
    job.wait_on(stream) / job.wait_layer(l, stream)  compute waits for a job (no host blocking)
    poll() / wait(job)                     settle completed jobs (never on a timeout)
    release(slot)                          retire a slot; freed once no copy uses it
    layer_flags() -> LayerFlags            per-layer "landed" flags a CUDA graph waits on: a step
                                           with loads arms them, its loads join (`flags=step`), the
                                           seal sets flag l once layer l of every load landed
    close()                                wait for every job; the pool stays open
    warm_up(engine, block_ids, chunk_blocks)  every path's first use, at start (warm_up.py)

The parts:

    TransferEngine     the protocol: waits, events, tracker moves, settling   (engine.py)
    EngineConfig       every knob, checked once                                (config.py)
    SaveJob, LoadJob   the handles a save / load returns                       (jobs.py)
    LayerFlags, FlagStep  the per-layer flags and one step's arming of them     (flags.py)
    SubmitTrace        an opt-in timer of each submit's phases                 (trace.py)
    Path, choose_path, parse_path  which copy path a job takes, and why        (paths.py)
    IdCheck            block ids checked once, at the entry                    (ids.py)
    movers             SimMover (CPU, late copies), CudaMover (staged / kernel / batch)
    fastpath/          beneath the CUDA mover: CUDA-graph replay, the C helper, batched copies
    handoff            GPU-to-GPU: blocks of device a's cache into device b's (peer copy)
"""

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import TransferEngine
from kvtier.engine.flags import FlagStep, LayerFlags
from kvtier.engine.handoff import Handoff, HandoffJob, handoff
from kvtier.engine.jobs import LoadJob, SaveJob
from kvtier.engine.paths import Path, choose_path, parse_path
from kvtier.engine.trace import SubmitTrace
from kvtier.engine.warm_up import warm_up

__all__ = [
    "EngineConfig",
    "FlagStep",
    "Handoff",
    "HandoffJob",
    "LayerFlags",
    "LoadJob",
    "Path",
    "SaveJob",
    "SubmitTrace",
    "TransferEngine",
    "choose_path",
    "handoff",
    "parse_path",
    "warm_up",
]
