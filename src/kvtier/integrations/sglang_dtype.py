"""The KV dtype an SGLang server runs, which its host pool does not say.

SGLang keeps an fp8 KV cache, e4m3 or e5m2, as uint8: its device pool's ``store_dtype`` is uint8
where its ``dtype`` is the fp8 format, and the host pool is built from ``store_dtype`` (its
``dtype`` is uint8 for both). Keyed by the pool's dtype alone, a server in e5m2 would load an
e4m3 server's pages as hits: the same bytes, read as other numbers.

    kv_dtype(pool, configured) -> str   what the model runs, as it goes into the chunk keys

A pool of any other dtype (bf16, fp16, fp32) stores what the model runs. For a uint8 pool the
format is SGLang's ``--kv-cache-dtype`` as this process published it (its runtime context), or
``configured`` (the backend's ``kv_cache_dtype`` setting) where that cannot be read; both given
and different, or neither, is an error at start. The name is resolved as SGLang resolves it:
``auto`` with an fp8 pool is an fp8 checkpoint's e4m3; on ROCm every fp8 name runs the GPU's own
fp8 format, so the GPU architecture names it there.
"""

from __future__ import annotations

FP8_NAMES = ("auto", "fp8_e4m3", "fp8_e5m2")
SETTING = "extra_config['kv_cache_dtype']"


def kv_dtype(pool, configured: str | None = None) -> str:
    """The dtype of ``pool``'s KV as the model runs it (``float8_e5m2``, ``bfloat16``, ...)."""
    stored = str(getattr(pool, "dtype", "unknown")).removeprefix("torch.")
    if stored != "uint8":
        return stored  # SGLang stores only quantized formats as bytes: this is what the model runs
    served = _served_kv_cache_dtype()
    if configured is not None and served is not None and configured != served:
        raise ValueError(f"{SETTING}={configured!r}, but this SGLang server runs --kv-cache-dtype {served!r}")
    name = served if served is not None else configured
    if name is None:
        raise ValueError(
            f"the host pool stores a quantized KV cache as uint8 and SGLang's --kv-cache-dtype cannot be "
            f"read here: set {SETTING} to the server's --kv-cache-dtype (e.g. 'fp8_e4m3'), so pages of "
            "another fp8 format are never loaded as this one"
        )
    if name not in FP8_NAMES:
        return f"uint8:{name}"  # another quantized format (mxfp8, nvfp4, ...): a namespace of its own
    rocm_arch = _rocm_arch()
    if rocm_arch is not None:
        return f"fp8@{rocm_arch}"
    return "float8_e5m2" if name == "fp8_e5m2" else "float8_e4m3fn"


def _served_kv_cache_dtype() -> str | None:
    """SGLang's ``--kv-cache-dtype`` as this process published it; None outside a server."""
    try:
        from sglang.srt.runtime_context import get_model

        value = get_model().kv_cache_dtype
    except Exception:  # SGLang absent, another version, or no published context (a test, a tool)
        return None
    return value if isinstance(value, str) and value else None


def _rocm_arch() -> str | None:
    """The GPU architecture on ROCm (its fp8 format: fnuz on gfx94x), None elsewhere."""
    try:
        import torch

        if torch.version.hip is None:
            return None
    except Exception:  # no torch: not ROCm
        return None
    try:
        return str(torch.cuda.get_device_properties(0).gcnArchName).split(":")[0]
    except Exception:  # ROCm without a readable device: the keys say so, apart from the others
        return "rocm"
