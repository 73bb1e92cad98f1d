"""The several-GPU suites on a machine without two GPUs: they skip with a reason; the link mapping."""

import pytest

from kvtier.bench.suite import SUITES, Context, SkipSuite
from kvtier.bench.suites.multi import link_spec


@pytest.mark.parametrize("name", ["handoff", "contention"])
def test_skips_below_two_gpus(name):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs here: the suite runs (tests/test_handoff_gpu.py covers the bytes)")
    with pytest.raises(SkipSuite, match="needs two CUDA GPUs"):
        list(SUITES[name].fn(Context("cpu", quick=True)))


@pytest.mark.parametrize(
    ("topo", "key", "gbps"),
    [
        ("NV18", "nvlink4", 450.0),
        ("NV4", "nvlink4", 450.0),
        ("SYS", "pcie5", 63.0),
        ("PXB", "pcie5", 63.0),
    ],  # fmt: skip
)
def test_link_spec(topo, key, gbps):
    got_key, got = link_spec(topo)
    assert got_key == key and got == pytest.approx(gbps, rel=0.01)


def test_peer_copy_ceiling_is_known():
    from kvtier.bench.probes import CEILINGS
    from kvtier.ceilings import FIGURES

    assert CEILINGS["peer_copy"].figure in FIGURES
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Context("cpu", quick=True).ceiling("peer_copy")
