"""polyhal_cpu.native: the numba-compiled fused loops agree with numpy's passes and the op
references, special values included, and are used only where they apply."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal_cpu import native
from polyhal_cpu.kernels import prepare

pytestmark = pytest.mark.skipif(not native.available(np.float32), reason="no compiled loops here (numba missing, or POLYHAL_CPU_NATIVE=0)")


def test_used_for_float32_only_and_switchable(monkeypatch):
    assert not native.available(np.float64)
    assert not native.available(np.float16)  # float16 kernels run as float32, and reach it that way
    monkeypatch.setenv("POLYHAL_CPU_NATIVE", "0")
    assert not native.available(np.float32)


def test_exp2_within_two_ulp_and_saturating():
    from polyhal_cpu.native_loops import exp2

    t = np.concatenate([np.linspace(-126, 127.4, 20001), [-0.5, 0.5, 0.0, 1e-8, -1e-8]]).astype(np.float32)
    got = np.array([exp2(v) for v in t], np.float32)
    want = np.exp2(t.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 2
    # Beyond float32's range: 0 below (subnormals flush), inf above (from 2^127.5 on).
    assert exp2(np.float32(-200)) == 0 and exp2(np.float32(200)) == np.inf and exp2(np.float32(np.inf)) == np.inf
    assert np.isnan(exp2(np.float32(np.nan)))


def _run(name, inputs, attrs):
    types = tuple(TensorType(x.shape, x.dtype) for x in inputs)
    out_types = OPS[name].infer(types, attrs)
    outs = [np.full(t.shape, np.nan, t.dtype) for t in out_types]
    prepare(name, attrs, types, out_types)(*inputs, *outs)
    return outs, OPS[name].reference(*inputs, **attrs)


@pytest.fixture(params=["native", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setenv("POLYHAL_CPU_NATIVE", "0")
    return request.param


def test_gelu_tanh(path):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4991) * 4, [0.0, -0.0, 1e-30, -1e-30, 30, -30, 1e4, -1e4, np.inf]])
    x = x.astype(np.float32).reshape(-1, 10)[:, :5]  # strided: the kernel copies it
    (got,), (want,) = _run("gelu", [x], {"approximate": "tanh"})
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    with np.errstate(invalid="ignore"):  # the reference warns on -inf * 0
        (nan,), _ = _run("gelu", [np.array([np.nan, -np.inf], np.float32)], {"approximate": "tanh"})
    assert np.isnan(nan).all()  # nan stays nan; -inf * 0 is nan, as in the reference


def test_epilogue_gelu_is_the_gelu_kernels():
    """A fused epilogue's erf GELU (conv, linear) gives the standalone loop's values bit for
    bit, special values included: one formula, in line in both."""
    x = np.concatenate([np.linspace(-9, 9, 1001), [np.nan, np.inf, -np.inf, 0.0, -0.0, 3e38]]).astype(np.float32)
    want = np.empty_like(x)
    native.gelu_erf(x, want)
    got = x.copy().reshape(1, -1)
    native.epilogue(got, np.zeros(1, np.float32), None, native.activation_code("gelu"), 0.0, 0.0)
    np.testing.assert_array_equal(got[0], want)
    exact = np.array([v / 2 * (1 + math.erf(v / math.sqrt(2))) for v in x[:1001].astype(np.float64)])
    np.testing.assert_allclose(got[0, :1001], exact, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape, axis", [((2, 37, 16), -1), ((5, 6, 7), 1), ((3, 4096), -1), ((1, 1, 1), -1)])
def test_layer_norm(path, shape, axis):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 3 + 5).astype(np.float32)
    norm = shape[axis % len(shape):]
    scale, bias = rng.standard_normal(norm).astype(np.float32), rng.standard_normal(norm).astype(np.float32)
    outs, wants = _run("layer_norm", [x, scale, bias], {"axis": axis, "epsilon": 1e-5})
    np.testing.assert_allclose(outs[0], wants[0], rtol=1e-4, atol=1e-4)


def test_layer_norm_special_values(path):
    x = np.array([[1.0, 2.0, 3.0, 4.0], [np.nan, 1.0, 2.0, 3.0], [np.inf, 1.0, 2.0, 3.0], [5.0] * 4], np.float32)
    ones, zeros = np.ones(4, np.float32), np.zeros(4, np.float32)
    with np.errstate(invalid="ignore"):  # the reference warns on the nan and inf rows
        (got,), _ = _run("layer_norm", [x, ones, zeros], {"axis": -1, "epsilon": 1e-5})
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all() and np.isnan(got[2]).all()
    np.testing.assert_array_equal(got[3], zeros)  # a constant row: 0 / sqrt(eps)


def test_linear_bias_rows_and_attention_normalisation(path):
    rng = np.random.default_rng(2)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((3, 40, 24), (24, 20), (20,)))
    (got,), (want,) = _run("linear", [x, w, b], {})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    q, k, v = (rng.standard_normal((2, 3, 130, 16)).astype(np.float32) for _ in range(3))
    (got,), (want,) = _run("attention", [q, k, v], {})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_relu_and_softmax(path):
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.standard_normal(997) * 5, [np.nan, np.inf, -np.inf]]).astype(np.float32)
    (got,), (want,) = _run("relu", [x[::2]], {})  # strided
    np.testing.assert_array_equal(got, want)
    rows = (rng.standard_normal((6, 300)) * 30).astype(np.float32)
    rows[1, 7], rows[2, 9], rows[3] = np.nan, np.inf, -np.inf  # nan, +inf, and an all -inf row
    rows[4, :] = 1e30  # equal huge scores
    with np.errstate(invalid="ignore"):
        (got,), (want,) = _run("softmax", [rows], {"axis": -1})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
