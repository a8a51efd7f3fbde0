"""MyAllocator: the device's memory. The base class validates requests, keeps statistics and
turns MemoryError into an out-of-memory error that says what is in use; a backend implements
only ``_allocate`` and ``_free``."""

import numpy as np

from polyhal import Allocator, BufferKind, Heap, MemoryType
from polyhal.hal.flags import MAPPABLE_BUFFER_USAGE

#: The one heap: device memory the host can map (as on a GPU that shares the host's RAM).
HEAP = Heap(MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE | MemoryType.HOST_COHERENT,
            MAPPABLE_BUFFER_USAGE, max_allocation_size=1 << 32, kind=BufferKind.DEVICE)


class MyAllocator(Allocator):
    """Buffers are numpy byte arrays (a real backend returns its device's handle)."""

    def _allocate(self, heap: Heap, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def _free(self, heap: Heap, native: np.ndarray) -> None:
        pass  # numpy frees the array with its last reference
