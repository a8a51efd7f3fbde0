"""conv and fused_conv through cuDNN (polyhal_cuda.cudnn) against float64 references: groups,
depthwise, stride / dilation / asymmetric pads, 1-d and 3-d, every epilogue activation with and
without a residual; the fallback when cuDNN is off; what the plugin advertises (GPU for most)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.ir.types import TensorType
from polyhal.ops import OPS

from polyhal_cuda import cudnn, plugin
from polyhal_cuda.kernels import KERNEL_NAMES

# (x shape, w shape, attrs): the shapes the CNNs of the suite have, and the corners.
CASES = {
    "3x3": ((2, 8, 12, 12), (16, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    "1x1": ((2, 16, 7, 7), (8, 16, 1, 1), dict()),
    "stride2_asym_pads": ((1, 4, 11, 9), (6, 4, 3, 3), dict(strides=[2, 2], pads=[0, 1, 2, 1])),
    "dilation2": ((1, 4, 13, 13), (4, 4, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    "groups2": ((2, 8, 9, 9), (6, 4, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": ((2, 12, 10, 10), (12, 1, 5, 5), dict(group=12, pads=[2, 2, 2, 2], strides=[2, 2])),
    "nonsquare_kernel": ((1, 3, 8, 10), (5, 3, 2, 4), dict(pads=[0, 1, 1, 2])),
    "conv1d": ((2, 4, 20), (6, 4, 5), dict(pads=[2, 1], strides=[2])),
    "conv3d": ((1, 3, 6, 7, 5), (4, 3, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1])),
}
ACTS = {"none": (0.0, 0.0), "relu": (0.0, 0.0), "clip": (-0.5, 1.5), "sigmoid": (0.0, 0.0), "silu": (0.0, 0.0),
        "gelu": (0.0, 0.0), "gelu_tanh": (0.0, 0.0), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}


def _attrs(x, w, extra):
    n = len(x) - 2
    return {"strides": [1] * n, "pads": [0] * 2 * n, "dilations": [1] * n, "group": 1, **extra}


def _run(cuda, op, inputs, attrs):
    import cupy as cp

    in_types = tuple(TensorType(a.shape, a.dtype) for a in inputs)
    out_types = OPS[op].infer(in_types, attrs)
    fn = cuda.prepare(op, attrs, in_types, out_types)
    with cuda.activate():
        dev = [cp.asarray(a) for a in inputs]
        out = cp.full(out_types[0].shape, np.nan, out_types[0].dtype)
    fn(*dev, out)
    cuda.synchronize()
    return cp.asnumpy(out), getattr(getattr(fn, "inner", fn), "kernel_name", "")  # the device wraps kernels


def _reference(op, inputs, attrs):
    return OPS[op].reference(*[a.astype(np.float64) for a in inputs], **attrs)[0]


def _rel_error(got, want):
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_conv_against_float64(cuda, rng, case, bias):
    xs, ws, extra = CASES[case]
    attrs = _attrs(xs, ws, extra)
    inputs = [rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)]
    if bias:
        inputs.append(rng.standard_normal(ws[0], dtype=np.float32))
    got, name = _run(cuda, "conv", inputs, attrs)
    want = _reference("conv", inputs, attrs)
    # fp32 means fp32: TF32 would be ~1e-3 here (10 mantissa bits)
    assert _rel_error(got, want) < 2e-6, (case, name, _rel_error(got, want), rng.seed_value)
    if cudnn.usable():
        assert name.startswith("cuDNN conv"), name


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("case", ["3x3", "depthwise", "stride2_asym_pads"])
def test_fused_conv_against_float64(cuda, rng, act, residual, case):
    xs, ws, extra = CASES[case]
    alpha, beta = ACTS[act]
    attrs = {**_attrs(xs, ws, extra), "activation": act, "alpha": alpha, "beta": beta}
    inputs = [rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32),
              rng.standard_normal(ws[0], dtype=np.float32)]
    if residual:
        (out,) = OPS["conv"].infer(tuple(TensorType(a.shape, a.dtype) for a in inputs[:2]), _attrs(xs, ws, extra))
        inputs.append(rng.standard_normal(out.shape, dtype=np.float32))
    got, name = _run(cuda, "fused_conv", inputs, attrs)
    want = _reference("fused_conv", inputs, attrs)
    assert np.isfinite(got).all(), name
    assert _rel_error(got, want) < 5e-6, (act, residual, case, name, _rel_error(got, want), rng.seed_value)
    if cudnn.usable():
        assert name.startswith("cuDNN conv+bias"), name


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_float_types(cuda, rng, dtype):
    xs, ws, extra = CASES["3x3"]
    attrs = {**_attrs(xs, ws, extra), "activation": "relu", "alpha": 0.0, "beta": 0.0}
    inputs = [rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype),
              rng.standard_normal(ws[0]).astype(dtype)]
    got, name = _run(cuda, "fused_conv", inputs, attrs)
    want = _reference("fused_conv", inputs, attrs)
    tol = 2e-3 if dtype == np.float16 else 1e-12
    assert _rel_error(got.astype(np.float64), want) < tol, (dtype, name, _rel_error(got.astype(np.float64), want))


def test_cudnn_off_falls_back_to_im2col(cuda, rng, monkeypatch):
    monkeypatch.setenv("POLYHAL_CUDA_CUDNN", "0")
    assert cudnn.status() == (None, "POLYHAL_CUDA_CUDNN=0 turned cuDNN off")
    xs, ws, extra = CASES["groups2"]
    attrs = {**_attrs(xs, ws, extra), "activation": "hard_swish", "alpha": 1 / 6, "beta": 0.5}
    inputs = [rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32),
              rng.standard_normal(ws[0], dtype=np.float32)]
    (out,) = OPS["conv"].infer(tuple(TensorType(a.shape, a.dtype) for a in inputs[:2]), _attrs(xs, ws, extra))
    inputs.append(rng.standard_normal(out.shape, dtype=np.float32))
    got, name = _run(cuda, "fused_conv", inputs, attrs)
    assert name.startswith("fused_conv (im2col"), name
    assert _rel_error(got, _reference("fused_conv", inputs, attrs)) < 5e-6


def test_plugin_advertises_fused_conv_only_with_cudnn():
    on_limits, on_names = plugin.conv_path(("cudnn 9.19.0", ""))
    off_limits, off_names = plugin.conv_path((None, "nvidia-cudnn-frontend is not installed"))
    assert "fused_conv" in on_names and "fused_conv" not in off_names
    assert on_names - off_names == {"fused_conv"} and "conv" in off_names
    assert on_limits["conv"].startswith("cudnn 9.19.0")
    assert off_limits["conv"] == "im2col + cuBLAS fallback: nvidia-cudnn-frontend is not installed"
    assert "fused_conv" in KERNEL_NAMES  # the table runs it either way (im2col + epilogue without cuDNN)


def test_devices_say_how_convs_run(cuda):
    version, why = cudnn.status()
    assert cuda.spec.limits["conv"] == plugin.conv_path((version, why))[0]["conv"]
    assert ("fused_conv" in polyhal.default_registry().kernel_names(cuda.spec.name)) == (version is not None)
    assert ("cudnn" in cuda.spec.capabilities) == (version is not None)


def test_compiled_resnet_block(cuda, rng, tmp_path):
    """Conv + BatchNormalization + Add + Relu from ONNX: one fused_conv on cuda with cuDNN (conv,
    add, relu without), the plan's result (replayed) equal to the float64 reference."""
    onnx = pytest.importorskip("onnx")
    import polyhal.onnx
    from onnx import TensorProto, helper, numpy_helper

    x = rng.standard_normal((2, 8, 14, 14), dtype=np.float32)
    w = (rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32)
    scale, shift = (1 + 0.1 * rng.standard_normal(8)).astype(np.float32), (0.1 * rng.standard_normal(8)).astype(np.float32)
    mean, var = (0.1 * rng.standard_normal(8)).astype(np.float32), (1 + 0.1 * np.abs(rng.standard_normal(8))).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (scale, "s"), (shift, "t"), (mean, "m"), (var, "v"))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "t", "m", "v"], ["bn"]),
             helper.make_node("Add", ["bn", "x"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)], inits)
    path = tmp_path / "block.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    program = polyhal.onnx.load(path)
    plan = program.compile(cuda.spec.name)
    ops = [op.name for op in plan.program.ops if op.kind == "dispatch"]
    assert ops == (["fused_conv"] if cudnn.usable() else ["conv", "add", "relu"]), ops
    x64 = x.astype(np.float64)
    conv = OPS["conv"].reference(x64, w.astype(np.float64), pads=[1, 1, 1, 1])[0]
    a = (scale / np.sqrt(var.astype(np.float64) + 1e-5))[:, None, None]
    want = np.maximum(conv * a + (shift - mean * a[:, 0, 0])[:, None, None] + x64, 0)
    for _ in range(3):  # the first run records the CUDA graph, later ones replay it
        (got,) = program.execute(plan, {"x": x}).values()
        assert _rel_error(np.asarray(got), want) < 5e-6
