"""The compiled loop of :mod:`polyhal_cpu.kernels`' ``topk``: a partial selection, by numba with
declared signatures, cached on disk. Importing this module imports numba.

A full sort of each lane costs n log n; the k best of n need only one pass that keeps them in a
heap (n log k, and for the usual k << n nearly every element is one compare against the heap's
worst), then a sort of the k. The order is ONNX's: by value (nan above every number, as the
sort the kernel replaces put it), ties to the lower index.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["topk"]

_opts = dict(nogil=True, cache=True, boundscheck=False)


@njit(inline="always", **_opts)
def _before(u, i, v, j, largest):
    """Whether element (value ``u``, index ``i``) comes before (``v``, ``j``) in the result."""
    if u != v:
        u_nan, v_nan = u != u, v != v
        if u_nan or v_nan:
            if u_nan and v_nan:
                return i < j
            return u_nan == largest  # nan is the largest value
        return (u > v) == largest
    return i < j


@njit(inline="always", **_opts)
def _sift_down(heap, vals, at, size, largest):
    """Restore the heap (the worst element at its root) below ``at``."""
    while True:
        child = 2 * at + 1
        if child >= size:
            return
        if child + 1 < size and _before(vals[heap[child]], heap[child], vals[heap[child + 1]], heap[child + 1],
                                        largest):
            child += 1  # the worse child
        if not _before(vals[heap[at]], heap[at], vals[heap[child]], heap[child], largest):
            return
        heap[at], heap[child] = heap[child], heap[at]
        at = child


_SIGS = ["void({x}[:, :, ::1], {x}[:, :, ::1], i8[:, :, ::1], b1, b1)".format(x=x) for x in ("f4", "f8", "i4", "i8")]


@njit(_SIGS, **_opts)
def topk(x, values, indices, largest, in_order):
    """The k = ``values.shape[1]`` best of each lane of ``x`` ``[outer, n, inner]`` (the lanes run
    along the middle dim) into ``values`` and ``indices`` ``[outer, k, inner]``: ordered best
    first with ``in_order``, else by index."""
    outer, n, inner = x.shape
    k = values.shape[1]
    if k == 0:
        return
    lane = np.empty(n, x.dtype)
    heap = np.empty(k, np.int64)
    for o in range(outer):
        for q in range(inner):
            for i in range(n):
                lane[i] = x[o, i, q]
            for i in range(k):  # the first k, heapified
                heap[i] = i
            for at in range(k // 2 - 1, -1, -1):
                _sift_down(heap, lane, at, k, largest)
            worst = lane[heap[0]]
            for i in range(k, n):
                v = lane[i]
                # most elements lose to the heap's worst at one compare (a tie loses too: i
                # is above every index in the heap); nan takes the full rule
                if (v <= worst) if largest else (v >= worst):
                    continue
                if _before(v, i, worst, heap[0], largest):
                    heap[0] = i
                    _sift_down(heap, lane, 0, k, largest)
                    worst = lane[heap[0]]
            if in_order:  # pop the worst to the back, k times: best first
                for size in range(k - 1, 0, -1):
                    heap[0], heap[size] = heap[size], heap[0]
                    _sift_down(heap, lane, 0, size, largest)
            else:
                heap.sort()
            for i in range(k):
                indices[o, i, q] = heap[i]
                values[o, i, q] = lane[heap[i]]
