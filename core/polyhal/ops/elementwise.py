"""Elementwise ops: binary arithmetic and comparisons (numpy broadcasting), unary math, where, cast.

Binary operands must share one element type: there is no implicit promotion, a program converts
explicitly with ``cast``. Arithmetic keeps the operand type (integer results wrap around like
numpy's); comparisons produce bool.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from polyhal.errors import ArithmeticDomainError, ProgramError
from polyhal.ir.types import COMPUTE_DTYPES, TensorType, as_dtype
from polyhal.ops._base import (
    ANY, FLOAT, NUMERIC, SIGNED, UNSIGNED_INT, broadcast, check_dtype, check_same_dtype, define,
    narrow, nonzero, pick, wide, with_ties,
)

BOOL = frozenset([np.dtype(bool)])

#: Operand shape pairs the binary samplers draw from: equal, trailing, both-sides and 0-d broadcasts.
_PAIRS = [
    ((4, 5), (4, 5)), ((2, 3, 4), (4,)), ((3, 1, 5), (1, 4, 5)), ((6,), ()), ((), (2, 3)),
    ((1,), (7, 1)), ((2, 1, 3, 1), (4, 1, 5)), ((64, 64), (64, 1)), ((), ()),
]
_UNARY_SHAPES = [(4, 5), (3, 4, 5), (64,), (), (2, 3, 1, 4), (32, 64)]


# --------------------------------------------------------------------------- binary arithmetic

#: name: (numpy function applied to the float64-widened operands, accepted types, sampler, doc).
#: div and pow are float-only: integer division and integer powers have several conventions
#: (truncating, flooring, negative exponents) and none is needed by the models we run.
_ARITHMETIC: dict[str, tuple[Callable, frozenset, str, str]] = {
    "add": (np.add, NUMERIC, "signed", "x + y."),
    "sub": (np.subtract, NUMERIC, "signed", "x - y."),
    "mul": (np.multiply, NUMERIC, "signed", "x * y."),
    "div": (np.true_divide, FLOAT, "signed", "x / y (IEEE division: x/0 is inf or nan)."),
    "pow": (np.power, FLOAT, "pow", "x ** y (a negative base with a fractional exponent is nan)."),
    "maximum": (np.maximum, ANY, "signed", "Elementwise maximum; nan if either operand is nan."),
    "minimum": (np.minimum, ANY, "signed", "Elementwise minimum; nan if either operand is nan."),
}

#: Comparisons accept every type and produce bool; nan compares unequal to everything.
_COMPARISONS: dict[str, tuple[Callable, str]] = {
    "equal": (np.equal, "=="), "not_equal": (np.not_equal, "!="), "less": (np.less, "<"),
    "less_equal": (np.less_equal, "<="), "greater": (np.greater, ">"),
    "greater_equal": (np.greater_equal, ">="),
}


def _sample_binary(kind: str):
    def sample(rng: np.random.Generator):
        sx, sy = pick(rng, _PAIRS)
        if kind == "pow":
            return [nonzero(rng, sx, positive=True), nonzero(rng, sy, 0.1, 2.0)], {}
        if kind == "ties":  # comparisons: many equal pairs, so equal/less_equal are exercised
            return [with_ties(rng, sx), with_ties(rng, sy)], {}
        return [nonzero(rng, sx), nonzero(rng, sy)], {}
    return sample


def _define_binary(name: str, fn: Callable, allowed: frozenset, sampler: str, doc: str,
                   result: np.dtype | None) -> None:
    def infer(x: TensorType, y: TensorType):
        dtype = check_same_dtype(x, y)
        check_dtype(x, allowed)
        return (TensorType(broadcast(x.shape, y.shape), result or dtype),)

    def reference(x, y):
        return (narrow(fn(wide(x), wide(y)), result or x.dtype),)

    define(name, infer=infer, reference=reference, sample=_sample_binary(sampler), arity=2,
           doc=f"{doc} Operands broadcast like numpy and must have the same element type.")


for _name, (_fn, _allowed, _sampler, _doc) in _ARITHMETIC.items():
    _define_binary(_name, _fn, _allowed, _sampler, _doc, None)
for _name, (_fn, _symbol) in _COMPARISONS.items():
    _define_binary(_name, _fn, ANY, "ties", f"x {_symbol} y, elementwise, as bool; "
                   f"{'true' if _symbol == '!=' else 'false'} where either operand is nan.", np.dtype(bool))


# ---------------------------------------------------------------------------------------- unary

_erf_scalar = np.frompyfunc(math.erf, 1, 1)


def _ref_erf(x):
    return np.asarray(_erf_scalar(x), dtype=np.float64)


def _ref_sigmoid(x):
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x << 0; 1/inf = 0 is right
        return 1.0 / (1.0 + np.exp(-x))


#: name: (reference on float64-widened input, accepted types, (lo, hi, positive) sample range, doc).
_UNARY: dict[str, tuple[Callable, frozenset, tuple[float, float, bool], str]] = {
    "neg": (np.negative, SIGNED, (0.5, 2.0, False), "-x."),
    "abs": (np.abs, NUMERIC, (0.5, 2.0, False), "|x|."),
    "relu": (lambda x: np.maximum(x, 0), NUMERIC, (0.5, 2.0, False), "max(x, 0); nan stays nan."),
    "exp": (np.exp, FLOAT, (0.1, 10.0, False), "e ** x."),
    "log": (np.log, FLOAT, (0.01, 100.0, True), "Natural logarithm (nan below 0, -inf at 0)."),
    "sqrt": (np.sqrt, FLOAT, (0.01, 100.0, True), "Square root (nan below 0)."),
    "tanh": (np.tanh, FLOAT, (0.05, 5.0, False), "Hyperbolic tangent."),
    "sigmoid": (_ref_sigmoid, FLOAT, (0.1, 20.0, False), "1 / (1 + exp(-x))."),
    "erf": (_ref_erf, FLOAT, (0.01, 5.0, False), "The error function 2/sqrt(pi) * int_0^x exp(-t^2) dt."),
}


def _define_unary(name: str, fn: Callable, allowed: frozenset, rng_range, doc: str) -> None:
    lo, hi, positive = rng_range

    def infer(x: TensorType):
        check_dtype(x, allowed)
        return (TensorType(x.shape, x.dtype),)

    def reference(x):
        return (narrow(fn(wide(x)), x.dtype),)

    def sample(rng: np.random.Generator):
        return [nonzero(rng, pick(rng, _UNARY_SHAPES), lo, hi, positive=positive)], {}

    kinds = {FLOAT: "float types", SIGNED: "float and signed integer types",
             NUMERIC: "numeric (non-bool) types"}[allowed]
    define(name, infer=infer, reference=reference, sample=sample, arity=1, doc=f"{doc} Accepts {kinds}.")


for _name, (_fn, _allowed, _range, _doc) in _UNARY.items():
    _define_unary(_name, _fn, _allowed, _range, _doc)


# ----------------------------------------------------------------------------------------- gelu

_GELU_MODES = ("none", "tanh")


def _infer_gelu(x: TensorType, *, approximate):
    if approximate not in _GELU_MODES:
        raise ProgramError(f"attribute 'approximate' must be one of {_GELU_MODES}, got {approximate!r}")
    check_dtype(x, FLOAT)
    return (TensorType(x.shape, x.dtype),)


def _ref_gelu(x, *, approximate="none"):
    w = wide(x)
    if approximate == "tanh":
        y = 0.5 * w * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (w + 0.044715 * w**3)))
    else:
        y = 0.5 * w * (1.0 + _ref_erf(w / math.sqrt(2.0)))
    return (narrow(y, x.dtype),)


def _sample_gelu(rng: np.random.Generator):
    return ([nonzero(rng, pick(rng, _UNARY_SHAPES), 0.01, 5.0)],
            {"approximate": pick(rng, _GELU_MODES)})


define("gelu", infer=_infer_gelu, reference=_ref_gelu, sample=_sample_gelu, arity=1, doc="""
    Gaussian error linear unit, float types only. approximate="none": x/2 * (1 + erf(x/sqrt(2)));
    approximate="tanh": x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))).
""")


# ---------------------------------------------------------------------------------------- where

def _infer_where(cond: TensorType, x: TensorType, y: TensorType):
    check_dtype(cond, BOOL, "condition (operand 0)")
    dtype = check_same_dtype(x, y, first=1)
    return (TensorType(broadcast(cond.shape, x.shape, y.shape), dtype),)


def _ref_where(cond, x, y):
    return (np.where(cond, x, y),)


_TRIPLES = [((4, 5), (4, 5), (4, 5)), ((4, 5), (5,), ()), ((3, 1), (1, 4), (3, 4)),
            ((), (2, 3), (3,)), ((2, 1, 5), (1, 3, 1), (5,))]


def _sample_where(rng: np.random.Generator):
    sc, sx, sy = pick(rng, _TRIPLES)
    return [rng.random(sc) < 0.5, nonzero(rng, sx), nonzero(rng, sy)], {}


define("where", infer=_infer_where, reference=_ref_where, sample=_sample_where, arity=3, doc="""
    where(cond, x, y): x where cond is true, else y. cond must be bool; x and y share an element
    type; all three broadcast.
""")


# ----------------------------------------------------------------------------------------- cast

def _infer_cast(x: TensorType, *, dtype, strict=False):
    return (TensorType(x.shape, as_dtype(dtype)),)


def check_strict_cast(x: np.ndarray, dtype: np.dtype) -> None:
    """Refuse converting to an integer type a float that has no value there (``cast`` with
    ``strict=True``): nan/inf, and (truncated toward zero) values outside the type's range. The
    ONNX front end's integer Div is a float division and this cast, so x / 0 is refused here, as
    onnxruntime refuses it ("Integer division by zero"), and so is the minimum divided by -1,
    which kills onnxruntime (SIGFPE). Two reductions, no per-element Python."""
    dtype, x = np.dtype(dtype), np.asarray(x)
    if dtype.kind not in "iub" or x.dtype.kind != "f" or not x.size:
        return
    low, high = float(x.min()), float(x.max())  # nan propagates into both
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ArithmeticDomainError(nonfinite_cast_message(dtype))
    if dtype.kind == "b":
        return
    info = np.iinfo(dtype)
    if math.trunc(low) < info.min or math.trunc(high) > info.max:  # Python compares these exactly
        raise ArithmeticDomainError(
            f"{low if math.trunc(low) < info.min else high:.17g} is outside the range of {dtype} ([{info.min}, "
            f"{info.max}]): an integer division overflowed (e.g. {info.min} / -1; onnxruntime dies of SIGFPE "
            "there); keep quotients in range, or divide in a wider type")


def nonfinite_cast_message(dtype) -> str:
    """What a strict ``cast`` of nan/inf to integer type ``dtype`` says (every backend's words)."""
    return (f"a non-finite value cannot be converted to {np.dtype(dtype)}: an integer division by zero "
            "(onnxruntime refuses it too); keep divisors nonzero")


def _ref_cast(x, *, dtype, strict=False):
    if strict:
        check_strict_cast(x, as_dtype(dtype))
    return (cast_source(np.asarray(x), as_dtype(dtype)).astype(as_dtype(dtype)),)


def cast_source(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x``, or where ml_dtypes has no direct conversion to ``dtype`` (uint4 -> int4, float8e8m0
    -> float8e4m3fn, ...), ``x`` as float32, which holds every storage type exactly: casts
    between storage types go through float32."""
    return x if np.can_cast(x.dtype, dtype, casting="unsafe") else x.astype(np.float32)


# The conformance suite runs every device; only the CPU has the storage types.
_CAST_TARGETS = sorted(str(d) for d in COMPUTE_DTYPES)


def _sample_cast(rng: np.random.Generator):
    target = np.dtype(pick(rng, _CAST_TARGETS))
    # Float -> unsigned of a negative value is undefined in C (and so in numpy): stay positive.
    positive = target in UNSIGNED_INT
    return [nonzero(rng, pick(rng, _UNARY_SHAPES), 0.5, 100.0, positive=positive)], {"dtype": str(target)}


define("cast", infer=_infer_cast, reference=_ref_cast, sample=_sample_cast, arity=1, doc="""
    Convert to element type ``dtype`` (numpy's unsafe casting: floats truncate toward zero when
    converted to integers, integers wrap, nonzero is True). Converting nan/inf or an out-of-range
    float to an integer type gives an unspecified value; with ``strict=True`` converting nan/inf
    (or, on the CPU, a value outside the integer type's range) to an integer raises
    :class:`~polyhal.errors.ArithmeticDomainError` (the CPU backend and import-time folding honour
    it; other backends may give the unspecified value).
""")
