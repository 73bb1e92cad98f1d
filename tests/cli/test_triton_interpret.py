"""Without a GPU and without TRITON_INTERPRET, kvtier's kernels still run: kvtier sets the variable
itself before triton is imported, and says so in one line on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU does")

SRC = str(Path(__file__).resolve().parents[2] / "src")

GATHER = """
import torch
from kvtier import layout, ops
caches = [torch.randn(2, 8, 16, 2, 8) for _ in range(2)]
kv = layout.vllm_flash(caches)
out = torch.empty(3, 2, 2, 16, 2, 8)
ops.gather(kv, [5, 0, 2], out)
ref = torch.stack([torch.stack([c[:, b] for c in caches]) for b in (5, 0, 2)])
print("EQUAL", torch.equal(out, ref))
"""


def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env |= env_extra or {}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_kernel_runs_on_the_cpu_without_triton_interpret_and_says_so_once():
    got = _run(GATHER)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "EQUAL True" in got.stdout
    lines = [x for x in got.stderr.splitlines() if x.startswith("kvtier:")]
    assert lines == ["kvtier: no CUDA GPU: kernels run in Triton's interpreter (TRITON_INTERPRET=1)"]


def test_the_users_own_value_is_kept():
    got = _run(
        "import os, kvtier.ops as o; print(o.INTERPRETING, os.environ['TRITON_INTERPRET'])",
        {"TRITON_INTERPRET": "0"},
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split() == ["False", "0"]
    assert "kvtier:" not in got.stderr


def test_triton_imported_first_is_said_with_what_to_do():
    got = _run("import triton, kvtier.ops as o; print(o.INTERPRETING)")
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split() == ["False"]
    assert "set TRITON_INTERPRET=1 before importing triton" in got.stderr
