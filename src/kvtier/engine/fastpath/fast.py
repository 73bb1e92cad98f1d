"""The submit path's optional C helper, `kvtier._fast` (`src/kvtier/_fast.c`), and whether it is
in use.

Why C: a submit often runs on a cold host -- right after the previous job's enqueue, or after
the caller's other work -- where every distinct numpy, torch or ctypes call costs many times
what it costs back to back. So the two steps made of many such calls become one C call each:

    check_ids  the ids copied to the job's own int32 array, range-checked, (loads) checked for
               repeats -- instead of astype, max, two scatters and a count (`ids.IdCheck`); one
               AVX2 pass where the CPU has it (copy, range and rising test at once), a branch-free
               bit mask for the repeats; for 1024+ ids the array taken from spares that nothing
               else holds any more
    replay     the query of the event guarding the graph's pinned ids buffer, the ids copied
               into it, then cudaMemcpyAsync, cudaGraphLaunch and the job's cudaEventRecord --
               instead of np.copyto and four ctypes calls (`graphs.StagedGraphs`)

Built by `make` (setup.py, optional: skipped without a C compiler); `KVTIER_NATIVE=0` turns it
off. Without it every step runs in numpy and ctypes, with the same results and errors (the tests
run both).
"""

from __future__ import annotations

import ctypes
import functools

from kvtier.native import load

fast, why = load("kvtier._fast")  # the module or None, and why not


@functools.cache
def runtime_bound() -> bool:
    """Give `fast.replay` the addresses of the runtime's calls (those of the libcudart torch
    loaded); False without the helper or the runtime."""
    if fast is None:
        return False
    from kvtier.device.cudart import runtime

    lib = runtime()[0]
    if lib is None:
        return False
    names = (
        "cudaMemcpyAsync",
        "cudaGraphLaunch",
        "cudaEventRecord",
        "cudaGetDevice",
        "cudaSetDevice",
        "cudaEventQuery",
    )
    try:
        fast.set_runtime(*(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names))
    except (AttributeError, ValueError):  # a runtime without one of them
        return False
    return True


def status() -> str:
    """One line for reports: in use, or why not."""
    return "in use" if fast is not None else why
