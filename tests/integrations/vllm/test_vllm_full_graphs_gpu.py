"""`full_graphs` on CUDA: the worker's hooks inside one real CUDA graph of a stand-in forward (per
layer: the connector's wait_for_layer_load, then a read of that layer of the request's blocks),
captured once with no metadata bound, replayed in steps with a load and in steps without; bit for
bit, the blocks poisoned before each load. Skipped without a GPU; the CPU versions run vLLM's
scheduler in test_vllm_full_graphs.py."""

from __future__ import annotations

import pytest
import torch

from kvtier.integrations.vllm.metadata import ChunkRun, KVTierMetadata
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.integrations.vllm.worker import WorkerSide

pytestmark = pytest.mark.gpu
LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 8, 32, 2, 16, 64
CHUNKS = 4  # one block each
SRC, DST = [3, 9, 4, 12], [20, 17, 25, 21]


class Forward:
    """Per layer, as vLLM's attention op calls the connector (`maybe_transfer_kv_layer`): the
    layer's wait where the connector says it has metadata, then the layer of DST read into `out`.
    Captured as one CUDA graph with no metadata bound (vLLM's captures bind none)."""

    def __init__(self, ws: WorkerSide, cache: torch.Tensor, names: list[str]):
        self.ws, self.cache, self.names = ws, cache, names
        self.idx = torch.tensor(DST, device="cuda")
        self.out = torch.empty_like(cache[:, DST])
        self.seen: list[bool] = []  # capturing() at each layer, as the connector asks it
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.run()  # warm-up on a side stream, as torch asks; not capturing: no wait
        torch.cuda.synchronize()
        self.seen.clear()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.run()

    def run(self):
        for layer, name in enumerate(self.names):
            capturing = self.ws.capturing()
            self.seen.append(capturing)
            if capturing:  # KVTierConnector.has_connector_metadata with nothing bound
                self.ws.wait_layer(name)  # on the capturing stream: a node of the graph
            self.out[layer].copy_(self.cache[layer].index_select(0, self.idx))


def test_one_graph_of_the_forward_replays_steps_with_and_without_a_load():
    cache = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD, device="cuda").to(torch.bfloat16)  # LBHNC
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    per_chunk = LAYERS * HEADS * BLOCK * 2 * HEAD * 2
    s = VllmSettings(chunk_tokens=BLOCK, host_bytes=4 * CHUNKS * per_chunk, full_graphs=True)
    ws = WorkerSide(s, "full-graphs-gpu", order="LBHNC", block_size=BLOCK, tiers=[])
    ws.register({n: cache[i] for i, n in enumerate(names)})
    ids = [i.to_bytes(32, "little") for i in range(CHUNKS)]
    try:
        assert ws.flags is not None and not ws.capturing()
        save = KVTierMetadata()
        save.saves.append(ChunkRun("s", ids, SRC))
        save.release.add("s")
        ws.save(save)
        ws.wait_submitted()
        torch.cuda.synchronize()
        assert ws.finished({"s"})[0] == {"s"}  # every chunk saved: the loads read them all
        want = cache[:, SRC].clone()
        fwd = Forward(ws, cache, names)
        assert fwd.seen == [True] * LAYERS  # the capture saw itself: every layer's wait is in the graph
        for _ in range(3):
            cache[:, DST] = float("nan")  # poisoned: only the load writes these blocks
            fwd.out.fill_(-1)
            torch.cuda.synchronize()
            load = KVTierMetadata()
            load.loads.append(ChunkRun("l", ids, DST))
            ws.start_load(load)  # re-arms the flags, the copies join the step, sealed
            fwd.graph.replay()  # each layer's read waits for that layer of the load
            ws.save(load)
            torch.cuda.synchronize()
            assert torch.equal(fwd.out.view(torch.uint8), want.view(torch.uint8))
            fwd.out.fill_(-1)
            ws.start_load(KVTierMetadata())  # a step without loads: the flags stay set
            fwd.graph.replay()
            ws.save(KVTierMetadata())
            torch.cuda.synchronize()
            assert torch.equal(fwd.out.view(torch.uint8), want.view(torch.uint8))
        assert ws.load_errors() == set()
        assert ws.flags.tracker.generation == 1 + 3  # the start's first use, then one per load step
    finally:
        ws.shutdown()
