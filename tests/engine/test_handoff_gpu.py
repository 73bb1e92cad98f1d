"""Handoff between two real GPUs (skipped below two): bytes, route, and the protocol under load."""

import pytest
import torch

from kvtier.reference import FORMATS, bits_equal, gather_ref, random_cache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

L, NB, BS, H, D = 4, 64, 16, 8, 128


def caches(fmt, seed_a, seed_b):
    """Random caches on GPU 0 and GPU 1, landed: `random_cache` writes them on each device's
    current stream, which the handoff's streams do not wait for (a job's `after=None` says no
    compute write is pending), so the test waits for the writes itself -- else a gather may read
    a block, or the fill overwrite a scattered one, before the fill ran (seen under racecheck,
    whose slow kernels made the 67-token round trip fail)."""
    ka = random_cache(fmt, L, NB, BS, H, D, torch.bfloat16, device="cuda:0", seed=seed_a)
    kb = random_cache(fmt, L, NB, BS, H, D, torch.bfloat16, device="cuda:1", seed=seed_b)
    torch.cuda.synchronize(0)  # the fills must land before any handoff stream touches the blocks
    torch.cuda.synchronize(1)
    return ka, kb


@pytest.fixture
def two():
    from kvtier.device import CudaDevice

    a, b = CudaDevice(0), CudaDevice(1)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [None, 16 * 4 + 3])
def test_round_trip(two, fmt, num_tokens):
    from kvtier.engine import handoff

    a, b = two
    ka, kb = caches(fmt, 1, 2)
    src, dst = [3, 9, 9, 40, 63], [0, 1, 2, 50, 7]
    job = handoff(
        ka, src, kb, dst, after=None, src_device=a, dst_device=b, num_tokens=num_tokens, sanitize=True
    )
    assert job.route == ("p2p" if torch.cuda.can_device_access_peer(0, 1) else "host")
    assert job.wait(timeout=30)
    got = gather_ref(kb, dst, num_tokens).cpu()
    assert bits_equal(got, gather_ref(ka, src, num_tokens).cpu())


@pytest.mark.parametrize("pieces", [1, 3])  # blocks per piece: gathers, copies, scatters overlap
def test_pieces_round_trip(two, pieces):
    from kvtier.engine import Handoff

    a, b = two
    ka, kb = caches("vllm_flash", 1, 2)
    src, dst = torch.randperm(NB)[:20], torch.randperm(NB)[:20]
    h = Handoff(ka, kb, src_device=a, dst_device=b, sanitize=True, piece_bytes=pieces * ka.block_nbytes)
    job = h.send(src, dst, after=None, num_tokens=19 * BS + 5)
    assert job.wait(timeout=30)
    want = gather_ref(ka, src, 19 * BS + 5).cpu()
    assert bits_equal(gather_ref(kb, dst, 19 * BS + 5).cpu(), want)
    h.close()


@pytest.mark.parametrize("late", ["send", "copy", "recv"])
def test_pieces_ordering_under_delays(two, late):
    """One stream of the handoff held back ~10 ms: its consumers must wait (stale or poisoned
    bytes otherwise), whichever stage is late."""
    from kvtier.engine import Handoff

    a, b = two
    ka, kb = caches("vllm_flash", 3, 4)
    for x in kb.layers:
        x.fill_(float("nan"))  # poison: a scatter that ran early leaves NaN or stale bytes
    torch.cuda.synchronize(1)
    h = Handoff(ka, kb, src_device=a, dst_device=b, sanitize=True, piece_bytes=2 * ka.block_nbytes)
    stream = {"send": h.send_stream, "copy": h.copy_stream, "recv": h.recv_stream}[late]
    with torch.cuda.stream(stream.raw):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before this stage's work
    src, dst = torch.randperm(NB)[:9], torch.randperm(NB)[:9]
    job = h.send(src, dst, after=None)
    for layer, ev in enumerate(job.layer_events):
        assert ev.synchronize(timeout=30)
        got = kb.block_view(layer)[:, dst].cpu()
        assert bits_equal(got, ka.block_view(layer)[:, src].cpu())  # layer l complete after its event
    h.close()


def test_decode_on_b_waits_per_layer(two):
    """Compute on b waits each layer's event, then reads; a overwrites the source after e_sent."""
    from kvtier.engine import Handoff
    from kvtier.lifecycle import Access

    a, b = two
    ka, kb = caches("vllm_flash", 1, 2)
    want = gather_ref(ka, range(32)).cpu()
    h = Handoff(ka, kb, src_device=a, dst_device=b, sanitize=True)
    job = h.send(range(32), range(32, 64), after=a.current_stream().record())
    cb = b.current_stream()
    outs = []
    for layer, ev in enumerate(job.layer_events):
        cb.wait_event(ev)  # attention of layer l must not read it before it landed on b
        with torch.cuda.stream(cb.raw):
            outs.append(kb.block_view(layer)[:, 32:64].clone())
    h.dst.blocks.compute_read(range(32, 64), cb.record(), waited=job.layer_events)
    ca = a.current_stream()
    waits = h.src.blocks.waits_for(Access.WRITE, range(32))
    for e in waits:
        ca.wait_event(e)  # the next prefill must not overwrite blocks the peer copy still reads
    with torch.cuda.stream(ca.raw):
        for x in ka.layers:
            x.zero_()
    h.src.blocks.compute_write(range(32), ca.record(), waited=waits)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for layer, out in enumerate(outs):
        assert bits_equal(out.transpose(0, 1).cpu(), want[:, layer])
