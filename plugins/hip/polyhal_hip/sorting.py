"""sort, argsort, topk and non_max_suppression on HIP: polyhal-gpu's CUDA C (``cu/sort.cu``,
``cu/nms.cu``) and its backend-neutral planning (:mod:`polyhal_gpu`), launched through HIP.

Shared with polyhal-cuda through polyhal-gpu: the kernels' source text, the instance plan
(:func:`polyhal_gpu.sorting.plan_sort`: lanes, padded sizes, flags, block size), the
scratch each kernel declares -- so the bufferization pass places it exactly as for CUDA: the
bitonic (key, index) pairs shared-first (LDS when they fit, a global slice per workgroup
otherwise), NMS's removed bits shared-first, its other buffers global -- the bitonic launch and
the NMS pipeline. HIP's own: compiling with hiprtc, HipArray views of the scratch,
``hipMemsetAsync``, and one choice -- every sort takes the bitonic path (see :func:`plan_sort`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal_gpu import nms
from polyhal_gpu import sorting as portable
from polyhal_gpu.scratch import Scratch
from polyhal_gpu.sorting import SortPlan
from polyhal_hip import compiler

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the HIP device; its module imports this one


def plan_sort(device: "Device", op: str, attrs: dict, x) -> SortPlan:
    """The plan of one instance, on the bitonic path (``sort_rows``) always: its pairs go to
    LDS when they fit and to a global slice per workgroup otherwise. polyhal-cuda's radix paths
    are not launched on HIP: its default, onesweep, relies on a decoupled look-back whose
    inter-workgroup progress and memory visibility need an AMD GPU to verify, and none has been
    available; long lanes therefore sort in O(n log^2 n) per workgroup, correct but slower."""
    return portable.plan_sort(device, op, attrs, x, backend="hip", radix=False)


def scratch_requests(device: "Device", op: str, attrs: dict, ins, outs):
    """Scratch of one sort / argsort / topk instance (the shared declarations of its plan)."""
    return portable.scratch_requests(plan_sort(device, op, attrs, ins[0]), attrs, ins, outs, "hip")


def nms_scratch_requests(device: "Device", op: str, attrs: dict, ins, outs):
    """Scratch of one non_max_suppression instance: the NMS kernels', then the argsort's (this
    module's plan)."""
    g = nms.Geometry.of_op(attrs, ins[1])
    if g.empty:
        return ()
    return nms.scratch_requests(device, g, attrs, ins, outs, backend="hip", sort_requests=scratch_requests)


def scratch(device: "Device", requests: tuple, binding: Any) -> Scratch:
    """Where the scratch of ``requests`` went: the plan's ``binding`` hands out HipArrays."""
    return Scratch(device, requests, binding, lambda array: array.ptr)


def prepare(device: "Device", op: str, attrs: dict, ins, outs, binding: Any = None):
    """``fn(x, *outputs)`` for one sort / argsort / topk instance."""
    plan = plan_sort(device, op, attrs, ins[0])
    resolved = scratch(device, portable.scratch_requests(plan, attrs, ins, outs, "hip"), binding)
    name = plan.rows_expression
    # the bitonic path needs only its own instance
    fn = device.function(compiler.source(portable.SOURCE), portable.SOURCE, name, [name])
    run = portable.rows_kernel(plan, fn, device.launch, resolved)
    run.plan = plan  # type: ignore[attr-defined]
    run.scratch_spaces = dict(resolved.spaces)  # type: ignore[attr-defined]
    return run


# -------------------------------------------------------------------------------------------- NMS

def prepare_nms(device: "Device", op: str, attrs: dict, ins, outs, binding: Any = None):
    """``fn(boxes, scores, selected, num_selected)`` of one ``non_max_suppression`` instance."""
    g = nms.Geometry.of_op(attrs, ins[1])
    if g.empty or g.max_out == 0:
        return None  # nothing to suppress: the table's host fallback writes the empty result
    from polyhal_hip.array import HipArray

    s = scratch(device, nms.own_requests(nms_scratch_requests(device, op, attrs, ins, outs)), binding)
    argsort = prepare(device, "argsort", nms.ARGSORT_ATTRS, (g.scores_type,), (g.order_type,), binding)
    text = compiler.source(nms.SOURCE)
    functions = [device.function(text, nms.SOURCE, e) for e in nms.EXPRESSIONS]
    order = HipArray(s.ptrs["order"], (g.batches, g.classes, g.n), np.int64, owner=s)
    rt = device.runtime

    def fill(array: Any, byte: int) -> None:
        rt.memset_async(array.ptr, byte, array.nbytes, device.stream)

    return nms.Pipeline(device, g, *nms.op_settings(attrs), s, functions, argsort, order, fill).op_kernel()
