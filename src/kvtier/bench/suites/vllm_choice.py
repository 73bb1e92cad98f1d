"""The `vllm` suite's choice rows: the connector's choice per request (load the hit, recompute it,
or load its first chunks and let vLLM prefill the rest) against each of those options measured in
the same run, for a prefix held by each tier; and decode steps beside a lower tier's read.

Both halves of the connector run as vLLM drives them (`SchedulerSide` through `vllm_engine_step`'s
requests and scheduler outputs, `WorkerSide` in vLLM's per-step order), the model's forward over
the request's paged blocks each step (`paged_step`), its prefill in steps of STEP_TOKENS (vLLM's
chunked prefill). The prefix is computed and saved once per cell (request A, on blocks of its own);
every run then asks for the same prompt on other blocks.

  option recompute <tier> <n>   vLLM's prefill of the prompt (n prefix tokens and the new ones)
  option load <tier> <n>        every chunk loaded in the background (the connector's asynchronous
                                load: a reader thread reads the tier into the host, the loader
                                thread copies, the engine steps meanwhile until get_finished says
                                so), then the forward over the new tokens
  option split <tier> <n>       the first K chunks loaded so, vLLM prefilling the rest: the fastest
                                of K = 1/4, 1/2, 3/4 of the chunks (params split_chunks, splits_ms)
  choice <tier> <n>             what the scheduler side chooses (`SchedulerSide.lookup`, fed this
                                engine's step times and the workers' read rates from the runs
                                before), then done as vLLM does it; params: vs_best (its first
                                token over the fastest option's), choice, chunks, predicted_ms
                                (the last run's), runs (each run's choice and time, the warm-up
                                first)
  step_beside_read <tier> <n>   a decode step of a running request (one token after n, the
                                graphed forward of `GraphedTail`, every hook around it) while a
                                waiting request's n-token prefix is read from the tier and loaded,
                                against the same steps with nothing read (phases interleaved);
                                params: slowdown_pct (medians), step_ms_alone, step_ms_beside

Tiers: host (the pinned pool), disk (the connector's disk tier in a folder under
$KVTIER_BENCH_DIR, buffered: its files dropped from the page cache before each run), redis (a
redis-server on loopback: skipped without one), slow (memory behind a SLOW_GBPS link,
`ThrottledTier`), stalled (memory that stops answering after a third of a load's chunks, until the
cell ends). $KVTIER_VLLM_TIERS (comma-separated) measures only those. n: 2K, 8K, 32K (quick: 8K;
CPU: 512 on the tiny shape).

TTFT: perf_counter from the request's arrival to its first token on the host, one warm-up and REPS
runs (a warm-up over RUN_ONCE_S is the only run). Before each run of a lower tier the host is
emptied and the scheduler told, as the workers' reports tell it. correct: every run's loaded
blocks equal the saved ones bit for bit. A load that did not finish (a stalled tier) is cut at
its deadline (option load: STALL_WAIT_S) and counts as what it took: param cut.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import torch

from kvtier.bench.stats import summarize
from kvtier.bench.suite import Context

TIERS = ("host", "disk", "redis", "slow", "stalled")
SIZES, QUICK_SIZES, CPU_SIZES = (2048, 8192, 32768), (8192,), (512,)
STEP_TOKENS = 8192  # vLLM's max_num_batched_tokens here: a longer prefill takes several steps
REPS, RUN_ONCE_S = 3, 3.0
SLOW_GBPS = {"cuda": 0.5, "cpu": 0.005}
STALL_WAIT_S = 2.0  # how long the stalled tier's option load waits (its deadline)
IDLE_STEP_S = 0.0005  # an idle engine step's own time while requests wait for their loads
BESIDE_STEPS, PHASES = (32, 4), 4  # decode steps per phase (GPU, CPU) and phases of each kind


class Stalling:
    """``inner``'s chunks; once armed, the reads after the first ``after`` block until released."""

    def __init__(self, inner) -> None:
        self.inner, self.name = inner, inner.name
        self._lock, self._open = threading.Lock(), threading.Event()
        self._open.set()
        self._left = 0

    def arm(self, after: int) -> None:
        with self._lock:
            self._left = after
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def get_into(self, key, dest):
        with self._lock:
            self._left -= 1
            stalled = self._left < 0
        if stalled:
            self._open.wait(600)  # no answer until released: a server that stopped answering
        return self.inner.get_into(key, dest)

    # The rest of the `Tier` protocol, spelled out (a protocol's isinstance looks on the class).
    def put(self, key, header, payload):
        return self.inner.put(key, header, payload)

    def get(self, key):
        return self.inner.get(key)

    def contains(self, key):
        return self.inner.contains(key)

    def contains_many(self, keys):
        return self.inner.contains_many(keys)

    def delete(self, key):
        return self.inner.delete(key)

    def stats(self):
        return self.inner.stats()

    def close(self) -> None:
        self.release()
        self.inner.close()


def tiers_asked(value: str | None) -> tuple[str, ...]:
    """The tiers $KVTIER_VLLM_TIERS names (comma-separated; unset or empty: all of TIERS)."""
    if not value:
        return TIERS
    asked = tuple(t.strip().lower() for t in value.split(",") if t.strip())
    bad = [t for t in asked if t not in TIERS]
    if bad:
        raise ValueError(f"KVTIER_VLLM_TIERS: unknown tier(s) {bad}; known: {', '.join(TIERS)}")
    return asked


def choice_rows(ctx: Context, fwd, replay, order: str, shape: dict, want: set[str]):
    """The rows of the families `want` names ("choice", "beside_read") over every tier and size."""
    sizes = CPU_SIZES if not ctx.on_gpu else QUICK_SIZES if ctx.quick else SIZES
    for tier in tiers_asked(os.environ.get("KVTIER_VLLM_TIERS")):
        for n in sizes:
            with ExitStack() as stack:
                cell = Cell.make(ctx, fwd, replay, order, shape, tier, n, stack)
                if cell is None:
                    continue
                if "choice" in want:
                    yield from cell.choice_rows()
                if "beside_read" in want and tier != "host":
                    yield from cell.beside_row()
            if ctx.on_gpu:
                torch.cuda.empty_cache()


class Cell:
    """One tier and prefix length: a `Replay` whose lower tier is `tier`, a `SchedulerSide` over
    it, the prompt's prefix computed and saved by request A on the source blocks."""

    @classmethod
    def make(cls, ctx: Context, fwd, replay, order, shape, tier: str, n: int, stack: ExitStack):
        """The cell, or None with its rows skipped (no redis-server, no room on the disk)."""
        from kvtier.bench.suites.store_rig import redis_process
        from kvtier.store.throttle import MemoryTier, ThrottledTier

        chunk = 16 * shape["N"]
        room = 2 * fwd.kv_bytes(n + chunk) + (64 << 20)
        extra = {"prefetch_timeout_s": 600.0}  # the plan's deadline rules, not the cap
        tiers, shared, why = (), None, None
        base = Path(os.environ.get("KVTIER_BENCH_DIR") or tempfile.gettempdir())
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-choice-", dir=base)))
        if tier == "disk":
            extra |= {"disk_path": str(workdir / "disk"), "disk_bytes": room}
            tiers = None  # the connector's own disk tier, watched for the scheduler's index
        elif tier == "redis":
            url, reason, _ = redis_process(stack, workdir / "redis")
            if url is None:
                why = reason
            else:
                from kvtier.store.redis_tier import RedisTier

                extra |= {"redis_url": url}
                tiers, shared = None, RedisTier(url=url, timeout_s=5.0)
                stack.callback(shared.close)
        elif tier == "slow":
            rate = SLOW_GBPS["cuda" if ctx.on_gpu else "cpu"]
            shared = ThrottledTier(MemoryTier(room, name="slow"), rate, name="slow")
            tiers = [shared]
        elif tier == "stalled":
            shared = Stalling(MemoryTier(room, name="stalled"))
            tiers = [shared]
        if why is not None:
            for case in ("option recompute", "option load", "option split", "choice", "step_beside_read"):
                ctx.skip(f"{case} {tier} {n} tokens", why)
            return None
        r = replay(ctx, order, shape, n + chunk, tiers=tiers, extra=extra)
        stack.callback(r.close)
        if isinstance(shared, Stalling):
            stack.callback(shared.release)  # before the store closes: its stalled readers end first
        cell = cls(ctx, fwd, r, tier, n, shared, workdir)
        cell.prepare()
        return cell

    def __init__(self, ctx: Context, fwd, r, tier: str, n: int, shared, workdir: Path) -> None:
        from kvtier.hfconfig import from_hf_dict
        from kvtier.integrations.vllm.scheduler import SchedulerSide

        self.ctx, self.fwd, self.r, self.tier, self.n = ctx, fwd, r, tier, n
        self.shared, self.workdir = shared, workdir
        self.N, self.bpc = r.kv.block_size, r.blocks // r.chunks
        self.ct, self.hit_chunks = self.N * self.bpc, n // (self.N * self.bpc)
        self.prompt = n + fwd.new
        self.ids = fwd.prompt(self.prompt)
        self.names = _chunk_names(self.ids, self.N, self.bpc, self.prompt)[: self.hit_chunks]
        spec = from_hf_dict(fwd.model.config.to_dict(), "the bench's Llama")
        self.sched = SchedulerSide(
            r.ws.settings, self.N, self.N, 1, redis=shared, spec=spec, step_tokens=STEP_TOKENS
        )
        self.label = f"{tier} {n} tokens"
        self._runs = 0
        self.picks: list[str] = []  # per choice run, the warm-up first: what it chose and took
        self.exact = True  # every run's loaded blocks equal the saved ones

    # -- one engine step, in vLLM's order -------------------------------------------------------

    def step(self, meta, forward=None):
        """handle_preemptions -> start_load -> the forward -> wait_for_save -> get_finished -> load
        errors -> the sampled token on the host -> the worker's report into the scheduler;
        (forward's output, received, errors)."""
        ws = self.r.ws
        ws.handle_preemptions(meta)
        ws.start_load(meta)
        out = forward() if forward is not None else None
        ws.save(meta)
        _, received = ws.finished(set())
        errors = ws.load_errors()
        if isinstance(out, torch.Tensor) and out.is_cuda:
            # vLLM's step ends with its sampled tokens on the host: the step time the scheduler
            # side fits (build to report) holds the forward's GPU time, as in the engine
            torch.cuda.current_stream(out.device).synchronize()
        self.sched.update(SimpleNamespace(kv_connector_worker_meta=ws.report()))
        return out, received or set(), errors

    def prefill(self, rid: str, blocks: list[int], start: int, first_new: bool = True):
        """vLLM's prefill of tokens [start, prompt) in steps of at most STEP_TOKENS; (the last
        position's logits, the blocks its steps' loads reported not loaded)."""
        from kvtier.bench.suites.vllm_engine_step import output, paged_step

        logits, errors = None, set()
        for s in range(start, self.prompt, STEP_TOKENS):
            e = min(self.prompt, s + STEP_TOKENS)
            new = first_new and s == start
            so = output(new=[(rid, blocks, s, e - s)]) if new else output(cached=[(rid, s, e - s)])
            meta = self.sched.build_meta(so)
            logits, _, errs = self.step(
                meta, lambda s=s, e=e: paged_step(self.fwd.lean, self.r, blocks, self.ids, s, e)
            )
            errors |= errs
        return logits, errors

    # -- the cell's prefix ----------------------------------------------------------------------

    def prepare(self) -> None:
        """Request A computes the prompt on the source blocks; its chunks are saved (write-through
        into the lower tier), then the host lets go of them unless the tier is the host."""
        from kvtier.bench.suites.vllm_engine_step import Blocks, Request

        r = self.r
        self.step(self.sched.build_meta(_empty()))  # the workers' first report: their key fields
        a = Request("a", self.ids, self.N)
        self.sched.lookup(a, 0)
        self.sched.after_alloc(a, Blocks(r.src[: r.blocks]), 0)
        self.prefill("a", r.src[: r.blocks], 0)
        r.settle_saves()  # A's copies landed
        r.ws.store.flush(600)  # and the lower tier holds them (write-through)
        self.sched.finished(a)
        if isinstance(self.shared, Stalling):
            self.shared.arm(max(1, self.hit_chunks // 3))  # it stops answering in the first load
        self.clean()

    def clean(self) -> None:
        """Before a run: the host holds the prefix's chunks (host tier) or none, and the scheduler
        knows it; nothing in flight (but reads stalled in their tier), no push either; the disk's
        files out of the page cache."""
        r = self.r
        r.sync()
        self.step(self.sched.build_meta(_empty()))  # landed loads and saves are settled, released
        if self.tier != "host":
            # The last run's chunks pushed down first: a push pins its host entry, and a chunk the
            # host kept would be loaded from there (that run's recompute, bf16 apart from A's) and
            # its push would still be writing beside the next run.
            r.ws.store.flush(600)
            r.ws.store.evict()
            if self.tier == "disk":
                _drop_page_cache(Path(r.ws.settings.disk_path))
        r.poison()
        self.step(self.sched.build_meta(_empty()))  # the workers' report: what the host dropped

    # -- the options and the choice -------------------------------------------------------------

    def _rid(self, what: str) -> str:
        self._runs += 1
        return f"{what}{self._runs}"

    def _known(self, rid: str):
        """The request, known to the scheduler side with no hit granted: the chunks its prefill
        computes are saved as the connector saves every request's (the choice's runs pay that
        too)."""
        from kvtier.bench.suites.vllm_engine_step import Blocks, Request

        req = Request(rid, self.ids, self.N)
        self.sched.after_alloc(req, Blocks(self.r.dst[: self.r.blocks]), 0)
        return req

    def recompute_once(self) -> float:
        req = self._known(self._rid("recompute"))
        t0 = time.perf_counter()
        int(self.prefill(req.request_id, self.r.dst[: self.r.blocks], 0)[0].argmax())
        dt = time.perf_counter() - t0
        self.sched.finished(req)
        return dt

    def load_once(self, chunks: int, budget_s: float | None = None) -> tuple[float, dict]:
        """The first ``chunks`` chunks loaded in the background, vLLM prefilling the rest."""
        r = self.r
        req = self._known(self._rid("load"))
        rid = req.request_id
        t0 = time.perf_counter()
        meta = self.sched.build_meta(_empty())
        meta.loads.append(self._run(rid, chunks, budget_s))
        landed = self._wait_received(rid, meta, chunks * self.N * self.bpc)
        int(self.prefill(rid, r.dst[: r.blocks], landed)[0].argmax())
        dt = time.perf_counter() - t0
        self._check(landed)
        self.sched.finished(req)
        return dt, {"landed": landed}

    def choice_once(self) -> tuple[float, dict]:
        from kvtier.bench.suites.vllm_engine_step import Blocks, Request

        r, rid = self.r, self._rid("choice")
        req = Request(rid, self.ids, self.N)
        t0 = time.perf_counter()
        tokens, background = self.sched.lookup(req, 0)
        self.sched.after_alloc(req, Blocks(r.dst[: r.blocks]), tokens or 0)
        dst = r.dst[: r.blocks]
        if tokens and background:
            landed = self._wait_received(rid, self.sched.build_meta(_empty()), tokens)
            int(self.prefill(rid, dst, landed)[0].argmax())
        else:  # recomputed, or a host hit loaded in the step, layer by layer under its forward
            landed = tokens or 0
            logits, errors = self.prefill(rid, dst, landed)
            if errors:  # vLLM drops that step's output and recomputes from the first block not loaded
                landed = _good(dst[: landed // self.N], errors) * self.N
                logits, _ = self.prefill(rid, dst, landed, first_new=False)
            int(logits.argmax())
        dt = time.perf_counter() - t0
        self._check(landed)
        choice = self.sched.choice(rid)
        self.sched.finished(req)
        kind = "recompute" if choice is None else f"{choice.kind} {choice.chunks} {choice.tier}"
        if choice is not None and choice.chunks:
            kind += " in the background" if background else " in the step"
        self.picks.append(f"{kind}: {dt * 1e3:.1f} ms, {landed // self.ct} chunks landed")
        return dt, {"landed": landed, "choice": choice}

    def _run(self, rid: str, chunks: int, budget_s: float | None):
        """A background load of the first ``chunks`` chunks from the cell's tier into the
        destination blocks, as the scheduler side would send it."""
        from kvtier.integrations.vllm.metadata import ChunkRun

        blocks = self.r.dst[: chunks * self.bpc]
        tiers = (self.tier,) * chunks  # the host holds none of them before a lower tier's run
        return ChunkRun(rid, self.names[:chunks], blocks, 0, 10**9 + self._runs, True, tiers, budget_s)

    def _wait_received(self, rid: str, meta, tokens: int) -> int:
        """Steps (nothing scheduled) until the workers report ``rid`` received; the tokens that
        landed (vLLM recomputes from the first block reported not loaded)."""
        errors: set[int] = set()
        while True:
            _, received, errs = self.step(meta)
            errors |= errs
            if rid in received:
                break
            time.sleep(IDLE_STEP_S)
            meta = self.sched.build_meta(_empty())
        return _good(self.r.dst[: tokens // self.N], errors) * self.N

    def _check(self, landed: int) -> None:
        self.r.sync()  # the copies landed before the blocks are compared
        b = landed // self.N
        got = self.r.cache[:, self.r.dst[:b]].contiguous().view(torch.uint8)
        ok = torch.equal(got, self.r.cache[:, self.r.src[:b]].contiguous().view(torch.uint8))
        self.exact &= ok

    def runs(self, name: str, once) -> tuple:
        """One warm-up and REPS runs of ``once`` (-> seconds or (seconds, info)), each after
        `clean`; a warm-up over RUN_ONCE_S is the only run. (Timing in ms, the last info)."""
        if self.ctx.on_progress:
            self.ctx.on_progress(f"vllm/{name} {self.label}")
        samples, info = [], {}
        reps = 2 if self.ctx.quick else REPS
        for i in range(1 + reps):
            self.clean()
            got = once()
            dt, info = got if isinstance(got, tuple) else (got, {})
            if i == 0 and dt > RUN_ONCE_S:
                samples = [dt * 1e3]
                break
            if i:
                samples.append(dt * 1e3)
        return summarize(samples, "perf_counter"), info

    def choice_rows(self):
        ctx, chunks = self.ctx, self.hit_chunks
        stall = STALL_WAIT_S if self.tier == "stalled" else None
        rec, _ = self.runs("option recompute", self.recompute_once)
        full, full_info = self.runs("option load", lambda: self.load_once(chunks, stall))
        splits = {}
        for k in sorted({max(1, chunks // 4), chunks // 2, 3 * chunks // 4} - {0, chunks}):
            splits[k] = self.runs(f"option split {k}", lambda k=k: self.load_once(k, stall))[0]
        best_k = min(splits, key=lambda k: splits[k].median_ms) if splits else None
        options = {"recompute": rec.median_ms, "load": full.median_ms}
        if best_k is not None:
            options["split"] = splits[best_k].median_ms
        chosen, info = self.runs("choice", self.choice_once)
        best = min(options, key=options.get)
        c = info.get("choice")
        nbytes = self.fwd.kv_bytes(self.n)
        link = "h2d_pinned" if ctx.on_gpu else "host_memcpy"
        common = dict(
            tier=self.tier, tokens=self.n, chunks=chunks, model=self.fwd.preset, new_tokens=self.fwd.new
        )
        yield ctx.row(f"option recompute {self.label}", nbytes, rec, link, **common)
        cut = full_info.get("landed", 0) < chunks * self.ct
        yield ctx.row(f"option load {self.label}", nbytes, full, link, correct=self.exact, cut=cut, **common)
        if best_k is not None:
            splits_ms = {str(k): t.median_ms for k, t in splits.items()}
            yield ctx.row(
                f"option split {self.label}",
                nbytes,
                splits[best_k],
                link,
                correct=self.exact,
                split_chunks=best_k,
                splits_ms=splits_ms,
                **common,
            )
        yield ctx.row(
            f"choice {self.label}",
            nbytes,
            chosen,
            link,
            correct=self.exact,
            vs_best=chosen.median_ms / options[best],
            best=best,
            options_ms=options,
            choice="recompute" if c is None else c.kind,  # None: no tier planned present held any
            choice_chunks=0 if c is None else c.chunks,
            choice_tier="host" if c is None else c.tier,
            predicted_ms=None if c is None else c.predicted_ms,
            predicted_recompute_ms=None if c is None else c.recompute_ms,
            absent=",".join(sorted(self.sched.absent)),
            runs=self.picks,
            **common,
        )

    # -- decode steps beside a read -------------------------------------------------------------

    def beside_row(self):
        from kvtier.bench.suites.vllm_rows import GraphedTail, PagedPrefix

        ctx, r = self.ctx, self.r
        if ctx.on_progress:
            ctx.on_progress(f"vllm/step_beside_read {self.label}")
        ids = self.ids[:, : self.n + 1]  # a running request's next token after n of its own
        tail = GraphedTail(self.fwd.lean, PagedPrefix(r, self.n // self.N, saved=True), ids)

        def decode(meta) -> tuple[float, set[str]]:
            t0 = time.perf_counter()
            _, received, _ = self.step(meta, lambda: int(tail.logits(ids).argmax()))
            return time.perf_counter() - t0, received

        decode(self.sched.build_meta(_empty()))  # eager first: the graphs are captured after it
        if ctx.on_gpu:
            r.sync()  # the eager step's work is done before the capture
            tail.capture()
        per_phase = BESIDE_STEPS[0 if ctx.on_gpu else 1]
        alone, beside = [], []
        for phase in range(2 * PHASES):
            self.clean()
            if phase % 2 == 0:
                alone += [decode(self.sched.build_meta(_empty()))[0] for _ in range(per_phase)]
                continue
            rid = self._rid("beside")
            meta = self.sched.build_meta(_empty())
            meta.loads.append(self._run(rid, self.hit_chunks, 600.0))
            for _ in range(per_phase):  # the steps while the read, then its copies, run
                dt, received = decode(meta)
                beside.append(dt)
                if rid in received:
                    break
                meta = self.sched.build_meta(_empty())
        a, b = summarize([x * 1e3 for x in alone]), summarize([x * 1e3 for x in beside])
        yield ctx.row(
            f"step_beside_read {self.label}",
            self.fwd.kv_bytes(self.n),
            b,
            "h2d_pinned" if ctx.on_gpu else "host_memcpy",
            tier=self.tier,
            tokens=self.n,
            slowdown_pct=(b.median_ms / a.median_ms - 1) * 100,
            step_ms_alone=a.median_ms,
            step_ms_beside=b.median_ms,
            steps_alone=len(alone),
            steps_beside=len(beside),
            **_reader(self.tier),
        )


def _reader(tier: str) -> dict:
    """For the Redis tier, the reply parser redis-py reads with ("hiredis": its C parser)."""
    if tier != "redis":
        return {}
    from redis.utils import HIREDIS_AVAILABLE

    return {"redis_parser": "hiredis" if HIREDIS_AVAILABLE else "python"}


def _chunk_names(ids: torch.Tensor, block_size: int, bpc: int, prompt: int) -> list[bytes]:
    """The prompt's chunk ids, as the scheduler side names them from vLLM's block hashes."""
    from kvtier.bench.suites.vllm_engine_step import Request
    from kvtier.integrations.vllm.chunk_ids import chunk_ids

    return chunk_ids(Request("names", ids, block_size).block_hashes, bpc, prompt - 1, block_size)


def _good(blocks: list[int], errors: set[int]) -> int:
    """How many of ``blocks``, from the first, loaded: up to the first one reported not loaded."""
    return next((i for i, b in enumerate(blocks) if b in errors), len(blocks))


def _empty():
    from kvtier.bench.suites.vllm_engine_step import output

    return output()


def _drop_page_cache(folder: Path) -> None:
    """The disk tier's chunk files out of the page cache: the next read comes from the disk."""
    from kvtier.store.chunkfile import SUFFIX

    for f in folder.rglob(f"*{SUFFIX}"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # fsynced pages are clean: dropped
        finally:
            os.close(fd)


__all__ = ["Cell", "Stalling", "choice_rows", "tiers_asked"]
