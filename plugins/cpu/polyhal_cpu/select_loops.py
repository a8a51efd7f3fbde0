"""The compiled loop of :mod:`polyhal_cpu.kernels`' ``topk``: a partial selection, by numba with
declared signatures, cached on disk. Importing this module imports numba.

A full sort of each lane costs n log n; the k best of n need only one pass that keeps them in a
heap (n log k), then a sort of the k. The order is ONNX's: by value (nan above every number, as
the sort the kernel replaces put it), ties to the lower index.

Most of a lane never reaches the heap. A first pass takes the best of each block of
:data:`BLOCK` elements (in vector registers, ~0.2 ns an element); the k-th best of those, the
*floor*, has k elements at least as good, so every element of the result is at least as good
too, and a block whose best is worse holds none of it. The heap then sees the few blocks left
(in order, which the tie rule needs), and starts from elements no worse than the floor. TopK 10
of 1,000 in 64 lanes (float32, one thread, a 2-core VM): 150 us through the heap alone (~45
insertions a lane, each ~15-30 ns with its mispredicted branches), 60 us with the blocks.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["BLOCK", "topk"]

_opts = dict(nogil=True, cache=True, boundscheck=False)

#: Elements a block of the first pass (a power of two: its best is reduced in halves).
BLOCK = 16


@njit(inline="always", **_opts)
def _better(u, v, largest):
    """Whether value ``u`` comes strictly before value ``v`` in the result (nan above every number)."""
    if largest:
        return u > v or (u != u and v == v)
    return u < v or (v != v and u == u)


@njit(inline="always", **_opts)
def _before(u, i, v, j, largest):
    """Whether element (value ``u``, index ``i``) comes before (``v``, ``j``) in the result."""
    # ordered values first: two compares where no nan is involved
    if largest:
        if u > v:
            return True
        if u < v:
            return False
    else:
        if u < v:
            return True
        if u > v:
            return False
    u_nan, v_nan = u != u, v != v  # equal values, or a nan (the largest value)
    if u_nan != v_nan:
        return u_nan == largest
    return i < j


@njit(inline="always", **_opts)
def _sift_down(heap, vals, at, size, largest):
    """Restore the heap of indices into ``vals`` (the worst element at its root) below ``at``."""
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


@njit(inline="always", **_opts)
def _sift_values(heap, at, size, largest):
    """Restore the heap of values (the worst at its root) below ``at``."""
    while True:
        child = 2 * at + 1
        if child >= size:
            return
        if child + 1 < size and _better(heap[child], heap[child + 1], largest):
            child += 1  # the worse child
        if not _better(heap[at], heap[child], largest):
            return
        heap[at], heap[child] = heap[child], heap[at]
        at = child


@njit(inline="always", **_opts)
def _block_best(src, base, acc, largest):
    """The best of ``src[base:base + BLOCK]`` (nan above every number): the two halves lane by
    lane, then halves of that, which the compiler keeps in vector registers."""
    h = BLOCK // 2
    for j in range(h):
        u, w = src[base + j], src[base + h + j]
        if largest:
            acc[j] = u if (u > w or u != u) else w
        else:
            acc[j] = u if (u < w or w != w) else w
    h //= 2
    while h >= 1:
        for j in range(h):
            u, w = acc[j], acc[j + h]
            if largest:
                acc[j] = u if (u > w or u != u) else w
            else:
                acc[j] = u if (u < w or w != w) else w
        h //= 2
    return acc[0]


@njit(inline="always", **_opts)
def _select(src, heap, k, largest, best, acc, floors):
    """The k best elements of the lane ``src`` into ``heap`` (indices, the worst at the root)."""
    n = src.shape[0]
    blocks = n // BLOCK
    filtered = blocks >= 2 * k  # enough blocks that most are left out
    floor = src[0]
    if filtered:
        for b in range(blocks):
            best[b] = _block_best(src, b * BLOCK, acc, largest)
        for b in range(k):  # the k best of the blocks' bests, in a heap of values
            floors[b] = best[b]
        for at in range(k // 2 - 1, -1, -1):
            _sift_values(floors, at, k, largest)
        for b in range(k, blocks):
            if _better(best[b], floors[0], largest):
                floors[0] = best[b]
                _sift_values(floors, 0, k, largest)
        floor = floors[0]
    size = 0
    worst = src[0]
    for b in range(blocks + 1):  # the last one: the tail past whole blocks
        if filtered and b < blocks and _better(floor, best[b], largest):
            continue
        for i in range(b * BLOCK, min(b * BLOCK + BLOCK, n)):
            v = src[i]
            if size < k:  # the first k (no worse than the floor) make the heap
                if filtered and _better(floor, v, largest):
                    continue
                heap[size] = i
                size += 1
                if size == k:
                    for at in range(k // 2 - 1, -1, -1):
                        _sift_down(heap, src, at, k, largest)
                    worst = src[heap[0]]
                continue
            # most elements lose to the heap's worst at one compare (a tie loses too: i is
            # above every index in the heap); nan takes the full rule
            if (v <= worst) if largest else (v >= worst):
                continue
            if _before(v, i, worst, heap[0], largest):
                heap[0] = i
                _sift_down(heap, src, 0, k, largest)
                worst = src[heap[0]]


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
    lane = np.empty(n if inner > 1 else 0, x.dtype)  # a strided lane, copied
    heap = np.empty(k, np.int64)
    best = np.empty(n // BLOCK, x.dtype)
    acc = np.empty(BLOCK // 2, x.dtype)
    floors = np.empty(k, x.dtype)
    rows = x.reshape(outer, n * inner)
    for o in range(outer):
        for q in range(inner):
            if inner == 1:
                src = rows[o]
            else:
                for i in range(n):
                    lane[i] = x[o, i, q]
                src = lane
            _select(src, heap, k, largest, best, acc, floors)
            if in_order:  # pop the worst to the back, k times: best first
                for size in range(k - 1, 0, -1):
                    heap[0], heap[size] = heap[size], heap[0]
                    _sift_down(heap, src, 0, size, largest)
            else:
                heap.sort()
            for i in range(k):
                indices[o, i, q] = heap[i]
                values[o, i, q] = src[heap[i]]
