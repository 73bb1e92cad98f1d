"""The test suite as a user runs it without an optional dependency: a test file that needs redis-py
skips with its reason (or runs the tests that need none), never an error at collection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDE_REDIS = """
import sys
sys.modules["redis"] = None  # `import redis` raises ImportError, as where redis-py is not installed
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_store_tests_collect_without_redis_py():
    files = ["tests/store/test_store_redis.py", "tests/store/test_store_stress.py"]
    env = os.environ | {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    got = subprocess.run(
        [sys.executable, "-c", HIDE_REDIS, "--collect-only", "-q", "-rs", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = got.stdout + got.stderr
    assert got.returncode == 0, out[-3000:]
    assert "error" not in out.lower().replace("errors_", ""), out[-3000:]
    assert "test_store_stress.py::test_disk_stress" in out  # what needs no redis-py still runs
    assert "redis-py is not installed" in out  # the redis file says why it skipped
