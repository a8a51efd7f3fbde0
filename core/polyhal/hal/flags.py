"""The HAL vocabulary: memory types, buffer usages, memory access and buffer kinds.

Bit values are IREE's (``runtime/src/iree/hal/buffer.h``), so a reader who knows IREE knows
polyhal. An allocator may return more than was asked (more bits), never less.
"""

from __future__ import annotations

import enum


class MemoryType(enum.IntFlag):
    """Where memory lives and who can see it. 0 (``NONE``) means "no requirement"."""

    NONE = 0
    #: Let the allocator choose from the usage; valid only when allocating.
    OPTIMAL = 1 << 0
    #: The host can map it (CUDA managed/pinned, OpenCL ALLOC_HOST_PTR, all CPU memory).
    HOST_VISIBLE = 1 << 1
    #: Host and device see each other's writes without flush/invalidate.
    HOST_COHERENT = 1 << 2
    #: Cached on the host: reads are fast, but flush/invalidate are needed.
    HOST_CACHED = 1 << 3
    #: The device can use it, maybe slowly (e.g. over PCIe).
    DEVICE_VISIBLE = 1 << 4
    #: Fastest memory for the device (CUDA device memory, OpenCL buffers).
    DEVICE_LOCAL = DEVICE_VISIBLE | 1 << 5
    #: Ordinary host memory.
    HOST_LOCAL = HOST_VISIBLE | HOST_COHERENT | 1 << 6

    def describe(self) -> str:
        """``'DEVICE_LOCAL|HOST_VISIBLE'``: the composite names first, then leftover bits."""
        return _describe(self, (MemoryType.DEVICE_LOCAL, MemoryType.HOST_LOCAL))


class BufferUsage(enum.IntFlag):
    """What a buffer will be used for; lets an allocator pick memory and reject misuse."""

    NONE = 0
    TRANSFER_SOURCE = 1 << 0
    TRANSFER_TARGET = 1 << 1
    TRANSFER = TRANSFER_SOURCE | TRANSFER_TARGET
    DISPATCH_INDIRECT_PARAMETERS = 1 << 8
    DISPATCH_UNIFORM_READ = 1 << 9
    DISPATCH_STORAGE_READ = 1 << 10
    DISPATCH_STORAGE_WRITE = 1 << 11
    DISPATCH_STORAGE = DISPATCH_STORAGE_READ | DISPATCH_STORAGE_WRITE
    DISPATCH_IMAGE_READ = 1 << 12
    DISPATCH_IMAGE_WRITE = 1 << 13
    #: May be exported (DLPack) to another API or process.
    SHARING_EXPORT = 1 << 16
    SHARING_REPLICATE = 1 << 17
    SHARING_CONCURRENT = 1 << 18
    SHARING_IMMUTABLE = 1 << 19
    MAPPING_SCOPED = 1 << 24
    MAPPING_PERSISTENT = 1 << 25
    #: Mapping is welcome but not required (the allocator may return unmappable memory).
    MAPPING_OPTIONAL = 1 << 26
    MAPPING_ACCESS_RANDOM = 1 << 27
    MAPPING_ACCESS_SEQUENTIAL_WRITE = 1 << 28
    MAPPING = MAPPING_SCOPED | MAPPING_ACCESS_RANDOM
    DEFAULT = TRANSFER | DISPATCH_STORAGE

    def describe(self) -> str:
        """Human-readable form, composite names first."""
        return _describe(
            self,
            (BufferUsage.DEFAULT, BufferUsage.TRANSFER, BufferUsage.DISPATCH_STORAGE, BufferUsage.MAPPING),
        )


_IMAGE_USAGE = BufferUsage.DISPATCH_IMAGE_READ | BufferUsage.DISPATCH_IMAGE_WRITE
#: Every mapping usage bit (what MAPPING_OPTIONAL lets an allocator drop).
MAPPING_USAGE = (BufferUsage.MAPPING_SCOPED | BufferUsage.MAPPING_PERSISTENT | BufferUsage.MAPPING_OPTIONAL
                 | BufferUsage.MAPPING_ACCESS_RANDOM | BufferUsage.MAPPING_ACCESS_SEQUENTIAL_WRITE)
_EVERY_USAGE = BufferUsage(sum(int(u) for u in BufferUsage if u.value and u.value & (u.value - 1) == 0))
#: What a heap of plain buffers allows when kernels address memory by pointer: every usage but
#: images (no backend has image kernels) and mapping -- device-local GPU memory.
BUFFER_USAGE = _EVERY_USAGE & ~_IMAGE_USAGE & ~MAPPING_USAGE
#: The same plus every mapping usage: host-visible heaps (host memory, pinned, managed).
MAPPABLE_BUFFER_USAGE = BUFFER_USAGE | MAPPING_USAGE
#: What a host-visible heap that allows mapping grants every buffer, asked or not: IREE's heap
#: allocator (``allocator_heap.c``, ``query_buffer_compatibility``) adds exactly these bits,
#: because the host maps such memory to copy it. polyhal's host-visible memory is the host's
#: own (numpy, pinned, managed, OpenCL host memory mapped once): a map costs nothing there.
HOST_MAPPING_USAGE = (BufferUsage.MAPPING_SCOPED | BufferUsage.MAPPING_PERSISTENT
                      | BufferUsage.MAPPING_ACCESS_RANDOM)


class MemoryAccess(enum.IntFlag):
    """How a mapping will be accessed."""

    NONE = 0
    READ = 1
    WRITE = 2
    #: Previous contents may be dropped (no read-back when mapping for write).
    DISCARD = 4
    MAY_ALIAS = 8
    UNALIGNED = 16
    ANY = 32
    DISCARD_WRITE = WRITE | DISCARD
    ALL = READ | WRITE | DISCARD

    def describe(self) -> str:
        """``'READ|WRITE'``: the set bits by name."""
        return _describe(self, ())


class BufferKind(enum.Enum):
    """How a buffer's memory was obtained (IREE's HIP driver has exactly these)."""

    DEVICE = "device"  #: device memory from the device's allocator or pool
    HOST = "host"  #: pinned (page-locked) or plain host memory allocated by us
    HOST_REGISTERED = "host_registered"  #: existing host memory registered with the device
    ASYNC = "async"  #: device memory from a stream-ordered (async) pool
    MANAGED = "managed"  #: unified / managed memory, migrates between host and device
    EXTERNAL = "external"  #: imported (DLPack, raw pointer); never freed by polyhal


class BufferCompatibility(enum.IntFlag):
    """What an allocator can do with a (memory type, usage) request."""

    NONE = 0
    ALLOCATABLE = 1 << 0
    IMPORTABLE = 1 << 1
    EXPORTABLE = 1 << 2
    QUEUE_TRANSFER = 1 << 10
    QUEUE_DISPATCH = 1 << 11


def _describe(value: enum.IntFlag, composites: tuple[enum.IntFlag, ...]) -> str:
    if value == 0:
        return "NONE"
    parts, rest = [], int(value)
    for comp in composites:
        if comp and rest & comp == comp:
            parts.append(comp.name)
            rest &= ~comp
    for member in type(value):
        bit = int(member)
        if bit and bit & (bit - 1) == 0 and rest & bit:
            parts.append(member.name)
            rest &= ~bit
    return "|".join(parts)
