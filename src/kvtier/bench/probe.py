"""`kvtier probe`: this machine's ceilings in one run, each next to its datasheet figure.

Like nvbandwidth: copy-engine transfers (device->device, pinned and pageable host<->device, both
directions at once), the same through an SM kernel, kernel launch cost eager vs CUDA graph, a
bf16 matmul rate, host memcpy; then the PCIe link and NUMA node from NVML. Each figure is the
median of repeated runs, with the slowest and the fastest (`stats.Rate`), on buffers larger than
any cache (host: 256 MiB, also in --quick). A step that fails is
reported with its error; the others still run. Without a GPU only host memcpy is measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.bench import datasheet, probes
from kvtier.ceilings import FIGURES, Ceilings

MiB, GiB = 1 << 20, 1 << 30

WHAT = {
    "d2d_copy_gbps": "device->device copy_ (cudaMemcpyAsync), bytes read + written",
    "h2d_pinned_gbps": "host->device, pinned, copy engine",
    "d2h_pinned_gbps": "device->host, pinned, copy engine",
    "h2d_pageable_gbps": "host->device, pageable (staged by the driver)",
    "d2h_pageable_gbps": "device->host, pageable (staged by the driver)",
    "bidir_pinned_gbps": "both directions at once, two streams, pinned, total",
    "d2d_sm_copy_gbps": "device->device, SM kernel (Triton), bytes read + written",
    "h2d_sm_copy_gbps": "host->device, SM kernel reading pinned memory (UVA)",
    "d2h_sm_copy_gbps": "device->host, SM kernel writing pinned memory (UVA)",
    "launch_eager_us": "per tiny kernel, 200 launched one by one from Python",
    "launch_graph_us": "per tiny kernel, 200 replayed from one CUDA graph",
    "bf16_tflops": "dense bf16 matmul",
    "host_memcpy_gbps": "host memcpy (torch copy_, pageable), bytes copied",
}


def unit_of(name: str) -> str:
    return {"gbps": "GB/s", "tflops": "TFLOP/s", "us": "us"}[name.rsplit("_", 1)[1]]


@dataclass(slots=True)
class Figure:
    name: str
    value: float | None
    what: str
    datasheet: float | None = None
    datasheet_what: str | None = None
    error: str | None = None

    @property
    def unit(self) -> str:
        return unit_of(self.name)

    @property
    def ratio(self) -> float | None:
        return self.value / self.datasheet if self.value and self.datasheet else None

    def to_json(self) -> dict:
        v = self.value
        return {
            "name": self.name,
            "value": None if v is None else float(v),
            "min": getattr(v, "low", None),  # a `Rate`: the slowest and fastest of its runs
            "max": getattr(v, "high", None),
            "samples": getattr(v, "samples", None),
            "unit": self.unit,
            "what": self.what,
            "datasheet": self.datasheet,
            "datasheet_what": self.datasheet_what,
            "ratio": self.ratio,
            "error": self.error,
        }


@dataclass(slots=True)
class ProbeReport:
    gpu: str | None
    gpu_key: str | None
    no_gpu_reason: str | None
    sizes: dict
    figures: list[Figure]
    environment: dict = field(default_factory=dict)
    link: dict | None = None

    def ceilings(self) -> Ceilings:
        figs = {f.name: float(f.value) for f in self.figures if f.name in FIGURES and f.value}
        env = self.environment
        return Ceilings(
            figures=figs,
            gpu=self.gpu,
            gpu_key=self.gpu_key,
            measured_at=env.get("date"),
            source=f"kvtier probe {env.get('kvtier')}, torch {env.get('torch')}, commit {env.get('commit')}",
        )

    def to_json(self) -> dict:
        return {
            "kvtier_probe": 1,
            "gpu": self.gpu,
            "gpu_key": self.gpu_key,
            "no_gpu_reason": self.no_gpu_reason,
            "sizes": self.sizes,
            "link": self.link,
            "figures": [f.to_json() for f in self.figures],
            "ceilings": self.ceilings().to_json(),
            "environment": self.environment,
        }


def no_gpu_reason() -> str | None:
    """None when a CUDA GPU is usable, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"torch.cuda.is_available() is False (torch {torch.__version__}, {built})"
    return None


def default_sizes(on_gpu: bool, quick: bool, size: int | None) -> dict[str, int]:
    if size is not None:
        return {"d2d": size, "host_device": size, "host": size}
    if on_gpu:
        return (
            {"d2d": 256 * MiB, "host_device": 64 * MiB, "host": 256 * MiB}
            if quick
            else {"d2d": 4 * GiB, "host_device": GiB, "host": GiB}
        )
    return {"d2d": 0, "host_device": 0, "host": 256 * MiB}  # past any CPU cache, quick or not


def probe_steps() -> int:
    """How many steps `run_probe` takes here (it calls `on_step` once per step)."""
    return 10 if no_gpu_reason() is None else 1


def run_probe(
    *, size: int | None = None, quick: bool = False, on_step: Callable[[str], None] | None = None
) -> ProbeReport:
    """Measure everything this machine allows. `on_step(name)` is called before each step."""
    from kvtier.bench.env import environment
    from kvtier.bench.timing import Timer

    reason = no_gpu_reason()
    on_gpu = reason is None
    sizes = default_sizes(on_gpu, quick, size)
    timer = Timer("cuda" if on_gpu else "cpu", min_reps=3 if quick else 10, budget_s=0.3 if quick else 2.0)
    values: dict[str, float] = {}
    errors: dict[str, str] = {}

    def step(names: tuple[str, ...], fn: Callable[[], float | dict[str, float]]) -> None:
        if on_step:
            on_step(names[0] if len(names) == 1 else "/".join(n.rsplit("_", 1)[0] for n in names))
        try:
            got = fn()
            values.update(got if isinstance(got, dict) else {names[0]: got})
        except Exception as e:  # one broken path must not hide the other figures
            for n in names:
                errors[n] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        finally:
            if on_gpu:
                import torch

                torch.cuda.empty_cache()  # give back the step's buffers before the next one allocates

    if on_gpu:
        for key in ("d2d_copy", "h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable", "bidir_pinned"):
            d = probes.CEILINGS[key]
            n = sizes["d2d"] if key == "d2d_copy" else sizes["host_device"]
            step((d.figure,), lambda d=d, n=n: d.fn(timer, n))
        sm = ("d2d_sm_copy_gbps", "h2d_sm_copy_gbps", "d2h_sm_copy_gbps")
        step(sm, lambda: probes.sm_copies(timer, sizes["host_device"]))
        step(("launch_eager_us", "launch_graph_us"), lambda: probes.launch_us(timer))
        step(("bf16_tflops",), lambda: probes.bf16_tflops(timer, 2048 if quick else 8192))
    step(("host_memcpy_gbps",), lambda: probes.host_memcpy(timer, sizes["host"]))

    env = environment("cuda" if on_gpu else "cpu")  # after the transfers: NVML's link gen is not idle-low
    gpu_name = env.get("gpu")
    spec = datasheet.gpu_spec(gpu_name)
    topo = env.get("topology", {})
    pcie = topo.get("pcie", {})
    gen = pcie.get("gen_max") if isinstance(pcie.get("gen_max"), int) else getattr(spec, "pcie_gen", None)
    link = datasheet.pcie_link(gen, pcie.get("width_max"))
    refs = datasheet.reference_values(spec, link)
    figures = []
    for name in WHAT:
        if name not in values and name not in errors:
            continue
        ref, ref_what = refs.get(name, (None, None))
        figures.append(Figure(name, values.get(name), WHAT[name], ref, ref_what, errors.get(name)))
    return ProbeReport(
        gpu=gpu_name,
        gpu_key=getattr(spec, "key", None),
        no_gpu_reason=reason,
        sizes=sizes,
        figures=figures,
        environment=env,
        link=link,
    )
