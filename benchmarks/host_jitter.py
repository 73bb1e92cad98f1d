"""Is the host slow, or slow right after waiting on the GPU? Times one `IdCheck.check` of 512 and
8192 ids (the first phase of a submit) in a hot loop, after a 20 ms host sleep, and after a
20 ms GPU wait (cudaEventSynchronize), as submit_overhead does between jobs.

    PYTHONPATH=src python benchmarks/host_jitter.py
"""

import statistics
import time

import torch

from kvtier.engine.ids import IdCheck


def us(fn, n=1):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    gpu = torch.cuda.is_available()
    if gpu:
        a = torch.randn(4096, 4096, device="cuda")
    for n in (512, 8192):
        chk = IdCheck(n, 16)
        ids = torch.randperm(n)
        call = lambda chk=chk, ids=ids: chk.check(ids, False)  # noqa: E731
        hot = us(call, 2000)
        slept, waited = [], []
        for _ in range(20):
            time.sleep(0.02)
            slept.append(us(call))
            if gpu:
                e = torch.cuda.Event()
                for _ in range(20):
                    a @ a  # ~20 ms of GPU work, then the host blocks on it as the engine's wait does
                e.record()
                e.synchronize()
                waited.append(us(call))
        line = f"{n:5d} ids: hot loop {hot:7.1f} us, after a 20 ms sleep {statistics.median(slept):7.1f} us"
        if waited:
            line += f", after a GPU wait {statistics.median(waited):7.1f} us"
        print(line)
    print("torch threads", torch.get_num_threads())


if __name__ == "__main__":
    main()
