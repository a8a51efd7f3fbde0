"""CLQueue: an OpenCL device's in-order command queue as a HAL queue (see :mod:`polyhal_gpu.queue`).

Its command queue is the device's own (``CLDevice.queue``). Signals are marker events
(``clEnqueueMarkerWithWaitList``) enqueued after the work; a host wait is ``clWaitForEvents``;
another queue of the same OpenCL context waits on the device with a marker whose wait list holds
the event. OpenCL events belong to a context, and polyhal makes one context per device, so the
domain is the context: queues of other devices (and other backends) wait through the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polyhal_gpu.queue import EventFence, EventQueue
from polyhal_opencl.errors import check

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the OpenCL device; its module imports this one


def _query(event: Any) -> bool:
    import pyopencl as cl

    with check("querying an OpenCL event"):
        status = event.command_execution_status
    # A negative status is an error: "done", and synchronize raises it.
    return status == cl.command_execution_status.COMPLETE or status < 0


def _synchronize(event: Any) -> None:
    with check("waiting for an OpenCL event"):
        event.wait()


class CLQueue(EventQueue):
    """The device's command queue as a HAL queue: markers as signals, wait lists as waits."""

    def __init__(self, device: "Device", name: str | None = None, timeout: float | None = None) -> None:
        super().__init__(device, name or f"{device.name}/queue0", timeout)
        #: OpenCL events can be waited for by queues of their own context only.
        self.domain = ("opencl", device.context.int_ptr)

    def _record(self) -> EventFence:
        import pyopencl as cl

        with check(f"enqueueing a marker on {self.name}"):
            event = cl.enqueue_marker(self.device.queue)
        return EventFence(event, self.domain, _query, _synchronize)

    def _device_wait(self, fence: EventFence) -> None:
        import pyopencl as cl

        with check(f"ordering {self.name} after an OpenCL event"):
            cl.enqueue_marker(self.device.queue, wait_for=[fence.event])
