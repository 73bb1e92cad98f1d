"""`kvtier probe --all-gpus`: what several GPUs of one machine do together (seed section 5.2).

- pinned host->device and device->host, 1 GiB, each GPU alone and then every GPU at once
  (one stream per GPU, the copies enqueued round-robin so they start together): the drop from
  alone to together is the contention on shared PCIe switches, root ports and DRAM;
- GPU->GPU copy rate of every ordered pair (`copy_` between devices) and whether peer access is
  possible (`torch.cuda.can_device_access_peer`: then torch enables it and the copy goes P2P,
  else the driver bounces it through host memory);
- the topology matrix from NVML (nvmlDeviceGetTopologyCommonAncestor -> PIX/PXB/PHB/NODE/SYS)
  and the NUMA node of each GPU.

The measurements are injectable (`Measure`) so the assembly into ceilings is tested on the CPU.
With one GPU or none the report says so and keeps what it could measure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.bench import nvml
from kvtier.ceilings import Ceilings

MiB, GiB = 1 << 20, 1 << 30


@dataclass(slots=True)
class Measure:
    """The device side, replaceable in tests: count() GPUs, host_device(gpus, nbytes, "h2d"|"d2h")
    -> per-GPU GB/s with those GPUs copying at once, peer(i, j, nbytes) -> GB/s, access(i, j)."""

    count: Callable[[], int]
    host_device: Callable[[list[int], int, str], list[float]]
    peer: Callable[[int, int, int], float]
    access: Callable[[int, int], bool]


@dataclass(slots=True)
class MultiReport:
    gpus: int
    note: str | None
    nbytes: int
    alone: dict[str, list[float | None]] = field(default_factory=dict)  # "h2d"/"d2h" -> per GPU
    together: dict[str, list[float | None]] = field(default_factory=dict)
    peer_gbps: list[list[float | None]] = field(default_factory=list)
    peer_access: list[list[bool | None]] = field(default_factory=list)
    topology: list[list[str]] = field(default_factory=list)
    numa_nodes: list[int | str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    def total(self, direction: str) -> float | None:
        """GB/s of every GPU at once, summed; None unless every GPU's figure is there."""
        vals = self.together.get(direction, [])
        return sum(vals) if vals and self.gpus >= 2 and all(v for v in vals) else None

    def slowest_peer(self) -> float | None:
        vals = [v for row in self.peer_gbps for v in row if v]
        return min(vals) if vals else None

    def ceilings(self, base: Ceilings | None = None) -> Ceilings:
        """`base` (a single-GPU probe) with the multi-GPU figures and the `multi_gpu` block added."""
        figs = dict(base.figures) if base else {}
        for d in ("h2d", "d2h"):
            if self.total(d):
                figs[f"{d}_pinned_all_gpus_gbps"] = self.total(d)
            if not figs.get(f"{d}_pinned_gbps") and self.alone.get(d) and self.alone[d][0]:
                figs[f"{d}_pinned_gbps"] = self.alone[d][0]
        if self.slowest_peer():
            figs["peer_gbps"] = self.slowest_peer()
        multi = {
            "gpus": max(self.gpus, 1),
            "h2d_pinned_gbps": self.alone.get("h2d", []),
            "h2d_pinned_all_gpus_gbps": self.together.get("h2d", []),
            "d2h_pinned_gbps": self.alone.get("d2h", []),
            "d2h_pinned_all_gpus_gbps": self.together.get("d2h", []),
            "peer_gbps": self.peer_gbps,
            "peer_access": self.peer_access,
            "topology": self.topology,
            "numa_nodes": self.numa_nodes,
        }
        b = base or Ceilings()
        return Ceilings(figs, b.gpu, b.gpu_key, b.measured_at, b.source, multi_gpu=multi)

    def to_json(self) -> dict:
        return {
            "kvtier_probe_multi": 1,
            "gpus": self.gpus,
            "note": self.note,
            "nbytes": self.nbytes,
            "alone_gbps": self.alone,
            "together_gbps": self.together,
            "total_gbps": {d: self.total(d) for d in ("h2d", "d2h")},
            "peer_gbps": self.peer_gbps,
            "peer_access": self.peer_access,
            "topology": self.topology,
            "numa_nodes": self.numa_nodes,
            "errors": self.errors,
        }


def topology(
    n: int, read: Callable[..., dict] = nvml.read
) -> tuple[list[list[str]], list[int | str], str | None]:
    """(matrix of nvidia-smi topo names, NUMA node per GPU, error) for GPUs 0..n-1 (NVML index = CUDA
    index assumed: under CUDA_VISIBLE_DEVICES the two may differ)."""
    matrix = [["X" if i == j else nvml.UNKNOWN for j in range(n)] for i in range(n)]
    numa: list[int | str] = []
    for i in range(n):
        info = read(i)
        if "error" in info:
            return matrix, [nvml.UNKNOWN] * n, info["error"]
        numa.append(info.get("numa_node", nvml.UNKNOWN))
        for p in info.get("peers", []):
            j = p.get("nvml_index")
            if isinstance(j, int) and 0 <= j < n and j != i:
                matrix[i][j] = p.get("path", nvml.UNKNOWN)
    return matrix, numa, None


def run_multi(
    *,
    size: int | None = None,
    quick: bool = False,
    on_step: Callable[[str], None] | None = None,
    measure: Measure | None = None,
    read: Callable[..., dict] = nvml.read,
) -> MultiReport:
    """Measure every GPU alone and all at once, every pair, and read the topology."""
    m = measure or cuda_measure()
    n = m.count()
    nbytes = size or (64 * MiB if quick else GiB)
    note = (
        None
        if n >= 2
        else f"{n} GPU{'s' if n != 1 else ''} visible: nothing is shared; measured what one allows"
    )
    r = MultiReport(gpus=n, note=note, nbytes=nbytes)

    def guarded(key: str, fn: Callable[[], object], default: object) -> object:
        if on_step:
            on_step(key)
        try:
            return fn()
        except Exception as e:  # one broken GPU or pair must not hide the other figures
            r.errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            return default

    for d in ("h2d", "d2h"):
        r.alone[d] = [
            guarded(f"{d} gpu{i} alone", lambda i=i, d=d: m.host_device([i], nbytes, d)[0], None)
            for i in range(n)
        ]
        if n >= 2:
            r.together[d] = guarded(
                f"{d} all gpus", lambda d=d: m.host_device(list(range(n)), nbytes, d), [None] * n
            )
    r.peer_access = [
        [
            None if i == j else guarded(f"access {i}->{j}", lambda i=i, j=j: m.access(i, j), None)
            for j in range(n)
        ]
        for i in range(n)
    ]
    r.peer_gbps = [
        [
            None if i == j else guarded(f"peer {i}->{j}", lambda i=i, j=j: m.peer(i, j, nbytes), None)
            for j in range(n)
        ]
        for i in range(n)
    ]
    if n:
        r.topology, r.numa_nodes, err = topology(n, read)
        if err:
            r.errors["topology"] = err
    return r


# ---- the CUDA side -------------------------------------------------------------------------


def cuda_measure(reps: int = 5) -> Measure:
    import torch

    def count() -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    return Measure(
        count,
        lambda g, n, d: host_device(g, n, d, reps),
        lambda i, j, n: peer(i, j, n, reps),
        torch.cuda.can_device_access_peer,
    )


def host_device(gpus: list[int], nbytes: int, direction: str, reps: int = 5) -> list[float]:
    """Per-GPU GB/s of `reps` pinned copies of `nbytes`, every GPU of `gpus` copying at once."""
    import torch

    bufs = []
    for i in gpus:
        g = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}").random_()  # never time on zeros
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(7)  # pages touched before timing
        bufs.append((i, g, h, torch.cuda.Stream(device=i)))

    def copy(g, h) -> None:
        (g.copy_(h, non_blocking=True) if direction == "h2d" else h.copy_(g, non_blocking=True))

    for _, g, h, s in bufs:
        with torch.cuda.stream(s):
            copy(g, h)  # warm-up: first-touch and the driver's lazy set-up stay out of the timing
    for i in gpus:
        torch.cuda.synchronize(i)  # every GPU idle: the timed copies start from the same state
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in bufs]
    for (*_, s), (e0, _e1) in zip(bufs, marks, strict=True):
        e0.record(s)
    for _ in range(reps):
        for _i, g, h, s in bufs:  # round-robin: every GPU has work queued at once
            with torch.cuda.stream(s):
                copy(g, h)
    for (*_, s), (_e0, e1) in zip(bufs, marks, strict=True):
        e1.record(s)
    for i in gpus:
        torch.cuda.synchronize(i)  # submitted is not done: elapsed times are valid only now
    return [reps * nbytes / (e0.elapsed_time(e1) / 1e3) / 1e9 for e0, e1 in marks]


def peer(src: int, dst: int, nbytes: int, reps: int = 5) -> float:
    """GB/s of `copy_` from GPU `src` to GPU `dst` (bytes moved once), timed on src's stream."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src}").random_()
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst}")
    b.copy_(a)  # warm-up: enables peer access (when possible) outside the timing
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)  # both idle: the timed copies wait for nothing else
    s = torch.cuda.current_stream(src)  # torch runs a device-to-device copy on the source's stream
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(s)
    for _ in range(reps):
        b.copy_(a, non_blocking=True)
    e1.record(s)
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)  # the copy's last bytes must have landed before reading the events
    return reps * nbytes / (e0.elapsed_time(e1) / 1e3) / 1e9


def summary_lines(doc: dict) -> list[str]:
    """Plain lines for the terminal: per GPU alone vs together, totals, the pair matrix."""
    n = doc["gpus"]
    lines = [
        f"{n} GPU(s), {doc['nbytes'] / GiB:.2f} GiB per copy" + (f" — {doc['note']}" if doc["note"] else "")
    ]
    fmt = lambda v: "-" if v is None else f"{v:7.1f}"  # noqa: E731
    for d in ("h2d", "d2h"):
        alone, together = doc["alone_gbps"].get(d, []), doc["together_gbps"].get(d, [])
        for i in range(n):
            t = together[i] if i < len(together) else None
            lines.append(f"  {d} gpu{i}: alone {fmt(alone[i])} GB/s, all at once {fmt(t)} GB/s")
        if doc["total_gbps"].get(d):
            lines.append(f"  {d} all GPUs at once: {doc['total_gbps'][d]:.1f} GB/s total")
    for i in range(n):
        cells = [f"{'X':>7s}" if i == j else fmt(doc["peer_gbps"][i][j]) for j in range(n)]
        topo = " ".join(f"{c:>4s}" for c in (doc["topology"][i] if doc["topology"] else []))
        numa = doc["numa_nodes"][i] if doc["numa_nodes"] else "?"
        lines.append(f"  peer gpu{i} -> [{' '.join(cells)}] GB/s  topo [{topo}]  numa {numa}")
    for k, e in doc["errors"].items():
        lines.append(f"  error {k}: {e}")
    return lines
