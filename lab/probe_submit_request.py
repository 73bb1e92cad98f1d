"""What a vLLM step pays the host to start a request's load or save (issue #28): one
`KVStore.load` / `KVStore.save` of 32 chunks of 256 tokens at the Llama-3-8B shape (32 layers,
8 KV heads, head_dim 128, bf16, 16-token blocks: 32 MiB a chunk, 1 GiB in all), every chunk in
the host tier, timed around the call alone (the copies it starts land later, untimed).

    PYTHONPATH=src:. python lab/probe_submit_request.py [--reps N] [--order LBHNC] [--path staged]
                                                        [--keys vllm|tokens] [--small] [--sim]
                                                        [--profile]

Medians of N calls, in microseconds per call. On a GPU (unless --sim) the cache is on it and the
pool pinned; elsewhere a `SimDevice` stands in (its "batch" path emulated), whose copies are
delayed so none runs while a call is timed. --small keeps every count (layers, blocks, chunks) and
shrinks the bytes (1 head of 8): the counts are what a submit's host time grows with. The same
script at an older commit gives the before figure (it uses only long-standing public names, and
the SimDevice's batch emulation only where asked). --profile: cProfile over the timed calls
(saves and loads apart), the functions that took the most time of their own.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time

import torch

from kvtier import layout
from kvtier.device import CudaDevice, SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.integrations.vllm.hash_store import HashKeyedStore
from kvtier.pool import PinnedPool
from kvtier.store import KVStore

LAYERS, BLOCK, CHUNK_TOKENS, CHUNKS = 32, 16, 256, 32


def build(order: str, heads: int, dim: int, path: str, sim: bool, keys: str = "vllm"):
    cuda = torch.cuda.is_available() and not sim
    bpc = CHUNK_TOKENS // BLOCK
    nb = 2 * CHUNKS * bpc  # the saved request's blocks, then the loaded one's
    sizes = {"L": LAYERS, "B": nb, "H": heads, "N": BLOCK, "C": 2 * dim}
    buf = torch.zeros([sizes[a] for a in order], dtype=torch.bfloat16, device="cuda" if cuda else "cpu")
    logical = buf.permute(*[order.index(a) for a in "LBHNC"])
    kv = layout.vllm_paged({f"model.layers.{i}.self_attn.attn": logical[i] for i in range(LAYERS)}, order)
    if cuda:
        dev = CudaDevice()
    else:  # delayed copies: none runs beside a timed call
        batch = {"batch_copy": True} if path == "batch" else {}  # only where asked: older SimDevices lack it
        dev = SimDevice(copy_delay=0.005, launch_delay=0.005, **batch)
    pool = PinnedPool(dev, (CHUNKS + 4) * kv.chunk_nbytes(bpc))
    eng = TransferEngine(dev, kv, pool, EngineConfig(path=path, sanitize=False))
    kind = HashKeyedStore if keys == "vllm" else KVStore
    host = (CHUNKS + 2) * kv.chunk_nbytes(bpc)
    store = kind(eng, "probe", chunk_tokens=CHUNK_TOKENS, host_capacity_bytes=host)
    return dev, pool, eng, store, bpc


def request(keys: str) -> list:
    """What the store is called with for the request: its chunk ids (vLLM's connector: the hash
    of each chunk's last block names its prefix) or its token ids."""
    if keys == "vllm":
        return [i.to_bytes(32, "little") for i in range(CHUNKS)]
    return list(range(CHUNKS * CHUNK_TOKENS))


def settle() -> None:
    """Between timed calls: a collection, then 10 ms of busy host (as a serving loop's, launching
    the forward between two steps) while the store's threads (its reaper, woken by the last
    call's jobs) go idle again. Not a sleep: a host that slept meets the next call cold, several
    times slower on a small VM, which would time the machine, not the call."""
    gc.collect()
    end = time.perf_counter() + 0.01
    while time.perf_counter() < end:
        pass


def median_us(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[len(samples) // 2] * 1e6


def probe(
    order: str, heads: int, dim: int, path: str, reps: int, sim: bool, keys: str, profile: bool = False
) -> tuple[float, float]:
    dev, pool, eng, store, bpc = build(order, heads, dim, path, sim, keys)
    prof = {"save": cProfile.Profile(), "load": cProfile.Profile()} if profile else None
    tokens = request(keys)
    src, dst = list(range(CHUNKS * bpc)), list(range(CHUNKS * bpc, 2 * CHUNKS * bpc))
    compute = dev.current_stream()
    save_s, load_s = [], []
    try:
        gc.disable()  # no collection inside a timed call (one runs between them)
        for rep in range(reps + 2):  # two warm-up calls each: plans, graphs, spare arrays
            store.evict(tokens)  # every chunk new again
            after = compute.record()
            settle()
            timed = prof is not None and rep >= 2
            if timed:
                prof["save"].enable()
            t0 = time.perf_counter()
            h = store.save(tokens, src, after=after)
            t1 = time.perf_counter()
            if timed:
                prof["save"].disable()
            assert h.saved == CHUNKS and h.wait(60), "the save did not complete"
            settle()
            if timed:
                prof["load"].enable()
            t2 = time.perf_counter()
            lh = store.load(tokens, dst)
            t3 = time.perf_counter()
            if timed:
                prof["load"].disable()
            assert len(lh.jobs) == CHUNKS and lh.wait(60), "the load did not complete"
            if rep >= 2:
                save_s.append(t1 - t0)
                load_s.append(t3 - t2)
    finally:
        gc.enable()
        if prof is not None:
            for name, p in prof.items():
                print(f"== cProfile of store.{name} (the profiler's own cost included)")
                pstats.Stats(p).sort_stats("tottime").print_stats(25)
        store.close()
        eng.close()
        pool.close()
        dev.close()
    return median_us(save_s), median_us(load_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--order", default="LBHNC", choices=layout.VLLM_ORDERS)
    ap.add_argument("--path", default="staged", choices=["staged", "kernel", "batch", "auto"])
    ap.add_argument("--small", action="store_true", help="1 KV head of 8 dims: the same counts, few bytes")
    ap.add_argument("--sim", action="store_true", help="a SimDevice even where a GPU is present")
    ap.add_argument(
        "--keys",
        default="vllm",
        choices=["vllm", "tokens"],
        help="chunks named as the vLLM connector names them (HashKeyedStore), or by token ids (KVStore)",
    )
    ap.add_argument("--profile", action="store_true", help="cProfile of the timed calls")
    args = ap.parse_args()
    heads, dim = (1, 8) if args.small else (8, 128)
    save_us, load_us = probe(args.order, heads, dim, args.path, args.reps, args.sim, args.keys, args.profile)
    where = "sim" if args.sim or not torch.cuda.is_available() else torch.cuda.get_device_name()
    shape = f"L{LAYERS} H{heads} D{dim} bf16, {CHUNKS} chunks of {CHUNK_TOKENS} tokens"
    print(f"{where} {args.order} path={args.path} keys={args.keys} ({shape}), median of {args.reps}:")
    print(f"  store.save  {save_us:9.1f} us per call")
    print(f"  store.load  {load_us:9.1f} us per call")


if __name__ == "__main__":
    main()
