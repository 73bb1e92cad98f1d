"""The `vllm` suite's failover rows: a load that fails in the middle of a request, through the
connector's hooks, and what vLLM computes and kvtier stores after it.

  load_failed_mid_request <order> <n>
      Both halves of the connector (`SchedulerSide` as vLLM's scheduler calls it, `WorkerSide` in
      vLLM's per-step order) and the model's forward over the request's blocks (`paged_step`).
      Request A computes and saves the prompt's first half. Request B, the whole prompt, is
      granted that half; right before its step the host loses a chunk in the middle of it (an
      eviction racing the grant): the load delivers the chunks before it, and B's forward runs
      on past the hit over the blocks that did not load, computing the rest of the prompt (what
      would be saved). vLLM's recompute follows (kv_load_failure_policy="recompute": the tokens
      from the first block reported on), saving what it computes. Request C, the same prompt, then
      loads every chunk. correct: no save of B was sent in the failing step, the blocks reported
      are exactly those not loaded, C loads every chunk, the KV C loaded equals, bit for bit, what
      B's recompute computed (the KV a healthy save holds), and C's first token's logits equal,
      bit for bit, those of the same forward over B's blocks (a recompute's); on the CPU (fp32)
      B's own first token after the recompute equals C's too. Params: chunks, chunks_granted,
      failed_chunk, saves_in_failing_step, error_blocks, expected_error_blocks, chunks_loaded,
      loaded_equals_recomputed, first_token, recompute_token, recompute_logits_max_abs_diff.
      Time: B's failing step's host time (hooks and forward).

  redis_killed_mid_load <order> <n>
      The request's blocks hold the prompt's own KV (the model's forward over it); a step saves
      its chunks (write-through: the host and a redis-server started here on a loopback port),
      the host is emptied, and a background load (as the scheduler sends a hit only Redis holds)
      reads them back from Redis, the engine stepping until it is received. After a third of
      the chunks have been read the server is killed (SIGKILL, from inside the tier's read, so
      the point is the same every run): the rest fail. What vLLM does with
      kv_load_failure_policy="recompute" follows: the tokens from the first block the worker
      reported (get_block_ids_with_load_errors) on are prefilled over the blocks that did load.
      correct: the blocks reported are exactly those after the loaded ones, the loaded ones equal
      the saved bit for bit, no exception reached the hooks, and the logits after the recompute
      equal, bit for bit, those of a healthy hit of the same length (the same forward over the
      blocks the KV was saved from): what vLLM computes had no tier failed there. On the CPU
      (fp32) they also equal recomputing the whole prompt within 1e-3. In bf16 on a GPU a hit's
      split forward and the whole prompt's prefill round differently, and with random weights
      the top logits lie closer than that rounding: the first token of each is reported, not
      required equal. Params: chunks, chunks_loaded, error_blocks, expected_error_blocks,
      load_errors (the worker's count), first_token, healthy_token, recompute_token,
      logits_max_abs_diff (against the whole prompt's recompute). Time: from the load's step to
      the step that reported it received (the reads, the failures, the copies).

  (redis_killed_mid_load is skipped without a redis-server binary on PATH or redis-py.)
"""

from __future__ import annotations

import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import torch

from kvtier.bench.stats import summarize
from kvtier.bench.suite import Context
from kvtier.reference import bits_equal


class KillAfter:
    """A tier that kills its server (``proc``) at the start of its ``reads + 1``-th read: every
    read from then on meets a dead server, whichever thread (the load's, read-ahead) makes it."""

    def __init__(self, tier, proc, reads: int) -> None:
        self.tier, self.proc, self.left = tier, proc, reads
        self.name = tier.name

    def get_into(self, key, dest):
        self.left -= 1
        if self.left == -1:
            self.proc.kill()
            self.proc.wait()  # dead before this read starts: no read after it reaches a live server
        return self.tier.get_into(key, dest)

    # The rest of the `Tier` protocol, spelled out: isinstance() of a protocol (Python 3.12) looks
    # the methods up on the class, not through __getattr__.
    def put(self, key, header, payload):
        return self.tier.put(key, header, payload)

    def get(self, key):
        return self.tier.get(key)

    def contains(self, key):
        return self.tier.contains(key)

    def delete(self, key):
        return self.tier.delete(key)

    def stats(self):
        return self.tier.stats()

    def close(self) -> None:
        pass  # the wrapped tier is closed by whoever made it (killed_row's stack)

    def __getattr__(self, name):
        return getattr(self.tier, name)


def killed_row(ctx: Context, fwd, replay, order: str, shape: dict, tokens: int):
    """Yield the redis_killed_mid_load row of `order` (or its skip); replay: `vllm.Replay`."""
    from kvtier.bench.suites.store_rig import redis_process
    from kvtier.bench.suites.vllm_rows import GraphedTail, PagedPrefix
    from kvtier.store.redis_tier import RedisTier

    case = f"redis_killed_mid_load {order} {tokens} tokens"
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-vllm-redis-")))
        url, why, proc = redis_process(stack, workdir)
        if url is None:
            ctx.skip(case, why)
            return
        redis = RedisTier(url=url, timeout_s=1.0)
        stack.callback(redis.close)
        killer = KillAfter(redis, proc, 1 << 62)  # armed below, once the save is in
        r = replay(ctx, order, shape, tokens, tiers=[killer])
        stack.callback(r.close)
        if ctx.on_progress:
            ctx.on_progress(f"vllm/{case}")
        n, nb, h = r.blocks * shape["N"], r.blocks, shape["H"]
        ids = fwd.prompt(n + fwd.new)
        src = torch.tensor(r.src[:nb], device=r.cache.device)
        with torch.no_grad():
            for layer, (k, v) in enumerate(fwd.lean.prefill_kv(ids[:, :n])):  # the prompt's own KV
                pages = torch.cat([k, v], -1)[0].view(h, nb, shape["N"], -1).permute(1, 0, 2, 3)
                r.cache[layer][src] = pages  # [blocks, H, N, K||V], as vLLM's attention writes it
        r.step(r.meta(save=True))
        r.settle_saves()
        if not r.ws.store.flush(120):  # write-through: every chunk in Redis before the host lets go
            ctx.skip(case, "the save to Redis did not finish within 120 s")
            return
        r.settle()  # the host drops them: every chunk must come from Redis
        r.poison()
        killer.left = max(1, r.chunks // 3)  # the server dies as the load's next read starts
        before = r.counts["load_errors"]
        t0 = time.perf_counter()
        errors = _background_load(r, ("redis",) * r.chunks)
        spent = time.perf_counter() - t0
        r.sync()  # the copies of what did load have landed before the blocks are compared
        per = nb // r.chunks
        good = nb - len(errors)
        want_errors = set(r.dst[good:nb])
        loaded_ok = torch.equal(
            r.cache[:, r.dst[:good]].contiguous().view(torch.uint8),
            r.cache[:, r.src[:good]].contiguous().view(torch.uint8),
        )
        # vLLM's recompute: the tokens from the first failed block on, over the blocks that loaded
        with torch.no_grad():
            logits = GraphedTail(fwd.lean, PagedPrefix(r, good), ids).logits(ids)
            healthy = GraphedTail(fwd.lean, PagedPrefix(r, good, saved=True), ids).logits(ids)
            want = fwd.lean.logits(ids)
        tok, want_tok = int(logits.argmax()), int(want.argmax())
        diff = float((logits - want).abs().max())
        ok = (
            errors == want_errors
            and 0 < good < nb
            and good % per == 0
            and loaded_ok
            and bits_equal(logits, healthy)
            and (ctx.on_gpu or diff < 1e-3)
        )
        clock = "perf_counter"
        yield ctx.row(
            case,
            r.nbytes,
            summarize([spent * 1e3], clock),
            "h2d_pinned" if ctx.on_gpu else "host_memcpy",
            correct=ok,
            order=order,
            tokens=n,
            chunks=r.chunks,
            chunks_loaded=good // per,
            error_blocks=len(errors),
            expected_error_blocks=len(want_errors),
            load_errors=r.counts["load_errors"] - before,
            loaded_blocks_exact=loaded_ok,
            first_token=tok,
            healthy_token=int(healthy.argmax()),
            recompute_token=want_tok,
            logits_max_abs_diff=diff,
            direction="load",
        )


def _background_load(r, tiers: tuple[str, ...]) -> set[int]:
    """`r`'s request loaded as the scheduler sends a hit a lower tier holds (in the background:
    read into the host on a reader thread, then copied), the engine stepping until the worker
    reports it received; the blocks it reported not loaded (get_block_ids_with_load_errors)."""
    from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata

    run = ChunkRun("load", r.ids, r.dst[: r.blocks], background=True, tiers=tiers)
    meta, errors = KVTierMetadata(loads=[run]), set()
    while True:
        r.ws.start_load(meta)
        r.ws.save(meta)
        _, received = r.ws.finished(set())  # get_finished
        errors |= r.ws.load_errors()
        r.counts.update(r.ws.stats())
        if received and "load" in received:
            return errors
        time.sleep(0.001)  # an idle engine step: the reader and the loader run meanwhile
        meta = KVTierMetadata()


def failed_load_row(ctx: Context, fwd, replay, order: str, shape: dict, tokens: int):
    """Yield the load_failed_mid_request row of `order`; replay: `vllm.Replay`."""
    from kvtier.bench.suites.vllm_engine_step import Blocks, Request, output, paged_step
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    case = f"load_failed_mid_request {order} {tokens} tokens"
    r = replay(ctx, order, shape, tokens)
    try:
        if r.chunks < 5:
            ctx.skip(case, f"needs 5 chunks, {tokens} tokens make {r.chunks}")
            return
        if ctx.on_progress:
            ctx.on_progress(f"vllm/{case}")
        ws, lean, bs = r.ws, fwd.lean, shape["N"]
        bpc, ct = r.blocks // r.chunks, r.blocks // r.chunks * bs
        c = r.chunks - 1  # the prompt's chunks; the last chunk's blocks take the new tokens
        granted, failed = c // 2 + 1, c // 4 + 1  # A's chunks; the one lost in the middle of them
        n = c * ct + fwd.new
        ids, need = fwd.prompt(n), -(-n // bs)
        a, b, cc = Request("A", ids[:, : granted * ct], bs), Request("B", ids, bs), Request("C", ids, bs)
        sched = SchedulerSide(ws.settings, bs, bs, 1)

        def report():
            """build_connector_worker_meta, into update_connector_output."""
            sched.update(SimpleNamespace(kv_connector_worker_meta=ws.report()))

        def step(meta, forward):
            """One step of the worker hooks in vLLM's order, `forward` in the middle."""
            ws.handle_preemptions(meta)
            ws.start_load(meta)
            out = forward()
            ws.save(meta)
            ws.finished(set())
            errors = ws.load_errors()
            report()
            return out, errors

        r.poison()
        report()  # the workers' first report: their key fields
        sched.lookup(a, 0)  # a miss: nothing is held yet
        sched.after_alloc(a, Blocks(r.src[: granted * bpc]), 0)
        meta = sched.build_meta(output(new=[("A", r.src[: granted * bpc], 0, granted * ct)]))
        step(meta, lambda: paged_step(lean, r, r.src, ids[:, : granted * ct], 0, granted * ct))
        r.settle_saves()  # A's copies landed: its chunks are held before the scheduler is told
        sched.finished(a)  # A is done: B's hit arrives with nothing else running (loaded in its step)
        report()  # A's chunks held: the scheduler grants them

        hit, _ = sched.lookup(b, 0)
        sched.after_alloc(b, Blocks(r.dst[:need]), hit)
        meta = sched.build_meta(output(new=[("B", r.dst[:need], hit, n - hit)]))
        held_back = sum(len(x.ids) for x in meta.saves if x.req_id == "B")
        # The host drops granted chunks, from one in the middle on, before B's load runs: B then
        # recomputes and saves each of them (a later hit's KV is B's, bit for bit, where a chunk
        # A's prefill saved and B recomputed would round apart in bf16).
        lost = ws.store.keys([bytes(b.block_hashes[(i + 1) * bpc - 1]) for i in range(failed, granted)])
        ws.store.host.evict(lost)
        t0 = time.perf_counter()
        _, errors = step(meta, lambda: paged_step(lean, r, r.dst, ids, hit, n))
        spent = time.perf_counter() - t0
        want_errors = set(r.dst[failed * bpc : granted * bpc])

        # vLLM's recompute: from the first block reported, over the blocks that did load.
        meta = sched.build_meta(output(cached=[("B", failed * ct, n - failed * ct)]))
        b_logits, _ = step(meta, lambda: paged_step(lean, r, r.dst, ids, failed * ct, n))
        r.settle_saves()  # the recompute's saves landed before C asks for them
        sched.finished(b)  # B is done: C's hit arrives with nothing else running (loaded in its step)
        report()

        r.cache[:, r.src[:need]] = torch.tensor(-7.0, dtype=r.cache.dtype)  # only C's load writes them
        hit_c, _ = sched.lookup(cc, 0)
        sched.after_alloc(cc, Blocks(r.src[:need]), hit_c)
        meta = sched.build_meta(output(new=[("C", r.src[:need], hit_c, n - hit_c)]))
        c_logits, c_errors = step(meta, lambda: paged_step(lean, r, r.src, ids, hit_c, n))
        r.sync()  # C's copies landed before its blocks are compared
        loaded = sum(len(x.ids) for x in meta.loads)
        same_kv = torch.equal(
            r.cache[:, r.src[: c * bpc]].contiguous().view(torch.uint8),
            r.cache[:, r.dst[: c * bpc]].contiguous().view(torch.uint8),
        )
        healthy = paged_step(lean, r, r.dst, ids, c * ct, n)  # the same forward over B's blocks
        tok, b_tok, diff = (
            int(c_logits.argmax()),
            int(b_logits.argmax()),
            float((c_logits - b_logits).abs().max()),
        )
        ok = (
            held_back == 0
            and errors == want_errors
            and not c_errors
            and hit_c == c * ct
            and loaded == c
            and same_kv
            and bits_equal(c_logits, healthy)
            and (ctx.on_gpu or (tok == b_tok and diff < 1e-3))
        )
        yield ctx.row(
            case,
            r.kv.chunk_nbytes(c * bpc),
            summarize([spent * 1e3], "perf_counter"),
            "h2d_pinned" if ctx.on_gpu else "host_memcpy",
            correct=ok,
            order=order,
            tokens=n,
            chunks=c,
            chunks_granted=granted,
            failed_chunk=failed,
            saves_in_failing_step=held_back,
            error_blocks=len(errors),
            expected_error_blocks=len(want_errors),
            chunks_loaded=loaded,
            loaded_equals_recomputed=same_kv,
            first_token=tok,
            recompute_token=b_tok,
            recompute_logits_max_abs_diff=diff,
            direction="load",
        )
    finally:
        r.close()
