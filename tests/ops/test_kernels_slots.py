"""scatter_slots (ops/slots.py): several chunks, each anywhere in memory, into one request's blocks,
one launch per layer range; bit for bit the reference scatter of each chunk, blocks outside the
call untouched, poisoned first. Interpreter on the CPU; on a GPU the chunks are pinned host memory
from separate allocations (as a PinnedPool's slab buffers are)."""

import pytest
import torch

from kvtier import ops
from kvtier.ops.slots import scatter_slots, slot_sources
from kvtier.reference import FORMATS, poison_, random_cache, scatter_ref, snapshot

if not ops.INTERPRETING and not torch.cuda.is_available():
    pytest.skip("kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cpu" if ops.INTERPRETING else "cuda"


def host_chunk(kv, n, seed):
    """A random chunk of n blocks in its own allocation (pinned on a GPU machine), not aligned to
    more than 16 bytes past its start when offset."""
    g = torch.Generator().manual_seed(seed)
    nb = kv.chunk_nbytes(n)
    pad = 16 * seed % 64  # chunks at different alignments inside their allocation
    buf = torch.empty(nb + 64, dtype=torch.uint8, pin_memory=DEV == "cuda")
    t = buf[pad : pad + nb]
    t.copy_(torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g))
    return t


def expect(kv, before, ids, chunks, counts, num_tokens, layers):
    """The reference: each chunk scattered into its ids, in order, only layers in range."""
    got = snapshot(kv)
    for x, b in zip(kv.layers, before, strict=True):
        x.view(b.dtype).copy_(b)
    at = 0
    lo, cnt = layers or (0, kv.num_layers)
    for j, (c, n) in enumerate(zip(chunks, counts, strict=True)):
        last = j == len(chunks) - 1
        tokens = None if num_tokens is None or not last else num_tokens - at * kv.block_size
        full = c.view(kv.dtype).view(kv.chunk_shape(n))
        for layer in range(lo, lo + cnt):
            one = _layer(kv, layer)
            scatter_ref(one, ids[at : at + n], full[:, layer : layer + 1].contiguous(), tokens)
        at += n
    return got, snapshot(kv)


def _layer(kv, layer):
    from kvtier.engine.movers import layer_kv

    return layer_kv(kv, layer)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layers", [None, (1, 1), (0, 2)])
def test_scatter_slots_equals_the_reference_chunk_by_chunk(fmt, layers):
    kv = random_cache(fmt, 3, 24, 8, 2, 64, torch.bfloat16, DEV, seed=7)
    counts = [2, 3, 1]
    chunks = [host_chunk(kv, n, seed=j + 1) for j, n in enumerate(counts)]
    ids = [20, 3, 11, 0, 7, 15]
    num_tokens = 5 * 8 + 5  # the last block half full
    for x in kv.layers:
        poison_(x)
    before = snapshot(kv)
    src = slot_sources(kv, ids, chunks, num_tokens=num_tokens)
    for layer in range(kv.num_layers) if layers == (1, 1) else [None]:
        scatter_slots(kv, src, max_ctas=3, layers=(layer, 1) if layer is not None else layers)
    if DEV == "cuda":
        torch.cuda.synchronize()
    got, want = expect(kv, before, ids, chunks, counts, num_tokens,
                       None if layers == (1, 1) else layers)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_slot_sources_checks_its_arguments():
    kv = random_cache("vllm_flash", 2, 8, 4, 1, 64, torch.float32, DEV, seed=1)
    a = host_chunk(kv, 2, 1)
    with pytest.raises(ValueError, match="chunks"):
        slot_sources(kv, [0, 1], [])
    with pytest.raises(ValueError, match=r"chunks\[1\]"):
        slot_sources(kv, [0, 1, 2], [a, a[:-4]])
    with pytest.raises(ValueError, match="block_ids: 3 ids"):
        slot_sources(kv, [0, 1, 2], [a])
    with pytest.raises(ValueError, match="duplicate"):
        slot_sources(kv, [1, 1], [a])
    with pytest.raises(ValueError, match="src"):
        scatter_slots(kv, "not sources")
    with pytest.raises(ValueError, match="layers"):
        scatter_slots(kv, slot_sources(kv, [0, 1], [a]), layers=(2, 1))


@pytest.mark.skipif(DEV != "cuda", reason="streams exist on CUDA only")
def test_scatter_slots_refuses_another_stream_and_reuses_its_launch():
    kv = random_cache("vllm_flash", 2, 8, 4, 1, 64, torch.float32, DEV, seed=1)
    src = slot_sources(kv, [0, 1], [host_chunk(kv, 2, 1)])
    for layer in range(kv.num_layers):
        scatter_slots(kv, src, layers=(layer, 1))
    assert len(src.runs) == 1  # planned once, launched per layer
    other = torch.cuda.Stream()
    with torch.cuda.stream(other), pytest.raises(ValueError, match="stream slot_sources ran on"):
        scatter_slots(kv, src, layers=(0, 1))
    torch.cuda.synchronize()
