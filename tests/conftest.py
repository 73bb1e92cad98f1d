"""Markers: `gpu` tests are skipped without CUDA; `redis` tests without a reachable server."""

import os
import tempfile

import pytest


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# The planner's first-use measurements are cached per machine and model: tests keep theirs apart
# from the user's cache, and start without one.
os.environ.setdefault("KVTIER_CACHE_DIR", tempfile.mkdtemp(prefix="kvtier-test-cache-"))

# vLLM picks its platform once, at the first import of any of its modules (SGLang's import some):
# without an accelerator it must be told to take its CPU platform before that, whichever test
# imports it first.
if not _cuda():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["c", "py"])
def slab(request, monkeypatch):
    """A test that uses it runs twice: with the pool's C bookkeeping (`kvtier._slab`, where built)
    and with the Python reference (`slab.PySlab`)."""
    from kvtier import slab as slab_mod

    if request.param == "c" and slab_mod.Slab is None:
        pytest.skip(f"kvtier._slab: {slab_mod.why}")
    if request.param == "py":
        monkeypatch.setattr(slab_mod, "Slab", None)
    return request.param
