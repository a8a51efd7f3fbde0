"""The recurrences of :mod:`polyhal_cpu.recurrent_kernels`, compiled by numba for float32 and
float64 when this module is imported (and cached on disk). Importing it imports numba.

One call runs one direction of a layer over every step for a block of batch rows ``b0`` to
``b1`` (rows are independent, so blocks run on different threads with nothing to wait for
between steps, as onnxruntime's ``batch_parallel_`` LSTM does). It takes the block's input
products of every step as one GEMM first (``x W^T`` into ``xw``, the block's rows of ``x``
gathered into ``xb`` first where the block is not the whole batch), then per step adds ``h
R^T`` to the step's rows of ``xw`` (GRU: see :func:`gru`), then one pass over the gates adds
the bias, applies the activations, updates the state in place and writes the step's output.
Rows past their sequence length keep their state and output zeros; a row of length 0 ends with
a zero state (onnxruntime's answer).

The GEMMs call numpy's BLAS (``cblas_sgemm`` through its address in ``desc``, a descriptor of
:mod:`polyhal_cpu.queue_layout`'s G_ fields; ``cblas_sgemv`` for one row) from the compiled
loop: no Python between steps. A descriptor with no function (float64, or no BLAS this backend
can call) takes a plain compiled loop instead.

Activations are codes, indices into :data:`polyhal.ops.recurrent.ACTIVATIONS`; ``acts`` holds a
direction's codes and ``alpha``/``beta`` their parameters.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba import types as nt
from numba.extending import overload

from polyhal_cpu.native_loops import _sgemm, exp2
from polyhal_cpu.queue_layout import G_A, G_B, G_BETA, G_C, G_FN, G_K, G_LDA, G_LDB, G_LDC, G_M, G_N

__all__ = ["gru", "lstm", "rnn"]

_opts = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")


def _signature(dtype, extra: str):
    """``(x, wt, bias, lens, h, y, d, reverse, acts, alpha, beta, clip, b0, b1, xb, xw, z,
    gates, desc, *extra)``; ``extra`` the trailing operands (lstm: p, c; gru: ``linear_before_reset``)."""
    ro = lambda n: nt.Array(dtype, n, "C", readonly=True)  # noqa: E731
    rw = lambda n: nt.Array(dtype, n, "C")  # noqa: E731
    f64 = nt.Array(nt.float64, 1, "C", readonly=True)
    args = [ro(3), ro(2), ro(1), nt.Array(nt.int32, 1, "C", readonly=True), rw(2), rw(4), nt.int64, nt.boolean,
            nt.Array(nt.int64, 1, "C", readonly=True), f64, f64, nt.float64, nt.int64, nt.int64, rw(2), rw(3),
            rw(2), rw(2), nt.Array(nt.int64, 1, "C")]
    args += {"lstm": [ro(1), rw(2)], "gru": [nt.boolean], "rnn": []}[extra]
    return nt.void(*args)


def _signatures(kind: str):
    return [_signature(nt.float32, kind), _signature(nt.float64, kind)]


def _sigmoid(v):
    """1 / (1 + e^-v); compiled, the typed implementations below."""
    return 1 / (1 + np.exp(-v))


def _tanh(v):
    """tanh(v); compiled, the typed implementations below."""
    return np.tanh(v)


_LOG2E = 1.4426950408889634


@overload(_sigmoid, inline="always")
def _sigmoid_typed(v):
    if isinstance(v, nt.Float) and v.bitwidth == 32:
        def impl(v):  # float32: exp2's polynomial in line, so that the gate loops vectorise
            return np.float32(1) / (np.float32(1) + exp2(v * np.float32(-_LOG2E)))
        return impl
    return lambda v: 1.0 / (1.0 + math.exp(-v))


@overload(_tanh, inline="always")
def _tanh_typed(v):
    if isinstance(v, nt.Float) and v.bitwidth == 32:
        def impl(v):  # (1 - e) / (1 + e), e = e^(-2|v|): an absolute error within 1e-7 near 0
            e = exp2(abs(v) * np.float32(-2 * _LOG2E))
            return math.copysign((np.float32(1) - e) / (np.float32(1) + e), v)
        return impl
    return lambda v: math.tanh(v)


@njit(inline="always", **_opts)
def _apply(code, v, alpha, beta, clip):
    """Activation ``code`` (the order of polyhal.ops.recurrent.ACTIVATIONS) of the gate row ``v``,
    in place, after clipping it to [-clip, clip] where clip > 0: a loop per code, so that each
    vectorises."""
    n = v.shape[0]
    if clip > 0:
        top = v.dtype.type(clip)
        for j in range(n):
            v[j] = min(max(v[j], -top), top)
    # Constants of v's type: numba widens float32 arithmetic with a Python number to float64.
    a = v.dtype.type(alpha)
    b = v.dtype.type(beta)
    zero = v.dtype.type(0)
    one = v.dtype.type(1)
    if code == 0:
        for j in range(n):
            v[j] = _sigmoid(v[j])
    elif code == 1:
        for j in range(n):
            v[j] = _tanh(v[j])
    elif code == 2:
        for j in range(n):
            v[j] = max(v[j], zero)
    elif code == 3:
        for j in range(n):
            v[j] = a * v[j] if v[j] < 0 else v[j]
    elif code == 4:
        for j in range(n):
            v[j] = v[j] if v[j] > a else zero
    elif code == 5:
        for j in range(n):
            v[j] = min(max(a * v[j] + b, zero), one)
    elif code == 6:
        for j in range(n):
            v[j] = a * v[j] + b
    elif code == 7:
        for j in range(n):
            v[j] = a * _tanh(b * v[j])
    elif code == 8:
        for j in range(n):
            v[j] = a * (math.exp(v[j]) - one) if v[j] < zero else v[j]
    elif code == 9:
        for j in range(n):
            v[j] = v[j] / (one + abs(v[j]))
    else:
        for j in range(n):
            v[j] = math.log1p(math.exp(v[j]))


@njit(inline="always", **_opts)
def _zero_empty(lens, h, b0, b1):
    """Rows of length 0 end with a zero state."""
    for b in range(b0, b1):
        if lens[b] == 0:
            h[b, :] = 0


#: G_BETA's bits for a product added to C (float32 1.0), and for one that overwrites it.
_ACCUMULATE, _OVERWRITE = 0x3F800000, 0


@njit(**_opts)
def _product(desc, a, b, c, accumulate):
    """``c = a @ b`` (``c += a @ b`` where ``accumulate``) for 2-D views whose rows have unit
    stride: numpy's BLAS through the address in ``desc`` (float32), else a compiled loop
    (float64, or no BLAS to call)."""
    m, k = a.shape
    n = b.shape[1]
    if desc[G_FN] != 0:
        item = a.itemsize
        desc[G_M], desc[G_N], desc[G_K] = m, n, k
        desc[G_A], desc[G_LDA] = a.ctypes.data, a.strides[0] // item
        desc[G_B], desc[G_LDB] = b.ctypes.data, b.strides[0] // item
        desc[G_C], desc[G_LDC] = c.ctypes.data, c.strides[0] // item
        desc[G_BETA] = _ACCUMULATE if accumulate else _OVERWRITE
        _sgemm(desc)
        return
    for i in range(m):
        row = c[i]
        if not accumulate:
            row[:] = 0
        for j in range(k):
            v = a[i, j]
            src = b[j]
            for q in range(n):
                row[q] += v * src[q]


@njit(inline="always", **_opts)
def _project(desc, x, wt, b0, b1, xb, xw):
    """The input products ``x W^T`` of batch rows ``b0`` to ``b1`` at every step into ``xw``
    (seq, rows, gate values): one GEMM, over ``x`` itself for the whole batch, else over the
    block's rows gathered into ``xb`` (seq * rows, features)."""
    seq, batch, features = x.shape
    rows = b1 - b0
    if seq * rows == 0:
        return
    out = xw.reshape(seq * rows, xw.shape[2])
    if rows == batch:
        _product(desc, x.reshape(seq * batch, features), wt[:features], out, False)
        return
    for t in range(seq):
        for i in range(rows):
            xb[t * rows + i] = x[t, b0 + i]
    _product(desc, xb, wt[:features], out, False)


@njit(_signatures("rnn"), **_opts)
def rnn(x, wt, bias, lens, h, y, d, reverse, acts, alpha, beta, clip, b0, b1, xb, xw, z, gates, desc):
    """``wt`` is ``[W^T; R^T]`` (features + hidden, hidden); ``bias`` the input and recurrent
    biases summed."""
    seq, features = x.shape[0], x.shape[2]
    _project(desc, x, wt, b0, b1, xb, xw)
    for step in range(seq):
        t = seq - 1 - step if reverse else step
        _product(desc, h[b0:b1], wt[features:], xw[t], True)
        for i in range(b1 - b0):
            b = b0 + i
            if t >= lens[b]:
                y[t, d, b, :] = 0
                continue
            g = xw[t, i]
            for j in range(g.shape[0]):
                g[j] += bias[j]
            _apply(acts[0], g, alpha[0], beta[0], clip)
            h[b, :] = g
            y[t, d, b, :] = g
    _zero_empty(lens, h, b0, b1)


@njit(_signatures("gru"), **_opts)
def gru(x, wt, bias, lens, h, y, d, reverse, acts, alpha, beta, clip, b0, b1, xb, xw, z, gates, desc,
        linear_before_reset):
    """Gates in ONNX's order: update, reset, hidden; ``wt`` is ``[W^T; R^T]`` (features + hidden,
    3 hidden), ``bias`` holds 6 * hidden values (the input biases, then the recurrent ones). Per
    step ``h Rzr^T`` is added to the update and reset gates' inputs; then, without
    ``linear_before_reset``, ``(reset * h) Rh^T`` (``reset * h`` in ``z``) to the hidden gate's;
    with it, ``h Rh^T`` goes to ``gates``, as the reset scales it (with its bias) alone."""
    seq, features, hidden = x.shape[0], x.shape[2], h.shape[1]
    rows = b1 - b0
    wb, rb = bias[:3 * hidden], bias[3 * hidden:]
    _project(desc, x, wt, b0, b1, xb, xw)
    # The GEMMs write column blocks; the passes take each row whole and cut it (contiguous
    # pieces: a row of a column block has an unknown stride, and its loops do not vectorise).
    for step in range(seq):
        t = seq - 1 - step if reverse else step
        _product(desc, h[b0:b1], wt[features:, :2 * hidden], xw[t][:, :2 * hidden], True)
        if linear_before_reset:
            _product(desc, h[b0:b1], wt[features:, 2 * hidden:], gates, False)
        for i in range(rows):  # update and reset gates, and (without linear_before_reset) reset * h
            if t >= lens[b0 + i]:
                continue
            g = xw[t, i][:2 * hidden]
            for j in range(2 * hidden):
                g[j] += wb[j] + rb[j]
            _apply(acts[0], g, alpha[0], beta[0], clip)
            if not linear_before_reset:
                reset, state = z[i], h[b0 + i]
                for j in range(hidden):
                    reset[j] = g[hidden + j] * state[j]
        if not linear_before_reset:
            _product(desc, z, wt[features:, 2 * hidden:], xw[t][:, 2 * hidden:], True)
        for i in range(rows):
            b = b0 + i
            if t >= lens[b]:
                y[t, d, b, :] = 0
                continue
            row, state, out = xw[t, i], h[b], y[t, d, b]
            update, c = row[:hidden], row[2 * hidden:]
            if linear_before_reset:
                reset, r = row[hidden:2 * hidden], gates[i]
                for j in range(hidden):
                    c[j] += wb[2 * hidden + j] + reset[j] * (r[j] + rb[2 * hidden + j])
            else:
                for j in range(hidden):
                    c[j] += wb[2 * hidden + j] + rb[2 * hidden + j]
            _apply(acts[1], c, alpha[1], beta[1], clip)
            for j in range(hidden):
                v = c[j] - update[j] * c[j] + update[j] * state[j]
                state[j] = v
                out[j] = v
    _zero_empty(lens, h, b0, b1)


@njit(_signatures("lstm"), **_opts)
def lstm(x, wt, bias, lens, h, y, d, reverse, acts, alpha, beta, clip, b0, b1, xb, xw, z, gates, desc, p, c):
    """Gates in ONNX's order: input, output, forget, cell; ``wt`` is ``[W^T; R^T]`` (features +
    hidden, 4 hidden), ``bias`` the input and recurrent biases summed; ``p`` the peepholes
    (input, output, forget); ``c`` the cell state, updated in place."""
    seq, features, hidden = x.shape[0], x.shape[2], h.shape[1]
    _project(desc, x, wt, b0, b1, xb, xw)
    for step in range(seq):
        t = seq - 1 - step if reverse else step
        _product(desc, h[b0:b1], wt[features:], xw[t], True)
        for i in range(b1 - b0):
            b = b0 + i
            if t >= lens[b]:
                y[t, d, b, :] = 0
                continue
            g = xw[t, i]
            for j in range(g.shape[0]):
                g[j] += bias[j]
            gi, go, gf, gc = g[:hidden], g[hidden:2 * hidden], g[2 * hidden:3 * hidden], g[3 * hidden:]
            cell = c[b]
            for j in range(hidden):
                gi[j] += p[j] * cell[j]
                gf[j] += p[2 * hidden + j] * cell[j]
            _apply(acts[0], gi, alpha[0], beta[0], clip)
            _apply(acts[0], gf, alpha[0], beta[0], clip)
            _apply(acts[1], gc, alpha[1], beta[1], clip)
            for j in range(hidden):
                cell[j] = gf[j] * cell[j] + gi[j] * gc[j]
                go[j] += p[hidden + j] * cell[j]
                gc[j] = cell[j]
            _apply(acts[0], go, alpha[0], beta[0], clip)
            _apply(acts[2], gc, alpha[2], beta[2], 0.0)
            for j in range(hidden):
                v = go[j] * gc[j]
                h[b, j] = v
                y[t, d, b, j] = v
    _zero_empty(lens, h, b0, b1)
    _zero_empty(lens, c, b0, b1)
