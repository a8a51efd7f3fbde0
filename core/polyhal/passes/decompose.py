"""Decompose ops that no compile-time device has a kernel for into core ops every backend has.

``dynamic_quantize`` (ONNX's DynamicQuantizeLinear) becomes its two reductions and elementwise
ops, ``squared_distances`` its differences, squares and sum. Recurrent layers are the larger case:

A recurrent layer (``rnn``, ``gru``, ``lstm``: :mod:`polyhal.ops.recurrent`) is one op so that a
device with a loop kernel (the CPU) runs the whole sequence in one dispatch. A device without
one -- an OpenCL device, whose table has no host fallback -- would otherwise refuse the model;
for it the layer is unrolled here, before placement, into matmuls, slices, activations and
``where`` masks per step (what the ONNX front end used to emit for every device). The arithmetic
is the op's: the reference's equations, step by step.

An op is decomposed only where no device of its affinity (or of the compile) has its kernel
(:meth:`polyhal.Target.candidates`), so a device that has one always gets the single op.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import numpy as np

from polyhal.ir.program import Op, Program, Value
from polyhal.ir.types import Affinity, TensorType
from polyhal.ops import canonical_attrs, infer_types
from polyhal.ops.recurrent import ACTIVATIONS, DEFAULT_ACTIVATIONS, GATES, resolve_activations
from polyhal.passes.fusion import Fusion

__all__ = ["DECOMPOSITIONS", "decompose"]


class _Emitter:
    """Appends core ops (and constants) for one decomposed op, as a ProgramBuilder would."""

    def __init__(self, program: Program, origin: Op) -> None:
        self.program_id = origin.outputs[0].program_id
        self.base = origin.outputs[0].name
        self.affinity = origin.affinity
        self.ops: list[Op] = []
        self.constants: list[tuple[Value, np.ndarray]] = []
        self.count = itertools.count()

    def _value(self, t: TensorType) -> Value:
        return Value(t, f"{self.base}.{next(self.count)}", self.program_id)

    def const(self, data: Any, dtype: Any = None) -> Value:
        arr = np.array(data, dtype=dtype, order="C")
        arr.flags.writeable = False
        value = self._value(TensorType(arr.shape, arr.dtype))
        self.constants.append((value, arr))
        return value

    def op(self, name: str, *inputs: Value, **attrs: Any) -> Any:
        outs = tuple(self._value(t) for t in infer_types(name, tuple(v.type for v in inputs), attrs))
        self.ops.append(Op("dispatch", name, tuple(inputs), outs, canonical_attrs(attrs), self.affinity))
        return outs[0] if len(outs) == 1 else outs

    def slice(self, x: Value, start: int, end: int, axis: int) -> Value:
        return self.op("slice", x, starts=[start], ends=[end], axes=[axis], steps=[1])

    def reshape(self, x: Value, shape) -> Value:
        return x if tuple(x.type.shape) == tuple(shape) else self.op("reshape", x, shape=[int(d) for d in shape])

    def take(self, x: Value, index: int) -> Value:
        """``x[index]`` along axis 0, the axis removed."""
        return self.reshape(self.slice(x, index, index + 1, 0), x.type.shape[1:])


def _activation(e: _Emitter, name: str, alpha: float, beta: float, dt) -> Callable[[Value], Value]:
    c = lambda v: e.const(v, dt)  # noqa: E731

    def fn(x: Value) -> Value:
        if name in ("sigmoid", "tanh", "relu"):
            return e.op(name, x)
        if name == "leakyrelu":
            return e.op("where", e.op("less", x, c(0)), e.op("mul", x, c(alpha)), x)
        if name == "thresholdedrelu":
            return e.op("where", e.op("greater", x, c(alpha)), x, c(0))
        if name == "hardsigmoid":
            return e.op("maximum", e.op("minimum", e.op("add", e.op("mul", x, c(alpha)), c(beta)), c(1)), c(0))
        if name == "affine":
            return e.op("add", e.op("mul", x, c(alpha)), c(beta))
        if name == "scaledtanh":
            return e.op("mul", e.op("tanh", e.op("mul", x, c(beta))), c(alpha))
        if name == "elu":
            neg = e.op("mul", e.op("sub", e.op("exp", x), c(1)), c(alpha))
            return e.op("where", e.op("less", x, c(0)), neg, x)
        if name == "softsign":
            return e.op("div", x, e.op("add", e.op("abs", x), c(1)))
        return e.op("log", e.op("add", e.op("exp", x), c(1)))  # softplus
    assert name in ACTIVATIONS
    return fn


def _recurrent(e: _Emitter, op: Op) -> tuple[Value, ...]:
    """``op`` (rnn, gru or lstm) unrolled over its static sequence length."""
    kind, attrs = op.name, op.attr_dict
    x, w, r, b, lens, h0 = op.inputs[:6]
    c0, peep = op.inputs[6:8] if kind == "lstm" else (None, None)
    dt = x.type.dtype
    seq, batch, _ = x.type.shape
    hidden, gates = r.type.shape[-1], GATES[kind]
    direction = attrs.get("direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    acts = resolve_activations(kind, direction, attrs.get("activations", ()), attrs.get("activation_alpha", ()),
                               attrs.get("activation_beta", ()))
    per_dir = len(DEFAULT_ACTIVATIONS[kind])
    clip = float(attrs.get("clip", 0.0))
    linear_before_reset = int(attrs.get("linear_before_reset", 0))
    zero = e.const(0, dt)

    def gate(v: Value, k: int) -> Value:
        return e.slice(v, k * hidden, (k + 1) * hidden, -1)

    def clipped(v: Value) -> Value:
        return v if clip <= 0 else e.op("maximum", e.op("minimum", v, e.const(clip, dt)), e.const(-clip, dt))

    ys, hs, cs = [], [], []
    ran = e.reshape(e.op("greater", lens, e.const(0, np.int32)), (batch, 1))
    for d in range(dirs):
        f = [_activation(e, *a, dt) for a in acts[d * per_dir:(d + 1) * per_dir]]
        wd, rd, bd = e.take(w, d), e.take(r, d), e.take(b, d)
        xw = e.op("matmul", x, e.op("transpose", wd, perm=[1, 0]))  # every step's input projection at once
        wb, rb = e.slice(bd, 0, gates * hidden, 0), e.slice(bd, gates * hidden, 2 * gates * hidden, 0)
        if kind == "gru" and linear_before_reset:  # Rbh goes inside the reset product
            xw = e.op("add", xw, e.op("add", wb, e.op("concat", e.slice(rb, 0, 2 * hidden, 0),
                                                      e.const(np.zeros(hidden, dt)), axis=0)))
        else:
            xw = e.op("add", xw, e.op("add", wb, rb))
        rt = e.op("transpose", rd, perm=[1, 0])  # (hidden, gates * hidden)
        h = e.take(h0, d)
        c = e.take(c0, d) if kind == "lstm" else None
        if kind == "lstm":
            pd = e.take(peep, d)
            p_i, p_o, p_f = (gate(pd, k) for k in range(3))
        outs = []
        for step in range(seq):
            t = seq - 1 - step if direction == "reverse" or d == 1 else step
            xt = e.take(xw, t)
            if kind == "rnn":
                h_new, c_new = f[0](clipped(e.op("add", xt, e.op("matmul", h, rt)))), None
            elif kind == "gru":
                hr = e.op("matmul", h, rt)
                z = f[0](clipped(e.op("add", gate(xt, 0), gate(hr, 0))))
                rg = f[0](clipped(e.op("add", gate(xt, 1), gate(hr, 1))))
                if linear_before_reset:
                    cand = e.op("add", gate(xt, 2), e.op("mul", rg, e.op("add", gate(hr, 2), gate(rb, 2))))
                else:
                    cand = e.op("add", gate(xt, 2), e.op("matmul", e.op("mul", rg, h), gate(rt, 2)))
                cand = f[1](clipped(cand))
                h_new, c_new = e.op("add", e.op("mul", e.op("sub", e.const(1, dt), z), cand), e.op("mul", z, h)), None
            else:  # gates i, o, f, c
                g = e.op("add", xt, e.op("matmul", h, rt))
                gi, go, gf, gc = (gate(g, k) for k in range(4))
                i_ = f[0](clipped(e.op("add", gi, e.op("mul", p_i, c))))
                f_ = f[0](clipped(e.op("add", gf, e.op("mul", p_f, c))))
                c_new = e.op("add", e.op("mul", f_, c), e.op("mul", i_, f[1](clipped(gc))))
                o_ = f[0](clipped(e.op("add", go, e.op("mul", p_o, c_new))))
                h_new = e.op("mul", o_, f[2](c_new))
            # Rows past their length keep their state and output zeros.
            live = e.reshape(e.op("greater", lens, e.const(t, np.int32)), (batch, 1))
            h = e.op("where", live, h_new, h)
            if c_new is not None:
                c = e.op("where", live, c_new, c)
            outs.append(e.reshape(e.op("where", live, h, zero), (1, 1, batch, hidden)))
        if direction == "reverse" or d == 1:
            outs = outs[::-1]
        ys.append(e.op("concat", *outs, axis=0) if len(outs) > 1 else outs[0])
        hs.append(e.reshape(e.op("where", ran, h, zero), (1, batch, hidden)))
        if c is not None:
            cs.append(e.reshape(e.op("where", ran, c, zero), (1, batch, hidden)))
    joined = [v[0] if len(v) == 1 else e.op("concat", *v, axis=1 if v is ys else 0) for v in (ys, hs, cs) if v]
    return tuple(joined)


#: op name -> ``decomposition(emitter, op) -> results``.
def _dynamic_quantize(e: _Emitter, op: Op) -> tuple[Value, ...]:
    """``dynamic_quantize`` as ONNX writes DynamicQuantizeLinear's arithmetic, op by op (a tensor
    of zeros divides 0 by 0 here: its kernels give scale 0 and zero point 0 instead)."""
    x = op.inputs[0]
    zero, top = e.const(0, np.float32), e.const(255, np.float32)
    lo = e.op("minimum", e.op("reduce_min", x), zero)
    hi = e.op("maximum", e.op("reduce_max", x), zero)
    scale = e.op("div", e.op("sub", hi, lo), top)
    zp = e.op("maximum", e.op("minimum", e.op("round", e.op("sub", zero, e.op("div", lo, scale))), top), zero)
    y = e.op("maximum", e.op("minimum", e.op("add", e.op("round", e.op("div", x, scale)), zp), top), zero)
    return e.op("cast", y, dtype="uint8"), scale, e.op("cast", zp, dtype="uint8")


def _squared_distances(e: _Emitter, op: Op) -> tuple[Value, ...]:
    """``squared_distances`` from an [N, V, F] tensor of differences: sub, mul, reduce_sum."""
    x, y = op.inputs
    rows, features = x.type.shape
    d = e.op("sub", e.reshape(x, (rows, 1, features)), y)
    return (e.op("reduce_sum", e.op("mul", d, d), axes=[2], keepdims=False),)


DECOMPOSITIONS: dict[str, Callable[[_Emitter, Op], tuple[Value, ...]]] = {
    "rnn": _recurrent, "gru": _recurrent, "lstm": _recurrent, "dynamic_quantize": _dynamic_quantize,
    "squared_distances": _squared_distances,
}


def decompose(program: Program, candidates: Callable[[str, Affinity | None], list[str]]) -> tuple[Program, list[Fusion]]:
    """Decompose ops that no device has a kernel for into core ops.

    ``candidates(op name, affinity)`` lists the devices with a kernel for the op. Returns the
    program and a record per decomposed op (Fusion records of kind ``"decompose"``, for explain).
    """
    if not any(op.kind == "dispatch" and op.name in DECOMPOSITIONS for op in program.ops):
        return program, []
    ops, constants, records = [], list(program.constants), []
    rename: dict[int, Value] = {}
    for op in program.ops:
        if rename:
            op = dataclasses.replace(op, inputs=tuple(rename.get(v.id, v) for v in op.inputs))
        if op.kind != "dispatch" or op.name not in DECOMPOSITIONS or candidates(op.name, op.affinity):
            ops.append(op)
            continue
        e = _Emitter(program, op)
        results = DECOMPOSITIONS[op.name](e, op)
        for old, new in zip(op.outputs, results):
            rename[old.id] = new
        ops.extend(e.ops)
        constants.extend(e.constants)
        records.append(Fusion("decompose", (op,), tuple(e.ops)))
    outputs = [rename.get(v.id, v) for v in program.outputs]
    return dataclasses.replace(program, ops=ops, outputs=outputs, constants=constants), records
