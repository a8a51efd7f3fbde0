"""Non-maximum suppression through ``cu/nms.cu``: the geometry of an instance, its scratch, the
pipeline of launches.

The pipeline (see the CUDA source): an argsort of the scores by decreasing score (the backend's,
stable: ties keep the lower index first), the boxes in that order (``nms_boxes``), one
suppression bit per box pair (``nms_mask``), a greedy walk per problem that keeps the removed
bits in shared memory when they fit (``nms_reduce``), and ONNX's padded output rows
(``nms_write``). Scratch is declared to the core (:func:`scratch_requests`), so a plan's
bufferization places it: the argsort's own, the sorted order and boxes, the candidate flags, the
suppression mask (``n * ceil(n / 64)`` words per problem: 1.25 GB for 100,000 boxes, as
torchvision's), the kept indices and counts -- global; the removed bits -- shared-first.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl
from polyhal.ir.types import TensorType

from polyhal_gpu.launch import NULL, grid, multiprocessors
from polyhal_gpu.scratch import Scratch

#: The CUDA C source, under ``polyhal_gpu/cu/``.
SOURCE = "nms.cu"
#: Its kernels, in pipeline order.
EXPRESSIONS: tuple[str, ...] = ("nms_boxes", "nms_mask", "nms_reduce", "nms_write")
#: Box encodings (the kernels' ``mode``): ONNX corners, ONNX centers, torchvision's corners.
MODE_ONNX_CORNERS, MODE_ONNX_CENTER, MODE_TORCHVISION = 0, 1, 2
#: The argsort that orders the boxes of every problem.
ARGSORT_ATTRS = {"axis": -1, "descending": True}


class Geometry:
    """The sizes of one NMS instance: ``batches`` x ``classes`` problems of ``n`` boxes,
    ``words`` 64-bit mask words per box, at most ``max_out`` (capped: ``cap``) kept per problem."""

    def __init__(self, batches: int, classes: int, n: int, max_out: int) -> None:
        self.batches, self.classes, self.n = batches, classes, n
        self.problems = batches * classes
        self.words = -(-n // 64)
        self.max_out = max(int(max_out), 0)
        self.cap = max(min(self.max_out, n), 1)

    @classmethod
    def of_op(cls, attrs: dict, scores: Any) -> "Geometry":
        """The geometry of a ``non_max_suppression`` op with ``scores`` of shape (batches, classes, n)."""
        return cls(scores.shape[0], scores.shape[1], scores.shape[2], attrs["max_output_boxes_per_class"])

    @property
    def empty(self) -> bool:
        """No box in any problem: nothing to declare or launch."""
        return self.n == 0 or self.problems == 0

    @property
    def scores_type(self) -> TensorType:
        return TensorType((self.batches, self.classes, self.n), np.float32)

    @property
    def order_type(self) -> TensorType:
        return TensorType((self.batches, self.classes, self.n), np.int64)


def op_settings(attrs: dict) -> tuple[int, float, float | None]:
    """(box encoding, IoU threshold, score threshold or None) of a ``non_max_suppression`` op,
    as :class:`Pipeline` takes them."""
    thr = attrs["score_threshold"]
    mode = MODE_ONNX_CENTER if int(attrs["center_point_box"]) else MODE_ONNX_CORNERS
    return mode, float(attrs["iou_threshold"]), None if thr is None else float(thr)


def reduce_threads(words: int) -> int:
    """Threads of ``nms_reduce``: warp 0 (the walk) and about three helpers per mask word of a
    row, in whole warps (at least one), at most 1024 in all. Measured on an H100: 10,000 boxes
    (157 words) walk in 373 us with 512 threads, 417 us with 1024; 100,000 boxes (1563 words)
    in 10.3 ms with 1024, 15.5 ms with 512 (plugins/cuda/tools/probe.py)."""
    return min(1024, 32 + max(32, -(-words * 3 // 32) * 32))


def scratch_decls(g: Geometry, backend: str) -> list[tuple[KernelInfo, list[ScratchDecl]]]:
    """The NMS kernels' scratch (the argsort's is the sort's own), labelled with ``backend``."""
    gl = (MemorySpace.GLOBAL,)
    P, n, W = g.problems, g.n, g.words
    reduce = KernelInfo("nms_reduce", "non_max_suppression", reduce_threads(W), P, backend)
    return [
        (KernelInfo("nms_pipeline", "non_max_suppression", 256, 1, backend), [
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


def scratch_requests(device: Any, g: Geometry, attrs: dict, ins, outs, *, backend: str,
                     sort_requests: Callable[..., Sequence[Any]]) -> tuple:
    """The NMS kernels' requests, then the argsort's: ``sort_requests(device, op, attrs, ins,
    outs)`` is the backend's (its sort plan decides them)."""
    problem = Problem("non_max_suppression", attrs, tuple(ins), tuple(outs))
    own = tuple(d.request(problem, k) for k, ds in scratch_decls(g, backend) for d in ds)
    return own + tuple(sort_requests(device, "argsort", ARGSORT_ATTRS, (g.scores_type,), (g.order_type,)))


def own_requests(requests: Sequence[Any]) -> tuple:
    """The NMS kernels' part of :func:`scratch_requests` (the argsort binds its own)."""
    return tuple(r for r in requests if r.kernel.op != "argsort")


class Pipeline:
    """The launches of one NMS geometry on one device, bound to their scratch.

    ``functions`` are the backend's loaded :data:`EXPRESSIONS`; ``argsort`` its prepared
    ``fn(scores, order)`` and ``order`` its array over the ``order`` scratch; ``fill(array,
    byte)`` sets an array's bytes on the device's stream. :meth:`run` computes the kept indices
    and counts (no host synchronisation), :meth:`write` ONNX's outputs.
    """

    def __init__(self, device: Any, g: Geometry, mode: int, iou: float, score_threshold: float | None,
                 scratch: Scratch, functions: Sequence[Any], argsort: Callable[..., None], order: Any,
                 fill: Callable[[Any, int], None]) -> None:
        self.device, self.g, self.mode, self.scratch = device, g, mode, scratch
        self.k_boxes, self.k_mask, self.k_reduce, self.k_write = functions
        self.argsort, self.order, self.fill = argsort, order, fill
        s = scratch
        P, n, W = g.problems, g.n, g.words
        shared = s.spaces["removed"] is MemorySpace.WORKGROUP
        #: Dynamic shared memory of ``nms_reduce`` (0 where the removed bits went to global scratch).
        self.reduce_smem = W * 8 if shared else 0
        removed = NULL if shared else s.ptr("removed")
        has_thr = score_threshold is not None
        self.boxes_args = (s.ptr("boxes"), s.ptr("valid"), np.int64(P), np.int32(g.classes), np.int32(n),
                           np.int32(mode), np.int32(has_thr), np.float32(score_threshold if has_thr else 0.0))
        self.boxes_grid = grid(P * n, multiprocessors(device))
        self.mask_args = (s.ptr("boxes"), np.int32(n), np.int32(W), np.int32(mode), np.float32(iou), s.ptr("mask"))
        self.reduce_args = (s.ptr("mask"), s.ptr("valid"), s.ptr("order"), np.int32(n), np.int32(W),
                            np.int64(g.max_out), np.int64(g.cap), removed, s.ptr("keep"), s.ptr("counts"))
        self.reduce_block = (reduce_threads(W),)
        self.write_args = (s.ptr("keep"), s.ptr("counts"), np.int64(P), np.int32(g.classes), np.int64(g.cap))

    def run(self, boxes: Any, scores: Any) -> None:
        """Everything up to the kept indices and counts (no host synchronisation)."""
        g, launch = self.g, self.device.launch
        self.argsort(scores, self.order)
        launch(self.k_boxes, "nms_boxes", self.boxes_grid, (256,), (boxes, scores, self.order) + self.boxes_args)
        launch(self.k_mask, "nms_mask", (g.words, g.words, g.problems), (64,), self.mask_args)
        launch(self.k_reduce, "nms_reduce", (g.problems,), self.reduce_block, self.reduce_args, self.reduce_smem)

    def write(self, selected: Any, num_selected: Any) -> None:
        """ONNX's padded output rows (-1 beyond the kept boxes) and count."""
        if selected.nbytes:
            self.fill(selected, 0xFF)
        self.device.launch(self.k_write, "nms_write", (1,), (256,), self.write_args + (selected, num_selected))

    def op_kernel(self, dense: Callable[[Any], Any] | None = None) -> Callable[..., None]:
        """``fn(boxes, scores, selected, num_selected)``: the ``non_max_suppression`` op.
        ``dense(array)``, where given, makes each input contiguous first (cupy may hand in views)."""
        def kernel(boxes, scores, selected, num_selected):
            if dense is not None:
                boxes, scores = dense(boxes), dense(scores)
            self.run(boxes, scores)
            self.write(selected, num_selected)

        kernel.kernel_name = "nms (argsort, nms_boxes, nms_mask, nms_reduce, nms_write)"  # type: ignore[attr-defined]
        kernel.pipeline = self  # type: ignore[attr-defined]
        return kernel
