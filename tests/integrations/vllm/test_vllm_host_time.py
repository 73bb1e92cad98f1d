"""The host time of the connector's per-step hooks, in vLLM 0.33's order (as `kvtier bench
--suite vllm` replays them), while the copies they start land late on a `SimDevice`: a hook
that waits for a copy, or whose work grows with the copies in flight, shows as host time near
the copy delay. Many layers and chunks: per-layer work over every chunk in flight is what grows.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.integrations.vllm.worker import WorkerSide

DELAY = 0.1  # seconds each copy lands late
LAYERS, HEADS, HEAD, BLOCK = 64, 1, 8, 16
CHUNKS = 16  # one block each: the request's load is CHUNKS jobs, each with an event per layer
BUDGET = DELAY / 4  # far below one copy's delay: no hook waited for a copy


class Rig:
    def __init__(self, **settings):
        self.dev = SimDevice(copy_delay=DELAY)
        buf = torch.randn(LAYERS, 2 * CHUNKS, HEADS, BLOCK, 2 * HEAD).to(torch.bfloat16)  # LBHNC
        self.cache = buf
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        per_chunk = LAYERS * 2 * HEADS * BLOCK * HEAD * 2
        s = VllmSettings(
            chunk_tokens=BLOCK, host_bytes=4 * CHUNKS * per_chunk, staging_bytes=1 << 20, **settings
        )
        self.ws = WorkerSide(s, "host-time", order="LBHNC", block_size=BLOCK, tiers=[], device=self.dev)
        self.ws.register({n: buf[i] for i, n in enumerate(self.names)})
        self.ids = [i.to_bytes(32, "little") for i in range(CHUNKS)]
        self.src, self.dst = list(range(CHUNKS)), list(range(CHUNKS, 2 * CHUNKS))

    def meta(self, *, save: bool = False, load: bool = False) -> KVTierMetadata:
        m = KVTierMetadata()
        if save:
            m.saves.append(ChunkRun("save", self.ids, self.src))
            m.release.add("save")  # finished: reported once its saves read the blocks
        if load:
            m.loads.append(ChunkRun("load", self.ids, self.dst))
        return m

    def step(self, meta: KVTierMetadata, rid: str) -> float:
        """Every hook of one step, as the suite's replay calls them; their host seconds."""
        ws, t0 = self.ws, time.perf_counter()
        ws.handle_preemptions(meta)
        ws.start_load(meta)
        for name in self.names:
            ws.wait_layer(name)
        ws.save(meta)
        ws.finished({rid})
        ws.load_errors()
        ws.stats()
        ws.report()
        return time.perf_counter() - t0

    def sync(self) -> None:
        self.ws.wait_submitted()  # the saver and loader threads queued what they were handed
        self.dev.synchronize()  # every stream's tail: the copies submitted so far have landed

    def close(self) -> None:
        self.ws.shutdown()  # every copy in flight lands before its slot goes back
        self.dev.close()


@pytest.mark.parametrize("full_graphs", [False, True], ids=["events", "flags"])
@pytest.mark.parametrize("sanitize", ["0", "1"])
def test_a_step_starting_a_load_or_a_save_never_waits_for_the_copies(monkeypatch, sanitize, full_graphs):
    monkeypatch.setenv("KVTIER_SANITIZE", sanitize)  # on: every wait is noted and each access checked
    r = Rig(full_graphs=full_graphs)
    try:
        save_s = r.step(r.meta(save=True), "s")
        r.sync()
        assert r.ws.finished({"save"})[0] == {"save"}  # every chunk saved: the load reads them all
        r.cache[:, r.dst] = -7.0  # poisoned: only the load writes these blocks

        load_s = r.step(r.meta(load=True), "l")
        idle_s = r.step(r.meta(), "i")  # the load's copies still in flight: every layer still waits
        r.sync()
        assert torch.equal(r.cache[:, r.dst], r.cache[:, r.src])  # the step's waits kept it exact
        assert save_s < BUDGET, f"a step starting a save took {save_s * 1e3:.1f} ms of host time"
        assert load_s < BUDGET, f"a step starting a load took {load_s * 1e3:.1f} ms of host time"
        assert idle_s < BUDGET, f"an idle step beside a load took {idle_s * 1e3:.1f} ms of host time"
    finally:
        r.close()
