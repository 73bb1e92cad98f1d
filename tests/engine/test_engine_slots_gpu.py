"""TransferEngine.save_slots / load_slots on CUDA, in vLLM 0.33's six orders, on every path: the
multi-slot submission (one batched copy for all slots on "batch", the slots in turn on "staged",
one UVA launch per layer on "kernel") bit for bit on poisoned outputs, a partial last block
included, and every pool byte back after. Skipped without a GPU; the same checks run on the CPU
in test_engine_slots.py (SimDevice)."""

import pytest
import torch
from test_batch_merge import ORDERS, SHAPES, vllm_cache
from test_engine_gpu import need
from test_engine_slots import finish, round_trip

from kvtier.device import CudaDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.pool import PinnedPool

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["batch", "staged", "kernel"])
@pytest.mark.parametrize("order", ORDERS)
def test_slots_round_trip_in_every_vllm_order(order, path):
    need(path)
    L, B, H, N, D = SHAPES["llama_page"]
    kv = vllm_cache(order, L, B, H, N, 2 * D, torch.bfloat16, seed=5, device="cuda")
    dev = CudaDevice()
    pool = PinnedPool(dev, 8 * kv.chunk_nbytes(3))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, staging_bytes=4 * kv.block_nbytes))
    torch.cuda.synchronize()  # the random cache was written on the compute stream: let it land
    slots = round_trip(kv, eng, path, [[2, 3], [4], [5, 6, 7]], [10, 11, 12, 13, 14, 15], None)
    for s in slots:
        eng.release(s)
    slots = round_trip(kv, eng, path, [[9], [1, 16]], [0, 18, 5], 2 * N + 1)
    finish(eng, pool, slots)
    pool.close()
