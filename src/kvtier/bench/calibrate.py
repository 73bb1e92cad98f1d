"""`kvtier calibrate` (PERF.md P10): kvtier's predictions beside measurements on this machine.

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

from kvtier.bench.calibrate_fit import Point, assign_roles, calibrate, p10
from kvtier.bench.calibration_file import FORMAT_VERSION, effective_rates, load, save  # noqa: F401

MiB = 1 << 20


# ---- the machine: its figures, and a GPU spec the roofline can use ------------------------


def measure_figures(device: torch.device, quick: bool) -> dict[str, float]:
    """Ceilings figures measured now. GPU: pinned H2D/D2H, device copy, bf16 matmul. CPU: host
    memcpy (it stands in for the links and, doubled, for HBM) and the fp32 matmul rate."""
    from kvtier.bench import probes
    from kvtier.bench.timing import Timer

    timer = Timer(device, min_reps=3 if quick else 5, budget_s=0.3 if quick else 1.0)
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
    memcpy = probes.host_memcpy(timer, 16 * MiB if quick else 64 * MiB)
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
    return GPU("measured", f"{name}, measured here", os.cpu_count() or 1, 0, 0, bw, tf, tf, None,
               5 if device.type == "cuda" else 4, "measured here (no datasheet entry)",
               measured=("mem_bw_gbps", "bf16_tflops"))  # fmt: skip


def machine_ceilings(device: torch.device, quick: bool, ceilings=None):
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
    return Ceilings(measure_figures(device, quick), gpu=name, gpu_key=key, source="kvtier calibrate")


def model_spec(model):
    """The `models.ModelSpec` of a transformers model, through its config.json."""
    import tempfile

    from kvtier.hfconfig import from_hf_config

    with tempfile.TemporaryDirectory() as d:
        model.config.to_json_file(f"{d}/config.json")
        return from_hf_config(d)


def roofline_dtypes(model) -> tuple[str, str]:
    """(weights dtype, KV dtype) names for the roofline. fp32 (the CPU dry run) counts its KV
    at 4 bytes; its weights are counted at bf16's 2 (the roofline has no fp32 matmul rate)."""
    kv = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[model.dtype]
    return ("fp16" if kv == "fp16" else "bf16"), kv


# ---- measuring -----------------------------------------------------------------------------

# (copy sizes in MiB, decode (batch, context) shapes, prefill lengths) per kind of run
PLANS = {
    "gpu": ((1, 4, 16, 64, 256, 1024),
            ((1, 1024), (1, 8192), (1, 32768), (8, 2048), (8, 8192), (32, 1024), (32, 4096), (64, 2048)),
            (1024, 2048, 4096, 8192, 16384)),
    "quick": ((1, 4, 16), ((1, 128), (4, 256), (16, 128), (1, 1024)), (64, 128, 256)),
    "cpu": ((1, 4, 16, 64), ((1, 256), (1, 2048), (4, 512), (16, 256), (16, 1024)), (128, 256, 512, 1024)),
}  # fmt: skip


def _point(q: str, case: str, predicted_ms: float, t, **params) -> Point:
    return Point(q, case, predicted_ms, t.median_ms, t.min_ms, t.max_ms, t.spread * 100,
                 params | {"clock": t.clock, "runs": t.count})  # fmt: skip


def transfer_points(device: torch.device, gpu, ceilings, sizes_mib, timer) -> list[Point]:
    """One pinned copy each way per size (CPU: a host memcpy stands in for each direction)."""
    from kvtier.path import build_path
    from kvtier.planner import tier_path
    from kvtier.specs import get_link, measured_host_link

    down = measured_host_link(get_link(f"pcie{gpu.pcie_gen}"), ceilings, "d2h")
    paths = {"h2d": tier_path(gpu, "host", ceilings), "d2h": build_path(gpu, "host", down, "save")}
    out = []
    for mib in sizes_mib:
        n = mib * MiB
        g = torch.empty(n, dtype=torch.uint8, device=device).random_()  # never time zeros
        h = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda").random_()
        copies = {"h2d": (g, h), "d2h": (h, g)}  # (destination, source)
        for q, (dst, src) in copies.items():
            t = timer.time(lambda d=dst, s=src: d.copy_(s, non_blocking=True), name=f"calibrate/{q}/{mib}MiB")
            out.append(_point(q, f"{q} {mib} MiB", paths[q].transfer_ms(n), t, bytes=n, device=device.type))
    return out


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of q (b, kv_heads, group, d) over k, v (b, kv_heads, ctx, d): the `group` query
    heads of a KV head as `group` rows. Two batched matmuls over the whole context (cuBLAS spreads
    them over every SM), not SDPA, whose kernels give batch 1 one block per head: ~8 blocks
    reading 4 GiB at 32K tokens."""
    w = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    return torch.matmul(torch.softmax(w, dim=-1).to(v.dtype), v)


def decode_step_fn(model, batch: int, context: int):
    """One decode step of ``model`` (a transformers Llama) for ``batch`` requests whose KV holds
    ``context`` random tokens per layer, ``(batch, kv_heads, context, head_dim)`` for K and V:
    embedding, per layer norm + q/k/v/o projections + attention over the static KV + MLP, final
    norm, LM head. The group of query heads sharing a KV head is one query of `group` rows, so
    grouped-query attention needs no copy of K/V. No CPU sync inside: it can be graph-captured."""
    cfg, inner = model.config, model.model
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dev, dt, group = model.device, model.dtype, heads // kv_heads
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = [torch.randn((2, batch, kv_heads, context, d), generator=gen, device=dev, dtype=dt)
          for _ in inner.layers]  # fmt: skip
    ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=dev)

    @torch.no_grad()
    def step():
        h = inner.embed_tokens(ids)  # (batch, hidden)
        for layer, (k, v) in zip(inner.layers, kv, strict=True):
            att, x = layer.self_attn, layer.input_layernorm(h)
            q = att.q_proj(x).view(batch, kv_heads, group, d)  # query heads of KV head j: rows j*g..
            att.k_proj(x), att.v_proj(x)  # the new token's K and V: weights read, not stored
            o = grouped_attention(q, k, v)  # (batch, kv_heads, group, d): every KV byte read once
            h = h + att.o_proj(o.reshape(batch, heads * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.lm_head(inner.norm(h))

    return step


def decode_points(model, gpu, spec, shapes, timer) -> list[Point]:
    from kvtier.bench.timing import TimingError
    from kvtier.roofline import decode_step

    wdt, kvdt = roofline_dtypes(model)
    out = []
    for b, c in shapes:
        step = decode_step_fn(model, b, c)
        try:  # a graph replays the step without Python launch overhead: the GPU's own time
            t = timer.time(step, graph=timer.on_cuda, name=f"calibrate/decode/b{b}c{c}")
        except TimingError:
            t = timer.time(step, name=f"calibrate/decode/b{b}c{c}")
        bound = decode_step(spec, gpu, b, c, wdt, kvdt)
        kv = b * c * spec.kv_bytes_per_token(kvdt)
        p = dict(batch=b, context=c, kv_share=kv / bound.bytes, bound=bound.bound, device=model.device.type)
        out.append(_point("decode", f"decode b{b} c{c}", bound.ms, t, **p))
        del step
        if timer.on_cuda:
            torch.cuda.empty_cache()  # this shape's KV buffers go before the next shape's
    return out


def prefill_points(model, gpu, spec, lengths, timer) -> list[Point]:
    import inspect

    from kvtier.roofline import prefill

    wdt, kvdt = roofline_dtypes(model)
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    gen = torch.Generator(device=model.device).manual_seed(1)
    out = []
    for n in lengths:
        ids = torch.randint(1, model.config.vocab_size, (1, n), generator=gen, device=model.device)

        @torch.no_grad()
        def forward(ids=ids):
            model(ids, use_cache=False, **last)

        t = timer.time(forward, name=f"calibrate/prefill/{n}")
        b = prefill(spec, gpu, n, 0, wdt, kvdt)
        out.append(
            _point("prefill", f"prefill {n}", b.ms, t, tokens=n, bound=b.bound, device=model.device.type)
        )
    return out


FLOOR_PREFIX = 256  # cached tokens under the floor's tail: short, so the GPU has little to do


def floor_ms(model, tail: int, timer) -> float:
    """Median ms of `generate` (one new token) over a DynamicCache holding FLOOR_PREFIX tokens, with
    `tail` prompt tokens after them, host clock, device synchronized (see the module docstring)."""
    from transformers import DynamicCache

    from kvtier.integrations.hf import cache_kwarg

    gen = torch.Generator(device=model.device).manual_seed(2)
    ids = torch.randint(
        1, model.config.vocab_size, (1, FLOOR_PREFIX + tail), generator=gen, device=model.device
    )
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :FLOOR_PREFIX], **{cache_kwarg(model): cache}, use_cache=True)

    @torch.no_grad()
    def first_token():
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0, **{cache_kwarg(model): cache})
        extra = cache.get_seq_length() - FLOOR_PREFIX
        if extra > 0:
            cache.crop(-extra)  # back to the prefix alone for the next run (negative: any version)

    return timer.time(first_token, name=f"calibrate/floor/{tail}").median_ms


def run(device: str = "auto", quick: bool = False, ceilings=None, reps: int | None = None) -> dict:
    """Measure every point, fit, and return the calibration document (see `save`)."""
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
    cei = machine_ceilings(dev, quick, ceilings)
    gpu = machine_gpu(dev, cei)
    model = build_llama(shape, dev, dtype, attn_implementation="sdpa")
    spec = model_spec(model)
    n = reps or (3 if quick else 5)
    timer = Timer(
        dev, warmup=1 if quick else 2, min_reps=n, max_reps=max(n, 50), budget_s=0.3 if quick else 1.0
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
        "kvtier_calibration": FORMAT_VERSION, "device": dev.type, "gpu": cei.gpu or gpu.name,
        "gpu_key": cei.gpu_key, "quick": quick, "measured_at": utc_now().isoformat(timespec="seconds"),
        "model": {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "layers": spec.layers,
                  "hidden": spec.hidden, "kv_bytes_per_token": kv_bytes},
        "ceilings": dict(cei.figures), "ceilings_source": "file" if given else "measured in this run",
        "gpu_spec": {"name": gpu.name, "mem_bw_gbps": gpu.mem_bw_gbps, "bf16_tflops": gpu.bf16_tflops,
                     "pcie_gen": gpu.pcie_gen},
        "fits": {q: asdict(f) for q, f in fits.items()},
        "forward_floor_ms": floor,
        "forward_floor": {"tail_tokens": floor_tail, "cached_tokens": FLOOR_PREFIX},
        "points": [p.to_json() for p in points],
    }  # fmt: skip
    doc["effective"] = effective_rates(doc)
    doc["p10"] = p10(points, dev.type)
    return doc


# ---- the file ------------------------------------------------------------------------------
