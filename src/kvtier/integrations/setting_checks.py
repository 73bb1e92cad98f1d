"""What an operator may type for a setting, checked once where it is given: one rule for the vLLM
connector, the SGLang backend and ``KVTier.for_model``. Each check returns the value to use, or
raises ValueError naming the setting as the operator typed it (``name``) and the value.

    byte_size(value, name, minimum)   an int of bytes, or a string with a unit: "4GiB", "512 MiB",
                                      "64GB", "1.5GiB" (whole bytes); see SIZE_UNITS
    seconds(value, name, zero_ok)     a finite number of seconds (no Infinity, no NaN)
    positive(value, name, ...)        a finite number > 0 (>= 0 with zero_ok)
    whole(value, name, minimum)       an int >= minimum (not a bool, not 1.0)
    flag(value, name)                 a bool (or 0 / 1, as JSON configs write it)
    disk_dir(value, name)             a directory that exists and is writable, or can be created
    redis_url(value, name)            a redis://, rediss:// or unix:// URL redis-py takes
    refuse_unknown(given, known, where)  keys that are no setting: an error listing them
    pool_room(pool_bytes, chunk_nbytes, name)  a pinned pool big enough for the store's chunks

Nothing here touches a device, allocates memory, creates a file or connects anywhere.
"""

from __future__ import annotations

import math
import os
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

# Exact: the decimal units are powers of 1000, the binary ones (IEC) powers of 1024. "K", "M",
# "G" alone are refused: they mean either, depending on who wrote them.
SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
SIZE_HELP = "an int of bytes, or a string such as '4GiB', '512MiB' or '64GB' (GiB = 2**30, GB = 10**9)"


def byte_size(value, name: str, minimum: int = 1) -> int:
    """``value`` in bytes: an int, a float with no fraction (JSON's ``4e9``), or a string of a
    number and a unit (``SIZE_UNITS``, any case; none: bytes). At least ``minimum``."""
    n = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        unit = SIZE_UNITS.get(m.group(2).lower() or "b")
        if unit is None:
            raise ValueError(f"{name}={value!r}: unknown unit {m.group(2)!r}; {SIZE_HELP}")
        try:
            exact = Decimal(m.group(1)) * unit
        except InvalidOperation:
            exact = None
        if exact is not None and exact == exact.to_integral_value():
            n = int(exact)
    if n is None:
        raise ValueError(f"{name}: {SIZE_HELP} (whole bytes), got {value!r}")
    if n < minimum:
        shown = f"{value!r}" if n == value else f"{value!r} ({n} bytes)"
        raise ValueError(f"{name}={shown}: must be at least {minimum} byte{'s' * (minimum != 1)}")
    return n


def positive(value, name: str, unit: str = "", zero_ok: bool = False) -> float:
    """A finite int or float > 0 (``zero_ok``: >= 0); ``unit`` only words the error."""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value >= 0 if zero_ok else value > 0)
    )
    if not ok:
        what = f"a finite number{' of ' + unit if unit else ''} {'>= 0' if zero_ok else '> 0'}"
        raise ValueError(f"{name}: {what}, got {value!r}")
    return value


def seconds(value, name: str, zero_ok: bool = False) -> float:
    """A finite number of seconds > 0 (``zero_ok``: >= 0)."""
    return positive(value, name, "seconds", zero_ok)


def whole(value, name: str, minimum: int = 1) -> int:
    """An int >= ``minimum`` (a bool or a float is refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: an int >= {minimum}, got {value!r}")
    return value


def flag(value, name: str) -> bool:
    """A bool; 0 and 1 too (JSON configs often write them)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{name}: true or false, got {value!r}")


def disk_dir(value, name: str) -> str:
    """A directory kvtier can write in: one that exists and is writable, or one that ``mkdir -p``
    can make (its nearest existing ancestor a writable directory). Nothing is created here."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name}: a directory path, got {value!r}")
    path = Path(value)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{name}={value!r} is a file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{name}={value!r}: the directory is not writable by this process")
        return value
    if path.is_symlink():
        raise ValueError(f"{name}={value!r} is a broken symlink")
    above = path.absolute().parent
    while not above.exists():
        if above.is_symlink():
            raise ValueError(f"{name}={value!r} cannot be created: {above} is a broken symlink")
        above = above.parent
    if not above.is_dir():
        raise ValueError(f"{name}={value!r} cannot be created: {above} is a file")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"{name}={value!r} cannot be created: {above} is not writable by this process")
    return value


def redis_url(value, name: str) -> str:
    """A URL redis-py takes (``kvtier.store.redis_url.check_url``); the error masks its password."""
    from kvtier.store.redis_url import check_url

    return check_url(value, name)


def refuse_unknown(given, known, where: str) -> None:
    """ValueError listing the keys of ``given`` that are not in ``known``, with what ``where``
    reads (a typo would otherwise silently fall back to a default)."""
    unknown = sorted(str(k) for k in given if k not in known)
    if unknown:
        raise ValueError(f"{where}: unknown settings {unknown}; known: {sorted(known)}")


def pool_room(pool_bytes: int, chunk_nbytes: int, name: str, alignment: int = 256) -> None:
    """ValueError naming ``name`` when a pinned pool of ``pool_bytes`` (``PinnedPool``'s default
    ``alignment``) cannot hold the store's host tier for chunks of ``chunk_nbytes``
    (``StoreConfig.host_capacity``: one chunk, beside headroom for two more in flight)."""
    from kvtier.store.config import StoreConfig

    capacity = -(-pool_bytes // alignment) * alignment
    span = -(-chunk_nbytes // alignment) * alignment
    try:
        StoreConfig().host_capacity(capacity, span)
    except ValueError:
        raise ValueError(
            f"{name}={pool_bytes!r} is too small for chunks of {chunk_nbytes} bytes: the host tier "
            f"needs at least {3 * span} bytes (a chunk, and room for two more in flight)"
        ) from None
