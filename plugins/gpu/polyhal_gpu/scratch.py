"""Scratch memory of the CUDA C kernels, in the core's terms (:mod:`polyhal.hal.scratch`).

Kernels with scratch (sort / argsort / topk, non_max_suppression) never allocate in a kernel:
they *declare* their scratch when a plan is compiled (the device's ``scratch`` ->
:class:`~polyhal.hal.scratch.ScratchRequest` records, with the spaces each kernel has code for),
the bufferization pass places every request through the ``select_memory_space`` policy, and the
plan hands the placements and global buffers to the device's ``prepare`` as a
:class:`~polyhal.hal.scratch.ScratchBinding`. A ``WORKGROUP`` placement becomes the launch's
dynamic shared memory (LDS on AMD GPUs); a ``GLOBAL`` placement is a slice of the plan's scratch
arena. Used outside a plan (e.g. :func:`polyhal_cuda.nms`), the same policy places the requests
and :class:`Scratch` allocates the global part once, when the kernel is prepared.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from polyhal.hal.flags import MemoryType
from polyhal.hal.scratch import MemorySpace

#: Bytes of shared memory left for a kernel's static ``__shared__`` variables.
SHARED_RESERVE = 1024


def shared_limit(device: Any) -> int:
    """Dynamic shared memory one block may use: the device's ``workgroup_bytes`` (CUDA: the
    opt-in maximum; HIP: the LDS per workgroup) less :data:`SHARED_RESERVE` -- the limit the
    core's memory-space policy checks."""
    return max(int(device.spec.workgroup_bytes) - SHARED_RESERVE, 0) if device.spec.workgroup_bytes else 0


class Scratch:
    """Where each scratch of one prepared kernel went (``spaces``) and, for global scratch, its
    device address (``ptrs``): from the plan's binding, or -- used outside a plan -- placed by the
    same policy and allocated here, once. ``address`` gives the device address of the backend's
    array that a binding hands out (a cupy array, a HipArray)."""

    def __init__(self, device: Any, requests: tuple, binding: Any, address: Callable[[Any], int]) -> None:
        self.spaces: dict[str, MemorySpace] = {}
        self.ptrs: dict[str, int] = {}
        self._keep: list = []
        if binding:
            for req in requests:
                space = binding.space(req.name, req.kernel.name)
                self.spaces[req.name] = space
                if space is MemorySpace.GLOBAL:
                    buf = binding.buffer(req.name, req.kernel.name)
                    self._keep.append(buf)
                    self.ptrs[req.name] = int(address(buf))
            return
        for a in device.place_scratch(requests):
            self.spaces[a.request.name] = a.space
            if a.space is MemorySpace.GLOBAL:
                buf = device.allocator.allocate(max(a.nbytes, 1), MemoryType.DEVICE_LOCAL)
                self._keep.append(buf)
                self.ptrs[a.request.name] = buf.native.ptr

    def ptr(self, name: str, offset: int = 0) -> np.uint64:
        """The device address of global scratch ``name`` (plus ``offset`` bytes), as a kernel argument."""
        return np.uint64(self.ptrs[name] + offset)
