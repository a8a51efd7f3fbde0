"""Quantization (QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul) and
detection (NonMaxSuppression) ops.

Quantized values are computed through float32 (ONNX defines them that way: round half to even,
then saturate to the integer type), so they run on any device with the elementwise ops.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters import NodeContext, converter
from polyhal.frontends.onnx.converters.elementwise import cast
from polyhal.frontends.onnx.converters.tensor import norm_axis, reshape
from polyhal.frontends.onnx.errors import OnnxUnsupportedError
from polyhal.frontends.onnx.types import Dynamic, np_dtype
from polyhal.ops import OPS

_F32 = np.dtype(np.float32)


def _along(ctx: NodeContext, param, x, axis: int):
    """A per-axis (1-D) quantization parameter shaped to broadcast along ``axis`` of ``x``."""
    if ctx.rank(param) == 0 or ctx.type(param).size == 1 and ctx.rank(param) <= 1:
        return reshape(ctx, param, ()) if ctx.rank(param) else param
    if ctx.rank(param) != 1:
        raise OnnxUnsupportedError("blocked quantization (parameters of rank > 1) is not supported")
    rank = ctx.rank(x)
    axis = norm_axis(axis, rank)
    return reshape(ctx, param, (ctx.shape(param)[0],) + (1,) * (rank - axis - 1))


def _saturate(ctx: NodeContext, y, dtype: np.dtype):
    info = np.iinfo(dtype)
    y = ctx.op("maximum", ctx.op("minimum", y, ctx.scalar(info.max, ctx.dtype(y))), ctx.scalar(info.min, ctx.dtype(y)))
    return cast(ctx, y, dtype)


def _quantize(ctx: NodeContext, x, scale, zero_point, out_dtype: np.dtype, axis: int):
    xf = cast(ctx, x, _F32)
    q = ctx.op("round", ctx.op("div", xf, cast(ctx, _along(ctx, scale, x, axis), _F32)))
    if zero_point is not None:
        q = ctx.op("add", q, cast(ctx, _along(ctx, zero_point, x, axis), _F32))
    return _saturate(ctx, q, out_dtype)


@converter("QuantizeLinear")
def _quantize_linear(ctx: NodeContext) -> list:
    x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
    if int(ctx.attr("block_size", 0)):
        raise OnnxUnsupportedError("blocked quantization (block_size) is not supported")
    if zp is not None:
        out = ctx.dtype(zp)
    elif ctx.has_attr("output_dtype") and int(ctx.attr("output_dtype")):
        out = np_dtype(int(ctx.attr("output_dtype")), "QuantizeLinear's output_dtype")
    else:
        out = np.dtype(np.uint8)
    if out.kind not in "iu":
        raise OnnxUnsupportedError(f"QuantizeLinear to {out} (polyhal quantizes to integer types)")
    return [_quantize(ctx, x, scale, zp, out, int(ctx.attr("axis", 1)))]


@converter("DequantizeLinear")
def _dequantize_linear(ctx: NodeContext) -> list:
    x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
    if int(ctx.attr("block_size", 0)):
        raise OnnxUnsupportedError("blocked quantization (block_size) is not supported")
    axis = int(ctx.attr("axis", 1))
    sdt = ctx.dtype(scale)
    xf = cast(ctx, x, _F32)
    if zp is not None:
        xf = ctx.op("sub", xf, cast(ctx, _along(ctx, zp, x, axis), _F32))
    y = ctx.op("mul", xf, cast(ctx, _along(ctx, scale, x, axis), _F32))
    return [cast(ctx, y, sdt)]


@converter("DynamicQuantizeLinear")
def _dynamic_quantize_linear(ctx: NodeContext) -> list:
    x = ctx.input(0)
    zero = ctx.scalar(0, _F32)
    lo = ctx.op("minimum", ctx.op("reduce_min", x), zero)
    hi = ctx.op("maximum", ctx.op("reduce_max", x), zero)
    scale = ctx.op("div", ctx.op("sub", hi, lo), ctx.scalar(255, _F32))
    zp_f = ctx.op("round", ctx.op("sub", zero, ctx.op("div", lo, scale)))
    zp_f = ctx.op("maximum", ctx.op("minimum", zp_f, ctx.scalar(255, _F32)), zero)
    y = ctx.op("add", ctx.op("round", ctx.op("div", x, scale)), zp_f)
    return [_saturate(ctx, y, np.dtype(np.uint8)), scale, cast(ctx, zp_f, np.uint8)]


@converter("QLinearMatMul")
def _qlinear_matmul(ctx: NodeContext) -> list:
    a, sa, za, b, sb, zb, sy, zy = (ctx.input(i) for i in range(8))
    out = ctx.dtype(zy)
    if out.kind not in "iu" or ctx.dtype(a).kind not in "iu" or ctx.dtype(b).kind not in "iu":
        raise OnnxUnsupportedError("QLinearMatMul on non-integer types")
    af = ctx.op("sub", cast(ctx, a, _F32), cast(ctx, _row_param(ctx, za, a), _F32))
    bf = ctx.op("sub", cast(ctx, b, _F32), cast(ctx, zb, _F32))
    prod = ctx.op("matmul", af, bf)
    scale = ctx.op("div", ctx.op("mul", cast(ctx, _row_param(ctx, sa, a), _F32), cast(ctx, sb, _F32)),
                   cast(ctx, sy, _F32))
    q = ctx.op("add", ctx.op("round", ctx.op("mul", prod, scale)), cast(ctx, zy, _F32))
    return [_saturate(ctx, q, out)]


def _row_param(ctx: NodeContext, p, a):
    """A's per-row (M,) parameter as (M, 1)."""
    if ctx.rank(p) == 1 and ctx.shape(p)[0] > 1:
        return reshape(ctx, p, (ctx.shape(p)[0], 1))
    return p


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
