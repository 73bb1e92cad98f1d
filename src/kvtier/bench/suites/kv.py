"""Benchmark suites of the KV copy kernels: gather_d2d, save_d2h, load_h2d, shapes (placeholder)."""
