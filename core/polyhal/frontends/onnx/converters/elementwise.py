"""Elementwise ONNX ops: arithmetic, comparisons, logic, unary math and activations.

ONNX and polyhal agree on numpy broadcasting and on refusing mixed element types, so most ops
map one to one. Activations that polyhal has no op for are composed from ops it has (so they
run on every device that has those); integer division and integer powers go through float64,
which is exact for the magnitudes where the results are defined.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters import NodeContext, converter
from polyhal.frontends.onnx.errors import OnnxUnsupportedError
from polyhal.frontends.onnx.types import np_dtype

_F64 = np.dtype(np.float64)

_BINARY = {
    "Add": "add", "Sub": "sub", "Mul": "mul", "Equal": "equal", "Less": "less", "Greater": "greater",
    "LessOrEqual": "less_equal", "GreaterOrEqual": "greater_equal", "And": "logical_and",
    "Or": "logical_or", "Xor": "logical_xor", "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or",
    "BitwiseXor": "bitwise_xor",
}

_UNARY = {
    "Abs": "abs", "Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Tanh": "tanh", "Relu": "relu",
    "Sigmoid": "sigmoid", "Erf": "erf", "Sin": "sin", "Cos": "cos", "Tan": "tan", "Asin": "asin",
    "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh", "Asinh": "asinh", "Acosh": "acosh",
    "Atanh": "atanh", "Floor": "floor", "Ceil": "ceil", "Round": "round", "Sign": "sign",
    "Reciprocal": "reciprocal", "IsNaN": "isnan", "Not": "logical_not", "BitwiseNot": "bitwise_not",
}


@converter(*_BINARY)
def _binary(ctx: NodeContext) -> list:
    return [ctx.op(_BINARY[ctx.op_type], ctx.input(0), ctx.input(1))]


@converter(*_UNARY)
def _unary(ctx: NodeContext) -> list:
    return [ctx.op(_UNARY[ctx.op_type], ctx.input(0))]


def cast(ctx: NodeContext, x, dtype) -> object:
    """``x`` as ``dtype`` (no op when it already is)."""
    dtype = np.dtype(dtype)
    return x if ctx.dtype(x) == dtype else ctx.op("cast", x, dtype=str(dtype))


@converter("Div")
def _div(ctx: NodeContext) -> list:
    a, b = ctx.input(0), ctx.input(1)
    dt = ctx.dtype(a)
    if dt.kind == "f":
        return [ctx.op("div", a, b)]
    # Integer division truncates toward zero (C, and ONNX's reference); float64 holds the
    # operands exactly up to 2**53. A zero divisor gives inf/nan, which the strict cast refuses
    # (onnxruntime: "Integer division by zero").
    q = ctx.op("div", cast(ctx, a, _F64), cast(ctx, b, _F64))
    return [ctx.op("cast", q, dtype=str(dt), strict=True)]


@converter("Pow")
def _pow(ctx: NodeContext) -> list:
    x, y = ctx.input(0), ctx.input(1)
    dt = ctx.dtype(x)
    if dt.kind == "f":
        return [ctx.op("pow", x, cast(ctx, y, dt))]
    r = ctx.op("pow", cast(ctx, x, _F64), cast(ctx, y, _F64))
    return [cast(ctx, r, dt)]


@converter("Mod")
def _mod(ctx: NodeContext) -> list:
    fmod = int(ctx.attr("fmod", 0))
    a, b = ctx.input(0), ctx.input(1)
    if ctx.dtype(a).kind == "f" and not fmod:
        # Floored: C's fmod moved by b where it is nonzero and its sign differs from b's; a zero
        # takes b's sign (0 * sign(b)). nan and inf cases come out of fmod as ONNX defines them.
        r = ctx.op("mod", a, b, fmod=True)
        zero = ctx.scalar(0, ctx.dtype(a))
        differ = ctx.op("not_equal", ctx.op("less", r, zero), ctx.op("less", b, zero))
        moved = ctx.op("where", ctx.op("logical_and", differ, ctx.op("not_equal", r, zero)), ctx.op("add", r, b), r)
        return [ctx.op("where", ctx.op("equal", moved, zero), ctx.op("mul", zero, ctx.op("sign", b)), moved)]
    return [ctx.op("mod", a, b, fmod=bool(fmod))]


@converter("BitShift")
def _bit_shift(ctx: NodeContext) -> list:
    direction = ctx.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise OnnxUnsupportedError(f"BitShift direction must be LEFT or RIGHT, got {direction!r}")
    return [ctx.op("bit_shift", ctx.input(0), ctx.input(1), direction=direction.lower())]


def _variadic(ctx: NodeContext, op: str):
    xs = [x for x in ctx.inputs() if x is not None]
    if not xs:
        raise OnnxUnsupportedError(f"{ctx.op_type} needs at least one input")
    acc = xs[0]
    for x in xs[1:]:
        acc = ctx.op(op, acc, x)
    return acc, len(xs)


@converter("Max")
def _max(ctx: NodeContext) -> list:
    return [_variadic(ctx, "maximum")[0]]


@converter("Min")
def _min(ctx: NodeContext) -> list:
    return [_variadic(ctx, "minimum")[0]]


@converter("Sum")
def _sum(ctx: NodeContext) -> list:
    return [_variadic(ctx, "add")[0]]


@converter("Mean")
def _mean(ctx: NodeContext) -> list:
    acc, n = _variadic(ctx, "add")
    return [ctx.op("div", acc, ctx.scalar(n, ctx.dtype(acc))) if n > 1 else acc]


@converter("IsInf")
def _isinf(ctx: NodeContext) -> list:
    x = ctx.input(0)
    neg, pos = int(ctx.attr("detect_negative", 1)), int(ctx.attr("detect_positive", 1))
    inf = ctx.op("isinf", x)
    zero = ctx.scalar(0, ctx.dtype(x))
    if neg and pos:
        return [inf]
    if not neg and not pos:
        return [ctx.op("logical_and", inf, ctx.scalar(False, bool))]
    side = ctx.op("greater" if pos else "less", x, zero)
    return [ctx.op("logical_and", inf, side)]


@converter("Clip")
def _clip(ctx: NodeContext) -> list:
    x = ctx.input(0)
    dt = ctx.dtype(x)
    if ctx.opset < 11:
        lo = ctx.scalar(ctx.attr("min"), dt) if ctx.has_attr("min") else None
        hi = ctx.scalar(ctx.attr("max"), dt) if ctx.has_attr("max") else None
    else:
        lo, hi = ctx.input(1), ctx.input(2)
    for bound, op in ((lo, "maximum"), (hi, "minimum")):
        if bound is not None:
            if ctx.type(bound).size == 1 and ctx.rank(bound) > 0:
                bound = ctx.op("reshape", bound, shape=[])
            x = ctx.op(op, x, cast(ctx, bound, dt))
    return [x]


@converter("Where")
def _where(ctx: NodeContext) -> list:
    return [ctx.op("where", ctx.input(0), ctx.input(1), ctx.input(2))]


@converter("Cast")
def _cast(ctx: NodeContext) -> list:
    x = ctx.input(0)
    to = np_dtype(int(ctx.attr("to")), "Cast's target type")
    return [cast(ctx, x, to) if ctx.dtype(x) != to else ctx.op("identity", x)]


@converter("BitCast")
def _bitcast(ctx: NodeContext) -> list:
    to = np_dtype(int(ctx.attr("to")), "BitCast's target type")
    return [ctx.op("bitcast", ctx.input(0), dtype=str(to))]


@converter("CastLike")
def _cast_like(ctx: NodeContext) -> list:
    x, like = ctx.input(0), ctx.input(1)
    return [cast(ctx, x, ctx.dtype(like))]


# ----------------------------------------------------------------------------- activations

def _c(ctx: NodeContext, x, value):
    return ctx.scalar(value, ctx.dtype(x))


@converter("LeakyRelu")
def _leaky_relu(ctx: NodeContext) -> list:
    x = ctx.input(0)
    alpha = float(ctx.attr("alpha", 0.01))
    return [ctx.op("where", ctx.op("less", x, _c(ctx, x, 0)), ctx.op("mul", x, _c(ctx, x, alpha)), x)]


@converter("PRelu")
def _prelu(ctx: NodeContext) -> list:
    x, slope = ctx.input(0), ctx.input(1)
    return [ctx.op("where", ctx.op("less", x, _c(ctx, x, 0)), ctx.op("mul", x, slope), x)]


@converter("Elu")
def _elu(ctx: NodeContext) -> list:
    x = ctx.input(0)
    alpha = float(ctx.attr("alpha", 1.0))
    neg = ctx.op("mul", ctx.op("sub", ctx.op("exp", x), _c(ctx, x, 1)), _c(ctx, x, alpha))
    return [ctx.op("where", ctx.op("less", x, _c(ctx, x, 0)), neg, x)]


@converter("Selu")
def _selu(ctx: NodeContext) -> list:
    x = ctx.input(0)
    alpha = float(ctx.attr("alpha", 1.67326319217681884765625))
    gamma = float(ctx.attr("gamma", 1.05070102214813232421875))
    neg = ctx.op("sub", ctx.op("mul", ctx.op("exp", x), _c(ctx, x, alpha)), _c(ctx, x, alpha))
    return [ctx.op("mul", ctx.op("where", ctx.op("less_equal", x, _c(ctx, x, 0)), neg, x), _c(ctx, x, gamma))]


@converter("Celu")
def _celu(ctx: NodeContext) -> list:
    x = ctx.input(0)
    alpha = float(ctx.attr("alpha", 1.0))
    e = ctx.op("sub", ctx.op("exp", ctx.op("div", x, _c(ctx, x, alpha))), _c(ctx, x, 1))
    neg = ctx.op("minimum", ctx.op("mul", e, _c(ctx, x, alpha)), _c(ctx, x, 0))
    return [ctx.op("add", ctx.op("relu", x), neg)]


def _hard_sigmoid(ctx: NodeContext, x, alpha: float, beta: float):
    y = ctx.op("add", ctx.op("mul", x, _c(ctx, x, alpha)), _c(ctx, x, beta))
    return ctx.op("maximum", ctx.op("minimum", y, _c(ctx, x, 1)), _c(ctx, x, 0))


@converter("HardSigmoid")
def _hardsigmoid(ctx: NodeContext) -> list:
    x = ctx.input(0)
    return [_hard_sigmoid(ctx, x, float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5)))]


@converter("HardSwish")
def _hardswish(ctx: NodeContext) -> list:
    x = ctx.input(0)
    return [ctx.op("mul", x, _hard_sigmoid(ctx, x, 1.0 / 6.0, 0.5))]


@converter("ThresholdedRelu")
def _thresholded_relu(ctx: NodeContext) -> list:
    x = ctx.input(0)
    alpha = float(ctx.attr("alpha", 1.0))
    return [ctx.op("where", ctx.op("greater", x, _c(ctx, x, alpha)), x, _c(ctx, x, 0))]


@converter("Shrink")
def _shrink(ctx: NodeContext) -> list:
    x = ctx.input(0)
    bias, lambd = float(ctx.attr("bias", 0.0)), float(ctx.attr("lambd", 0.5))
    dt = ctx.dtype(x)
    upper = ctx.op("where", ctx.op("greater", x, _c(ctx, x, lambd)), ctx.op("sub", x, _c(ctx, x, bias)), _c(ctx, x, 0))
    if dt.kind == "u":
        return [upper]
    return [ctx.op("where", ctx.op("less", x, _c(ctx, x, -lambd)), ctx.op("add", x, _c(ctx, x, bias)), upper)]


def _softplus(ctx: NodeContext, x):
    return ctx.op("log", ctx.op("add", ctx.op("exp", x), _c(ctx, x, 1)))


@converter("Softplus")
def _softplus_conv(ctx: NodeContext) -> list:
    return [_softplus(ctx, ctx.input(0))]


@converter("Softsign")
def _softsign(ctx: NodeContext) -> list:
    x = ctx.input(0)
    return [ctx.op("div", x, ctx.op("add", ctx.op("abs", x), _c(ctx, x, 1)))]


@converter("Mish")
def _mish(ctx: NodeContext) -> list:
    x = ctx.input(0)
    return [ctx.op("mul", x, ctx.op("tanh", _softplus(ctx, x)))]


@converter("Swish")
def _swish(ctx: NodeContext) -> list:
    x = ctx.input(0)
    alpha = float(ctx.attr("alpha", 1.0))
    z = x if alpha == 1.0 else ctx.op("mul", x, _c(ctx, x, alpha))
    return [ctx.op("mul", x, ctx.op("sigmoid", z))]


@converter("Gelu")
def _gelu(ctx: NodeContext) -> list:
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise OnnxUnsupportedError(f"Gelu approximate={approximate!r} (expected 'none' or 'tanh')")
    return [ctx.op("gelu", ctx.input(0), approximate=approximate)]
