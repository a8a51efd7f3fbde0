"""sort, argsort and topk of many rows on CPU OpenCL devices: ``cl/rowsort.cl``, 16 rows per
work-item in vector lanes, with the tile's memory space chosen by the bufferize pass.

Used for a last-axis sort of 32-bit elements (float32, int32, uint32) with at least
:data:`MIN_ROWS` rows on a CPU device (PoCL): there, one work-item sorting 16 rows with
16-lane vector compare-exchanges beats a work-group cooperating on one row by an order of
magnitude (no barriers; PoCL runs a work-group's work-items in a loop). Everything else goes to
:mod:`polyhal_opencl.ops.sorting` (a work-group per row in local memory, or tiles in local
memory merged through global scratch), whose scratch the bufferize pass places too.

Scratch: ``tile`` -- per work-item, ``NP * 64`` bytes of keys (``2 * NP * 64`` with indices),
NP = next power of two >= max(row length, 16). Its declaration allows private, workgroup and
global memory, in that order: the default policy keeps short rows in private memory, rows that
fit in ``__local`` memory there, and longer rows in a global scratch buffer (one slice per
work-group) that the plan allocates.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl

from polyhal_opencl.codegen import Arg, DeviceTraits, Launch, Recipe, cl_source, defines, next_pow2

#: Fewest rows for the lane-parallel kernel (below, most of 16 lanes would idle).
MIN_ROWS = 32
_KINDS = {np.dtype(np.float32): 0, np.dtype(np.int32): 1, np.dtype(np.uint32): 2}
#: TILE_SPACE values of the template.
_SPACE_CODE = {MemorySpace.PRIVATE: 0, MemorySpace.WORKGROUP: 1, MemorySpace.GLOBAL: 2}
KERNEL = "sort_lanes"


def _params(op: str, attrs: Mapping[str, Any], x) -> dict | None:
    """The instance's parameters, or None when the lane kernel does not apply."""
    if x.dtype not in _KINDS or x.rank == 0:
        return None
    axis = int(attrs["axis"]) % x.rank
    n = x.shape[axis]
    rows = math.prod(x.shape) // n if n else 0
    if axis != x.rank - 1 or rows < MIN_ROWS or n < 2 or n >= 2**31:
        return None
    if op == "topk":
        k, desc, idx_order = int(attrs["k"]), bool(attrs["largest"]), not attrs["sorted"]
        if k == 0:
            return None
    else:
        k, desc, idx_order = n, bool(attrs["descending"]), False
    has_idx = op != "sort"
    np_ = max(next_pow2(n), 16)
    return dict(n=n, rows=rows, k=k, kp=max(min(next_pow2(k), np_), 1), np=np_, desc=desc, idx_order=idx_order,
                has_idx=has_idx, values=op in ("sort", "topk"), indices=op != "sort", kind=_KINDS[x.dtype],
                groups=-(-rows // 16))


def declarations(op: str, attrs: Mapping[str, Any], in_types, out_types) -> list | None:
    """``[(KernelInfo, [ScratchDecl])]`` for the lane kernel, or None when it does not apply."""
    p = _params(op, attrs, in_types[0])
    if p is None:
        return None
    per_thread = p["np"] * 64 * (2 if p["has_idx"] else 1)
    kernel = KernelInfo(KERNEL, op, 1, p["groups"], "opencl")
    decl = ScratchDecl("tile", shared=False, per_thread=per_thread,
                       spaces=(MemorySpace.PRIVATE, MemorySpace.WORKGROUP, MemorySpace.GLOBAL),
                       purpose=f"{p['np']} lane vectors of keys{' and indices' if p['has_idx'] else ''} "
                               "per work-item (16 rows)")
    return [(kernel, [decl])]


def generate(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits,
             spaces: Mapping[tuple[str, str], MemorySpace]) -> Recipe:
    """The recipe for the placement ``spaces`` (``(kernel, scratch) -> space``)."""
    x = in_types[0]
    p = _params(op, attrs, x)
    assert p is not None, "rowsort.generate called for an instance it does not handle"
    space = MemorySpace(spaces[(KERNEL, "tile")])
    outs = []
    params, prologue = [], []
    if p["values"]:
        outs.append(Arg(1))
        params.append("__global uint* values_base, const ulong values_off")
        prologue.append("__global uint* values = values_base + values_off;")
    if p["indices"]:
        outs.append(Arg(len(outs) + 1))
        params.append("__global long* indices_base, const ulong indices_off")
        prologue.append("__global long* indices = indices_base + indices_off;")
    src = (
        defines(N=p["n"], NP=p["np"], ROWS=p["rows"], K=p["k"], KP=p["kp"], DESC=p["desc"], HAS_IDX=p["has_idx"],
                IDX_ORDER=p["idx_order"], HAS_VALUES=p["values"], HAS_INDICES=p["indices"], KIND=p["kind"],
                FIXUP=p["kind"] == 0, TILE_SPACE=_SPACE_CODE[space])
        + "#define OUT_KERNEL_PARAMS , " + ", ".join(params) + "\n"
        + "#define OUT_PROLOGUE " + " ".join(prologue) + "\n"
        + cl_source("rowsort.cl")
    )
    args = (Arg(0), *outs) + ((Arg(0, scratch=True),) if space is MemorySpace.GLOBAL else ())
    recipe = Recipe(src, [Launch(KERNEL, (p["groups"],), (1,), args)])
    if space is MemorySpace.GLOBAL:
        recipe.scratch = [p["groups"] * p["np"] * 64 * (2 if p["has_idx"] else 1)]
        recipe.scratch_names = [(KERNEL, "tile")]
    return recipe


def problem(op: str, attrs: Mapping[str, Any], in_types, out_types) -> Problem:
    """The :class:`~polyhal.hal.scratch.Problem` of an instance."""
    return Problem(op, dict(attrs), tuple(in_types), tuple(out_types))
