"""Recurrent layers: ``rnn``, ``gru`` and ``lstm`` (ONNX RNN, GRU, LSTM), each one op over the whole
sequence.

Operands (ONNX's, sequence first; ONNX's ``layout=1`` is a transpose in the front end):

* ``x`` ``[seq, batch, input]``; ``w`` ``[dirs, gates * hidden, input]``; ``r`` ``[dirs, gates *
  hidden, hidden]``; ``b`` ``[dirs, 2 * gates * hidden]`` (the input bias, then the recurrent one);
* ``lens`` int32 ``[batch]``: each row's sequence length (0 to ``seq``). A row runs its first
  ``lens`` steps (the last ``lens`` backwards in the reverse direction); its outputs after them are
  0, and its final state is the state after its last step -- 0 for a row of length 0, as
  onnxruntime gives;
* ``h0`` ``[dirs, batch, hidden]``; for ``lstm`` also ``c0`` ``[dirs, batch, hidden]`` and the
  peepholes ``p`` ``[dirs, 3 * hidden]`` (input, output, forget).

Results: ``y`` ``[seq, dirs, batch, hidden]``, ``y_h`` ``[dirs, batch, hidden]``, and for ``lstm``
``y_c``. ``gates`` is 1 (rnn: ``h = f(x W + h R + b)``), 3 (gru: update z, reset r, hidden; with
``linear_before_reset`` the recurrent product of the hidden gate is taken before the reset gate
scales it), 4 (lstm: input, output, forget, cell). ``dirs`` is 2 for ``direction="bidirectional"``
(the forward pass, then the reverse one), else 1.

``activations`` names the per-direction activations (rnn one, gru two, lstm three; empty: ONNX's
defaults, sigmoid and tanh), one of :data:`ACTIVATIONS`, with ``activation_alpha`` and
``activation_beta`` one value per activation (empty: each activation's default; an activation
without a parameter ignores its value). ``clip`` (> 0) clips the gate pre-activations to
``[-clip, clip]``; 0 does not clip.
"""

from __future__ import annotations

import math

import numpy as np

from polyhal.errors import DTypeError, ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import FLOAT, check_dtype, define, float_attr, fmt_shape, nonzero, pick

__all__ = ["ACTIVATIONS", "DEFAULT_ACTIVATIONS", "GATES", "activate", "resolve_activations"]

#: Gate count per op.
GATES = {"rnn": 1, "gru": 3, "lstm": 4}
#: Each op's activations per direction when none are given (ONNX's defaults).
DEFAULT_ACTIVATIONS = {"rnn": ("tanh",), "gru": ("sigmoid", "tanh"), "lstm": ("sigmoid", "tanh", "tanh")}
#: The activations ONNX names for recurrent layers, lower-case, with their default (alpha, beta);
#: a kernel encodes one by its index here.
ACTIVATIONS = {
    "sigmoid": (0.0, 0.0), "tanh": (0.0, 0.0), "relu": (0.0, 0.0), "leakyrelu": (0.01, 0.0),
    "thresholdedrelu": (1.0, 0.0), "hardsigmoid": (0.2, 0.5), "affine": (1.0, 0.0), "scaledtanh": (1.0, 1.0),
    "elu": (1.0, 0.0), "softsign": (0.0, 0.0), "softplus": (0.0, 0.0),
}


def activate(name: str, x: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """Activation ``name`` (of :data:`ACTIVATIONS`) of ``x``, as ONNX defines it."""
    if name == "sigmoid":
        return 1.0 / (1.0 + np.exp(-x))
    if name == "tanh":
        return np.tanh(x)
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "leakyrelu":
        return np.where(x < 0, alpha * x, x)
    if name == "thresholdedrelu":
        return np.where(x > alpha, x, 0.0)
    if name == "hardsigmoid":
        return np.clip(alpha * x + beta, 0.0, 1.0)
    if name == "affine":
        return alpha * x + beta
    if name == "scaledtanh":
        return alpha * np.tanh(beta * x)
    if name == "elu":
        return np.where(x < 0, alpha * (np.exp(x) - 1.0), x)
    if name == "softsign":
        return x / (1.0 + np.abs(x))
    return np.log1p(np.exp(x))  # softplus


def resolve_activations(op: str, direction: str, activations, alpha, beta) -> list[tuple[str, float, float]]:
    """``(name, alpha, beta)`` of every activation of ``op``'s attributes, direction by direction;
    a ProgramError for a count or a name that does not fit."""
    dirs = 2 if direction == "bidirectional" else 1
    names = tuple(str(a).lower() for a in activations) or DEFAULT_ACTIVATIONS[op] * dirs
    want = len(DEFAULT_ACTIVATIONS[op]) * dirs
    if len(names) != want:
        raise ProgramError(f"needs {want} activations ({len(DEFAULT_ACTIVATIONS[op])} per direction), got "
                           f"{list(names)}")
    unknown = [n for n in names if n not in ACTIVATIONS]
    if unknown:
        raise ProgramError(f"activation {unknown[0]!r} is not one of {', '.join(ACTIVATIONS)}")
    for values, what in ((alpha, "activation_alpha"), (beta, "activation_beta")):
        if len(values) not in (0, want):
            raise ProgramError(f"{what} needs one value per activation ({want}) or none, got {list(values)}")
    return [(n, float(alpha[i]) if len(alpha) else ACTIVATIONS[n][0],
             float(beta[i]) if len(beta) else ACTIVATIONS[n][1]) for i, n in enumerate(names)]


def _infer(op: str):
    gates = GATES[op]

    def infer(x: TensorType, w: TensorType, r: TensorType, b: TensorType, lens: TensorType, h0: TensorType,
              *cell, direction, activations, activation_alpha, activation_beta, clip, **extra):
        check_dtype(x, FLOAT)
        if direction not in ("forward", "reverse", "bidirectional"):
            raise ProgramError(f"direction must be 'forward', 'reverse' or 'bidirectional', got {direction!r}")
        resolve_activations(op, direction, activations, activation_alpha, activation_beta)
        if float_attr(clip, "clip") < 0:
            raise ProgramError(f"clip must be > 0 (or 0: no clipping), got {clip}")
        if x.rank != 3:
            raise ShapeError(f"x must be [seq, batch, input], got {fmt_shape(x.shape)}")
        seq, batch, features = x.shape
        dirs = 2 if direction == "bidirectional" else 1
        hidden = r.shape[-1] if r.rank == 3 else None
        want = {"w": (w, (dirs, gates * hidden, features)), "r": (r, (dirs, gates * hidden, hidden)),
                "b": (b, (dirs, 2 * gates * hidden)), "h0": (h0, (dirs, batch, hidden))}
        if cell:
            want.update(c0=(cell[0], (dirs, batch, hidden)), p=(cell[1], (dirs, 3 * hidden)))
        for name, (t, shape) in want.items():
            if hidden is None or tuple(t.shape) != shape or t.dtype != x.dtype:
                raise ShapeError(f"{name} must be {x.dtype} {fmt_shape(shape) if hidden else '[dirs, ...]'} for x "
                                 f"{x} and direction {direction!r}, got {t}")
        if lens.dtype != np.dtype(np.int32) or tuple(lens.shape) != (batch,):
            raise DTypeError(f"lens must be int32 [{batch}], got {lens}")
        if op == "gru" and extra["linear_before_reset"] not in (0, 1, False, True):
            raise ProgramError(f"linear_before_reset must be 0 or 1, got {extra['linear_before_reset']!r}")
        state = TensorType((dirs, batch, hidden), x.dtype)
        return (TensorType((seq, dirs, batch, hidden), x.dtype), state) + ((state,) if op == "lstm" else ())
    return infer


def recurrence(op: str, x, w, r, b, lens, h0, c0=None, p=None, *, direction="forward", activations=(),
               activation_alpha=(), activation_beta=(), clip=0.0, linear_before_reset=0):
    """The reference: every step in float64, as ONNX writes the equations."""
    dt = x.dtype
    x, w, r, b, h0 = (np.asarray(a, np.float64) for a in (x, w, r, b, h0))
    seq, batch, _ = x.shape
    hidden = r.shape[-1]
    gates = GATES[op]
    per_dir = len(DEFAULT_ACTIVATIONS[op])
    acts = resolve_activations(op, direction, activations, activation_alpha, activation_beta)
    dirs = 2 if direction == "bidirectional" else 1
    lens = np.asarray(lens).astype(np.int64)
    y = np.zeros((seq, dirs, batch, hidden))
    y_h = np.zeros((dirs, batch, hidden))
    y_c = np.zeros((dirs, batch, hidden))

    def cut(v):
        return np.clip(v, -clip, clip) if clip > 0 else v

    for d in range(dirs):
        f = [lambda v, a=a: activate(a[0], v, a[1], a[2]) for a in acts[d * per_dir:(d + 1) * per_dir]]
        wb, rb = b[d, :gates * hidden], b[d, gates * hidden:]
        h = h0[d].copy()
        c = np.asarray(c0[d], np.float64).copy() if op == "lstm" else None
        pi, po, pf = np.asarray(p[d], np.float64).reshape(3, hidden) if op == "lstm" else (0, 0, 0)
        steps = range(seq - 1, -1, -1) if direction == "reverse" or d == 1 else range(seq)
        for t in steps:
            live = (lens > t).reshape(batch, 1)
            xt = x[t] @ w[d].T + wb
            if op == "rnn":
                h_new = f[0](cut(xt + h @ r[d].T + rb))
            elif op == "gru":
                hr = h @ r[d].T + rb
                z = f[0](cut(xt[:, :hidden] + hr[:, :hidden]))
                rg = f[0](cut(xt[:, hidden:2 * hidden] + hr[:, hidden:2 * hidden]))
                if linear_before_reset:
                    cand = xt[:, 2 * hidden:] + rg * hr[:, 2 * hidden:]
                else:
                    cand = xt[:, 2 * hidden:] + (rg * h) @ r[d, 2 * hidden:].T + rb[2 * hidden:]
                cand = f[1](cut(cand))
                h_new = (1 - z) * cand + z * h
            else:
                g = xt + h @ r[d].T + rb
                gi, go, gf, gc = (g[:, k * hidden:(k + 1) * hidden] for k in range(4))
                i_ = f[0](cut(gi + pi * c))
                f_ = f[0](cut(gf + pf * c))
                c_new = f_ * c + i_ * f[1](cut(gc))
                o_ = f[0](cut(go + po * c_new))
                h_new = o_ * f[2](c_new)
                c = np.where(live, c_new, c)
            h = np.where(live, h_new, h)
            y[t, d] = np.where(live, h, 0.0)
        ran = (lens > 0).reshape(batch, 1)
        y_h[d] = np.where(ran, h, 0.0)
        if op == "lstm":
            y_c[d] = np.where(ran, c, 0.0)
    out = (y.astype(dt), y_h.astype(dt))
    return out + ((y_c.astype(dt),) if op == "lstm" else ())


def _ref_rnn(x, w, r, b, lens, h0, *, direction="forward", activations=(), activation_alpha=(), activation_beta=(),
             clip=0.0):
    return recurrence("rnn", x, w, r, b, lens, h0, direction=direction, activations=activations,
                      activation_alpha=activation_alpha, activation_beta=activation_beta, clip=clip)


def _ref_gru(x, w, r, b, lens, h0, *, direction="forward", activations=(), activation_alpha=(), activation_beta=(),
             clip=0.0, linear_before_reset=0):
    return recurrence("gru", x, w, r, b, lens, h0, direction=direction, activations=activations,
                      activation_alpha=activation_alpha, activation_beta=activation_beta, clip=clip,
                      linear_before_reset=linear_before_reset)


def _ref_lstm(x, w, r, b, lens, h0, c0, p, *, direction="forward", activations=(), activation_alpha=(),
              activation_beta=(), clip=0.0):
    return recurrence("lstm", x, w, r, b, lens, h0, c0, p, direction=direction, activations=activations,
                      activation_alpha=activation_alpha, activation_beta=activation_beta, clip=clip)


def _sample(op: str):
    gates = GATES[op]

    def sample(rng: np.random.Generator):
        seq, batch, features, hidden = int(rng.integers(1, 6)), int(rng.integers(1, 4)), 5, 4
        direction = pick(rng, ["forward", "reverse", "bidirectional"])
        dirs = 2 if direction == "bidirectional" else 1
        scale = 1 / math.sqrt(hidden)
        ins = [nonzero(rng, (seq, batch, features)), rng.uniform(-scale, scale, (dirs, gates * hidden, features)),
               rng.uniform(-scale, scale, (dirs, gates * hidden, hidden)), rng.uniform(-0.1, 0.1, (dirs, 2 * gates * hidden)),
               rng.integers(0, seq + 1, batch), rng.uniform(-0.5, 0.5, (dirs, batch, hidden))]
        if op == "lstm":
            ins += [rng.uniform(-0.5, 0.5, (dirs, batch, hidden)), rng.uniform(-0.5, 0.5, (dirs, 3 * hidden))]
        ins = [a.astype(np.int32) if i == 4 else np.asarray(a, np.float32) for i, a in enumerate(ins)]
        attrs = {"direction": direction, "clip": pick(rng, [0.0, 3.0])}
        if op == "gru":
            attrs["linear_before_reset"] = int(rng.integers(0, 2))
        return ins, attrs
    return sample


_DOC = "ONNX's {}: the whole sequence in one op (see polyhal.ops.recurrent for operands and attributes)."
define("rnn", infer=_infer("rnn"), reference=_ref_rnn, sample=_sample("rnn"), arity=6, tolerance=(1e-4, 1e-5),
       doc=_DOC.format("RNN"))
define("gru", infer=_infer("gru"), reference=_ref_gru, sample=_sample("gru"), arity=6, tolerance=(1e-4, 1e-5),
       doc=_DOC.format("GRU"))
define("lstm", infer=_infer("lstm"), reference=_ref_lstm, sample=_sample("lstm"), arity=8, tolerance=(1e-4, 1e-5),
       doc=_DOC.format("LSTM"))
