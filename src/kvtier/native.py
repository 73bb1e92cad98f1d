"""Loading kvtier's optional C extensions (`_fast.c`, `_slab.c`, beside this module: below every
layer that uses them): the module, or None and why not. Off with KVTIER_NATIVE=0, where it was
not built, and where the interpreter runs without a GIL: both rely on it (each call atomic
towards other Python threads; the spare id arrays' use read from a reference count)."""

from __future__ import annotations

import importlib
import os
import sysconfig


def load(name: str):
    """(the module `name`, "") or (None, why not)."""
    if os.environ.get("KVTIER_NATIVE", "1") == "0":
        return None, "off (KVTIER_NATIVE=0)"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None, "off (no GIL: its calls would not be atomic)"
    try:
        return importlib.import_module(name), ""
    except ImportError as e:
        return None, f"not built ({e}); `make` builds it"
