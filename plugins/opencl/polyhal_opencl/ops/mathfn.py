"""More elementwise math (mirrors :mod:`polyhal.ops.mathfn`): trigonometric and hyperbolic
functions, rounding, sign, reciprocal, isnan/isinf and mod, as tables of C expressions for
:mod:`.elementwise`'s generators; bitcast is a byte copy. ``identity`` lives with the
elementwise copies."""

from __future__ import annotations

from polyhal_opencl.codegen import CType
from polyhal_opencl.ops.elementwise import Expr, binary_generator, unary_generator
from polyhal_opencl.ops.shape import byte_copy


def _call(fn: str) -> Expr:
    return lambda x, t: f"{fn}({x})"


def _sign(x: str, t: CType) -> str:
    if t.kind == "u":
        return f"({t.compute})({x} > 0)"
    sign = f"({t.compute})(({x} > 0) - ({x} < 0))"
    return f"(isnan({x}) ? {x} : {sign})" if t.is_float else sign


#: Unary ops. OpenCL's builtins are within a few ulp, inside the conformance tolerance (2e-6);
#: round is rint: halves to even, as numpy and ONNX.
UNARY: dict[str, Expr] = {
    **{n: _call(n) for n in ("sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
                             "acosh", "atanh", "floor", "ceil")},
    "round": _call("rint"),
    "reciprocal": lambda x, t: f"({t.lit(1.0)} / {x})",
    "sign": _sign,
    "isnan": _call("isnan"), "isinf": _call("isinf"),
}


def _mod(a: str, b: str, t: CType, fmod: bool = False) -> str:
    if t.is_float:
        return f"fmod({a}, {b})"
    return f"mod_{'trunc' if fmod else 'floor'}({a}, {b})"


def _mod_helpers(t: CType) -> str:
    """Integer remainders that never trap: x % 0 is 0 (numpy's result), and x % -1 is 0 without
    evaluating INT_MIN % -1, which overflows in C. floor: the remainder takes the divisor's sign."""
    if t.is_float:
        return ""
    c = t.compute
    minus_one = "b == -1 || " if t.kind == "i" else ""
    fix = "  if (r != 0 && ((r < 0) != (b < 0))) r += b;\n" if t.kind == "i" else ""
    return (
        f"inline {c} mod_trunc({c} a, {c} b) {{ return ({minus_one}b == 0) ? ({c})0 : ({c})(a % b); }}\n"
        f"inline {c} mod_floor({c} a, {c} b) {{\n  {c} r = mod_trunc(a, b);\n{fix}  return r;\n}}\n"
    )


BINARY: dict[str, Expr] = {"mod": _mod}

GENERATORS = {**dict.fromkeys(UNARY, unary_generator(UNARY)),
              "mod": binary_generator(BINARY, {"mod": _mod_helpers}), "bitcast": byte_copy}
