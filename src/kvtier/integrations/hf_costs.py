"""What the planner needs to know of a transformers model on this machine that no datasheet says,
measured on first use and kept per machine and model, so that `plan_request` predicts from the
first request on without a calibration file:

    forward_floor_ms   `generate` of one token for a short tail over a short cached prefix: the
                       least time any forward through transformers takes here (host launches)
    floor_points       [[cached tokens, ms], ...]: that floor over a short and a long cached prefix;
                       it grows with the prefix (DynamicCache's per-layer appends, the attention
                       over it), and the planner takes it as a line through the two points
    hit_ms             the same `generate` (over the short prefix) when the prefix is a kvtier hit
                       from the host (a throwaway `KVTier`: lookup, allocation, the copies'
                       submission, each layer's arrival), and hit_fixed_ms = hit_ms - the floor:
                       what a hit costs on the host that no forward hides
    prefill_ms         one forward over `prefill_tokens` tokens: what a prefill reaches here

    costs = model_costs(model)                       # measured once (said on stderr), then read
    opts = planner_options(model, spec, gpu)         # plan()'s efficiency, floor and hit costs

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
from contextlib import contextmanager
from pathlib import Path

import torch

FORMAT = 2
FLOOR_PREFIX = 256  # cached tokens under the floor's tail: short, so the device has little to do
# The long cached prefix of the floor's second point: long enough that its growth shows, short
# enough to cost well under a second on a GPU (CPU: a tiny test model).
LONG_PREFIX = {"cuda": 8192, "cpu": 512}
HIT_BLOCK = 16  # the throwaway KVTier's block size; its one chunk is the short prefix
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

    def said(doc: dict, where: str) -> str:
        (p0, f0), (p1, f1) = doc["floor_points"][0], doc["floor_points"][-1]
        return (
            f"kvtier: measured this model's forward floor ({f0:.1f} ms over {p0} cached tokens, {f1:.1f} "
            f"over {p1}), a host hit's fixed cost ({doc['hit_fixed_ms']:.1f} ms) and prefill "
            f"({doc['prefill_tokens']} tokens in {doc['prefill_ms']:.1f} ms) on first use, {where}; "
            "`kvtier calibrate` measures more"
        )

    tag = ("kvtier_model_costs", FORMAT)
    return cached(cache_path(model), tag, machine_and_model(model), lambda: measure(model), said, refresh)


def cached(path: Path, tag: tuple[str, int], machine: dict, measure, said, refresh: bool = False) -> dict:
    """The document at ``path`` when it carries ``tag`` (key, format) and ``machine``; else
    ``measure()``'s, written there (an unwritable cache only says so) and announced once on
    stderr with ``said(doc, where)``."""
    if not refresh and path.exists():
        try:
            doc = json.loads(path.read_text())
            if doc.get(tag[0]) == tag[1] and doc.get("machine") == machine:
                return doc
        except (OSError, json.JSONDecodeError):
            pass  # unreadable: measured again and rewritten
    doc = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        where = f"saved to {path}"
    except OSError as e:
        where = f"not saved ({e})"
    print(said(doc, where), file=sys.stderr)
    return doc


def measure(model) -> dict:
    """Median ms of the floor's `generate` over a short and a long cached prefix, of the same
    `generate` over the short prefix loaded as a kvtier hit, and of one prefill forward (device
    synchronized)."""
    import inspect

    dev = _device(model)
    tail, tokens = (64, 2048) if dev.type == "cuda" else (16, 256)
    long = LONG_PREFIX["cuda" if dev.type == "cuda" else "cpu"]
    limit = getattr(model.config, "max_position_embeddings", None) or long + tail
    long = min(long, limit - tail)  # a model too short for the second point: one point, no growth
    gen = torch.Generator(device=dev).manual_seed(2)
    ids = torch.randint(1, model.config.vocab_size, (1, max(long + tail, tokens)), generator=gen, device=dev)
    floors = [
        [p, _floor_ms(model, ids[:, : p + tail], p, dev)] for p in (FLOOR_PREFIX, long) if p >= FLOOR_PREFIX
    ]
    hit = _hit_ms(model, ids[:, : FLOOR_PREFIX + tail], FLOOR_PREFIX, dev)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    def prefill() -> None:
        model(ids[:, :tokens], use_cache=False, **keep)

    return {
        "kvtier_model_costs": FORMAT,
        "machine": machine_and_model(model),
        "forward_floor_ms": floors[0][1],
        "floor_points": floors,
        "floor_tail_tokens": tail,
        "floor_cached_tokens": FLOOR_PREFIX,
        "hit_ms": hit,
        "hit_fixed_ms": max(0.0, hit - floors[0][1]),
        "prefill_ms": median_ms(prefill, dev),
        "prefill_tokens": tokens,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def generate_one(model, ids, cache) -> torch.Tensor:
    from kvtier.integrations.hf import cache_kwarg

    return model.generate(
        ids, max_new_tokens=1, do_sample=False, pad_token_id=0, **{cache_kwarg(model): cache}
    )


def _floor_ms(model, ids, prefix: int, dev) -> float:
    """`generate` of one token after ids[:, :prefix], already in a DynamicCache."""
    from transformers import DynamicCache

    from kvtier.integrations.hf import cache_kwarg

    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :prefix], **{cache_kwarg(model): cache}, use_cache=True)

    def floor() -> None:
        generate_one(model, ids, cache)
        extra = cache.get_seq_length() - prefix
        if extra > 0:
            cache.crop(-extra)  # back to the prefix alone for the next run

    return median_ms(floor, dev)


def _hit_ms(model, ids, prefix: int, dev) -> float:
    """The same `generate` with ids[:, :prefix] a host hit (`saved_prefix`): the lookup, the
    allocation, the copies and each layer's arrival on top of the forward."""
    with saved_prefix(model, ids, prefix, "kvtier-hf-costs") as kvt:

        def hit() -> None:
            c = kvt.cache(ids)
            generate_one(model, ids, c)
            c.finish(None)  # the blocks go back; nothing new is saved

        return median_ms(hit, dev)


@contextmanager
def saved_prefix(model, ids, prefix: int, model_id: str):
    """A throwaway `KVTier` whose host holds ids[:, :prefix] as one chunk of `prefix` tokens,
    saved by an untimed first request; closed on exit."""
    from kvtier.integrations.hf import KVTier

    blocks = -(-(ids.shape[1] + 1) // HIT_BLOCK)
    kvt = KVTier.for_model(
        model,
        num_blocks=2 * blocks,
        block_size=HIT_BLOCK,
        model_id=model_id,
        chunk_tokens=prefix,
        salt=os.urandom(8),
    )
    try:
        with torch.no_grad():
            cache = kvt.cache(ids)
            saved = cache.finish(generate_one(model, ids, cache))
        if saved is not None:
            saved.wait(60)  # the prefix is a host entry once its save completed
        yield kvt
    finally:
        kvt.close()


@torch.no_grad()
def median_ms(fn, dev: torch.device) -> float:
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
    """`planner.plan`'s efficiency, floor and hit cost from `model_costs` (or `costs`): the measured
    prefill against the roofline's at full rate on `gpu` (a `specs.GPU`); the floor as
    `floor_line` draws it; hit_fixed_ms."""
    from kvtier.roofline import prefill

    c = costs or model_costs(model)
    ideal = prefill(spec, gpu, c["prefill_tokens"], 0, dtype, kv_dtype).ms
    floor, slope = floor_line(c)
    return {
        "efficiency": min(1.0, ideal / c["prefill_ms"]),
        "forward_floor_ms": floor,
        "floor_ms_per_token": slope,
        "hit_fixed_ms": c["hit_fixed_ms"],
    }


def floor_line(costs: dict) -> tuple[float, float]:
    """(forward_floor_ms at no cached token, floor_ms_per_token) of `model_costs`' two floor points:
    the line through them, its growth never negative (a noisy long point does not make the floor
    shrink) and never so steep that the floor at no cached token falls below half the short
    point's (a noisy long point alone would otherwise extrapolate a forward's launch cost away)."""
    (p0, f0), (p1, f1) = costs["floor_points"][0], costs["floor_points"][-1]
    slope = max(0.0, (f1 - f0) / (p1 - p0)) if p1 > p0 else 0.0
    slope = min(slope, f0 / (2 * p0)) if p0 > 0 else slope
    return max(0.0, f0 - slope * p0), slope
