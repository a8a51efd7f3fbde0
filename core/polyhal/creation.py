"""Tensor creation on a device given by name, or on the default device.

The HAL's constructors (:mod:`polyhal.hal.tensor`) take a :class:`~polyhal.hal.device.Device`;
these are the public ones (``polyhal.empty``, ``polyhal.asarray``, ``polyhal.from_dlpack``),
which also take a device name or ``None`` (the best-ranked device) and find through the
registry which device imports DLPack memory.
"""

from __future__ import annotations

from typing import Any

from polyhal.hal import tensor as hal_tensor
from polyhal.hal.device import Device
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.hal.tensor import Tensor
from polyhal.registry import default_registry, get_device

__all__ = ["asarray", "empty", "from_dlpack"]


def empty(shape: Any, dtype: Any = "float32", device: Device | str | None = None,
          memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
          usage: BufferUsage = BufferUsage.DEFAULT) -> Tensor:
    """An uninitialised dense tensor on ``device`` (default: the highest-ranked device)."""
    return hal_tensor.empty(shape, dtype, get_device(device), memory_type, usage)


def asarray(obj: Any, dtype: Any = None, device: Device | str | None = None,
            memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL) -> Tensor:
    """A new tensor on ``device`` (default: the highest-ranked device) holding a copy of ``obj``
    (anything numpy accepts)."""
    return hal_tensor.asarray(obj, dtype, get_device(device), memory_type)


def from_dlpack(obj: Any, *, device: Device | str | None = None, copy: bool | None = None) -> Tensor:
    """Import any DLPack producer (numpy, cupy, torch, jax, a polyhal tensor) without copying.

    The memory stays owned by the producer (an EXTERNAL buffer) and is released when the tensor
    is. With ``device`` naming a device other than where the data lives, the data is copied there
    unless ``copy`` is False.
    """
    target = None if device is None else get_device(device)
    return hal_tensor.from_dlpack(obj, default_registry().device_for_dlpack, device=target, copy=copy)
