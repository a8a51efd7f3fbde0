"""The recurrences of :mod:`polyhal_cpu.recurrent_kernels`, compiled by numba for float32 and
float64 when this module is imported (and cached on disk). Importing it imports numba.

One call runs one direction of a layer over steps ``first`` to ``first + count``: per step the
recurrent product ``h R^T`` is one GEMM (``np.dot``, which numba sends to scipy's BLAS; with
``multiply`` False the caller has computed it into ``gates`` instead), then one pass over the
gates adds the input projection (computed for every step at once before the call) and the bias,
applies the activations, updates the state in place and writes the step's output. Rows past
their sequence length keep their state and output zeros; a row of length 0 ends with a zero
state (onnxruntime's answer).

Activations are codes, indices into :data:`polyhal.ops.recurrent.ACTIVATIONS`; ``acts`` holds a
direction's codes and ``alpha``/``beta`` their parameters.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba import types as nt
from numba.extending import overload

from polyhal_cpu.native_loops import exp2

__all__ = ["gru", "lstm", "rnn"]

_opts = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")


def _signature(dtype, extra: int):
    """``(xw, bias, r, lens, h, y, d, reverse, acts, alpha, beta, clip, first, count, multiply, gates,
    *extra)``; ``extra``
    the trailing operands (lstm: p, c; gru: the reset product's two scratch rows and
    ``linear_before_reset``)."""
    ro = lambda n: nt.Array(dtype, n, "C", readonly=True)  # noqa: E731
    rw = lambda n: nt.Array(dtype, n, "C")  # noqa: E731
    args = [rw(3), ro(1), ro(2), nt.Array(nt.int32, 1, "C", readonly=True), rw(2), rw(4), nt.int64, nt.boolean,
            nt.Array(nt.int64, 1, "C", readonly=True), nt.Array(nt.float64, 1, "C", readonly=True),
            nt.Array(nt.float64, 1, "C", readonly=True), nt.float64, nt.int64, nt.int64, nt.boolean, rw(2)]
    args += {"lstm": [ro(1), rw(2)], "gru": [rw(2), rw(2), nt.boolean], "rnn": []}[extra]
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
def _zero_empty(lens, h):
    """Rows of length 0 end with a zero state."""
    for b in range(h.shape[0]):
        if lens[b] == 0:
            h[b, :] = 0


@njit(inline="always", **_opts)
def _add_input(g, xw, bias):
    """The step's recurrent product ``g`` plus its input projection and bias, in place."""
    for j in range(g.shape[0]):
        g[j] += xw[j] + bias[j]


@njit(_signatures("rnn"), **_opts)
def rnn(xw, bias, r, lens, h, y, d, reverse, acts, alpha, beta, clip, first, count, multiply, gates):
    """``bias`` holds the input and recurrent biases summed (hidden values)."""
    seq, batch = xw.shape[0], h.shape[0]
    for step in range(first, first + count):
        t = seq - 1 - step if reverse else step
        if multiply:
            np.dot(h, r.T, gates)
        for b in range(batch):
            if t >= lens[b]:
                y[t, d, b, :] = 0
                continue
            g = gates[b]
            _add_input(g, xw[t, b], bias)
            _apply(acts[0], g, alpha[0], beta[0], clip)
            h[b, :] = g
            y[t, d, b, :] = g
    if first + count == seq:
        _zero_empty(lens, h)


@njit(_signatures("gru"), **_opts)
def gru(xw, bias, r, lens, h, y, d, reverse, acts, alpha, beta, clip, first, count, multiply, gates, reset, product,
        linear_before_reset):
    """Gates in ONNX's order: update, reset, hidden; ``bias`` holds 6 * hidden values (the
    input biases, then the recurrent ones). With ``linear_before_reset`` the recurrent product of
    the hidden gate is taken with ``h`` and its bias added before the reset gate scales it."""
    seq, batch, hidden = xw.shape[0], h.shape[0], h.shape[1]
    rz = r[:2 * hidden]
    rh = r[2 * hidden:]
    wb, rb = bias[:3 * hidden], bias[3 * hidden:]
    # Without linear_before_reset, the step's first product is h R_zr^T alone (batch x 2 hidden,
    # contiguous), and the hidden gate's is taken after the reset, into ``product``.
    zr = gates if linear_before_reset else gates.ravel()[:batch * 2 * hidden].reshape(batch, 2 * hidden)
    for step in range(first, first + count):
        t = seq - 1 - step if reverse else step
        if multiply:  # (else the caller computed the step's product into gates)
            if linear_before_reset:
                np.dot(h, r.T, gates)
            else:
                np.dot(h, rz.T, zr)
        for b in range(batch):  # update and reset gates, and the reset rows
            g = zr[b]
            for j in range(2 * hidden):
                g[j] += xw[t, b, j] + wb[j] + rb[j]
            _apply(acts[0], g[:2 * hidden], alpha[0], beta[0], clip)
            for j in range(hidden):
                reset[b, j] = g[hidden + j] * h[b, j]
        if not linear_before_reset:
            np.dot(reset, rh.T, product)
        for b in range(batch):
            if t >= lens[b]:
                y[t, d, b, :] = 0
                continue
            g = zr[b]
            if linear_before_reset:
                cand = gates[b, 2 * hidden:]
                for j in range(hidden):
                    cand[j] = xw[t, b, 2 * hidden + j] + wb[2 * hidden + j] + g[hidden + j] * (cand[j] + rb[2 * hidden + j])
            else:
                cand = product[b, :]
                for j in range(hidden):
                    cand[j] = xw[t, b, 2 * hidden + j] + wb[2 * hidden + j] + cand[j] + rb[2 * hidden + j]
            _apply(acts[1], cand, alpha[1], beta[1], clip)
            for j in range(hidden):
                v = cand[j] - g[j] * cand[j] + g[j] * h[b, j]
                h[b, j] = v
                y[t, d, b, j] = v
    if first + count == seq:
        _zero_empty(lens, h)


@njit(_signatures("lstm"), **_opts)
def lstm(xw, bias, r, lens, h, y, d, reverse, acts, alpha, beta, clip, first, count, multiply, gates, p, c):
    """Gates in ONNX's order: input, output, forget, cell; ``bias`` the input and recurrent
    biases summed; ``p`` the peepholes (input, output, forget); ``c`` the cell state, updated in
    place."""
    seq, batch, hidden = xw.shape[0], h.shape[0], h.shape[1]
    for step in range(first, first + count):
        t = seq - 1 - step if reverse else step
        if multiply:
            np.dot(h, r.T, gates)
        for b in range(batch):
            if t >= lens[b]:
                y[t, d, b, :] = 0
                continue
            g = gates[b]
            _add_input(g, xw[t, b], bias)
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
    if first + count == seq:
        _zero_empty(lens, h)
        _zero_empty(lens, c)
