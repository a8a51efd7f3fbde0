"""Matrix products: ``matmul`` (numpy semantics) and ``gemm`` (ONNX Gemm)."""

from __future__ import annotations

import numpy as np

from polyhal.errors import ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import (
    FLOAT, NUMERIC, bool_attr, broadcast, check_dtype, check_same_dtype, define, float_attr,
    fmt_shape, narrow, nonzero, pick, wide,
)

#: matmul and gemm accumulate over K terms in float32, so allow for K roundings.
_PRODUCT_TOLERANCE = (1e-4, 1e-5)


# --------------------------------------------------------------------------------------- matmul

def _infer_matmul(a: TensorType, b: TensorType):
    dtype = check_same_dtype(a, b)
    check_dtype(a, NUMERIC)
    for i, t in enumerate((a, b)):
        if t.rank == 0:
            raise ShapeError(f"operand {i} is 0-d; matmul needs operands of rank >= 1 (use mul for scalars)")
    # numpy's rule: a 1-D a is a row vector (1, K), a 1-D b a column (K, 1); the added dim is dropped.
    a2 = a.shape if a.rank > 1 else (1,) + a.shape
    b2 = b.shape if b.rank > 1 else b.shape + (1,)
    if a2[-1] != b2[-2]:
        raise ShapeError(
            f"inner dimensions do not match: operand 0 has shape {fmt_shape(a.shape)} (K={a2[-1]}) "
            f"but operand 1 has shape {fmt_shape(b.shape)} (K={b2[-2]})")
    try:
        batch = broadcast(a2[:-2], b2[:-2])
    except ShapeError:
        raise ShapeError(f"batch dimensions {fmt_shape(a2[:-2])} of operand 0 and {fmt_shape(b2[:-2])} "
                         f"of operand 1 do not broadcast") from None
    shape = batch + (a2[-2],) * (a.rank > 1) + (b2[-1],) * (b.rank > 1)
    return (TensorType(shape, dtype),)


def _ref_matmul(a, b):
    return (narrow(np.matmul(wide(a), wide(b)), a.dtype),)


_MATMUL_SHAPES = [
    ((4, 5), (5, 3)), ((5,), (5, 3)), ((4, 5), (5,)), ((7,), (7,)), ((2, 4, 5), (5, 3)),
    ((2, 1, 4, 5), (3, 5, 6)), ((64, 64), (64, 64)), ((3, 1, 8), (8, 2)),
]


def _sample_matmul(rng: np.random.Generator):
    sa, sb = pick(rng, _MATMUL_SHAPES)
    return [nonzero(rng, sa), nonzero(rng, sb)], {}


define("matmul", infer=_infer_matmul, reference=_ref_matmul, sample=_sample_matmul, arity=2,
       tolerance=_PRODUCT_TOLERANCE, contraction=True, doc="""
    Matrix product with numpy.matmul semantics: the last two dims multiply, leading (batch) dims
    broadcast; a 1-D first operand is a row vector and a 1-D second operand a column vector,
    the added dim being removed from the result. Numeric types (not bool).
""")


# ----------------------------------------------------------------------------------------- gemm

def _infer_gemm(a: TensorType, b: TensorType, c: TensorType | None = None, *,
                alpha, beta, trans_a, trans_b):
    operands = (a, b) if c is None else (a, b, c)
    dtype = check_same_dtype(*operands)
    check_dtype(a, FLOAT)
    float_attr(alpha, "alpha")
    float_attr(beta, "beta")
    for i, t in enumerate((a, b)):
        if t.rank != 2:
            raise ShapeError(f"operand {i} has shape {fmt_shape(t.shape)}; gemm needs 2-D A and B")
    m, ka = a.shape[::-1] if bool_attr(trans_a, "trans_a") else a.shape
    kb, n = b.shape[::-1] if bool_attr(trans_b, "trans_b") else b.shape
    if ka != kb:
        raise ShapeError(
            f"inner dimensions do not match: A{'^T' * bool(trans_a)} is ({m},{ka}) but "
            f"B{'^T' * bool(trans_b)} is ({kb},{n})")
    if c is not None and not _broadcasts_to(c.shape, (m, n)):
        raise ShapeError(f"C has shape {fmt_shape(c.shape)}, which does not broadcast to the "
                         f"result shape ({m},{n})")
    return (TensorType((m, n), dtype),)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts one way (without growing) to ``target``."""
    try:
        return broadcast(shape, target) == target
    except ShapeError:
        return False


def _ref_gemm(a, b, c=None, *, alpha=1.0, beta=1.0, trans_a=False, trans_b=False):
    a64, b64 = wide(a), wide(b)
    y = alpha * ((a64.T if trans_a else a64) @ (b64.T if trans_b else b64))
    if c is not None:
        y = y + beta * wide(c)
    return (narrow(y, a.dtype),)


def _sample_gemm(rng: np.random.Generator):
    m, k, n = (int(d) for d in rng.integers(1, 17, size=3))
    trans_a, trans_b = (bool(t) for t in rng.integers(0, 2, size=2))
    inputs = [nonzero(rng, (k, m) if trans_a else (m, k)), nonzero(rng, (n, k) if trans_b else (k, n))]
    if rng.random() < 0.75:
        inputs.append(nonzero(rng, pick(rng, [(n,), (m, n), (m, 1), (1, n), ()])))
    attrs = {"alpha": float(pick(rng, [1.0, 0.5, -1.5])), "beta": float(pick(rng, [1.0, 2.0, -0.25])),
             "trans_a": trans_a, "trans_b": trans_b}
    return inputs, attrs


define("gemm", infer=_infer_gemm, reference=_ref_gemm, sample=_sample_gemm, arity=(2, 3),
       tolerance=_PRODUCT_TOLERANCE, contraction=True, doc="""
    ONNX Gemm: Y = alpha * A' @ B' + beta * C, where A' is A transposed when trans_a and B' is B
    transposed when trans_b. A and B are 2-D; the optional C broadcasts (one way) to the (M, N)
    result. Float types only.
""")


# ------------------------------------------------------------------------------------------ det

def _infer_det(x: TensorType):
    check_dtype(x, FLOAT)
    if x.rank < 2 or x.shape[-1] != x.shape[-2]:
        raise ShapeError(f"x must be [..., M, M] (square matrices), got {fmt_shape(x.shape)}")
    return (TensorType(x.shape[:-2], x.dtype),)


def _ref_det(x):
    mats = wide(x).reshape((-1,) + x.shape[-2:])
    out = np.empty(mats.shape[0])
    for i, a in enumerate(mats):
        a, d = a.copy(), 1.0
        for col in range(a.shape[0]):  # Gaussian elimination with partial pivoting
            p = col + int(np.argmax(np.abs(a[col:, col])))
            if a[p, col] == 0:
                d = 0.0
                break
            if p != col:
                a[[col, p]] = a[[p, col]]
                d = -d
            d *= a[col, col]
            a[col + 1:] -= np.outer(a[col + 1:, col] / a[col, col], a[col])
        out[i] = d
    return (narrow(out.reshape(x.shape[:-2]), x.dtype),)


def _sample_det(rng: np.random.Generator):
    m = int(rng.integers(1, 6))
    return [nonzero(rng, pick(rng, [(), (3,), (2, 2)]) + (m, m)).astype(pick(rng, [np.float32, np.float64]))], {}


define("det", infer=_infer_det, reference=_ref_det, sample=_sample_det, arity=1, tolerance=(1e-4, 1e-5), doc="""
    ONNX Det: the determinant of each square matrix of x [..., M, M]; the result is x.shape[:-2].
""")
