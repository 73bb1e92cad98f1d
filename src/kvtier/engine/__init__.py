"""The transfer engine: save (GPU blocks -> pinned slot) and load (slot -> GPU blocks) jobs on
copy streams, in the lifecycle protocol's order (`kvtier.lifecycle`), with a per-device mover
for the bytes themselves.

    TransferEngine   the protocol: waits, events, tracker moves, settling   (engine.py)
    SaveJob, LoadJob the handles a save / load returns                      (jobs.py)
    Path, choose     which copy path a job takes, and why (measured)        (paths.py)
    movers           SimMover (CPU, late copies) and CudaMover (staged / kernel / batch)
    graphs           staged jobs replayed from CUDA graphs (LRU keyed by slot, n, last tokens)
    handoff          GPU-to-GPU: blocks of device a's cache into device b's (peer copy)
    ids              block-id checks without a per-block loop or a sort
"""

from kvtier.engine.engine import TransferEngine
from kvtier.engine.handoff import Handoff, HandoffJob, handoff
from kvtier.engine.jobs import LoadJob, SaveJob
from kvtier.engine.paths import Path, choose_path

__all__ = ["Handoff", "HandoffJob", "LoadJob", "Path", "SaveJob", "TransferEngine", "choose_path", "handoff"]
