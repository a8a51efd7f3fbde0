"""More elementwise math: trigonometric and hyperbolic functions, rounding, sign, reciprocal,
nan/inf tests, ``mod`` and ``identity``.

Like :mod:`polyhal.ops.elementwise`, operands of binary ops share one element type and broadcast
like numpy; float references compute in float64.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from polyhal.errors import ArithmeticDomainError, DTypeError, ProgramError
from polyhal.ir.types import TensorType, as_dtype
from polyhal.ops._base import (
    FLOAT, NUMERIC, bool_attr, broadcast, check_dtype, check_same_dtype, define, narrow, nonzero,
    pick, wide,
)

_SHAPES = [(4, 5), (3, 4, 5), (64,), (), (2, 3, 1, 4), (32, 64)]
_PAIRS = [((4, 5), (4, 5)), ((2, 3, 4), (4,)), ((3, 1, 5), (1, 4, 5)), ((6,), ()), ((), (2, 3)), ((64, 64), (64, 1))]


# ----------------------------------------------------------------------------- float unary math

#: name: (numpy function, (lo, hi, positive) sample magnitudes, doc). The ranges keep samples
#: inside each function's domain and away from its poles.
_FLOAT_UNARY: dict[str, tuple[Callable, tuple[float, float, bool], str]] = {
    "sin": (np.sin, (0.05, 6.0, False), "Sine (radians)."),
    "cos": (np.cos, (0.05, 6.0, False), "Cosine (radians)."),
    "tan": (np.tan, (0.05, 1.2, False), "Tangent (radians)."),
    "asin": (np.arcsin, (0.05, 0.95, False), "Inverse sine, in [-pi/2, pi/2]; nan outside [-1, 1]."),
    "acos": (np.arccos, (0.05, 0.95, False), "Inverse cosine, in [0, pi]; nan outside [-1, 1]."),
    "atan": (np.arctan, (0.05, 10.0, False), "Inverse tangent, in (-pi/2, pi/2)."),
    "sinh": (np.sinh, (0.05, 5.0, False), "Hyperbolic sine."),
    "cosh": (np.cosh, (0.05, 5.0, False), "Hyperbolic cosine."),
    "asinh": (np.arcsinh, (0.05, 10.0, False), "Inverse hyperbolic sine."),
    "acosh": (np.arccosh, (1.05, 10.0, True), "Inverse hyperbolic cosine; nan below 1."),
    "atanh": (np.arctanh, (0.05, 0.95, False), "Inverse hyperbolic tangent; nan outside [-1, 1]."),
    "floor": (np.floor, (0.1, 10.0, False), "Largest integer <= x (as a float)."),
    "ceil": (np.ceil, (0.1, 10.0, False), "Smallest integer >= x (as a float)."),
    "round": (np.round, (0.1, 10.0, False), "Nearest integer, halves to even (as ONNX Round and numpy)."),
    "reciprocal": (np.reciprocal, (0.1, 10.0, False), "1 / x (inf at 0)."),
}


def _define_float_unary(name: str, fn: Callable, rng_range, doc: str) -> None:
    lo, hi, positive = rng_range

    def infer(x: TensorType):
        check_dtype(x, FLOAT)
        return (TensorType(x.shape, x.dtype),)

    def reference(x):
        with np.errstate(all="ignore"):
            return (narrow(fn(wide(x)), x.dtype),)

    def sample(rng: np.random.Generator):
        return [nonzero(rng, pick(rng, _SHAPES), lo, hi, positive=positive)], {}

    define(name, infer=infer, reference=reference, sample=sample, arity=1,
           tolerance=(2e-6, 1e-6), doc=f"{doc} Float types only.")


for _name, (_fn, _range, _doc) in _FLOAT_UNARY.items():
    _define_float_unary(_name, _fn, _range, _doc)


# ----------------------------------------------------------------------------------------- sign

def _infer_sign(x: TensorType):
    check_dtype(x, NUMERIC)
    return (TensorType(x.shape, x.dtype),)


def _ref_sign(x):
    return (narrow(np.sign(wide(x)), x.dtype),)


def _sample_sign(rng: np.random.Generator):
    shape = pick(rng, _SHAPES)
    if rng.random() < 0.3:
        return [rng.integers(-5, 6, size=shape).astype(pick(rng, [np.int32, np.int64, np.int8]))], {}
    return [nonzero(rng, shape)], {}


define("sign", infer=_infer_sign, reference=_ref_sign, sample=_sample_sign, arity=1, tolerance=(0.0, 0.0), doc="""
    -1, 0 or 1 by the sign of x (nan stays nan). Numeric types (unsigned gives 0 or 1).
""")


# ---------------------------------------------------------------------------------- isnan/isinf

def _infer_is(x: TensorType):
    check_dtype(x, FLOAT)
    return (TensorType(x.shape, np.dtype(bool)),)


def _sample_special(rng: np.random.Generator):
    x = nonzero(rng, pick(rng, [s for s in _SHAPES if s]))
    flat = x.reshape(-1)
    for value in (np.nan, np.inf, -np.inf):
        flat[rng.integers(0, flat.size, size=max(1, flat.size // 6))] = value
    return [x], {}


define("isnan", infer=_infer_is, reference=lambda x: (np.isnan(x),), sample=_sample_special, arity=1,
       tolerance=(0.0, 0.0), doc="True where x is nan. Float types only.")
define("isinf", infer=_infer_is, reference=lambda x: (np.isinf(x),), sample=_sample_special, arity=1,
       tolerance=(0.0, 0.0), doc="True where x is +inf or -inf. Float types only.")


# ------------------------------------------------------------------------------------------ mod

def _infer_mod(x: TensorType, y: TensorType, *, fmod):
    dtype = check_same_dtype(x, y)
    check_dtype(x, NUMERIC)
    if not bool_attr(fmod, "fmod") and x.dtype in FLOAT:
        raise ProgramError("floored mod (fmod=False) is for integers; use fmod=True for floats")
    return (TensorType(broadcast(x.shape, y.shape), dtype),)


def check_integer_divisor(y: np.ndarray) -> None:
    """Refuse an integer ``mod`` by zero (as onnxruntime does: "Integer modulo by zero") rather
    than give numpy's 0; one reduction over ``y``, nothing for float divisors."""
    if y.dtype.kind in "iu" and not y.all():
        raise ArithmeticDomainError(f"integer mod by zero (the {y.dtype} divisor holds 0; onnxruntime refuses it "
                                    "too); keep divisors nonzero, or compute the remainder in floats")


def _ref_mod(x, y, *, fmod=False):
    check_integer_divisor(np.asarray(y))
    fn = np.fmod if fmod else np.mod
    with np.errstate(all="ignore"):
        return (narrow(fn(wide(x), wide(y)), x.dtype),)


def _sample_mod(rng: np.random.Generator):
    sx, sy = pick(rng, _PAIRS)
    if rng.random() < 0.5:
        dt = pick(rng, [np.int32, np.int64, np.int8, np.uint8])
        lo = 0 if np.dtype(dt).kind == "u" else -20
        x = rng.integers(lo, 21, size=sx).astype(dt)
        y = rng.integers(1, 8, size=sy).astype(dt)
        if np.dtype(dt).kind == "i":
            y = (y * rng.choice([-1, 1], size=sy)).astype(dt)
        return [x, y], {"fmod": bool(rng.integers(2))}
    return [nonzero(rng, sx, 0.5, 20.0), nonzero(rng, sy, 0.5, 4.0)], {"fmod": True}


define("mod", infer=_infer_mod, reference=_ref_mod, sample=_sample_mod, arity=2, tolerance=(1e-5, 1e-5), doc="""
    Remainder of x / y. fmod=True: the sign of x (C fmod; floats and integers); fmod=False: the
    sign of y (floored, Python's %; integers only). An integer y holding 0 raises
    :class:`~polyhal.errors.ArithmeticDomainError` on the CPU (other backends may give 0).
""")


# ------------------------------------------------------------------------------------- identity

def _infer_identity(x: TensorType):
    return (TensorType(x.shape, x.dtype),)


def _sample_identity(rng: np.random.Generator):
    x = nonzero(rng, pick(rng, _SHAPES))
    return [x.astype(pick(rng, [np.float32, np.int64, np.int8, bool]))], {}


define("identity", infer=_infer_identity, reference=lambda x: (np.array(x, copy=True),),
       sample=_sample_identity, arity=1, tolerance=(0.0, 0.0), doc="""
    A copy of x (any element type). Front ends use it where a result must be a new value, e.g. a
    program output that is also an input or a constant.
""")


# -------------------------------------------------------------------------------------- bitcast

def _infer_bitcast(x: TensorType, *, dtype):
    target = as_dtype(dtype)
    if target.itemsize != x.dtype.itemsize:
        raise DTypeError(f"cannot reinterpret {x.dtype} ({x.dtype.itemsize * 8} bits) as {target} "
                         f"({target.itemsize * 8} bits): the widths must match")
    return (TensorType(x.shape, target),)


def _ref_bitcast(x, *, dtype):
    return (np.ascontiguousarray(x).view(as_dtype(dtype)).reshape(np.shape(x)),)


_BITCAST_PAIRS = [("int32", "float32"), ("float32", "int32"), ("uint8", "int8"), ("int64", "float64"),
                  ("float64", "uint64"), ("int16", "float16"), ("uint32", "int32")]


def _sample_bitcast(rng: np.random.Generator):
    src, dst = pick(rng, _BITCAST_PAIRS)
    shape = pick(rng, _SHAPES)
    if np.dtype(src).kind == "f":
        x = nonzero(rng, shape, dtype=src)
    else:  # bit patterns of ordinary floats, so that the result is finite and comparable
        x = nonzero(rng, shape, dtype=f"f{np.dtype(src).itemsize}").view(src) if np.dtype(src).itemsize > 1 \
            else rng.integers(-100, 100, size=shape).astype(src)
    return [x], {"dtype": dst}


define("bitcast", infer=_infer_bitcast, reference=_ref_bitcast, sample=_sample_bitcast, arity=1,
       tolerance=(0.0, 0.0), doc="""
    The same bits read as element type ``dtype`` of the same width (ONNX BitCast; little endian,
    as every polyhal device). Unlike cast, no value is converted.
""")
