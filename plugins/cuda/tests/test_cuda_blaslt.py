"""linear through cublasLt with the bias in the epilogue, chosen per shape by timing (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from polyhal.ir.types import TensorType


@pytest.mark.parametrize("m,k,n", [(3152, 96, 384), (37, 50, 29), (1, 768, 8)])
def test_every_algorithm_of_the_heuristics_computes_the_linear(cuda, cp, rng, m, k, n):
    from polyhal_cuda import blas, blaslt

    lib, handle = blaslt._library(), blaslt._handle(cuda)
    call, algos = blaslt._matmul(lib, handle, blas.blas_for(cuda), cuda, m, k, n, False)
    assert algos, "cublasLt offered no algorithm with a bias epilogue"
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), (n,)))
    want = x.astype(np.float64) @ w + b
    dx, dw, db = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    for algo in algos:
        out = cp.full((m, n), np.nan, np.float32)
        call(algo, dx.data.ptr, dw.data.ptr, db.data.ptr, out.data.ptr)
        np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-4, atol=1e-4, err_msg=f"seed {rng.seed_value}")


@pytest.mark.parametrize("b_shape", [(), (1,)])
@pytest.mark.parametrize("m,k,n", [(4, 8, 32), (64, 14, 30), (10, 11, 8)])
def test_a_scalar_bias_is_broadcast_not_read_as_a_vector(cuda, cp, rng, m, k, n, b_shape):
    # cublasLt's bias epilogue reads n values: a one-value bias must stay on the cuBLAS path
    f = np.dtype(np.float32)
    fn = cuda.prepare("linear", {}, (TensorType((m, k), f), TensorType((k, n), f), TensorType(b_shape, f)),
                      (TensorType((m, n), f),))
    assert fn.inner.kernel_name == "cublasGemmStridedBatchedEx (linear)"
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (k, n), b_shape))
    out = cp.full((m, n), np.nan, np.float32)
    fn(cp.asarray(x), cp.asarray(w), cp.asarray(b), out)
    np.testing.assert_allclose(cp.asnumpy(out), x.astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)


def test_the_linear_kernel_takes_the_faster_path_and_views(cuda, cp, rng):
    f = np.dtype(np.float32)
    m, k, n = 512, 256, 384
    fn = cuda.prepare("linear", {}, (TensorType((2, m // 2, k), f), TensorType((k, n), f), TensorType((n,), f)),
                      (TensorType((2, m // 2, n), f),))
    assert fn.inner.kernel_name in ("cublasLtMatmul (bias epilogue)", "cublasGemmStridedBatchedEx (linear)")
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, m // 2, k), (k, n), (n,)))
    out = cp.full((2, m // 2, n), np.nan, np.float32)
    fn(cp.asarray(x), cp.asarray(w), cp.asarray(b), out)
    np.testing.assert_allclose(cp.asnumpy(out), x.astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)
    wide = cp.asarray(rng.standard_normal((2, m // 2, k + 8)).astype(np.float32))
    view = wide[:, :, 3:k + 3]  # rows at a stride: the kernel falls back to cuBLAS with ld
    fn(view, cp.asarray(w), cp.asarray(b), out)
    np.testing.assert_allclose(cp.asnumpy(out), cp.asnumpy(view).astype(np.float64) @ w + b, rtol=1e-4, atol=1e-4)


def test_every_algorithm_computes_a_gemm_with_transposed_weights(cuda, cp, rng):
    from polyhal_cuda import blas, blaslt

    m, k, n = 197, 96, 72
    lib, handle = blaslt._library(), blaslt._handle(cuda)
    call, algos = blaslt._matmul(lib, handle, blas.blas_for(cuda), cuda, m, k, n, False, True, 0.5)
    assert algos
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (n, k), (n,)))
    want = 0.5 * (x.astype(np.float64) @ w.T) + b
    dx, dw, db = cp.asarray(x), cp.asarray(w), cp.asarray(b)
    for algo in algos:
        out = cp.full((m, n), np.nan, np.float32)
        call(algo, dx.data.ptr, dw.data.ptr, db.data.ptr, out.data.ptr)
        np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-4, atol=1e-4, err_msg=f"seed {rng.seed_value}")


@pytest.mark.parametrize("c_shape", [(384,), (1, 384)])
def test_a_linear_layers_gemm_takes_the_bias_epilogue_path(cuda, cp, rng, c_shape):
    # ONNX's Gemm(x, W, C, transB=1) of a linear layer: C as cublasLt's bias where that measures faster
    f = np.dtype(np.float32)
    m, k, n = 3152, 256, 384
    fn = cuda.prepare("gemm", {"trans_b": 1}, (TensorType((m, k), f), TensorType((n, k), f), TensorType(c_shape, f)),
                      (TensorType((m, n), f),))
    assert fn.inner.kernel_name in ("cublasLtMatmul (bias epilogue)", "cublasGemmStridedBatchedEx")
    x, w, c = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (n, k), c_shape))
    out = cp.full((m, n), np.nan, np.float32)
    fn(cp.asarray(x), cp.asarray(w), cp.asarray(c), out)
    np.testing.assert_allclose(cp.asnumpy(out), x.astype(np.float64) @ w.T + c, rtol=1e-4, atol=1e-4)
    full = TensorType((m, n), f)  # a C of the result's shape stays on cuBLAS's beta
    fn = cuda.prepare("gemm", {"trans_b": 1}, (TensorType((m, k), f), TensorType((n, k), f), full), (full,))
    assert fn.inner.kernel_name == "cublasGemmStridedBatchedEx"


def test_libraries_are_taken_as_this_process_mapped_them():
    """cuBLAS and cuBLASLt are the copies already mapped (cupy's); a name prefix picks the file
    (libm.so, not another library whose name merely contains it). Runs without a GPU."""
    import ctypes

    from polyhal_cuda import blas

    with open("/proc/self/maps") as maps:
        libm = next(line.split()[-1] for line in maps if line.split()[-1].rsplit("/", 1)[-1].startswith("libm.so"))
    assert blas.mapped_library("libm.so")._name == libm
    assert isinstance(blas.mapped_library("libm.so"), ctypes.CDLL)
    with pytest.raises(OSError):
        blas.mapped_library("libpolyhal-not-there.so")
