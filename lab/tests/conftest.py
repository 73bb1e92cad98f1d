"""The lab's tests see the lab's suites in kvtier's registry, as `python -m lab` does; `gpu` tests
are skipped without CUDA (as under tests/)."""

import os
import tempfile

import pytest

import lab.suites  # noqa: F401 - registers the lab's suites

# the planner's first-use costs: kept apart from the user's cache (~/.cache/kvtier)
os.environ.setdefault("KVTIER_CACHE_DIR", tempfile.mkdtemp(prefix="kvtier-test-cache-"))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
