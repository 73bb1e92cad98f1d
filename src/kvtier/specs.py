"""Datasheet figures of GPUs and links, each with its source; measured ceilings override them.

Units: GB/s and TB/s are decimal (1e9, 1e12 bytes per second); memory sizes in GB (1e9) as
vendors print them; TFLOPS are dense (no 2:4 sparsity) figures. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtier.ceilings import Ceilings

H100_DS = "NVIDIA H100 Tensor Core GPU datasheet (2023); dense = sparsity figure / 2"
H200_DS = "NVIDIA H200 Tensor Core GPU datasheet (2024); dense = sparsity figure / 2"
A100_DS = "NVIDIA A100 Tensor Core GPU datasheet (2021)"
L40S_DS = "NVIDIA L40S datasheet (2023); dense = sparsity figure / 2"
B200_DS = "NVIDIA DGX/HGX B200 datasheets (2024), per GPU; dense = sparsity figure / 2"
ARCH_WP = "NVIDIA architecture whitepapers (Ampere GA100, Hopper GH100, Ada AD102, Blackwell)"


@dataclass(frozen=True, slots=True)
class GPU:
    key: str
    name: str
    sms: int
    l2_mb: float
    mem_gb: float
    mem_bw_gbps: float  # HBM/GDDR bandwidth, GB/s (one number for read + write)
    bf16_tflops: float
    fp16_tflops: float
    fp8_tflops: float | None  # None: no fp8 tensor cores
    pcie_gen: int
    source: str
    sm_source: str = ARCH_WP
    measured: tuple[str, ...] = ()  # fields replaced by measured ceilings

    @property
    def balance(self) -> float:
        """FLOP per byte at which bf16 compute time equals memory time (the roofline's ridge)."""
        return self.bf16_tflops * 1e12 / (self.mem_bw_gbps * 1e9)

    def peak_tflops(self, dtype: str = "bf16") -> float:
        rate = {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp8": self.fp8_tflops}.get(dtype)
        if rate is None:
            raise ValueError(f"dtype: {self.name} has no {dtype} tensor-core rate")
        return rate


@dataclass(frozen=True, slots=True)
class Link:
    key: str
    name: str
    theoretical_gbps: float  # per direction
    typical_gbps: float  # per direction, what transfers really reach
    latency_us: float  # one transfer's fixed cost
    source: str
    kind: str = "pcie"  # pcie | nvlink | nic | nvme | dram

    def gbps(self, achieved: bool = True) -> float:
        return self.typical_gbps if achieved else self.theoretical_gbps


def _gpu(key, name, sms, l2, mem, bw, bf16, fp8, gen, src, sm_src=ARCH_WP) -> GPU:
    return GPU(key, name, sms, l2, mem, bw, bf16, bf16, fp8, gen, src, sm_src)


GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        _gpu("h100-sxm", "NVIDIA H100 SXM", 132, 50, 80, 3350, 989.4, 1978.9, 5, H100_DS),
        _gpu("h100-pcie", "NVIDIA H100 PCIe", 114, 50, 80, 2000, 756.5, 1513.0, 5, H100_DS),
        _gpu(
            "h200",
            "NVIDIA H200",
            132,
            60,
            141,
            4800,
            989.4,
            1978.9,
            5,
            H200_DS,
            "torch.cuda.get_device_properties on kvtier's H200: 132 SMs, 60 MB L2",
        ),
        _gpu("a100-80gb", "NVIDIA A100 80GB SXM", 108, 40, 80, 2039, 312.0, None, 4, A100_DS),
        _gpu("l40s", "NVIDIA L40S", 142, 96, 48, 864, 362.05, 733.0, 4, L40S_DS),
        _gpu("b200", "NVIDIA B200", 148, 126, 180, 8000, 2250.0, 4500.0, 6, B200_DS),
    )
}

# Driver names that map to a key (first match on a lower-cased substring wins, so order matters).
_NAME_HINTS = (
    ("h100 pcie", "h100-pcie"),
    ("h100", "h100-sxm"),
    ("h200", "h200"),
    ("a100", "a100-80gb"),
    ("l40s", "l40s"),
    ("b200", "b200"),
)

PCIE_SPEC = "PCI-SIG base specifications: GT/s x 16 lanes, 128b/130b (Gen3-5), FLIT 242/256 (Gen6)"
SEED = "kvtier seed section 5.2 (Gen4 ~25 GB/s real; 1 GiB in ~42 ms at 24 GiB/s; Gen5 ~50 GB/s)"

LINKS: dict[str, Link] = {
    x.key: x
    for x in (
        Link("pcie3", "PCIe Gen3 x16", 15.75, 12.0, 10, PCIE_SPEC + "; typical: ~76% as commonly measured"),
        Link("pcie4", "PCIe Gen4 x16", 31.5, 24 * 1.073741824, 10, PCIE_SPEC + "; typical: " + SEED),
        Link("pcie5", "PCIe Gen5 x16", 63.0, 50.0, 10, PCIE_SPEC + "; typical: " + SEED),
        Link("pcie6", "PCIe Gen6 x16", 121.0, 100.0, 10, PCIE_SPEC + "; typical: estimate, ~80% as Gen5"),
        Link(
            "nvlink4",
            "NVLink 4 (H100/H200, 18 links)",
            450.0,
            370.0,
            5,
            "NVIDIA H100 datasheet: 900 GB/s bidirectional; typical: ~82% as nccl-tests bus bandwidth",
            "nvlink",
        ),
        Link(
            "nvlink5",
            "NVLink 5 (B200, 18 links)",
            900.0,
            740.0,
            5,
            "NVIDIA B200 datasheet: 1.8 TB/s bidirectional; typical: ~82% as NVLink 4",
            "nvlink",
        ),
        Link(
            "nic100",
            "100 Gb/s NIC (RDMA)",
            12.5,
            11.5,
            5,
            "line rate / 8; typical ~92% as ib_write_bw",
            "nic",
        ),
        Link(
            "nic200",
            "200 Gb/s NIC (RDMA)",
            25.0,
            23.0,
            5,
            "line rate / 8; typical ~92% as ib_write_bw",
            "nic",
        ),
        Link(
            "nic400",
            "400 Gb/s NIC (RDMA)",
            50.0,
            46.0,
            5,
            "line rate / 8; typical ~92% as ib_write_bw",
            "nic",
        ),
        Link(
            "nvme",
            "NVMe SSD, PCIe Gen4 x4",
            7.88,
            7.0,
            80,
            "link: PCIe Gen4 x4; typical: vendor sequential read of current Gen4 SSDs (~7 GB/s)",
            "nvme",
        ),
        Link(
            "dram",
            "Host DRAM, DDR5-4800 x 8 channels",
            307.2,
            200.0,
            0.1,
            "JEDEC DDR5-4800: 38.4 GB/s per channel; typical ~65% as STREAM copy",
            "dram",
        ),
    )
}


def _unknown(kind: str, name: str, known) -> ValueError:
    return ValueError(f"{kind}: unknown {kind} {name!r}; known: {', '.join(sorted(known))}")


def get_gpu(key: str, ceilings: Ceilings | None = None) -> GPU:
    """The GPU with key `key` (see GPUS); measured ceilings, when given, replace datasheet figures."""
    gpu = GPUS.get(key.lower())
    if gpu is None:
        raise _unknown("gpu", key, GPUS)
    if ceilings is None:
        return gpu
    if ceilings.gpu_key not in (None, gpu.key):
        raise ValueError(f"ceilings: measured on {ceilings.gpu_key!r}, cannot stand for gpu {gpu.key!r}")
    return apply_ceilings(gpu, ceilings)


def get_link(key: str) -> Link:
    link = LINKS.get(key.lower())
    if link is None:
        raise _unknown("link", key, LINKS)
    return link


def gpu_from_device_name(device_name: str) -> GPU | None:
    """Map a driver name ("NVIDIA H200", "NVIDIA H100 80GB HBM3") to a known GPU, or None."""
    low = device_name.lower()
    for hint, key in _NAME_HINTS:
        if hint in low:
            return GPUS[key]
    return None


def apply_ceilings(gpu: GPU, ceilings: Ceilings) -> GPU:
    """Replace memory bandwidth and bf16 rate by what was measured on this machine.

    A device-to-device copy counts bytes read + written, which is the same quantity as the
    datasheet's memory bandwidth (both directions of HBM traffic together).
    """
    changes, measured = {}, []
    if (bw := ceilings.get("d2d_copy_gbps")) is not None:
        changes["mem_bw_gbps"] = bw
        measured.append("mem_bw_gbps")
    if (tf := ceilings.get("bf16_tflops")) is not None:
        changes["bf16_tflops"] = tf
        measured.append("bf16_tflops")
    if not changes:
        return gpu
    return dataclasses.replace(gpu, **changes, measured=tuple(measured), source=gpu.source + " + measured")


def measured_host_link(base: Link, ceilings: Ceilings | None, direction: str = "h2d") -> Link:
    """`base` with its achieved bandwidth replaced by the probed pinned copy rate, if any."""
    if ceilings is None:
        return base
    value = ceilings.get("h2d_pinned_gbps" if direction == "h2d" else "d2h_pinned_gbps")
    if value is None:
        return base
    where = ceilings.gpu or "this machine"
    return dataclasses.replace(base, typical_gbps=value, source=f"measured by kvtier probe on {where}")
