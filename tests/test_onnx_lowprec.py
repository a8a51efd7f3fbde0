"""Low-precision and quantized ONNX models: Cast among bfloat16/float8/float4/int4 (saturate and
not), QuantizeLinear/DequantizeLinear per tensor, per axis and blocked, QLinearConv, models from
onnxruntime's quantization tool, and the storage types in the IR and DLPack. Checked against
onnx's reference evaluator and onnxruntime."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from polyhal import dlpack  # noqa: E402
from polyhal.errors import DLPackError, DTypeError  # noqa: E402
from polyhal.frontends.onnx import OnnxModelError, OnnxUnsupportedError  # noqa: E402
from polyhal.ir.types import COMPUTE_DTYPES, STORAGE_DTYPES, TensorType  # noqa: E402
from polyhal.ops import infer_types  # noqa: E402

F = TensorProto.FLOAT
FLOAT8 = [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ]
LOW = FLOAT8 + [TensorProto.BFLOAT16, TensorProto.FLOAT4E2M1, TensorProto.INT4, TensorProto.UINT4]


def _model(nodes, inputs, outputs, inits=(), opset=23):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _devices():
    """cpu:0, and each GPU device whose kernels convert the storage types, where there is one."""
    import polyhal

    here = {s.name for s in polyhal.devices()}
    return [pytest.param(d, marks=pytest.mark.skipif(d not in here, reason=f"no {d} here"))
            for d in ("cpu:0", "opencl:0", "cuda:0")]


DEVICES = _devices()


def _run(model, feeds, device="cpu:0"):
    plan = ponnx.load(model).compile(device)
    out = plan(**feeds)
    return [np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])]


def _same(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    # Compare the bits: nan payloads and -0 included, as the types define them.
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[actual.dtype.itemsize]
    np.testing.assert_array_equal(actual.view(width), expected.view(width))


def _awkward_floats(rng):
    """Values every cast must get right: ties, subnormals, beyond the ranges, inf, nan, -0."""
    x = np.concatenate([rng.normal(0, 50, 40), rng.normal(0, 0.01, 20),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e6, -1e6, 448, 449, 464, 57344, 61440,
                         240, 0.5, 1.5, 2.5, -2.5, 7.4, 7.6, -8.6, 15.5, 3e-39]])
    return x.astype(np.float32)


@pytest.mark.parametrize("to", LOW, ids=TensorProto.DataType.Name)
@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("device", DEVICES)
def test_cast_to_and_from_low_precision_matches_onnx(to, saturate, device):
    x = _awkward_floats(np.random.default_rng(to))
    if to in (TensorProto.INT4, TensorProto.UINT4):
        x = np.clip(np.nan_to_num(x), -8, 15)  # float -> int4 out of range is undefined in ONNX
    node_attrs = {"saturate": saturate} if to in FLOAT8 else {}
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=to, **node_attrs),
                    helper.make_node("Cast", ["y"], ["z"], to=F)],
                   [helper.make_tensor_value_info("x", F, [x.size])],
                   [helper.make_tensor_value_info("y", to, [x.size]), helper.make_tensor_value_info("z", F, [x.size])])
    want_y, want_z = ReferenceEvaluator(model).run(None, {"x": x})
    got_y, got_z = _run(model, {"x": x}, device)
    _same(got_y, want_y)
    _same(got_z, want_z)


@pytest.mark.parametrize("device", DEVICES)
def test_castlike_between_two_storage_types_goes_exactly_through_float32(device):
    x = (np.arange(-20, 20, dtype=np.float32) * 37.5).astype(ml_dtypes.bfloat16)
    like = np.zeros(1, ml_dtypes.float8_e4m3fn)
    model = _model([helper.make_node("CastLike", ["x", "like"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [40]),
                    helper.make_tensor_value_info("like", TensorProto.FLOAT8E4M3FN, [1])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, [40])])
    (want,) = ReferenceEvaluator(model).run(None, {"x": x, "like": like})
    _same(_run(model, {"x": x, "like": like}, device)[0], want)
    assert np.asarray(want).astype(np.float32).max() == 448  # saturated, not nan


@pytest.mark.parametrize("zp_type,block", [
    (TensorProto.INT4, 4), (TensorProto.UINT4, 3), (TensorProto.INT8, 0), (TensorProto.UINT8, 5),
    (TensorProto.FLOAT8E4M3FN, 2), (TensorProto.FLOAT8E5M2, 0), (TensorProto.FLOAT4E2M1, 4), (TensorProto.INT2, 2),
], ids=lambda v: TensorProto.DataType.Name(v) if isinstance(v, int) and v > 8 else str(v))
@pytest.mark.parametrize("device", DEVICES)
def test_quantize_dequantize_per_axis_and_blocked_match_onnx(zp_type, block, device):
    rng = np.random.default_rng(zp_type * 10 + block)
    x = rng.normal(0, 3, (3, 10)).astype(np.float32)
    axis = 1 if block else 0
    n_scales = (-(-10 // block)) if block else 3
    scale_shape = (3, n_scales) if block else (3,)
    scale = rng.uniform(0.05, 0.5, scale_shape).astype(np.float32)
    zp_dtype = helper.tensor_dtype_to_np_dtype(zp_type)
    zp = (np.zeros(scale_shape) if zp_type in FLOAT8 else rng.integers(0, 2, scale_shape)).astype(zp_dtype)
    attrs = {"axis": axis} | ({"block_size": block} if block else {})
    model = _model([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], **attrs),
                    helper.make_node("DequantizeLinear", ["q", "s", "zp"], ["y"], **attrs)],
                   [helper.make_tensor_value_info("x", F, list(x.shape))],
                   [helper.make_tensor_value_info("q", zp_type, list(x.shape)),
                    helper.make_tensor_value_info("y", F, list(x.shape))],
                   [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "zp")])
    want_q, want_y = ReferenceEvaluator(model).run(None, {"x": x})
    got_q, got_y = _run(model, {"x": x}, device)
    _same(got_q, want_q)
    _same(got_y, want_y)


def test_blocked_scale_of_the_wrong_shape_is_a_clear_error():
    model = _model([helper.make_node("DequantizeLinear", ["x", "s"], ["y"], axis=1, block_size=4)],
                   [helper.make_tensor_value_info("x", TensorProto.INT8, [2, 8])],
                   [helper.make_tensor_value_info("y", F, [2, 8])],
                   [numpy_helper.from_array(np.ones((2, 3), np.float32), "s")])
    with pytest.raises(OnnxModelError, match=r"block_size 4 along axis 1 .* shape \[2, 2\]"):
        ponnx.load(model)


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [1, 0])
@pytest.mark.parametrize("source", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE],
                         ids=TensorProto.DataType.Name)
@pytest.mark.parametrize("device", DEVICES)
def test_cast_to_float8e8m0_matches_onnx(round_mode, saturate, source, device):
    e8m0 = TensorProto.FLOAT8E8M0
    x = np.concatenate([_awkward_floats(np.random.default_rng(1)),
                        [2.0 ** 127, 1.9 * 2.0 ** 127, 3.4e38, 1.5, 1.75, 1.25, 3.0, 2 ** -126, 1e-45, -4.5]])
    with np.errstate(over="ignore"):  # to float16, the large ones become inf, which e8m0 makes nan
        x = x.astype(helper.tensor_dtype_to_np_dtype(source))
    n = len(x)
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=e8m0, saturate=saturate, round_mode=round_mode),
                    helper.make_node("Cast", ["y"], ["back"], to=F)],
                   [helper.make_tensor_value_info("x", source, [n])],
                   [helper.make_tensor_value_info("y", e8m0, [n]), helper.make_tensor_value_info("back", F, [n])],
                   opset=25)
    got = _run(model, {"x": x}, device)
    want = ReferenceEvaluator(model).run(None, {"x": x})
    _same(got[0], want[0])
    _same(got[1], want[1])


def test_an_unknown_e8m0_round_mode_is_refused():
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E8M0, round_mode="sideways")],
                   [helper.make_tensor_value_info("x", F, [4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT8E8M0, [4])], opset=25)
    with pytest.raises((OnnxModelError, OnnxUnsupportedError), match="round_mode"):
        ponnx.load(model)


def test_qlinearconv_per_channel_matches_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(3)
    x = rng.integers(0, 255, (1, 3, 7, 7)).astype(np.uint8)
    w = rng.integers(-100, 100, (4, 3, 3, 3)).astype(np.int8)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "xs"), numpy_helper.from_array(np.array(128, np.uint8), "xz"),
             numpy_helper.from_array(w, "w"), numpy_helper.from_array(rng.uniform(0.001, 0.01, 4).astype(np.float32), "ws"),
             numpy_helper.from_array(np.zeros(4, np.int8), "wz"), numpy_helper.from_array(np.array(0.05, np.float32), "ys"),
             numpy_helper.from_array(np.array(120, np.uint8), "yz"),
             numpy_helper.from_array(rng.integers(-500, 500, 4).astype(np.int32), "b")]
    model = _model([helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                                     pads=[1, 1, 1, 1], strides=[2, 2])],
                   [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 7, 7])],
                   [helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 4, 4, 4])], inits, opset=13)
    (want,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = _run(model, {"x": x})[0]
    assert got.dtype == np.uint8
    (exact,) = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_array_equal(got, exact)
    # onnxruntime requantizes in float32 (off by one at most) where its uint8 x int8 kernel is exact;
    # on AVX2 CPUs without VNNI (an AMD EPYC VM) that kernel's 16-bit pair sums saturate, and it is
    # onnxruntime that is off the spec: the reference evaluator above is the oracle.
    if np.abs(want.astype(int) - exact.astype(int)).max() <= 1:
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def _float_model(path):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), "b"),
             numpy_helper.from_array(rng.normal(0, 0.2, (64, 10)).astype(np.float32), "m"),
             numpy_helper.from_array(np.array([1, 64], np.int64), "shape")]
    model = _model([helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
                    helper.make_node("Relu", ["c"], ["r"]),
                    helper.make_node("Reshape", ["r", "shape"], ["f"]),
                    helper.make_node("MatMul", ["f", "m"], ["y"])],
                   [helper.make_tensor_value_info("x", F, [1, 3, 8, 8])],
                   [helper.make_tensor_value_info("y", F, [1, 10])], inits, opset=17)
    onnx.save(model, path)
    return rng


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["normal", "positive", "zeros", "large"])
def test_dynamic_quantize_linear_is_one_op_where_a_kernel_runs_it_and_exact_everywhere(device, case):
    # cpu:0 runs the dynamic_quantize kernel; a device without one gets the op's elementwise
    # decomposition (polyhal.passes.decompose): both exactly onnx's reference.
    rng = np.random.default_rng(3)
    x = {"normal": rng.standard_normal((16, 300)) * 3, "positive": rng.uniform(0.5, 4, (16, 300)),
         "zeros": np.zeros((4, 5)), "large": rng.standard_normal((2, 70000)) * 1e3}[case].astype(np.float32)
    model = _model([helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
                   [helper.make_tensor_value_info("x", F, list(x.shape))],
                   [helper.make_tensor_value_info("y", TensorProto.UINT8, list(x.shape)),
                    helper.make_tensor_value_info("s", F, []), helper.make_tensor_value_info("z", TensorProto.UINT8, [])],
                   opset=11)
    program = ponnx.load(model)
    plan = program.compile(device)
    got = program.execute(plan, {"x": x})
    if case == "zeros":  # onnx divides 0 by 0 here: polyhal's kernel says scale 0, zero point 0, y 0
        if f"dynamic_quantize -> {device}" in plan.explain():
            assert float(got["s"]) == 0 and int(got["z"]) == 0 and not got["y"].any()
        return
    want = dict(zip(["y", "s", "z"], ReferenceEvaluator(model).run(None, {"x": x})))
    for name in ("y", "s", "z"):
        _same(np.asarray(got[name]).reshape(np.shape(want[name])), want[name])
    assert (f"dynamic_quantize -> {device}" in plan.explain()) == (device == "cpu:0")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", [TensorProto.INT8, TensorProto.UINT8])
@pytest.mark.parametrize("same", [True, False])
def test_a_max_pool_or_reshape_between_equal_quantizations_runs_on_the_integers_exactly(device, qtype, same):
    # x -> Q -> DQ -> MaxPool -> Q -> DQ -> Reshape -> Q -> DQ (a QDQ model's form): with the
    # same scale and zero point around them, the pool and the reshape run on the int8 / uint8
    # map (polyhal.passes.fuse_quantized); with another scale after the pool, as float ops. Both
    # exactly onnx's reference.
    dtype = helper.tensor_dtype_to_np_dtype(qtype)
    zp = np.array(-3 if dtype == np.int8 else 130, dtype)
    inits = [numpy_helper.from_array(np.array(0.037, np.float32), "s"),
             numpy_helper.from_array(np.array(0.037 if same else 0.05, np.float32), "s2"),
             numpy_helper.from_array(zp, "z"), numpy_helper.from_array(np.array([2, -1], np.int64), "shape")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q0"]),
             helper.make_node("DequantizeLinear", ["q0", "s", "z"], ["d0"]),
             helper.make_node("MaxPool", ["d0"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("QuantizeLinear", ["p", "s2", "z"], ["q1"]),
             helper.make_node("DequantizeLinear", ["q1", "s2", "z"], ["d1"]),
             helper.make_node("Reshape", ["d1", "shape"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "s2", "z"], ["q2"]),
             helper.make_node("DequantizeLinear", ["q2", "s2", "z"], ["y"])]
    model = _model(nodes, [helper.make_tensor_value_info("x", F, [2, 3, 8, 10])],
                   [helper.make_tensor_value_info("y", F, None)], inits, opset=19)
    x = (np.random.default_rng(4).standard_normal((2, 3, 8, 10)) * 3).astype(np.float32)
    program = ponnx.load(model)
    plan = program.compile(device)
    fused = [line.split(" -> ")[1].split()[0] for line in plan.explain().splitlines() if "fused quantized:" in line]
    assert fused == (["max_pool", "reshape"] if same else ["reshape"])
    _same(program.execute(plan, {"x": x})["y"], ReferenceEvaluator(model).run(None, {"x": x})[0])


def test_onnxruntime_quantized_models_run(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    q = pytest.importorskip("onnxruntime.quantization")
    rng = _float_model(tmp_path / "f.onnx")
    batches = [rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32) for _ in range(4)]

    class Reader(q.CalibrationDataReader):
        def __init__(self):
            self.it = iter({"x": b} for b in batches)

        def get_next(self):
            return next(self.it, None)

    q.quantize_dynamic(tmp_path / "f.onnx", tmp_path / "dyn.onnx", weight_type=q.QuantType.QInt8)
    q.quantize_static(tmp_path / "f.onnx", tmp_path / "qdq.onnx", Reader(), quant_format=q.QuantFormat.QDQ,
                      per_channel=True)
    q.quantize_static(tmp_path / "f.onnx", tmp_path / "qop.onnx", Reader(), quant_format=q.QuantFormat.QOperator)
    x = batches[0]
    for name in ("dyn", "qdq", "qop"):
        path = str(tmp_path / f"{name}.onnx")
        ops = {n.op_type for n in onnx.load(path).graph.node}
        assert ops & {"DynamicQuantizeLinear", "QuantizeLinear", "QLinearConv", "MatMulInteger", "ConvInteger"}, ops
        # onnxruntime's graph optimizations fuse QDQ into its int8 kernels, whose 16-bit pair sums
        # saturate on AVX2 CPUs without VNNI (0.28 off here on an AMD EPYC VM, where the unfused
        # graph and onnx's reference evaluator agree with polyhal exactly): compare with the graph
        # as written.
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        (want,) = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
        got = _run(onnx.load(path), {"x": x})[0]
        np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max(), err_msg=name)


def test_storage_types_in_the_ir_and_dlpack():
    bf16, e4m3 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
    assert bf16 in STORAGE_DTYPES and e4m3 in STORAGE_DTYPES and not STORAGE_DTYPES & COMPUTE_DTYPES
    t = TensorType((2, 3), "float8_e5m2")
    assert t.nbytes == 6 and str(t) == "tensor<2x3xfloat8_e5m2>"
    (out,) = infer_types("cast", [t], {"dtype": "float32"})
    assert out.dtype == np.float32
    with pytest.raises(DTypeError, match="insert a 'cast'"):
        infer_types("maximum", [TensorType((2,), bf16), TensorType((2,), bf16)], {})
    # DLPack 1.1's codes: bfloat16 4, float8 e4m3fn 10, e4m3fnuz 11, e5m2 12, e5m2fnuz 13, e8m0fnu 14.
    for dt, code in ((bf16, (4, 16, 1)), (e4m3, (10, 8, 1)), (np.dtype(ml_dtypes.float8_e4m3fnuz), (11, 8, 1)),
                     (np.dtype(ml_dtypes.float8_e5m2), (12, 8, 1)), (np.dtype(ml_dtypes.float8_e5m2fnuz), (13, 8, 1)),
                     (np.dtype(ml_dtypes.float8_e8m0fnu), (14, 8, 1))):
        assert dlpack.dlpack_dtype(dt) == code
        assert dlpack.numpy_dtype(*code) == dt
    with pytest.raises(DLPackError, match="int4 has no DLPack equivalent"):
        dlpack.dlpack_dtype(ml_dtypes.int4)  # one element per byte here, packed nibbles in DLPack


def test_arithmetic_in_a_storage_type_is_refused_cleanly():
    e4m3 = TensorProto.FLOAT8E4M3FN
    model = _model([helper.make_node("Add", ["a", "b"], ["y"])],
                   [helper.make_tensor_value_info("a", e4m3, [3]), helper.make_tensor_value_info("b", e4m3, [3])],
                   [helper.make_tensor_value_info("y", e4m3, [3])])
    with pytest.raises(OnnxUnsupportedError, match="add on float8_e4m3fn: .*cast to float32 first"):
        ponnx.load(model)


def test_a_model_computing_in_bfloat16_runs_in_float32_within_bfloat16_rounding():
    bf = TensorProto.BFLOAT16
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Reshape", ["m", "shape"], ["r"]),
             helper.make_node("Softmax", ["r"], ["s"]), helper.make_node("Celu", ["s"], ["y"], alpha=0.7),
             helper.make_node("ArgMax", ["r"], ["i"], axis=1)]
    model = _model(nodes, [helper.make_tensor_value_info("x", bf, [4, 6]), helper.make_tensor_value_info("w", bf, [6, 8])],
                   [helper.make_tensor_value_info("y", bf, [8, 4]), helper.make_tensor_value_info("i", TensorProto.INT64, [8, 1])],
                   [numpy_helper.from_array(np.array([8, 4], np.int64), "shape")])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(4, 6)).astype(ml_dtypes.bfloat16),
             "w": rng.normal(size=(6, 8)).astype(ml_dtypes.bfloat16)}
    program = ponnx.load(model)
    # Reshape moves bfloat16 as it is; only the ops without a bfloat16 form are widened.
    reshape = next(op for op in program.ops if op.name == "reshape")
    assert reshape.inputs[0].type.dtype == ml_dtypes.bfloat16
    got = _run(model, feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    assert got[0].dtype == ml_dtypes.bfloat16 and got[1].dtype == np.int64
    # onnx's reference rounds Softmax's steps (exp, sum, divide) to bfloat16 each; polyhal's
    # softmax is one op computed in float32 and rounded once: within two bfloat16 steps.
    np.testing.assert_allclose(got[0].astype(np.float32), want[0].astype(np.float32), rtol=2 ** -6)
    np.testing.assert_array_equal(got[1], want[1])
