"""Non-maximum suppression on CUDA (``cu/nms.cu``): the ONNX op ``non_max_suppression`` and a
torchvision-compatible :func:`nms`.

Both run the same pipeline (see the CUDA source): an argsort of the scores by decreasing score
(:mod:`.sorting`, stable: ties keep the lower index first), the boxes in that order, one
suppression bit per box pair, and a greedy walk per problem that keeps the removed bits in
shared memory when they fit. Scratch is declared to the core (:func:`scratch_requests`), so a
plan's bufferization places it: the argsort's own, the sorted order and boxes, the candidate
flags, the suppression mask (``n * ceil(n / 64)`` words per problem: 1.25 GB for 100,000
boxes, as torchvision's), the kept indices and counts — global; the removed bits —
shared-first.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl
from polyhal.ir.types import TensorType

from polyhal_cuda import sorting
from polyhal_cuda.cuda_source import function

if TYPE_CHECKING:
    from polyhal_cuda.device import CUDADevice

_EXPRS = ["nms_boxes", "nms_mask", "nms_reduce", "nms_write"]
MODE_ONNX_CORNERS, MODE_ONNX_CENTER, MODE_TORCHVISION = 0, 1, 2
_ARGSORT = {"axis": -1, "descending": True}


class _Geometry:
    def __init__(self, batches: int, classes: int, n: int, max_out: int) -> None:
        self.batches, self.classes, self.n = batches, classes, n
        self.problems = batches * classes
        self.words = -(-n // 64)
        self.max_out = max(int(max_out), 0)
        self.cap = max(min(self.max_out, n), 1)

    @property
    def scores_type(self) -> TensorType:
        return TensorType((self.batches, self.classes, self.n), np.float32)

    @property
    def order_type(self) -> TensorType:
        return TensorType((self.batches, self.classes, self.n), np.int64)


def _threads(words: int) -> int:
    return max(32, min(1024, -(-words // 32) * 32))


def _decls(g: _Geometry) -> list[tuple[KernelInfo, list[ScratchDecl]]]:
    gl = (MemorySpace.GLOBAL,)
    P, n, W = g.problems, g.n, g.words
    reduce = KernelInfo("nms_reduce", "non_max_suppression", _threads(W), P, "cuda")
    return [
        (KernelInfo("nms_pipeline", "non_max_suppression", 256, 1, "cuda"), [
            ScratchDecl("order", shared=True, per_workgroup=P * n * 8, spaces=gl, alignment=256,
                        purpose="box indices by decreasing score"),
            ScratchDecl("boxes", shared=True, per_workgroup=P * n * 16, spaces=gl, alignment=256,
                        purpose="corners in score order"),
            ScratchDecl("valid", shared=True, per_workgroup=P * n, spaces=gl, alignment=256,
                        purpose="candidate flags (score not nan, above the threshold)"),
            ScratchDecl("mask", shared=True, per_workgroup=P * n * W * 8, spaces=gl, alignment=256,
                        purpose="suppression bits, one per box pair"),
            ScratchDecl("keep", shared=True, per_workgroup=P * g.cap * 8, spaces=gl, alignment=256,
                        purpose="selected box indices per problem"),
            ScratchDecl("counts", shared=True, per_workgroup=P * 8, spaces=gl, alignment=256,
                        purpose="selected count per problem"),
        ]),
        (reduce, [ScratchDecl("removed", shared=True, per_workgroup=W * 8,
                              spaces=(MemorySpace.WORKGROUP, MemorySpace.GLOBAL), alignment=16,
                              purpose="removed bits of one problem")]),
    ]


def _requests(device: "CUDADevice", g: _Geometry, op_attrs: dict, ins, outs) -> tuple:
    problem = Problem("non_max_suppression", op_attrs, tuple(ins), tuple(outs))
    own = tuple(d.request(problem, k) for k, ds in _decls(g) for d in ds)
    sort_reqs = sorting.scratch_requests(device, "argsort", _ARGSORT, (g.scores_type,), (g.order_type,))
    return own + tuple(sort_reqs)


def scratch_requests(device: "CUDADevice", attrs: dict, ins, outs) -> tuple:
    """Scratch of one ``non_max_suppression`` instance (the core's ``Device.scratch``)."""
    boxes, scores = ins
    g = _Geometry(scores.shape[0], scores.shape[1], scores.shape[2], attrs["max_output_boxes_per_class"])
    if g.n == 0 or g.problems == 0:
        return ()
    return _requests(device, g, attrs, ins, outs)


def _view(ptr: int, shape: tuple, dtype: Any, owner: Any, device_id: int) -> Any:
    import cupy as cp

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = cp.cuda.UnownedMemory(ptr, max(nbytes, 1), owner, device_id)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))


class _Pipeline:
    """Bound kernels and scratch of one NMS geometry on one device."""

    def __init__(self, device: "CUDADevice", g: _Geometry, mode: int, iou: float, score_threshold: float | None,
                 requests: tuple, binding: Any) -> None:
        self.device, self.g, self.mode = device, g, mode
        own = tuple(r for r in requests if r.kernel.op != "argsort")
        self.scratch = sorting.Scratch(device, own, binding)
        self.argsort = sorting.prepare(device, "argsort", _ARGSORT, (g.scores_type,), (g.order_type,), binding)
        s, dev_id = self.scratch, device.ordinal
        P, n, W = g.problems, g.n, g.words
        self.order = _view(s.ptrs["order"], (g.batches, g.classes, n), np.int64, s, dev_id)
        self.keep = _view(s.ptrs["keep"], (P, g.cap), np.int64, s, dev_id)
        self.counts = _view(s.ptrs["counts"], (P,), np.int64, s, dev_id)
        get = lambda e: function(device, "nms.cu", _EXPRS, e)  # noqa: E731
        self.k_boxes, self.k_mask, self.k_reduce, self.k_write = (get(e) for e in _EXPRS)
        shared = s.spaces["removed"] is MemorySpace.WORKGROUP
        self.reduce_smem = W * 8 if shared else 0
        if self.reduce_smem > 48 * 1024:
            self.k_reduce.max_dynamic_shared_size_bytes = self.reduce_smem
        removed = np.uint64(0) if shared else s.ptr("removed")
        sms = int(device.spec.limits.get("multiprocessors", 1))
        has_thr = score_threshold is not None
        self.boxes_args = (s.ptr("boxes"), s.ptr("valid"), np.int64(P), np.int32(g.classes), np.int32(n),
                           np.int32(mode), np.int32(has_thr), np.float32(score_threshold if has_thr else 0.0))
        self.boxes_grid = (max(1, min(-(-(P * n) // 256), sms * 32)),)
        self.mask_args = (s.ptr("boxes"), np.int32(n), np.int32(W), np.int32(mode), np.float32(iou), s.ptr("mask"))
        self.reduce_args = (s.ptr("mask"), s.ptr("valid"), s.ptr("order"), np.int32(n), np.int32(W),
                            np.int64(g.max_out), np.int64(g.cap), removed, s.ptr("keep"), s.ptr("counts"))
        self.reduce_block = (_threads(W),)

    def run(self, boxes: Any, scores: Any) -> None:
        """Everything up to the kept indices and counts (no host synchronisation)."""
        g, launch = self.g, self.device.launch
        self.argsort(scores, self.order)
        launch(self.k_boxes, "nms_boxes", self.boxes_grid, (256,), (boxes, scores, self.order) + self.boxes_args)
        launch(self.k_mask, "nms_mask", (g.words, g.words, g.problems), (64,), self.mask_args)
        launch(self.k_reduce, "nms_reduce", (g.problems,), self.reduce_block, self.reduce_args, self.reduce_smem)

    def counts_host(self, device: "CUDADevice") -> int:
        """The first problem's kept count, read back (waits for the device's stream)."""
        from cupy.cuda import runtime

        if not hasattr(self, "_count_host"):
            self._count_host = np.zeros(1, np.int64)
        runtime.memcpyAsync(self._count_host.ctypes.data, self.counts.data.ptr, 8, 2, device.stream.ptr)
        device.stream.synchronize()
        return int(self._count_host[0])

    def write(self, selected: Any, num_selected: Any) -> None:
        """ONNX's padded output rows and count."""
        from cupy.cuda import runtime

        if selected.nbytes:
            runtime.memsetAsync(selected.data.ptr, 0xFF, selected.nbytes, self.device.stream.ptr)  # -1 rows
        self.device.launch(self.k_write, "nms_write", (1,), (256,),
                           (self.keep, self.counts, np.int64(self.g.problems), np.int32(self.g.classes),
                            np.int64(self.g.cap), selected, num_selected))


def prepare_op(device: "CUDADevice", attrs: dict, ins, outs, binding: Any = None):
    """The kernel of one ``non_max_suppression`` instance: ``fn(boxes, scores, selected, num_selected)``."""
    import cupy as cp

    boxes_t, scores_t = ins
    g = _Geometry(scores_t.shape[0], scores_t.shape[1], scores_t.shape[2], attrs["max_output_boxes_per_class"])
    if g.n == 0 or g.problems == 0 or g.max_out == 0:
        def empty(boxes, scores, selected, num_selected):
            if selected.size:
                selected.fill(-1)
            num_selected.fill(0)
        return empty
    mode = MODE_ONNX_CENTER if int(attrs["center_point_box"]) else MODE_ONNX_CORNERS
    thr = attrs["score_threshold"]
    pipe = _Pipeline(device, g, mode, float(attrs["iou_threshold"]),
                     None if thr is None else float(thr), _requests(device, g, attrs, ins, outs), binding)

    def kernel(boxes, scores, selected, num_selected):
        pipe.run(cp.ascontiguousarray(boxes), cp.ascontiguousarray(scores))
        pipe.write(selected, num_selected)

    kernel.kernel_name = "nms (argsort, nms_boxes, nms_mask, nms_reduce, nms_write)"  # type: ignore[attr-defined]
    kernel.pipeline = pipe  # type: ignore[attr-defined]
    return kernel


# ------------------------------------------------------------------------- torchvision-compatible

_cache: dict[tuple, _Pipeline] = {}
_cache_lock = threading.Lock()
_devices: dict[Any, Any] = {}


def nms(boxes: Any, scores: Any, iou_threshold: float, *, device: Any = None) -> Any:
    """Indices (``cupy`` int64) of the boxes kept by greedy NMS, by decreasing score — the same
    contract as ``torchvision.ops.nms``: ``boxes`` (N, 4) float32 ``(x1, y1, x2, y2)``,
    ``scores`` (N,), a box is dropped when its IoU with a kept box exceeds ``iou_threshold``.

    Inputs may be anything DLPack or ``cupy.asarray`` accepts (cupy, torch CUDA tensors, polyhal
    tensors, numpy); ``device`` defaults to the best-ranked CUDA device. The number of kept boxes
    is data-dependent, so this waits for the device once (to read the count), as torchvision
    does. Pipelines (kernels and scratch) are cached per (device, N).
    """
    import cupy as cp

    import polyhal

    dev = _devices.get(device)
    if dev is None:
        dev = _devices[device] = polyhal.get_device(device) if device is not None else next(
            polyhal.get_device(s.name) for s in polyhal.devices() if s.backend == "cuda")
    with dev.activate():
        b = _as_cupy(boxes)
        s = _as_cupy(scores)
        if b.dtype != np.float32 or not b.flags.c_contiguous:
            b = cp.ascontiguousarray(b, dtype=np.float32)
        if s.dtype != np.float32 or not s.flags.c_contiguous:
            s = cp.ascontiguousarray(s, dtype=np.float32)
        n = int(s.shape[0])
        if b.shape != (n, 4):
            raise ValueError(f"boxes must be (N, 4) with N = len(scores) = {n}, got {tuple(b.shape)}")
        if n == 0:
            return cp.empty(0, np.int64)
        key = (dev.name, n, float(iou_threshold))
        pipe = _cache.get(key) or _pipeline(dev, key, n, float(iou_threshold))
        pipe.run(b, s.reshape(1, 1, n))
        count = int(pipe.counts_host(dev))
        return pipe.keep[0, :count].copy()


def _pipeline(dev: Any, key: tuple, n: int, iou_threshold: float) -> _Pipeline:
    with _cache_lock:
        pipe = _cache.get(key)
        if pipe is None:
            g = _Geometry(1, 1, n, n)
            ins = (TensorType((1, n, 4), np.float32), g.scores_type)
            outs = (TensorType((n, 3), np.int64), TensorType((), np.int64))
            pipe = _cache[key] = _Pipeline(dev, g, MODE_TORCHVISION, iou_threshold, None,
                                           _requests(dev, g, {}, ins, outs), None)
        return pipe


def _as_cupy(x: Any) -> Any:
    import cupy as cp

    if isinstance(x, cp.ndarray):
        return x
    if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        return cp.from_dlpack(x)
    return cp.asarray(x)
