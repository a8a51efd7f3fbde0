"""Elementwise kernels: binary arithmetic and comparisons (broadcasting), unary math, gelu, where,
cast and identity, from tables of C expressions and one strided-kernel generator (``map_kernel``,
which :mod:`.mathfn` and :mod:`.logical` use with their own tables)."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from polyhal.ir.types import TensorType

from polyhal_opencl.codegen import (
    CType, DeviceTraits, Recipe, bits_ctype, broadcast_strides, ctype, header, linear_launch,
    operands, strided_kernel,
)

#: An expression builder: operand C expressions and the compute type -> C expression.
Expr = Callable[..., str]


def _wrapping(op: str) -> Expr:
    """``a OP b``, computed in the unsigned type for signed integers so it wraps like numpy."""
    def expr(a: str, b: str, t: CType) -> str:
        if t.kind == "i":
            return f"({t.compute})(({t.unsigned}){a} {op} ({t.unsigned}){b})"
        return f"({a} {op} {b})"
    return expr


def _extremum(fn: str, cmp: str) -> Expr:
    """maximum/minimum: nan if either operand is nan (``a + b`` carries it), else the extremum."""
    def expr(a: str, b: str, t: CType) -> str:
        if t.is_float:
            return f"((isnan({a}) || isnan({b})) ? {a} + {b} : {fn}({a}, {b}))"
        return f"(({a}) {cmp} ({b}) ? ({a}) : ({b}))"
    return expr


#: Binary ops: name -> expression. Comparisons give 0/1, stored as bool by the output type.
BINARY: dict[str, Expr] = {
    "add": _wrapping("+"), "sub": _wrapping("-"), "mul": _wrapping("*"),
    "div": lambda a, b, t: f"({a} / {b})",
    "pow": lambda a, b, t: f"pow({a}, {b})",
    "maximum": _extremum("fmax", ">"), "minimum": _extremum("fmin", "<"),
    "equal": lambda a, b, t: f"({a} == {b})", "not_equal": lambda a, b, t: f"({a} != {b})",
    "less": lambda a, b, t: f"({a} < {b})", "less_equal": lambda a, b, t: f"({a} <= {b})",
    "greater": lambda a, b, t: f"({a} > {b})", "greater_equal": lambda a, b, t: f"({a} >= {b})",
}


def _neg(x: str, t: CType) -> str:
    return f"({t.compute})(({t.unsigned})0 - ({t.unsigned}){x})" if t.kind == "i" else f"(-{x})"


def _abs(x: str, t: CType) -> str:
    if t.is_float:
        return f"fabs({x})"
    return f"({t.compute})abs({x})" if t.kind == "i" else x  # abs(INT_MIN) wraps to INT_MIN, as numpy


def _gelu(x: str, t: CType, approximate: str = "none") -> str:
    half, one = t.lit(0.5), t.lit(1.0)
    if approximate == "tanh":
        c, k = t.lit(math.sqrt(2.0 / math.pi)), t.lit(0.044715)
        return f"({half} * {x} * ({one} + tanh({c} * ({x} + {k} * {x} * {x} * {x}))))"
    return f"({half} * {x} * ({one} + erf({x} * {t.lit(math.sqrt(0.5))})))"


#: Unary ops: name -> expression (attributes, e.g. gelu's ``approximate``, passed as keywords).
UNARY: dict[str, Expr] = {
    "neg": _neg, "abs": _abs,
    # nan < 0 is false, so nan stays nan.
    "relu": lambda x, t: f"({x} < ({t.compute})0 ? ({t.compute})0 : {x})",
    "exp": lambda x, t: f"exp({x})", "log": lambda x, t: f"log({x})",
    "sqrt": lambda x, t: f"sqrt({x})", "tanh": lambda x, t: f"tanh({x})",
    "sigmoid": lambda x, t: f"({t.lit(1.0)} / ({t.lit(1.0)} + exp(-{x})))",
    "erf": lambda x, t: f"erf({x})",
    "gelu": _gelu,
}


def map_kernel(name: str, out: TensorType, out_t: CType, ins: list[tuple[TensorType, CType]],
               expr: Callable[[list[str]], str], traits: DeviceTraits, preamble: str = "") -> Recipe:
    """out = expr(inputs) elementwise, inputs broadcast to ``out``'s shape; ``preamble`` is C
    code (helper functions) placed before the kernel."""
    name = f"{name}_kernel"  # op names such as abs and exp are OpenCL builtins
    views = [(f"x{i}", t, broadcast_strides(tt.shape, out.shape), True) for i, (tt, t) in enumerate(ins)]
    views.append(("y", out_t, broadcast_strides(out.shape, out.shape), False))

    def body(o: dict[str, str]) -> str:
        # Loads go to locals first: expressions such as maximum's use an operand several times.
        loads = "".join(f"  const {t.compute} v{i} = {t.load(f'x{i}', o[f'x{i}'])};\n"
                        for i, (_, t) in enumerate(ins))
        return loads + "  " + out_t.store_stmt("y", o["y"], expr([f"v{i}" for i in range(len(ins))]))

    src = header(out_t, *(t for _, t in ins)) + preamble + strided_kernel(name, out.shape, views, body)
    ins_args, outs_args = operands(len(ins), 1)
    return Recipe(src, linear_launch(name, out.size, ins_args + outs_args, traits))


def binary_generator(table: Mapping[str, Expr], preambles: Mapping[str, Callable[[CType], str]] | None = None):
    """A generator for the binary ops of ``table`` (name -> ``expr(a, b, t, **attrs)``); operands
    share one type (the core's inference checks it). ``preambles`` gives helper C functions."""
    def generate(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
        t = ctype(in_types[0].dtype, traits, op)
        out_t = ctype(out_types[0].dtype, traits, op)
        fn, pre = table[op], (preambles or {}).get(op)
        return map_kernel(op, out_types[0], out_t, [(in_types[0], t), (in_types[1], t)],
                          lambda v: fn(v[0], v[1], t, **attrs), traits, pre(t) if pre else "")
    return generate


def unary_generator(table: Mapping[str, Expr]):
    """A generator for the unary ops of ``table`` (name -> ``expr(x, t, **attrs)``); the result
    has the operand's type unless the core infers another (bool for isnan)."""
    def generate(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
        t = ctype(in_types[0].dtype, traits, op)
        out_t = ctype(out_types[0].dtype, traits, op)
        fn = table[op]
        return map_kernel(op, out_types[0], out_t, [(in_types[0], t)], lambda v: fn(v[0], t, **attrs), traits)
    return generate


def cast(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """numpy ``astype``: C conversions truncate floats toward zero and wrap integers; the output
    type's store converts (nonzero is true; half rounds to nearest even)."""
    src_t = ctype(in_types[0].dtype, traits, op)
    dst_t = ctype(out_types[0].dtype, traits, op)
    if src_t.dtype == dst_t.dtype:  # identity: move bits
        src_t = dst_t = bits_ctype(src_t.dtype)
    return map_kernel(op, out_types[0], dst_t, [(in_types[0], src_t)], lambda v: v[0], traits)


def where(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """where(cond, x, y): a select on raw bits, so it works for every type (float64 without fp64)."""
    cond = ctype(in_types[0].dtype, traits, op)
    data = bits_ctype(out_types[0].dtype)
    return map_kernel(op, out_types[0], data, [(in_types[0], cond), (in_types[1], data), (in_types[2], data)],
                      lambda v: f"({v[0]} ? {v[1]} : {v[2]})", traits)


def identity(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """A copy of the bits, any element type."""
    t = bits_ctype(in_types[0].dtype)
    return map_kernel(op, out_types[0], t, [(in_types[0], t)], lambda v: v[0], traits)


#: op name -> generator, for kernels.py's table.
GENERATORS = {**dict.fromkeys(BINARY, binary_generator(BINARY)), **dict.fromkeys(UNARY, unary_generator(UNARY)),
              "cast": cast, "where": where, "identity": identity}
