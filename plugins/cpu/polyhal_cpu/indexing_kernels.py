"""CPU kernels of :mod:`polyhal.ops.indexing`: expand, pad, gather/scatter by elements and by
index tuples, cumsum, cumprod, argmin, reduce_prod and einsum.

Index operands may be negative (counted from the end); indices are normalised once per call.
Out-of-range indices raise IndexError (numpy's fancy indexing checks them).
"""

from __future__ import annotations

import math

import numpy as np

from polyhal.ops import normalize_axes

from polyhal_cpu.table import TABLE, Kernel, Types, float16_via_float32


def _normalized(indices: np.ndarray, dims) -> np.ndarray:
    """``indices`` with negative entries counted from the end of ``dims`` (broadcast)."""
    return np.where(indices < 0, indices + np.asarray(dims, dtype=indices.dtype), indices)


@TABLE.register("expand")
def _expand(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    copyto = np.copyto

    def kernel(x, out):
        copyto(out, x)  # numpy broadcasts x to out's shape
    return kernel


@TABLE.register("pad")
def _pad(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    x_type = ins[0]
    rank = x_type.rank
    pads = [int(p) for p in attrs["pads"]]
    pairs = [(pads[i], pads[i + rank]) for i in range(rank)]
    crop = tuple(slice(-b if b < 0 else 0, d + e if e < 0 else d) for d, (b, e) in zip(x_type.shape, pairs))
    widths = [(max(b, 0), max(e, 0)) for b, e in pairs]
    mode = attrs["mode"]
    if mode == "constant":
        value = np.asarray(attrs["value"]).astype(x_type.dtype)
        inner = tuple(slice(b, b + (s.stop - s.start)) for (b, _), s in zip(widths, crop))

        def kernel(x, out):
            out.fill(value)
            np.copyto(out[inner], x[crop])
        return kernel

    def kernel(x, out):
        np.copyto(out, np.pad(x[crop], widths, mode=mode))
    return kernel


@TABLE.register("gather_elements")
def _gather_elements(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    data_type, idx_type = ins
    axis = int(attrs["axis"]) % data_type.rank
    dim = data_type.shape[axis]
    # take_along_axis broadcasts the other dims, but ONNX lets indices be smaller there: cut data.
    cut = tuple(slice(None) if i == axis else slice(0, k) for i, k in enumerate(idx_type.shape))

    def kernel(data, indices, out):
        idx = _normalized(indices, dim)
        if idx.size and (idx.min() < 0 or idx.max() >= dim):
            raise IndexError(f"gather_elements: an index is out of range for axis {axis} of size {dim}")
        np.copyto(out, np.take_along_axis(data[cut], idx, axis=axis))
    return kernel


@TABLE.register("gather_nd")
def _gather_nd(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    data_type, idx_type = ins
    b = int(attrs["batch_dims"])
    k = idx_type.shape[-1]
    batch = math.prod(data_type.shape[:b])
    rest = data_type.shape[b:]
    lookups = math.prod(idx_type.shape[b:-1])
    dims = np.asarray(rest[:k], dtype=np.int64)

    def kernel(data, indices, out):
        d = data.reshape((batch,) + rest)
        idx = _normalized(indices.reshape(batch, lookups, k).astype(np.int64), dims)
        picked = d[(np.arange(batch)[:, None],) + tuple(idx[..., j] for j in range(k))]
        np.copyto(out, picked.reshape(out.shape))
    return kernel


_AT = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


@TABLE.register("scatter_elements")
def _scatter_elements(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    data_type, idx_type, _ = ins
    axis = int(attrs["axis"]) % data_type.rank
    dim = data_type.shape[axis]
    reduction = attrs["reduction"]
    grid = list(np.indices(idx_type.shape, sparse=True))

    def kernel(data, indices, updates, out):
        np.copyto(out, data)
        where = list(grid)
        where[axis] = _normalized(indices, dim)
        if reduction == "none":
            out[tuple(where)] = updates
        else:
            _AT[reduction].at(out, tuple(where), updates)
    return kernel


@TABLE.register("scatter_nd")
def _scatter_nd(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    data_type, idx_type, _ = ins
    k = idx_type.shape[-1]
    reduction = attrs["reduction"]
    dims = np.asarray(data_type.shape[:k], dtype=np.int64)
    rows = math.prod(idx_type.shape[:-1])
    tail = data_type.shape[k:]

    def kernel(data, indices, updates, out):
        np.copyto(out, data)
        idx = _normalized(indices.reshape(rows, k).astype(np.int64), dims)
        where = tuple(idx[:, j] for j in range(k))
        ups = updates.reshape((rows,) + tail)
        if reduction == "none":
            out[where] = ups
        else:
            _AT[reduction].at(out, where, ups)
    return kernel


@TABLE.register("cumsum", "cumprod")
@float16_via_float32
def _scan(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    axis = int(attrs["axis"]) % ins[0].rank
    exclusive, reverse = bool(attrs["exclusive"]), bool(attrs["reverse"])
    n = ins[0].shape[axis]
    head = (slice(None),) * axis
    fn, identity = (np.cumsum, 0) if op == "cumsum" else (np.cumprod, 1)

    def kernel(x, out):
        src = np.flip(x, axis) if reverse else x
        dst = np.flip(out, axis) if reverse else out  # a view: writing it writes out
        if not exclusive:
            fn(src, axis=axis, out=dst)
            return
        # Shift by one instead of undoing each element (x - x, or / x), which would round.
        if n > 1:
            fn(src[head + (slice(0, n - 1),)], axis=axis, out=dst[head + (slice(1, n),)])
        dst[head + (slice(0, 1),)] = identity
    return kernel


@TABLE.register("argmin")
def _argmin(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    axis, keepdims = int(attrs["axis"]) % ins[0].rank, bool(attrs["keepdims"])

    def kernel(x, out):
        np.argmin(x, axis=axis, out=out, keepdims=keepdims)
    return kernel


@TABLE.register("reduce_prod")
@float16_via_float32
def _reduce_prod(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    axes = normalize_axes(attrs["axes"], ins[0].rank)
    keepdims = bool(attrs["keepdims"])

    def kernel(x, out):
        np.multiply.reduce(x, axis=axes, out=out, keepdims=keepdims)
    return kernel


@TABLE.register("einsum")
@float16_via_float32
def _einsum(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    equation = attrs["equation"].replace(" ", "")
    n = len(ins)
    # The contraction order is chosen once, here, not on every call.
    dummies = [np.empty(t.shape, t.dtype) for t in ins]
    path = np.einsum_path(equation, *dummies, optimize="greedy")[0] if n > 2 else False

    def kernel(*arrays):
        np.copyto(arrays[n], np.einsum(equation, *arrays[:n], optimize=path))
    return kernel
