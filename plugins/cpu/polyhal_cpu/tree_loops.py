"""The tree-ensemble walk of :mod:`polyhal_cpu.ml_kernels`, compiled by numba on first call
(and cached on disk). Importing this module imports numba."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["tree_ensemble"]


@njit(nogil=True, cache=True, boundscheck=False)
def tree_ensemble(x, nodes, thresholds, leaf_values, roots, acc, out):
    """Walk every tree for every row of ``x`` (see polyhal.ops.ml for the arrays); sums in the
    float64 row ``acc``, rounded once into ``out``."""
    n_targets = leaf_values.shape[1]
    for n in range(x.shape[0]):
        acc[:] = 0.0
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
            for j in range(n_targets):
                acc[j] += leaf_values[i, j]
        for j in range(n_targets):
            out[n, j] = acc[j]  # rounded once, to out's type
