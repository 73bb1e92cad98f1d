"""The pure-Python parts of the staged path's CUDA graphs (engine/graphs.py) and the vectorized
id checks (engine/ids.py). The graphs themselves: tests/test_engine_graphs_gpu.py."""

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import TransferEngine
from kvtier.engine.graphs import LRU, StagedGraphs, graph_key
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
    base = ("save", 0x1000, 4096, 8, 16, (1, 2))
    keys = {graph_key(*base)}
    for i, other in enumerate(["load", 0x2000, 8192, 9, 5, (3, 4)]):
        k = list(base)
        k[i] = other
        keys.add(graph_key(*k))
    assert len(keys) == 7  # each field alone makes another graph
    assert graph_key(*base) == graph_key(*base)  # and equal inputs hit the same one


def test_replay_miss_counts_and_leaves_the_job_to_the_eager_path():
    kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=0)
    g = StagedGraphs(kv, max_graphs=4)
    key = graph_key("save", 1, 2, 3, 4, ())
    assert g.replay(key, torch.arange(3), stream=None) is False
    assert g.stats.misses == 1 and g.stats.replays == 0
    g.enabled = False
    assert g.replay(key, torch.arange(3), stream=None) is False and g.stats.misses == 2


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
    eng = TransferEngine(dev, kv, pool, sanitize=True, graphs=graphs, max_graphs=2)
    assert not hasattr(eng.mover, "graphs")  # SimMover: no graphs
    want = gather_ref(kv, [5, 1, 6], 10)
    save = eng.save([5, 1, 6], after=None, num_tokens=10)
    assert save.wait() and bits_equal(save.slot.view(kv.dtype, kv.chunk_shape(3)), want)
    eng.release(save.slot)
    eng.close()
    pool.close()
    dev.close()


@pytest.mark.parametrize("kw", [{"graphs": 1}, {"graphs": None}, {"max_graphs": 0}, {"max_graphs": True}])
def test_graphs_options_checked(kw):
    dev = SimDevice()
    kv = random_cache("vllm_flash", 2, 8, 4, 2, 8, torch.bfloat16, seed=1)
    pool = PinnedPool(dev, 2 * kv.chunk_nbytes(3))
    with pytest.raises(ValueError, match=next(iter(kw))):
        TransferEngine(dev, kv, pool, **kw)
    pool.close()
    dev.close()
