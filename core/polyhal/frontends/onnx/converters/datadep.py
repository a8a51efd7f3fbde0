"""Ops whose result length is data: NonZero and Unique, computed on the device.

A plan's buffers have static sizes, so these compute into a buffer of the static upper bound
(every element nonzero, every element unique) plus an int64 count, with existing core ops (a
stable argsort moves the selected positions to the front, in order). The result is a
:class:`~polyhal.frontends.onnx.types.Dynamic`: the front end cuts it to the count after the run,
and a staged model (:mod:`polyhal.frontends.onnx.staged`) ends a segment there, so the ops that
read it run in the next segment, specialized to the real size. Known inputs fold at import.
"""

from __future__ import annotations

import math

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.elementwise import cast
from polyhal.frontends.onnx.converters.tensor import norm_axis, reshape
from polyhal.frontends.onnx.errors import OnnxUnsupportedError
from polyhal.frontends.onnx.types import Dynamic

_I64 = np.dtype(np.int64)


def _selected_first(ctx: NodeContext, mask):
    """Positions of a 1-D bool ``mask``: the true ones first in ascending order, then the rest
    (a stable argsort of "not selected"), and how many are true (an int64 scalar)."""
    order = ctx.op("argsort", cast(ctx, ctx.op("logical_not", mask), np.dtype(np.int32)), axis=0)
    count = ctx.op("reduce_sum", cast(ctx, mask, _I64), axes=[0], keepdims=False)
    return cast(ctx, order, _I64), count


@converter("NonZero")
def _nonzero(ctx: NodeContext) -> list:
    x = ctx.input(0)
    if isinstance(x, np.ndarray):
        return [np.array(np.nonzero(np.atleast_1d(x)), dtype=_I64)]
    shape = ctx.shape(x)
    n = math.prod(shape)
    if not shape or n == 0:
        raise OnnxUnsupportedError("NonZero of a run-time scalar or empty tensor")
    flat = reshape(ctx, x, (n,))
    mask = ctx.op("not_equal", flat, np.zeros((), ctx.dtype(x)))
    order, count = _selected_first(ctx, mask)
    # Coordinates of every flat position (one row per axis), gathered in the selected order.
    table = np.indices(shape, dtype=_I64).reshape(len(shape), n)
    ctx.importer.check_fold(table.nbytes, "NonZero's coordinate table")
    padded = ctx.op("gather", table, order, axis=1)
    return [Dynamic(padded, count, f"NonZero node {ctx.label}", axis=1)]


def _unique_known(x: np.ndarray, axis, keep_sorted: bool) -> list:
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = norm_axis(int(axis), x.ndim)
    y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    if not keep_sorted:  # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        y, first, counts, inverse = np.take(y, order, axis=axis), first[order], counts[order], rank[inverse]
    return [np.array(y, order="C"), first.astype(_I64), inverse.reshape(-1).astype(_I64), counts.astype(_I64)]


#: Most elements per slice that Unique along an axis sorts by (one stable sort pass each).
MAX_UNIQUE_KEYS = 256


@converter("Unique")
def _unique(ctx: NodeContext) -> list:
    x = ctx.input(0)
    axis = ctx.attr("axis", None)
    keep_sorted = bool(int(ctx.attr("sorted", 1)))
    if isinstance(x, np.ndarray):
        return _unique_known(x, axis, keep_sorted)
    shape = ctx.shape(x)
    if axis is None:
        x, shape, axis = reshape(ctx, x, (math.prod(shape),)), (math.prod(shape),), 0
    axis = norm_axis(int(axis), len(shape))
    k, m = shape[axis], math.prod(shape) // max(shape[axis], 1)
    if k == 0 or m == 0:
        raise OnnxUnsupportedError("Unique of a run-time empty tensor")
    if m > MAX_UNIQUE_KEYS:
        raise OnnxUnsupportedError(f"Unique along an axis whose slices hold {m} elements (polyhal sorts by at "
                                   f"most {MAX_UNIQUE_KEYS})")
    order = [axis] + [d for d in range(len(shape)) if d != axis]
    moved = ctx.op("transpose", x, perm=order) if axis else x
    rows = reshape(ctx, moved, (k, m))
    if ctx.dtype(x) == np.dtype(bool):
        rows = cast(ctx, rows, np.dtype(np.int8))
    y, first, inverse, counts, count = _unique_rows(ctx, rows, k, m, keep_sorted)
    y = reshape(ctx, cast(ctx, y, ctx.dtype(x)), tuple(shape[d] for d in order))
    if axis:
        y = ctx.op("transpose", y, perm=[order.index(d) for d in range(len(shape))])
    what = f"Unique node {ctx.label}"
    return [Dynamic(y, count, what, axis=axis), Dynamic(first, count, what), inverse, Dynamic(counts, count, what)]


def _unique_rows(ctx: NodeContext, rows, k: int, m: int, keep_sorted: bool) -> tuple:
    """Unique rows of ``rows`` (k, m), each result padded to k: (values, first index, inverse,
    counts, count). Rows sort lexicographically by stable sorts from the last column to the first."""
    perm = None
    for j in reversed(range(m)):
        col = reshape(ctx, ctx.op("slice", rows, starts=[j], ends=[j + 1], axes=[1], steps=[1]), (k,))
        if perm is None:
            perm = cast(ctx, ctx.op("argsort", col, axis=0), _I64)
        else:
            step = cast(ctx, ctx.op("argsort", ctx.op("gather", col, perm, axis=0), axis=0), _I64)
            perm = ctx.op("gather", perm, step, axis=0)
    ordered = ctx.op("gather", rows, perm, axis=0)
    if k == 1:
        is_new = np.ones((1,), bool)
    else:
        head = ctx.op("slice", ordered, starts=[1], ends=[k], axes=[0], steps=[1])
        tail = ctx.op("slice", ordered, starts=[0], ends=[k - 1], axes=[0], steps=[1])
        differs = ctx.op("reduce_max", cast(ctx, ctx.op("not_equal", head, tail), np.dtype(np.int32)),
                         axes=[1], keepdims=False)
        is_new = ctx.op("concat", np.ones((1,), bool), cast(ctx, differs, np.dtype(bool)), axis=0)
    group = ctx.op("sub", ctx.op("cumsum", cast(ctx, is_new, _I64), axis=0), np.array(1, _I64))
    starts, count = _selected_first(ctx, is_new)
    y = ctx.op("gather", ordered, starts, axis=0)
    first = ctx.op("gather", perm, starts, axis=0)  # stable sorts: the smallest original index
    zeros = np.zeros((k,), _I64)
    inverse = ctx.op("scatter_elements", zeros, perm, group, axis=0)
    counts = ctx.op("scatter_elements", zeros, group, np.ones((k,), _I64), axis=0, reduction="add")
    if not keep_sorted:  # reorder the values by first occurrence; padding sorts last
        key = ctx.op("where", ctx.op("less", np.arange(k, dtype=_I64), count), first, np.array(k, _I64))
        by_first = cast(ctx, ctx.op("argsort", key, axis=0), _I64)
        rank = ctx.op("scatter_elements", zeros, by_first, np.arange(k, dtype=_I64), axis=0)
        y, first, counts = (ctx.op("gather", v, by_first, axis=0) for v in (y, first, counts))
        inverse = ctx.op("gather", rank, inverse, axis=0)
    return y, first, inverse, counts, count


@converter("TensorScatter")
def _tensor_scatter(ctx: NodeContext) -> list:
    """A KV-cache update: ``update`` written into ``past_cache`` along ``axis`` from each batch
    row's write index (modulo the cache length in circular mode), as one scatter_elements whose
    indices are computed on the device (the write indices may be run-time data)."""
    past, update = ctx.input(0), ctx.input(1)
    shape, ushape = ctx.shape(past), ctx.shape(update)
    axis = norm_axis(int(ctx.attr("axis", -2)), len(shape))
    if axis == 0:
        raise OnnxUnsupportedError("TensorScatter along the batch axis (axis 0)")
    mode = ctx.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        raise OnnxUnsupportedError(f"TensorScatter mode {mode!r} (ONNX defines 'linear' and 'circular')")
    ones = [1] * len(shape)
    steps = np.arange(ushape[axis], dtype=_I64).reshape(ones[:axis] + [ushape[axis]] + ones[axis + 1:])
    index = steps
    if ctx.has(2):
        start = reshape(ctx, cast(ctx, ctx.input(2), _I64), (ushape[0],) + tuple(ones[1:]))
        index = ctx.op("add", start, steps)
    if mode == "circular":
        index = ctx.op("mod", index, np.array(shape[axis], _I64))
    index = ctx.op("expand", index, shape=list(ushape))
    return [ctx.op("scatter_elements", past, index, update, axis=axis)]
