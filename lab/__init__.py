"""The lab: what judges kvtier against its own targets and against its peers.

Not installed with kvtier; run from the repository root (`python -m lab bench ...`). It imports
kvtier through public names only (`lab/tests/test_lab_rules.py` checks this).

    suites/      suites registered in kvtier's bench registry: baselines and peer rebuilds, bidir,
                 save_beside_matmul, submit_overhead, hf (transformers' caches as peers)
    targets      kvtier's own targets (P1..P7) as numbers
    summary      a result file judged against those targets (`python -m lab results FILE`)
    native       vLLM's swap_blocks rebuilt at run time (a peer)
    hostref      this host's yardstick for submit times
    results/     committed result files; README.md says which command wrote each family
"""
