"""Scratch memory of this backend's kernels, in the core's terms (:mod:`polyhal.hal.scratch`).

Kernels with scratch (sort/argsort/topk, non_max_suppression) never allocate in a kernel: they
*declare* their scratch at plan-compile time (``CUDADevice.scratch`` ->
:class:`~polyhal.hal.scratch.ScratchRequest` records, with the spaces each kernel has code for),
the bufferization pass places every request through the ``select_memory_space`` policy, and the
plan hands the placements and global buffers to ``CUDADevice.prepare`` as a
:class:`~polyhal.hal.scratch.ScratchBinding`. A ``WORKGROUP`` placement becomes the launch's
dynamic shared memory (opting in past 48 KiB when needed); a ``GLOBAL`` placement is a slice of
the plan's scratch arena. Used outside a plan (e.g. :func:`polyhal_cuda.nms`), the same policy
places the requests and the kernel allocates its global scratch once, when it is prepared
(:class:`polyhal_cuda.sorting.Scratch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polyhal_cuda.device import CUDADevice

#: Bytes of shared memory left for a kernel's static ``__shared__`` variables.
SHARED_RESERVE = 1024


def shared_limit(device: "CUDADevice") -> int:
    """Dynamic shared memory one block may use: the opt-in maximum less :data:`SHARED_RESERVE`
    (the same limit the core's memory-space policy checks, ``DeviceSpec.workgroup_bytes``)."""
    return max(int(device.spec.workgroup_bytes) - SHARED_RESERVE, 0) if device.spec.workgroup_bytes else 0
