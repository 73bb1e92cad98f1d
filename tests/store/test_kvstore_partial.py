"""KVStore.load from the middle of a chunk (``first_block``: the serving engine's own cache holds
the chunk's first blocks), on every load path, and the eviction hook (``on_evict``)."""

import pytest
import torch

from kvtier.reference import bits_equal, gather_ref

from test_kvstore import BPC, BS, CT, Rig, expected, toks


def _blocks_hold(rig, blocks, tokens, first_chunk, first_block) -> bool:
    """``blocks`` hold the chunks of ``tokens`` from block ``first_block`` of ``first_chunk`` on."""
    n = len(tokens) // CT
    want = expected(tuple(tokens), n).view(n * BPC, -1)[first_chunk * BPC + first_block :]
    got = gather_ref(rig.kv, list(blocks)).view(torch.uint8).view(len(blocks), -1)
    return bits_equal(got, want)


@pytest.mark.parametrize("path,per_layer", [(None, True), ("kernel", True), ("staged", False), (None, False)])
@pytest.mark.parametrize("first_chunk", [0, 1])
def test_a_load_from_inside_a_chunk_writes_only_the_blocks_past_it(path, per_layer, first_chunk):
    rig = Rig()
    try:
        tokens = toks(11, 3 * CT + 1)
        assert rig.store.save(tokens, range(3 * BPC), after=rig.write(tokens, range(3 * BPC))).wait(5)
        chunks = 3 - first_chunk
        dst = list(range(40, 40 + chunks * BPC - 1))  # the first block of chunk first_chunk is vLLM's
        rig.poison(range(39, 40 + chunks * BPC))
        before = rig.kv.layers[0][:, 39].clone()
        h = rig.store.load(
            tokens, dst, first_chunk=first_chunk, first_block=1, path=path, per_layer=per_layer
        )
        assert h.tokens == chunks * CT - BS and len(h.jobs) == chunks and h.wait(5)
        assert _blocks_hold(rig, dst, tokens, first_chunk, 1)
        assert torch.equal(rig.kv.layers[0][:, 39], before)  # the block before was not written
    finally:
        rig.close()


def test_a_load_from_inside_a_missing_chunk_loads_nothing():
    rig = Rig()
    try:
        tokens = toks(12, 2 * CT)
        h = rig.store.load(tokens, range(40, 43), first_block=1)
        assert h.tokens == 0 and h.jobs == [] and h.tiers == ()
    finally:
        rig.close()


def test_first_block_must_lie_inside_a_chunk():
    rig = Rig()
    try:
        tokens = toks(13, 2 * CT)
        for bad in (-1, BPC, True, 1.0):
            with pytest.raises(ValueError, match="first_block"):
                rig.store.load(tokens, range(40, 43), first_block=bad)
        with pytest.raises(ValueError, match="first_block"):
            rig.store.load(tokens, range(40, 43), first_chunk=2, first_block=1)
    finally:
        rig.close()


def test_on_evict_hears_every_chunk_the_host_drops():
    gone: list[bytes] = []
    rig = Rig(pool_chunks=8, on_evict=gone.extend)  # the host index: 6 chunks
    try:
        a, b = toks(14, 4 * CT), toks(15, 4 * CT)
        assert rig.store.save(a, range(8), after=rig.write(a, range(8))).wait(5)
        assert gone == []
        assert rig.store.save(b, range(8, 16), after=rig.write(b, range(8, 16))).wait(5)
        ka, kb = rig.store.keys(a), rig.store.keys(b)
        assert gone == ka[:2]  # the host made room for b's last chunks: a's oldest went
        rig.store.evict(b[:CT])
        assert gone[2:] == kb[:1]
    finally:
        rig.close()
