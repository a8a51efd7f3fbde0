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

from polyhal.frontends.onnx.converters import NodeContext, converter
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


@converter("Unique")
def _unique(ctx: NodeContext) -> list:
    x = ctx.input(0)
    axis = ctx.attr("axis", None)
    keep_sorted = bool(int(ctx.attr("sorted", 1)))
    if isinstance(x, np.ndarray):
        return _unique_known(x, axis, keep_sorted)
    shape = ctx.shape(x)
    n = math.prod(shape)
    if axis is not None and len(shape) > 1:
        raise OnnxUnsupportedError("Unique along an axis of a run-time tensor of rank > 1 (only the "
                                   "flattened form runs on the device)")
    if n == 0:
        raise OnnxUnsupportedError("Unique of a run-time empty tensor")
    flat = reshape(ctx, x, (n,))
    perm = ctx.op("argsort", flat, axis=0)  # stable: equal values keep their original order
    ordered = ctx.op("gather", flat, perm, axis=0)
    if n == 1:
        is_new = np.ones((1,), bool)
    else:
        head = ctx.op("slice", ordered, starts=[1], ends=[n], axes=[0], steps=[1])
        tail = ctx.op("slice", ordered, starts=[0], ends=[n - 1], axes=[0], steps=[1])
        is_new = ctx.op("concat", np.ones((1,), bool), ctx.op("not_equal", head, tail), axis=0)
    group = ctx.op("sub", ctx.op("cumsum", cast(ctx, is_new, _I64), axis=0), np.array(1, _I64))
    starts, count = _selected_first(ctx, is_new)
    y = ctx.op("gather", ordered, starts, axis=0)
    first = ctx.op("gather", perm, starts, axis=0)  # the smallest original index of each value
    zeros = np.zeros((n,), _I64)
    inverse = ctx.op("scatter_elements", zeros, perm, group, axis=0)
    counts = ctx.op("scatter_elements", zeros, group, np.ones((n,), _I64), axis=0, reduction="add")
    if not keep_sorted:  # reorder the values by first occurrence; padding sorts last
        key = ctx.op("where", ctx.op("less", np.arange(n, dtype=_I64), count), first, np.array(n, _I64))
        by_first = cast(ctx, ctx.op("argsort", key, axis=0), _I64)
        rank = ctx.op("scatter_elements", zeros, by_first, np.arange(n, dtype=_I64), axis=0)
        y, first, counts = (ctx.op("gather", v, by_first, axis=0) for v in (y, first, counts))
        inverse = ctx.op("gather", rank, inverse, axis=0)
    what = f"Unique node {ctx.label}"
    return [Dynamic(y, count, what), Dynamic(first, count, what), inverse, Dynamic(counts, count, what)]


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
