"""What the `ttft` suite measures on: the model, the prompts, one `KVTier` per tier, the planner's
inputs (this run's ceilings, an optional calibration), and the figures its rows derive from each
other (those, with the first-token helpers, live in `ttft_checks` and are re-exported here).

Not a suite (it registers nothing); `ttft.py` is.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch

from kvtier.bench import calibrate
from kvtier.bench.calibration_file import planner_inputs
from kvtier.bench.suite import Context
from kvtier.bench.suites.ttft_checks import (  # noqa: F401 - derived, regret: re-exported
    MARGIN,
    derived,
    first_token,
    margin,
    regret,
    tiers_asked,
)

MAX_READ_S = 6.0  # a lower tier slower than this for a prefix skips it: the suite must fit in minutes


class Rig:
    def __init__(self, ctx: Context, stack: ExitStack) -> None:
        from kvtier.bench.llama_rig import build_llama
        from kvtier.ceilings import Ceilings

        self.ctx, self.on_gpu, big = ctx, ctx.on_gpu, ctx.on_gpu and not ctx.quick
        self.shape = "llama-3-8b" if big else "tiny"
        self.prefixes = (2048, 8192, 32768) if big else ((256, 512) if ctx.quick else (512, 1024))
        self.new, self.block = (64 if big else 16), 16
        self.new_out = 1 if big else 4  # tokens generated; bf16: only the first one's margin is checked
        self.chunk = 256 if big else 64
        self.warmup, self.reps = 1, 3 if ctx.quick else 5  # p50 / p90 / p99 of these runs
        dtype = torch.bfloat16 if big else torch.float32  # fp32: greedy ties are not decided by rounding
        self.model = build_llama(self.shape, ctx.device, dtype, attn_implementation="sdpa")
        self.spec = calibrate.model_spec(self.model)
        wdt, self.kv_dtype = calibrate.roofline_dtypes(self.model)
        self.link = "h2d_pinned" if self.on_gpu else "host_memcpy"
        root = Path(os.environ.get("KVTIER_BENCH_DIR") or tempfile.gettempdir())
        self.workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-ttft-", dir=root))
        stack.callback(shutil.rmtree, self.workdir, ignore_errors=True)
        self.tiers = tiers_asked(os.environ.get("KVTIER_TTFT_TIERS"))
        self.remote_gbps = float(os.environ.get("KVTIER_TTFT_REMOTE_GBPS") or (2.0 if self.on_gpu else 0.05))
        figures = self._figures()
        efficiency, overhead, floor, self.calibration = self._calibration(figures)
        self.calibrated = self.calibration not in ("none",) and not self.calibration.startswith(
            ("not used", "unreadable")
        )
        name = torch.cuda.get_device_name(ctx.device) if self.on_gpu else None
        self.ceilings = Ceilings(figures, gpu=name, source="kvtier bench ttft (this run)")
        self.gpu = calibrate.machine_gpu(ctx.device, self.ceilings)
        # What a user's plan_request uses: the first-use costs (measured once, cached), of which a
        # calibration replaces the prefill rate and the floor; the floor's growth with the prefix
        # and a hit's fixed cost come from first use either way (a calibration measures neither).
        from kvtier.integrations.hf_costs import cache_path, planner_options

        got = planner_options(self.model, self.spec, self.gpu, wdt, self.kv_dtype)
        growth, hit = got["floor_ms_per_token"], got["hit_fixed_ms"]
        first_use = f"measured on first use ({cache_path(self.model)})"
        self.planner_costs = f"calibration {self.calibration}; floor growth and hit cost {first_use}"
        if not self.calibrated:
            efficiency, floor = got["efficiency"], got["forward_floor_ms"]
            self.planner_costs = first_use
        self.plan_opts = dict(
            efficiency=efficiency,
            dtype=wdt,
            kv_dtype=self.kv_dtype,
            prefill_overhead_ms=overhead,
            forward_floor_ms=floor,
            floor_ms_per_token=growth,
            hit_fixed_ms=hit,
        )
        self.disk_io = None
        self.recompute: dict[int, tuple] = {}  # n -> (Timing, outputs, infos)
        self.lean_ms: dict[int, dict[str, float]] = {}  # n -> lean row -> median ms (ttft_lean)
        self.floor_ms: dict[int, float] = {}  # n -> the host rows' forward floor
        self.reference: dict[int, torch.Tensor] = {}  # n -> the recompute run's tokens
        self.reference_logits: dict[int, torch.Tensor] = {}  # n -> its first token's logits
        self._prompts: dict[int, torch.Tensor] = {}
        self.margins: dict[int, tuple[float, int]] = {}  # n -> (top-2 margin in std, prompts drawn)

    def _figures(self) -> dict[str, float]:
        """This run's ceilings for the planner (see the suite's docstring)."""
        from kvtier.bench import probes
        from kvtier.bench.timing import Timer

        ctx, link = self.ctx, self.ctx.ceiling(self.link)
        if self.on_gpu:
            timer = Timer(ctx.device, min_reps=3, budget_s=0.5)
            f = {
                "h2d_pinned_gbps": link,
                "d2h_pinned_gbps": ctx.ceiling("d2h_pinned"),
                "d2d_copy_gbps": ctx.ceiling("d2d_copy"),
                "bf16_tflops": probes.bf16_tflops(timer, 4096 if ctx.quick else 8192),
            }
        else:
            tf = calibrate.cpu_matmul_tflops(ctx.host_timer, 256 if ctx.quick else 512)
            f = {
                "host_memcpy_gbps": link,
                "h2d_pinned_gbps": link,
                "d2h_pinned_gbps": link,
                "d2d_copy_gbps": 2 * link,
                "bf16_tflops": tf,
            }
        f["disk_read_gbps"] = ctx.ceiling("disk_read", root=self.workdir)
        f["redis_loopback_get_gbps"] = self.remote_gbps  # the planner's remote GET hop: the throttle
        return f

    def _calibration(self, figures: dict) -> tuple[float, float, float, str]:
        """(prefill efficiency, prefill fixed ms, forward floor ms, what was used) from
        $KVTIER_CALIBRATION; figures get its H2D rate."""
        path = os.environ.get("KVTIER_CALIBRATION")
        if not path:
            return 1.0, 0.0, 0.0, "none"
        try:
            cal = calibrate.load(path)
        except ValueError as e:
            self.ctx.skip("calibration", f"{e}; the planner runs uncalibrated")
            return 1.0, 0.0, 0.0, f"unreadable: {path}"
        gpu = torch.cuda.get_device_name(self.ctx.device) if self.on_gpu else None
        here = (self.ctx.device.type, self.shape, gpu)
        if (cal.get("device"), cal.get("model", {}).get("shape"), gpu and cal.get("gpu")) != here:
            why = (
                f"{path} was made on {cal.get('device')} with {cal.get('model', {}).get('shape')}, not {here}"
            )
            self.ctx.skip("calibration", why + "; the planner runs uncalibrated")
            return 1.0, 0.0, 0.0, f"not used: {why}"
        got = planner_inputs(cal, figures["bf16_tflops"])
        if "h2d_gbps" in got:
            figures["h2d_pinned_gbps"] = got["h2d_gbps"]
        return got["efficiency"], got["prefill_overhead_ms"], got["forward_floor_ms"], path

    # ---- prompts, tiers, requests ------------------------------------------------------------

    def label(self, n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

    def kv_bytes(self, n: int) -> int:
        return int(n * self.spec.kv_bytes_per_token(self.kv_dtype))

    def prompt(self, n: int) -> torch.Tensor:
        """[1, n + new] random token ids, the same for every tier, whose first greedy token is no
        near-tie: its top-2 logits are >= MARGIN standard deviations apart, so bf16 rounding (a
        prefill of other shapes computes the same KV) cannot flip it while wrong KV still would."""
        if n not in self._prompts:
            for attempt in range(8):
                g = torch.Generator().manual_seed(1000 * n + attempt)
                ids = torch.randint(1, self.model.config.vocab_size, (1, n + self.new), generator=g)
                ids = ids.to(self.ctx.device)
                _, _, logits = first_token(self.model, ids, None, 1)
                self.margins[n] = (margin(logits), attempt + 1)
                if self.margins[n][0] >= MARGIN:
                    break
            self._prompts[n] = ids
        return self._prompts[n]

    def plan(self, n: int):
        from kvtier.planner import plan

        return plan(
            self.spec, self.gpu, "host", n, self.new, self.ceilings, chunk_tokens=self.chunk, **self.plan_opts
        )

    def kvtier(self, tier: str, stack: ExitStack):
        """A KVTier whose only lower tier is `tier` (None, with the cases skipped, if it cannot be)."""
        from kvtier.bench.probes_io import disk_io_mode
        from kvtier.device import SimDevice
        from kvtier.integrations.hf import KVTier
        from kvtier.store.disk import DiskTier
        from kvtier.store.throttle import MemoryTier, ThrottledTier

        need = 2 * sum(self.kv_bytes(n) for n in self.prefixes) + (64 << 20)
        tiers = []
        if tier == "disk":
            free = shutil.disk_usage(self.workdir).free
            if free < need + (1 << 30):
                why = f"{free / 2**30:.1f} GiB free in {self.workdir}, need {need / 2**30:.1f} GiB"
                for n in self.prefixes:
                    for mode in ("load", "split", "choice"):
                        self.ctx.skip(f"{self.label(n)} {mode} disk", why + " (set KVTIER_BENCH_DIR)")
                return None
            self.disk_io = disk_io_mode(self.workdir)
            tiers = [DiskTier(self.workdir / "disk", need, o_direct=self.disk_io == "O_DIRECT")]
        elif tier == "remote":
            tiers = [ThrottledTier(MemoryTier(need, name="remote"), self.remote_gbps)]
        for t in tiers:
            stack.callback(t.close)  # after the KVTier's close (registered later, runs first)
        device = None
        if not self.on_gpu:
            device = SimDevice()  # CPU: worker threads stand in for the streams, copies are memcpys
            stack.callback(device.close)
        blocks = -(-(max(self.prefixes) + self.new + self.new_out) // self.block) + 8
        pool = int(1.25 * self.kv_bytes(max(self.prefixes))) + 8 * self.kv_bytes(self.chunk)
        kvt = KVTier.for_model(
            self.model,
            device=device,
            num_blocks=blocks,
            block_size=self.block,
            pool_bytes=pool,
            tiers=tiers,
            model_id=f"kvtier-bench-ttft/{self.shape}",
            chunk_tokens=self.chunk,
            salt=os.urandom(8),
        )
        stack.callback(kvt.close)
        return kvt

    def too_slow(self, tier: str, n: int) -> str | None:
        """Why n tokens are not read from `tier` (a run would take over MAX_READ_S), or None."""
        rate = {"disk": self.ceilings.get("disk_read_gbps"), "remote": self.remote_gbps}.get(tier)
        s = self.kv_bytes(n) / (rate * 1e9) if rate else 0.0
        if s <= MAX_READ_S:
            return None
        gib = self.kv_bytes(n) / 2**30
        return f"reading {gib:.1f} GiB at {rate:.2f} GB/s takes {s:.0f} s a run (cap {MAX_READ_S:g} s)"

    def cold(self, kvt, tier: str, ids, reference) -> str | None:
        """One cold request that saves the prefix; None, or why the tier cannot be measured."""
        cache = kvt.cache(ids)
        out, _, _ = first_token(self.model, ids, cache, self.new_out)
        h = cache.finish(out)
        # Submitted is not done: the prefix is in the tier once every save event (host) or push
        # (lower tier, write-through) completed; lookups before that would race them.
        if h is not None and not (h.wait_durable(600) if tier != "host" else h.wait(600)):
            return "the cold request's save did not finish within 600 s"
        if not torch.equal(out, reference):
            return "the cold request's tokens differ from the recompute run's"
        if tier != "host":
            kvt.store.evict()  # from now on the prefix lives in the tier only
        n = ids.shape[1] - self.new
        hit = kvt.store.lookup(ids[0, :-1].tolist())
        if hit.tokens < n or set(hit.tiers) != {tier}:
            where = sorted(set(hit.tiers))
            return f"after the cold request the store holds {hit.tokens} of {n} tokens, in {where}"
        return None

    def cold_host(self, kvt, tier: str):
        """Before each run of a lower tier: empty the host (and the page cache of buffered disk files)."""
        if tier == "host":
            return None

        def before() -> None:
            kvt.store.evict()
            if tier == "disk" and self.disk_io != "O_DIRECT":
                from kvtier.store.chunkfile import SUFFIX

                for f in (self.workdir / "disk").rglob(f"*{SUFFIX}"):
                    fd = os.open(f, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced pages are clean: dropped
                    finally:
                        os.close(fd)

        return before

    @staticmethod
    def read_params(plan) -> dict:
        """The lower tier's read rate a plan used and where it came from (the store's own loads,
        the probe, the datasheet): planner_read_gbps, planner_read_source."""
        if plan.path.tier == "host":
            return {}
        hop = plan.path.hops[0]
        return {
            "planner_read_gbps": hop.gbps,
            "planner_read_fixed_ms": hop.latency_us / 1e3,
            "planner_read_source": hop.source,
        }

    def params(self, n: int, tier: str, mode: str, predicted: float, measured: float) -> dict:
        p = dict(
            model=self.shape,
            dtype=str(self.model.dtype).removeprefix("torch."),
            prefix_tokens=n,
            new_tokens=self.new,
            chunk_tokens=self.chunk,
            block_size=self.block,
            tier=tier,
            mode=mode,
            predicted_ms=predicted,
            measured_ms=measured,
            error_pct=(predicted / measured - 1) * 100,
            planner_efficiency=self.plan_opts["efficiency"],
            planner_forward_floor_ms=self.plan_opts["forward_floor_ms"],
            planner_floor_ms_per_token=self.plan_opts["floor_ms_per_token"],
            planner_hit_fixed_ms=self.plan_opts["hit_fixed_ms"],
            calibration=self.calibration,
            calibrated=self.calibrated,
            planner_costs=self.planner_costs,
            device="CudaDevice" if self.on_gpu else "SimDevice (CPU; copies are memcpys)",
            runs=self.reps,
            warmup_runs=self.warmup,
            generated_tokens=self.new_out,
            first_token_margin_std=self.margins[n][0],
            prompts_drawn=self.margins[n][1],
        )
        if tier == "remote":
            p["remote_gbps"] = self.remote_gbps
        if tier == "disk":
            p["disk_io"] = self.disk_io
        return p
