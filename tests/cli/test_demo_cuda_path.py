"""What `kvtier demo` does differently on a GPU, checked on the CPU: the device and model chosen,
the model made on its device (llama_rig), the TTFT clock synchronizing the GPU, and the kvtier
warm-up that keeps first-use costs (Triton compiles, graph captures) out of the measured requests."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from kvtier.cli import cli, demo  # noqa: E402
from kvtier.device import SimDevice  # noqa: E402
from kvtier.integrations.hf import KVTier  # noqa: E402
from kvtier.store.disk import DiskTier  # noqa: E402


def test_auto_picks_cuda_with_the_larger_model_and_its_prefix(monkeypatch):
    seen = {}

    def fake_build(kind, device=None, max_positions=32768):
        seen.update(build=kind, max_positions=max_positions)
        return "model"

    def fake_run(kind, prefix, requests, new_tokens, redis_url, model=None, on_step=None):
        seen.update(run=kind, prefix=prefix, model=model)
        return dict(identical=True)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(demo, "build_model", fake_build)
    monkeypatch.setattr(demo, "run", fake_run)
    r = CliRunner().invoke(cli, ["demo", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == {"identical": True}
    assert seen["build"] == seen["run"] == "cuda" and seen["model"] == "model"
    assert seen["prefix"] == demo.PREFIX["cuda"] == 8192
    assert seen["max_positions"] >= 8192 + demo.TAIL + 8 * 4 + 16  # the longest prompt fits


def test_device_cuda_without_a_gpu_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(cli, ["demo", "--device", "cuda"])
    assert r.exit_code == 2 and "torch finds no CUDA GPU" in r.output


def test_the_cuda_model_is_made_on_the_gpu_directly_in_fp32(monkeypatch):
    import kvtier.bench.llama_rig as rig

    seen = {}
    monkeypatch.setattr(rig, "build_llama", lambda shape, device, dtype, **kw: seen.update(device=device,
                        dtype=dtype, **kw))  # fmt: skip
    demo.build_model("cuda")
    assert seen["device"] == "cuda" and seen["dtype"] is torch.float32  # no CPU build + .to("cuda")
    assert seen["hidden_size"] == 2048 and seen["num_hidden_layers"] == 16


def test_the_cpu_model_is_seeded_fp32_and_the_same_config():
    a, b = demo.build_model("cpu"), demo.build_model("cpu")
    assert a.device.type == "cpu" and a.dtype == torch.float32
    assert a.config.hidden_size == demo.MODELS["cpu"]["hidden_size"]
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_first_token_clock_synchronizes_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append("sync"))
    clock = demo._FirstToken(torch.device("cuda"))
    clock.put(torch.zeros(1, 7, dtype=torch.long))  # the prompt
    assert clock.t_first is None and calls == []
    clock.put(torch.zeros(1, dtype=torch.long))  # the first token: a CPU tensor, still synchronized
    first = clock.t_first
    clock.put(torch.zeros(1, dtype=torch.long))
    assert calls == ["sync"] and clock.t_first == first is not None
    cpu = demo._FirstToken(torch.device("cpu"))
    cpu.put(torch.zeros(1, dtype=torch.long))
    assert calls == ["sync"] and cpu.t_first is not None


def test_kvtier_warm_up_saves_loads_and_leaves_no_chunk_in_any_tier(tmp_path):
    model = demo.build_model("cpu")
    dev = SimDevice()
    opts = dict(num_blocks=80, chunk_tokens=demo.CHUNK, tiers=[DiskTier(tmp_path / "disk", 64 << 20)])
    with KVTier.for_model(model, device=dev, **opts) as kvt:
        assert demo.warm_up_kvtier(kvt, model) == 0  # SimDevice: nothing to compile, the CPU demo skips it
        assert demo.warm_up_kvtier(kvt, model, always=True) == 2 * demo.CHUNK  # the 2nd request loaded
        g = torch.Generator().manual_seed(99)  # the warm-up's prompt
        ids = torch.randint(1, model.config.vocab_size, (1, 2 * demo.CHUNK + 8), generator=g)
        assert kvt.store.lookup(ids[0].tolist()).tokens == 0  # evicted from the host and the disk
        kvt.store.evict()
        assert kvt.store.lookup(ids[0].tolist()).tokens == 0
    assert not list((tmp_path / "disk").rglob("*.kvc"))
    dev.close()
