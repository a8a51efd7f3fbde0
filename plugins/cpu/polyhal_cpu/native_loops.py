"""The loops of :mod:`polyhal_cpu.native`, compiled by numba on first call (and cached on disk).

Importing this module imports numba; :mod:`polyhal_cpu.native` does so only when a kernel asks
for a loop. Every loop takes float32 C-contiguous arrays and releases the GIL.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["add_rows", "exp2_shifted_rows", "gelu_erf", "gelu_tanh", "layer_norm", "relu", "scale_rows", "softmax_rows"]

# No "nnan"/"ninf": nan and inf keep their IEEE meaning (a nan input gives a nan result).
# "reassoc" lets LLVM vectorise the row sums (in any order, as numpy's pairwise sum does).
_jit = njit(fastmath={"contract", "arcp", "reassoc", "nsz", "afn"}, error_model="numpy", nogil=True,
            cache=True, boundscheck=False)
f32, i32 = np.float32, np.int32


@_jit
def exp2(t):
    """2^t in float32, in line (see polyhal_cpu.native: Cephes' polynomial, exponent bits)."""
    t = min(max(t, f32(-127.0)), f32(128.0))
    n = np.floor(t + f32(0.5))
    f = t - n
    p = f32(1.535336188319500e-4)
    p = p * f + f32(1.339887440266574e-3)
    p = p * f + f32(9.618437357674640e-3)
    p = p * f + f32(5.550332471162809e-2)
    p = p * f + f32(2.402264791363012e-1)
    p = p * f + f32(6.931472028550421e-1)
    p = p * f + f32(1.0)
    bits = (i32(n) + i32(127)) << i32(23)  # numba widens the arithmetic to int64:
    return p * i32(bits).view(np.float32)  # back to 32 bits before reinterpreting


@_jit
def gelu_tanh(x, out):
    """x * sigmoid(2u) = x / (1 + 2^(-2u log2 e)), u = sqrt(2/pi) (x + 0.044715 x^3), over 1-D x."""
    k1 = f32(-2.0 * 0.7978845608028654 * 1.4426950408889634)
    k3 = f32(-2.0 * 0.7978845608028654 * 1.4426950408889634 * 0.044715)
    for i in range(x.size):
        v = x[i]
        out[i] = v / (f32(1.0) + exp2(v * (k1 + k3 * v * v)))


@_jit
def gelu_erf(x, out, p, q):
    """x/2 * (1 + erf(x / sqrt 2)) over 1-D x, erf(z) = z P(z^2) / Q(z^2) on z clamped to
    [-4, 4] (``p``, ``q``: 7 and 5 coefficients, highest power first), evaluated in float64 and
    then combined in float32, as the numpy kernels of polyhal_cpu.kernels do (erf's error,
    1e-7, times |x| / 2)."""
    for i in range(x.size):
        v = np.float64(x[i])
        z = min(max(v * 0.7071067811865476, -4.0), 4.0)  # nan stays nan (min/max pass it)
        z2 = z * z
        n = ((((((p[0] * z2 + p[1]) * z2 + p[2]) * z2 + p[3]) * z2 + p[4]) * z2 + p[5]) * z2 + p[6]) * z
        d = (((q[0] * z2 + q[1]) * z2 + q[2]) * z2 + q[3]) * z2 + q[4]
        e = f32(n / d)  # erf rounded to float32 first, as the numpy kernel does: erf(+-4) is +-1
        out[i] = (e * f32(0.5) + f32(0.5)) * x[i]


@_jit
def relu(x, out):
    """max(x, 0) over 1-D x; nan stays nan (as numpy's maximum)."""
    for i in range(x.size):
        v = x[i]
        out[i] = v if not v < f32(0.0) else f32(0.0)


@_jit
def softmax_rows(x, out):
    """Softmax of each row of (rows, cols) x into out, shifted by the row's maximum. A row with
    a nan, or whose maximum is +-inf, gives nan where x - max is nan, as the reference does."""
    rows, cols = x.shape
    log2e = f32(1.4426950408889634)
    for r in range(rows):
        m = x[r, 0]
        for c in range(1, cols):
            v = x[r, c]
            if v > m or v != v:
                m = v
        t = f32(0.0)
        for c in range(cols):
            e = exp2((x[r, c] - m) * log2e)
            out[r, c] = e
            t += e
        k = f32(1.0) / t
        for c in range(cols):
            out[r, c] *= k


@_jit
def layer_norm(x, scale, bias, eps, out):
    """Rows of (rows, cols) x normalised (mean 0, variance 1, then scale and bias) into out."""
    rows, cols = x.shape
    inv = f32(1.0) / f32(cols)
    for r in range(rows):
        s = f32(0.0)
        for c in range(cols):
            s += x[r, c]
        mean = s * inv
        v = f32(0.0)
        for c in range(cols):
            d = x[r, c] - mean
            v += d * d
        rstd = f32(1.0) / np.sqrt(v * inv + eps)
        for c in range(cols):
            out[r, c] = (x[r, c] - mean) * rstd * scale[c] + bias[c]


@_jit
def exp2_shifted_rows(s, shift, sums):
    """In place: (rows, cols) s becomes 2^(s - shift), sums[r] the sum of row r. Scores far
    below the shift give 0 (no subnormals); nan and +inf pass through to the sums."""
    rows, cols = s.shape
    for r in range(rows):
        t = f32(0.0)
        for c in range(cols):
            e = exp2(s[r, c] - shift)
            s[r, c] = e
            t += e
        sums[r] = t


@_jit
def scale_rows(x, factors):
    """In place: row r of (rows, cols) x divided by factors[r]."""
    rows, cols = x.shape
    for r in range(rows):
        k = f32(1.0) / factors[r]
        for c in range(cols):
            x[r, c] *= k


@_jit
def add_rows(x, row):
    """In place: (cols,) row added to every row of (rows, cols) x."""
    rows, cols = x.shape
    for r in range(rows):
        for c in range(cols):
            x[r, c] += row[c]
