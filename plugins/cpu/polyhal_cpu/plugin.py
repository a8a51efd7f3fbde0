"""The CPU backend's hooks: one device per logical CPU device (``POLYHAL_CPU_DEVICES``, default 1).

Several logical CPU devices share the host's memory and cores; they exist so that multi-device
placement and every device policy can be exercised on a machine without accelerators.
"""

from __future__ import annotations

import os

import polyhal
from polyhal.hal.records import DeviceSpec

from polyhal_cpu.allocator import host_heap
from polyhal_cpu.device import CPUDevice

POLYHAL_API_VERSION = polyhal.API_VERSION


def _device_count() -> int:
    raw = os.environ.get("POLYHAL_CPU_DEVICES", "1")
    try:
        n = int(raw)
    except ValueError:
        raise polyhal.PluginError(f"POLYHAL_CPU_DEVICES={raw!r} is not an integer; set it to a count such as 2")
    if not 1 <= n <= 64:
        raise polyhal.PluginError(f"POLYHAL_CPU_DEVICES={n} is outside 1..64")
    return n


@polyhal.hookimpl
def register_devices():
    """One DeviceSpec per logical CPU device; creating the device is deferred to first use."""
    heap = host_heap()
    return [
        DeviceSpec(
            name=f"cpu:{i}", backend="cpu", rank=0, factory=CPUDevice, heaps=(heap,),
            workgroup_bytes=0, capabilities=frozenset({"host", "fp16", "fp64"}),
            limits={"ordinal": i, "cores": os.cpu_count() or 1, "max_allocation_bytes": heap.max_allocation_size},
            dlpack_devices=frozenset({(1, 0)}) if i == 0 else frozenset(),
            description=f"numpy on the host CPU ({os.cpu_count()} cores)",
        )
        for i in range(_device_count())
    ]
