"""CUDAQueue: a CUDA device's stream as a HAL queue (see :mod:`polyhal_gpu.queue`).

Its stream is the device's own (``CUDADevice.stream``), so work a queue issues is ordered with
everything else polyhal puts on that GPU. Signals are CUDA events recorded on the stream after
the work (``cudaEventRecord``, timing disabled: the cheapest kind); a host wait is
``cudaEventSynchronize``; another CUDA queue -- of this GPU or another GPU of the process --
waits with ``cudaStreamWaitEvent``, never through the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polyhal_cuda.errors import check
from polyhal_gpu.queue import EventFence, EventQueue

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Any CUDA stream of the process can wait for any CUDA event of the process.
DOMAIN = "cuda"


def _query(event: Any) -> bool:
    with check("querying a CUDA event"):
        return bool(event.done)


def _synchronize(event: Any) -> None:
    with check("waiting for a CUDA event"):
        event.synchronize()


class CUDAQueue(EventQueue):
    """The device's stream as a queue: issue on the stream, signal with recorded events."""

    domain = DOMAIN

    def __init__(self, device: "Device", name: str | None = None, timeout: float | None = None) -> None:
        super().__init__(device, name or f"{device.name}/stream0", timeout)

    def _record(self) -> EventFence:
        import cupy

        device = self.device
        with check(f"recording an event on {self.name}"), device.activate():
            event = cupy.cuda.Event(disable_timing=True)
            event.record(device.stream)
        return EventFence(event, DOMAIN, _query, _synchronize)

    def _device_wait(self, fence: EventFence) -> None:
        device = self.device
        with check(f"ordering {self.name} after a CUDA event"), device.activate():
            device.stream.wait_event(fence.event)
