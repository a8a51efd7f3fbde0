"""Indexing and data movement beyond :mod:`polyhal.ops.shape`: expand, pad, gather_elements,
gather_nd, scatter_elements, scatter_nd; and scans/reductions it lacked: cumsum, cumprod,
argmin, reduce_prod; and einsum.

Index operands are int32 or int64 and may be negative (counted from the end of their axis);
indices out of range are an error at run time (kernels decide how to report it).
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import (
    INDEX, NUMERIC, bool_attr, broadcast, check_dtype, check_same_dtype, define, fmt_shape,
    int_attr, int_list_attr, narrow, nonzero, normalize_axes, normalize_axis, pick, prod, random_shape,
    wide, with_ties,
)


# --------------------------------------------------------------------------------------- expand

def _infer_expand(x: TensorType, *, shape):
    target = int_list_attr(shape, "shape")
    if any(d < 0 for d in target):
        raise ShapeError(f"shape {list(target)} has a negative dim")
    return (TensorType(broadcast(x.shape, target), x.dtype),)


def _ref_expand(x, *, shape):
    out = np.broadcast_shapes(x.shape, tuple(shape))
    return (np.broadcast_to(x, out).copy(),)


def _sample_expand(rng: np.random.Generator):
    x = nonzero(rng, pick(rng, [(3, 1), (1,), (), (2, 1, 4), (1, 5)]))
    shape = pick(rng, {(3, 1): [(3, 4), (2, 3, 5), (1, 1)], (1,): [(6,), (2, 3)], (): [(4, 2)],
                       (2, 1, 4): [(2, 3, 4), (3, 2, 5, 4)], (1, 5): [(4, 1), (7, 5)]}[x.shape])
    return [x], {"shape": list(shape)}


define("expand", infer=_infer_expand, reference=_ref_expand, sample=_sample_expand, arity=1,
       tolerance=(0.0, 0.0), doc="""
    ONNX Expand: broadcast x against ``shape`` both ways (numpy rules), so the result has shape
    broadcast(x.shape, shape); a dim of ``shape`` may be 1 where x's is larger.
""")


# ------------------------------------------------------------------------------------------ pad

_PAD_MODES = ("constant", "reflect", "edge", "wrap")


def _split_pads(pads, rank: int) -> list[tuple[int, int]]:
    pads = int_list_attr(pads, "pads")
    if len(pads) != 2 * rank:
        raise ProgramError(f"attribute 'pads' needs {2 * rank} entries (all begins, then all ends) for rank "
                           f"{rank}, got {len(pads)}")
    return [(pads[i], pads[i + rank]) for i in range(rank)]


def _infer_pad(x: TensorType, *, pads, mode, value):
    if mode not in _PAD_MODES:
        raise ProgramError(f"attribute 'mode' must be one of {_PAD_MODES}, got {mode!r}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ProgramError(f"attribute 'value' must be a number, got {value!r}")
    shape = []
    for d, (b, e) in zip(x.shape, _split_pads(pads, x.rank)):
        if d + b + e < 0 or d + min(b, 0) < 0 or d + min(e, 0) < 0:
            raise ShapeError(f"pads ({b}, {e}) remove more than dim {d}")
        if mode != "constant" and (b > 0 or e > 0) and d + min(b, 0) + min(e, 0) == 0:
            raise ShapeError(f"mode {mode!r} cannot pad an empty dim")
        if mode == "reflect" and max(b, e) >= d + min(b, 0) + min(e, 0) and max(b, e) > 0:
            raise ShapeError(f"mode 'reflect' needs pads smaller than the dim: ({b}, {e}) for dim {d}")
        shape.append(d + b + e)
    return (TensorType(tuple(shape), x.dtype),)


def _ref_pad(x, *, pads, mode="constant", value=0.0):
    pairs = _split_pads(pads, x.ndim)
    # Negative pads crop first; then numpy pads with the rest.
    crop = tuple(slice(-b if b < 0 else 0, d + e if e < 0 else d) for d, (b, e) in zip(x.shape, pairs))
    x = x[crop]
    widths = [(max(b, 0), max(e, 0)) for b, e in pairs]
    if mode == "constant":
        return (np.pad(x, widths, mode="constant", constant_values=np.asarray(value).astype(x.dtype)),)
    return (np.pad(x, widths, mode=mode),)


def _sample_pad(rng: np.random.Generator):
    x = nonzero(rng, random_shape(rng, 1, 3, max_dim=6))
    mode = pick(rng, _PAD_MODES)
    pads = []
    for d in x.shape * 2:
        hi = d - 1 if mode == "reflect" else 3
        pads.append(int(rng.integers(-1 if d > 2 else 0, hi + 1)) if hi >= 0 else 0)
    rank = x.ndim
    pads = [max(p, -1) for p in pads]
    for i in range(rank):  # keep at least 2 elements per dim after cropping
        if x.shape[i] + min(pads[i], 0) + min(pads[i + rank], 0) < 2:
            pads[i], pads[i + rank] = max(pads[i], 0), max(pads[i + rank], 0)
        if mode == "reflect":
            left = x.shape[i] + min(pads[i], 0) + min(pads[i + rank], 0)
            pads[i], pads[i + rank] = min(pads[i], left - 1), min(pads[i + rank], left - 1)
    return [x], {"pads": pads, "mode": mode, "value": float(pick(rng, [0.0, 1.5, -2.0]))}


define("pad", infer=_infer_pad, reference=_ref_pad, sample=_sample_pad, arity=1, tolerance=(0.0, 0.0), doc="""
    ONNX Pad: ``pads`` = [begin_0, ..., begin_{r-1}, end_0, ..., end_{r-1}] elements added per dim
    (negative values crop). mode "constant" fills with ``value``; "reflect" mirrors without the
    edge element; "edge" repeats the edge; "wrap" wraps around.
""")


# ------------------------------------------------------------------------------ gather_elements

def _infer_gather_elements(data: TensorType, indices: TensorType, *, axis):
    check_dtype(indices, INDEX, "indices (operand 1)")
    if data.rank == 0 or indices.rank != data.rank:
        raise ShapeError(f"data {fmt_shape(data.shape)} and indices {fmt_shape(indices.shape)} must have the "
                         "same rank >= 1")
    axis = normalize_axis(axis, data.rank)
    for i, (d, k) in enumerate(zip(data.shape, indices.shape)):
        if i != axis and k > d:
            raise ShapeError(f"indices dim {i} ({k}) is larger than data's ({d})")
    return (TensorType(indices.shape, data.dtype),)


def _ref_gather_elements(data, indices, *, axis=0):
    axis = axis % data.ndim
    idx = np.where(indices < 0, indices + data.shape[axis], indices)
    grid = list(np.indices(indices.shape, sparse=True))
    grid[axis] = idx
    return (data[tuple(grid)],)


def _sample_gather_elements(rng: np.random.Generator):
    data = nonzero(rng, random_shape(rng, 1, 3))
    axis = int(rng.integers(-data.ndim, data.ndim))
    shape = [int(rng.integers(1, d + 1)) for d in data.shape]
    shape[axis] = int(rng.integers(1, 6))
    dim = data.shape[axis]
    idx = rng.integers(-dim, dim, size=shape).astype(pick(rng, [np.int32, np.int64]))
    return [data, idx], {"axis": axis}


define("gather_elements", infer=_infer_gather_elements, reference=_ref_gather_elements,
       sample=_sample_gather_elements, arity=2, tolerance=(0.0, 0.0), doc="""
    ONNX GatherElements: out[i][j]... = data[..., indices[i][j]..., ...] with the index replacing
    the position along ``axis``; indices has data's rank and its shape is the result's.
""")


# ---------------------------------------------------------------------------------- gather_nd

def _infer_gather_nd(data: TensorType, indices: TensorType, *, batch_dims):
    check_dtype(indices, INDEX, "indices (operand 1)")
    b = int_attr(batch_dims, "batch_dims")
    if indices.rank < 1 or data.rank < 1:
        raise ShapeError("gather_nd needs data and indices of rank >= 1")
    k = indices.shape[-1]
    if not 0 <= b < min(data.rank, indices.rank):
        raise ShapeError(f"batch_dims {b} must be less than both ranks ({data.rank}, {indices.rank})")
    if data.shape[:b] != indices.shape[:b]:
        raise ShapeError(f"the first {b} dims of data {fmt_shape(data.shape)} and indices "
                         f"{fmt_shape(indices.shape)} must be equal")
    if k > data.rank - b:
        raise ShapeError(f"indices' last dim ({k}) exceeds data's rank minus batch_dims ({data.rank - b})")
    return (TensorType(indices.shape[:-1] + data.shape[b + k:], data.dtype),)


def _ref_gather_nd(data, indices, *, batch_dims=0):
    b = batch_dims
    k = indices.shape[-1]
    batch = data.shape[:b]
    out = []
    flat_data = data.reshape((prod(batch),) + data.shape[b:])
    flat_idx = indices.reshape((prod(batch),) + indices.shape[b:])
    for d, i in zip(flat_data, flat_idx):
        pos = i.reshape(-1, k)
        pos = np.where(pos < 0, pos + np.array(d.shape[:k]), pos)
        out.append(np.stack([d[tuple(p)] for p in pos]) if len(pos) else np.empty((0,) + d.shape[k:], d.dtype))
    result = np.stack(out) if out else np.empty((0,), data.dtype)
    return (result.reshape(indices.shape[:-1] + data.shape[b + k:]),)


def _sample_gather_nd(rng: np.random.Generator):
    data = nonzero(rng, random_shape(rng, 1, 4, max_dim=4))
    b = int(rng.integers(0, data.ndim)) if rng.random() < 0.3 else 0
    k = int(rng.integers(1, data.ndim - b + 1))
    lead = tuple(int(d) for d in rng.integers(1, 4, size=int(rng.integers(0, 2))))
    shape = data.shape[:b] + lead + (k,)
    idx = np.stack([rng.integers(-data.shape[b + j], data.shape[b + j], size=shape[:-1]) for j in range(k)], -1)
    return [data, idx.astype(pick(rng, [np.int32, np.int64]))], {"batch_dims": b}


define("gather_nd", infer=_infer_gather_nd, reference=_ref_gather_nd, sample=_sample_gather_nd, arity=2,
       tolerance=(0.0, 0.0), doc="""
    ONNX GatherND: each row of the last dim of ``indices`` (length k) indexes the first k dims
    of data after the ``batch_dims`` leading dims that data and indices share; the result has
    shape indices.shape[:-1] + data.shape[batch_dims + k:].
""")


# ------------------------------------------------------------------------ scatter_elements / nd

_REDUCTIONS = ("none", "add", "mul", "max", "min")


def _check_reduction(reduction) -> None:
    if reduction not in _REDUCTIONS:
        raise ProgramError(f"attribute 'reduction' must be one of {_REDUCTIONS}, got {reduction!r}")


def _infer_scatter_elements(data: TensorType, indices: TensorType, updates: TensorType, *, axis, reduction):
    _check_reduction(reduction)
    _infer_gather_elements(data, indices, axis=axis)
    check_same_dtype(data, updates)
    if updates.shape != indices.shape:
        raise ShapeError(f"updates {fmt_shape(updates.shape)} must have the shape of indices "
                         f"{fmt_shape(indices.shape)}")
    return (TensorType(data.shape, data.dtype),)


_UFUNC = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _ref_scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    out = np.array(data, copy=True)
    axis = axis % data.ndim
    idx = np.where(indices < 0, indices + data.shape[axis], indices)
    grid = list(np.indices(indices.shape))
    grid[axis] = idx
    if reduction == "none":
        out[tuple(grid)] = updates
    else:
        _UFUNC[reduction].at(out, tuple(grid), updates)
    return (out,)


def _sample_scatter_elements(rng: np.random.Generator):
    data = nonzero(rng, random_shape(rng, 1, 3))
    axis = int(rng.integers(-data.ndim, data.ndim))
    dim = data.shape[axis]
    reduction = pick(rng, _REDUCTIONS)
    shape = [int(rng.integers(1, d + 1)) for d in data.shape]
    if reduction == "none":  # distinct indices along the axis, so the result is defined
        shape[axis] = int(rng.integers(1, dim + 1))
        perm = np.argsort(rng.random(tuple(shape[:axis % data.ndim]) + (dim,) + tuple(shape[axis % data.ndim + 1:])),
                          axis=axis)
        idx = np.take(perm, np.arange(shape[axis]), axis=axis)
        idx = idx - dim * (rng.random(idx.shape) < 0.3)
    else:
        shape[axis] = int(rng.integers(1, 6))
        idx = rng.integers(-dim, dim, size=shape)
    return [data, idx.astype(pick(rng, [np.int32, np.int64])), nonzero(rng, idx.shape)], \
        {"axis": axis, "reduction": reduction}


define("scatter_elements", infer=_infer_scatter_elements, reference=_ref_scatter_elements,
       sample=_sample_scatter_elements, arity=3, tolerance=(1e-5, 1e-6), doc="""
    ONNX ScatterElements: a copy of data with updates written at the positions gather_elements
    would read (indices along ``axis``). reduction "none" overwrites (with repeated indices the
    result is unspecified); "add", "mul", "max", "min" combine every update into the element.
""")


def _infer_scatter_nd(data: TensorType, indices: TensorType, updates: TensorType, *, reduction):
    _check_reduction(reduction)
    check_dtype(indices, INDEX, "indices (operand 1)")
    check_same_dtype(data, updates)
    if indices.rank < 1:
        raise ShapeError("indices must have rank >= 1")
    k = indices.shape[-1]
    if k > data.rank:
        raise ShapeError(f"indices' last dim ({k}) exceeds data's rank ({data.rank})")
    want = indices.shape[:-1] + data.shape[k:]
    if updates.shape != want:
        raise ShapeError(f"updates must have shape indices.shape[:-1] + data.shape[k:] = {fmt_shape(want)}, "
                         f"got {fmt_shape(updates.shape)}")
    return (TensorType(data.shape, data.dtype),)


def _ref_scatter_nd(data, indices, updates, *, reduction="none"):
    out = np.array(data, copy=True)
    k = indices.shape[-1]
    pos = indices.reshape(-1, k)
    pos = np.where(pos < 0, pos + np.array(data.shape[:k]), pos)
    ups = updates.reshape((pos.shape[0],) + data.shape[k:])
    for p, u in zip(pos, ups):
        where = tuple(p)
        out[where] = u if reduction == "none" else _UFUNC[reduction](out[where], u)
    return (out,)


def _sample_scatter_nd(rng: np.random.Generator):
    data = nonzero(rng, random_shape(rng, 1, 3, max_dim=5))
    k = int(rng.integers(1, data.ndim + 1))
    reduction = pick(rng, _REDUCTIONS)
    cells = prod(data.shape[:k])
    n = int(rng.integers(1, cells + 1))
    flat = rng.permutation(cells)[:n] if reduction == "none" else rng.integers(0, cells, size=n)
    idx = np.stack(np.unravel_index(flat, data.shape[:k]), -1).astype(pick(rng, [np.int32, np.int64]))
    return [data, idx, nonzero(rng, (n,) + data.shape[k:])], {"reduction": reduction}


define("scatter_nd", infer=_infer_scatter_nd, reference=_ref_scatter_nd, sample=_sample_scatter_nd, arity=3,
       tolerance=(1e-5, 1e-6), doc="""
    ONNX ScatterND: a copy of data where each row of ``indices`` (length k) selects a slice
    data[i_0, ..., i_{k-1}] that the matching slice of updates replaces (reduction "none") or
    is combined into ("add", "mul", "max", "min"), in order.
""")


# ------------------------------------------------------------------------------ cumsum / cumprod

def _infer_scan(x: TensorType, *, axis, exclusive, reverse):
    check_dtype(x, NUMERIC)
    if x.rank == 0:
        raise ShapeError("a running sum or product needs rank >= 1")
    normalize_axis(axis, x.rank)
    bool_attr(exclusive, "exclusive")
    bool_attr(reverse, "reverse")
    return (TensorType(x.shape, x.dtype),)


def _scan_reference(fn, identity: float):
    def reference(x, *, axis, exclusive=False, reverse=False):
        w = wide(x)
        axis = axis % x.ndim
        if reverse:
            w = np.flip(w, axis)
        y = fn(w, axis=axis)
        if exclusive:  # shift by one, the identity first
            y = np.concatenate([np.full_like(np.take(y, [0], axis=axis), identity),
                                np.take(y, np.arange(y.shape[axis] - 1), axis=axis)], axis=axis)
        if reverse:
            y = np.flip(y, axis)
        return (narrow(y, x.dtype),)
    return reference


def _scan_sample(lo: float, hi: float):
    def sample(rng: np.random.Generator):
        shape = pick(rng, [random_shape(rng), (64,), (8, 64)])
        if rng.random() < 0.2:
            x = rng.integers(1, 4, size=shape).astype(pick(rng, [np.int32, np.int64]))
        else:
            x = nonzero(rng, shape, lo, hi)
        return [x], {"axis": int(rng.integers(-x.ndim, x.ndim)), "exclusive": bool(rng.integers(2)),
                     "reverse": bool(rng.integers(2))}
    return sample


_SCAN_DOC = """along ``axis``; ``exclusive`` leaves each element out of its own {what}, ``reverse`` runs
    from the end. Numeric types ({wrap})."""

define("cumsum", infer=_infer_scan, reference=_scan_reference(np.cumsum, 0.0), sample=_scan_sample(0.5, 2.0),
       arity=1, tolerance=(1e-4, 1e-5),
       doc="Running sum " + _SCAN_DOC.format(what="sum", wrap="integer sums wrap around"))
define("cumprod", infer=_infer_scan, reference=_scan_reference(np.cumprod, 1.0), sample=_scan_sample(0.8, 1.25),
       arity=1, tolerance=(1e-4, 1e-5),
       doc="Running product " + _SCAN_DOC.format(what="product", wrap="integer products wrap around"))


# --------------------------------------------------------------------------------------- argmin

def _infer_argmin(x: TensorType, *, axis, keepdims):
    axis = normalize_axis(axis, x.rank)
    if x.shape[axis] == 0:
        raise ShapeError(f"cannot reduce over empty axis {axis} of shape {fmt_shape(x.shape)}")
    keep = bool_attr(keepdims, "keepdims")
    shape = tuple(1 if i == axis else d for i, d in enumerate(x.shape) if keep or i != axis)
    return (TensorType(shape, np.int64),)


def _ref_argmin(x, *, axis=0, keepdims=False):
    return (np.argmin(x, axis=axis, keepdims=bool(keepdims)).astype(np.int64),)


def _sample_argmin(rng: np.random.Generator):
    x = with_ties(rng, random_shape(rng))
    return [x], {"axis": int(rng.integers(-x.ndim, x.ndim)), "keepdims": bool(rng.integers(2))}


define("argmin", infer=_infer_argmin, reference=_ref_argmin, sample=_sample_argmin, arity=1,
       tolerance=(0.0, 0.0), doc="""
    Index (int64) of the smallest element along ``axis``; ties give the lowest index, and nan
    counts as the smallest value (the first nan wins).
""")


# ---------------------------------------------------------------------------------- reduce_prod

def _infer_reduce_prod(x: TensorType, *, axes, keepdims):
    check_dtype(x, NUMERIC)
    axes = normalize_axes(axes, x.rank)
    keep = bool_attr(keepdims, "keepdims")
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if keep or i not in axes)
    return (TensorType(shape, x.dtype),)


def _ref_reduce_prod(x, *, axes=None, keepdims=False):
    axis = tuple(axes) if isinstance(axes, (list, tuple)) else axes
    return (narrow(np.prod(wide(x), axis=axis, keepdims=bool(keepdims)), x.dtype),)


def _sample_reduce_prod(rng: np.random.Generator):
    x = nonzero(rng, pick(rng, [random_shape(rng), (8, 16)]), 0.8, 1.25)
    choice = int(rng.integers(3))
    axes = None if choice == 0 else int(rng.integers(-x.ndim, x.ndim)) if choice == 1 else \
        [int(a) for a in rng.choice(x.ndim, size=int(rng.integers(1, x.ndim + 1)), replace=False)]
    return [x], {"axes": axes, "keepdims": bool(rng.integers(2))}


define("reduce_prod", infer=_infer_reduce_prod, reference=_ref_reduce_prod, sample=_sample_reduce_prod,
       arity=1, tolerance=(1e-4, 1e-6), doc="""
    Product over ``axes`` (None: all; [] reduces nothing; 1 over an empty axis); ``keepdims``
    keeps reduced axes as size 1. Numeric types (integer products wrap around).
""")


# --------------------------------------------------------------------------------------- einsum

def einsum_output_shape(equation: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The result shape of ``numpy.einsum(equation, ...)`` on operands of ``shapes``; ProgramError
    or ShapeError when the equation does not fit them."""
    if not isinstance(equation, str):
        raise ProgramError(f"attribute 'equation' must be a string, got {equation!r}")
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        raise ProgramError(f"equation {equation!r} has {len(terms)} operand terms for {len(shapes)} operands")
    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    ellipses = []
    for term, shape in zip(terms, shapes):
        if term.count("...") > 1:
            raise ProgramError(f"term {term!r} has more than one ellipsis")
        pre, dots, post = term.partition("...")
        labels = pre + post
        if not all(c.isalpha() for c in labels):
            raise ProgramError(f"term {term!r} of {equation!r} has characters other than letters and '...'")
        n_ell = len(shape) - len(labels)
        if n_ell < 0 or (n_ell > 0 and not dots):
            raise ShapeError(f"term {term!r} does not fit an operand of shape {fmt_shape(shape)}")
        ellipses.append(tuple(shape[len(pre):len(pre) + n_ell]))
        for c, d in zip(labels, shape[:len(pre)] + shape[len(pre) + n_ell:]):
            if c in sizes and sizes[c] != d:
                raise ShapeError(f"label {c!r} is {sizes[c]} in one operand and {d} in another")
            sizes[c] = d
            counts[c] = counts.get(c, 0) + 1
    ell = broadcast(*ellipses) if ellipses else ()
    if not arrow:
        out = ("..." if any("..." in t for t in terms) else "") + "".join(sorted(c for c, n in counts.items() if n == 1))
    else:
        out = rhs
    if out.count("...") > 1:
        raise ProgramError(f"the output of {equation!r} has more than one ellipsis")
    pre, dots, post = out.partition("...")
    shape = []
    for c in pre + post:
        if c not in sizes:
            raise ProgramError(f"output label {c!r} of {equation!r} appears in no operand")
    if len(set(pre + post)) != len(pre + post):
        raise ProgramError(f"the output of {equation!r} repeats a label")
    shape = [sizes[c] for c in pre] + (list(ell) if dots else []) + [sizes[c] for c in post]
    return tuple(shape)


def _infer_einsum(*xs: TensorType, equation):
    dtype = check_same_dtype(*xs)
    check_dtype(xs[0], NUMERIC)
    return (TensorType(einsum_output_shape(equation, [x.shape for x in xs]), dtype),)


def _ref_einsum(*xs, equation):
    return (narrow(np.einsum(equation, *[wide(x) for x in xs]), xs[0].dtype),)


_EINSUM_CASES = [
    ("ij,jk->ik", [(4, 5), (5, 3)]), ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]), ("ii->i", [(4, 4)]),
    ("ij->ji", [(3, 5)]), ("i,i", [(6,), (6,)]), ("...ij,...jk", [(2, 3, 4), (4, 2)]), ("ij", [(3, 4)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]), ("i,j->ij", [(3,), (4,)]), ("ijk->", [(2, 3, 4)]),
]


def _sample_einsum(rng: np.random.Generator):
    eq, shapes = pick(rng, _EINSUM_CASES)
    return [nonzero(rng, s) for s in shapes], {"equation": eq}


define("einsum", infer=_infer_einsum, reference=_ref_einsum, sample=_sample_einsum, arity=(1, None),
       tolerance=(1e-4, 1e-5), contraction=True, doc="""
    numpy.einsum with ``equation`` (letters, '...' for broadcast dims, optional '->' output;
    without it the output is the labels used once, sorted). Numeric operands of one type.
""")

