"""Sorting ops: sort, argsort and topk, all stable along one axis.

Order, the same for all three ops and every backend:

* ascending: numbers in increasing order, then every nan (nan sorts as larger than every
  number, as numpy does);
* descending: every nan first, then numbers in decreasing order (the exact reverse of the
  ascending order of values) -- except that
* ties keep their input order in both directions: of equal elements (and of nans, and of
  -0.0 and 0.0, which are equal) the one with the lower index comes first.

topk(largest=True) takes the first k of the descending order (so nans are "largest"),
topk(largest=False) the first k of the ascending order.
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import (
    bool_attr, define, int_attr, nonzero, normalize_axis, pick, prod, random_shape, with_ties,
)


def _stable_order(values: list, descending: bool) -> list[int]:
    """Indices of ``values`` in the order the module docstring defines, by plain Python sorting.

    The key puts nan above every number; Python's sort is stable even with reverse=True (equal
    keys keep their input order), which is exactly the tie rule for both directions.
    """
    keys = [(v != v, 0.0 if v != v else v) for v in values]
    return sorted(range(len(values)), key=keys.__getitem__, reverse=descending)


def _lanes(x: np.ndarray, axis: int) -> np.ndarray:
    """``x`` as a 2-D array whose rows are the 1-D lanes along ``axis``."""
    return np.moveaxis(x, axis, -1).reshape(_lane_count(x.shape, axis), x.shape[axis])


def _lane_count(shape: tuple[int, ...], axis: int) -> int:
    # Explicit, because reshape(-1, 0) cannot infer the row count of an empty array.
    return prod(d for i, d in enumerate(shape) if i != axis)


def _unlanes(rows: np.ndarray, like_shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Inverse of :func:`_lanes` for rows of length ``rows.shape[1]``."""
    moved = tuple(d for i, d in enumerate(like_shape) if i != axis) + (rows.shape[1],)
    return np.moveaxis(rows.reshape(moved), -1, axis)


def _ref_order(x: np.ndarray, axis: int, descending: bool, k: int | None = None,
               index_order: bool = False) -> np.ndarray:
    """int64 indices along ``axis`` of the sorted order (first ``k`` of it; in increasing index
    order when ``index_order``)."""
    x = np.asarray(x)
    axis = axis % x.ndim
    n = x.shape[axis] if k is None else k
    rows = []
    for lane in _lanes(x, axis):
        order = _stable_order(lane.tolist(), descending)[:n]
        rows.append(sorted(order) if index_order else order)
    return _unlanes(np.array(rows, dtype=np.int64).reshape(_lane_count(x.shape, axis), n), x.shape, axis)


def _check_rank(x: TensorType) -> None:
    if x.rank == 0:
        raise ShapeError("operand 0 is 0-d; sorting needs rank >= 1")


# ----------------------------------------------------------------------------- sort / argsort

def _infer_sort(x: TensorType, *, axis, descending):
    _check_rank(x)
    normalize_axis(axis, x.rank)
    bool_attr(descending, "descending")
    return (TensorType(x.shape, x.dtype),)


def _infer_argsort(x: TensorType, *, axis, descending):
    (values,) = _infer_sort(x, axis=axis, descending=descending)
    return (TensorType(values.shape, np.int64),)


def _ref_sort(x, *, axis=-1, descending=False):
    return (np.take_along_axis(x, _ref_order(x, axis, bool(descending)), axis=axis),)


def _ref_argsort(x, *, axis=-1, descending=False):
    return (_ref_order(x, axis, bool(descending)),)


def _sample_values(rng: np.random.Generator, shape) -> np.ndarray:
    """Values with many ties, sometimes continuous, sometimes with a few nans."""
    x = with_ties(rng, shape) if rng.random() < 0.6 else nonzero(rng, shape)
    if rng.random() < 0.3 and x.size:
        x.reshape(-1)[rng.integers(0, x.size, size=max(1, x.size // 8))] = np.nan
    return x


def _sample_sort(rng: np.random.Generator):
    x = _sample_values(rng, pick(rng, [random_shape(rng, 1, 3, max_dim=8), (64,), (16, 64)]))
    return [x], {"axis": int(rng.integers(-x.ndim, x.ndim)), "descending": bool(rng.integers(2))}


_ORDER_DOC = ("Stable; ascending puts nan last, descending puts nan first; equal elements keep "
              "input order in both directions (see polyhal.ops.sorting).")

define("sort", infer=_infer_sort, reference=_ref_sort, sample=_sample_sort, arity=1,
       tolerance=(0.0, 0.0), doc=f"Sorted values along ``axis``. {_ORDER_DOC}")
define("argsort", infer=_infer_argsort, reference=_ref_argsort, sample=_sample_sort, arity=1,
       tolerance=(0.0, 0.0), doc=f"int64 indices that sort along ``axis``. {_ORDER_DOC}")


# ----------------------------------------------------------------------------------------- topk

def _infer_topk(x: TensorType, *, k, axis, largest, sorted):
    _check_rank(x)
    axis = normalize_axis(axis, x.rank)
    bool_attr(largest, "largest")
    bool_attr(sorted, "sorted")
    k = int_attr(k, "k")
    if not 0 <= k <= x.shape[axis]:
        raise ProgramError(f"k={k} is out of range for axis {axis} of size {x.shape[axis]} "
                           f"(0..{x.shape[axis]})")
    shape = x.shape[:axis] + (k,) + x.shape[axis + 1:]
    return TensorType(shape, x.dtype), TensorType(shape, np.int64)


def _ref_topk(x, *, k, axis=-1, largest=True, sorted=True):
    idx = _ref_order(x, axis, descending=bool(largest), k=k, index_order=not sorted)
    return np.take_along_axis(x, idx, axis=axis), idx


def _sample_topk(rng: np.random.Generator):
    [x], attrs = _sample_sort(rng)
    del attrs["descending"]
    attrs["k"] = int(rng.integers(1, x.shape[attrs["axis"]] + 1))
    attrs["largest"] = bool(rng.integers(2))
    attrs["sorted"] = bool(rng.random() < 0.75)
    return [x], attrs


define("topk", infer=_infer_topk, reference=_ref_topk, sample=_sample_topk, arity=1,
       tolerance=(0.0, 0.0), doc="""
    The ``k`` largest (``largest``) or smallest elements along ``axis``: (values, int64 indices),
    the k dim replacing ``axis``. The selection is the first k of the stable descending
    (largest) or ascending order of sort, so nans count as largest and ties pick the lower
    index. sorted=True returns them in that order; sorted=False returns the same elements in
    increasing index order (a deterministic choice, so every backend agrees).
""")
