"""Non-maximum suppression on CUDA (``cu/nms.cu``): the ONNX op ``non_max_suppression`` and a
torchvision-compatible :func:`nms`.

Both run the same pipeline, shared with polyhal-hip (:mod:`polyhal_gpu.nms`, whose
docstring describes it and its scratch): an argsort of the scores (:mod:`.sorting`), the boxes
in that order, one suppression bit per box pair, and a greedy walk per problem. CUDA's own here:
cupy views of the scratch, the opt-in to more than 48 KiB of shared memory, reading the kept
count back for :func:`nms`, and the pipelines that :func:`nms` caches per (device, N).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.ir.types import TensorType

from polyhal_cuda import sorting
from polyhal_cuda.allocator import array_view
from polyhal_cuda.cuda_source import function
from polyhal_gpu import nms as portable
from polyhal_gpu.nms import Geometry

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one


def _requests(device: "Device", g: Geometry, op_attrs: dict, ins, outs) -> tuple:
    return portable.scratch_requests(device, g, op_attrs, ins, outs, backend="cuda",
                                     sort_requests=sorting.scratch_requests)


def scratch_requests(device: "Device", op: str, attrs: dict, ins, outs) -> tuple:
    """Scratch of one ``non_max_suppression`` instance (the core's ``Device.scratch``)."""
    g = Geometry.of_op(attrs, ins[1])
    if g.empty:
        return ()
    return _requests(device, g, attrs, ins, outs)


class _Pipeline(portable.Pipeline):
    """The pipeline of one NMS geometry on one CUDA device, with cupy views of the order, the
    kept indices and the counts."""

    def __init__(self, device: "Device", g: Geometry, mode: int, iou: float, score_threshold: float | None,
                 requests: tuple, binding: Any) -> None:
        s = sorting.scratch(device, portable.own_requests(requests), binding)
        argsort = sorting.prepare(device, "argsort", portable.ARGSORT_ATTRS, (g.scores_type,), (g.order_type,),
                                  binding)
        dev_id = device.ordinal
        order = array_view(s.ptrs["order"], (g.batches, g.classes, g.n), np.int64, s, dev_id)
        self.keep = array_view(s.ptrs["keep"], (g.problems, g.cap), np.int64, s, dev_id)
        self.counts = array_view(s.ptrs["counts"], (g.problems,), np.int64, s, dev_id)
        functions = [function(device, portable.SOURCE, portable.EXPRESSIONS, e) for e in portable.EXPRESSIONS]
        super().__init__(device, g, mode, iou, score_threshold, s, functions, argsort, order, _fill(device))
        if self.reduce_smem > 48 * 1024:
            self.k_reduce.max_dynamic_shared_size_bytes = self.reduce_smem

    def counts_host(self, device: "Device") -> int:
        """The first problem's kept count, read back (waits for the device's stream)."""
        from cupy.cuda import runtime

        if not hasattr(self, "_count_host"):
            self._count_host = np.zeros(1, np.int64)
        runtime.memcpyAsync(self._count_host.ctypes.data, self.counts.data.ptr, 8, 2, device.stream.ptr)
        device.stream.synchronize()
        return int(self._count_host[0])


def _fill(device: "Device"):
    def fill(array: Any, byte: int) -> None:
        from cupy.cuda import runtime

        runtime.memsetAsync(array.data.ptr, byte, array.nbytes, device.stream.ptr)
    return fill


def prepare(device: "Device", op: str, attrs: dict, ins, outs, binding: Any = None):
    """The kernel of one ``non_max_suppression`` instance: ``fn(boxes, scores, selected, num_selected)``."""
    import cupy as cp

    g = Geometry.of_op(attrs, ins[1])
    if g.empty or g.max_out == 0:
        def empty(boxes, scores, selected, num_selected):
            if selected.size:
                selected.fill(-1)
            num_selected.fill(0)
        return empty
    pipe = _Pipeline(device, g, *portable.op_settings(attrs), _requests(device, g, attrs, ins, outs), binding)
    return pipe.op_kernel(cp.ascontiguousarray)


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
            g = Geometry(1, 1, n, n)
            ins = (TensorType((1, n, 4), np.float32), g.scores_type)
            outs = (TensorType((n, 3), np.int64), TensorType((), np.int64))
            pipe = _cache[key] = _Pipeline(dev, g, portable.MODE_TORCHVISION, iou_threshold, None,
                                           _requests(dev, g, {}, ins, outs), None)
        return pipe


def _as_cupy(x: Any) -> Any:
    import cupy as cp

    if isinstance(x, cp.ndarray):
        return x
    if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        return cp.from_dlpack(x)
    return cp.asarray(x)
