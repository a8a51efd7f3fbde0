"""Kernel scratch on the CPU: a binding for kernels prepared outside a plan, and typed views.

A kernel that needs working memory beyond its operands (attention's score block, NMS's per-box
arrays) declares it where it is registered in the kernel table
(``TABLE.register(op, scratch=[ScratchDecl(...)])``, :mod:`polyhal.hal.kernels`) instead of
allocating it per call: the bufferize pass sizes and places every declared scratch (the CPU has
no workgroup memory, so it goes to the plan's global arena), the plan allocates it once, and
``prepare`` hands the kernel its slice. An allocation per call is not free on the CPU either: a
1 MiB numpy array is fresh pages from the OS each time (glibc maps blocks that large), ~120 µs
of page faults and zeroing for attention's scores on a 2-core VM, a third of the kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyhal.hal.scratch import MemorySpace, ScratchAssignment, ScratchBinding, ScratchRequest

__all__ = ["array", "standalone"]


def standalone(device: Any, requests: tuple[ScratchRequest, ...]) -> ScratchBinding:
    """Scratch for a kernel prepared without a plan (a direct ``prepare``): allocated here, once,
    before any call -- still never by the kernel. Such a kernel must not run on two threads at
    once (a plan never does: its runs are serialised)."""
    assignments, buffers = [], {}
    for req in requests:
        nbytes = req.nbytes(MemorySpace.GLOBAL)
        assignments.append(ScratchAssignment(req, MemorySpace.GLOBAL, nbytes, nbytes, "standalone"))
        buffers[(req.kernel.name, req.name)] = np.empty(max(nbytes, 1), np.uint8)
    return ScratchBinding(tuple(assignments), buffers)


def array(binding: ScratchBinding, name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Scratch ``name`` of ``binding`` as a C-contiguous array of ``shape`` and ``dtype``."""
    n = int(np.prod(shape, dtype=np.int64))
    return binding.buffer(name).view(np.uint8)[: n * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
