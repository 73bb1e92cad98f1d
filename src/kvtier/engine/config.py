"""`EngineConfig`: every knob of a `TransferEngine`, checked once when it is made."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.engine.paths import Path, parse_path


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """How a `TransferEngine` moves its jobs. Each bad field raises ValueError naming it.

    path: "auto" (the rule in `kvtier.engine.paths`), "staged", "kernel" or "batch"; a job's
        own `path=` wins. Stored as a `Path`.
    sanitize: raise LifecycleError on illegal moves (None: the environment's KVTIER_SANITIZE).
    staging_bytes: GPU staging per direction for the staged path (two buffers of half each).
        Larger chunks bring the DMAs closer to the link's ceiling, and the CPU cost of a submit
        grows with the number of chunks; at least two blocks (checked against the cache).
    uva_ctas: CTAs of the kernel path's persistent grid (None: a quarter of the SMs).
    compute_beside: the model computes while jobs run (steers "auto" to copy-engine paths).
    graphs: on CUDA, replay staged jobs from CUDA graphs captured once per direction / slot size /
        block count / last-block tokens, each pointed at the job's slot.
    max_graphs: size of that LRU cache of graphs.
    graph_execs: execs kept per graph, each pointed at a recent slot: a job on one of those slots
        replays without first moving the graph's DMA nodes. Slots are reused lowest address
        first, so a few execs cover the slots a serving loop cycles through.

    >>> EngineConfig(path="kernel", sanitize=True).path
    <Path.KERNEL: 'kernel'>
    """

    path: Path | str = Path.AUTO
    sanitize: bool | None = None
    staging_bytes: int = 512 << 20
    uva_ctas: int | None = None
    compute_beside: bool = True
    graphs: bool = True
    max_graphs: int = 64
    graph_execs: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", parse_path(self.path))  # frozen: the parsed value, once
        if self.sanitize is not None and not isinstance(self.sanitize, bool):
            raise ValueError(f"sanitize: expected True, False or None, got {self.sanitize!r}")
        if not _positive_int(self.staging_bytes):
            raise ValueError(f"staging_bytes: expected a positive int of bytes, got {self.staging_bytes!r}")
        if self.uva_ctas is not None and not _positive_int(self.uva_ctas):
            raise ValueError(f"uva_ctas: expected a positive int or None, got {self.uva_ctas!r}")
        if not isinstance(self.compute_beside, bool):
            raise ValueError(f"compute_beside: expected a bool, got {self.compute_beside!r}")
        if not isinstance(self.graphs, bool):
            raise ValueError(f"graphs: expected a bool, got {self.graphs!r}")
        if not _positive_int(self.max_graphs):
            raise ValueError(f"max_graphs: expected a positive int, got {self.max_graphs!r}")
        if not _positive_int(self.graph_execs):
            raise ValueError(f"graph_execs: expected a positive int, got {self.graph_execs!r}")
