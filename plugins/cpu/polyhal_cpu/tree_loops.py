"""The tree-ensemble walks of :mod:`polyhal_cpu.ml_kernels`, compiled by numba on first call
(and cached on disk). Importing this module imports numba.

Two loops share the per-row aggregation and epilogue:

* :func:`compare_all` walks shallow ensembles (depth <= 6: a tree's nodes are the bits of an int64)
  laid out as
  *complete* trees (:func:`polyhal_cpu.ml_kernels.complete_trees`): for a block of rows it
  compares every node of a tree at once -- one threshold against one feature column of the
  block, a loop with no branches that the compiler vectorises -- into a bit mask per row, then
  finds each row's leaf from its mask by ``i = 2 i + 1 + bit(i)`` per level (again branch-free,
  over the block). A tree of depth 3 costs 7 compares where a walk makes 3, but a walk's branch
  goes the wrong way half the time on real data, and its loads depend on each other; this
  loop's compares run 8 rows to an instruction.
* :func:`walk_pairs` walks deeper ensembles of the same rules laid out with each branch's
  children side by side (:func:`polyhal_cpu.ml_kernels.paired_trees`): a step is
  ``i = left(i) + (x[feature(i)] > threshold(i))``, no branch, and a block of
  :data:`WALK_ROWS` rows takes each tree a level at a time, so the rows' chains of dependent
  loads overlap and the tree stays in cache for the block (fewer rows walk all trees side by
  side, a level at a time, for the same overlap). A random forest of 50 trees of
  depth 8 at batch 1,000: 2.7 ms walked row by row with a branch per level, 1.0 ms (~2.5 ns a
  step; a 2-core VM, one thread).
* :func:`tree_ensemble` walks the compact node arrays (any depth, every ONNX branch mode), a
  branch per level, row by row: what the other loops do not take (BRANCH_EQ, BRANCH_NEQ).

``params`` (float64) holds the codes ``(aggregate, binary, post_transform)`` (indices into
polyhal.ops.ml's AGGREGATES, BINARY, POST_TRANSFORMS) followed by the base values, if any: few
arguments, as each costs the call time (~65 ns an array). Scores are kept in float64 (two columns
for ``binary``), rounded once into ``out``; with ``labels`` non-empty, ``label_out[n]`` is the
label of row n's largest (rounded) output.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["BLOCK", "VECTOR_ROWS", "WALK_ROWS", "compare_all", "tree_ensemble", "walk_pairs"]

#: Rows that :func:`compare_all` takes at once (its transposed block of ``x`` stays in L1).
BLOCK = 64
#: Rows from which :func:`compare_all` compares with vector loops.
VECTOR_ROWS = 16
#: Rows that :func:`walk_pairs` walks side by side (8 to 64 took the same time).
WALK_ROWS = 16

_opts = dict(nogil=True, cache=True, boundscheck=False)
# The helpers are inlined in numba's IR: called per row and tree, a call costs more than their work.


@njit(inline="always", **_opts)
def _start(acc, r, aggregate):
    """Row ``r`` of the accumulator before any tree: 0 to sum, nan ("no value yet") for min/max."""
    for j in range(acc.shape[1]):
        acc[r, j] = 0.0 if aggregate == 0 else np.nan


@njit(inline="always", **_opts)
def _start_rows(acc, rows, aggregate):
    """The first ``rows`` rows of the accumulator before any tree."""
    for r in range(rows):
        _start(acc, r, aggregate)


@njit(inline="always", **_opts)
def _aggregate(acc, r, values, k, aggregate):
    """Add one tree's leaf values ``values[k]`` (one per target) into row ``r`` of the
    accumulator (indices, not a row view: a view costs a reference count per tree)."""
    if aggregate == 0:
        for j in range(values.shape[1]):
            acc[r, j] += values[k, j]
    else:
        for j in range(values.shape[1]):
            w = values[k, j]
            if w == w and (acc[r, j] != acc[r, j] or (w < acc[r, j] if aggregate == 1 else w > acc[r, j])):
                acc[r, j] = w


@njit(inline="always", **_opts)
def _add_leaves(acc, rows, leaves, first, at, aggregate):
    """Add one tree's leaves ``leaves[first + at[r]]`` into rows ``r < rows`` of the accumulator."""
    if aggregate == 0 and leaves.shape[1] == 1:  # a regressor's or a binary classifier's sum
        for r in range(rows):
            acc[r, 0] += leaves[first + at[r], 0]
    else:
        for r in range(rows):
            _aggregate(acc, r, leaves, first + at[r], aggregate)


@njit(inline="always", **_opts)
def _finish(acc, r, n_targets, params, out, n, labels, label_out):
    """Row ``r`` of the accumulator through the epilogue into ``out[n]`` (and ``label_out[n]``)."""
    aggregate, binary, transform = int(params[0]), int(params[1]), int(params[2])
    base = params[3:]
    columns = out.shape[1]
    for j in range(n_targets):
        if acc[r, j] != acc[r, j] and aggregate != 0:
            acc[r, j] = 0.0  # no tree gave this target a value
        if base.shape[0]:
            acc[r, j] += base[j]
    if binary:
        acc[r, 1] = acc[r, 0]
        acc[r, 0] = 1.0 - acc[r, 0] if binary == 1 else -acc[r, 0]
    if transform == 1:
        for j in range(columns):
            acc[r, j] = 1.0 / (1.0 + math.exp(-acc[r, j]))
    elif transform >= 2:  # softmax; softmax_zero leaves zero entries out
        top = -np.inf
        for j in range(columns):
            if (transform == 2 or acc[r, j] != 0.0) and acc[r, j] > top:
                top = acc[r, j]
        total = 0.0
        for j in range(columns):
            if transform == 2 or acc[r, j] != 0.0:
                acc[r, j] = math.exp(acc[r, j] - top)
                total += acc[r, j]
        for j in range(columns):
            acc[r, j] = acc[r, j] / total if total > 0.0 else 0.0
    best = 0
    for j in range(columns):
        out[n, j] = acc[r, j]  # rounded once, to out's type
        if out[n, j] > out[n, best]:
            best = j
    if labels.shape[0]:
        label_out[n] = labels[best]


@njit(inline="always", **_opts)
def _finish_rows(acc, rows, n_targets, params, out, r0, labels, label_out):
    """The first ``rows`` rows of the accumulator through the epilogue into ``out[r0:]``."""
    for r in range(rows):
        _finish(acc, r, n_targets, params, out, r0 + r, labels, label_out)


@njit(**_opts)
def tree_ensemble(x, nodes, thresholds, leaf_values, roots, params, out, labels, label_out):
    """Walk every tree for every row of ``x`` over the compact arrays (see polyhal.ops.ml)."""
    n_targets = leaf_values.shape[1]
    aggregate = int(params[0])
    acc = np.empty((1, max(n_targets, 2)), np.float64)
    for n in range(x.shape[0]):
        _start(acc, 0, aggregate)
        for t in range(roots.shape[0]):
            i = roots[t]
            mode = nodes[i, 1]
            while mode != 0:
                v = x[n, nodes[i, 0]]
                th = thresholds[i]
                if v != v:
                    go = (mode & 8) != 0
                else:
                    go = ((mode & 1) != 0 and v < th) or ((mode & 2) != 0 and v == th) or ((mode & 4) != 0 and v > th)
                i = nodes[i, 2] if go else nodes[i, 3]
                mode = nodes[i, 1]
            _aggregate(acc, 0, leaf_values, i, aggregate)
        _finish(acc, 0, n_targets, params, out, n, labels, label_out)


@njit(inline="always", **_opts)
def _step(x, n, links, threshold, i):
    """Row ``n``'s next position in the paired layout from position ``i``: the left child when
    ``x <= threshold``, else the one next to it (a leaf: itself)."""
    f = links[i, 0]
    v = x[n, f ^ (f >> 31)]  # a negative f reads ~f and sends nan right
    th = threshold[i]
    return links[i, 1] + ((v > th) | ((f < 0) & (not v <= th)))


@njit(**_opts)
def walk_pairs(x, links, threshold, leaves, trees, params, out, labels, label_out):
    """Every tree for every row of ``x`` over the paired layout (see
    :func:`polyhal_cpu.ml_kernels.paired_trees`): ``links`` int32 ``[P, 2]`` (feature, left
    child), ``threshold`` (x's type) ``[P]``, ``leaves`` float64 ``[P, n_targets]``, ``trees``
    int32 ``[T, 2]`` (root, depth)."""
    samples = x.shape[0]
    n_targets = leaves.shape[1]
    aggregate = int(params[0])
    count = trees.shape[0]
    if samples < WALK_ROWS:  # too few rows to overlap: the trees side by side, a level at a time
        acc = np.empty((1, max(n_targets, 2)), np.float64)
        at = np.empty(count, np.int32)
        deepest = 0
        for t in range(count):
            deepest = max(deepest, trees[t, 1])
        for n in range(samples):
            _start(acc, 0, aggregate)
            for t in range(count):
                at[t] = trees[t, 0]
            for _ in range(deepest):
                for t in range(count):
                    at[t] = _step(x, n, links, threshold, at[t])
            for t in range(count):
                _aggregate(acc, 0, leaves, at[t], aggregate)
            _finish(acc, 0, n_targets, params, out, n, labels, label_out)
        return
    at = np.empty(WALK_ROWS, np.int32)
    acc = np.empty((WALK_ROWS, max(n_targets, 2)), np.float64)
    for r0 in range(0, samples, WALK_ROWS):
        rows = min(WALK_ROWS, samples - r0)
        _start_rows(acc, rows, aggregate)
        for t in range(count):
            root, depth = trees[t, 0], trees[t, 1]
            for r in range(rows):
                at[r] = root
            for _ in range(depth):  # a leaf links to itself: rows that reached one stay
                for r in range(rows):
                    at[r] = _step(x, r0 + r, links, threshold, at[r])
            _add_leaves(acc, rows, leaves, 0, at, aggregate)
        _finish_rows(acc, rows, n_targets, params, out, r0, labels, label_out)


@njit(**_opts)
def compare_all(x, feature, threshold, leaves, params, out, labels, label_out):
    """Every tree for every row of ``x``, over complete trees of depth d <= 6 (see the module
    docstring): ``feature`` ``[T, 2**d - 1]`` and ``threshold`` (x's type) per node in
    heap order (node i's children are 2i + 1 and 2i + 2), a row going to 2i + 1 when
    ``x[feature] <= threshold``; a negative ``feature`` f reads feature ~f and sends nan to
    2i + 2 (else nan goes to 2i + 1). ``leaves`` float64 ``[T * 2**d, n_targets]``, tree t's
    leaves from row t * 2**d on. Batches of fewer than :data:`VECTOR_ROWS` rows (a batch of one)
    walk the trees instead, all of them a level at a time (independent loads that overlap):
    vector loops that short run as scalar code. ``feature``'s type is the bit masks' (int32 holds a
    tree of depth 5, int64 one of depth 6), so shallow trees compare 8 rows to an AVX2 vector."""
    trees, inner = feature.shape
    depth = 0
    while (1 << depth) - 1 < inner:
        depth += 1
    samples, features = x.shape
    n_targets = leaves.shape[1]
    aggregate = int(params[0])
    if samples < VECTOR_ROWS:  # the trees walk side by side, a level at a time, without branches
        acc = np.empty((1, max(n_targets, 2)), np.float64)
        at = np.empty(trees, np.int64)
        for n in range(samples):
            _start(acc, 0, aggregate)
            at[:] = 0
            for _ in range(depth):
                for t in range(trees):
                    i = at[t]
                    f = feature[t, i]
                    v = x[n, f ^ (f >> 31)]  # a negative f reads ~f and sends nan right
                    at[t] = 2 * i + 1 + (not v <= threshold[t, i] if f < 0 else v > threshold[t, i])
            for t in range(trees):
                _aggregate(acc, 0, leaves, (t << depth) + at[t] - inner, aggregate)
            _finish(acc, 0, n_targets, params, out, n, labels, label_out)
        return
    xt = np.zeros((features, BLOCK), x.dtype)
    masks = np.empty(BLOCK, feature.dtype)
    idx = np.empty(BLOCK, feature.dtype)
    acc = np.empty((BLOCK, max(n_targets, 2)), np.float64)
    for r0 in range(0, samples, BLOCK):
        rows = min(BLOCK, samples - r0)
        _start_rows(acc, rows, aggregate)
        for r in range(rows):
            for f in range(features):
                xt[f, r] = x[r0 + r, f]
        lanes = (rows + 7) // 8 * 8  # whole vectors; lanes past `rows` are ignored
        for t in range(trees):
            masks[:lanes] = 0
            for k in range(inner):
                f = feature[t, k]
                th = threshold[t, k]
                bit = feature.dtype.type(k)
                if f >= 0:  # nan > th is false: nan goes to 2k + 1
                    for r in range(lanes):
                        masks[r] |= feature.dtype.type(xt[f, r] > th) << bit
                else:  # not (nan <= th) is true: nan goes to 2k + 2
                    g = ~f
                    for r in range(lanes):
                        masks[r] |= feature.dtype.type(not xt[g, r] <= th) << bit
            idx[:lanes] = 0
            for _ in range(depth):
                for r in range(lanes):
                    i = idx[r]
                    idx[r] = 2 * i + 1 + ((masks[r] >> i) & 1)
            _add_leaves(acc, rows, leaves, (t << depth) - inner, idx, aggregate)
        _finish_rows(acc, rows, n_targets, params, out, r0, labels, label_out)
