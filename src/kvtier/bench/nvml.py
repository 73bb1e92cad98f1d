"""What the driver says about a GPU's place in the machine, through NVML (pynvml from nvidia-ml-py):
driver and CUDA driver version, PCIe link (generation, width: current and max), PCI bus id, the NUMA
node the GPU hangs off, clocks, and how it connects to the other GPUs.

Every NVML call is guarded: an old driver or binding lacking a call gives "unknown", not a crash.
The *current* PCIe generation drops at idle to save power (an idle H100 can report Gen1), so the
link a transfer gets is the *max* pair, and `probe` reads this right after its transfers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

UNKNOWN = "unknown"

# nvmlDeviceGetTopologyCommonAncestor levels, named as `nvidia-smi topo -m` names them
_TOPO_LEVELS = {0: "SELF", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _call(fn_name: str, *args: Any) -> Any:
    """pynvml.<fn_name>(*args), or UNKNOWN when the binding or the driver lacks it."""
    import pynvml

    fn = getattr(pynvml, fn_name, None)
    if fn is None:
        return UNKNOWN
    try:
        return _text(fn(*args))
    except Exception:  # NVMLError_NotSupported, NoPermission, FunctionNotFound ...
        return UNKNOWN


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:1B:00.0" -> sysfs's "0000:1b:00.0"."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def numa_node_from_sysfs(nvml_bus_id: str, root: str = "/sys/bus/pci/devices") -> int | str:
    try:
        return int((Path(root) / sysfs_bus_id(nvml_bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return UNKNOWN


def _handle(pynvml: Any, uuid: str | None, bus_id: str | None, index: int):
    """The NVML handle of the GPU torch calls `index`: by UUID, then bus id (CUDA and NVML may
    number GPUs differently, e.g. under CUDA_VISIBLE_DEVICES), then by index."""
    if uuid:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception:
            pass
    if bus_id:
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except Exception:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def read(index: int = 0, *, uuid: str | None = None, bus_id: str | None = None) -> dict:
    """A JSON-ready dict about one GPU; {"error": ...} when NVML cannot be used at all."""
    try:
        import pynvml
    except ImportError:
        return {"error": "pynvml (package nvidia-ml-py) is not installed"}
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return {"error": f"NVML is not available ({type(e).__name__}: {e})"}
    try:
        try:
            h = _handle(pynvml, uuid, bus_id, index)
        except Exception as e:
            return {"error": f"NVML finds no GPU {index} ({type(e).__name__}: {e})"}
        cuda = _call("nvmlSystemGetCudaDriverVersion")
        pci = _call("nvmlDeviceGetPciInfo", h)
        nvml_bus = _text(getattr(pci, "busId", None)) if pci != UNKNOWN else None
        numa = _call("nvmlDeviceGetNumaNodeId", h)
        if numa == UNKNOWN and nvml_bus:
            numa = numa_node_from_sysfs(nvml_bus)
        return {
            "name": _call("nvmlDeviceGetName", h),
            "driver": _call("nvmlSystemGetDriverVersion"),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else cuda,
            "pci_bus_id": nvml_bus or UNKNOWN,
            "numa_node": numa,  # -1: the platform reports no NUMA affinity (one node)
            "pcie": {
                "gen_current": _call("nvmlDeviceGetCurrPcieLinkGeneration", h),
                "gen_max": _call("nvmlDeviceGetMaxPcieLinkGeneration", h),  # GPU and slot together
                "gen_gpu_max": _call("nvmlDeviceGetGpuMaxPcieLinkGeneration", h),
                "width_current": _call("nvmlDeviceGetCurrPcieLinkWidth", h),
                "width_max": _call("nvmlDeviceGetMaxPcieLinkWidth", h),
            },
            "clocks_mhz": {
                "sm": _call("nvmlDeviceGetClockInfo", h, getattr(pynvml, "NVML_CLOCK_SM", 1)),
                "sm_max": _call("nvmlDeviceGetMaxClockInfo", h, getattr(pynvml, "NVML_CLOCK_SM", 1)),
                "mem": _call("nvmlDeviceGetClockInfo", h, getattr(pynvml, "NVML_CLOCK_MEM", 2)),
                "mem_max": _call("nvmlDeviceGetMaxClockInfo", h, getattr(pynvml, "NVML_CLOCK_MEM", 2)),
            },
            "nvlinks_active": _nvlinks(pynvml, h),
            "peers": _peers(pynvml, h),
        }
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _active_links(pynvml: Any, h: Any) -> list[int]:
    """The NVLinks of `h` that are up."""
    up = []
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        state = _call("nvmlDeviceGetNvLinkState", h, link)
        if state == UNKNOWN:
            break  # no NVLink, or no more links
        if state == getattr(pynvml, "NVML_FEATURE_ENABLED", 1):
            up.append(link)
    return up


def _nvlinks(pynvml: Any, h: Any) -> int | str:
    return len(_active_links(pynvml, h))


def _bus(h: Any) -> str | None:
    info = _call("nvmlDeviceGetPciInfo", h)
    return None if info == UNKNOWN else _text(getattr(info, "busId", None))


def _peers(pynvml: Any, h: Any) -> list[dict]:
    """How this GPU reaches every other GPU (nvidia-smi topo's PIX/PXB/PHB/NODE/SYS)."""
    count = _call("nvmlDeviceGetCount")
    peers = []
    for j in range(count if isinstance(count, int) else 0):
        try:
            other = pynvml.nvmlDeviceGetHandleByIndex(j)
        except Exception:
            continue
        if _bus(other) == _bus(h):
            continue  # itself
        nv = _nvlink_path(pynvml, h, other)
        level = _call("nvmlDeviceGetTopologyCommonAncestor", h, other)
        peers.append({"nvml_index": j, "path": nv or _TOPO_LEVELS.get(level, str(level))})
    return peers


def _nvlink_path(pynvml: Any, h: Any, other: Any) -> str | None:
    """ "NV<links>" when NVLink joins the two GPUs (as `nvidia-smi topo -m` says), else None. The
    common-ancestor call only knows PCIe: two NVLinked GPUs under one host bridge read "PHB"."""
    bus = _bus(other)
    direct = 0
    for link in _active_links(pynvml, h):
        remote = _call("nvmlDeviceGetNvLinkRemotePciInfo_v2", h, link)
        direct += int(remote != UNKNOWN and bus is not None and _text(getattr(remote, "busId", None)) == bus)
    if direct:
        return f"NV{direct}"
    # through an NVSwitch the links end at the switch: ask whether P2P goes over NVLink
    status = _call("nvmlDeviceGetP2PStatus", h, other, getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
    if status == getattr(pynvml, "NVML_P2P_STATUS_OK", 0):
        links = _nvlinks(pynvml, h)
        return f"NV{links}" if isinstance(links, int) and links else None
    return None
