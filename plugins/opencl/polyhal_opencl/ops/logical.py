"""Logical ops on bool and bitwise ops on integers (mirrors :mod:`polyhal.ops.logical`), as
tables of C expressions for :mod:`.elementwise`'s generators. Bools are stored as 0/1 bytes."""

from __future__ import annotations

from polyhal_opencl.codegen import CType
from polyhal_opencl.ops.elementwise import Expr, binary_generator, unary_generator


def _shift(a: str, b: str, t: CType, direction: str = "left") -> str:
    # C leaves shifts by the width or more undefined; polyhal defines them as 0.
    op = "<<" if direction == "left" else ">>"
    return f"(({b}) >= {t.dtype.itemsize * 8} ? ({t.compute})0 : ({t.compute})({a} {op} {b}))"


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
