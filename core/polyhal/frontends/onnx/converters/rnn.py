"""Recurrent layers (RNN, GRU, LSTM), unrolled over the static sequence length (rows with a
shorter ``sequence_lens`` masked after their last step).

The input projection of every step is one matmul over the whole sequence; each step then adds
the recurrent projection and applies the gates, with the activations ONNX names (``Sigmoid``,
``Tanh``, ``Relu``, ``LeakyRelu``, ``HardSigmoid``, ``Affine``, ``ScaledTanh``, ``Elu``,
``Softsign``, ``Softplus``, ``ThresholdedRelu``) composed from polyhal ops.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.tensor import reshape
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError

_DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def _activation(ctx: NodeContext, name: str, alpha: float | None, beta: float | None):
    dt = None

    def c(x, v):
        return ctx.scalar(v, ctx.dtype(x))

    key = name.lower()

    def fn(x):
        if key == "sigmoid":
            return ctx.op("sigmoid", x)
        if key == "tanh":
            return ctx.op("tanh", x)
        if key == "relu":
            return ctx.op("relu", x)
        if key == "leakyrelu":
            a = 0.01 if alpha is None else alpha
            return ctx.op("where", ctx.op("less", x, c(x, 0)), ctx.op("mul", x, c(x, a)), x)
        if key == "thresholdedrelu":
            a = 1.0 if alpha is None else alpha
            return ctx.op("where", ctx.op("greater", x, c(x, a)), x, c(x, 0))
        if key == "hardsigmoid":
            a, b = (0.2 if alpha is None else alpha), (0.5 if beta is None else beta)
            y = ctx.op("add", ctx.op("mul", x, c(x, a)), c(x, b))
            return ctx.op("maximum", ctx.op("minimum", y, c(x, 1)), c(x, 0))
        if key == "affine":
            a, b = (1.0 if alpha is None else alpha), (0.0 if beta is None else beta)
            return ctx.op("add", ctx.op("mul", x, c(x, a)), c(x, b))
        if key == "scaledtanh":
            a, b = (1.0 if alpha is None else alpha), (1.0 if beta is None else beta)
            return ctx.op("mul", ctx.op("tanh", ctx.op("mul", x, c(x, b))), c(x, a))
        if key == "elu":
            a = 1.0 if alpha is None else alpha
            neg = ctx.op("mul", ctx.op("sub", ctx.op("exp", x), c(x, 1)), c(x, a))
            return ctx.op("where", ctx.op("less", x, c(x, 0)), neg, x)
        if key == "softsign":
            return ctx.op("div", x, ctx.op("add", ctx.op("abs", x), c(x, 1)))
        if key == "softplus":
            return ctx.op("log", ctx.op("add", ctx.op("exp", x), c(x, 1)))
        raise OnnxUnsupportedError(f"{ctx.op_type} activation {name!r}")
    del dt
    return fn


def _gate(ctx: NodeContext, v, k: int, hidden: int):
    """Gate ``k`` (of size ``hidden``) of the last axis of ``v``."""
    return ctx.op("slice", v, starts=[k * hidden], ends=[(k + 1) * hidden], axes=[-1], steps=[1])


def _step_input(ctx: NodeContext, xw, t: int):
    """The input projection of step ``t``: ``xw[t]`` as (batch, gates*hidden)."""
    shape = ctx.shape(xw)
    return reshape(ctx, ctx.op("slice", xw, starts=[t], ends=[t + 1], axes=[0], steps=[1]), shape[1:])


@converter("RNN", "GRU", "LSTM")
def _recurrent(ctx: NodeContext) -> list:
    kind = ctx.op_type
    x, w, r, b = ctx.input(0), ctx.input(1), ctx.input(2), ctx.input(3)
    seq_lens = ctx.const(4, "the sequence lengths")
    h0 = ctx.input(5)
    c0 = ctx.input(6) if kind == "LSTM" else None
    peep = ctx.input(7) if kind == "LSTM" else None
    hidden = int(ctx.attr("hidden_size"))
    direction = ctx.attr("direction", "forward")
    layout = int(ctx.attr("layout", 0))
    clip = ctx.attr("clip", None)
    if kind == "LSTM" and int(ctx.attr("input_forget", 0)):
        raise OnnxUnsupportedError("LSTM input_forget=1")
    dirs = 2 if direction == "bidirectional" else 1
    if direction not in ("forward", "reverse", "bidirectional"):
        raise OnnxModelError(f"direction {direction!r}")
    dt = ctx.dtype(x)
    if layout:  # (batch, seq, input) -> (seq, batch, input)
        x = ctx.op("transpose", x, perm=[1, 0, 2])
    seq, batch, _ = ctx.shape(x)
    # Rows shorter than the sequence keep their state after their last step and output zeros
    # there (ONNX, onnxruntime): a per-step mask, a constant, where the lengths are known.
    lengths = None if seq_lens is None else np.asarray(seq_lens).reshape(-1).astype(np.int64)
    if lengths is not None:
        if lengths.shape != (batch,) or (lengths < 0).any() or (lengths > seq).any():
            raise OnnxModelError(f"{kind}: sequence_lens must hold {batch} lengths from 0 to {seq}, got "
                                 f"{lengths.tolist()}")
        if (lengths == seq).all():
            lengths = None
    names = ctx.attr("activations", None) or _DEFAULT_ACTIVATIONS[kind] * dirs
    alphas = ctx.attr("activation_alpha", None)
    betas = ctx.attr("activation_beta", None)
    per_dir = len(_DEFAULT_ACTIVATIONS[kind])
    if len(names) != per_dir * dirs:
        raise OnnxModelError(f"{kind} needs {per_dir * dirs} activations, got {names}")
    # alpha/beta lists cover only the activations that take them, in order.
    fns, ai, bi = [], 0, 0
    for name in names:
        takes_alpha = name.lower() in ("leakyrelu", "thresholdedrelu", "hardsigmoid", "affine", "scaledtanh", "elu")
        takes_beta = name.lower() in ("hardsigmoid", "affine", "scaledtanh")
        alpha = float(alphas[ai]) if takes_alpha and alphas and ai < len(alphas) else None
        beta = float(betas[bi]) if takes_beta and betas and bi < len(betas) else None
        ai += takes_alpha
        bi += takes_beta
        fns.append(_activation(ctx, name, alpha, beta))
    gates = _GATES[kind]
    linear_before_reset = int(ctx.attr("linear_before_reset", 0)) if kind == "GRU" else 0

    def clipped(v):
        if clip is None:
            return v
        return ctx.op("maximum", ctx.op("minimum", v, ctx.scalar(float(clip), dt)), ctx.scalar(-float(clip), dt))

    ys, hs, cs = [], [], []
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        f = fns[d * per_dir:(d + 1) * per_dir]
        wd = reshape(ctx, ctx.op("slice", w, starts=[d], ends=[d + 1], axes=[0], steps=[1]), ctx.shape(w)[1:])
        rd = reshape(ctx, ctx.op("slice", r, starts=[d], ends=[d + 1], axes=[0], steps=[1]), ctx.shape(r)[1:])
        # The input projection of all steps at once: (seq, batch, in) @ (in, gates*hidden).
        xw = ctx.op("matmul", x, ctx.op("transpose", wd))
        wb = rb = None
        if b is not None:
            bd = reshape(ctx, ctx.op("slice", b, starts=[d], ends=[d + 1], axes=[0], steps=[1]), ctx.shape(b)[1:])
            wb = ctx.op("slice", bd, starts=[0], ends=[gates * hidden], axes=[0], steps=[1])
            rb = ctx.op("slice", bd, starts=[gates * hidden], ends=[2 * gates * hidden], axes=[0], steps=[1])
            if not (kind == "GRU" and linear_before_reset):
                xw = ctx.op("add", xw, ctx.op("add", wb, rb))
            else:  # Rbh goes inside the reset product; Rbz and Rbr are added as usual
                rb_zr = ctx.op("concat", ctx.op("slice", rb, starts=[0], ends=[2 * hidden], axes=[0], steps=[1]),
                               np.zeros(hidden, dt), axis=0)
                xw = ctx.op("add", xw, ctx.op("add", wb, rb_zr))
        rt = ctx.op("transpose", rd)  # (hidden, gates*hidden)
        h = np.zeros((batch, hidden), dt) if h0 is None else \
            reshape(ctx, ctx.op("slice", h0, starts=[d], ends=[d + 1], axes=[0], steps=[1]), (batch, hidden))
        c = None
        if kind == "LSTM":
            c = np.zeros((batch, hidden), dt) if c0 is None else \
                reshape(ctx, ctx.op("slice", c0, starts=[d], ends=[d + 1], axes=[0], steps=[1]), (batch, hidden))
            if peep is not None:
                pd = reshape(ctx, ctx.op("slice", peep, starts=[d], ends=[d + 1], axes=[0], steps=[1]), (3 * hidden,))
                p_i, p_o, p_f = (_gate(ctx, pd, k, hidden) for k in range(3))
        outs = []
        for step in range(seq):
            t = seq - 1 - step if reverse else step
            xt = _step_input(ctx, xw, t)
            h_before, c_before = h, c
            if kind == "RNN":
                h = f[0](clipped(ctx.op("add", xt, ctx.op("matmul", h, rt))))
            elif kind == "GRU":
                hr = ctx.op("matmul", h, rt)
                z = f[0](clipped(ctx.op("add", _gate(ctx, xt, 0, hidden), _gate(ctx, hr, 0, hidden))))
                rg = f[0](clipped(ctx.op("add", _gate(ctx, xt, 1, hidden), _gate(ctx, hr, 1, hidden))))
                rh = _gate(ctx, rt, 2, hidden)
                if linear_before_reset:
                    lin = ctx.op("matmul", h, rh)
                    if rb is not None:
                        lin = ctx.op("add", lin, _gate(ctx, rb, 2, hidden))
                    cand = ctx.op("add", _gate(ctx, xt, 2, hidden), ctx.op("mul", rg, lin))
                else:
                    cand = ctx.op("add", _gate(ctx, xt, 2, hidden), ctx.op("matmul", ctx.op("mul", rg, h), rh))
                cand = f[1](clipped(cand))
                one = ctx.scalar(1, dt)
                h = ctx.op("add", ctx.op("mul", ctx.op("sub", one, z), cand), ctx.op("mul", z, h))
            else:  # LSTM, gates i, o, f, c
                g = ctx.op("add", xt, ctx.op("matmul", h, rt))
                gi, go, gf, gc = (_gate(ctx, g, k, hidden) for k in range(4))
                if peep is not None:
                    gi = ctx.op("add", gi, ctx.op("mul", p_i, c))
                    gf = ctx.op("add", gf, ctx.op("mul", p_f, c))
                i_ = f[0](clipped(gi))
                f_ = f[0](clipped(gf))
                c_ = f[1](clipped(gc))
                c = ctx.op("add", ctx.op("mul", f_, c), ctx.op("mul", i_, c_))
                if peep is not None:
                    go = ctx.op("add", go, ctx.op("mul", p_o, c))
                o_ = f[0](clipped(go))
                h = ctx.op("mul", o_, f[2](c))
            if lengths is not None and (lengths <= t).any():
                live = (lengths > t).reshape(batch, 1)
                h = ctx.op("where", live, h, h_before)
                if c is not None:
                    c = ctx.op("where", live, c, c_before)
                outs.append(ctx.op("where", live, h, np.zeros((), dt)))
            else:
                outs.append(h)
        if lengths is not None and (lengths == 0).any():
            # onnxruntime gives an empty row zeros for its final state, not its initial one.
            ran = (lengths > 0).reshape(batch, 1)
            h = ctx.op("where", ran, h, np.zeros((), dt))
            if c is not None:
                c = ctx.op("where", ran, c, np.zeros((), dt))
        if reverse:
            outs = outs[::-1]
        ys.append(ctx.op("concat", *[reshape(ctx, o, (1, 1, batch, hidden)) for o in outs], axis=0)
                  if len(outs) > 1 else reshape(ctx, outs[0], (1, 1, batch, hidden)))
        hs.append(reshape(ctx, h, (1, batch, hidden)))
        if c is not None:
            cs.append(reshape(ctx, c, (1, batch, hidden)))
    y = ys[0] if dirs == 1 else ctx.op("concat", *ys, axis=1)  # (seq, dirs, batch, hidden)
    y_h = hs[0] if dirs == 1 else ctx.op("concat", *hs, axis=0)
    y_c = (cs[0] if dirs == 1 else ctx.op("concat", *cs, axis=0)) if cs else None
    if layout:
        y = ctx.op("transpose", y, perm=[2, 0, 1, 3])  # (batch, seq, dirs, hidden)
        y_h = ctx.op("transpose", y_h, perm=[1, 0, 2])
        if y_c is not None:
            y_c = ctx.op("transpose", y_c, perm=[1, 0, 2])
    return [y, y_h] + ([y_c] if kind == "LSTM" else [])
