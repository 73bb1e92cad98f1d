"""NVML reads are guarded: a missing driver or call gives 'unknown' / an error entry, never a crash."""

import sys
import types

import pytest

from kvtier.bench import datasheet, nvml


def test_sysfs_bus_id():
    assert nvml.sysfs_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert nvml.sysfs_bus_id("00000001:C3:00.0") == "0001:c3:00.0"


def test_numa_node_from_sysfs(tmp_path):
    d = tmp_path / "0000:1b:00.0"
    d.mkdir()
    (d / "numa_node").write_text("1\n")
    assert nvml.numa_node_from_sysfs("00000000:1B:00.0", root=str(tmp_path)) == 1
    assert nvml.numa_node_from_sysfs("00000000:2B:00.0", root=str(tmp_path)) == nvml.UNKNOWN


class _Err(Exception):
    pass


def _fake_pynvml(**overrides):
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: None
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    m.nvmlDeviceGetHandleByUUID = lambda u: (_ for _ in ()).throw(_Err("no uuid"))
    m.nvmlSystemGetDriverVersion = lambda: b"580.1"
    m.nvmlSystemGetCudaDriverVersion = lambda: 13000
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:1B:00.0" if h == "h0" else b"X")
    m.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: (_ for _ in ()).throw(_Err("NotSupported"))
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: 40
    # nvmlDeviceGetNumaNodeId, clocks, NVLink and GpuMaxPcieLinkGeneration are absent: an old binding
    for k, v in overrides.items():
        setattr(m, k, v)
    return m


def test_read_with_partial_binding(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    monkeypatch.setattr(nvml, "numa_node_from_sysfs", lambda bus: 0)
    info = nvml.read(0, uuid="abc")
    assert info["name"] == "NVIDIA H200" and info["driver"] == "580.1" and info["cuda_driver"] == "13.0"
    assert info["pcie"]["gen_max"] == 5 and info["pcie"]["width_current"] == 16
    assert info["pcie"]["width_max"] == nvml.UNKNOWN and info["pcie"]["gen_gpu_max"] == nvml.UNKNOWN
    assert info["numa_node"] == 0  # from sysfs, since the binding lacks nvmlDeviceGetNumaNodeId
    assert info["clocks_mhz"]["sm"] == nvml.UNKNOWN
    assert info["peers"] == [{"nvml_index": 1, "path": "NODE"}]


def test_nvlink_peers_read_nv(monkeypatch):
    """Two GPUs under one host bridge, joined by 18 NVLinks: "NV18" (as nvidia-smi), not "PHB"."""
    bus = {"h0": b"00000000:1B:00.0", "h1": b"00000000:2B:00.0"}
    fake = _fake_pynvml(
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=bus[h]),
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 30,  # PHB
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < 18 else (_ for _ in ()).throw(_Err("bad link")),
        nvmlDeviceGetNvLinkRemotePciInfo_v2=lambda h, link: types.SimpleNamespace(
            busId=bus["h1" if h == "h0" else "h0"]
        ),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(nvml, "numa_node_from_sysfs", lambda bus: 0)
    assert nvml.read(0)["peers"] == [{"nvml_index": 1, "path": "NV18"}]
    # through a switch: the links end elsewhere, the P2P status says NVLink
    fake.nvmlDeviceGetNvLinkRemotePciInfo_v2 = lambda h, link: types.SimpleNamespace(busId=b"switch")
    fake.nvmlDeviceGetP2PStatus = lambda a, b, cap: 0
    assert nvml.read(0)["peers"] == [{"nvml_index": 1, "path": "NV18"}]
    fake.nvmlDeviceGetP2PStatus = lambda a, b, cap: 4  # not supported over NVLink
    assert nvml.read(0)["peers"] == [{"nvml_index": 1, "path": "PHB"}]


def test_read_without_driver(monkeypatch):
    def boom():
        raise _Err("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(nvmlInit=boom))
    assert "Driver Not Loaded" in nvml.read(0)["error"]


def test_read_without_binding(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert "nvidia-ml-py" in nvml.read(0)["error"]


def test_datasheet_adapter_tolerates_unknowns():
    assert datasheet.pcie_link("unknown", 16) is None
    assert datasheet.gpu_spec(None) is None
    assert datasheet.reference_values(None, None) == {}
    link = {"name": "PCIe Gen5 x16", "theoretical_gbps": 63.0}
    refs = datasheet.reference_values(None, link)
    assert refs["h2d_pinned_gbps"][0] == 63.0 and refs["bidir_pinned_gbps"][0] == 126.0


def test_datasheet_with_specs_when_present():
    specs = pytest.importorskip("kvtier.specs")
    gpu = datasheet.gpu_spec("NVIDIA H200")
    if gpu is None:
        pytest.skip("kvtier.specs does not know the H200 yet")
    refs = datasheet.reference_values(gpu, datasheet.pcie_link(getattr(gpu, "pcie_gen", 5), 16))
    assert refs["d2d_copy_gbps"][0] == gpu.mem_bw_gbps
    assert "pcie5" in specs.LINKS
