"""CPU kernels of :mod:`polyhal.ops.mathfn` and :mod:`polyhal.ops.logical`: one numpy ufunc
each, called with ``out=`` (the contract of :mod:`polyhal_cpu.kernels`)."""

from __future__ import annotations

import numpy as np

from polyhal.ops.mathfn import check_integer_divisor
from polyhal_cpu.table import TABLE, Kernel, Types, binary_ufuncs, float16_via_float32

_UNARY = {
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan,
    "sinh": np.sinh, "cosh": np.cosh, "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh,
    "floor": np.floor, "ceil": np.ceil, "round": np.round, "reciprocal": np.reciprocal, "sign": np.sign,
    "isnan": np.isnan, "isinf": np.isinf, "logical_not": np.logical_not, "bitwise_not": np.invert,
}
_BINARY = {
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor,
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
}


#: The unary ops that never warn (rounding, tests, bits): no errstate around them, which costs
#: ~1 us a call (a QDQ model's quantizations round every activation).
_QUIET = frozenset({"floor", "ceil", "round", "sign", "isnan", "isinf", "logical_not", "bitwise_not"})


@TABLE.register(*_UNARY)
def _unary(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    ufunc = _UNARY[op]
    if op == "round" and ins[0].dtype.kind == "f":
        ufunc = np.rint  # half to even, as np.round's decimals=0 is, without its wrapper (~1 us)
    if op in _QUIET:
        def quiet(x, out):
            ufunc(x, out=out)
        return quiet

    def kernel(x, out):
        # Outside their domains (asin(2), acosh(0), ...) these give nan, as the references do.
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            ufunc(x, out=out)
    return kernel


TABLE.register(*_BINARY)(binary_ufuncs(_BINARY))


@TABLE.register("mod")
def _mod(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    ufunc = np.fmod if attrs["fmod"] else np.mod
    if ins[1].dtype.kind in "iu":
        def integer_kernel(x, y, out):
            check_integer_divisor(y)  # numpy would give 0 for x % 0
            ufunc(x, y, out=out)
        return integer_kernel

    def kernel(x, y, out):
        with np.errstate(divide="ignore", invalid="ignore"):  # fmod(x, 0) is nan, as IEEE says
            ufunc(x, y, out=out)
    return kernel


@TABLE.register("bit_shift")
def _bit_shift(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    dtype = outs[0].dtype
    bits = dtype.itemsize * 8
    left = attrs["direction"] == "left"
    unsigned = np.dtype(f"u{dtype.itemsize}")
    signed = dtype.kind == "i"

    def kernel(x, y, out):
        outside = (y < 0) | (y >= bits) if signed else y >= bits
        safe = np.where(outside, 0, y).astype(unsigned if left else dtype)
        if left:  # through the unsigned type: bits past the top drop, no overflow
            np.copyto(out, np.left_shift(x.astype(unsigned), safe), casting="unsafe")
            np.copyto(out, 0, where=outside)
        else:
            np.right_shift(x, safe, out=out)  # arithmetic for signed types
            if signed:
                np.copyto(out, np.where(x < 0, -1, 0).astype(dtype), where=outside)
            else:
                np.copyto(out, 0, where=outside)
    return kernel


@TABLE.register("identity")
def _identity(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    copyto = np.copyto

    def kernel(x, out):
        copyto(out, x)
    return kernel


@TABLE.register("bitcast")
def _bitcast(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    src = ins[0].dtype

    def kernel(x, out):
        np.copyto(out.view(src), x)  # out is contiguous: viewing it as the source type is exact
    return kernel


@TABLE.register("det")
@float16_via_float32
def _det(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    def kernel(x, out):
        np.copyto(out, np.linalg.det(x), casting="same_kind")  # LAPACK's LU, batched
    return kernel
