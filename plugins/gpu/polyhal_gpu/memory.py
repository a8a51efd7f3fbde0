"""Memory commons of the CUDA and HIP backends: usages, memory types, ``allocate(kind=...)``.

Both backends hand kernels raw device addresses, so their buffers serve every usage but images
(:data:`DEVICE_USAGE`), plus mapping where the host sees the memory (:data:`HOST_USAGE`). Both
have managed memory (:data:`MANAGED_MEMORY`) and pinned host memory that kernels reach at the
same address (:data:`PINNED_MEMORY`), and both let a device-local allocation name its kind --
DEVICE (the backend's ordinary device memory) or ASYNC (its stream-ordered pool):
:class:`GPUAllocator`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from polyhal.errors import DLPackError, IncompatibleBufferError
from polyhal.hal.allocator import Allocator
from polyhal.hal.buffer import Buffer
from polyhal.hal.flags import BUFFER_USAGE, MAPPABLE_BUFFER_USAGE, BufferKind, BufferUsage, MemoryType
from polyhal.hal.records import Heap

#: Alignment of every buffer (CUDA and HIP allocations are 256-byte aligned).
ALIGNMENT = 256

#: Device memory: plain buffers (kernels take pointers), no mapping.
DEVICE_USAGE = BUFFER_USAGE
#: Host-visible memory (managed, pinned): device usages plus mapping.
HOST_USAGE = MAPPABLE_BUFFER_USAGE

#: Managed (unified) memory: device-local, and the host maps it at the same address.
MANAGED_MEMORY = MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE | MemoryType.HOST_COHERENT
#: Pinned, mapped host memory: kernels read it over the bus at the same address.
PINNED_MEMORY = MemoryType.HOST_LOCAL | MemoryType.DEVICE_VISIBLE


def host_memory_bytes() -> int:
    """The host's physical memory (the largest pinned allocation), or 1 TiB where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def import_extent(imported: Any, importer: str) -> int:
    """Bytes a DLPack import spans from its data pointer (0 when it has no element). Negative
    strides are refused with a :class:`~polyhal.DLPackError` naming ``importer`` (the device)."""
    if not all(d > 0 for d in imported.shape):
        return 0
    if any(s < 0 for s in imported.strides):
        raise DLPackError(f"{importer} cannot import a tensor with negative strides {imported.strides}; make it "
                          "contiguous first (e.g. .copy())")
    return (sum((d - 1) * s for d, s in zip(imported.shape, imported.strides)) + 1) * imported.dtype.itemsize


class GPUAllocator(Allocator):
    """The part of the CUDA and HIP allocators that is the same: ``allocate(..., kind=...)``.

    A subclass says where the device reports stream-ordered pools (:attr:`async_pool_limit`,
    a key of ``spec.limits``) and, in its own words, why an ASYNC buffer cannot be had without
    them; its ``_allocate`` asks :meth:`requested_kind` which kind to make.
    """

    #: The ``spec.limits`` key that is true where the device has stream-ordered memory pools.
    async_pool_limit = "async_pool_supported"
    #: What an ASYNC request is told on a device without them (``{device}``: the device's name).
    no_async_pool = "{device} has no stream-ordered memory pool; allocate kind=DEVICE instead"
    #: Where the kinds that cannot be asked for come from.
    other_kinds_from = "the memory type"

    def __init__(self, device: Any, heaps: tuple[Heap, ...]) -> None:
        super().__init__(device, heaps)
        self._requested = threading.local()

    def allocate(self, nbytes: int, memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
                 usage: BufferUsage = BufferUsage.DEFAULT, *, kind: BufferKind | None = None) -> Buffer:
        """As :meth:`polyhal.Allocator.allocate`; ``kind`` (DEVICE or ASYNC) picks where a
        device-local buffer comes from, whatever the device's default pool."""
        if kind is None:
            return super().allocate(nbytes, memory_type, usage)
        if kind not in (BufferKind.DEVICE, BufferKind.ASYNC):
            raise IncompatibleBufferError(f"kind={kind.value} cannot be asked for; DEVICE and ASYNC can (device-local "
                                          f"memory), the other kinds follow from {self.other_kinds_from}")
        heap = self.select_heap(memory_type, usage)
        if heap is not None and heap.memory_type & MemoryType.HOST_VISIBLE:
            raise IncompatibleBufferError(f"kind={kind.value} is device-local memory, but memory type "
                                          f"{MemoryType(memory_type).describe()} selects {heap.memory_type.describe()}")
        if kind is BufferKind.ASYNC and not self.device.spec.limits.get(self.async_pool_limit, False):
            raise IncompatibleBufferError(self.no_async_pool.format(device=self.device.name))
        self._requested.kind = kind
        try:
            buf = super().allocate(nbytes, memory_type, usage)
        finally:
            self._requested.kind = None
        buf.kind = kind
        return buf

    def requested_kind(self, heap: Heap) -> BufferKind:
        """The kind ``_allocate`` makes: the one asked for with ``kind=``, else the heap's."""
        return getattr(self._requested, "kind", None) or heap.kind
