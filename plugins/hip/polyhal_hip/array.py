"""HipArray: the native object a HIP device hands its kernels for a tensor (``Device.view``).

A device address with a shape, an element type and element strides -- no methods that compute:
kernels take ``HipArray`` arguments as their device address (:func:`polyhal_hip.launch.pack`).
``owner`` keeps the memory alive (the buffer's native handle).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from polyhal.dlpack import row_major_strides


class HipArray:
    """``ptr`` (device address of element 0), ``shape``, ``dtype``, ``strides`` (in elements)."""

    __slots__ = ("ptr", "shape", "dtype", "strides", "owner")

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: Any, strides: tuple[int, ...] | None = None,
                 owner: Any = None) -> None:
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.strides = row_major_strides(self.shape) if strides is None else tuple(int(s) for s in strides)
        self.owner = owner

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_contiguous(self) -> bool:
        return self.size <= 1 or self.strides == row_major_strides(self.shape)

    @property
    def extent_bytes(self) -> int:
        """Bytes from element 0 to one past the last element (non-negative strides)."""
        if self.size == 0:
            return 0
        return (sum((d - 1) * s for d, s in zip(self.shape, self.strides)) + 1) * self.dtype.itemsize

    def reshape(self, shape: tuple[int, ...]) -> "HipArray":
        """A contiguous array seen with another shape of the same size."""
        if not self.is_contiguous or math.prod(shape) != self.size:
            raise ValueError(f"cannot view {self} as shape {shape}")
        return HipArray(self.ptr, tuple(shape), self.dtype, None, self.owner)

    def __repr__(self) -> str:
        return f"<HipArray {self.dtype}{list(self.shape)} at {self.ptr:#x}>"
