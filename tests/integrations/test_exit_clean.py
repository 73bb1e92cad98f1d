"""Ending a program with kvtier work in flight is clean (issue #32, classes 2 and 3).

A program that ends with loads in flight -- no wait, no close -- used to die with "terminate
called without an active exception" (SIGABRT): SimDevice's worker threads were still in torch
ops when the interpreter finalized. Each script here runs in fresh subprocesses, several times,
and must exit with the code Python gives it (0, or 1 after an uncaught exception) every time.
`KVTier.close()` after a device error releases everything and warns once instead of raising."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

transformers = pytest.importorskip("transformers")

from kvtier.device import DeviceError, SimDevice  # noqa: E402
from kvtier.integrations.hf import KVTier  # noqa: E402

RUNS = 6

SCRIPT = textwrap.dedent(
    """
    import sys, torch, transformers
    from kvtier.integrations.hf import KVTier, cache_kwarg

    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    kvt = KVTier.for_model(model, num_blocks=256, block_size=16, chunk_tokens=32)
    ids = torch.randint(1, 384, (1, 200))
    cache = kvt.cache(ids)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=1, do_sample=False, **{cache_kwarg(model): cache})
    cache.finish(out)
    caches = [kvt.cache(ids) for _ in range(16)]  # loads in flight: no wait, no close
    assert caches[-1].hit_tokens > 0
    if sys.argv[1] == "raise":
        caches[-1]._arrive(0, torch.zeros(2, 1))  # an error inside the cache (batch 2), uncaught
    """
)


def run(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONFAULTHANDLER="")
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode, code", [("exit", 0), ("raise", 1)])
def test_exit_with_loads_in_flight_is_clean(mode, code):
    for i in range(RUNS):
        p = run(mode)
        assert "terminate called" not in p.stderr, f"run {i}: {p.stderr[-2000:]}"
        assert p.returncode == code, f"run {i}: exit code {p.returncode}\n{p.stderr[-2000:]}"
        if mode == "raise":
            assert "KVTierCache holds one request" in p.stderr


def tiny_kvtier() -> KVTier:
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    return KVTier.for_model(model, num_blocks=32, block_size=16, chunk_tokens=32)


def test_close_after_a_device_error_releases_everything_and_warns_once():
    """close() after a device error raised the same error again and released nothing."""
    kvt = tiny_kvtier()
    assert isinstance(kvt.device, SimDevice) and kvt.owns_device
    kvt.device.launch(lambda: 1 / 0, kvt.compute)  # a kernel that fails: the error is sticky
    with pytest.raises(DeviceError):
        kvt.device.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kvt.close()
        kvt.close()  # idempotent: nothing more to release, nothing reported twice
    said = [w for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "ZeroDivisionError" in str(said[0].message), [str(w.message) for w in seen]
    assert kvt.pool.closed
    assert not any(s.worker_alive for s in kvt.device.streams())  # the workers were joined


def test_close_twice_without_an_error_is_quiet():
    kvt = tiny_kvtier()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvt.close()
        kvt.close()
    assert kvt.pool.closed
