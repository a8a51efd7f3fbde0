"""polyhal_cpu.blas: the batched GEMM of numpy's own BLAS, on every operand layout it accepts, and
the attention kernel on both of its GEMM paths."""

from __future__ import annotations

import numpy as np
import pytest

from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal_cpu import blas, nn_kernels
from polyhal_cpu.kernels import prepare

DTYPES = [np.float32, np.float64]


def _batched(dtype):
    fn = blas.batched_matmul(np.dtype(dtype))
    if fn is None:
        pytest.skip(f"numpy's BLAS has no batched GEMM for {np.dtype(dtype)} (not OpenBLAS >= 0.3.29)")
    return fn


def _operand(rng, dtype, batch, rows, cols, layout):
    """A (batch, rows, cols) view: row-major, column-major (a transpose), or a column slice of
    a wider array (heads of a projection: leading dimension larger than cols)."""
    if layout == "row":
        return rng.standard_normal((batch, rows, cols)).astype(dtype)
    if layout == "col":
        return rng.standard_normal((batch, cols, rows)).astype(dtype).transpose(0, 2, 1)
    wide = rng.standard_normal((rows, batch * cols + 3)).astype(dtype)  # heads side by side
    return wide[:, : batch * cols].reshape(rows, batch, cols).transpose(1, 0, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("a_layout", ["row", "col", "heads"])
@pytest.mark.parametrize("b_layout", ["row", "col", "heads"])
def test_batched_matmul_matches_numpy(dtype, a_layout, b_layout):
    mm = _batched(dtype)
    rng = np.random.default_rng(0)
    batch, m, k, n = 3, 120, 72, 130  # m * n * k above MIN_MACS
    a = _operand(rng, dtype, batch, m, k, a_layout)
    b = _operand(rng, dtype, batch, k, n, b_layout)
    out = np.full((batch, m, n), np.nan, dtype)
    assert mm(a, b, out, 0.5)
    np.testing.assert_allclose(out, 0.5 * (a @ b), rtol=1e-4, atol=1e-4)


def test_batched_matmul_declines_what_it_cannot_do():
    mm = _batched(np.float32)
    rng = np.random.default_rng(1)
    small = rng.standard_normal((4, 32, 8)).astype(np.float32)
    out = np.zeros((4, 32, 32), np.float32)
    # OpenBLAS's small-matrix path (m * n * k <= 100**3) crashed in the batched call: declined.
    assert not mm(small, small.transpose(0, 2, 1), out)
    assert not out.any()
    big = rng.standard_normal((2, 128, 128)).astype(np.float32)
    strided = big[:, :, ::2]  # no unit stride in either matrix dimension
    assert not mm(strided, strided.transpose(0, 2, 1), np.zeros((2, 128, 128), np.float32))
    assert not mm(big, big, np.zeros((2, 128, 128), np.float32).transpose(0, 2, 1))  # output must be row-major


@pytest.mark.parametrize("batched", [True, False], ids=["batched BLAS", "numpy GEMMs"])
def test_attention_on_both_gemm_paths(monkeypatch, batched):
    if not batched:
        monkeypatch.setattr(blas, "batched_matmul", lambda dtype: None)
    elif blas.batched_matmul(np.dtype(np.float32)) is None:
        pytest.skip("numpy's BLAS has no batched GEMM")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 256, 3 * 128)).astype(np.float32)
    q, k, v = (x[..., i * 128:(i + 1) * 128].reshape(1, 256, 4, 32).transpose(0, 2, 1, 3) for i in range(3))
    types = tuple(TensorType(t.shape, t.dtype) for t in (q, k, v))
    (out_type,) = OPS["attention"].infer(types, {})
    out = np.full(out_type.shape, np.nan, np.float32)
    prepare("attention", {}, types, (out_type,))(q, k, v, out)
    (want,) = OPS["attention"].reference(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_attention_scores_are_planned_scratch():
    """The score block is declared scratch: sized per group of heads, float32 for float16."""
    from polyhal_cpu.kernels import TABLE

    t16 = TensorType((1, 4, 256, 32), np.float16)
    (req,) = TABLE.scratch(None, "attention", {}, (t16, t16, t16), (t16,))
    group = nn_kernels._attention_shape((t16, t16, t16))[0]
    assert req.bytes_per_launch == group * 256 * 256 * 4


def _gemm(dtype):
    fn = blas.gemm(np.dtype(dtype))
    if fn is None:
        pytest.skip(f"numpy's BLAS is not one polyhal_cpu.blas can call for {np.dtype(dtype)}")
    return fn


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("a_layout", ["row", "col", "heads"])
@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_gemm_accumulates_onto_out(dtype, a_layout, b_layout):
    gemm = _gemm(dtype)
    rng = np.random.default_rng(3)
    a = _operand(rng, dtype, 1, 40, 24, a_layout)[0]
    b = _operand(rng, dtype, 1, 24, 56, b_layout)[0]
    c = rng.standard_normal((40, 56)).astype(dtype)
    out = c.copy()
    assert gemm(a, b, out, 0.5, 2.0)
    np.testing.assert_allclose(out, 0.5 * (a @ b) + 2.0 * c, rtol=1e-5, atol=1e-5)
    assert gemm(a, b, out)  # beta 0: C's old contents do not matter, nan included
    out[...] = np.nan
    assert gemm(a, b, out)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-5)


def test_gemm_declines_what_it_cannot_do():
    gemm = _gemm(np.float32)
    a = np.ones((64, 64), np.float32)
    out = np.zeros((64, 64), np.float32)
    assert not gemm(a[:, ::2], a[::2], out[:, :32])  # a without a unit stride
    assert not gemm(a, a, out.T)  # a column-major result
    assert not out.any()
    assert blas.gemm(np.dtype(np.float32), blas.ACCUMULATE_ELEMENTS - 1) is None  # too small to pay
    assert blas.gemm(np.dtype(np.int32)) is None


@pytest.mark.parametrize("accumulate", [True, False], ids=["BLAS accumulates", "numpy matmul"])
def test_linear_and_gemm_kernels_on_both_paths(monkeypatch, accumulate):
    if not accumulate:
        monkeypatch.setattr(blas, "gemm", lambda dtype, size=None: None)
    elif blas.gemm(np.dtype(np.float32)) is None:
        pytest.skip("numpy's BLAS is not one polyhal_cpu.blas can call")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 128, 96)).astype(np.float32)[:, :, :64]  # strided: numpy copies it
    w, bias = rng.standard_normal((64, 512)).astype(np.float32), rng.standard_normal(512).astype(np.float32)
    types = tuple(TensorType(t.shape, t.dtype) for t in (x, w, bias))
    (out_type,) = OPS["linear"].infer(types, {})
    out = np.full(out_type.shape, np.nan, np.float32)
    prepare("linear", {}, types, (out_type,))(x, w, bias, out)
    np.testing.assert_allclose(out, x @ w + bias, rtol=1e-4, atol=1e-4)

    a, b, c = x[0], rng.standard_normal((512, 64)).astype(np.float32), rng.standard_normal((1, 512)).astype(np.float32)
    attrs = {"trans_b": 1, "alpha": 0.5, "beta": 3.0}
    types = tuple(TensorType(t.shape, t.dtype) for t in (a, b, c))
    (out_type,) = OPS["gemm"].infer(types, attrs)
    out = np.full(out_type.shape, np.nan, np.float32)
    prepare("gemm", attrs, types, (out_type,))(a, b, c, out)
    np.testing.assert_allclose(out, 0.5 * a @ b.T + 3.0 * c, rtol=1e-4, atol=1e-4)
