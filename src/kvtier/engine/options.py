"""The checks of TransferEngine's arguments, of its constructor and of its calls: each error
names its argument."""

from __future__ import annotations

from kvtier.device.base import Event
from kvtier.layout import PagedKV
from kvtier.pool import Slot


def _positive_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def check_options(device, kv, pool, *, staging_bytes, uva_ctas, graphs, max_graphs, graph_execs) -> None:
    """Raise ValueError naming the first bad argument (see TransferEngine for their meaning)."""
    if not isinstance(kv, PagedKV):
        raise ValueError(f"kv: expected a PagedKV, got {type(kv).__name__}")
    if pool.device is not device:
        raise ValueError("pool: must be a PinnedPool of the same device")
    if uva_ctas is not None and not _positive_int(uva_ctas):
        raise ValueError(f"uva_ctas: expected a positive int or None, got {uva_ctas!r}")
    if not isinstance(staging_bytes, int) or staging_bytes < 2 * kv.block_nbytes:
        raise ValueError(f"staging_bytes: need at least two blocks ({2 * kv.block_nbytes} B)")
    if not isinstance(graphs, bool):
        raise ValueError(f"graphs: expected a bool, got {graphs!r}")
    if not _positive_int(max_graphs):
        raise ValueError(f"max_graphs: expected a positive int, got {max_graphs!r}")
    if not _positive_int(graph_execs):
        raise ValueError(f"graph_execs: expected a positive int, got {graph_execs!r}")


def check_slot(slot) -> None:
    if not isinstance(slot, Slot):
        raise ValueError(f"slot: expected a Slot of this engine's pool (a save job's .slot), got {slot!r}")


def check_per_layer(per_layer) -> None:
    if per_layer is not True and per_layer is not False:
        raise ValueError(f"per_layer: expected True or False, got {per_layer!r}")


def check_event(device, event) -> None:
    """`event` is an event of `device`: a later job's stream will wait for it."""
    if not isinstance(event, Event) or getattr(event, "_dev", device) is not device:
        raise ValueError(f"event: expected an event of this engine's device, got {event!r}")
