"""How fast this host runs a submit's first step, hot and right after a wait: the yardstick the
submit figures (P6) are read against.

The step is one `IdCheck.checked` of 512 block ids (what every save / load does first) and a
tensor view of them: the work `IdCheck.check` did until 9edb36f, kept as it was so the yardstick
reads the same across runs (since 9edb36f `check` makes an int64 copy instead: runs `-39` and
`-40` timed that, ~2x the step on the CI CPU; their yardstick is not comparable). Timed in a hot
loop, then once each right after the thread slept 20 ms and right after it waited 20 ms on
the GPU (as a job submitted after waiting for the one before). On the H200 boxes the same step
took 4-9 us hot and 120-260 us after a wait (`lab/host_jitter.py`): every phase of a
submit swells so, which no change inside kvtier removes.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch


def _us(fn, n: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def host_reference(n_ids: int = 512, wait_s: float = 0.02, reps: int = 10, gpu: bool | None = None) -> dict:
    """{"ids", "hot_us", "after_sleep_us", "after_gpu_wait_us" (None without a GPU)}: medians."""
    from kvtier.engine.ids import IdCheck

    if isinstance(n_ids, bool) or not isinstance(n_ids, int) or n_ids < 1:
        raise ValueError(f"n_ids: expected a positive int, got {n_ids!r}")
    if not wait_s > 0:
        raise ValueError(f"wait_s: expected seconds > 0, got {wait_s!r}")
    gpu = torch.cuda.is_available() if gpu is None else gpu
    chk, ids = IdCheck(n_ids, 16), torch.randperm(n_ids)

    def call():
        return torch.from_numpy(chk.checked(ids, False).ids)

    hot = _us(call, 2000)
    slept, waited = [], []
    if gpu:
        a = torch.randn(4096, 4096, device="cuda")
        per = max(1, round(wait_s / _matmul_s(a)))
    for _ in range(reps):
        time.sleep(wait_s)
        slept.append(_us(call))
        if gpu:
            e = torch.cuda.Event()
            for _ in range(per):
                a @ a  # ~wait_s of GPU work, then the host blocks on it as a waited job does
            e.record()
            e.synchronize()  # the host idles on the GPU here: the state a cold submit starts from
            waited.append(_us(call))
    return {
        "ids": n_ids,
        "hot_us": hot,
        "after_sleep_us": statistics.median(slept),
        "after_gpu_wait_us": statistics.median(waited) if waited else None,
    }


def _matmul_s(a: torch.Tensor) -> float:
    """Seconds of one `a @ a` on the GPU (after a warm-up)."""
    for _ in range(3):
        a @ a
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        a @ a
    e.record()
    e.synchronize()  # elapsed_time needs the end event complete
    return s.elapsed_time(e) / 5 / 1e3


def host_work(ms: float) -> None:
    """Keep this thread busy for `ms` as a serving loop's scheduler step would between submits:
    Python objects, small numpy and torch CPU ops (a stand-in, not any engine's code)."""
    end = time.perf_counter() + ms / 1e3
    a, seqs = np.arange(512), {}
    while time.perf_counter() < end:
        for i in range(64):
            seqs[i] = [i, i + 1, (i * 7) % 512]
        b = a[a % 3 == 0].sum() + len(seqs)
        torch.as_tensor(a[:64]).add_(int(b) & 7)
