"""What the planner needs to know of `LeanRunner` on this machine: the host cost of its hits that
the planner's terms (the copies, the tail's arithmetic) do not cover, measured on first use and
kept per machine and model beside `hf_costs`' file.

A lean hit has no forward floor of its own (its tail replays CUDA graphs, on CUDA), but it still
pays for the lookup, the allocation, the copies' submission, the wait and the gather of each
layer's prefix, and the replays' launches: a few milliseconds that a short prefix shows next to
nothing else. `measure` times a lean hit over a one-chunk prefix (`hf_costs.FLOOR_PREFIX`
tokens), and `planner_options` turns it into `plan`'s ``hit_fixed_ms``: what that hit took beyond
the planner's own prediction of it.

    opts = planner_options(lean, spec, gpu, plan_opts, ceilings)  # plan()'s floors and hit cost
    p = plan(spec, gpu, "host", n, m, ceilings, **plan_opts | opts)

The file is ``$KVTIER_CACHE_DIR`` (default ``~/.cache/kvtier``) ``/lean-costs-<key>.json``.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from kvtier.integrations import hf_costs

FORMAT = 1


def _machine(runner) -> dict:
    return hf_costs.machine_and_model(runner.model) | {"graphs": runner.graphs}


def cache_path(runner):
    key = hashlib.sha256(json.dumps(_machine(runner), sort_keys=True).encode()).hexdigest()[:16]
    return hf_costs.cache_dir() / f"lean-costs-{key}.json"


def lean_costs(runner, *, refresh: bool = False) -> dict:
    """The costs of ``runner`` (a `LeanRunner`) here: read from the cache, or measured now and saved."""

    def said(doc: dict, where: str) -> str:
        return (
            f"kvtier: measured the lean runner's hit ({doc['hit_ms']:.1f} ms over {doc['prefix_tokens']} "
            f"cached tokens + {doc['new_tokens']} new) on first use, {where}"
        )

    tag = ("kvtier_lean_costs", FORMAT)
    return hf_costs.cached(cache_path(runner), tag, _machine(runner), lambda: measure(runner), said, refresh)


def measure(runner) -> dict:
    """Median ms of ``runner.first_token`` for a host hit of one chunk (a throwaway `KVTier`; the
    first hit of the shape captures its graphs and is not timed)."""
    model = runner.model
    dev = next(model.parameters()).device
    prefix, new = hf_costs.FLOOR_PREFIX, 64 if dev.type == "cuda" else 16
    gen = torch.Generator(device=dev).manual_seed(3)
    ids = torch.randint(1, model.config.vocab_size, (1, prefix + new), generator=gen, device=dev)
    with hf_costs.saved_prefix(model, ids, prefix, "kvtier-lean-costs") as kvt:

        def hit() -> None:
            c = kvt.cache(ids)
            runner.first_token(ids, c)  # int(): the host holds the token, so the GPU made it
            c.finish(None)  # the blocks go back; nothing new is saved

        try:
            ms = hf_costs.median_ms(hit, dev)
        finally:
            runner.pieces.clear()  # its graphs hold the throwaway KVTier's pages, closed next
    return {
        "kvtier_lean_costs": FORMAT,
        "machine": _machine(runner),
        "hit_ms": ms,
        "prefix_tokens": prefix,
        "new_tokens": new,
        "chunk_tokens": prefix,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def planner_options(runner, spec, gpu, plan_opts: dict, ceilings=None, costs=None) -> dict:
    """`plan`'s options for ``runner``'s hits, over ``plan_opts`` (the model's: efficiency, floor,
    dtypes): no floor nor fixed cost for the tail after a hit (nor for a graphed split's front), and
    ``hit_fixed_ms``, what the measured one-chunk hit (`lean_costs`, or ``costs``) took beyond the
    planner's prediction of it with no fixed cost."""
    from kvtier.planner import plan

    c = costs or lean_costs(runner)
    # graph replays: no floor and no per-forward framework cost (a calibration's prefill overhead is
    # generate's); without graphs the front is an eager forward like the others
    floors = {"tail_floor_ms": 0.0, "tail_overhead_ms": 0.0}
    if runner.graphs:
        floors |= {"front_floor_ms": 0.0, "front_overhead_ms": 0.0}
    opts = {k: v for k, v in plan_opts.items() if k != "read_gbps"} | floors | {"hit_fixed_ms": 0.0}
    bare = plan(
        spec,
        gpu,
        "host",
        c["prefix_tokens"],
        c["new_tokens"],
        ceilings,
        chunk_tokens=c["chunk_tokens"],
        **opts,
    )
    return floors | {"hit_fixed_ms": max(0.0, c["hit_ms"] - bare.options["load"].ms)}
