"""The CUDA runtime torch has loaded, through ctypes: for the few calls torch does not expose
(cudaGetLastError, cudaMemcpyBatchAsync). None without a CUDA build of torch."""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def runtime() -> tuple[ctypes.CDLL | None, int, str]:
    """(libcudart, runtime version, why not usable or '')."""
    if not torch.cuda.is_available() or not torch.version.cuda:
        return None, 0, "needs a CUDA build of torch and a GPU"
    major = torch.version.cuda.split(".")[0]
    lib = None
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)  # the runtime torch already loaded (same soname)
            break
        except OSError:
            continue
    if lib is None:
        return None, 0, f"libcudart.so.{major} not found"
    lib.cudaGetErrorString.restype = ctypes.c_char_p  # const char*, not the default int
    ver = ctypes.c_int(0)
    if lib.cudaRuntimeGetVersion(ctypes.byref(ver)) != 0:
        return None, 0, "cudaRuntimeGetVersion failed"
    return lib, ver.value, ""


def clear_last_error() -> None:
    """Reset the runtime's last error after a failed call we handled (e.g. cudaHostRegister),
    so torch's next error check does not report it against an unrelated launch."""
    lib = runtime()[0]
    if lib is not None:
        lib.cudaGetLastError()
