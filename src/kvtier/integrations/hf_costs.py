"""What the planner needs to know of a transformers model on this machine that no datasheet says,
measured on first use and kept per machine and model, so that `plan_request` predicts from the
first request on without a calibration file:

    forward_floor_ms   `generate` of one token for a short tail over a short cached prefix: the
                       least time any forward through transformers takes here (host launches)
    prefill_ms         one forward over `prefill_tokens` tokens: what a prefill reaches here

    costs = model_costs(model)                       # measured once (said on stderr), then read
    opts = planner_options(model, "h200", ceilings)  # efficiency + forward_floor_ms for plan()

The file is ``$KVTIER_CACHE_DIR`` (default ``~/.cache/kvtier``) ``/model-costs-<key>.json``, the
key a hash of the device's name, torch's version and the model's config, dtype and attention
implementation. ``kvtier calibrate`` measures the same and more, with fits; its file, given to the
planner, takes precedence (`plan_request` uses what its options already hold).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

FORMAT = 1
FLOOR_PREFIX = 256  # cached tokens under the floor's tail: short, so the device has little to do
REPS = 5


def cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_CACHE_DIR") or Path.home() / ".cache" / "kvtier")


def _device(model) -> torch.device:
    return next(model.parameters()).device


def machine_and_model(model) -> dict:
    """What the measured costs depend on: the device, torch, and the model's shape and dtype."""
    dev = _device(model)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu {platform.machine()}"
    cfg = model.config.to_dict()
    shape = {
        k: cfg.get(k)
        for k in (
            "model_type",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
        )
    }
    return {
        "device": name,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "torch": torch.__version__,
        "dtype": str(model.dtype).removeprefix("torch."),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "shape": shape,
    }


def cache_path(model) -> Path:
    key = hashlib.sha256(json.dumps(machine_and_model(model), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"model-costs-{key}.json"


def model_costs(model, *, refresh: bool = False) -> dict:
    """The costs of `model` here: read from the cache, or measured now (a few forwards) and saved."""
    path = cache_path(model)
    if not refresh and path.exists():
        try:
            doc = json.loads(path.read_text())
            if doc.get("kvtier_model_costs") == FORMAT and doc.get("machine") == machine_and_model(model):
                return doc
        except (OSError, json.JSONDecodeError):
            pass  # unreadable: measured again and rewritten
    doc = measure(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        where = f"saved to {path}"
    except OSError as e:
        where = f"not saved ({e})"
    print(
        f"kvtier: measured this model's forward floor ({doc['forward_floor_ms']:.1f} ms) and prefill "
        f"({doc['prefill_tokens']} tokens in {doc['prefill_ms']:.1f} ms) on first use, {where}; "
        "`kvtier calibrate` measures more",
        file=sys.stderr,
    )
    return doc


def measure(model) -> dict:
    """Median ms of the floor's `generate` and of one prefill forward (device synchronized)."""
    from transformers import DynamicCache

    from kvtier.integrations.hf import cache_kwarg

    dev = _device(model)
    tail, tokens = (64, 2048) if dev.type == "cuda" else (16, 256)
    gen = torch.Generator(device=dev).manual_seed(2)
    ids = torch.randint(
        1, model.config.vocab_size, (1, max(FLOOR_PREFIX + tail, tokens)), generator=gen, device=dev
    )
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :FLOOR_PREFIX], **{cache_kwarg(model): cache}, use_cache=True)

    def floor() -> None:
        model.generate(
            ids[:, : FLOOR_PREFIX + tail],
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=0,
            **{cache_kwarg(model): cache},
        )
        extra = cache.get_seq_length() - FLOOR_PREFIX
        if extra > 0:
            cache.crop(-extra)  # back to the prefix alone for the next run

    import inspect

    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def prefill() -> None:
        model(ids[:, :tokens], use_cache=False, **keep)

    return {
        "kvtier_model_costs": FORMAT,
        "machine": machine_and_model(model),
        "forward_floor_ms": _median_ms(floor, dev),
        "floor_tail_tokens": tail,
        "floor_cached_tokens": FLOOR_PREFIX,
        "prefill_ms": _median_ms(prefill, dev),
        "prefill_tokens": tokens,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


@torch.no_grad()
def _median_ms(fn, dev: torch.device) -> float:
    samples = []
    for i in range(REPS + 1):  # the first run warms up
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # earlier work is not billed to this run
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # submitted is not done
        if i:
            samples.append((time.perf_counter() - t0) * 1e3)
    return sorted(samples)[len(samples) // 2]


def planner_options(model, spec, gpu, dtype: str = "bf16", kv_dtype: str = "bf16", costs=None) -> dict:
    """`planner.plan`'s efficiency and forward_floor_ms from `model_costs` (or `costs`): the measured
    prefill against the roofline's at full rate on `gpu` (a `specs.GPU`), and the measured floor."""
    from kvtier.roofline import prefill

    c = costs or model_costs(model)
    ideal = prefill(spec, gpu, c["prefill_tokens"], 0, dtype, kv_dtype).ms
    return {"efficiency": min(1.0, ideal / c["prefill_ms"]), "forward_floor_ms": c["forward_floor_ms"]}
