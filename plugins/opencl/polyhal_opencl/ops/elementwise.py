"""Elementwise kernels: binary arithmetic and comparisons (broadcasting), unary math, gelu, where,
cast and identity, from tables of C expressions and one strided-kernel generator (``map_kernel``,
which :mod:`.mathfn` and :mod:`.logical` use with their own tables)."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from polyhal.ir.types import TensorType
from polyhal.ops.elementwise import nonfinite_cast_message
from polyhal_gpu import storage

from polyhal_opencl.codegen import (
    FLAG, Arg, Check, CType, DeviceTraits, Launch, Recipe, bits_ctype, broadcast_strides, collapse, ctype, header,
    index_type, linear_launch, next_pow2, operands, param, prologue, strided_kernel,
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


#: Elements per work-item of the contiguous kernel on CPU devices: bounds of the chunk size.
CPU_CHUNK = (256, 16384)


def _contiguous(out: TensorType, views: list) -> list[bool] | None:
    """For each input view, whether it is read whole (True) or is one broadcast element (False),
    when every operand is one of the two (no index math needed); None otherwise."""
    shape, strides = collapse(out.shape, [v[2] for v in views])
    if len(shape) > 1 or any(s not in ((), (0,), (1,)) for s in strides) or strides[-1] not in ((), (1,)):
        return None
    return [s == (1,) for s in strides[:-1]]


def contiguous_kernel(name: str, total: int, out_t: CType, ins: list[CType], whole: list[bool],
                      expr: Callable[[list[str]], str], traits: DeviceTraits, flag: bool = False
                      ) -> tuple[str, list[Launch]]:
    """``y[i] = expr(x0[i], x1[i] or x1[0], ...)`` over ``total`` dense elements, no index math.

    GPUs: one element per work-item (coalesced). CPU devices: a contiguous chunk of elements per
    work-item, a plain loop the compiler vectorizes, with the broadcast operands read once;
    chunks are sized so that every core gets several (fewer, larger work-groups cost less
    than one work-item per element there). ``flag``: the kernel also takes the recipe's error
    flag, ``flag`` (see :class:`~polyhal_opencl.codegen.Check`), which ``expr`` may set."""
    bufs = [(f"x{i}", t.store, True) for i, t in enumerate(ins)] + [("y", out_t.store, False)]
    bufs += [("flag", "int", False)] if flag else []
    params = ", ".join(param(*b) for b in bufs)
    pro = prologue(*bufs)
    args = tuple(Arg(i) for i in range(len(ins) + 1)) + ((FLAG,) if flag else ())
    if traits.is_cpu:
        chunk = min(max(next_pow2(-(-total // (8 * max(traits.compute_units, 1)))), CPU_CHUNK[0]), CPU_CHUNK[1])
        idx = index_type(total + chunk)
        hoisted = "".join(f"  const {t.compute} v{i} = {t.load(f'x{i}', '0')};\n"
                          for i, t in enumerate(ins) if not whole[i])
        loads = "".join(f"    const {t.compute} v{i} = {t.load(f'x{i}', 'i')};\n"
                        for i, t in enumerate(ins) if whole[i])
        src = (f"__kernel void {name}({params}) {{\n{pro}"
               f"  const {idx} s = ({idx})get_global_id(0) * {chunk};\n"
               f"  const {idx} e = s + {chunk} < {total} ? s + {chunk} : {total};\n{hoisted}"
               f"  for ({idx} i = s; i < e; ++i) {{\n{loads}"
               f"    {out_t.store_stmt('y', 'i', expr([f'v{i}' for i in range(len(ins))]))}\n  }}\n}}\n")
        return src, [Launch(name, (-(-total // chunk),), (1,), args)]
    idx = index_type(total)
    loads = "".join(f"  const {t.compute} v{i} = {t.load(f'x{i}', 'i' if whole[i] else '0')};\n"
                    for i, t in enumerate(ins))
    src = (f"__kernel void {name}({params}) {{\n{pro}"
           f"  const size_t gid = get_global_id(0);\n  if (gid >= {total}) return;\n"
           f"  const {idx} i = ({idx})gid;\n{loads}"
           f"  {out_t.store_stmt('y', 'i', expr([f'v{i}' for i in range(len(ins))]))}\n}}\n")
    return src, linear_launch(name, total, args, traits)


def map_kernel(name: str, out: TensorType, out_t: CType, ins: list[tuple[TensorType, CType]],
               expr: Callable[[list[str]], str], traits: DeviceTraits, preamble: str = "",
               check: str = "") -> Recipe:
    """out = expr(inputs) elementwise, inputs broadcast to ``out``'s shape; ``preamble`` is C
    code (helper functions) placed before the kernel. Dense operands (and single broadcast
    elements) get :func:`contiguous_kernel`, anything else the strided kernel. With ``check``,
    the kernel takes the recipe's error flag (``expr`` sets ``flag[0]``) and a
    :class:`~polyhal_opencl.codegen.Check` step raising ``check`` follows the launch."""
    name = f"{name}_kernel"  # op names such as abs and exp are OpenCL builtins
    views = [(f"x{i}", t, broadcast_strides(tt.shape, out.shape), True) for i, (tt, t) in enumerate(ins)]
    views.append(("y", out_t, broadcast_strides(out.shape, out.shape), False))
    whole = _contiguous(out, views) if out.size else None
    checks = [Check(check)] if check and out.size else []
    if whole is not None:
        src, launches = contiguous_kernel(name, out.size, out_t, [t for _, t in ins], whole, expr, traits,
                                          flag=bool(check))
        return Recipe(header(out_t, *(t for _, t in ins)) + preamble + src, launches + checks)

    def body(o: dict[str, str]) -> str:
        # Loads go to locals first: expressions such as maximum's use an operand several times.
        loads = "".join(f"  const {t.compute} v{i} = {t.load(f'x{i}', o[f'x{i}'])};\n"
                        for i, (_, t) in enumerate(ins))
        flag = prologue(("flag", "int", False)) if check else ""
        return flag + loads + "  " + out_t.store_stmt("y", o["y"], expr([f"v{i}" for i in range(len(ins))]))

    extra = ", " + param("flag", "int") if check else ""
    src = header(out_t, *(t for _, t in ins)) + preamble + strided_kernel(name, out.shape, views, body, extra)
    ins_args, outs_args = operands(len(ins), 1)
    args = ins_args + outs_args + ([FLAG] if check else [])
    return Recipe(src, linear_launch(name, out.size, args, traits) + checks)


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
    type's store converts (nonzero is true; half rounds to nearest even). To and from the
    storage-only types (bfloat16, float8, int4, ...), ml_dtypes' conversions, from the source
    shared with the other GPU backends (:mod:`polyhal_gpu.storage`)."""
    src, dst = in_types[0].dtype, out_types[0].dtype
    if src != dst and (storage.is_storage(src) or storage.is_storage(dst)):
        src_t = bits_ctype(src) if storage.is_storage(src) else ctype(src, traits, op)
        dst_t = bits_ctype(dst) if storage.is_storage(dst) else ctype(dst, traits, op)
        return map_kernel(op, out_types[0], dst_t, [(in_types[0], src_t)],
                          lambda v: storage.cast_expr(src, dst, v[0]), traits, storage.source())
    if src == dst:  # identity: move bits (any type, the storage types included)
        return identity(op, attrs, in_types, out_types, traits)
    src_t = ctype(in_types[0].dtype, traits, op)
    dst_t = ctype(out_types[0].dtype, traits, op)
    if attrs.get("strict") and src_t.is_float and dst_t.kind in "iub":
        # nan/inf (an integer division by zero) raise after the launch, as on every backend
        return map_kernel(op, out_types[0], dst_t, [(in_types[0], src_t)],
                          lambda v: f"((isfinite({v[0]}) ? 0 : (flag[0] = 1)), {v[0]})", traits,
                          check=nonfinite_cast_message(dst_t.dtype))
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
