"""The tree-ensemble walk of :mod:`polyhal_cpu.ml_kernels`, compiled by numba on first call
(and cached on disk). Importing this module imports numba."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["tree_ensemble"]


@njit(nogil=True, cache=True, boundscheck=False)
def tree_ensemble(x, nodes, thresholds, leaf_values, roots, params, out, labels, label_out):
    """Walk every tree for every row of ``x`` (see polyhal.ops.ml for the arrays and the
    epilogue). ``params`` (float64) holds the codes ``(aggregate, binary, post_transform)``
    (indices into polyhal.ops.ml's AGGREGATES, BINARY, POST_TRANSFORMS) followed by the base
    values, if any: few arguments, as each costs the call time. Scores are kept in a float64 row
    (two columns for ``binary``), rounded once into ``out``; with ``labels`` non-empty,
    ``label_out[n]`` is the label of row n's largest (rounded) output."""
    n_targets = leaf_values.shape[1]
    aggregate, binary, transform = int(params[0]), int(params[1]), int(params[2])
    base = params[3:]
    acc = np.empty(max(n_targets, 2), np.float64)
    columns = out.shape[1]
    for n in range(x.shape[0]):
        for j in range(n_targets):
            acc[j] = 0.0 if aggregate == 0 else np.nan
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
            if aggregate == 0:
                for j in range(n_targets):
                    acc[j] += leaf_values[i, j]
            else:
                for j in range(n_targets):
                    w = leaf_values[i, j]
                    if w == w and (acc[j] != acc[j] or (w < acc[j] if aggregate == 1 else w > acc[j])):
                        acc[j] = w
        for j in range(n_targets):
            if acc[j] != acc[j] and aggregate != 0:
                acc[j] = 0.0  # no tree gave this target a value
            if base.shape[0]:
                acc[j] += base[j]
        if binary:
            acc[1] = acc[0]
            acc[0] = 1.0 - acc[0] if binary == 1 else -acc[0]
        if transform == 1:
            for j in range(columns):
                acc[j] = 1.0 / (1.0 + math.exp(-acc[j]))
        elif transform >= 2:  # softmax; softmax_zero leaves zero entries out
            top = -np.inf
            for j in range(columns):
                if (transform == 2 or acc[j] != 0.0) and acc[j] > top:
                    top = acc[j]
            total = 0.0
            for j in range(columns):
                if transform == 2 or acc[j] != 0.0:
                    acc[j] = math.exp(acc[j] - top)
                    total += acc[j]
            for j in range(columns):
                acc[j] = acc[j] / total if total > 0.0 else 0.0
        best = 0
        for j in range(columns):
            out[n, j] = acc[j]  # rounded once, to out's type
            if out[n, j] > out[n, best]:
                best = j
        if labels.shape[0]:
            label_out[n] = labels[best]
