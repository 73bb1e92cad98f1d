"""The SM-copy kernel of `probe`, bit-exact: on a GPU, or on the CPU through Triton's interpreter."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1 (as `make test` sets on CPU)", allow_module_level=True)


@pytest.mark.parametrize("n", [1, 8191, 8192, 70_001])
def test_copy_kernel_is_bit_exact(n):
    import triton

    from kvtier.bench import smcopy

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=dev)
    dst = torch.zeros(n + 5, dtype=torch.int32, device=dev)  # the tail past n must stay untouched
    smcopy.copy_kernel[(triton.cdiv(n, smcopy.BLOCK),)](src, dst, n, BLOCK=smcopy.BLOCK)
    assert torch.equal(dst[:n], src) and not dst[n:].any()
