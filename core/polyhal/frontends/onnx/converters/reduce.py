"""ONNX reductions, ArgMax/ArgMin and the softmax family.

ONNX's reductions take their axes as an attribute before opset 18 (13 for ReduceSum) and as an
input after; an empty axes list reduces everything unless ``noop_with_empty_axes``. Reducing
over an empty axis gives the reduction's identity (0, 1, -inf, ...), which polyhal folds to a
constant since it does not depend on the data.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.tensor import ints, norm_axis, reshape
from polyhal.frontends.onnx.errors import OnnxModelError

#: op type -> (opset from which axes are an input, identity over an empty axis)
_REDUCE = {
    "ReduceSum": (13, 0.0), "ReduceMean": (18, np.nan), "ReduceMax": (18, -np.inf), "ReduceMin": (18, np.inf),
    "ReduceProd": (18, 1.0), "ReduceL1": (18, 0.0), "ReduceL2": (18, 0.0), "ReduceLogSum": (18, -np.inf),
    "ReduceLogSumExp": (18, -np.inf), "ReduceSumSquare": (18, 0.0),
}


def _extreme(dtype: np.dtype, value: float):
    if dtype.kind == "f" or not np.isinf(value):
        return value
    info = np.iinfo(dtype) if dtype.kind in "iu" else None
    if info is None:  # bool
        return value > 0
    return info.max if value > 0 else info.min


@converter(*_REDUCE)
def _reduce(ctx: NodeContext) -> list:
    x = ctx.input(0)
    since, identity = _REDUCE[ctx.op_type]
    shape = ctx.shape(x)
    rank = len(shape)
    keepdims = bool(ctx.attr("keepdims", 1))
    if ctx.opset < since:
        axes = ctx.attr("axes", None)
        axes = None if axes is None else [int(a) for a in axes]
        noop = False
    else:
        a = ctx.const(1, "the axes")
        axes = None if a is None else ints(a)
        noop = bool(ctx.attr("noop_with_empty_axes", 0))
    if axes is not None and not axes:
        axes = None
    if axes is None and noop:
        return [_elementwise_part(ctx, x)]
    axes = sorted({norm_axis(a, rank, "axes entry") for a in (range(rank) if axes is None else axes)})
    out_shape = [1 if i in axes else d for i, d in enumerate(shape) if keepdims or i not in axes]
    dt = ctx.dtype(x)
    if any(shape[a] == 0 for a in axes):
        return [ctx.full(out_shape, _extreme(dt, identity), dt)]
    kw = {"axes": axes, "keepdims": keepdims}
    op = ctx.op_type
    if op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"):
        return [ctx.op({"ReduceSum": "reduce_sum", "ReduceMean": "reduce_mean", "ReduceMax": "reduce_max",
                        "ReduceMin": "reduce_min"}[op], x, **kw)]
    if op == "ReduceProd":
        return [ctx.op("reduce_prod", x, **kw)]
    if op == "ReduceL1":
        return [ctx.op("reduce_sum", ctx.op("abs", x), **kw)]
    if op == "ReduceSumSquare":
        return [ctx.op("reduce_sum", ctx.op("mul", x, x), **kw)]
    if op == "ReduceL2":
        s = ctx.op("reduce_sum", ctx.op("mul", x, x), **kw)
        return [_sqrt_any(ctx, s)]
    if op == "ReduceLogSum":
        return [ctx.op("log", ctx.op("reduce_sum", x, **kw))]
    # ReduceLogSumExp: m + log(sum(exp(x - m))), with m the max, so exp cannot overflow.
    m = ctx.op("reduce_max", x, axes=axes, keepdims=True)
    m = ctx.op("where", ctx.op("isinf", m), ctx.scalar(0, dt), m)
    s = ctx.op("log", ctx.op("reduce_sum", ctx.op("exp", ctx.op("sub", x, m)), **kw))
    return [ctx.op("add", s, m if keepdims else reshape(ctx, m, out_shape))]


def _sqrt_any(ctx: NodeContext, x):
    dt = ctx.dtype(x)
    if dt.kind == "f":
        return ctx.op("sqrt", x)
    return ctx.op("cast", ctx.op("sqrt", ctx.op("cast", x, dtype="float64")), dtype=str(dt))


def _elementwise_part(ctx: NodeContext, x):
    """What a reduction does to each element when it reduces nothing (noop_with_empty_axes)."""
    op = ctx.op_type
    if op == "ReduceL1":
        return ctx.op("abs", x)
    if op == "ReduceL2":
        return ctx.op("abs", x)
    if op == "ReduceSumSquare":
        return ctx.op("mul", x, x)
    if op == "ReduceLogSum":
        return ctx.op("log", x)
    return x


@converter("ArgMax", "ArgMin")
def _arg(ctx: NodeContext) -> list:
    x = ctx.input(0)
    rank = ctx.rank(x)
    axis = norm_axis(int(ctx.attr("axis", 0)), rank)
    keepdims = bool(ctx.attr("keepdims", 1))
    op = "argmax" if ctx.op_type == "ArgMax" else "argmin"
    if not int(ctx.attr("select_last_index", 0)):
        return [ctx.op(op, x, axis=axis, keepdims=keepdims)]
    # The last of equal extremes: search the reversed axis, then map the index back.
    n = ctx.shape(x)[axis]
    flipped = ctx.op("slice", x, starts=[-1], ends=[-(2**63)], axes=[axis], steps=[-1])
    idx = ctx.op(op, flipped, axis=axis, keepdims=keepdims)
    return [ctx.op("sub", ctx.scalar(n - 1, np.int64), idx)]


def _coerced(ctx: NodeContext, x, axis: int):
    """Before opset 13 softmax-like ops work on x flattened to 2-D at ``axis``."""
    shape = ctx.shape(x)
    axis = norm_axis(axis, len(shape)) if shape else 0
    rows = int(np.prod(shape[:axis], dtype=np.int64))
    return reshape(ctx, x, (rows, int(np.prod(shape[axis:], dtype=np.int64)))), shape


@converter("Softmax", "LogSoftmax", "Hardmax")
def _softmax(ctx: NodeContext) -> list:
    x = ctx.input(0)
    if ctx.rank(x) == 0:
        raise OnnxModelError(f"{ctx.op_type} needs rank >= 1")
    if ctx.opset < 13:
        flat, shape = _coerced(ctx, x, int(ctx.attr("axis", 1)))
        return [reshape(ctx, _softmax_along(ctx, flat, -1), shape)]
    return [_softmax_along(ctx, x, int(ctx.attr("axis", -1)))]


def _softmax_along(ctx: NodeContext, x, axis: int):
    axis = norm_axis(axis, ctx.rank(x))
    if ctx.op_type == "Softmax":
        return ctx.op("softmax", x, axis=axis)
    if ctx.op_type == "LogSoftmax":
        m = ctx.op("reduce_max", x, axes=[axis], keepdims=True)
        shifted = ctx.op("sub", x, m)
        lse = ctx.op("log", ctx.op("reduce_sum", ctx.op("exp", shifted), axes=[axis], keepdims=True))
        return ctx.op("sub", shifted, lse)
    # Hardmax: 1 at the first maximum along the axis.
    n = ctx.shape(x)[axis]
    idx = ctx.op("argmax", x, axis=axis, keepdims=True)
    positions = np.arange(n, dtype=np.int64).reshape((n,) + (1,) * (ctx.rank(x) - axis - 1))
    hot = ctx.op("equal", idx, positions)
    dt = ctx.dtype(x)
    return ctx.op("where", hot, ctx.scalar(1, dt), ctx.scalar(0, dt))
