"""Elementwise ONNX ops: arithmetic, comparisons, logic, unary math and activations.

ONNX and polyhal agree on numpy broadcasting and on refusing mixed element types, so most ops
map one to one. Activations that polyhal has no op for are composed from ops it has (so they
run on every device that has those); integer division and integer powers go through float64,
which is exact for the magnitudes where the results are defined.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.types import np_dtype
from polyhal.ir.types import DTypeSet

_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

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


#: The float8 types, whose conversions ONNX's ``saturate`` attribute governs.
#: (Sets of ml_dtypes' types, here and below, that import ml_dtypes only once one of them can exist:
#: :class:`~polyhal.ir.types.DTypeSet`.)
_FLOAT8 = DTypeSet(("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"))


#: float8e8m0 (ml_dtypes' float8_e8m0fnu): an exponent alone, 2**(e - 127) for e in 0..254, nan
#: at 255; no sign, no zero, no inf. Conversions to it follow ``round_mode``.
_E8M0 = DTypeSet(("float8_e8m0fnu",))
_U32 = np.dtype(np.uint32)


def onnx_cast(ctx: NodeContext, x, to: np.dtype, saturate: bool = True, round_mode: str = "up") -> object:
    """``x`` converted to ``to`` as ONNX's Cast does (round to nearest even). To a float8 type
    with ``saturate`` (ONNX's default), values beyond its range, infinities included, become its
    largest finite value of their sign, by a clamp before the conversion; without it they
    become inf or nan, as the type has them. To float8e8m0, see :func:`to_e8m0`."""
    if to in _E8M0 and ctx.dtype(x) not in _E8M0:
        return to_e8m0(ctx, x, saturate, round_mode)
    if to in _FLOAT8 and saturate:
        if ctx.dtype(x) not in (_F64, _F32, _F16):
            # float32 holds every value it can matter for exactly: larger ones are clamped.
            x = cast(ctx, x, _F32)
        import ml_dtypes  # (imported already: ``to`` is one of its types)

        limit = float(ml_dtypes.finfo(to).max)
        x = ctx.op("maximum", ctx.op("minimum", x, ctx.scalar(limit, ctx.dtype(x))),
                   ctx.scalar(-limit, ctx.dtype(x)))
    return cast(ctx, x, to)


def to_e8m0(ctx: NodeContext, x, saturate: bool, round_mode: str) -> object:
    """``x`` as float8e8m0, as ONNX defines it (and onnx's reference computes it): the exponent
    of ``x`` as float32 (the sign is dropped; zero and subnormals have exponent 0, inf and nan
    become nan), rounded by ``round_mode``: "up" adds one when any mantissa bit is set, "down"
    none, "nearest" one when the guard bit is set and a lower bit or the exponent is nonzero.
    With ``saturate`` rounding stops at the largest exponent (254) instead of reaching nan.
    Integer ops on the float32 bits, so it runs wherever they do; the final reinterpretation
    as float8e8m0 needs a device with the storage types (the CPU)."""
    if round_mode not in ("up", "down", "nearest"):
        raise OnnxModelError(f"Cast's round_mode is {round_mode!r}; ONNX defines 'up', 'down' and 'nearest'")

    def u32(v):
        return ctx.scalar(v, _U32)

    def bits_set(mask):
        return ctx.op("not_equal", ctx.op("bitwise_and", bits, u32(mask)), u32(0))

    bits = ctx.op("bitcast", cast(ctx, x, _F32), dtype="uint32")
    exponent = ctx.op("bitwise_and", ctx.op("bit_shift", bits, u32(23), direction="right"), u32(0xFF))
    if round_mode == "down":
        return ctx.op("bitcast", cast(ctx, exponent, np.uint8), dtype="float8_e8m0fnu")
    if round_mode == "up":
        round_up = bits_set(0x7FFFFF)
    else:
        round_up = ctx.op("logical_and", bits_set(0x400000),
                          ctx.op("logical_or", bits_set(0x3FFFFF), ctx.op("greater", exponent, u32(0))))
    # inf/nan (255) keep their exponent; with saturate, 254 is not rounded up into nan.
    round_up = ctx.op("logical_and", round_up, ctx.op("less", exponent, u32(0xFE if saturate else 0xFF)))
    exponent = ctx.op("add", exponent, cast(ctx, round_up, _U32))
    return ctx.op("bitcast", cast(ctx, exponent, np.uint8), dtype="float8_e8m0fnu")


@converter("Cast")
def _cast(ctx: NodeContext) -> list:
    x = ctx.input(0)
    to = np_dtype(int(ctx.attr("to")), "Cast's target type")
    if ctx.dtype(x) == to:
        return [x]  # nothing to run (a graph output still gets its own value: the importer copies it)
    return [onnx_cast(ctx, x, to, bool(ctx.attr("saturate", 1)), ctx.attr("round_mode", "up"))]


@converter("BitCast")
def _bitcast(ctx: NodeContext) -> list:
    to = np_dtype(int(ctx.attr("to")), "BitCast's target type")
    return [ctx.op("bitcast", ctx.input(0), dtype=str(to))]


@converter("CastLike")
def _cast_like(ctx: NodeContext) -> list:
    x, like = ctx.input(0), ctx.input(1)
    return [onnx_cast(ctx, x, ctx.dtype(like), bool(ctx.attr("saturate", 1)), ctx.attr("round_mode", "up"))]


# ----------------------------------------------------------------------------- activations

def _c(ctx: NodeContext, x, value):
    return ctx.scalar(value, ctx.dtype(x))


@converter("LeakyRelu")
def _leaky_relu(ctx: NodeContext) -> list:
    x = ctx.input(0)
    alpha = float(ctx.attr("alpha", 0.01))
    # For 0 < alpha <= 1, max(x, alpha x) is exactly the select (x >= 0: alpha x <= x; x < 0:
    # alpha x >= x; nan, -0 and infinities pass through), for alpha > 1 min is: two elementwise
    # passes where the select costs a compare, a product and a masked copy. (alpha 0 is left to
    # the select: 0 * -inf is nan, which max would have to propagate on every backend.)
    if alpha > 0.0:
        return [ctx.op("maximum" if alpha <= 1.0 else "minimum", x, ctx.op("mul", x, _c(ctx, x, alpha)))]
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
