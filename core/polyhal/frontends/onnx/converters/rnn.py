"""Recurrent layers (RNN, GRU, LSTM), each one op over the whole sequence
(:mod:`polyhal.ops.recurrent`): a device runs the recurrence as one loop kernel.

The converter fills in what ONNX lets a model leave out (biases, initial states and peepholes
as zeros, sequence lengths as the full length), turns ``layout=1`` into transposes, and reads
ONNX's ``activation_alpha``/``activation_beta`` lists, which hold values only for the
activations that take them, into one value per activation. ``sequence_lens`` is an operand like
any other, so a model whose lengths are an input runs from one plan.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.ops.recurrent import ACTIVATIONS, DEFAULT_ACTIVATIONS, GATES

#: ONNX's activations that read ``activation_alpha`` / ``activation_beta``, in its order.
_TAKES_ALPHA = frozenset({"leakyrelu", "thresholdedrelu", "hardsigmoid", "affine", "scaledtanh", "elu"})
_TAKES_BETA = frozenset({"hardsigmoid", "affine", "scaledtanh"})


def _activations(ctx: NodeContext, op: str, dirs: int) -> dict:
    """The op's ``activations``, ``activation_alpha`` and ``activation_beta`` attributes: one
    entry per activation."""
    names = [str(n).lower() for n in (ctx.attr("activations", None) or DEFAULT_ACTIVATIONS[op] * dirs)]
    per_dir = len(DEFAULT_ACTIVATIONS[op])
    if len(names) != per_dir * dirs:
        raise OnnxModelError(f"{ctx.op_type} needs {per_dir * dirs} activations ({per_dir} per direction), got "
                             f"{names}")
    unknown = next((n for n in names if n not in ACTIVATIONS), None)
    if unknown is not None:
        raise OnnxUnsupportedError(f"{ctx.op_type} activation {unknown!r} (polyhal has "
                                   f"{', '.join(ACTIVATIONS)})")
    alphas, betas = list(ctx.attr("activation_alpha", None) or ()), list(ctx.attr("activation_beta", None) or ())
    alpha, beta = [], []
    for n in names:
        alpha.append(float(alphas.pop(0)) if n in _TAKES_ALPHA and alphas else ACTIVATIONS[n][0])
        beta.append(float(betas.pop(0)) if n in _TAKES_BETA and betas else ACTIVATIONS[n][1])
    return {"activations": tuple(names), "activation_alpha": tuple(alpha), "activation_beta": tuple(beta)}


@converter("RNN", "GRU", "LSTM")
def _recurrent(ctx: NodeContext) -> list:
    op = ctx.op_type.lower()
    gates = GATES[op]
    x, w, r = ctx.input(0), ctx.input(1), ctx.input(2)
    direction = ctx.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise OnnxModelError(f"{ctx.op_type} direction {direction!r} (ONNX has forward, reverse, bidirectional)")
    if op == "lstm" and int(ctx.attr("input_forget", 0)):
        raise OnnxUnsupportedError("LSTM input_forget=1 (coupled input and forget gates)")
    dirs = 2 if direction == "bidirectional" else 1
    dt = ctx.dtype(x)
    layout = int(ctx.attr("layout", 0))
    if layout:  # (batch, seq, input) -> (seq, batch, input)
        x = ctx.op("transpose", x, perm=[1, 0, 2])
    seq, batch, _ = ctx.shape(x)
    hidden = ctx.shape(r)[-1]
    if ctx.has_attr("hidden_size") and int(ctx.attr("hidden_size")) != hidden:
        raise OnnxModelError(f"{ctx.op_type} hidden_size={ctx.attr('hidden_size')} but R is {list(ctx.shape(r))}")
    zeros = lambda *shape: np.zeros(shape, dt)  # noqa: E731
    b = ctx.input(3) if ctx.has(3) else zeros(dirs, 2 * gates * hidden)
    lens = ctx.input(4)
    if lens is None:
        lens = ctx.full((batch,), seq, np.int32)
    elif isinstance(lens, np.ndarray):
        lens = lens.reshape(-1)
        if lens.shape != (batch,) or (lens < 0).any() or (lens > seq).any():
            raise OnnxModelError(f"{ctx.op_type}: sequence_lens must hold {batch} lengths from 0 to {seq}, got "
                                 f"{lens.tolist()}")
        lens = lens.astype(np.int32)
    elif ctx.dtype(lens) != np.int32:
        lens = ctx.op("cast", lens, dtype=np.int32)

    def state(i: int):
        """Initial state ``i`` as (dirs, batch, hidden): zeros where omitted."""
        if not ctx.has(i):
            return ctx.full((dirs, batch, hidden), 0, dt)
        return ctx.op("transpose", ctx.input(i), perm=[1, 0, 2]) if layout else ctx.input(i)

    operands = [x, w, r, b, lens, state(5)]
    if op == "lstm":
        operands += [state(6), ctx.input(7) if ctx.has(7) else zeros(dirs, 3 * hidden)]
    attrs = _activations(ctx, op, dirs)
    clip = ctx.attr("clip", None)
    if clip is not None and not float(clip) > 0:
        raise OnnxModelError(f"{ctx.op_type} clip={clip}: a clip threshold is > 0")
    attrs.update(direction=direction, clip=float(clip or 0.0))
    if op == "gru":
        attrs["linear_before_reset"] = int(ctx.attr("linear_before_reset", 0))
    outs = list(ctx.op(op, *operands, **attrs))
    if layout:
        outs = [ctx.op("transpose", outs[0], perm=[2, 0, 1, 3])] + [ctx.op("transpose", o, perm=[1, 0, 2])
                                                                     for o in outs[1:]]
    return outs
