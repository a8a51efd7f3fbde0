"""Kernel scratch on the CPU: which ops declare it, what each instance requests, and a binding
for kernels prepared outside a plan.

A kernel that needs working memory beyond its operands (attention's score block, NMS's per-box
arrays) declares it here with :func:`declare` instead of allocating it per call: the bufferize
pass sizes and places every declared scratch (the CPU has no workgroup memory, so it goes to
the plan's global arena), the plan allocates it once, and ``prepare`` hands the kernel its
slice. An allocation per call is not free on the CPU either: a 1 MiB numpy array is fresh
pages from the OS each time (glibc maps blocks that large), ~120 µs of page faults and zeroing
for attention's scores on a 2-core VM, a third of the kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from polyhal.hal.scratch import (KernelInfo, MemorySpace, Problem, ScratchAssignment, ScratchBinding,
                                 ScratchDecl, ScratchRequest)

__all__ = ["SCRATCH", "array", "build", "declare", "requests", "standalone"]

#: op -> its kernel's scratch declarations (all global: the CPU spec declares no workgroup memory).
SCRATCH: dict[str, tuple[ScratchDecl, ...]] = {}
#: op -> builder(op, attrs, ins, outs, scratch) of the kernel that uses them.
_BUILDERS: dict[str, Callable[..., Any]] = {}


def declare(op: str, *decls: ScratchDecl) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate the builder ``f(op, attrs, ins, outs, scratch)`` of ``op``'s kernel, which needs
    ``decls``; returns a plain builder ``f(op, attrs, ins, outs)`` for use outside a plan
    (:func:`standalone` scratch), to register with ``register_kernels``."""
    def wrap(builder: Callable[..., Any]) -> Callable[..., Any]:
        SCRATCH[op] = tuple(decls)
        _BUILDERS[op] = builder

        def plain(op_: str, attrs: dict, ins, outs):
            return builder(op_, attrs, ins, outs, standalone(op_, attrs, ins, outs))
        return plain
    return wrap


def requests(op: str, attrs: Mapping[str, Any], in_types, out_types) -> tuple[ScratchRequest, ...]:
    """The evaluated scratch requests of one op instance (empty for ops without scratch)."""
    decls = SCRATCH.get(op)
    if not decls:
        return ()
    problem = Problem(op, dict(attrs), tuple(in_types), tuple(out_types))
    kernel = KernelInfo(f"cpu_{op}", op, 1, 1, "cpu")
    return tuple(d.request(problem, kernel) for d in decls)


def build(op: str, attrs: dict, in_types, out_types, scratch: ScratchBinding) -> Any:
    """The kernel of ``op`` bound to the plan's placement of its scratch."""
    return _BUILDERS[op](op, attrs, tuple(in_types), tuple(out_types), scratch)


def standalone(op: str, attrs: dict, in_types, out_types) -> ScratchBinding:
    """Scratch for a kernel prepared without a plan (a direct ``prepare``): allocated here, once,
    before any call -- still never by the kernel. Such a kernel must not run on two threads at
    once (a plan never does: its runs are serialised)."""
    assignments, buffers = [], {}
    for req in requests(op, attrs, in_types, out_types):
        nbytes = req.nbytes(MemorySpace.GLOBAL)
        assignments.append(ScratchAssignment(req, MemorySpace.GLOBAL, nbytes, nbytes, "standalone"))
        buffers[(req.kernel.name, req.name)] = np.empty(max(nbytes, 1), np.uint8)
    return ScratchBinding(tuple(assignments), buffers)


def array(binding: ScratchBinding, name: str, dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Scratch ``name`` of ``binding`` as a C-contiguous array of ``shape`` and ``dtype``."""
    n = int(np.prod(shape, dtype=np.int64))
    return binding.buffer(name).view(np.uint8)[: n * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
