"""Block ids checked on the device: the error a lazily checked call reports later, and the check
that reports it.

Ids in a GPU tensor are checked by the copy kernel itself (`check="lazy"`, the default for them):
reading them back to check them would make the host wait for the GPU on every call. An id out of
range, or named twice in one scatter, is then neither read nor written (its block's copy is
skipped), and the kernel counts it in the cache's error flag (two int32 on the device). The flag
is read, and cleared, by `check(kv)` -- and by any op call that waits for the GPU anyway (GPU ids
checked eagerly) -- which raises `BlockIdError`.
"""

from __future__ import annotations

import torch

from kvtier.layout import PagedKV

PLANS_KEY = "launches"  # the cache's `ops/launch.py` entry in PagedKV.plans, which holds the flag


class BlockIdError(ValueError):
    """Lazily checked block ids of earlier calls were bad: `out_of_range` ids past the cache (or
    negative) and `repeated` ids named again in one scatter; their copies were skipped."""

    def __init__(self, out_of_range: int, repeated: int):
        self.out_of_range, self.repeated = out_of_range, repeated
        super().__init__(
            f"block_ids: {out_of_range} out of range and {repeated} repeated in a scatter, in calls "
            "checked on the device since the last check; their blocks were not copied"
        )


def check(kv: PagedKV) -> None:
    """Raise `BlockIdError` if a lazily checked call on `kv` met bad ids, then clear the flag.

    Waits for all work on the cache's device first (the calls must have completed for their count
    to be in): call it where the host waits anyway, e.g. after a step's copies completed. Costs
    nothing beyond that wait when no call on `kv` was checked lazily.

    >>> ops.gather(kv, gpu_ids, dst)  # ids on the GPU: checked by the kernel, the host does not wait
    >>> torch.cuda.current_stream().synchronize(); ops.check(kv)  # raises if an id was bad
    """
    if not isinstance(kv, PagedKV):
        raise ValueError(f"kv: expected a PagedKV (see kvtier.layout), got {type(kv).__name__}")
    c = kv.plans.get(PLANS_KEY)
    if c is None or c.err is None:
        return
    if c.err.is_cuda:
        torch.cuda.synchronize(c.err.device)  # every call that may still count into the flag
    raise_flagged(c.err)


def flagged(kv: PagedKV) -> None:
    """After the host waited for the GPU: raise what lazily checked calls on `kv` flagged."""
    c = kv.plans.get(PLANS_KEY)
    if c is not None and c.err is not None:
        raise_flagged(c.err)


def raise_flagged(err: torch.Tensor) -> None:
    """Read the flag of completed calls (the caller waited for them); raise and clear if set."""
    out_of_range, repeated = err.tolist()
    if out_of_range or repeated:
        err.zero_()
        raise BlockIdError(out_of_range, repeated)
