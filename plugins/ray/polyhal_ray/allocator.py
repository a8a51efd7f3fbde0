"""RemoteAllocator: memory on a node, allocated in the node's runtime.

A buffer's native handle is its id on the node (an int chosen here). Allocation is a command of
the node's stream, so a plan that allocates its outputs on every run sends no extra round trip;
an allocation of :data:`CONFIRMED_BYTES` or more is confirmed at once, so that an out-of-memory
on the node is raised where the allocation is made (naming node and device), not at the next read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from polyhal import Allocator, BufferKind, BufferUsage, Heap, MemoryType
from polyhal.hal.flags import MAPPING_USAGE

from polyhal_ray.worker import ALLOC, FREE

if TYPE_CHECKING:
    from polyhal_ray.device import RemoteDevice

#: Allocations this large are confirmed by the node before ``allocate`` returns (one round trip,
#: small beside moving that many bytes).
CONFIRMED_BYTES = 16 << 20

#: Bits a remote heap never has: the driver cannot map memory of another process or machine.
_HOST_BITS = int(MemoryType.HOST_LOCAL | MemoryType.HOST_CACHED)


def remote_heap(node_heap: Heap) -> Heap:
    """The heap a remote device offers for one heap of its node's device: the same memory, seen
    from the driver as device-local and not mappable."""
    memory_type = MemoryType((int(node_heap.memory_type) & ~_HOST_BITS) | int(MemoryType.DEVICE_LOCAL))
    usage = BufferUsage(int(node_heap.allowed_usage) & ~int(MAPPING_USAGE))
    return Heap(memory_type, usage, node_heap.max_allocation_size, BufferKind.DEVICE, node_heap.alignment)


class RemoteAllocator(Allocator):
    """Allocates on the node's device; ``node_heaps[i]`` is the node's heap behind ``heaps[i]``."""

    device: "RemoteDevice"

    def __init__(self, device: "RemoteDevice", heaps: tuple[Heap, ...], node_heaps: tuple[Heap, ...]) -> None:
        super().__init__(device, heaps)
        self._node_heap = dict(zip(heaps, node_heaps))

    def _allocate(self, heap: Heap, nbytes: int) -> int:
        device = self.device
        node_heap = self._node_heap[heap]
        bid = device.session.new_id()
        command = (ALLOC, bid, device.local_name, nbytes, int(node_heap.memory_type), int(BufferUsage.DEFAULT))
        if nbytes >= CONFIRMED_BYTES:  # (a smaller one that fails on the node says so at the next wait)
            free = device.memory_available()
            if free is not None and nbytes > free:
                raise MemoryError(f"node {device.session.name} has {free} B available for {device.local_name}")
            device.session.call(command)
        else:
            device.session.enqueue(command)
        return bid

    def _free(self, heap: Heap, native: int) -> None:
        self.device.session.discard((FREE, native))
