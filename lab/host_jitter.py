"""Is the host slow, or slow right after waiting on the GPU? Times one `IdCheck.check` of 512 and
8192 ids (the first phase of a submit) in a hot loop, after a 20 ms host sleep, and after a
20 ms GPU wait (cudaEventSynchronize), as submit_overhead does between jobs
(`lab/hostref.py`; the suite stores the 512-id figures in its rows).

    PYTHONPATH=src python -m lab.host_jitter
"""

import torch

from lab.hostref import host_reference


def main() -> None:
    for n in (512, 8192):
        r = host_reference(n, reps=20)
        line = (
            f"{n:5d} ids: hot loop {r['hot_us']:7.1f} us, after a 20 ms sleep {r['after_sleep_us']:7.1f} us"
        )
        if r["after_gpu_wait_us"] is not None:
            line += f", after a GPU wait {r['after_gpu_wait_us']:7.1f} us"
        print(line)
    print("torch threads", torch.get_num_threads())


if __name__ == "__main__":
    main()
