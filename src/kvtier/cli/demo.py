"""`kvtier demo`: a random-weight Llama generating through kvtier's store (`integrations.hf`).

Several requests share a long prefix. The first runs cold and saves its KV (host, then pushed
to disk and Redis); the next ones load the prefix from the host; one more loads it from disk
after the host was emptied; with ``--redis URL`` a second kvtier instance, sharing only Redis,
loads it from there. Each request also runs without kvtier (transformers' DynamicCache, the
whole prompt recomputed): its time to first token is the baseline and its tokens must match.

    kvtier demo                          # CPU: SimDevice, a small model, 1024-token prefix
    kvtier demo --device cuda            # GPU: CudaDevice, a 0.9B-parameter fp32 model, 8192 tokens
    kvtier demo --redis redis://localhost:6379 --plot ttft.png
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import click

from kvtier.cli import cli
from kvtier.cli.demo_report import plot_ttft, print_report
from kvtier.cli.options import plot_option

# Random-weight Llama configs per device: small enough for 2 CPU cores, larger on a GPU.
MODELS = {
    "cpu": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
    ),
    "cuda": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
}
PREFIX = {"cpu": 1024, "cuda": 8192}
TAIL, CHUNK, BLOCK = 48, 256, 16
PLOT_PREFIXES = {"cpu": (256, 512, 1024, 2048), "cuda": (1024, 2048, 4096, 8192, 16384)}


def build_model(kind: str, device: str | None = None, max_positions: int = 32768):
    """A Llama of config MODELS[kind] with seeded random weights in fp32 (greedy ties are not
    decided by rounding), made on `device` directly (default: "cuda" for kind "cuda", else "cpu"):
    no CPU copy of a large model to move over."""
    import torch

    from kvtier.bench.llama_rig import build_llama

    device = device or ("cuda" if kind == "cuda" else "cpu")
    return build_llama("tiny", device, torch.float32, max_positions=max_positions, **MODELS[kind])


def _sync(device) -> None:
    if getattr(device, "type", device) == "cuda":
        import torch

        torch.cuda.synchronize()  # a host clock read is true only once the GPU's queued work is done


class _FirstToken:
    """A generate() streamer noting when the first new token comes out (the prompt comes first)."""

    def __init__(self, device="cpu") -> None:
        self.device, self.t_first = device, None

    def put(self, value) -> None:
        if value.dim() == 1 and self.t_first is None:  # (batch,): a new token; the prompt is (1, n)
            _sync(self.device)  # the token exists once the GPU made it (its loads landed), not when queued
            self.t_first = time.perf_counter()

    def end(self) -> None:
        pass


def generate(model, ids, new_tokens: int, cache=None):
    """(tokens, seconds to the first new token) of a greedy run; ``cache`` None: DynamicCache."""
    import torch

    from kvtier.integrations.hf import cache_kwarg

    extra = {} if cache is None else {cache_kwarg(model): cache}
    clock = _FirstToken(model.device)
    if cache is None:
        _sync(model.device)  # the clock must not start while earlier work is still queued
    t0 = time.perf_counter() if cache is None else cache.t_start  # kvtier's lookup counts too
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=clock, **extra)
    return out, clock.t_first - t0


def request(kvt, model, ids, new_tokens: int, label: str) -> dict:
    """One request with kvtier and the same without; the KV is saved (and pushed down) after.
    The recompute baseline is the faster of two runs (the CPU may be shared)."""
    import torch

    (ref, a), (_, b) = generate(model, ids, new_tokens), generate(model, ids, new_tokens)
    _sync(model.device)  # cache() starts kvtier's clock: nothing earlier may still be queued
    cache = kvt.cache(ids)
    out, ttft = generate(model, ids, new_tokens, cache)
    load_s = cache.load_seconds()
    t = time.perf_counter()
    h = cache.finish(out)
    save_s = time.perf_counter() - t  # into host pool slots (the copies have landed)
    durable = h is None or h.wait_durable(60)  # write-through: on disk / in Redis before the next one
    saved = 0 if h is None else h.saved * kvt.store.fmt.span
    return dict(
        request=label,
        prompt_tokens=ids.shape[1],
        hit_tokens=cache.hit_tokens,
        tier="+".join(sorted(set(cache.hit_tiers))) or "-",
        ttft_recompute_ms=min(a, b) * 1e3,
        ttft_ms=ttft * 1e3,
        loaded_bytes=cache.hit_bytes,
        load_gbps=cache.hit_bytes / load_s / 1e9 if load_s else None,
        saved_bytes=saved,
        save_gbps=saved / save_s / 1e9 if saved else None,
        durable=durable,
        identical=bool(torch.equal(out, ref)),
    )


def run(
    kind: str,
    prefix: int,
    requests: int,
    new_tokens: int,
    redis_url: str | None,
    model=None,
    on_step=lambda what, weight=1.0: None,
) -> dict:
    """The demo's requests (see the module docstring); `on_step(what, weight)` is told each step
    as it starts (`steps()` weighs them)."""
    import torch

    from kvtier.integrations.hf import KVTier
    from kvtier.store.disk import DiskTier

    model = model if model is not None else build_model(kind)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    shared = torch.randint(1, vocab, (1, prefix), generator=g)
    prompts = [
        torch.cat([shared, torch.randint(1, vocab, (1, TAIL + 8 * i), generator=g)], 1)
        for i in range(requests)
    ]
    prompts = [p.to(model.device) for p in prompts]
    on_step("warming up the model and kvtier")
    generate(model, prompts[0][:, :64], 2)  # warm-up: first-call costs are not the prefill's
    blocks = 2 * (prefix + TAIL + 8 * requests + new_tokens) // BLOCK + 8
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        tiers = [DiskTier(tmp, 8 << 30)] + _redis(redis_url)
        salt = os.urandom(8)  # this run's keys: chunks an earlier run left in Redis do not hit
        opts = dict(num_blocks=blocks, chunk_tokens=CHUNK, salt=salt)
        with KVTier.for_model(model, tiers=tiers, **opts) as kvt:
            device = kvt.device.name
            warm_up_kvtier(kvt, model)
            for i, ids in enumerate(prompts[:-1]):
                label = "cold" if i == 0 else f"warm {i}"
                on_step(f"request {i + 1} of {requests} ({label}): recompute twice, then kvtier", 3)
                rows.append(request(kvt, model, ids, new_tokens, label))
            kvt.store.evict()  # empty the host: the next hit must come from disk
            on_step(f"request {requests} of {requests} (host emptied): from disk", 3)
            rows.append(request(kvt, model, prompts[-1], new_tokens, "host emptied"))
        if redis_url:  # another instance: no disk, no host copy, only the Redis both share
            on_step("a 2nd instance: from Redis", 3)
            with KVTier.for_model(model, tiers=_redis(redis_url), **opts) as b:
                warm_up_kvtier(b, model)
                rows.append(request(b, model, prompts[1], new_tokens, "2nd instance"))
    cfg = model.config
    return dict(
        device=device,
        torch_device=str(model.device),
        chunk_tokens=CHUNK,
        block_size=BLOCK,
        model=dict(
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            dtype=str(model.dtype).removeprefix("torch."),
            params=sum(p.numel() for p in model.parameters()),
        ),
        prefix_tokens=prefix,
        new_tokens=new_tokens,
        requests=rows,
        identical=all(r["identical"] for r in rows),
    )


def _redis(url: str | None) -> list:
    """A Redis tier with its own client, as each serving instance would have."""
    if not url:
        return []
    from kvtier.store.redis_tier import RedisTier

    return [RedisTier(url=url, prefix="kvtier-demo:", ttl_s=3600, timeout_s=5.0)]


def warm_up_kvtier(kvt, model, *, always: bool = False) -> int:
    """On a GPU, one throwaway request saved and then loaded, so that the first measured ones do not
    pay for first use (Triton compiles the engine's kernels, CUDA graphs are captured); its chunks
    are evicted after, from every tier. SimDevice has nothing to compile: skipped unless `always`.
    Returns the tokens its load hit (0: skipped)."""
    import torch

    if kvt.device.name == "sim" and not always:
        return 0
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(1, model.config.vocab_size, (1, 2 * CHUNK + 8), generator=g).to(model.device)
    hit = 0
    for _ in range(2):  # the first saves, the second loads
        cache = kvt.cache(ids)
        out, _ = generate(model, ids, 2, cache)
        hit = cache.hit_tokens
        h = cache.finish(out)
        if h is not None and not h.wait_durable(60):  # pushed down before it is deleted there
            raise RuntimeError("kvtier warm-up: the save did not reach the lower tiers in 60 s")
    kvt.store.evict(out[0].tolist(), lower=True)
    return hit


def steps(requests: int, redis: bool, plot_prefixes: tuple = ()) -> float:
    """The weight of the demo's steps: the model, the warm-up, each request (3: it runs twice
    without kvtier and once with), the Redis instance, each point of the plot's sweep (2)."""
    return 2 + 3 * requests + (3 if redis else 0) + 2 * len(plot_prefixes)


def sweep(
    kind: str, prefixes, new_tokens: int, model=None, on_step=lambda what, weight=1.0: None
) -> list[dict]:
    """TTFT of recompute (DynamicCache) vs load (kvtier, host hit) over prefix lengths."""
    import torch

    from kvtier.integrations.hf import KVTier

    model = model if model is not None else build_model(kind)
    g = torch.Generator().manual_seed(2)
    out = []
    blocks = 2 * (max(prefixes) + 2 * TAIL + new_tokens) // BLOCK + 8
    with KVTier.for_model(model, num_blocks=blocks, chunk_tokens=CHUNK) as kvt:
        generate(model, torch.randint(1, 99, (1, 64)).to(model.device), 2)  # warm-up
        warm_up_kvtier(kvt, model)
        for n in prefixes:
            on_step(f"plot: a {n}-token prefix, recompute vs load", 2)
            ids = torch.randint(1, model.config.vocab_size, (1, n + TAIL), generator=g).to(model.device)
            request(kvt, model, ids, 1, "cold")  # saves the prefix
            row = request(kvt, model, ids, 1, f"prefix {n}")
            out.append(
                dict(prefix=row["hit_tokens"], recompute_ms=row["ttft_recompute_ms"], load_ms=row["ttft_ms"])
            )
    return out


@cli.command()
@click.option(
    "--device",
    "device_kind",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Where the model runs; auto: CUDA when present.",
)
@click.option(
    "--prefix", type=click.IntRange(CHUNK, 1 << 17), default=None, help="Shared prefix [cpu 1024, cuda 8192]."
)
@click.option("--requests", type=click.IntRange(3, 32), default=4, show_default=True)
@click.option("--new-tokens", type=click.IntRange(1, 1024), default=16, show_default=True)
@click.option(
    "--redis", "redis_url", default=None, help="Also push to this Redis and hit it from a 2nd instance."
)
@plot_option("PNG: TTFT vs prefix, recompute vs load.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def demo(
    device_kind: str, prefix: int | None, requests: int, new_tokens: int, redis_url, plot, as_json
) -> None:
    """A random-weight Llama generating through kvtier: TTFT against recomputing the prefix, the
    tier of each hit, GB/s, exactness."""
    from kvtier.bench.progress import Steps

    with Steps(1 + steps(requests, bool(redis_url)), "demo", enabled=not as_json) as step:
        step("loading torch and transformers")
        try:
            import torch
            import transformers  # noqa: F401
        except ImportError as e:
            raise click.ClickException(
                f"kvtier demo needs torch and transformers ({e}): pip install 'kvtier[hf]'"
            ) from None
        kind = ("cuda" if torch.cuda.is_available() else "cpu") if device_kind == "auto" else device_kind
        if kind == "cuda" and not torch.cuda.is_available():
            raise click.UsageError("--device cuda: torch finds no CUDA GPU")
        prefix = prefix or PREFIX[kind]
        sweep_at = PLOT_PREFIXES[kind] if plot else ()
        step.total = 1 + steps(requests, bool(redis_url), sweep_at)
        longest = max([prefix + TAIL + 8 * requests] + ([max(sweep_at) + 2 * TAIL] if plot else []))
        step(f"building a random-weight Llama on {kind}")
        model = build_model(kind, max_positions=max(32768, longest + new_tokens))  # once, for both
        data = run(kind, prefix, requests, new_tokens, redis_url, model, on_step=step)
        if plot:
            data["sweep"] = sweep(kind, sweep_at, new_tokens, model, on_step=step)
    if plot:
        m = data["model"]
        title = (
            f"TTFT, random-weight Llama {m['layers']}L/{m['hidden']} {m['dtype']} on {data['torch_device']}"
        )
        plot_ttft(data["sweep"], title, plot)
    if as_json:
        click.echo(json.dumps(data, indent=2))
    else:
        print_report(data)
        if plot:
            click.echo(f"plot: {plot}")
    if not data["identical"]:
        raise SystemExit(1)
