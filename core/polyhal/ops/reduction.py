"""Reductions (reduce_sum/mean/max/min, argmax) and the normalisations built on them (softmax,
layer_norm)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from polyhal.errors import ProgramError, ShapeError
from polyhal.ir.types import SymbolicDim, TensorType
from polyhal.ops._base import (
    ANY, FLOAT, NUMERIC, bool_attr, check_dtype, check_same_dtype, define, float_attr, fmt_shape,
    narrow, nonzero, normalize_axes, normalize_axis, pick, random_shape, wide, with_ties,
)

#: Sums of up to 4096 float32 terms of either sign: allow for cancellation.
_SUM_TOLERANCE = (1e-4, 1e-5)


def _reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _check_not_empty(shape: tuple[int, ...], axes: tuple[int, ...]) -> None:
    # max/min/argmax of nothing have no value, and a mean of nothing is 0/0: refuse statically.
    # (a symbolic dim is checked when the program is specialized to its size)
    empty = [a for a in axes if not isinstance(shape[a], SymbolicDim) and shape[a] == 0]
    if empty:
        raise ShapeError(f"cannot reduce over empty axis {empty[0]} of shape {fmt_shape(shape)}")


# ------------------------------------------------------------------------------- reduce_<kind>

#: name: (numpy reduction on the widened input, accepted types, refuses empty axes, tolerance, doc)
_REDUCTIONS: dict[str, tuple[Callable, frozenset, bool, tuple[float, float], str]] = {
    "reduce_sum": (np.sum, NUMERIC, False, _SUM_TOLERANCE,
                   "Sum (0 over an empty axis; integer sums wrap around in the operand type)."),
    "reduce_mean": (np.mean, FLOAT, True, _SUM_TOLERANCE, "Arithmetic mean, float types only."),
    "reduce_max": (np.max, ANY, True, (0.0, 0.0), "Maximum; nan if any reduced element is nan."),
    "reduce_min": (np.min, ANY, True, (0.0, 0.0), "Minimum; nan if any reduced element is nan."),
}


def _sample_axes(rng: np.random.Generator, rank: int):
    """None, one axis (maybe negative) or a list of distinct axes."""
    choice = int(rng.integers(3))
    if choice == 0 or rank == 0:
        return None
    if choice == 1:
        return int(rng.integers(-rank, rank))
    count = int(rng.integers(1, rank + 1))
    return [int(a) for a in rng.choice(rank, size=count, replace=False)]


def _define_reduction(name: str, fn: Callable, allowed: frozenset, refuse_empty: bool,
                      tolerance: tuple[float, float], doc: str) -> None:
    def infer(x: TensorType, *, axes, keepdims):
        check_dtype(x, allowed)
        axes = normalize_axes(axes, x.rank)
        if refuse_empty:
            _check_not_empty(x.shape, axes)
        return (TensorType(_reduced_shape(x.shape, axes, bool_attr(keepdims, "keepdims")), x.dtype),)

    def reference(x, *, axes=None, keepdims=False):
        # numpy reads a list of axes as a fancy index elsewhere; reductions want a tuple.
        axis = tuple(axes) if isinstance(axes, (list, tuple)) else axes
        return (narrow(fn(wide(x), axis=axis, keepdims=bool(keepdims)), x.dtype),)

    def sample(rng: np.random.Generator):
        x = nonzero(rng, pick(rng, [random_shape(rng), (64, 64), (4096,)]))
        return [x], {"axes": _sample_axes(rng, x.ndim), "keepdims": bool(rng.integers(2))}

    define(name, infer=infer, reference=reference, sample=sample, arity=1, tolerance=tolerance,
           doc=f"{doc} Over ``axes`` (None: all; a list of distinct axes; [] reduces nothing); "
               f"``keepdims`` keeps reduced axes as size 1.")


for _name, (_fn, _allowed, _refuse, _tol, _doc) in _REDUCTIONS.items():
    _define_reduction(_name, _fn, _allowed, _refuse, _tol, _doc)


# --------------------------------------------------------------------------------------- argmax

def _infer_argmax(x: TensorType, *, axis, keepdims):
    axis = normalize_axis(axis, x.rank)
    _check_not_empty(x.shape, (axis,))
    return (TensorType(_reduced_shape(x.shape, (axis,), bool_attr(keepdims, "keepdims")), np.int64),)


def _ref_argmax(x, *, axis=0, keepdims=False):
    return (narrow(np.argmax(x, axis=axis, keepdims=bool(keepdims)), np.int64),)


def _sample_argmax(rng: np.random.Generator):
    x = with_ties(rng, random_shape(rng))
    return [x], {"axis": int(rng.integers(-x.ndim, x.ndim)), "keepdims": bool(rng.integers(2))}


define("argmax", infer=_infer_argmax, reference=_ref_argmax, sample=_sample_argmax, arity=1, doc="""
    Index (int64) of the largest element along ``axis``; ties give the lowest index, and nan
    counts as the largest value (the first nan wins).
""")


# -------------------------------------------------------------------------------------- softmax

def _infer_softmax(x: TensorType, *, axis):
    check_dtype(x, FLOAT)
    normalize_axis(axis, x.rank)
    return (TensorType(x.shape, x.dtype),)


def _ref_softmax(x, *, axis=-1):
    w = wide(x)
    e = np.exp(w - np.max(w, axis=axis, keepdims=True))
    return (narrow(e / np.sum(e, axis=axis, keepdims=True), x.dtype),)


def _sample_softmax(rng: np.random.Generator):
    x = nonzero(rng, pick(rng, [random_shape(rng), (64, 64)]), 0.1, 8.0)
    return [x], {"axis": int(rng.integers(-x.ndim, x.ndim))}


define("softmax", infer=_infer_softmax, reference=_ref_softmax, sample=_sample_softmax, arity=1, doc="""
    exp(x) / sum(exp(x)) along one ``axis`` (computed as exp(x - max) for range). Float types only.
""")


# ----------------------------------------------------------------------------------- layer_norm

def _infer_layer_norm(x: TensorType, scale: TensorType, bias: TensorType, *, axis, epsilon):
    dtype = check_same_dtype(x, scale, bias)
    check_dtype(x, FLOAT)
    axis = normalize_axis(axis, x.rank)
    if float_attr(epsilon, "epsilon") < 0:
        raise ProgramError(f"attribute 'epsilon' must be >= 0, got {epsilon}")
    want = x.shape[axis:]
    for i, t in ((1, scale), (2, bias)):
        if t.shape != want:
            raise ShapeError(f"operand {i} ({('scale', 'bias')[i - 1]}) has shape {fmt_shape(t.shape)}, "
                             f"expected x.shape[{axis}:] = {fmt_shape(want)}")
    return (TensorType(x.shape, dtype),)


def _ref_layer_norm(x, scale, bias, *, axis=-1, epsilon=1e-5):
    w = wide(x)
    axes = tuple(range(axis % w.ndim, w.ndim))
    centered = w - w.mean(axis=axes, keepdims=True)
    var = (centered**2).mean(axis=axes, keepdims=True)
    return (narrow(centered / np.sqrt(var + epsilon) * wide(scale) + wide(bias), x.dtype),)


def _sample_layer_norm(rng: np.random.Generator):
    x = nonzero(rng, pick(rng, [(4, 8, 16), (32, 64), (6,), (2, 3, 4, 5)]))
    axis = int(rng.integers(-x.ndim, x.ndim))
    norm_shape = x.shape[axis % x.ndim:]
    attrs = {"axis": axis} if rng.random() < 0.5 else {"axis": axis, "epsilon": 1e-3}
    return [x, nonzero(rng, norm_shape), nonzero(rng, norm_shape)], attrs


define("layer_norm", infer=_infer_layer_norm, reference=_ref_layer_norm, sample=_sample_layer_norm,
       arity=3, tolerance=(1e-4, 1e-5), doc="""
    ONNX LayerNormalization: normalise x over dims ``axis..rank-1`` to zero mean and unit
    (biased) variance, (x - mean) / sqrt(var + epsilon), then multiply by ``scale`` and add
    ``bias``, both of shape x.shape[axis:]. Float types only.
""")
