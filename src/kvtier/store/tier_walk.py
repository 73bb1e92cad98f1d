"""Walks over a stack of lower tiers, fastest first: where a prefix lives, the first tier that
delivers a chunk of the expected format, dropping chunks from every tier.

Failure never escapes a walk: a tier that raises, times out or holds another format is a miss
(logged and counted), so a bug in one tier can cost a recompute but never hand bad KV on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from .chunking import ChunkFormat
from .tier import DestTooSmall, Tier, contains_many

log = logging.getLogger(__name__)


def where(keys: list[bytes], held: Callable[[bytes], bool], tiers: Sequence[Tier]) -> list[str]:
    """The first tier holding each chunk of the longest prefix of ``keys`` that some tier holds:
    "host" where ``held(key)``, else a lower tier's name. One ``contains_many`` per lower tier
    (Redis: one round trip for the prompt, not one per chunk), only for the keys the tiers above
    lack. A hint: a later read may still miss."""
    found: list[str | None] = ["host" if held(key) else None for key in keys]
    for tier in tiers:
        missing = [i for i, name in enumerate(found) if name is None]
        if not missing:
            break
        try:
            hits = contains_many(tier, [keys[i] for i in missing])
        except Exception as exc:  # a tier failure is a miss, never raised
            log.warning("kvstore: contains on %s failed: %s", tier.name, exc)
            continue
        for i, yes in zip(missing, hits, strict=True):
            found[i] = tier.name if yes else None
    n = found.index(None) if None in found else len(found)
    return found[:n]  # a chunk after a gap is useless: its KV needs the missing one's


def read_first(
    key: bytes, dest, tiers: Sequence[Tier], fmt: ChunkFormat, count: Callable[[str], None]
) -> int | None:
    """Index of the first tier of ``tiers`` that reads ``key``'s chunk into ``dest`` (a uint8
    tensor of at least ``fmt.nbytes``) with a header describing exactly ``fmt``, or None.
    ``count(event)``: "header_mismatches" or "read_failures", once per tier that failed."""
    for i, tier in enumerate(tiers):
        try:
            header = tier.get_into(key, dest)
        except DestTooSmall as exc:  # a bigger chunk than this cache's: another format
            log.warning("kvstore: %s holds %s in another format (%s); a miss", tier.name, key.hex(), exc)
            count("header_mismatches")
            continue
        except Exception as exc:  # tiers do not raise, but a bug in one must stay a miss
            log.warning("kvstore: %s read of %s failed: %s", tier.name, key.hex(), exc)
            count("read_failures")
            continue
        if header is None:
            continue
        if fmt.matches(header):
            return i
        log.warning("kvstore: %s holds %s in another format (%s); a miss", tier.name, key.hex(), header)
        count("header_mismatches")
    return None


def delete_everywhere(keys: list[bytes], tiers: Sequence[Tier]) -> None:
    """Delete ``keys`` from every tier of ``tiers`` (failures logged, never raised)."""
    for key in keys:
        for tier in tiers:
            try:
                tier.delete(key)
            except Exception as exc:  # one tier's failure must not stop the others' deletes
                log.warning("kvstore: delete from %s failed: %s", tier.name, exc)
