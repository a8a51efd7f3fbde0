"""Generators (``op -> generate(op, attrs, in_types, out_types, traits)``) for the kernels written
for the bufferize pass, usable without a device or a plan (tests, the kernel lint).

Their scratch is placed by the core's default rule -- the first space of each declaration that
fits -- against the traits' local memory (a plan instead asks the ``select_memory_space``
policy, see :mod:`polyhal_opencl.scratch`). The row sort is used for CPU devices
(``DeviceTraits.is_cpu``); other devices, and instances the row sort does not handle, get
:mod:`polyhal_opencl.ops.sorting`'s kernels.
"""

from __future__ import annotations

from typing import Any, Mapping

from polyhal.hal.scratch import MemoryLimits, MemorySpace, Problem, place_scratch, requests_for

from polyhal_opencl.codegen import DeviceTraits, Recipe, private_bytes
from polyhal_opencl.ops import nms_bitmask, rowsort, sorting

__all__ = ["GENERATORS", "default_spaces", "memory_limits"]


def default_spaces(problem: Problem, decls, limits: MemoryLimits) -> dict[tuple[str, str], MemorySpace]:
    """First-fit placements (the core's default rule) of ``decls`` within ``limits``."""
    device = next((k.backend for k, _ in decls if k.backend), "opencl")
    return {(a.request.kernel.name, a.request.name): a.space
            for a in place_scratch(requests_for(problem, decls), limits, device)}


def memory_limits(traits: DeviceTraits, kind: str) -> MemoryLimits:
    """The limits the default rule places scratch within on a device of type ``kind``
    (``"cpu"``, ``"gpu"``, ...) with these traits."""
    return MemoryLimits(private_bytes(kind), traits.local_mem_size, 1 << 62)


def _kind(traits: DeviceTraits) -> str:
    return "cpu" if traits.is_cpu else "gpu"


def _sort(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    decls = rowsort.declarations(op, attrs, in_types, out_types) if traits.is_cpu else None
    if decls is None:
        return sorting.GENERATORS[op](op, attrs, in_types, out_types, traits)
    problem = Problem(op, dict(attrs), tuple(in_types), tuple(out_types))
    spaces = default_spaces(problem, decls, memory_limits(traits, _kind(traits)))
    return rowsort.generate(op, attrs, in_types, out_types, traits, spaces)


def _nms(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    decls = nms_bitmask.declarations(op, attrs, in_types, out_types)
    problem = Problem(op, dict(attrs), tuple(in_types), tuple(out_types))
    spaces = default_spaces(problem, decls, memory_limits(traits, _kind(traits)))
    return nms_bitmask.generate(op, attrs, in_types, out_types, traits, spaces)


GENERATORS = {"sort": _sort, "argsort": _sort, "topk": _sort, "non_max_suppression": _nms}
