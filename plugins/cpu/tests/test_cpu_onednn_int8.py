"""int8 convs and matmuls on the CPU (polyhal_cpu.onednn_int8) and the QDQ fusion that feeds them
(polyhal.passes.fuse_quantized): ONNX models as onnxruntime's quantizer writes them, checked
against onnx's reference evaluator (the float QDQ semantics) within one quantization step.

The weights are drawn within [-64, 64]: on CPUs without VNNI (AVX2, as the AMD EPYC VM) oneDNN, as
onnxruntime, sums uint8 x int8 products in pairs into int16, which saturate beyond that (explain
says so; see the module docstring of polyhal_cpu.onednn_int8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import polyhal  # noqa: E402
import polyhal.onnx as ponnx  # noqa: E402
from polyhal.errors import DTypeError, PolyhalError  # noqa: E402
from polyhal.ir.types import TensorType  # noqa: E402
from polyhal.ops import OPS  # noqa: E402
from polyhal.passes.fuse_quantized import fuse_quantized, int8_weights  # noqa: E402
from polyhal_cpu import onednn  # noqa: E402

needs_onednn = pytest.mark.skipif(not onednn.usable(), reason=f"oneDNN is not usable here: {onednn.status()[1]}")
_Q = {np.uint8: TensorProto.UINT8, np.int8: TensorProto.INT8}


def _init(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _model(nodes, x_shape, inits, out="y", out_type=TensorProto.FLOAT, opset=19):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(out, out_type, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _qdq_conv(rng, qtype, *, group=1, cin=8, cout=8, k=3, pads=1, strides=1, relu=True, quantize_out=True,
              per_channel=True, peak=64):
    """x -> Q -> DQ -> Conv(DQ(w int8), DQ(bias int32)) [-> Relu] [-> Q -> DQ]: onnxruntime's QDQ form."""
    info = np.iinfo(qtype)
    xs, xz = 0.03, int(rng.integers(info.min // 2, info.max // 2))
    ws = rng.uniform(0.002, 0.01, cout if per_channel else 1).astype(np.float32)
    w = rng.integers(-peak, peak + 1, (cout, cin // group, k, k)).astype(np.int8)
    w[:, 0, 0, 0] = peak  # each channel's peak: 64 for 7-bit weights, as onnxruntime's reduce_range makes them
    b = rng.integers(-2000, 2000, cout).astype(np.int32)
    inits = [_init("xs", xs), _init("xz", xz, qtype), _init("w", w, np.int8), _init("ws", ws if per_channel else ws[0]),
             _init("wz", np.zeros(cout if per_channel else (), np.int8), np.int8), _init("b", b, np.int32),
             _init("bs", (xs * ws).astype(np.float32) if per_channel else np.float32(xs * ws[0])),
             _init("bz", np.zeros(cout if per_channel else (), np.int32), np.int32),
             _init("ys", 0.05), _init("yz", int(rng.integers(info.min // 4, info.max // 4)), qtype)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], pads=[pads] * 4, strides=[strides] * 2,
                              group=group)]
    y = "c"
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
        y = "r"
    if quantize_out:
        nodes += [helper.make_node("QuantizeLinear", [y, "ys", "yz"], ["yq"]),
                  helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", [y], ["y"]))
    return _model(nodes, [2, cin, 9, 9], inits)


def _compare(model, x, step):
    """polyhal's output against the reference evaluator's, within one step; returns explain."""
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    program = ponnx.load(model)
    plan = program.compile("cpu:0")
    got = program.execute(plan, {"x": x})["y"]
    assert np.abs(got.astype(np.float64) - want).max() <= step * 1.001 + 1e-5
    return plan.explain()


@needs_onednn
@pytest.mark.parametrize("qtype", [np.uint8, np.int8])
@pytest.mark.parametrize("case", [dict(), dict(strides=2), dict(pads=0, relu=False), dict(group=8, cin=8),
                                  dict(per_channel=False), dict(quantize_out=False), dict(k=1, pads=0)])
def test_qdq_conv_runs_as_one_int8_primitive_within_one_step(qtype, case):
    rng = np.random.default_rng(len(case) + (qtype == np.int8))
    model = _qdq_conv(rng, qtype, **case)
    x = rng.standard_normal((2, case.get("cin", 8), 9, 9)).astype(np.float32) * 2
    text = _compare(model, x, 0.05 if case.get("quantize_out", True) else 1e-3)
    assert "quantized_conv" in text and "1 of 1 quantized contractions on the CPU run as oneDNN int8" in text


def _qdq_matmul(rng, *, gemm=False):
    k, n = 24, 16
    w = rng.integers(-64, 65, (n, k) if gemm else (k, n)).astype(np.int8)
    w[(slice(None), 0) if gemm else (0, slice(None))] = -64
    inits = [_init("xs", 0.02), _init("xz", 3, np.uint8), _init("w", w, np.int8),
             _init("ws", rng.uniform(0.002, 0.01, n)), _init("wz", np.zeros(n, np.int8), np.int8),
             _init("bias", rng.standard_normal(n)), _init("ys", 0.04), _init("yz", 120, np.uint8)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0 if gemm else 1)]
    if gemm:
        nodes.append(helper.make_node("Gemm", ["xd", "wd", "bias"], ["m"], transB=1))
    else:
        nodes += [helper.make_node("MatMul", ["xd", "wd"], ["mm"]), helper.make_node("Add", ["mm", "bias"], ["m"])]
    nodes += [helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["yq"]),
              helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    return _model(nodes, [5, k], inits)


@needs_onednn
@pytest.mark.parametrize("gemm", [False, True])
def test_qdq_matmul_and_gemm_run_as_int8_within_one_step(gemm):
    rng = np.random.default_rng(7)
    text = _compare(_qdq_matmul(rng, gemm=gemm), rng.standard_normal((5, 24)).astype(np.float32), 0.04)
    assert "quantized_matmul" in text and "1 of 1 quantized contractions" in text


@needs_onednn
def test_matmul_integer_rescaled_runs_as_int8():
    # onnxruntime's dynamic quantization: DynamicQuantizeLinear, MatMulInteger, Cast, Mul by the scales
    rng = np.random.default_rng(8)
    w = rng.integers(-64, 65, (16, 12)).astype(np.int8)
    inits = [_init("w", w, np.int8), _init("ws", 0.01)]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "w", "xz"], ["acc"]),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"]), helper.make_node("Mul", ["accf", "s"], ["y"])]
    model = _model(nodes, [6, 16], inits)
    x = rng.standard_normal((6, 16)).astype(np.float32)
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    program = ponnx.load(model)
    plan = program.compile("cpu:0")
    np.testing.assert_allclose(program.execute(plan, {"x": x})["y"], want, rtol=1e-5, atol=1e-6)
    assert "quantized_matmul" in plan.explain()


@needs_onednn
def test_qlinearconv_fuses_and_stays_within_one_step_of_onnx():
    rng = np.random.default_rng(9)
    x = rng.integers(0, 255, (1, 3, 7, 7)).astype(np.uint8)
    w = rng.integers(-64, 65, (4, 3, 3, 3))
    w[:, 0, 0, 0] = 64
    inits = [_init("xs", 0.02), _init("xz", 128, np.uint8), _init("w", w, np.int8),
             _init("ws", rng.uniform(0.001, 0.01, 4)), _init("wz", np.zeros(4), np.int8), _init("ys", 0.05),
             _init("yz", 120, np.uint8), _init("b", rng.integers(-500, 500, 4), np.int32)]
    graph = helper.make_graph([helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                                                ["y"], pads=[1, 1, 1, 1], strides=[2, 2])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 7, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 4, 4, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    program = ponnx.load(model)
    plan = program.compile("cpu:0")
    got = program.execute(plan, {"x": x})["y"]
    assert got.dtype == np.uint8 and np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert "quantized_conv" in plan.explain()


@needs_onednn
def test_a_conv_onednn_refuses_falls_back_per_op_and_explain_says_why():
    # Grouped, 3 channels a group: oneDNN 3.2 has only its reference loop for it up to AVX2 (AVX-512
    # machines have a jit one). oneDNN reads ONEDNN_MAX_CPU_ISA once, as it loads, so the conv is
    # compiled in a fresh process capped at AVX2, and the refusal is seen on every machine.
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import numpy as np, test_cpu_onednn_int8 as t\n"
            "rng = np.random.default_rng(10)\n"
            "model = t._qdq_conv(rng, np.uint8, group=2, cin=6, cout=6)\n"
            "x = rng.standard_normal((2, 6, 9, 9)).astype(np.float32)\n"
            "print(t._compare(model, x, 0.05))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 of 1 quantized contractions" in done.stdout
    assert "runs on the CPU's own float kernel: oneDNN has only its reference implementation" in done.stdout


def test_wrong_zero_point_types_are_clear_errors():
    rng = np.random.default_rng(11)
    inits = [_init("xs", 0.02), _init("xz", 0, np.int8), _init("w", rng.integers(-64, 64, (4, 3, 3, 3)), np.int8),
             _init("ws", 0.01), _init("wz", 0, np.int8), _init("ys", 0.05), _init("yz", 0, np.uint8)]
    graph = helper.make_graph([helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    with pytest.raises(PolyhalError, match="x_zero_point is int8 but x is uint8"):
        ponnx.load(model)
    # the op itself: a zero point of another type than its tensor
    types = (TensorType((1, 3, 5, 5), np.uint8), TensorType((), np.float32), TensorType((), np.int8),
             TensorType((4, 3, 3, 3), np.int8), TensorType((), np.float32), TensorType((4,), np.float32))
    with pytest.raises(DTypeError, match="x_zero_point .x is uint8. has element type int8, expected uint8"):
        OPS["quantized_conv"].infer(types, {})


def test_int8_weights_are_recovered_only_where_int8_holds_them():
    rng = np.random.default_rng(12)
    q = rng.integers(-127, 128, (6, 4, 3, 3)).astype(np.int8)
    q[:, 0, 0, 0] = 127  # every channel reaches the range's end, as a symmetric quantizer makes it
    scale = rng.uniform(0.001, 0.01, 6).astype(np.float32)
    w = q.astype(np.float32) * scale[:, None, None, None]
    got_q, got_scale = int8_weights(w, 0)
    np.testing.assert_array_equal(got_q, q)
    np.testing.assert_allclose(got_scale, scale, rtol=1e-6)
    q[1:, 0, 0, 0] = 3  # only the first channel reaches 127: one scale for the tensor
    per_tensor = q.astype(np.float32) * scale[0]
    got_q, got_scale = int8_weights(per_tensor, 0)
    assert got_scale.shape == () and np.array_equal(got_q, q)
    assert int8_weights(rng.standard_normal((6, 4, 3, 3)).astype(np.float32), 0) is None  # float weights


def test_fusion_asks_the_gate_and_leaves_float_models_alone():
    rng = np.random.default_rng(13)
    model = _qdq_conv(rng, np.uint8)
    program = ponnx.load(model)
    fused, changes = fuse_quantized(program, lambda name, ops: False)  # no device with int8 kernels
    assert fused is program and not changes
    fused, changes = fuse_quantized(program)
    assert [op.name for f in changes for op in f.new] == ["quantized_conv"]
    # a float conv behind a DequantizeLinear (weights not int8): not an int8 conv
    float_w = numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32), "fw")
    model.graph.initializer.append(float_w)
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    conv.input[1] = "fw"
    assert not fuse_quantized(ponnx.load(model))[1]


@needs_onednn
def test_compiled_without_fusion_the_quantized_model_still_runs_in_float():
    rng = np.random.default_rng(14)
    model = _qdq_conv(rng, np.int8)
    x = rng.standard_normal((2, 8, 9, 9)).astype(np.float32)
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    program = ponnx.load(model)
    plan = polyhal.compile(program, "cpu:0", fuse=False)
    got = plan(x=x)
    got = (got[0] if isinstance(got, tuple) else got).numpy()
    assert "quantized_conv" not in plan.explain()
    assert np.abs(got - want).max() <= 0.05 * 1.001


def _float64_qdq_conv(model, x):
    """The QDQ conv graph of :func:`_qdq_conv` (pads 1, stride 1, relu, quantized output) evaluated in
    float64: the ONNX semantics with no rounding but the quantizations' own."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    info = np.iinfo(inits["xz"].dtype)
    xs, xz, ys, yz = (np.float64(inits[k]) for k in ("xs", "xz", "ys", "yz"))
    xq = np.clip(np.rint(x.astype(np.float64) / xs) + xz, info.min, info.max)
    wd = inits["w"].astype(np.float64) * inits["ws"].astype(np.float64).reshape(-1, 1, 1, 1)
    windows = np.lib.stride_tricks.sliding_window_view(np.pad((xq - xz) * xs, ((0, 0), (0, 0), (1, 1), (1, 1))),
                                                       wd.shape[2:], axis=(2, 3))
    c = np.einsum("nchwij,kcij->nkhw", windows, wd, optimize=True)
    c += (inits["b"].astype(np.float64) * inits["bs"].astype(np.float64))[None, :, None, None]
    return (np.clip(np.rint(np.maximum(c, 0) / ys) + yz, info.min, info.max) - yz) * ys


@needs_onednn
@pytest.mark.parametrize("qtype", [np.uint8, np.int8])
def test_an_int8_conv_equals_the_float64_qdq_semantics(qtype):
    # oneDNN accumulates in int32 and rounds once: exactly the float QDQ graph's result, where
    # onnxruntime's kernels were a step off at a few outputs in 10^5 (see bench/onnx_breadth.py)
    rng = np.random.default_rng(16)
    model = _qdq_conv(rng, qtype, cin=32, cout=32)
    x = rng.standard_normal((2, 32, 9, 9)).astype(np.float32) * 2
    program = ponnx.load(model)
    plan = program.compile("cpu:0")
    got = program.execute(plan, {"x": x})["y"]
    off = np.abs(got.astype(np.float64) - _float64_qdq_conv(model, x)) / 0.05
    if "1 of 1 quantized contractions on the CPU run as oneDNN int8 primitives" in plan.explain():
        assert off.max() < 1e-3, f"{(off > 0.5).sum()} outputs a step off"
    else:  # the CPU's own float kernels: float32 sums, a step off at ties
        assert off.max() <= 1.001


@needs_onednn
def test_int8_inputs_with_8_bit_weights_stay_exact_without_vnni():
    # int8 x goes to oneDNN as uint8 x + 128, large where x is near 0: with weights up to 127 the
    # int16 pair sums of a CPU without VNNI would saturate (27 steps off on onnxruntime's
    # symmetric-int8 CNN), so such instances run the CPU's own float kernels there
    rng = np.random.default_rng(15)
    model = _qdq_conv(rng, np.int8, peak=127)
    x = rng.standard_normal((2, 8, 9, 9)).astype(np.float32) * 2
    text = _compare(model, x, 0.05)
    assert "quantized_conv" in text
    if "no int8 dot-product instruction (VNNI)" in text:
        assert "int8 inputs (shifted to uint8 for oneDNN) with such weights run on the CPU's own float kernels" in text
