"""The lab's suites; importing this package registers them in kvtier's bench registry, beside
kvtier's own (so one `python -m lab bench` run can write both into one result file).

baseline*:          the ways peers move KV today (torch gather, gather + one copy, vLLM's per-block
                    memcpy rebuilt from C++), the yardsticks kvtier's paths are read against
bidir:              the engine's save + load at once vs the bidirectional copy (P4)
save_beside_matmul: does a save slow a matmul beside it (P5)
submit_overhead:    the host time of one submit (P6)
hf:                 HF transformers: TTFT with kvtier's cache vs recompute vs transformers' offload
"""

from lab.suites import baseline, bidir, hf, interference, submit  # noqa: F401 - registers the suites
