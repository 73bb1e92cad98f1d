"""Where the vLLM connector's save and load of a request go: chunk size swept, one step traced.

    python -m lab.trace_vllm_step [--tokens 8192] [--orders LBHNC BLHNC] [--chunk-blocks 16 64 512]
                                  [--leads 4 0] [--rounds 2] [--layerwise] [--no-trace]

--leads: values of `kvtier.store.kvstore.LEAD_CHUNKS` (0: off, a request in one submission), each
timed in turn, --rounds times (an A/B on one box). --layerwise: the connector's default loads
(layer-major); without it loads are whole-job (`layerwise: false`), where the lead applies.

For each order and chunk size (blocks per chunk): the worker side (`WorkerSide`, as the connector
drives it) saves then loads a request of --tokens at the Llama-3-8B KV shape; each timed with
CUDA events from before the step's hooks to the copies' end (median of --reps), against the
same-run pinned copy of the same bytes (one cudaMemcpyAsync). Prints GB/s, the ratio, the hooks'
host time; then one save and one load step of the first chunk size under torch's profiler: per
stream, when its GPU work ran (gaps between chunk jobs show there), and the Chrome trace to --out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

L, H, D, N = 32, 8, 128, 16  # Llama-3-8B's KV: layers, KV heads, head size, block tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.trace_vllm_step", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--orders", nargs="+", default=["LBHNC", "BLHNC"])
    ap.add_argument("--chunk-blocks", type=int, nargs="+", default=[16, 64, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="out")
    ap.add_argument("--leads", type=int, nargs="+", default=[4])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layerwise", action="store_true")
    ap.add_argument("--no-trace", action="store_true")
    a = ap.parse_args(argv)
    from kvtier.store import kvstore

    if not torch.cuda.is_available():
        raise SystemExit("trace_vllm_step: needs a CUDA GPU")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = a.tokens // N
    nbytes = n * L * 2 * H * N * D * 2
    d2h, h2d = ceilings(nbytes, a.reps)
    print(f"pinned copy of {nbytes / 2**30:.2f} GiB: D2H {gbps(nbytes, d2h)}, H2D {gbps(nbytes, h2d)}")
    for order in a.orders:
        for cb in a.chunk_blocks:
            rig = Rig(order, n, cb, a.layerwise)
            try:
                for _ in range(a.rounds):
                    for lead in a.leads:
                        kvstore.LEAD_CHUNKS = lead or 1 << 30
                        save_ms, save_host = rig.timed("save", a.reps)
                        load_ms, load_host = rig.timed("load", a.reps)
                        ok = rig.exact()
                        print(
                            f"{order} chunk {cb:4d} blocks lead {lead}: save {gbps(nbytes, save_ms)} "
                            f"({d2h / save_ms:.1%} of D2H, hooks {save_host:7.0f} us)  load "
                            f"{gbps(nbytes, load_ms)} ({h2d / load_ms:.1%} of H2D, "
                            f"hooks {load_host:7.0f} us)  exact {ok}",
                            flush=True,
                        )
                if cb == a.chunk_blocks[0] and not a.no_trace:
                    for kind in ("save", "load"):
                        trace(rig, kind, out / f"vllm-{order}-{kind}.trace.json.gz")
            finally:
                rig.close()


class Rig:
    """A worker over a vLLM 0.33 cache in `order` holding two requests of n blocks."""

    def __init__(self, order: str, n: int, chunk_blocks: int, layerwise: bool = False):
        from kvtier.integrations.vllm.settings import VllmSettings
        from kvtier.integrations.vllm.worker import WorkerSide

        sizes = dict(L=L, B=2 * n, H=H, N=N, C=2 * D)
        buf = torch.empty([sizes[x] for x in order], dtype=torch.bfloat16, device="cuda")
        buf.view(torch.uint8).random_(0, 256)
        self.cache = buf.permute(*[order.index(x) for x in "LBHNC"])
        names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
        perm = torch.randperm(2 * n, generator=torch.Generator().manual_seed(0)).tolist()
        self.src, self.dst = perm[:n], perm[n:]
        per_chunk = chunk_blocks * L * 2 * H * N * D * 2
        chunks = n // chunk_blocks
        s = VllmSettings(
            chunk_tokens=chunk_blocks * N,
            host_bytes=2 * chunks * per_chunk + (64 << 20),
            staging_bytes=min(256 << 20, 2 * per_chunk),
            layerwise=layerwise,
        )
        self.ws = WorkerSide(s, "trace", order=order, block_size=N, tiers=[])
        self.ws.register({name: self.cache[i] for i, name in enumerate(names)})
        self.names = names
        self.ids = [i.to_bytes(32, "little") for i in range(chunks)]
        self.blocks = chunks * chunk_blocks
        self.n_step = 0

    def meta(self, kind: str):
        from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata

        m = KVTierMetadata()
        if kind == "save":
            m.saves.append(ChunkRun("save", self.ids, self.src[: self.blocks]))
        elif kind == "load":
            m.loads.append(ChunkRun("load", self.ids, self.dst[: self.blocks]))
        return m

    def step(self, kind: str) -> float:
        """The hooks of one step in vLLM's order; host seconds spent in them."""
        ws, meta = self.ws, self.meta(kind)
        t0 = time.perf_counter()
        ws.handle_preemptions(meta)
        ws.start_load(meta)
        for name in self.names:
            ws.wait_layer(name)
        ws.save(meta)
        ws.finished({f"r{self.n_step}"})
        ws.report()
        self.n_step += 1
        return time.perf_counter() - t0

    def settle(self) -> None:
        torch.cuda.synchronize()  # every copy landed before the host tier is emptied
        self.ws.finished({"save"})
        self.ws.store.evict()

    def timed(self, kind: str, reps: int) -> tuple[float, float]:
        """(median ms from before the hooks to the copies' end, median host us of the hooks)."""
        from kvtier.integrations.vllm.metadata import KVTierMetadata

        if kind == "load":
            self.settle()
            self.step("save")
            torch.cuda.synchronize()  # the chunks the loads read are in the host tier
            self.ws.finished({"save"})
        ms, host = [], []
        for i in range(reps + 1):
            if kind == "save":
                self.settle()
            torch.cuda.synchronize()  # the previous run's copies are not billed to this one
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            host.append(self.step(kind) * 1e6)
            wait = KVTierMetadata(preempted={"save"})
            self.ws.handle_preemptions(wait)  # the end event follows the save's copies
            end.record()
            torch.cuda.synchronize()  # both events completed
            if i:
                ms.append(start.elapsed_time(end))
        return statistics.median(ms), statistics.median(host[1:])

    def exact(self) -> bool:
        a = self.cache[:, self.dst[: self.blocks]].contiguous().view(torch.uint8)
        b = self.cache[:, self.src[: self.blocks]].contiguous().view(torch.uint8)
        return torch.equal(a, b)

    def close(self) -> None:
        self.ws.shutdown()  # every copy in flight lands before its slot goes back


def trace(rig: Rig, kind: str, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    from lab.trace_split import phases

    if kind == "save":
        rig.settle()
    torch.cuda.synchronize()  # nothing earlier in the trace
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rig.step(kind)
        rig.ws.wait_submitted()  # the saver and loader threads queued the step's copies
        torch.cuda.synchronize()  # every copy of the step lands in the trace
    prof.export_chrome_trace(str(path))
    print(f"  {kind} step traced: {path}")
    for line in phases(prof):
        print("    " + line)


def ceilings(nbytes: int, reps: int) -> tuple[float, float]:
    """ms of one pinned D2H and one H2D copy of nbytes (one cudaMemcpyAsync each)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = timed_gpu(lambda: host.copy_(dev, non_blocking=True), reps)
    h2d = timed_gpu(lambda: dev.copy_(host, non_blocking=True), reps)
    return d2h, h2d


def gbps(nbytes: int, ms: float) -> str:
    return f"{nbytes / ms / 1e6:5.1f} GB/s"


def timed_gpu(fn, reps: int) -> float:
    fn()
    ms = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()  # both events completed
        ms.append(start.elapsed_time(end))
    return statistics.median(ms)


if __name__ == "__main__":
    main()
