"""Per-layer "landed" flags on CUDA: one CUDA graph of a stand-in forward (per layer: the flag
wait, then a read of that layer of the request's blocks), captured once, replayed in steps with
loads on every path and in steps without; bit for bit, poisoned first. Skipped without a GPU; the
CPU versions of the protocol are in test_engine_flags.py and test_flag_bugs.py."""

import pytest
import torch
from test_engine_gpu import make, need

from kvtier.engine.flags import LANDED

pytestmark = pytest.mark.gpu

SRC, DST = [9, 2, 40, 7, 0, 33, 5, 12], [1, 3, 4, 6, 8, 10, 11, 13]


class Forward:
    """Per layer: wait for the layer's flag, then copy the layer of DST into `out` (vllm_flash:
    a layer is (2, blocks, block_size, heads, dim)). Captured as one CUDA graph."""

    def __init__(self, kv, flags, waits=True):
        self.kv, self.flags, self.waits = kv, flags, waits
        self.idx = torch.tensor(DST, device="cuda")
        self.out = [torch.empty_like(t[:, : len(DST)]) for t in kv.layers]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.run()  # warm-up on a side stream, as torch asks
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.run()

    def run(self):
        for layer, t in enumerate(self.kv.layers):
            if self.waits:
                self.flags.wait(layer)  # on the capturing stream: a node of the graph
            self.out[layer].copy_(t.index_select(1, self.idx))

    def replay(self):
        self.graph.replay()


def warm(dev, eng, flags, fwd, slot):
    """One step in the usual order (loads, then the forward): every kernel the load path launches is
    loaded before a forward may block on flags ahead of a load (lazy module loading synchronizes)."""
    with flags.arm(dev.current_stream()) as step:
        eng.load(slot, DST, flags=step)
    fwd.replay()
    torch.cuda.synchronize()


def exact(fwd, want):
    return all(
        torch.equal(o.view(torch.uint8), w.view(torch.uint8)) for o, w in zip(fwd.out, want, strict=True)
    )


def want_of(kv):
    idx = torch.tensor(SRC, device="cuda")
    return [t.index_select(1, idx).clone() for t in kv.layers]


def poison(kv, fwd):
    idx = torch.tensor(DST, device="cuda")
    for t in kv.layers:
        t.index_fill_(1, idx, float("nan"))
    for o in fwd.out:
        o.fill_(-1)


@pytest.mark.parametrize("path", ["kernel", "staged", "batch"])
@pytest.mark.parametrize("api", ["load", "load_slots"])
def test_one_graph_replays_steps_with_and_without_loads(path, api):
    need(path)
    dev, kv, pool, eng = make(layers=8, blocks=64, slots=8, n=4, compute_beside=False)
    flags = eng.layer_flags()
    want = want_of(kv)
    saves = [eng.save(SRC[:4], after=None, path=path), eng.save(SRC[4:], after=None, path=path)]
    assert all(j.wait() for j in saves)
    fwd = Forward(kv, flags)  # captured once, before any load
    compute = dev.current_stream()
    for _ in range(3):
        poison(kv, fwd)
        torch.cuda.synchronize()
        with flags.arm(compute) as step:
            if api == "load":
                jobs = [
                    eng.load(s.slot, d, path=path, flags=step)
                    for s, d in zip(saves, (DST[:4], DST[4:]), strict=True)
                ]
            else:
                jobs = eng.load_slots([s.slot for s in saves], DST, path=path, flags=step)
        fwd.replay()  # each layer's read waits for that layer of both loads
        torch.cuda.synchronize()
        assert exact(fwd, want)
        assert all(j.wait() for j in jobs)
        for o in fwd.out:
            o.fill_(-1)
        fwd.replay()  # a step without loads: the flags are set, the same graph runs through
        torch.cuda.synchronize()
        assert exact(fwd, want)
    assert flags.words.read()[: kv.num_layers] == [LANDED] * kv.num_layers
    eng.close()
    pool.close()


def test_the_graph_waits_for_a_load_submitted_after_its_launch():
    """The forward is launched first and the load submitted after it (a load submitted off the
    forward's thread): the graph's waits hold each layer's read until the layer landed."""
    dev, kv, pool, eng = make(layers=8, blocks=64, slots=4, n=8, compute_beside=False)
    flags = eng.layer_flags()
    want = want_of(kv)
    save = eng.save(SRC, after=None)
    assert save.wait()
    fwd = Forward(kv, flags)
    warm(dev, eng, flags, fwd, save.slot)
    poison(kv, fwd)
    torch.cuda.synchronize()
    step = flags.arm(dev.current_stream())
    fwd.replay()  # queued behind the re-arm: waits for flags nobody has set yet
    job = eng.load(save.slot, DST, flags=step)
    step.seal()
    torch.cuda.synchronize()
    assert exact(fwd, want)
    assert job.wait()
    eng.close()
    pool.close()


def test_a_failed_load_after_the_launch_never_blocks_the_graph(monkeypatch):
    dev, kv, pool, eng = make(layers=8, blocks=64, slots=4, n=8, compute_beside=False)
    flags = eng.layer_flags()
    save = eng.save(SRC, after=None)
    assert save.wait()
    fwd = Forward(kv, flags)
    warm(dev, eng, flags, fwd, save.slot)
    real = eng.mover.load

    def broken(path, ids, slot, stream, per_layer, label, done=None, mark=None):
        def failing(i):
            mark(i)
            if i == 2:
                raise RuntimeError("injected submit failure")

        return real(path, ids, slot, stream, per_layer, label, done, failing)

    monkeypatch.setattr(eng.mover, "load", broken)
    with pytest.raises(RuntimeError, match="injected"), flags.arm(dev.current_stream()) as step:
        fwd.replay()
        eng.load(save.slot, DST, flags=step)
    end = dev.current_stream().record()
    assert end.synchronize(timeout=30)  # every flag was set: the forward ran to its end
    eng.close()
    pool.close()
