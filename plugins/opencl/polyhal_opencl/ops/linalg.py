"""matmul (numpy semantics, batched with broadcasting), gemm (ONNX) and linear (x @ w + b), all
on the tiled, register-blocked ``cl/matmul.cl`` kernel. pyclblast is not used: PyPI has only its source, which needs the
CLBlast C library installed, so the tiled kernel is the one path everywhere."""

from __future__ import annotations

import math
from typing import Any, Mapping

from polyhal.ops._base import broadcast

from polyhal_opencl.codegen import (
    Arg, CType, DeviceTraits, Launch, Recipe, broadcast_strides, cl_source, collapse, ctype,
    defines, dense_strides, header, offsets_code, param, prologue, round_up,
)


def tile_edge(traits: DeviceTraits) -> int:
    """The largest power-of-two work-group edge whose square fits in a work-group (at most 16)."""
    ts = 16
    while ts > 1 and ts * ts > traits.max_work_group_size:
        ts //= 2
    return ts


def register_tile(m: int, n: int, ts: int) -> int:
    """Outputs per work-item per dim: 4 once the product fills 4x4-register blocks, less for
    small products, whose blocks would be mostly padding."""
    edge = min(m, n)
    return 4 if edge >= 4 * ts else 2 if edge >= 2 * ts else 1


def _batch_strides(shape: tuple[int, ...], batch: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides over the broadcast ``batch`` dims of a dense operand of ``shape`` (whose
    last two dims are the matrix): 0 where the operand is broadcast."""
    own = shape[:-2]
    dense = dense_strides(shape)[:-2]
    lead = len(batch) - len(own)
    return tuple(0 if i < lead or own[i - lead] == 1 else dense[i - lead] for i in range(len(batch)))


def _product(t: CType, out: CType, *, m: int, n: int, k: int, batch: tuple[int, ...],
             a_strides: tuple[int, int], b_strides: tuple[int, int], a_batch, b_batch,
             result: str, c: CType | None, traits: DeviceTraits) -> tuple[str, int]:
    ts = tile_edge(traits)
    rt = register_tile(m, n, ts)
    bshape, (abs_, bbs) = collapse(batch, [a_batch, b_batch])
    acc = t.unsigned if t.kind in "iu" else t.compute  # unsigned: integer products wrap as numpy's
    names = [("a", t.store, True), ("b", t.store, True)] + ([("c", c.store, True)] if c else []) + [("y", out.store, False)]
    source = (
        header(t, out)
        + defines(TS=ts, RT=rt, TK=16, M=m, N=n, K=k, SAM=a_strides[0], SAK=a_strides[1], SBK=b_strides[0],
                  SBN=b_strides[1], CT=t.compute, ACC=acc)
        + f"#define LOAD_A(i) {t.load('a', 'i')}\n#define LOAD_B(i) {t.load('b', 'i')}\n"
        + f"#define MUL(x, y) (({acc})(x) * ({acc})(y))\n"
        + "#define PARAMS " + ", ".join(param(nm, st, cst) for nm, st, cst in names) + "\n"
        + "#define PROLOGUE " + prologue(*names).replace("\n", " ") + "\n"
        + "#define BATCH_OFFSETS " + offsets_code("bat", bshape, [abs_, bbs], ["abat", "bbat"], "long").replace("\n", " ") + "\n"
        + f"#define RESULT {result}\n"
        + cl_source("matmul.cl")
    )
    return source, ts, rt


def _launch(source: str, ts: int, rt: int, m: int, n: int, batch: int, nargs: int) -> Recipe:
    if m * n * batch == 0:
        return Recipe("")
    gsize = (round_up(n, ts * rt) // rt, round_up(m, ts * rt) // rt, batch)
    return Recipe(source, [Launch("matmul", gsize, (ts, ts, 1), tuple(Arg(i) for i in range(nargs)))])


def matmul(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """numpy.matmul: 1-D operands become a row (a) or a column (b); batch dims broadcast."""
    a, b = in_types
    t = ctype(a.dtype, traits, op)
    a2 = a.shape if a.rank > 1 else (1,) + a.shape
    b2 = b.shape if b.rank > 1 else b.shape + (1,)
    batch = broadcast(a2[:-2], b2[:-2])
    (m, k), n = a2[-2:], b2[-1]
    sa, sb = dense_strides(a2), dense_strides(b2)
    source, ts, rt = _product(t, t, m=m, n=n, k=k, batch=batch, a_strides=(sa[-2], sa[-1]),
                              b_strides=(sb[-2], sb[-1]), a_batch=_batch_strides(a2, batch),
                              b_batch=_batch_strides(b2, batch), result=t.store_stmt("y", "yo", "v"),
                              c=None, traits=traits)
    return _launch(source, ts, rt, m, n, math.prod(batch), 3)


def gemm(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """alpha * op(A) @ op(B) + beta * C: transposes are stride swaps, C broadcasts by zero strides."""
    a, b = in_types[:2]
    c = in_types[2] if len(in_types) > 2 else None
    y = out_types[0]
    t = ctype(a.dtype, traits, op)
    (m, n), k = y.shape, (a.shape[0] if attrs["trans_a"] else a.shape[1])
    sa, sb = dense_strides(a.shape), dense_strides(b.shape)
    a_strides = (sa[1], sa[0]) if attrs["trans_a"] else (sa[0], sa[1])
    b_strides = (sb[1], sb[0]) if attrs["trans_b"] else (sb[0], sb[1])
    value = f"{t.lit(float(attrs['alpha']))} * v"
    if c is not None:
        scm, scn = broadcast_strides(c.shape, (m, n))
        value += f" + {t.lit(float(attrs['beta']))} * {t.load('c', f'(long)m * {scm} + (long)n * {scn}')}"
    source, ts, rt = _product(t, t, m=m, n=n, k=k, batch=(), a_strides=a_strides, b_strides=b_strides,
                              a_batch=(), b_batch=(), result=t.store_stmt("y", "yo", value),
                              c=t if c is not None else None, traits=traits)
    return _launch(source, ts, rt, m, n, 1, len(in_types) + 1)


def linear(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """x @ w + b with the leading dims of x flattened into M (x is dense): the bias is added as
    each result is stored, so the result is written once."""
    x, w, b = in_types
    t = ctype(x.dtype, traits, op)
    k, n = w.shape
    m = x.size // k if k else math.prod(x.shape[:-1])
    bias = t.load("c", f"(long)n * {1 if b.shape == (n,) and n > 1 else 0}")
    source, ts, rt = _product(t, t, m=m, n=n, k=k, batch=(), a_strides=(k, 1), b_strides=(n, 1),
                              a_batch=(), b_batch=(), result=t.store_stmt("y", "yo", f"v + {bias}"),
                              c=t, traits=traits)
    return _launch(source, ts, rt, m, n, 1, 4)


GENERATORS = {"matmul": matmul, "gemm": gemm, "linear": linear}
