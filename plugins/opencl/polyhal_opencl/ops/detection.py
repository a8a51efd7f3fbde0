"""non_max_suppression (mirrors :mod:`polyhal.ops.detection`) on ``cl/nms.cl``: per (batch,
class) a work-group sorts the candidates in local memory and selects greedily, testing each
candidate against the kept boxes in parallel; a second kernel lays the rows out in ONNX order.

The IoU test is onnxruntime's float32 arithmetic with contraction off; it matches the reference
bit for bit where float division is correctly rounded (PoCL; others where the device reports
CL_FP_CORRECTLY_ROUNDED_DIVIDE_SQRT, which the build options then request). The boxes of one
(batch, class) must fit in local memory (8 bytes each plus 20 per selectable box): a
KernelNotFoundError says so otherwise.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from polyhal.errors import KernelNotFoundError
from polyhal.ops.detection import nms_bound

from polyhal_opencl.codegen import (
    Arg, DeviceTraits, Launch, Recipe, cl_source, defines, next_pow2, round_up,
)
from polyhal_opencl.ops.sorting import LOCAL_RESERVE


def _f32(value: float) -> str:
    """A C float literal of exactly ``value`` rounded to float32, as the reference compares."""
    return repr(float(np.float32(value))) + "f"


def non_max_suppression(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Outputs: ``selected`` int64 [bound, 3] padded with -1, and ``num_selected``."""
    boxes, scores = in_types
    nb, nc, n = scores.shape
    maxsel = min(max(int(attrs["max_output_boxes_per_class"]), 0), n)
    bound = nms_bound(nb, nc, n, attrs["max_output_boxes_per_class"])
    if bound == 0:  # nothing can be selected: only the count, 0
        return Recipe("__kernel void nms_none(__global long* num_base, const ulong num_off) { num_base[num_off] = 0; }\n",
                      [Launch("nms_none", (1,), None, (Arg(3),))])
    np_ = next_pow2(n)
    local = np_ * 8 + maxsel * 20 + 16
    if local > traits.local_mem_size - LOCAL_RESERVE:
        raise KernelNotFoundError(
            f"{op} with {n} boxes per class needs {local} bytes of local memory; {traits.name} has "
            f"{traits.local_mem_size}. Run it on the CPU device (affinity='cpu:0')")
    wg = traits.work_group(np_ // 2)
    threshold = attrs["score_threshold"]
    src = (
        defines(NB=nb, NC=nc, N=n, NP=np_, MAXSEL=maxsel, BOUND=bound, CENTER=int(attrs["center_point_box"]),
                HAS_THRESHOLD=threshold is not None, THRESHOLD=_f32(threshold or 0.0),
                IOU=_f32(attrs["iou_threshold"]), WG=wg, KEY_T="float", DESC=1)
        + "#define ISNAN(v) isnan(v)\n" + cl_source("bitonic.cl") + cl_source("nms.cl")
    )
    sel, count = Arg(0, scratch=True), Arg(1, scratch=True)
    return Recipe(src, [
        Launch("nms_select", (nb * nc * wg,), (wg,), (Arg(0), Arg(1), sel, count)),
        Launch("nms_emit", (round_up(bound, 64),), (64,) if traits.max_work_group_size >= 64 else None,
               (sel, count, Arg(2), Arg(3))),
    ], scratch=[nb * nc * maxsel * 4, nb * nc * 4])


GENERATORS = {"non_max_suppression": non_max_suppression}
