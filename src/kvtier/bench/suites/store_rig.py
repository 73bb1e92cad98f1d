"""What the `store` suite measures on: a paged cache with one request in it, an engine and pool
sized for that request, a redis-server of its own, and the `kvtier.path` model of each tier.

Not a suite (it registers nothing); `store.py` is.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from kvtier import path as kpath
from kvtier.bench.suite import Context
from kvtier.reference import bits_equal, gather_ref, random_cache

PROMPT_TOKENS, CHUNK_TOKENS, BLOCK_SIZE, VOCAB = 32768, 256, 16, 128256  # Llama-3 vocabulary
MODEL_TIER = {"host": "host", "disk": "disk", "redis": "remote"}  # kvtier.path's name of each tier
TIER_CEILINGS = {"disk": ("disk_write", "disk_read"), "redis": ("redis_loopback_set", "redis_loopback_get")}
TIER_HOP = {"disk": "local disk (measured here)", "redis": "Redis on loopback, redis-py (measured here)"}


class Rig:
    """A random vLLM-flash cache on the run's device (CudaDevice, or SimDevice with copy delay 0),
    holding one request of `tokens` tokens in random blocks (`src`) and as many other blocks to
    load into (`dst`); an engine and a pool with room for the whole request plus the host tier's
    headroom. Everything is closed by `stack`."""

    def __init__(
        self,
        ctx: Context,
        stack: ExitStack,
        *,
        layers: int,
        tokens: int,
        heads: int,
        head_dim: int,
        seed: int,
    ) -> None:
        from kvtier.device import CudaDevice, SimDevice
        from kvtier.engine import EngineConfig, TransferEngine
        from kvtier.pool import PinnedPool

        self.ctx, self.chunk_tokens, self.chunks = ctx, CHUNK_TOKENS, tokens // CHUNK_TOKENS
        self.dev = CudaDevice(ctx.device.index or 0) if ctx.on_gpu else SimDevice(copy_delay=0.0)
        stack.callback(self.dev.close)
        nb = tokens // BLOCK_SIZE
        dtype = torch.bfloat16
        self.kv = random_cache(
            "vllm_flash", layers, 2 * nb + 16, BLOCK_SIZE, heads, head_dim, dtype, ctx.device, seed=seed
        )
        if ctx.on_gpu:  # the engine's streams do not know of the kernels that filled the cache
            torch.cuda.synchronize(ctx.device)
        g = torch.Generator().manual_seed(seed)
        self.tokens: list[int] = torch.randint(0, VOCAB, (tokens,), generator=g).tolist()
        perm = torch.randperm(self.kv.num_blocks, generator=g).tolist()
        self.src, self.dst = perm[:nb], perm[nb : 2 * nb]
        self.nbytes = self.kv.chunk_nbytes(nb)
        self.span = self.kv.chunk_nbytes(CHUNK_TOKENS // BLOCK_SIZE)
        self.pool = PinnedPool(self.dev, self.nbytes + self.nbytes // 4 + 4 * self.span)
        stack.callback(self.pool.close)
        staging = min(512 << 20, 4 * self.span)  # a store job is one chunk: more staging is idle memory
        self.eng = TransferEngine(self.dev, self.kv, self.pool, EngineConfig(staging_bytes=staging))
        stack.callback(self.eng.close)
        self.shape = dict(layers=layers, kv_heads=heads, head_dim=head_dim, dtype="bfloat16")

    def store(self, tiers: list):
        """A KVStore over the engine and `tiers` (write-through); use it as a context manager."""
        from kvtier.store import KVStore

        return KVStore(self.eng, "kvtier-bench/llama-3-8b-kv", tiers=tiers, chunk_tokens=CHUNK_TOKENS)

    def params(self) -> dict:
        dev = "CudaDevice" if self.ctx.on_gpu else "SimDevice (copy delay 0; 'GPU' memory is host RAM)"
        return self.shape | dict(
            block_size=BLOCK_SIZE,
            chunk_tokens=CHUNK_TOKENS,
            tokens=len(self.tokens),
            chunks=self.chunks,
            chunk_bytes=self.span,
            device=dev,
            engine_path="auto",
            write_policy="write_through",
        )

    def check_load(self, st, tier: str) -> tuple[bool, str]:
        """Poison the destination blocks, load the request, compare every byte with the source
        blocks; the chunks must all come from `tier`. (ok, what was checked or what went wrong)."""
        idx = torch.tensor(self.dst, device=self.kv.device)
        for layer in range(self.kv.num_layers):  # a block the load leaves alone must fail the check
            self.kv.block_view(layer).view(torch.uint8)[:, idx] = 0xA5
        if self.ctx.on_gpu:  # the engine's load stream does not know of these writes: finish them first
            torch.cuda.synchronize(self.ctx.device)
        lh = st.load(self.tokens, self.dst)
        if not lh.wait(120):  # submitted is not done: compare only once every chunk landed
            return False, "the load did not complete within 120 s"
        if lh.tokens != len(self.tokens) or set(lh.tiers) != {tier}:
            return False, f"the load delivered {lh.tokens} tokens from {sorted(set(lh.tiers))}"
        ok = bits_equal(gather_ref(self.kv, self.dst), gather_ref(self.kv, self.src))
        return ok, f"every byte loaded from {tier} equals its source block (destination poisoned first)"


def _gpu_spec(ctx: Context):
    if not ctx.on_gpu:
        return None
    from kvtier.specs import gpu_from_device_name

    return gpu_from_device_name(torch.cuda.get_device_name(ctx.device))


def path_model(ctx: Context, tier: str, direction: str, nbytes: int) -> tuple[str, dict]:
    """(the ceiling of the slowest hop measured in this run, params of the `kvtier.path` model of
    moving `nbytes` between the GPU and `tier`: its hops with this run's figures where measured)."""
    save = direction == "save"
    link = ("d2h_pinned" if save else "h2d_pinned") if ctx.on_gpu else "host_memcpy"
    measured = {link: ctx.ceiling(link)}
    low = TIER_CEILINGS[tier][0 if save else 1] if tier in TIER_CEILINGS else None
    if low is not None:
        measured[low] = ctx.ceiling(low)  # measured before the tier's rows ran (store.py)
    gpu = _gpu_spec(ctx)
    hops: list[kpath.Hop] = []
    if gpu is not None:  # GPU HBM -> PCIe -> host DRAM [-> disk | NIC], as kvtier.path builds a save
        base = kpath.build_path(gpu, MODEL_TIER[tier], None, "save")
        for role, hop in zip(("gpu", "link", "dram", "tier"), base.hops, strict=False):
            if role == "link":
                hop = kpath.Hop(hop.name, measured[link], hop.latency_us, f"measured {link}")
            elif role == "tier":
                hop = kpath.Hop(TIER_HOP[tier], measured[low], hop.latency_us, f"measured {low}")
            hops.append(hop)
    else:  # SimDevice, or a GPU kvtier has no datasheet for: only the hops measured here
        name = "GPU <-> pinned host (DMA)" if ctx.on_gpu else "SimDevice 'GPU' <-> pool slot (a host memcpy)"
        hops.append(kpath.Hop(name, measured[link], 0.0, f"measured {link}"))
        if low is not None:
            hops.append(kpath.Hop(TIER_HOP[tier], measured[low], 0.0, f"measured {low}"))
    p = kpath.Path(MODEL_TIER[tier], direction, tuple(hops if save else reversed(hops)))
    ms = p.transfer_ms(nbytes)
    text = " -> ".join(
        f"{h.name}: {h.gbps:,.1f} GB/s ({h.source if h.source.startswith('measured') else 'datasheet'})"
        for h in p.hops
    )
    ceiling = min(measured, key=measured.get)
    model = dict(
        path_hops=text,
        path_bottleneck=p.bottleneck.name,
        path_bottleneck_gbps=p.bottleneck.gbps,
        path_predicted_ms=ms,
        path_predicted_gbps=nbytes / ms / 1e6,
    )
    return ceiling, model


def redis_server(stack: ExitStack, workdir: Path) -> tuple[str | None, str]:
    """(url of a redis-server started here on a free loopback port, "") or (None, why not).
    The server is stopped by `stack`; it saves nothing to disk."""
    url, why, _ = redis_process(stack, workdir)
    return url, why


def redis_process(stack: ExitStack, workdir: Path) -> tuple[str | None, str, subprocess.Popen | None]:
    """`redis_server`, with its process: (url, "", process) or (None, why not, None)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None, "redis-server is not on PATH (apt-get install redis-server)", None
    try:
        import redis  # noqa: F401
    except ImportError as e:
        return None, f"redis-py is not importable: {e}", None
    from kvtier.store.redis_client import make_client

    workdir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(workdir), "--logfile", str(workdir / "redis.log")]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(_stop, proc)
    url = f"redis://127.0.0.1:{port}/0"
    client = make_client(url, timeout_s=1.0)
    deadline = time.monotonic() + 10.0
    try:
        # Poll until it answers: a tier used before the listener is up would look dead.
        while True:
            if proc.poll() is not None:
                return None, f"redis-server exited with code {proc.returncode} (see its log)", None
            try:
                client.ping()
                return url, "", proc
            except Exception:
                if time.monotonic() > deadline:
                    return None, f"redis-server on port {port} did not answer PING within 10 s", None
                time.sleep(0.02)
    finally:
        client.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)  # reaped: no zombie outlives the run
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
