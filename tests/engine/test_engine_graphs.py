"""The pure-Python parts of the staged path's CUDA graphs (engine/graphs.py) and the vectorized
id checks (engine/ids.py). The graphs themselves: tests/test_engine_graphs_gpu.py."""

import ctypes

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, TransferEngine
from kvtier.engine.fastpath.graph_nodes import (
    KIND_D2H,
    KIND_DEFAULT,
    KIND_H2D,
    Copy,
    NodeError,
    cudaMemcpy3DParms,
    host_offsets,
    moved,
)
from kvtier.engine.fastpath.graphs import LRU, StagedGraphs, graph_key, pinned_key
from kvtier.engine.ids import IdCheck
from kvtier.pool import PinnedPool
from kvtier.reference import bits_equal, gather_ref, random_cache


def test_lru_evicts_least_recently_used():
    c = LRU(2)
    assert c.put("a", 1) == [] and c.put("b", 2) == []
    assert c.get("a") == 1  # "a" is now the most recent
    assert c.put("c", 3) == [2]  # so "b" goes
    assert c.keys() == ["a", "c"] and "b" not in c and len(c) == 2
    assert c.get("b") is None
    assert c.put("a", 10) == [] and c.get("a") == 10  # replacing keeps the size
    assert sorted(c.clear()) == [3, 10] and len(c) == 0


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, None])
def test_lru_size_checked(bad):
    with pytest.raises(ValueError, match="max_graphs"):
        LRU(bad)


def test_graph_key_names_everything_the_graph_bakes_in():
    base = ("save", 4096, 8, 16, (1, 2))
    keys = {graph_key(*base)}
    for i, other in enumerate(["load", 8192, 9, 5, (3, 4)]):
        k = list(base)
        k[i] = other
        keys.add(graph_key(*k))
    assert len(keys) == 6  # each field alone makes another graph
    assert graph_key(*base) == graph_key(*base)  # and equal inputs hit the same one
    # The slot address is not in the key; a graph that cannot be moved is keyed by it as well.
    k = graph_key(*base)
    assert pinned_key(k, 0x1000) != pinned_key(k, 0x2000) and pinned_key(k, 0x1000) != k
    assert len({k, pinned_key(k, 0x1000), pinned_key(k, 0x1000)}) == 2


def test_lru_pop():
    c = LRU(2)
    c.put("a", 1)
    assert c.pop("a") == 1 and c.pop("a") is None and len(c) == 0


# ---- graph_nodes: the pure parts of moving a graph's DMA nodes to another slot -----------------

BASE, SLOT = 0x7F00_0000_0000, 10 * 4096
STAGE = [(0x1_0000_0000, 4 * 4096), (0x2_0000_0000, 4 * 4096)]  # two staging buffers of 4 blocks


def _save_copies(base=BASE, kind=KIND_D2H):
    """A save of 10 blocks of 4096 B in chunks of 4: staging -> slot, buffers alternating."""
    out = []
    for c, start in enumerate(range(0, 10, 4)):
        m = min(4, 10 - start)
        out.append(Copy(STAGE[c % 2][0], base + start * 4096, m * 4096, kind))
    return out


def test_host_offsets_save_and_load():
    copies = _save_copies()
    assert host_offsets(copies, "dst", BASE, SLOT, STAGE, 3) == [0, 4 * 4096, 8 * 4096]
    loads = [Copy(c.dst, c.src, c.nbytes, KIND_H2D) for c in copies]
    assert host_offsets(loads, "src", BASE, SLOT, STAGE, 3) == [0, 4 * 4096, 8 * 4096]
    shuffled = copies[::-1]  # node order is the graph's, not the chunks'
    assert host_offsets(shuffled, "dst", BASE, SLOT, STAGE, 3) == [8 * 4096, 4 * 4096, 0]
    assert host_offsets(_save_copies(kind=KIND_DEFAULT), "dst", BASE, SLOT, STAGE, 3)


def test_offsets_map_to_the_new_slot():
    offs = host_offsets(_save_copies(), "dst", BASE, SLOT, STAGE, 3)
    new = 0x7F00_1234_5000
    assert moved(offs, new) == [new, new + 4 * 4096, new + 8 * 4096]
    # Captured at the new base, the same nodes give the same offsets: moving is base + offset.
    assert host_offsets(_save_copies(new), "dst", new, SLOT, STAGE, 3) == offs
    assert moved(offs, BASE) == [c.dst for c in _save_copies()]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda cs: cs[:2], "2 memcpy nodes, expected 3"),
        (lambda cs: cs + [cs[0]], "4 memcpy nodes"),
        (lambda cs: [cs[0], cs[1], Copy(cs[2].src, cs[2].dst, cs[2].nbytes, KIND_H2D)], "kind"),
        (lambda cs: [cs[0], cs[1], Copy(cs[2].src, BASE + SLOT, 4096, KIND_D2H)], "not inside the slot"),
        (lambda cs: [cs[0], cs[1], Copy(cs[2].src, BASE - 4096, 4096, KIND_D2H)], "not inside the slot"),
        (lambda cs: [cs[0], cs[1], Copy(0x3_0000_0000, cs[2].dst, cs[2].nbytes, KIND_D2H)], "staging"),
        (lambda cs: [cs[0], cs[1], Copy(cs[2].src + 3 * 4096, cs[2].dst, cs[2].nbytes, KIND_D2H)], "staging"),
        (lambda cs: [cs[0], cs[0], cs[2]], "gap or overlap"),
        (lambda cs: [cs[0], cs[1], Copy(cs[2].src, cs[2].dst, 4096, KIND_D2H)], "cover"),
        (lambda cs: [cs[0], cs[1], Copy(cs[2].src, cs[2].dst, 0, KIND_D2H)], "not inside the slot"),
    ],
)
def test_host_offsets_refuses_unexpected_nodes(change, match):
    with pytest.raises(NodeError, match=match):
        host_offsets(change(_save_copies()), "dst", BASE, SLOT, STAGE, 3)
    with pytest.raises(NodeError):  # and as a load: the host side is the other one
        host_offsets(_save_copies(), "src", BASE, SLOT, STAGE, 3)


def test_memcpy3d_parms_layout_matches_driver_types_h():
    P = cudaMemcpy3DParms
    # x86-64 / aarch64: void* and size_t are 8 bytes; cudaPos/cudaExtent 3 x 8, cudaPitchedPtr 4 x 8.
    assert ctypes.sizeof(P) == 8 + 24 + 32 + 8 + 24 + 32 + 24 + 8  # enum kind + tail padding
    offs = {name: getattr(P, name).offset for name, _ in P._fields_}
    assert offs == {
        "srcArray": 0, "srcPos": 8, "srcPtr": 32, "dstArray": 64, "dstPos": 72, "dstPtr": 96,
        "extent": 128, "kind": 152,
    }  # fmt: skip
    p = P()
    side = p.dstPtr  # graph_nodes keeps this view and writes the new host pointer through it
    side.ptr = 0x1234_5000
    assert p.dstPtr.ptr == 0x1234_5000 and p.srcPtr.ptr is None
    raw = bytes(p)
    assert int.from_bytes(raw[96:104], "little") == 0x1234_5000


def test_replay_miss_counts_and_leaves_the_job_to_the_eager_path():
    kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=0)
    g = StagedGraphs(kv, max_graphs=4)
    key = graph_key("save", 2, 3, 4, ())
    assert g.replay(key, torch.arange(3), stream=None, slot_ptr=0x2000) is False
    assert g.stats.misses == 1 and g.stats.replays == 0
    assert g.replay(key, torch.arange(3), stream=None, slot_ptr=0x1000) is False and g.stats.misses == 2
    g.enabled = False
    assert g.replay(key, torch.arange(3), stream=None, slot_ptr=0x2000) is False and g.stats.misses == 3


def test_id_check_duplicates_match_unique():
    check = IdCheck(num_blocks=1000, block_size=16)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 64, 999, 1000, 5000):
        for _ in range(20):
            ids = torch.randint(0, 1000, (n,), generator=gen)
            if torch.rand((), generator=gen) < 0.5 and n <= 1000:
                ids = torch.randperm(1000, generator=gen)[:n]
            want = len(torch.unique(ids)) != n
            assert check.has_duplicates(ids) == want, (n, ids[:10])
    for n in (2, 500, 1000):  # one repeat anywhere is found
        ids = torch.randperm(1000, generator=gen)[:n]
        ids[n - 1] = ids[0]
        assert check.has_duplicates(ids)
        assert check.has_duplicates(ids, int(ids.max()))  # the largest id given, as check() does
    assert check.scratch_clear  # the scratch is clear between calls


def test_id_check_errors():
    check = IdCheck(num_blocks=10, block_size=4)
    assert check([3, 1, 2], unique=True).tolist() == [3, 1, 2]
    assert check(torch.tensor([1, 1], dtype=torch.int32), unique=False).dtype == torch.int64
    for bad, match in [
        ([10], "out of range"),
        ([-1], "out of range"),
        ([], "non-empty"),
        (torch.zeros(2, 2, dtype=torch.int64), "1-D"),
        (torch.zeros(2), "1-D int32/int64"),
        (["a"], "sequence of ints"),
    ]:
        with pytest.raises(ValueError, match=match):
            check(bad, unique=False)
    with pytest.raises(ValueError, match="duplicate"):
        check([1, 2, 1], unique=True)
    with pytest.raises(ValueError, match="num_tokens"):
        check([1, 2], unique=True, num_tokens=4)  # two blocks of 4 hold 5..8 tokens
    assert check([1, 2], unique=True, num_tokens=5).tolist() == [1, 2]


@pytest.mark.parametrize("graphs", [True, False])
def test_graphs_option_is_ignored_on_sim(graphs):
    dev = SimDevice()
    kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=1)
    pool = PinnedPool(dev, 2 * kv.chunk_nbytes(3))
    eng = TransferEngine(dev, kv, pool, EngineConfig(sanitize=True, graphs=graphs, max_graphs=2))
    assert not hasattr(eng.mover, "graphs")  # SimMover: no graphs
    want = gather_ref(kv, [5, 1, 6], 10)
    save = eng.save([5, 1, 6], after=None, num_tokens=10)
    assert save.wait() and bits_equal(save.slot.view(kv.dtype, kv.chunk_shape(3)), want)
    eng.release(save.slot)
    eng.close()
    pool.close()
    dev.close()


@pytest.mark.parametrize(
    "kw",
    [
        {"graphs": 1},
        {"graphs": None},
        {"max_graphs": 0},
        {"max_graphs": True},
        {"graph_execs": 0},
        {"graph_execs": 2.0},
        {"uva_ctas": 0},
        {"uva_ctas": True},
        {"staging_bytes": 1},
        {"staging_bytes": 2.0**30},
    ],
)
def test_graphs_options_checked(kw):
    dev = SimDevice()
    kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=1)
    pool = PinnedPool(dev, 2 * kv.chunk_nbytes(3))
    with pytest.raises(ValueError, match=next(iter(kw))):
        TransferEngine(dev, kv, pool, EngineConfig(**kw))
    with pytest.raises(ValueError, match="kv: expected a PagedKV"):
        TransferEngine(dev, kv.layers[0], pool)
    other = SimDevice()
    with pytest.raises(ValueError, match="pool: must be a PinnedPool of the same device"):
        TransferEngine(other, kv, pool)
    other.close()
    pool.close()
    dev.close()


class _FakeGraph:
    """A torch CUDAGraph's handles; its nodes live in a _FakeRuntime."""

    def raw_cuda_graph(self):
        return 0x6000

    def raw_cuda_graph_exec(self):
        return 0xE000


class _FakeRuntime:
    """The four graph calls of graph_nodes, on Python data (byref arguments expose `_obj`)."""

    def __init__(self, copies, pos_x=0, fail_set=False):
        # A kernel node first, then the memcpys: only memcpy nodes are read.
        self.nodes = {0x10: None} | {0x20 + i: c for i, c in enumerate(copies)}
        self.pos_x, self.fail_set, self.sets = pos_x, fail_set, []

    def get_nodes(self, g, arr, pcount):
        assert g == 0x6000
        if arr is None:
            pcount._obj.value = len(self.nodes)
        else:
            for i, h in enumerate(self.nodes):
                arr[i] = h
        return 0

    def node_type(self, h, pt):
        pt._obj.value = 0 if self.nodes[h] is None else 1
        return 0

    def get_params(self, h, pp):
        c, p = self.nodes[h], pp._obj
        x = self.pos_x  # the driver may report a pointer plus an x position: the sum is the address
        p.srcPtr.ptr, p.srcPos.x = c.src - x, x
        p.dstPtr.ptr, p.dstPos.x = c.dst - x, x
        p.srcPtr.pitch = p.dstPtr.pitch = p.srcPtr.xsize = p.dstPtr.xsize = c.nbytes
        p.srcPtr.ysize = p.dstPtr.ysize = 1
        p.extent.width, p.extent.height, p.extent.depth = c.nbytes, 1, 1
        p.kind = c.kind
        return 0

    def exec_set(self, ex, h, pp):
        p = pp._obj
        self.sets.append((ex.value, h.value, p.srcPtr.ptr, p.dstPtr.ptr + p.dstPos.x, p.extent.width))
        return 700 if self.fail_set else 0


@pytest.mark.parametrize("pos_x", [0, 64])
def test_slot_nodes_move_the_host_side_only(pos_x):
    from kvtier.engine.fastpath import graph_nodes

    rt = _FakeRuntime(_save_copies(), pos_x=pos_x)
    nodes = graph_nodes.SlotNodes.find(_FakeGraph(), "dst", BASE, SLOT, STAGE, 3, api=rt)
    assert nodes.base == BASE and rt.sets == []
    new = 0x7F00_0040_0000
    nodes.retarget(new)
    assert nodes.base == new
    # Every memcpy node of the exec, device side as captured, host side at the new slot + its offset.
    want = [
        (0xE000, 0x20 + i, c.src - pos_x, new + (c.dst - BASE), c.nbytes)
        for i, c in enumerate(_save_copies())
    ]
    assert rt.sets == want
    rt.sets.clear()
    nodes.retarget(BASE)  # and back
    assert [s[3] for s in rt.sets] == [c.dst for c in _save_copies()]


def test_slot_nodes_refuse_or_fail_loudly():
    from kvtier.engine.fastpath import graph_nodes

    rt = _FakeRuntime(_save_copies()[:2])  # a chunk missing: not the expected graph
    with pytest.raises(NodeError, match="2 memcpy nodes"):
        graph_nodes.SlotNodes.find(_FakeGraph(), "dst", BASE, SLOT, STAGE, 3, api=rt)
    rt = _FakeRuntime(_save_copies(), fail_set=True)
    nodes = graph_nodes.SlotNodes.find(_FakeGraph(), "dst", BASE, SLOT, STAGE, 3, api=rt)
    with pytest.raises(NodeError, match="cudaGraphExecMemcpyNodeSetParams"):
        nodes.retarget(BASE + SLOT)
    assert nodes.base is None  # half-updated: the caller drops the graph, never replays it
