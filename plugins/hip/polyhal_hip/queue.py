"""HIPQueue: an AMD GPU's stream as a HAL queue (see :mod:`polyhal_gpu.queue`).

The same shape as polyhal-cuda's CUDAQueue: its stream is the device's own
(``HIPDevice.stream``); signals are HIP events recorded after the work (``hipEventRecord``,
timing disabled); a host wait is ``hipEventSynchronize``; another HIP queue of the process waits
with ``hipStreamWaitEvent``. Events are destroyed (``hipEventDestroy``) when their fence goes.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from polyhal_gpu.queue import EventFence, EventQueue
from polyhal_hip import runtime as hip

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the HIP device; its module imports this one

#: Any HIP stream of the process can wait for any HIP event of the process.
DOMAIN = "hip"


class HIPQueue(EventQueue):
    """The device's stream as a queue: issue on the stream, signal with recorded events."""

    domain = DOMAIN

    def __init__(self, device: "Device", name: str | None = None, timeout: float | None = None) -> None:
        super().__init__(device, name or f"{device.name}/stream0", timeout)

    def _record(self) -> EventFence:
        device = self.device
        rt = device.runtime
        with device.activate():
            event = rt.event_create(hip.EVENT_DISABLE_TIMING)
            rt.event_record(event, device.stream)
        fence = EventFence(event, DOMAIN, rt.event_query, rt.event_synchronize)
        weakref.finalize(fence, rt.event_destroy, event)
        return fence

    def _device_wait(self, fence: EventFence) -> None:
        device = self.device
        with device.activate():
            device.runtime.stream_wait_event(device.stream, fence.event)
