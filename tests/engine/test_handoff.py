"""GPU-to-GPU handoff on two SimDevices: the bytes (every layout, partial last block, per-layer
events) and the arguments. Copies land late for real, with the sanitizer on."""

import pytest
import torch

from kvtier.device import SimDevice
from kvtier.engine import EngineConfig, Handoff, TransferEngine, handoff
from kvtier.engine.handoff import Side, side
from kvtier.lifecycle import BlockTracker
from kvtier.pool import PinnedPool
from kvtier.reference import FORMATS, bits_equal, gather_ref, random_cache

L, NB, BS, H, D = 3, 10, 4, 2, 8


@pytest.fixture
def devs():
    a, b = SimDevice(copy_delay=0.02, launch_delay=0.002), SimDevice(copy_delay=0.01)
    yield a, b
    a.close()
    b.close()


def caches(fmt_a, fmt_b, dtype=torch.bfloat16):
    return random_cache(fmt_a, L, NB, BS, H, D, dtype, seed=1), random_cache(
        fmt_b, L, NB, BS, H, D, dtype, seed=2
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [None, 9])  # 9 tokens in 3 blocks of 4: the last holds 1
def test_round_trip_every_layout(devs, fmt, num_tokens):
    a, b = devs
    ka, kb = caches(fmt, fmt)
    before = gather_ref(kb, [7, 1, 4])
    job = handoff(ka, [2, 5, 5], kb, [7, 1, 4], after=None, src_device=a, dst_device=b,
                  num_tokens=num_tokens, sanitize=True)  # fmt: skip
    assert job.wait(timeout=10)
    assert job.route == "sim" and job.nbytes == ka.chunk_nbytes(3)
    assert bits_equal(gather_ref(kb, [7, 1, 4], num_tokens), gather_ref(ka, [2, 5, 5], num_tokens))
    if num_tokens is not None:  # dst tokens past num_tokens in the last block are left as they were
        after = gather_ref(kb, [7, 1, 4])
        tail = kb.block_size - 1
        axis = 2 + kb.token_dim
        assert bits_equal(after[2].narrow(axis, 1, tail), before[2].narrow(axis, 1, tail))


@pytest.mark.parametrize("pieces", [1, 2, 3])  # one block per piece .. several blocks per piece
@pytest.mark.parametrize("num_tokens", [None, 4 * 6 + 3])  # 27 tokens in 7 blocks: the last holds 3
@pytest.mark.parametrize("group", [1, 2, 4])  # layers per scatter of the last piece (L = 3)
def test_pieces_pipeline(devs, pieces, num_tokens, group):
    """Several pieces: gather k+1 beside copy k; the last piece layer by layer; every byte lands."""
    a, b = devs
    ka, kb = caches("vllm_flash", "vllm_flash")
    src, dst = [9, 0, 3, 3, 7, 1, 5], [2, 8, 6, 0, 4, 9, 1]
    h = Handoff(ka, kb, src_device=a, dst_device=b, sanitize=True, piece_bytes=pieces * ka.block_nbytes,
                layer_group=group)  # fmt: skip
    assert len(h.pieces(len(src), num_tokens)) == -(-len(src) // pieces)
    assert {h.send_stream, h.copy_stream} <= set(a.streams()) and {h.recv_stream, h.land_stream} <= set(
        b.streams()
    )
    job = h.send(src, dst, after=None, num_tokens=num_tokens)
    for layer, ev in enumerate(job.layer_events):
        assert ev.synchronize(timeout=10)  # layer l of every piece is readable after its event
        assert bits_equal(
            gather_ref(kb, dst, num_tokens)[:, layer], gather_ref(ka, src, num_tokens)[:, layer]
        )
    assert job.wait(timeout=10) and job.sent.query()
    h.close()


def test_pieces_copy_waits_for_its_gather():
    """Slow gathers, instant copies: a copy that did not wait its piece's gather sends stale bytes."""
    a, b = SimDevice(launch_delay=0.03), SimDevice()
    ka, kb = caches("vllm_flash", "vllm_flash")
    h = Handoff(ka, kb, src_device=a, dst_device=b, sanitize=True, piece_bytes=ka.block_nbytes)
    job = h.send([1, 2, 3], [4, 5, 6], after=None)
    assert job.wait(timeout=10)
    assert bits_equal(gather_ref(kb, [4, 5, 6]), gather_ref(ka, [1, 2, 3]))
    h.close()
    a.close()
    b.close()


@pytest.mark.parametrize("pair", [("vllm_flash", "flashinfer_nhd"), ("vllm_hnd_memory", "flashinfer_hnd")])
def test_between_layouts(devs, pair):
    a, b = devs
    ka, kb = caches(*pair, dtype=torch.float16)
    job = Handoff(ka, kb, src_device=a, dst_device=b, sanitize=True).send(range(4), [9, 8, 0, 3], after=None)
    job.wait()
    assert bits_equal(gather_ref(kb, [9, 8, 0, 3]), gather_ref(ka, range(4)))


def test_per_layer_events_complete_in_order(devs):
    a, b = devs
    ka, kb = caches("vllm_flash", "vllm_flash")
    job = Handoff(ka, kb, src_device=a, dst_device=b, sanitize=True).send([1, 2], [3, 4], after=None)
    assert len(job.layer_events) == L and job.layer_events[-1] is job.event
    for layer, ev in enumerate(job.layer_events):
        assert ev.synchronize(timeout=10)
        one = kb.block_view(layer)[:, [3, 4]]
        assert bits_equal(one, ka.block_view(layer)[:, [1, 2]])  # layer l is readable after its event
    assert job.sent.query()  # b waited e_sent before scattering


def test_one_device_two_caches():
    with SimDevice(copy_delay=0.01) as dev:
        ka, kb = caches("vllm_flash", "vllm_flash")
        h = Handoff(ka, kb, src_device=dev, dst_device=dev, sanitize=True)
        job = h.send([0, 1], [5, 6], after=None, per_layer=False)
        assert job.route == "same-device" and h.recv_stream is h.send_stream
        job.wait()
        assert bits_equal(gather_ref(kb, [5, 6]), gather_ref(ka, [0, 1]))


def test_engines_share_their_trackers(devs):
    a, b = devs
    ka, kb = caches("vllm_flash", "vllm_flash")
    ea = TransferEngine(
        a,
        ka,
        PinnedPool(a, 4 * ka.chunk_nbytes(2)),
        EngineConfig(sanitize=True, staging_bytes=4 * ka.block_nbytes),
    )
    eb = TransferEngine(
        b,
        kb,
        PinnedPool(b, 4 * kb.chunk_nbytes(2)),
        EngineConfig(sanitize=True, staging_bytes=4 * kb.block_nbytes),
    )
    h = Handoff(ea, eb)
    assert h.src.blocks is ea.blocks and h.dst.blocks is eb.blocks
    job = h.send([1, 2], [3, 4], after=None)
    assert eb.blocks.state(3) == "LOADING" or job.event.query()
    save = ea.save([1, 2], after=None)  # the save of a reads the same blocks: no conflict
    job.wait()
    ea.wait(save)
    assert bits_equal(gather_ref(kb, [3, 4]), gather_ref(ka, [1, 2]))
    ea.close()
    eb.close()


def test_arguments(devs):
    a, b = devs
    ka, kb = caches("vllm_flash", "vllm_flash")
    with pytest.raises(ValueError, match="device: needed"):
        Handoff(ka, kb)
    with pytest.raises(ValueError, match="expected a TransferEngine"):
        Handoff(object(), kb, dst_device=b)
    other = random_cache("vllm_flash", L, NB, BS, H, 2 * D, torch.bfloat16)
    with pytest.raises(ValueError, match="copies blocks as they are"):
        Handoff(ka, other, src_device=a, dst_device=b)
    hnd = random_cache("flashinfer_hnd", L, NB, BS, H, D, torch.bfloat16)
    with pytest.raises(ValueError, match="copies blocks as they are"):  # token-major vs head-major chunk
        Handoff(ka, hnd, src_device=a, dst_device=b)
    with pytest.raises(ValueError, match="piece_bytes"):
        Handoff(ka, kb, src_device=a, dst_device=b, piece_bytes=0)
    with pytest.raises(ValueError, match="layer_group"):
        Handoff(ka, kb, src_device=a, dst_device=b, layer_group=0)
    h = Handoff(ka, kb, src_device=a, dst_device=b)
    with pytest.raises(ValueError, match="dst_blocks: 1 ids for 2"):
        h.send([1, 2], [3], after=None)
    with pytest.raises(ValueError):
        h.send([1, 2], [3, 3], after=None)  # two writes into one block would race
    with pytest.raises(ValueError):
        h.send([1, NB], [3, 4], after=None)
    assert isinstance(side(Side(a, ka, BlockTracker())), Side)
    h.close()


def test_a_failed_send_lets_what_it_enqueued_land_before_it_raises(devs, monkeypatch):
    """A send whose scatter step raised after part of the job was enqueued: when the error reaches
    the caller nothing of it is in flight (no late write into b's blocks, no read of a's)."""
    import time

    a, b = devs
    ka, kb = caches("vllm_flash", "vllm_flash")
    h = Handoff(ka, kb, src_device=a, dst_device=b, sanitize=True)
    landed = []
    plain = b.launch  # on b only the scatter step launches work (its waits, then its scatters)

    def broken(fn, stream):
        plain(lambda: (time.sleep(0.05), landed.append(True)), stream)  # a late scatter
        raise RuntimeError("boom")

    monkeypatch.setattr(b, "launch", broken)
    with pytest.raises(RuntimeError, match="boom"):
        h.send([1, 2], [3, 4], after=None)
    assert landed == [True]
