"""The environment block of a result file: what ran, where, with which software and commit.

A figure without it cannot be reproduced or compared; missing pieces are null, never a crash.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

import kvtier


def git_commit(where: str | Path | None = None) -> tuple[str | None, bool | None]:
    """(commit hash, dirty?) of the checkout kvtier runs from. KVTIER_COMMIT, when set, wins (dirty
    unknown): a tree copied to a remote GPU box may carry no .git, or a stale one whose HEAD is
    not the commit that was copied."""
    named = os.environ.get("KVTIER_COMMIT")
    if named:
        return named, None
    cwd = Path(where) if where else Path(kvtier.__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return (head or None), bool(status.strip())


def slug(name: str) -> str:
    """ "NVIDIA H200" -> "nvidia-h200": a file-name-safe lower-case form."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return s or "unknown"


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0)


def environment(device: str = "cpu") -> dict:
    """GPU, driver, CUDA, torch, triton, python, kvtier, commit, hostname, date."""
    from kvtier.bench import nvml

    env: dict = {
        "gpu": None,
        "gpu_count": 0,
        "driver": None,
        "cuda": None,
        "torch": None,
        "triton": None,
        "python": platform.python_version(),
        "kvtier": kvtier.__version__,
        "commit": None,
        "dirty": None,
        "hostname": socket.gethostname(),
        "date": utc_now().isoformat().replace("+00:00", "Z"),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "argv": list(sys.argv),
    }
    env["commit"], env["dirty"] = git_commit()
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["torch_threads"] = torch.get_num_threads()
        if str(device).startswith("cuda") and torch.cuda.is_available():
            idx = torch.device(device).index or 0
            props = torch.cuda.get_device_properties(idx)
            env["gpu"] = props.name
            env["gpu_count"] = torch.cuda.device_count()
            env["sms"] = props.multi_processor_count
            env["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
            uuid = getattr(props, "uuid", None)
            topo = nvml.read(idx, uuid=str(uuid) if uuid else None)
            env["driver"] = topo.get("driver")
            env["topology"] = topo
            from kvtier.device.cuda_events import choose_events

            # What CudaDevice's events are (a submit's host cost depends on it): raw or torch.
            try:
                env["events"] = choose_events()[1]
            except (ValueError, RuntimeError) as e:  # a bad KVTIER_EVENTS: CudaDevice would refuse it
                env["events"] = f"refused: {e}"
            from kvtier import slab
            from kvtier.engine.fastpath.fast import status

            env["c_helper"] = status()  # the submit's C helper: "in use", or why not
            env["c_slab"] = slab.status()  # the pool's C bookkeeping: "in use", or why not
    except ImportError:
        pass
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env
