"""Streams, events, flags and pinned memory behind one interface: `CudaDevice` and `SimDevice`."""

from kvtier.device.base import Device, DeviceError, Event, FlagBatch, FlagOp, Flags, Stream
from kvtier.device.cuda import CudaDevice
from kvtier.device.sim import SimDevice

__all__ = [
    "CudaDevice",
    "Device",
    "DeviceError",
    "Event",
    "FlagBatch",
    "FlagOp",
    "Flags",
    "SimDevice",
    "Stream",
]
