"""Prefill on device a, decode on device b: the prompt's KV goes a -> b through `Handoff` and the
greedy tokens equal one device's `generate`. On the CPU with two SimDevices (copies land late,
b's blocks poisoned with NaN first, sanitizer on); on two GPUs when there are two. Random weights
from a config, no download."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvtier import layout  # noqa: E402
from kvtier.engine import Handoff  # noqa: E402
from kvtier.integrations.hf import cache_kwarg  # noqa: E402
from kvtier.lifecycle import Access  # noqa: E402
from kvtier.reference import poison_  # noqa: E402

NEW, BS, NB = 8, 16, 12


def model(device="cpu"):
    cfg = transformers.Qwen2Config(
        vocab_size=320, hidden_size=120, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval().to(device)


def paged(m, device):
    c = m.config
    hd = c.hidden_size // c.num_attention_heads
    shape = (2, NB, BS, c.num_key_value_heads, hd)
    return layout.vllm_flash(
        [torch.zeros(shape, dtype=m.dtype, device=device) for _ in range(c.num_hidden_layers)]
    )


def prefill_on_a(m, ids, dev, kv, blocks):
    """One forward over the prompt on a; its KV written into `blocks` of a's paged cache on a's
    compute stream. Returns (first token, the event after the write)."""
    with torch.no_grad():
        out = m(ids, use_cache=True)
    past = out.get("cache")  # `past_key_values` before transformers 5
    if past is None:
        past = out.past_key_values
    seq, pad = ids.shape[1], len(blocks) * BS - ids.shape[1]
    cs = dev.current_stream()

    def write() -> None:
        for layer, x in enumerate(kv.layers):
            for kind, t in enumerate((past.layers[layer].keys, past.layers[layer].values)):
                tok = torch.nn.functional.pad(t[0].transpose(0, 1), (0, 0, 0, 0, 0, pad))  # (seq+pad, H, D)
                x[kind, blocks] = tok.reshape(len(blocks), BS, *tok.shape[1:])

    dev.launch(write, cs)
    e = cs.record("e_prefill")
    assert seq <= len(blocks) * BS
    return out.logits[:, -1].argmax(-1, keepdim=True), e


def decode_on_b(m, first, dev, kv, blocks, seq, job):
    """Rebuild b's DynamicCache layer by layer, each after its handoff event, then decode greedily."""
    cache = transformers.DynamicCache()
    for layer, x in enumerate(kv.layers):
        # The model runs eagerly on the host here: the host waits for layer l's event, which is
        # what makes reading layer l's blocks legal (on a GPU the compute stream would wait it).
        assert job.layer_events[layer].synchronize(timeout=30)
        k, v = (x[kind, blocks].reshape(-1, *x.shape[3:])[:seq].transpose(0, 1)[None] for kind in (0, 1))
        cache.update(k.contiguous(), v.contiguous(), layer)
    tok, out = first.to(kv.device), [first.to(kv.device)]
    with torch.no_grad():
        for _ in range(NEW - 1):
            logits = m(tok, use_cache=True, **{cache_kwarg(m): cache}).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(tok)
    return torch.cat(out, 1)


def run(dev_a, dev_b, ma, mb, da, db):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, ma.config.vocab_size, (1, 45), generator=g)  # 3 blocks, the last partial
    with torch.no_grad():
        want = ma.generate(ids.to(da), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[:, ids.shape[1] :]
    ka, kb = paged(ma, da), paged(mb, db)
    for x in kb.layers:
        poison_(x)  # b's blocks hold garbage until the handoff lands
    h = Handoff(ka, kb, src_device=dev_a, dst_device=dev_b, sanitize=True)
    src, dst = [4, 0, 7], [11, 2, 5]
    # The poison is a compute write on b's current stream: told to b's tracker, the scatters wait for it.
    h.dst.blocks.compute_write(dst, dev_b.current_stream().record("poison"))
    first, e = prefill_on_a(ma, ids.to(da), dev_a, ka, src)
    h.src.blocks.compute_write(src, e)
    job = h.send(src, dst, after=e, num_tokens=ids.shape[1])
    waits = h.src.blocks.waits_for(Access.WRITE, src)
    # a's next prefill into these blocks must wait for the peer copy (or it is over already)
    assert job.sent in waits or job.sent.query()
    got = decode_on_b(mb, first, dev_b, kb, dst, ids.shape[1], job)
    assert torch.equal(got.cpu(), want.cpu())
    h.close()


def test_prefill_on_a_decode_on_b_sim():
    from kvtier.device import SimDevice

    with SimDevice(copy_delay=0.05) as a, SimDevice(copy_delay=0.02, launch_delay=0.01) as b:
        m = model()
        run(a, b, m, m, "cpu", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_prefill_on_a_decode_on_b_cuda():
    from kvtier.device import CudaDevice

    with CudaDevice(0) as a, CudaDevice(1) as b:
        run(a, b, model("cuda:0"), model("cuda:1"), "cuda:0", "cuda:1")
