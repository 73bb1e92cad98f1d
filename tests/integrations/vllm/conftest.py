"""The vLLM tests' engines (a scheduler, workers, their stores and threads) hold reference cycles,
and a hybrid model's caches and host pools take hundreds of MB to GB each: collected after every
test, not at Python's next full collection, or a run of them outgrows CI's memory."""

import gc

import pytest


@pytest.fixture(autouse=True)
def _collect_engines():
    yield
    gc.collect()  # the last test's engines and caches freed before the next one allocates its own
