"""The README's Python blocks run as written: in order, as one session, on this machine (a GPU or
the CPU), in a temporary folder, from a fresh interpreter without TRITON_INTERPRET set, as a new
user pastes them. A block whose first line says `# needs N CUDA GPUs` is skipped with fewer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDS = re.compile(r"#\s*needs (\d+) CUDA GPUs?", re.I)


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_the_readme_has_python_blocks_and_none_names_a_fixed_path():
    found = blocks()
    assert len(found) >= 5
    for b in found:
        code = re.sub(r"#.*", "", b)  # the comments may show a real deployment's path
        assert not re.search(r"""DiskTier\(\s*["']/""", code), b  # run as root, it is made under /


@pytest.mark.timeout(900)
def test_every_python_block_runs_as_written(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    have, script, ran = gpus(), [], []
    for i, b in enumerate(blocks()):
        m = NEEDS.match(b.lstrip())
        if m and int(m.group(1)) > have:
            continue
        script += [b, f"print('README block {i} ran', flush=True)"]
        ran.append(i)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {
        "PYTHONPATH": str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", ""),
        "TMPDIR": str(tmp_path),  # the blocks' temporary folders, removed with the test's
        "KVTIER_CACHE_DIR": str(tmp_path / "cache"),  # first-use measurements: not the user's cache
    }
    work = tmp_path / "cwd"
    work.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", "\n".join(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert [int(x) for x in re.findall(r"README block (\d+) ran", r.stdout)] == ran
    assert "1024 ('host', 'host', 'host', 'host')" in r.stdout  # the HF block's second request hit
