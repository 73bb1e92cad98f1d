"""bench: CUDA-event timer, probes of the machine's ceilings, suites, result files, plots."""
