"""Edge cases of the CPU softmax (a shift per block of rows) and attention (exp2 with a shift per
group of heads, scores computed a block of query rows at a time) kernels, and of matmul operands
in layouts BLAS cannot take."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal_cpu.kernels import prepare


def _run(name, inputs, attrs):
    in_types = tuple(TensorType(x.shape, x.dtype) for x in inputs)
    out_types = OPS[name].infer(in_types, attrs)
    outs = [np.full(t.shape, np.nan, t.dtype) for t in out_types]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf - inf in the references and kernels
        prepare(name, attrs, in_types, out_types)(*inputs, *outs)
        want = OPS[name].reference(*inputs, **attrs)
    return outs, want


def _close(got, want, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


def _softmax_cases():
    rng = np.random.default_rng(0)
    g = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    ranges = g(300, 50) * 3
    ranges[5] -= 1000  # far below its block's maximum: done again on its own
    ranges[7] += 500
    masked = g(64, 64)
    masked[3] = -np.inf  # a fully masked row: nan, as the reference
    masked[4, :10] = -np.inf
    inf, nan = g(64, 64), g(64, 64)
    inf[3, 5], nan[3, 5] = np.inf, np.nan
    return {
        "blocks": (g(4, 256, 256), -1), "tail block": (g(7, 33), -1), "row ranges": (ranges, -1),
        "masked": (masked, -1), "inf": (inf, -1), "nan": (nan, -1), "long rows": (g(16, 5000), 1),
        "float64": (g(16, 20).astype(np.float64) * 50, -1), "float16": (g(16, 20).astype(np.float16), -1),
        "inner axis": (g(3, 16, 20), 1), "strided": (g(16, 40).T, -1),
        "onnx large number": (np.array([[0, 1, 2, 3], [10000, 10001, 10002, 10003]], np.float32), -1),
    }


@pytest.mark.parametrize("case", list(_softmax_cases()))
def test_softmax_edge_cases(case):
    x, axis = _softmax_cases()[case]
    (got,), (want,) = _run("softmax", [x], {"axis": axis})
    tol = 2e-3 if x.dtype == np.float16 else 1e-5
    _close(got, want, tol, 1e-6)


def _views(rng, batch=1, seq=32, heads=4, dh=8):
    """q, k, v as strided (batch, heads, seq, dh) views of one (batch, seq, 3 * heads * dh) array."""
    x = rng.standard_normal((batch, seq, 3 * heads * dh)).astype(np.float32)
    split = [x[..., i * heads * dh:(i + 1) * heads * dh].reshape(batch, seq, heads, dh).transpose(0, 2, 1, 3)
             for i in range(3)]
    assert not any(a.flags.c_contiguous for a in split)
    return split


def _attention_cases():
    rng = np.random.default_rng(1)
    g = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    rows = g(16, 8)
    rows[4] *= 50  # one row's scores far above the others'
    inf_q, nan_k = g(16, 8), g(20, 8)
    inf_q[2, 1], nan_k[2, 1] = np.inf, np.nan
    unsampled = g(32, 8)  # the shift comes from every 8th row: rows 1, 3, 5 are not looked at
    unsampled[1] *= 200  # overflows exp2 unshifted: done again on its own
    unsampled[3, 0], unsampled[5] = np.inf, np.nan
    neg_inf = g(12, 4)
    neg_inf[::2, 0] = -np.inf  # -inf scores in every other row: the clamp before exp2
    return {
        "heads as views": (_views(rng), None),
        "large scores": ([g(7, 5) * 20, g(9, 5) * 20, g(9, 4)], 1.0),
        "row ranges": ([rows, g(16, 8), g(16, 3)], 1.0),
        "all negative": ([-np.abs(g(8, 4)) * 100, np.abs(g(10, 4)), g(10, 2)], 1.0),
        "inf in q": ([inf_q, g(20, 8), g(20, 3)], None),
        "nan in k": ([g(16, 8), nan_k, g(20, 3)], None),
        "-inf scores": ([neg_inf, np.abs(g(6, 4)) + 0.1, g(6, 3)], 1.0),
        "rows outside the sample": ([unsampled, g(20, 8), g(20, 3)], 1.0),
        "several groups": ([g(6, 300, 4), g(6, 400, 4), g(6, 400, 3)], None),
        "long keys": ([g(3, 2, 5), g(3, 6000, 5), g(3, 6000, 2)], None),
        "float64": ([g(4, 3).astype(np.float64) * 30, g(6, 3).astype(np.float64), g(6, 2).astype(np.float64)], None),
        "float16": ([g(4, 3).astype(np.float16), g(6, 3).astype(np.float16), g(6, 2).astype(np.float16)], None),
    }


@pytest.mark.parametrize("queue", [True, False], ids=["gemm queue", "numpy steps"])
@pytest.mark.parametrize("case", list(_attention_cases()))
def test_attention_edge_cases(case, queue, monkeypatch):
    # float32 attention runs on the pool's compiled GEMM queue where there is one (its
    # softmax an epilogue of the scores' GEMM); without it, as numpy and compiled steps
    if not queue:
        from polyhal_cpu import parallel

        monkeypatch.setattr(parallel, "_fn", None)
    inputs, scale = _attention_cases()[case]
    (got,), (want,) = _run("attention", inputs, {} if scale is None else {"scale": scale})
    if inputs[0].dtype == np.float16:
        _close(got, want, 2e-3, 1e-3)
    else:
        _close(got, want, 1e-4, 1e-5)


@pytest.mark.parametrize("case", ["heads as views", "rows outside the sample", "several groups"])
def test_attention_scores_in_blocks_of_rows(case, monkeypatch):
    # Blocks of a few query rows for the scores' GEMM (and a shorter tail block), with the
    # transposing copy of k in several tiles: the same results as the reference.
    from polyhal_cpu import nn_kernels, parallel

    monkeypatch.setattr(parallel, "_fn", None)  # numpy's steps: the GEMM queue has no such blocks
    monkeypatch.setattr(nn_kernels, "_ATTENTION_SCORE_MACS", 1)  # the fewest rows a block has: 16
    monkeypatch.setattr(nn_kernels, "_TRANSPOSE_TILE", 3)
    inputs, scale = _attention_cases()[case]
    assert inputs[0].shape[-2] > 16  # several blocks (300 rows: a shorter tail block too)
    (got,), (want,) = _run("attention", inputs, {} if scale is None else {"scale": scale})
    _close(got, want, 1e-4, 1e-5)


@pytest.mark.parametrize("op", ["matmul", "gemm", "linear"])
def test_matmul_operands_without_a_unit_stride(op):
    # An operand with no unit stride in its matrix dims (a strided view): numpy's matmul would
    # not use BLAS on it; the kernels copy it first and give the same result.
    rng = np.random.default_rng(2)
    a = rng.standard_normal((12, 32)).astype(np.float32)[:, ::2]  # (12, 16), strides (128, 8)
    assert 4 not in a.strides
    w = rng.standard_normal((16, 5)).astype(np.float32)
    inputs = {"matmul": [a, w], "gemm": [a, w], "linear": [a, w, rng.standard_normal(5).astype(np.float32)]}[op]
    (got,), (want,) = _run(op, inputs, {})
    _close(got, want, 1e-4, 1e-5)
