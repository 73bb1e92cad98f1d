"""`kvtier calibrate`: kvtier's predictions beside measurements on this machine.

  h2d, d2h  one pinned copy of N bytes (copy engine) vs the `kvtier.path` host path
  decode    one decode step of the random-weight model, batch B, context C (`decode_step_fn`:
            every weight matrix and every KV byte read once; replayed from a CUDA graph on a
            GPU, so Python launch overhead is not in it) vs `roofline.decode_step`
  prefill   one transformers forward over N tokens (no cache, last token's logits) vs
            `roofline.prefill`
  floor     (not fitted) transformers' `generate` of one token for a short tail over a short
            cached prefix: the host-bound time of a forward that gives the GPU little to do — the
            least any first token through `generate` takes (`forward_floor_ms`, for the planner)

Predictions use probed ceilings (a `--ceilings` file, else measured now): device copy (HBM), bf16
matmul rate, pinned H2D / D2H. The fit and the explanations of misses are `calibrate_fit`. Without
a GPU it all runs on the CPU with the tiny model in fp32: copies are host memcpys, the "GPU" is
the CPU's memcpy and fp32 matmul rates - a dry run of the method, not figures.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch

from kvtier.bench.calibrate_fit import assign_roles, calibrate, p10
from kvtier.bench.calibrate_points import (  # noqa: F401 - grouped_attention, decode_step_fn: re-exported
    FLOOR_PREFIX,
    MiB,
    decode_points,
    decode_step_fn,
    floor_ms,
    grouped_attention,
    prefill_points,
    roofline_dtypes,
    transfer_points,
)
from kvtier.bench.calibration_file import FORMAT_VERSION, effective_rates, load, save  # noqa: F401

# ---- the machine: its figures, and a GPU spec the roofline can use ------------------------


def measure_figures(device: torch.device, quick: bool, on_time=None) -> dict[str, float]:
    """Ceilings figures measured now. GPU: pinned H2D/D2H, device copy, bf16 matmul. CPU: host
    memcpy (it stands in for the links and, doubled, for HBM) and the fp32 matmul rate."""
    from kvtier.bench import probes
    from kvtier.bench.timing import Timer

    timer = Timer(device, min_reps=3 if quick else 5, budget_s=0.3 if quick else 1.0, on_time=on_time)
    if device.type == "cuda":
        size = 64 * MiB if quick else 1 << 30
        out = {
            "h2d_pinned_gbps": probes.h2d_pinned(timer, size),
            "d2h_pinned_gbps": probes.d2h_pinned(timer, size),
            "d2d_copy_gbps": probes.d2d_copy(timer, 4 * size),
            "bf16_tflops": probes.bf16_tflops(timer, 4096 if quick else 8192),
        }
        torch.cuda.empty_cache()  # the probe buffers are not needed again
        return out
    memcpy = probes.host_memcpy(timer, 256 * MiB)  # past any CPU cache, quick or not
    return {
        "host_memcpy_gbps": memcpy,
        "h2d_pinned_gbps": memcpy,
        "d2h_pinned_gbps": memcpy,
        "d2d_copy_gbps": 2 * memcpy,  # read + write, as the device copy counts
        "bf16_tflops": cpu_matmul_tflops(timer, 256 if quick else 512),
    }


def cpu_matmul_tflops(timer, n: int = 512) -> float:
    """fp32 n x n x n matmul on the CPU, TFLOP/s (the tiny model runs in fp32 there)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    return 2 * n**3 / timer.time(lambda: torch.mm(a, b, out=c), name="calibrate/cpu_matmul").median_s / 1e12


def machine_gpu(device: torch.device, ceilings):
    """The `specs.GPU` predictions use: the datasheet entry of this GPU with the measured figures
    in place, or (CPU, or a GPU kvtier does not know) a spec made of the measured figures."""
    from kvtier.specs import GPU, apply_ceilings, gpu_from_device_name

    if device.type == "cuda":
        base = gpu_from_device_name(torch.cuda.get_device_name(device))
        if base is not None:
            return apply_ceilings(base, ceilings)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no GPU)"
    bw, tf = ceilings.get("d2d_copy_gbps"), ceilings.get("bf16_tflops")
    return GPU(
        "measured",
        f"{name}, measured here",
        os.cpu_count() or 1,
        0,
        0,
        bw,
        tf,
        tf,
        None,
        5 if device.type == "cuda" else 4,
        "measured here (no datasheet entry)",
        measured=("mem_bw_gbps", "bf16_tflops"),
    )


def machine_ceilings(device: torch.device, quick: bool, ceilings=None, on_time=None):
    """`ceilings` (a loaded file) or a `Ceilings` of figures measured now."""
    from kvtier.ceilings import Ceilings
    from kvtier.specs import gpu_from_device_name

    if ceilings is not None:
        return ceilings
    key = name = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = gpu_from_device_name(name)
        key = spec.key if spec is not None else None
    figures = measure_figures(device, quick, on_time)
    return Ceilings(figures, gpu=name, gpu_key=key, source="kvtier calibrate")


def model_spec(model):
    """The `models.ModelSpec` of a transformers model, through its config.json."""
    import tempfile

    from kvtier.hfconfig import from_hf_config

    with tempfile.TemporaryDirectory() as d:
        model.config.to_json_file(f"{d}/config.json")
        return from_hf_config(d)


# ---- measuring -----------------------------------------------------------------------------

# (copy sizes in MiB, decode (batch, context) shapes, prefill lengths) per kind of run
PLANS = {
    "gpu": (
        (1, 4, 16, 64, 256, 1024),
        ((1, 1024), (1, 8192), (1, 32768), (8, 2048), (8, 8192), (32, 1024), (32, 4096), (64, 2048)),
        (1024, 2048, 4096, 8192, 16384),
    ),
    "quick": ((1, 4, 16), ((1, 128), (4, 256), (16, 128), (1, 1024)), (64, 128, 256)),
    "cpu": ((1, 4, 16, 64), ((1, 256), (1, 2048), (4, 512), (16, 256), (16, 1024)), (128, 256, 512, 1024)),
}


def steps(device: str = "auto", quick: bool = False, ceilings=None) -> int:
    """How many measurements `run` times (each calls its `on_step` once), the model's build too."""
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    sizes, shapes, lengths = PLANS["quick" if quick else ("gpu" if cuda else "cpu")]
    figures = 0 if ceilings is not None else (4 if cuda else 2)
    return figures + 1 + 2 * len(sizes) + len(shapes) + len(lengths) + 1


def run(
    device: str = "auto", quick: bool = False, ceilings=None, reps: int | None = None, on_step=None
) -> dict:
    """Measure every point, fit, and return the calibration document (see `save`). on_step: told
    what is measured next, `steps()` times in all."""
    from kvtier.bench.env import utc_now
    from kvtier.bench.llama_rig import build_llama
    from kvtier.bench.timing import Timer

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device: expected auto, cpu or cuda[:N], got {device!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda asked for, but torch finds no CUDA GPU")
    kind = "quick" if quick else ("gpu" if dev.type == "cuda" else "cpu")
    shape = "llama-3-8b" if kind == "gpu" else "tiny"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    given = ceilings is not None
    cei = machine_ceilings(dev, quick, ceilings, on_step)
    gpu = machine_gpu(dev, cei)
    if on_step is not None:
        on_step(f"building a random-weight {shape} model")
    model = build_llama(shape, dev, dtype, attn_implementation="sdpa")
    spec = model_spec(model)
    n = reps or (3 if quick else 5)
    timer = Timer(
        dev,
        warmup=1 if quick else 2,
        min_reps=n,
        max_reps=max(n, 50),
        budget_s=0.3 if quick else 1.0,
        on_time=on_step,
    )
    sizes, shapes, lengths = PLANS[kind]
    points = transfer_points(dev, gpu, cei, sizes, timer)
    points += decode_points(model, gpu, spec, shapes, timer)
    points += prefill_points(model, gpu, spec, lengths, timer)
    floor_tail = 64 if kind == "gpu" else 16
    floor = floor_ms(model, floor_tail, timer)
    assign_roles(points)
    fits = calibrate(points)
    kv_bytes = spec.kv_bytes_per_token(roofline_dtypes(model)[1])
    doc = {
        "kvtier_calibration": FORMAT_VERSION,
        "device": dev.type,
        "gpu": cei.gpu or gpu.name,
        "gpu_key": cei.gpu_key,
        "quick": quick,
        "measured_at": utc_now().isoformat(timespec="seconds"),
        "model": {
            "shape": shape,
            "dtype": str(dtype).removeprefix("torch."),
            "layers": spec.layers,
            "hidden": spec.hidden,
            "kv_bytes_per_token": kv_bytes,
        },
        "ceilings": dict(cei.figures),
        "ceilings_source": "file" if given else "measured in this run",
        "gpu_spec": {
            "name": gpu.name,
            "mem_bw_gbps": gpu.mem_bw_gbps,
            "bf16_tflops": gpu.bf16_tflops,
            "pcie_gen": gpu.pcie_gen,
        },
        "fits": {q: asdict(f) for q, f in fits.items()},
        "forward_floor_ms": floor,
        "forward_floor": {"tail_tokens": floor_tail, "cached_tokens": FLOOR_PREFIX},
        "points": [p.to_json() for p in points],
    }
    doc["effective"] = effective_rates(doc)
    doc["p10"] = p10(points, dev.type)
    return doc


# ---- the file ------------------------------------------------------------------------------
