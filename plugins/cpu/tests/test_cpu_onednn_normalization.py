"""Layer norm and softmax as oneDNN primitives (polyhal_cpu.onednn_normalization), where the
compiled loops are not loaded (here: POLYHAL_CPU_NATIVE=0, as in a first run while they build):
real library calls, checked against the ops' references; refused instances on the CPU's own
kernels."""

from __future__ import annotations

import numpy as np
import pytest

from polyhal.ir.types import TensorType
from polyhal.ops import OPS, resolve_attrs
from polyhal_cpu import onednn, onednn_kernels, onednn_normalization
from polyhal_cpu.kernels import prepare

pytestmark = pytest.mark.skipif(not onednn.usable(), reason=f"oneDNN is not usable here: {onednn.status()[1]}")
RNG = np.random.default_rng(31)


@pytest.fixture(autouse=True)
def _no_loops(monkeypatch):
    monkeypatch.setenv("POLYHAL_CPU_NATIVE", "0")  # the library kernels' tier


def _run(op: str, attrs: dict, *ins: np.ndarray):
    attrs = resolve_attrs(op, attrs)
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    kernel = prepare(op, attrs, types, types[:1])
    out = np.empty_like(ins[0])
    kernel(*ins, out)
    (want,) = OPS[op].reference(*ins, **attrs)
    return kernel, out, want


@pytest.mark.parametrize("shape, axis", [((1, 128, 128), -1), ((3, 5, 768), 2), ((2, 3, 4, 6), 2)])
def test_layer_norm_runs_as_a_primitive_within_float32_tolerance(shape, axis):
    x = RNG.standard_normal(shape).astype(np.float32) * 3 + 1
    span = shape[axis:]
    scale, bias = RNG.standard_normal(span).astype(np.float32), RNG.standard_normal(span).astype(np.float32)
    kernel, got, want = _run("layer_norm", {"axis": axis, "epsilon": 1e-5}, x, scale, bias)
    assert getattr(kernel, "kernel_name", kernel.__qualname__).startswith("oneDNN layer_norm")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 4, 128, 128), (7, 1000), (3, 1)])
def test_last_axis_softmax_runs_as_a_primitive_within_float32_tolerance(shape):
    x = RNG.standard_normal(shape).astype(np.float32) * 10
    kernel, got, want = _run("softmax", {"axis": -1}, x)
    assert kernel.kernel_name.startswith("oneDNN softmax")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("activation, alpha, beta", [("none", 0, 0), ("relu", 0, 0), ("clip", -0.5, 1.5),
                                                     ("hard_swish", 1 / 6, 0.5), ("sigmoid", 0, 0), ("silu", 0, 0),
                                                     ("gelu", 0, 0)])
@pytest.mark.parametrize("shape", [(1, 16, 7, 9), (3, 5), (2, 4, 3, 5, 6)])
def test_scale_shift_runs_as_a_binary_primitive_within_its_tolerance(shape, activation, alpha, beta):
    x = RNG.standard_normal(shape).astype(np.float32) * 3
    c = shape[1]
    scale, shift = RNG.standard_normal(c).astype(np.float32), RNG.standard_normal(c).astype(np.float32)
    attrs = {"activation": activation, "alpha": alpha, "beta": beta}
    kernel, got, want = _run("scale_shift", attrs, x, scale, shift)
    assert kernel.kernel_name.startswith("oneDNN scale_shift"), kernel
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # scale_shift's own tolerance
    kernel(x[:, ::-1].copy(), scale, shift, got)  # operands of another call: nothing kept from the first
    np.testing.assert_allclose(got, OPS["scale_shift"].reference(x[:, ::-1], scale, shift, **attrs)[0],
                               rtol=1e-4, atol=1e-5)


def test_scale_shift_stays_on_the_compiled_loop_where_loaded(monkeypatch):
    from polyhal_cpu import native

    monkeypatch.setenv("POLYHAL_CPU_NATIVE", "1")
    if not native.available():
        pytest.skip("no compiled loops here")
    x = RNG.standard_normal((1, 8, 6, 6)).astype(np.float32)
    kernel, got, want = _run("scale_shift", {"activation": "relu"}, x, np.ones(8, np.float32), np.zeros(8, np.float32))
    assert not getattr(kernel, "kernel_name", "").startswith("oneDNN")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["layer_norm", "softmax", "scale_shift"])
def test_a_strided_view_is_copied_and_the_copy_held_while_the_primitive_reads_it(op):
    # ConvNeXt's channel layer norms get a transposed view: the primitive must read a copy that
    # is still alive (the address of a temporary copy was freed memory by the call: 5% off)
    base = RNG.standard_normal((2, 96, 9, 7)).astype(np.float32) * 3 + 1
    # scale_shift: a reversed view, its channels where scale_shift wants them
    x = base[:, :, ::-1] if op == "scale_shift" else base.transpose(0, 2, 3, 1)
    assert not x.flags.c_contiguous
    c = x.shape[-1] if op == "layer_norm" else x.shape[1]
    params = {"layer_norm": (RNG.standard_normal(c).astype(np.float32), RNG.standard_normal(c).astype(np.float32)),
              "softmax": (), "scale_shift": (RNG.standard_normal(c).astype(np.float32),
                                             RNG.standard_normal(c).astype(np.float32))}[op]
    attrs = {"layer_norm": {"axis": -1, "epsilon": 1e-6}, "softmax": {"axis": -1},
             "scale_shift": {"activation": "relu"}}[op]
    attrs = resolve_attrs(op, attrs)
    types = tuple(TensorType(a.shape, a.dtype) for a in (x, *params))
    kernel = prepare(op, attrs, types, types[:1])
    assert kernel.kernel_name.startswith(f"oneDNN {op}")
    (want,) = OPS[op].reference(x, *params, **attrs)
    for _ in range(3):
        out = np.empty(x.shape, np.float32)
        kernel(x, *params, out)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["max_pool", "avg_pool"])
@pytest.mark.parametrize("shape, attrs", [
    ((1, 16, 20, 20), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 8, 9, 11), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ((2, 8, 9, 11), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 0, 1], "count_include_pad": 1}),
    ((2, 3, 17), {"kernel_shape": [4], "strides": [3], "pads": [1, 2]}),
    ((1, 2, 5, 6, 7), {"kernel_shape": [2, 2, 3], "strides": [1, 2, 2]}),
])
def test_pools_run_as_primitives_within_float32_tolerance(op, shape, attrs):
    x = RNG.standard_normal(shape).astype(np.float32)
    if op == "max_pool":
        attrs = {k: v for k, v in attrs.items() if k != "count_include_pad"}
    attrs = resolve_attrs(op, attrs)
    (want,) = OPS[op].reference(x, **attrs)
    kernel = prepare(op, attrs, (TensorType(x.shape, x.dtype),), (TensorType(want.shape, want.dtype),))
    assert kernel.kernel_name.startswith(f"oneDNN {op}"), kernel
    got = np.full(want.shape, np.nan, np.float32)
    kernel(x, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op, attrs", [
    ("avg_pool", {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 0, 0], "ceil_mode": 1,
                  "count_include_pad": 1}),  # oneDNN would count ceil_mode's end padding
    ("max_pool", {"kernel_shape": [2, 2], "dilations": [2, 2]}),  # oneDNN 3.2: ref:any only
])
def test_pools_oneDNN_does_not_take_stay_on_the_cpus_own_kernel(op, attrs):
    x = RNG.standard_normal((1, 2, 10, 10)).astype(np.float32)  # 10: ceil_mode pads the end by 1
    attrs = resolve_attrs(op, attrs)
    (want,) = OPS[op].reference(x, **attrs)
    kernel = prepare(op, attrs, (TensorType(x.shape, x.dtype),), (TensorType(want.shape, want.dtype),))
    assert not getattr(kernel, "kernel_name", "").startswith("oneDNN")
    got = np.empty(want.shape, np.float32)
    kernel(x, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_inner_axis_softmax_and_float64_run_on_the_cpus_own_kernels_with_the_reason_kept():
    x = RNG.standard_normal((4, 6, 5)).astype(np.float32)
    kernel, got, want = _run("softmax", {"axis": 1}, x)
    assert not getattr(kernel, "kernel_name", "").startswith("oneDNN")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert any(k[0] == "softmax" and "inner axis" in why for k, why in onednn_kernels.refusals().items())
    x64 = RNG.standard_normal((4, 8))
    kernel, got, want = _run("layer_norm", {"axis": -1, "epsilon": 1e-5}, x64, np.ones(8), np.zeros(8))
    assert not getattr(kernel, "kernel_name", "").startswith("oneDNN")  # oneDNN is not asked about float64
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_the_compiled_loops_keep_the_layer_norms_where_loaded(monkeypatch):
    from polyhal_cpu import native

    monkeypatch.setenv("POLYHAL_CPU_NATIVE", "1")
    if not native.available():
        pytest.skip("no compiled loops here")
    t, row = TensorType((8, 16), np.float32), TensorType((16,), np.float32)
    attrs = {"axis": -1, "epsilon": 1e-5}
    assert onednn_normalization.plan("layer_norm", attrs, (t, row, row), (t,)) is None  # the loop was faster
    big = TensorType((16, onednn_normalization.PREFERRED_FROM_ELEMENTS // 16), np.float32)
    assert onednn_normalization.plan("softmax", {"axis": -1}, (big,), (big,)) is not None  # the primitive was
    # A small softmax stays on the loop too: a call's fixed cost decides there.
    assert onednn_normalization.plan("softmax", {"axis": -1}, (t,), (t,)) is None
