"""non_max_suppression with IoU bitmask blocks (``cl/nms_bitmask.cl``), scratch placed by the planner.

Four kernels (see the .cl file): sort the candidates of each (batch, class) row, build the
row's IoU bitmask in 64x64 blocks, reduce it greedily on the device, and emit ONNX's rows. The
scratch each kernel declares, and where the default policy puts it:

=============  ============  ==========================================  ==========================
kernel         scratch       size                                        spaces (preference order)
=============  ============  ==========================================  ==========================
nms_prep       ``keys``      next_pow2(N) x 8 B per work-group (a row)    workgroup, global
nms_prep       ``order``     rows x N x 4 B                               global
nms_prep       ``sboxes``    rows x N x 16 B (sorted corner boxes)        global
nms_prep       ``counts``    rows x 4 B                                   global
nms_mask       ``cols``      64 x 16 B per work-group                     workgroup, global
nms_mask       ``mask``      N x W x 8 B (one row at a time)              global
nms_reduce     ``removed``   W x 8 B per work-group                       workgroup, global
nms_reduce     ``selected``  rows x LIMIT x 4 B, ``nsel`` rows x 4 B      global
=============  ============  ==========================================  ==========================

W = ceil(N / 64). Rows whose sort or bitset does not fit the device's local memory take the
global path of the same kernel; a mask larger than the device's largest allocation is a
ScratchError when the plan is compiled. The output bound and padding are those of
:mod:`polyhal.ops.detection`.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from polyhal.hal.scratch import KernelInfo, MemorySpace, ScratchDecl
from polyhal.ops.detection import nms_bound

from polyhal_opencl.codegen import Arg, DeviceTraits, Launch, Recipe, cl_source, defines, next_pow2

G, WG_ = MemorySpace.GLOBAL, MemorySpace.WORKGROUP
_CODE = {MemorySpace.WORKGROUP: 1, MemorySpace.GLOBAL: 2}
#: The global buffers of the recipe, in Recipe.scratch order: (kernel, scratch name).
_GLOBALS = [("nms_prep", "order"), ("nms_prep", "sboxes"), ("nms_prep", "counts"), ("nms_mask", "mask"),
            ("nms_reduce", "selected"), ("nms_reduce", "nsel")]


def _f32(value: float) -> str:
    """A C float literal of exactly ``value`` rounded to float32 (what onnxruntime compares with)."""
    v = float(np.float32(value))
    return "INFINITY" if v == float("inf") else "(-INFINITY)" if v == float("-inf") else repr(v) + "f"


def _shape(attrs: Mapping[str, Any], in_types) -> dict:
    nb, nc, n = in_types[1].shape
    limit = min(max(int(attrs["max_output_boxes_per_class"]), 0), n)
    w = max(-(-n // 64), 1)
    np_ = max(next_pow2(n), 2)
    return dict(nb=nb, nc=nc, n=n, rows=nb * nc, limit=limit, w=w, np=np_,
                bound=nms_bound(nb, nc, n, attrs["max_output_boxes_per_class"]),
                wg=min(256, max(np_ // 2, 1)), wgr=min(64, next_pow2(w)))


def declarations(op: str, attrs: Mapping[str, Any], in_types, out_types) -> list:
    """``[(KernelInfo, [ScratchDecl])]`` (an empty list when nothing can be selected)."""
    s = _shape(attrs, in_types)
    if s["limit"] == 0 or s["rows"] == 0:
        return []
    n, rows, w = s["n"], s["rows"], s["w"]
    prep = KernelInfo("nms_prep", op, s["wg"], rows, "opencl")
    mask = KernelInfo("nms_mask", op, 64, w * w, "opencl")
    reduce = KernelInfo("nms_reduce", op, s["wgr"], 1, "opencl")
    return [
        (prep, [ScratchDecl("keys", shared=True, per_workgroup=s["np"] * 8, spaces=(WG_, G),
                            purpose="the row's (score, index) keys, bitonic-sorted by the work-group"),
                ScratchDecl("order", shared=True, per_launch=rows * n * 4, spaces=(G,),
                            purpose="candidate box indices in decreasing score, per row"),
                ScratchDecl("sboxes", shared=True, per_launch=rows * n * 16, spaces=(G,),
                            purpose="candidate corner boxes in that order"),
                ScratchDecl("counts", shared=True, per_launch=rows * 4, spaces=(G,),
                            purpose="candidates per row")]),
        (mask, [ScratchDecl("cols", shared=True, per_workgroup=64 * 16, spaces=(WG_, G),
                            purpose="the 64 column boxes of a mask block, read by all 64 work-items"),
                ScratchDecl("mask", shared=True, per_launch=n * w * 8, spaces=(G,), purpose="IoU bitmask of one row: N x ceil(N/64) 64-bit words")]),
        (reduce, [ScratchDecl("removed", shared=True, per_workgroup=w * 8, spaces=(WG_, G),
                              purpose="bitset of suppressed candidates, OR-ed by the work-group"),
                  ScratchDecl("selected", shared=True, per_launch=rows * s["limit"] * 4, spaces=(G,),
                              purpose="selected box indices per row"),
                  ScratchDecl("nsel", shared=True, per_launch=rows * 4, spaces=(G,),
                              purpose="selected boxes per row")]),
    ]


def generate(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits,
             spaces: Mapping[tuple[str, str], MemorySpace]) -> Recipe:
    """The recipe for the placements ``spaces`` (``(kernel, scratch) -> space``)."""
    s = _shape(attrs, in_types)
    thr = attrs["score_threshold"]
    base = defines(NB=s["nb"], NC=s["nc"], N=s["n"], NP=s["np"], W=s["w"], LIMIT=max(s["limit"], 1),
                   BOUND=s["bound"], CENTER=int(attrs["center_point_box"]), IOU_T=_f32(attrs["iou_threshold"]),
                   HAS_SCORE_T=thr is not None, SCORE_T=_f32(0.0 if thr is None else thr))
    if s["limit"] == 0 or s["rows"] == 0:  # nothing can be selected: the count, 0 (bound is 0)
        return Recipe("__kernel void nms_none(__global long* num_base, const ulong num_off) "
                      "{ num_base[num_off] = 0; }\n", [Launch("nms_none", (1,), (1,), (Arg(3),))])
    sort_sp = MemorySpace(spaces[("nms_prep", "keys")])
    cols_sp = MemorySpace(spaces[("nms_mask", "cols")])
    rm_sp = MemorySpace(spaces[("nms_reduce", "removed")])
    src = base + defines(WG=s["wg"], WGR=s["wgr"], SORT_SPACE=_CODE[sort_sp], COLS_SPACE=_CODE[cols_sp],
                         REMOVED_SPACE=_CODE[rm_sp]) + cl_source("nms_bitmask.cl")
    names = list(_GLOBALS)
    sizes = [s["rows"] * s["n"] * 4, s["rows"] * s["n"] * 16, s["rows"] * 4, s["n"] * s["w"] * 8,
             s["rows"] * s["limit"] * 4, s["rows"] * 4]
    extra = {}
    for key, sp, size in ((("nms_prep", "keys"), sort_sp, s["rows"] * s["np"] * 8),
                          (("nms_mask", "cols"), cols_sp, s["w"] * s["w"] * 64 * 16),
                          (("nms_reduce", "removed"), rm_sp, s["w"] * 8)):
        if sp is MemorySpace.GLOBAL:
            extra[key] = Arg(len(names), True)
            names.append(key)
            sizes.append(size)
    order, sboxes, counts, mask, sel, nsel = (Arg(i, True) for i in range(6))
    steps: list[Launch] = [Launch("nms_prep", (s["rows"] * s["wg"],), (s["wg"],),
                                  (Arg(0), Arg(1), order, sboxes, counts)
                                  + ((extra[("nms_prep", "keys")],) if ("nms_prep", "keys") in extra else ()))]
    w = s["w"]
    for r in range(s["rows"]):
        steps.append(Launch("nms_mask", (w * 64, w), (64, 1),
                            (sboxes, counts, mask) + ((extra[("nms_mask", "cols")],) if ("nms_mask", "cols") in extra else ()),
                            (r,)))
        steps.append(Launch("nms_reduce", (s["wgr"],), (s["wgr"],),
                            (order, counts, mask, sel, nsel)
                            + ((extra[("nms_reduce", "removed")],) if ("nms_reduce", "removed") in extra else ()),
                            (r,)))
    steps.append(Launch("nms_emit", (1,), (1,), (sel, nsel, Arg(2), Arg(3))))
    recipe = Recipe(src, steps, sizes)
    recipe.scratch_names = names
    return recipe
