"""sort, argsort, topk and non_max_suppression on HIP: polyhal-cuda's CUDA C (``cu/sort.cu``,
``cu/nms.cu``) and its backend-neutral planning, launched through HIP.

Shared with polyhal-cuda (imported, not copied): the kernels' source text, the instance plan
(:func:`polyhal_cuda.sorting.plan_sort`: lanes, padded sizes, flags, block size) and the
scratch each kernel declares, so the bufferization pass places it exactly as for CUDA: the
bitonic (key, index) pairs shared-first (LDS when they fit, a global slice per workgroup
otherwise), NMS's removed bits shared-first, its other buffers global. HIP's own: this host
code (launches through :meth:`~polyhal_hip.device.HIPDevice.launch`, ``hipMemsetAsync``),
scratch addresses from the plan's binding (:class:`Scratch`), and one choice -- every sort
takes the bitonic path (see :func:`plan_sort`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.hal.scratch import MemorySpace

from polyhal_hip import compiler

if TYPE_CHECKING:
    from polyhal_hip.device import HIPDevice

BLOCK = 256
F_CANON_ZERO = 2  # sort.cu: -0.0 sorts as +0.0 (the bitonic path always sets it)
_NULL = np.uint64(0)


def _cuda_sorting():
    from polyhal_cuda import sorting

    return sorting


def _cuda_nms():
    from polyhal_cuda import suppression

    return suppression


def plan_sort(device: "HIPDevice", op: str, attrs: dict, x) -> Any:
    """polyhal-cuda's plan of one instance, on the bitonic path (``sort_rows``) always: its
    pairs go to LDS when they fit and to a global slice per workgroup otherwise. polyhal-cuda's
    radix path is not launched on HIP yet (its kernels are being reworked -- onesweep with a
    decoupled look-back, whose inter-workgroup progress and visibility need checking on AMD
    hardware); long lanes therefore sort in O(n log^2 n) per workgroup, correct but slower."""
    cs = _cuda_sorting()
    plan = cs.plan_sort(device, op, attrs, x)
    if plan.path == "rows":
        return plan
    if plan.n >= 2**31:
        from polyhal.errors import ProgramError

        raise ProgramError(f"{op}: lanes of {plan.n} elements; the HIP sort handles fewer than 2**31 per lane")
    p = max(2, 1 << max(plan.n - 1, 1).bit_length())
    return dataclasses.replace(plan, path="rows", flags=plan.flags | F_CANON_ZERO, p=p,
                               kp=max(2, 1 << max(plan.kout - 1, 1).bit_length()),
                               threads=min(1024, max(32, p // 2)))


def scratch_requests(device: "HIPDevice", op: str, attrs: dict, ins, outs):
    """Scratch of one sort / argsort / topk instance (polyhal-cuda's declarations of the plan)."""
    from polyhal.hal.scratch import Problem

    plan = plan_sort(device, op, attrs, ins[0])
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    return tuple(d.request(problem, k) for k, ds in _cuda_sorting()._decls(plan) for d in ds)


def _nms_geometry(attrs: dict, scores) -> Any:
    return _cuda_nms()._Geometry(scores.shape[0], scores.shape[1], scores.shape[2], attrs["max_output_boxes_per_class"])


def nms_scratch_requests(device: "HIPDevice", attrs: dict, ins, outs):
    """Scratch of one non_max_suppression instance: polyhal-cuda's NMS declarations, plus the
    argsort's (this module's plan)."""
    from polyhal.hal.scratch import Problem

    g = _nms_geometry(attrs, ins[1])
    if g.n == 0 or g.problems == 0:
        return ()
    problem = Problem("non_max_suppression", attrs, tuple(ins), tuple(outs))
    own = tuple(d.request(problem, k) for k, ds in _cuda_nms()._decls(g) for d in ds)
    return own + tuple(scratch_requests(device, "argsort", _ARGSORT, (g.scores_type,), (g.order_type,)))


class Scratch:
    """Where each scratch of one prepared kernel went and its device address: from the plan's
    :class:`~polyhal.hal.scratch.ScratchBinding`, or -- used outside a plan -- placed by the same
    policy and allocated here, once."""

    def __init__(self, device: "HIPDevice", requests: tuple, binding: Any) -> None:
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
                    self.ptrs[req.name] = int(buf.ptr)
            return
        from polyhal.hal.flags import MemoryType
        from polyhal.passes.bufferize import place_scratch
        from polyhal.registry import default_registry

        for a in place_scratch(default_registry(), device.spec, tuple(requests)):
            self.spaces[a.request.name] = a.space
            if a.space is MemorySpace.GLOBAL:
                buf = device.allocator.allocate(max(a.nbytes, 1), MemoryType.DEVICE_LOCAL)
                self._keep.append(buf)
                self.ptrs[a.request.name] = buf.native.ptr

    def ptr(self, name: str, offset: int = 0) -> np.uint64:
        return np.uint64(self.ptrs[name] + offset)


def _grid(total: int, device: "HIPDevice") -> tuple[int]:
    cus = int(device.spec.limits.get("multiprocessors", 1)) or 1
    return (max(1, min(-(-total // BLOCK), cus * 32)),)


def _outputs(op: str, outs: tuple) -> tuple[Any, Any]:
    if op == "sort":
        return outs[0], None
    if op == "argsort":
        return None, outs[0]
    return outs[0], outs[1]


def prepare(device: "HIPDevice", op: str, attrs: dict, ins, outs, binding: Any = None):
    """``fn(x, *outputs)`` for one sort / argsort / topk instance."""
    plan = plan_sort(device, op, attrs, ins[0])
    scratch = Scratch(device, scratch_requests(device, op, attrs, ins, outs), binding)
    run = _rows(device, plan, scratch)
    run.plan = plan  # type: ignore[attr-defined]
    run.scratch_spaces = dict(scratch.spaces)  # type: ignore[attr-defined]
    return run


def _sort_function(device: "HIPDevice", exprs: list[str], expression: str) -> Any:
    return device.function(compiler.source("sort.cu"), "sort.cu", expression, exprs)


def _rows(device: "HIPDevice", plan: Any, scratch: Scratch):
    name = f"sort_rows<{plan.ctype}, {_cuda_sorting()._kind(plan.dtype)}>"
    fn = _sort_function(device, [name], name)  # the bitonic path needs only its own instance
    shared = scratch.spaces["pairs"] is MemorySpace.WORKGROUP
    smem = plan.p * (4 + plan.key_bytes) if shared else 0
    base = _NULL if shared else scratch.ptr("pairs")
    grid, block = (plan.lanes,), (plan.threads,)
    fixed = (np.int64(plan.lanes), np.int64(plan.n), np.int64(plan.inner), np.int64(plan.kout),
             np.uint32(plan.p), np.uint32(plan.kp), np.int32(plan.flags), base)
    launch, op = device.launch, plan.op

    def run(x, *outs):
        values, indices = _outputs(op, outs)
        launch(fn, name, grid, block, (x, values, indices) + fixed, smem)

    run.kernel_name = name  # type: ignore[attr-defined]
    return run


# -------------------------------------------------------------------------------------------- NMS

_NMS_EXPRS = ["nms_boxes", "nms_mask", "nms_reduce", "nms_write"]
_ARGSORT = {"axis": -1, "descending": True}


def prepare_nms(device: "HIPDevice", attrs: dict, ins, outs, binding: Any = None):
    """``fn(boxes, scores, selected, num_selected)`` of one ``non_max_suppression`` instance."""
    cn = _cuda_nms()
    g = _nms_geometry(attrs, ins[1])
    rt = device.runtime
    if g.n == 0 or g.problems == 0 or g.max_out == 0:
        from polyhal_hip.kernels import host_fallback

        return host_fallback(device, "non_max_suppression", attrs, ins, outs)
    mode = cn.MODE_ONNX_CENTER if int(attrs["center_point_box"]) else cn.MODE_ONNX_CORNERS
    thr = attrs["score_threshold"]
    requests = nms_scratch_requests(device, attrs, ins, outs)
    own = tuple(r for r in requests if r.kernel.op != "argsort")
    s = Scratch(device, own, binding)
    argsort = prepare(device, "argsort", _ARGSORT, (g.scores_type,), (g.order_type,), binding)
    text = compiler.source("nms.cu")
    k_boxes, k_mask, k_reduce, k_write = (device.function(text, "nms.cu", e) for e in _NMS_EXPRS)
    P, n, W = g.problems, g.n, g.words
    shared = s.spaces["removed"] is MemorySpace.WORKGROUP
    reduce_smem = W * 8 if shared else 0
    removed = _NULL if shared else s.ptr("removed")
    has_thr = thr is not None
    boxes_args = (s.ptr("boxes"), s.ptr("valid"), np.int64(P), np.int32(g.classes), np.int32(n), np.int32(mode),
                  np.int32(has_thr), np.float32(float(thr) if has_thr else 0.0))
    boxes_grid = _grid(P * n, device)
    mask_args = (s.ptr("boxes"), np.int32(n), np.int32(W), np.int32(mode), np.float32(float(attrs["iou_threshold"])),
                 s.ptr("mask"))
    reduce_args = (s.ptr("mask"), s.ptr("valid"), s.ptr("order"), np.int32(n), np.int32(W), np.int64(g.max_out),
                   np.int64(g.cap), removed, s.ptr("keep"), s.ptr("counts"))
    reduce_block = (cn._threads(W),)
    from polyhal_hip.array import HipArray

    order = HipArray(s.ptrs["order"], (g.batches, g.classes, n), np.int64, owner=s)
    launch = device.launch

    def kernel(boxes, scores, selected, num_selected):
        argsort(scores, order)
        launch(k_boxes, "nms_boxes", boxes_grid, (256,), (boxes, scores, order) + boxes_args)
        launch(k_mask, "nms_mask", (W, W, P), (64,), mask_args)
        launch(k_reduce, "nms_reduce", (P,), reduce_block, reduce_args, reduce_smem)
        if selected.nbytes:
            rt.memset_async(selected.ptr, 0xFF, selected.nbytes, device.stream)  # -1 rows
        launch(k_write, "nms_write", (1,), (256,), (s.ptr("keep"), s.ptr("counts"), np.int64(P), np.int32(g.classes),
                                                     np.int64(g.cap), selected, num_selected))

    kernel.kernel_name = "nms (argsort, nms_boxes, nms_mask, nms_reduce, nms_write)"  # type: ignore[attr-defined]
    return kernel
