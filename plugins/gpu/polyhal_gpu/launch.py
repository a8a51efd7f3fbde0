"""Launch shapes shared by the CUDA C kernels on CUDA and HIP."""

from __future__ import annotations

from typing import Any

import numpy as np

#: Threads per block of the grid-stride kernels (and of the radix sort's tiles).
BLOCK = 256
#: A null device address as a kernel argument (an absent output, scratch in shared memory).
NULL = np.uint64(0)


def multiprocessors(device: Any) -> int:
    """The device's SMs (CUDA) or CUs (HIP), at least 1."""
    return int(device.spec.limits.get("multiprocessors", 1)) or 1


def grid(total: int, multiprocessors: int, block: int = BLOCK, per_multiprocessor: int = 32) -> tuple[int]:
    """A 1-D grid-stride launch over ``total`` items: one thread each, but no more than
    ``per_multiprocessor`` blocks per multiprocessor (the kernels loop over the rest)."""
    return (max(1, min(-(-total // block), (multiprocessors or 1) * per_multiprocessor)),)
