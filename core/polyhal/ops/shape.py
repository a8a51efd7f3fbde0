"""Data movement: transpose, reshape, concat, slice (ONNX clamping) and gather."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from polyhal.errors import ProgramError, ShapeError
from polyhal.ir.types import SymbolicDim, SymbolicDimError, TensorType
from polyhal.ops._base import (
    INDEX, check_dtype, check_same_dtype, define, fmt_shape, int_list_attr, nonzero,
    normalize_axis, pick, prod, random_shape,
)


# ------------------------------------------------------------------------------------ transpose

def _perm(perm, rank: int) -> tuple[int, ...]:
    if perm is None:
        return tuple(reversed(range(rank)))
    perm = int_list_attr(perm, "perm")
    if sorted(perm) != list(range(rank)):
        raise ShapeError(f"perm {list(perm)} is not a permutation of 0..{rank - 1} (operand rank {rank})")
    return perm


def _infer_transpose(x: TensorType, *, perm):
    return (TensorType(tuple(x.shape[p] for p in _perm(perm, x.rank)), x.dtype),)


def _ref_transpose(x, *, perm=None):
    return (np.transpose(x, perm).copy(),)


def _sample_transpose(rng: np.random.Generator):
    x = nonzero(rng, random_shape(rng, 0, 4))
    perm = None if rng.random() < 0.25 else [int(p) for p in rng.permutation(x.ndim)]
    return [x], {"perm": perm}


define("transpose", infer=_infer_transpose, reference=_ref_transpose, sample=_sample_transpose,
       arity=1, tolerance=(0.0, 0.0), doc="""
    Permute dims: output dim i is input dim perm[i]. perm=None reverses the dims.
""")


# -------------------------------------------------------------------------------------- reshape

def _infer_reshape(x: TensorType, *, shape):
    dims = int_list_attr(shape, "shape")
    if any(d < -1 for d in dims) or dims.count(-1) > 1:
        raise ShapeError(f"shape {list(dims)} is invalid: dims must be >= 0, with at most one -1")
    known = prod(d for d in dims if d != -1)
    if not x.is_static:
        return (TensorType(_symbolic_reshape(x.shape, dims, known), x.dtype),)
    if -1 in dims:
        if known == 0 or x.size % known:
            raise ShapeError(f"cannot reshape {fmt_shape(x.shape)} ({x.size} elements) to {list(dims)}: "
                             f"no size for the -1 dim gives {x.size} elements")
        dims = tuple(x.size // known if d == -1 else d for d in dims)
    elif known != x.size:
        raise ShapeError(f"cannot reshape {fmt_shape(x.shape)} ({x.size} elements) to "
                         f"{fmt_shape(dims)} ({known} elements)")
    return (TensorType(dims, x.dtype),)


def _symbolic_reshape(shape: tuple, dims: tuple[int, ...], known: int) -> tuple:
    """A reshape's result dims for an operand with symbolic dims: its -1 takes the operand's one
    symbol when the sizes on both sides match (``(batch, 16, 16) -> (-1, 256)`` is ``(batch,
    256)``); any other result depends on the symbols' sizes (SymbolicDimError)."""
    symbols = [d for d in shape if isinstance(d, SymbolicDim)]
    if -1 in dims and len(symbols) == 1 and known and prod(d for d in shape if not isinstance(d, SymbolicDim)) == known:
        return tuple(symbols[0] if d == -1 else d for d in dims)
    raise SymbolicDimError(f"reshape of {fmt_shape(shape)} to {list(dims)}: the result depends on the sizes of "
                           f"{', '.join(map(str, symbols))}")


def _ref_reshape(x, *, shape):
    return (np.reshape(x, tuple(shape)).copy(),)


def _sample_reshape(rng: np.random.Generator):
    x = nonzero(rng, random_shape(rng, 0, 4))
    n = x.size
    targets = [(n,), (-1,), (1, n), (n, 1, -1), tuple(reversed(x.shape)),
               (x.shape[0], -1) if x.ndim else (1,)]
    return [x], {"shape": list(pick(rng, targets))}


define("reshape", infer=_infer_reshape, reference=_ref_reshape, sample=_sample_reshape, arity=1,
       tolerance=(0.0, 0.0), doc="""
    Same elements in row-major order, new ``shape``. One dim may be -1 (inferred); 0 is an
    ordinary zero-size dim (not ONNX's "copy the input dim").
""")


# --------------------------------------------------------------------------------------- concat

def _infer_concat(*xs: TensorType, axis):
    dtype = check_same_dtype(*xs)
    first = xs[0]
    if first.rank == 0:
        raise ShapeError("operand 0 is 0-d; concat needs operands of rank >= 1")
    axis = normalize_axis(axis, first.rank)
    for i, t in enumerate(xs[1:], 1):
        others_differ = any(d != e for j, (d, e) in enumerate(zip(t.shape, first.shape)) if j != axis)
        if t.rank != first.rank or others_differ:
            raise ShapeError(f"operand {i} has shape {fmt_shape(t.shape)} but operand 0 has shape "
                             f"{fmt_shape(first.shape)}; they may differ only in axis {axis}")
    shape = list(first.shape)
    shape[axis] = sum(t.shape[axis] for t in xs)
    return (TensorType(tuple(shape), dtype),)


def _ref_concat(*xs, axis):
    return (np.concatenate(xs, axis=axis),)


def _sample_concat(rng: np.random.Generator):
    base = random_shape(rng, 1, 3)
    axis = int(rng.integers(-len(base), len(base)))
    inputs = []
    for _ in range(int(rng.integers(1, 5))):
        shape = list(base)
        shape[axis] = int(rng.integers(1, 6))
        inputs.append(nonzero(rng, shape))
    return inputs, {"axis": axis}


define("concat", infer=_infer_concat, reference=_ref_concat, sample=_sample_concat, arity=(1, None),
       tolerance=(0.0, 0.0), doc="""
    Join one or more operands of the same rank and element type along ``axis`` (required); all
    other dims must be equal.
""")


# ---------------------------------------------------------------------------------------- slice

def normalize_slice(shape: Sequence[int], starts, ends, axes=None, steps=None) -> tuple[slice, ...]:
    """The ONNX Slice attributes for an operand of ``shape`` as one Python slice per dim.

    ONNX semantics: a negative start or end counts from the end (``+ dim``), then for a positive
    step both are clamped to ``[0, dim]``; for a negative step start is clamped to
    ``[0, dim - 1]`` and end to ``[-1, dim - 1]``, where -1 means "past the first element"
    (``None`` in the returned slice). So huge values (INT64_MAX/MIN) mean "to the end". Note
    that ONNX clamps where Python does not: ``start=-10, step=-1`` on a dim of 5 starts at
    element 0 (Python's ``x[-10::-1]`` is empty).
    ``axes`` defaults to ``0..len(starts)-1`` and ``steps`` to ones; steps must be nonzero.
    Raises ProgramError for malformed attributes and ShapeError for axes that do not fit.
    """
    rank = len(shape)
    starts, ends = int_list_attr(starts, "starts"), int_list_attr(ends, "ends")
    n = len(starts)
    if axes is None:
        if n > rank:
            raise ShapeError(f"'starts' has {n} entries but the operand has rank {rank}")
        axes = tuple(range(n))
    axes = int_list_attr(axes, "axes")
    steps = (1,) * n if steps is None else int_list_attr(steps, "steps")
    if not len(ends) == len(axes) == len(steps) == n:
        raise ProgramError(f"'starts', 'ends', 'axes' and 'steps' must have equal lengths, got "
                           f"{n}, {len(ends)}, {len(axes)} and {len(steps)}")
    norm_axes = [normalize_axis(a, rank, "axes entry") for a in axes]
    if len(set(norm_axes)) != n:
        raise ShapeError(f"axes {list(axes)} repeats an axis")
    slices = [slice(None)] * rank
    for axis, start, end, step in zip(norm_axes, starts, ends, steps):
        if step == 0:
            raise ProgramError(f"steps must be nonzero, got {list(steps)}")
        dim = shape[axis]
        start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
        if step > 0:
            slices[axis] = slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
        elif dim == 0:
            slices[axis] = slice(0, 0, step)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            slices[axis] = slice(start, None if end < 0 else end, step)
    return tuple(slices)


def _infer_slice(x: TensorType, *, starts, ends, axes, steps):
    slices = normalize_slice(x.shape, starts, ends, axes, steps)
    return (TensorType(tuple(len(range(*s.indices(d))) for s, d in zip(slices, x.shape)), x.dtype),)


def _ref_slice(x, *, starts, ends, axes=None, steps=None):
    return (x[normalize_slice(x.shape, starts, ends, axes, steps)].copy(),)


_BIG = 2**63 - 1  # what ONNX exporters write for "to the end"


def _sample_slice(rng: np.random.Generator):
    x = nonzero(rng, random_shape(rng, 1, 3, max_dim=10))
    count = int(rng.integers(1, x.ndim + 1))
    axes = [int(a) for a in rng.choice(x.ndim, size=count, replace=False)]
    starts, ends, steps = [], [], []
    for _ in axes:
        step = int(pick(rng, [1, 1, 2, 3, -1, -2]))
        starts.append(int(pick(rng, [int(rng.integers(-12, 12)), _BIG if step < 0 else -_BIG - 1])))
        ends.append(int(pick(rng, [int(rng.integers(-12, 12)), _BIG if step > 0 else -_BIG - 1])))
        steps.append(step)
    if rng.random() < 0.3 and axes == list(range(count)) and set(steps) == {1}:
        return [x], {"starts": starts, "ends": ends}
    return [x], {"starts": starts, "ends": ends,
                 "axes": [a - x.ndim if rng.random() < 0.5 else a for a in axes], "steps": steps}


define("slice", infer=_infer_slice, reference=_ref_slice, sample=_sample_slice, arity=1,
       tolerance=(0.0, 0.0), doc="""
    ONNX Slice with static ``starts``, ``ends`` and optional ``axes`` (default 0..len(starts)-1)
    and ``steps`` (default 1, never 0). Negative starts/ends count from the end; then, for a
    positive step, both are clamped to [0, dim]; for a negative step start is clamped to
    [0, dim-1] and end to [-1, dim-1] (-1: past the first element). See normalize_slice.
""")


# --------------------------------------------------------------------------------------- gather

def _infer_gather(data: TensorType, indices: TensorType, *, axis):
    check_dtype(indices, INDEX, "indices (operand 1)")
    if data.rank == 0:
        raise ShapeError("data (operand 0) is 0-d; gather needs rank >= 1")
    axis = normalize_axis(axis, data.rank)
    return (TensorType(data.shape[:axis] + indices.shape + data.shape[axis + 1:], data.dtype),)


def _ref_gather(data, indices, *, axis=0):
    return (np.take(data, indices, axis=axis),)


def _sample_gather(rng: np.random.Generator):
    data = nonzero(rng, random_shape(rng, 1, 3))
    axis = int(rng.integers(-data.ndim, data.ndim))
    dim = data.shape[axis]
    indices = rng.integers(-dim, dim, size=random_shape(rng, 0, 2)).astype(pick(rng, [np.int32, np.int64]))
    return [data, indices], {"axis": axis}


define("gather", infer=_infer_gather, reference=_ref_gather, sample=_sample_gather, arity=2,
       tolerance=(0.0, 0.0), doc="""
    ONNX Gather: out[..., i..., ...] = data[..., indices[i...], ...] along ``axis``; the output
    shape is data.shape[:axis] + indices.shape + data.shape[axis+1:]. Indices are int32 or
    int64 and may be negative (counted from the end); an index outside [-dim, dim) is an error
    at run time (kernels decide how to report it).
""")

