"""Logical ops on bool and bitwise ops on integers (mirrors :mod:`polyhal.ops.logical`), as
tables of C expressions for :mod:`.elementwise`'s generators. Bools are stored as 0/1 bytes."""

from __future__ import annotations

from polyhal_opencl.codegen import CType
from polyhal_opencl.ops.elementwise import Expr, binary_generator, unary_generator


def _shift(a: str, b: str, t: CType, direction: str = "left") -> str:
    """ONNX BitShift as polyhal defines it: left shifts wrap (done unsigned), right shifts of
    signed values are arithmetic, and a count outside [0, bits) gives the sign fill alone (C
    leaves such shifts undefined)."""
    c, bits = t.compute, t.dtype.itemsize * 8
    outside = f"({b} < 0 || {b} >= {bits})" if t.kind == "i" else f"({b} >= {bits})"
    if direction == "left":
        return f"({outside} ? ({c})0 : ({c})(({t.unsigned}){a} << {b}))"
    fill = f"({a} < 0 ? ({c})-1 : ({c})0)" if t.kind == "i" else f"({c})0"
    return f"({outside} ? {fill} : ({c})({a} >> {b}))"


BINARY: dict[str, Expr] = {
    "logical_and": lambda a, b, t: f"({a} && {b})",
    "logical_or": lambda a, b, t: f"({a} || {b})",
    "logical_xor": lambda a, b, t: f"(({a} != 0) != ({b} != 0))",
    "bitwise_and": lambda a, b, t: f"({t.compute})({a} & {b})",
    "bitwise_or": lambda a, b, t: f"({t.compute})({a} | {b})",
    "bitwise_xor": lambda a, b, t: f"({t.compute})({a} ^ {b})",
    "bit_shift": _shift,
}

UNARY: dict[str, Expr] = {
    "logical_not": lambda x, t: f"(!{x})",
    "bitwise_not": lambda x, t: f"({t.compute})(~{x})",
}

GENERATORS = {**dict.fromkeys(BINARY, binary_generator(BINARY)), **dict.fromkeys(UNARY, unary_generator(UNARY))}
