"""The decode batch stand-in (`kvtier.bench.decode_batch`): its paged attention reads each
sequence's context through the block table, in every vLLM 0.33 order, as plain torch does."""

from __future__ import annotations

import pytest
import torch

from kvtier.bench.decode_batch import DecodeBatch, reference_attention

L, B, H, N, D = 2, 24, 2, 4, 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel compiled on a GPU, interpreted on a CPU


def _cache(order: str) -> torch.Tensor:
    sizes = dict(L=L, B=B, H=H, N=N, C=2 * D)
    buf = torch.randn([sizes[a] for a in order]).to(torch.float16).to(DEV)
    return buf.permute(*[order.index(a) for a in "LBHNC"])  # logical [L, B, H, N, C]


@pytest.mark.parametrize("order", ["LBHNC", "BLHNC", "LHBNC"])
def test_paged_attention_equals_torch_over_each_context(order):
    cache = _cache(order)
    g = torch.Generator().manual_seed(1)
    tables = torch.randperm(B, generator=g)[:18].view(3, 6).to(torch.int32).to(DEV)  # 3 sequences, 6 blocks
    lengths = torch.tensor([24, 7, 13], dtype=torch.int32, device=DEV)  # full, partial first block, mid-block
    batch = DecodeBatch(cache, tables, lengths, hidden=64, mlp=32, q_heads=4, blocks_per_iter=4)
    q = torch.randn(3, 4, D).to(torch.float16).to(DEV)
    for layer in range(L):
        batch.attn.fill_(float("nan"))  # poisoned: every head of every sequence must be written
        batch.attend(layer, q)
        want = reference_attention(cache, tables, lengths, q, layer)
        torch.testing.assert_close(batch.attn.float().cpu(), want, atol=2e-3, rtol=2e-3)


def test_a_step_reads_no_block_outside_the_tables():
    cache = _cache("LBHNC")
    tables = torch.tensor([[3, 5], [7, 1]], dtype=torch.int32, device=DEV)
    lengths = torch.tensor([8, 5], dtype=torch.int32, device=DEV)
    batch = DecodeBatch(cache, tables, lengths, hidden=64, mlp=32, q_heads=4)
    batch.step()
    before = batch.out.clone()
    outside = [b for b in range(B) if b not in (3, 5, 7, 1)]
    cache[:, outside] = float("nan")  # blocks no sequence holds: a read of one would spread NaN
    cache[:, 1, :, 1:] = float("nan")  # past sequence 1's length (5 tokens: block 7 and one of 1)
    batch.step()
    assert torch.equal(batch.out, before)
    assert batch.kv_bytes == 13 * L * H * 2 * D * 2


def test_bad_arguments_name_themselves():
    cache = _cache("LBHNC")
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="lengths: at most 8"):
        DecodeBatch(
            cache, tables, torch.tensor([9, 1], dtype=torch.int32, device=DEV), hidden=64, mlp=32, q_heads=4
        )
    with pytest.raises(ValueError, match="q_heads"):
        DecodeBatch(
            cache, tables, torch.tensor([1, 1], dtype=torch.int32, device=DEV), hidden=64, mlp=32, q_heads=3
        )
