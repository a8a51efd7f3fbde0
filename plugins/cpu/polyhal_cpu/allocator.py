"""CPUAllocator: 64-byte aligned host memory from numpy.

On the CPU the host *is* the device, so one heap serves everything: its memory type is
HOST_LOCAL | DEVICE_LOCAL | HOST_CACHED — device-local because no memory is closer to the CPU's
kernels, host-visible and coherent because it is ordinary host memory.
"""

from __future__ import annotations

import os

import numpy as np

from polyhal.hal.allocator import Allocator
from polyhal.hal.flags import MAPPABLE_BUFFER_USAGE, BufferKind, MemoryType
from polyhal.hal.records import Heap

ALIGNMENT = 64


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: a generous fixed cap
        return 1 << 40


def host_heap() -> Heap:
    """The CPU device's single heap."""
    # Plain buffers, mappable: the CPU backend has no image (texture) kernels.
    usage = MAPPABLE_BUFFER_USAGE
    return Heap(
        memory_type=MemoryType.HOST_LOCAL | MemoryType.DEVICE_LOCAL | MemoryType.HOST_CACHED,
        allowed_usage=usage, max_allocation_size=_physical_memory(), kind=BufferKind.HOST,
        alignment=ALIGNMENT,
    )


class CPUAllocator(Allocator):
    """Aligned numpy byte arrays; freeing drops the reference."""

    def _allocate(self, heap: Heap, nbytes: int) -> np.ndarray:
        raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)  # MemoryError on failure
        start = -raw.ctypes.data % ALIGNMENT
        return raw[start: start + nbytes]

    def _free(self, heap: Heap, native: np.ndarray) -> None:
        pass  # numpy frees the memory when the last view goes
