"""The `vllm` suite's decode_beside rows: a graphed decode batch beside the connector's transfers.

In vLLM a step decodes the requests already running while the connector loads a new request's
prefix and saves finished ones. What users pick an offloader by is what that costs the requests
already running. Per order (LBHNC, BLHNC) and batch (32, 128 sequences, contexts spread over
2K-8K tokens), the step is `decode_batch.DecodeBatch` (an 8B model's decode over vLLM's paged
cache, one CUDA graph, synchronized each step as vLLM's sampler does), and the connector's worker
hooks run around it in vLLM's order on the step's thread:

  decode_beside <mode> <order> <batch>
      load_layerwise   an arrival every EVERY steps, its 8K or 32K prefix (in turn) held by the
                       host tier, loaded with the connector's defaults (``layerwise: true``,
                       ``load_async: auto``: others run, so it loads in the background and the
                       request waits out of the batch until it landed, as vLLM's asynchronous
                       load does)
      load_whole       the same with ``layerwise: false``
      save             a departure every EVERY steps: its 8K tokens saved after the step
      mixed            arrivals and departures, EVERY / 2 steps apart
      load_in_step     the arrivals loaded in the step, as ``load_async: never`` does: every
                       layer of the decode waits for the load (what the background load avoids)

Steps with nothing beside and steps beside the transfers alternate in phases of PHASE steps
(ROUNDS of each, after a warm-up phase), so both meet the same clocks. Params: ``p50_ratio`` /
``p99_ratio`` (the step's wall time, beside over nothing), ``link_ratio`` (the transfers' bytes
over their GPU time, from the event that made the data ready to the copies' last event, against
the same-run pinned ceiling of their direction; the lower of the two in ``mixed``),
``submit_us_p99`` (the hooks' host time on the step's thread per request, over the steps that
started a transfer), ``step_ms_nothing`` / ``step_ms_beside`` (p50), ``steps_beside`` /
``steps_nothing`` (where a step's time goes, the middle half of the steps and the slowest 2%: the
wall time, the hooks' host time, the replay call, the host's wait for the stream, the graph's GPU
time), ``arrival_ms_p50`` (from the
step that starts an arrival's load to the step whose report says it landed), ``transfers``,
``skipped`` (arrivals or departures not started: their blocks were still in use), ``load_path``.
``correct``: every loaded prefix equals its saved blocks (a fingerprint of the blocks). The row's
bytes are the KV one decode step reads, its time the steps beside the transfers: its GB/s is the
decode's read rate, against the same-run device copy.

On a CPU (`--quick`): a tiny shape on `SimDevice`, a few steps, timed on the host clock.
"""

from __future__ import annotations

import time

import torch

from kvtier.bench.decode_batch import DecodeBatch
from kvtier.bench.stats import percentile
from kvtier.bench.suite import Context

MODES = ("load_layerwise", "load_whole", "save", "mixed", "load_in_step")
ORDERS = ("LBHNC", "BLHNC")
BATCHES, CONTEXT, HITS, DEPART = (32, 128), (2048, 8192), (8192, 32768), 8192
PHASE, ROUNDS, EVERY, REGIONS = 24, 5, 6, 3
TINY = dict(batches=(4,), context=(32, 96), hits=(64, 128), depart=64, phase=4, rounds=2, every=2)


class DecodeRig:
    """A cache in `order` holding the decode batch's contexts, REGIONS arrival and REGIONS
    departure regions; a worker over it (its `layerwise` setting per mode); the arrivals'
    prefixes saved into its host tier once."""

    def __init__(self, ctx: Context, order: str, shape: dict, batch: int, *, sizes: dict, memory) -> None:
        from kvtier.integrations.vllm.settings import VllmSettings

        self.ctx, self.order, self.shape, self.sizes = ctx, order, shape, sizes
        L, H, D, N = shape["L"], shape["H"], shape["D"], shape["N"]
        self.N = N
        g = torch.Generator().manual_seed(batch)
        lo, hi = sizes["context"]
        lengths = torch.randint(lo, hi + 1, (batch,), generator=g)
        per_seq = [-(-int(n) // N) for n in lengths]
        hit_blocks, dep_blocks = max(sizes["hits"]) // N, sizes["depart"] // N
        total = sum(per_seq) + REGIONS * (hit_blocks + dep_blocks)
        sz = dict(L=L, B=total, H=H, N=N, C=2 * D)
        dims = [sz[a] for a in order]
        buf = memory.get(dims, shape["dtype"], ctx.device)
        buf.normal_()  # values, not random bits: the stand-in's attention must not meet NaNs
        self.cache = buf.permute(*[order.index(a) for a in "LBHNC"])  # logical [L, B, H, N, C]
        perm = torch.randperm(total, generator=g).tolist()  # scattered ids, as a serving engine's
        tables, at = torch.zeros(batch, max(per_seq), dtype=torch.int32), 0
        for s, nb in enumerate(per_seq):
            tables[s, :nb] = torch.tensor(perm[at : at + nb])
            at += nb
        self.arrive = [perm[at + r * hit_blocks : at + (r + 1) * hit_blocks] for r in range(REGIONS)]
        at += REGIONS * hit_blocks
        self.depart = [perm[at + r * dep_blocks : at + (r + 1) * dep_blocks] for r in range(REGIONS)]
        self.tables = tables.to(ctx.device)
        self.lengths = lengths.to(torch.int32).to(ctx.device)
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
        self.chunk_blocks = 16 if hit_blocks >= 16 else 2
        self.chunk_bytes = self.chunk_blocks * L * 2 * H * N * D * shape["dtype"].itemsize
        chunks_held = sum(sizes["hits"]) // N // self.chunk_blocks + 4 * dep_blocks // self.chunk_blocks
        self.settings = dict(
            chunk_tokens=self.chunk_blocks * N,
            host_bytes=chunks_held * self.chunk_bytes * 8 // 7 + (64 << 20),
            staging_bytes=min(256 << 20, max(2 * self.chunk_bytes, 1 << 20)),
        )
        self._settings_cls = VllmSettings
        self.model = None
        self.ws = None

    # -- the worker of one mode -------------------------------------------------------------------

    def open(self, layerwise: bool, load_async: str) -> None:
        """A worker with ``layerwise`` over the cache; the arrivals' prefixes saved into its host
        (from the regions their loads will land in, fingerprinted there first)."""
        from kvtier.integrations.vllm.worker import WorkerSide

        self.close()
        dev = None
        if not self.ctx.on_gpu:
            from kvtier.device import SimDevice

            dev = SimDevice()
        s = self._settings_cls(**self.settings, layerwise=layerwise, load_async=load_async)
        self.ws = WorkerSide(s, "decode-beside", order=self.order, block_size=self.N, device=dev)
        self.ws.register({name: self.cache[i] for i, name in enumerate(self.names)})
        self.dev = self.ws.dev
        self.prefixes = []  # (ids, tokens, fingerprint) per hit size
        from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata

        for k, tokens in enumerate(self.sizes["hits"]):
            blocks = self.arrive[k % REGIONS][: tokens // self.N]
            ids = [f"hit{k}/{i}".encode().ljust(32, b".") for i in range(len(blocks) // self.chunk_blocks)]
            self.prefixes.append((ids, tokens, self.fingerprint(blocks)))
            meta = KVTierMetadata(saves=[ChunkRun(f"seed{k}", ids, blocks)], release={f"seed{k}"})
            self.ws.save(meta)
            self.sync()
            self.ws.finished(set())
        for _, tokens, _ in self.prefixes:  # saved and landed (sync above): the loads must rewrite them
            for region in self.arrive:
                self.poison(region[: tokens // self.N])
        self.ws.stats()  # the seeding's counts are not the row's

    def close(self) -> None:
        if self.ws is not None:
            self.ws.shutdown()  # every copy in flight lands before its slot goes back
            if not self.ctx.on_gpu:
                self.dev.close()
            self.ws = None

    def sampled(self, blocks: list[int]) -> torch.Tensor:
        """The last block of each chunk of ``blocks``: what a check reads and a poison writes (a
        chunk lands whole or not at all, so one block of it tells)."""
        return torch.tensor(blocks[self.chunk_blocks - 1 :: self.chunk_blocks], device=self.ctx.device)

    def fingerprint(self, blocks: list[int]) -> int:
        """A sum over the sampled blocks' bits (the host waits for it: untimed work)."""
        return int(self.cache[:, self.sampled(blocks)].contiguous().view(torch.int16).sum(dtype=torch.int64))

    def poison(self, blocks: list[int]) -> None:
        """The sampled blocks overwritten, so a load that does not land there is seen; done before
        the next step starts (the host waits), so no step is billed for it."""
        self.cache[:, self.sampled(blocks)] = torch.tensor(-7.0, dtype=self.cache.dtype)
        if self.ctx.on_gpu:  # the compute stream only: the transfers in flight go on meanwhile
            torch.cuda.current_stream(self.ctx.device).synchronize()

    def sync(self) -> None:
        self.ws.wait_submitted()  # the saver and loader threads queued what they were handed
        if self.ctx.on_gpu:
            torch.cuda.synchronize(self.ctx.device)
        else:
            self.dev.synchronize()  # every stream: compute, the loads' and each save lane's

    # -- the batch ---------------------------------------------------------------------------------

    def batch(self) -> DecodeBatch:
        if self.model is None:
            small = {} if self.ctx.on_gpu else dict(hidden=64, mlp=32, q_heads=2 * self.shape["H"])
            self.model = DecodeBatch(self.cache, self.tables, self.lengths, **small)
            if self.ctx.on_gpu:
                self.model.capture()
        return self.model


class Run:
    """One row's steps: phases of nothing and of `mode` beside, the worker's hooks in vLLM's
    order around each decode step."""

    def __init__(self, rig: DecodeRig, mode: str) -> None:
        self.rig, self.mode = rig, mode
        self.loads = mode in ("load_layerwise", "load_whole", "mixed", "load_in_step")
        self.background = mode != "load_in_step"
        self.saves = mode in ("save", "mixed")
        self.step_s: dict[bool, list[float]] = {False: [], True: []}
        # per timed step: (wall, the hooks' host time, the replay call, the wait for the stream, GPU)
        self.parts: dict[bool, list[tuple]] = {False: [], True: []}
        self.submit_s: list[float] = []
        self.arrivals: list[float] = []
        self.pending: dict[str, tuple] = {}  # req id -> (kind, region, t0, fingerprint or None)
        self.busy: dict[tuple, str] = {}  # (kind, region) -> req id still using it
        self.next_region = {"load": 0, "save": 0}
        self.hits = 0
        self.transfers = self.skipped = 0
        self.wrong = 0
        self.ids: dict[str, list[bytes]] = {}  # departures' chunk ids, until saved
        self._n = 0

    def step(self, beside: bool, at: int, timed: bool) -> None:
        from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata

        rig, ws = self.rig, self.rig.ws
        every = rig.sizes["every"]
        meta, started = KVTierMetadata(), 0
        if beside and self.loads and at % every == 0:
            started += self._arrival(meta, ChunkRun)
        if beside and self.saves and (at + (every // 2 if self.loads else 0)) % every == 0:
            started += self._departure(meta, ChunkRun)
        t0 = time.perf_counter()
        ws.handle_preemptions(meta)
        ws.start_load(meta)  # bind_connector_metadata: the hooks read `meta`
        host = time.perf_counter() - t0
        for name in rig.names:  # vLLM's piecewise forward calls it before each attention layer
            t1 = time.perf_counter()
            ws.wait_layer(name)
            host += time.perf_counter() - t1
        gpu = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if rig.ctx.on_gpu
            else None
        )
        t_replay = time.perf_counter()
        if gpu:
            gpu[0].record()
        rig.batch().replay()
        if gpu:
            gpu[1].record()
        t1 = time.perf_counter()
        replay_s = t1 - t_replay
        ws.save(meta)
        sending, recving = ws.finished(set())  # get_transfer_results
        ws.load_errors()
        ws.report()
        host += time.perf_counter() - t1
        if rig.ctx.on_gpu:
            # vLLM's sampler waits for the step's own stream, not the device: copies in flight on
            # kvtier's streams go on past the step
            torch.cuda.current_stream(rig.ctx.device).synchronize()
        else:
            rig.dev.current_stream().synchronize()
        t_end = time.perf_counter()
        if timed:
            self.step_s[beside].append(t_end - t0)
            gpu_ms = gpu[0].elapsed_time(gpu[1]) if gpu else 0.0  # both completed: the stream synced
            wait_s = t_end - t0 - host - replay_s
            self.parts[beside].append((t_end - t0, host, replay_s, wait_s, gpu_ms / 1e3))
            if started:
                self.submit_s.append(host / started)
        self._settle(set(sending or ()) | set(recving or ()), t_end)

    def _arrival(self, meta, ChunkRun) -> int:
        rig = self.rig
        r = self.next_region["load"]
        if ("load", r) in self.busy:
            self.skipped += 1
            return 0
        self.next_region["load"] = (r + 1) % REGIONS
        ids, tokens, fp = rig.prefixes[self.hits % len(rig.prefixes)]
        self.hits += 1
        blocks = rig.arrive[r][: tokens // rig.N]
        self._n += 1
        rid = f"a{self._n}"
        meta.loads.append(ChunkRun(rid, ids, blocks, background=self.background))
        self.pending[rid] = ("load", r, time.perf_counter(), (blocks, fp))
        self.busy[("load", r)] = rid
        return 1

    def _departure(self, meta, ChunkRun) -> int:
        rig = self.rig
        r = self.next_region["save"]
        if ("save", r) in self.busy:
            self.skipped += 1
            return 0
        self.next_region["save"] = (r + 1) % REGIONS
        self._n += 1
        rid = f"d{self._n}"
        blocks = rig.depart[r]
        ids = [f"{rid}/{i}".encode().ljust(32, b".") for i in range(len(blocks) // rig.chunk_blocks)]
        self.ids[rid] = ids
        meta.saves.append(ChunkRun(rid, ids, blocks))
        meta.release.add(rid)  # finished: reported once its saves read its blocks
        self.pending[rid] = ("save", r, time.perf_counter(), None)
        self.busy[("save", r)] = rid
        return 1

    def _settle(self, finished: set[str], t_end: float) -> None:
        """Transfers the worker reported complete (a load in the step: landed once the step
        synced) free their regions; a load's blocks are checked against the prefix it loaded."""
        for rid in list(self.pending):
            kind, r, t0, check = self.pending[rid]
            if rid not in finished and (kind == "save" or self.background):
                continue
            del self.pending[rid]
            self.busy.pop((kind, r), None)
            self.transfers += 1
            if kind == "save":  # each departure's chunks are new: dropped once saved, so the
                self.rig.ws.store.evict(self.ids.pop(rid))  # arrivals' prefixes stay in the host
            if kind == "load":
                self.arrivals.append(t_end - t0)
                blocks, fp = check
                if self.rig.fingerprint(blocks) != fp:
                    self.wrong += 1
                self.rig.poison(blocks)  # the next load into the region must land to pass its check

    def drain(self) -> None:
        """Steps with nothing new until every transfer started has landed and was settled."""
        deadline = time.monotonic() + 60
        while self.pending and time.monotonic() < deadline:
            self.step(False, 1, timed=False)


class Memory:
    """One device buffer every rig's cache is carved from, grown only when a rig needs more: the
    rigs of several orders and batches take tens of GiB each, and one allocation reused keeps
    the caching allocator from holding several."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, dims: list[int], dtype: torch.dtype, device) -> torch.Tensor:
        n = 1
        for d in dims:
            n *= d
        if self.buf is None or self.buf.numel() < n or self.buf.dtype != dtype:
            self.buf = None  # the old one goes back first
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            self.buf = torch.empty(n, dtype=dtype, device=device)
        return self.buf[:n].view(dims)


def decode_rows(ctx: Context, order: str, shape: dict, memory: Memory | None = None):
    """The decode_beside rows of one order (module docstring); memory: a `Memory` shared with the
    other orders' rows (None: one of their own)."""
    memory = Memory() if memory is None else memory
    sizes = dict(
        batches=BATCHES, context=CONTEXT, hits=HITS, depart=DEPART, phase=PHASE, rounds=ROUNDS, every=EVERY
    )
    if not ctx.on_gpu:
        sizes = dict(TINY)
    elif ctx.quick:
        sizes |= dict(batches=(32,), rounds=2)
    for batch in sizes["batches"]:
        rig = DecodeRig(ctx, order, shape, batch, sizes=sizes, memory=memory)
        try:
            kv_bytes = rig.batch().kv_bytes
            for mode in MODES:
                yield _row(ctx, rig, mode, batch, kv_bytes)
        finally:
            rig.close()
            del rig
            if ctx.on_gpu:
                torch.cuda.empty_cache()


def _row(ctx: Context, rig: DecodeRig, mode: str, batch: int, kv_bytes: int):
    label = f"decode_beside {mode} {rig.order} {batch}"
    if ctx.on_progress:
        ctx.on_progress(label)
    rig.open(layerwise=mode != "load_whole", load_async="never" if mode == "load_in_step" else "auto")
    run, s = Run(rig, mode), rig.sizes
    for at in range(s["phase"]):  # warm-up: clocks, the first use of every path
        run.step(at % 2 == 1, at, timed=False)
    run.drain()
    rig.ws.stats()
    for _ in range(s["rounds"]):
        for beside in (False, True):
            for at in range(s["phase"]):
                run.step(beside, at, timed=True)
        run.drain()
    counts = rig.ws.stats()
    nothing, beside = run.step_s[False], run.step_s[True]
    ratios = {}
    for op, ceiling in (("load", "h2d_pinned"), ("save", "d2h_pinned")):
        gpu_s, nbytes = counts.get(f"{op}_busy_s", 0.0), counts.get(f"{op}_bytes", 0)
        if gpu_s and nbytes and ctx.on_gpu:
            ratios[op] = nbytes / gpu_s / 1e9 / ctx.ceilings[ceiling]
    params = dict(
        order=rig.order,
        batch=batch,
        mode=mode,
        context_tokens=f"{s['context'][0]}-{s['context'][1]}",
        kv_read_gib=round(kv_bytes / 2**30, 2),
        hits=list(s["hits"]),
        every=s["every"],
        step_ms_nothing=_ms(nothing, 50),
        step_ms_beside=_ms(beside, 50),
        p50_ratio=round(percentile(beside, 50) / percentile(nothing, 50), 4),
        p99_ratio=round(percentile(beside, 99) / percentile(nothing, 99), 4),
        link_ratio=round(min(ratios.values()), 4) if ratios else None,
        load_link_ratio=round(ratios["load"], 4) if "load" in ratios else None,
        save_link_ratio=round(ratios["save"], 4) if "save" in ratios else None,
        submit_us_p99=round(percentile(run.submit_s, 99) * 1e6, 1) if run.submit_s else None,
        submit_us_p50=round(percentile(run.submit_s, 50) * 1e6, 1) if run.submit_s else None,
        arrival_ms_p50=_ms(run.arrivals, 50),
        steps_beside=_profile(run.parts[True]),
        steps_nothing=_profile(run.parts[False]),
        transfers=run.transfers,
        skipped=run.skipped,
        load_path=rig.ws.load_path(run.background) or rig.ws.store.engine.load_path(per_layer=False).value,
        background=run.background if run.loads else None,
        load_errors=counts.get("miss_chunks", 0),
        save_errors=counts.get("save_errors", 0),
    )
    rig.close()
    from kvtier.bench.stats import summarize

    t = summarize([x * 1e3 for x in beside], "perf_counter")
    ok = run.wrong == 0 and run.transfers > 0 and not params["load_errors"]
    ceiling = "d2d_copy" if ctx.on_gpu else "host_memcpy"  # the step's KV reads against the HBM's copy
    return ctx.row(label, kv_bytes, t, ceiling, correct=ok, **params)


def _profile(parts: list[tuple]) -> dict:
    """Where a step's time goes, for the median steps and the slowest (at or past p98): the wall
    time, the hooks' host time, the replay call's, the host's wait for the stream, and the graph's
    GPU time (CUDA events; 0 on a CPU), each the mean over those steps, in ms."""
    if not parts:
        return {}
    ranked = sorted(parts)
    cut = min(len(ranked) - 1, int(0.98 * len(ranked)))
    mid = ranked[len(ranked) // 4 : max(len(ranked) // 4 + 1, 3 * len(ranked) // 4)]
    names = ("wall_ms", "hooks_ms", "replay_call_ms", "wait_ms", "gpu_ms")

    def mean(rows) -> dict:
        return {n: round(sum(r[i] for r in rows) / len(rows) * 1e3, 3) for i, n in enumerate(names)}

    return {"middle_half": mean(mid), "slowest_2pct": mean(ranked[cut:]), "steps": len(ranked)}


def _ms(samples: list[float], q: float) -> float | None:
    return round(percentile(samples, q) * 1e3, 3) if samples else None
