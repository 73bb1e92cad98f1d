"""kernels: @triton.jit code only, and the one decision made before any of it is defined.

Triton decides when it is imported and when a kernel is defined whether kernels run compiled
(CUDA) or in its interpreter (``TRITON_INTERPRET=1``, on CPU tensors). `interpret_without_gpu()`
sets the variable where torch sees no GPU and it is not set, and says so once on stderr; the
modules that import triton (`kvtier.ops`, `kvtier.bench.smcopy`) call it first.
"""

import os
import sys


def interpret_without_gpu() -> None:
    """Set ``TRITON_INTERPRET=1`` when torch sees no CUDA GPU and the variable is unset (the
    user's own value, either way, is kept). Too late once triton is imported: then it says what
    to do instead, and kvtier's checks refuse CPU tensors naming the variable."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if torch.cuda.is_available():
        return
    if "triton" in sys.modules:  # its own helpers are defined already, compiled: a mix would fail
        print(
            "kvtier: no CUDA GPU found, and triton was imported before kvtier: "
            "set TRITON_INTERPRET=1 before importing triton to run kvtier's kernels on the CPU",
            file=sys.stderr,
        )
        return
    os.environ["TRITON_INTERPRET"] = "1"
    print("kvtier: no CUDA GPU: kernels run in Triton's interpreter (TRITON_INTERPRET=1)", file=sys.stderr)


interpret_without_gpu()
