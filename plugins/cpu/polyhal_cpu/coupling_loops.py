"""The compiled loop of :mod:`polyhal_cpu.ml_kernels`' ``pairwise_coupling`` (an SVM's class
probabilities), by numba with declared signatures, cached on disk. Importing this module imports
numba.

Each row is Wu, Lin and Weng's method 2 as :func:`polyhal.ops.ml.coupling_row` (and libsvm, and
onnxruntime) iterates it, in the row's type: the numpy version of a row is ~40 small array calls
a sweep, this loop is the same arithmetic on a k x k matrix held in cache.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["pairwise_coupling"]

_SIGS = ["void({x}[:, ::1], {x}[:, ::1])".format(x=x) for x in ("f4", "f8")]


@njit(_SIGS, nogil=True, cache=True, boundscheck=False)
def pairwise_coupling(r, out):
    """Class probabilities ``out`` ``[samples, k]`` from pairwise ones ``r`` ``[samples, pairs]``
    (pair p: P(class i | i or j) for the pairs i < j in order)."""
    k = out.shape[1]
    dtype = out.dtype
    pr = np.zeros((k, k), dtype)
    q = np.zeros((k, k), dtype)
    qp = np.empty(k, dtype)
    p = np.empty(k, dtype)
    limit = dtype.type(0.005 / k)
    for n in range(r.shape[0]):
        at = 0
        for i in range(k):
            for j in range(i + 1, k):
                pr[i, j] = r[n, at]
                pr[j, i] = 1 - r[n, at]
                at += 1
        for t in range(k):
            s = dtype.type(0)
            for j in range(k):
                if j != t:
                    s += pr[j, t] * pr[j, t]
            q[t, t] = s
            for j in range(t):
                q[t, j] = q[j, t]
            for j in range(t + 1, k):
                q[t, j] = -pr[j, t] * pr[t, j]
        for t in range(k):
            p[t] = dtype.type(1.0 / k)
        for _ in range(max(100, k)):
            pqp = dtype.type(0)
            for t in range(k):
                s = dtype.type(0)
                for j in range(k):
                    s += q[t, j] * p[j]
                qp[t] = s
                pqp += p[t] * s
            err = dtype.type(0)
            for t in range(k):
                err = max(err, abs(qp[t] - pqp))
            if err < limit:
                break
            for t in range(k):
                diff = (-qp[t] + pqp) / q[t, t]
                p[t] += diff
                pqp = (pqp + diff * (diff * q[t, t] + 2 * qp[t])) / ((1 + diff) * (1 + diff))
                for j in range(k):
                    p[j] /= 1 + diff
                    qp[j] = (qp[j] + diff * q[t, j]) / (1 + diff)
        for t in range(k):
            out[n, t] = p[t]
