"""Detection (NonMaxSuppression). The quantization ops live in
:mod:`polyhal.frontends.onnx.converters.quantize`."""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.errors import OnnxUnsupportedError
from polyhal.frontends.onnx.types import Dynamic
from polyhal.ops import OPS


@converter("NonMaxSuppression")
def _nms(ctx: NodeContext) -> list:
    if "non_max_suppression" not in OPS:
        raise OnnxUnsupportedError("NonMaxSuppression: this polyhal has no non_max_suppression op")
    boxes, scores = ctx.input(0), ctx.input(1)
    # The limits decide the output bound, so they must be known when the model is loaded.
    limit = ctx.const(2, "max_output_boxes_per_class")
    iou = ctx.const(3, "iou_threshold")
    score = ctx.const(4, "score_threshold")
    selected, count = ctx.op(
        "non_max_suppression", boxes, scores,
        max_output_boxes_per_class=0 if limit is None else int(np.asarray(limit).reshape(-1)[0]),
        iou_threshold=0.0 if iou is None else float(np.asarray(iou).reshape(-1)[0]),
        score_threshold=None if score is None else float(np.asarray(score).reshape(-1)[0]),
        center_point_box=int(ctx.attr("center_point_box", 0)))
    if isinstance(selected, np.ndarray):  # known boxes and scores: folded
        return [np.ascontiguousarray(selected[: int(count)])]
    return [Dynamic(selected, count, f"NonMaxSuppression node {ctx.label}")]
