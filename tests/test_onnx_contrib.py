"""onnxruntime's com.microsoft quantized ops (converters/contrib.py) against onnxruntime itself:
models its quantizer writes (QOperator, dynamic, and as its optimizer fuses them), single ops
with the attributes the quantizer does not use, and the error for a contrib op polyhal lacks."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime.quantization")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from bench import onnx_breadth as fam  # noqa: E402
from polyhal.frontends.onnx.errors import OnnxUnsupportedError  # noqa: E402

MS = "com.microsoft"


def _ort(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _output_step(model) -> float:
    """The quantization step of the model's output: the scale of the DequantizeLinear that makes it."""
    out = model.graph.output[0].name
    node = next(n for n in model.graph.node if out in n.output)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return float(inits[node.input[1]]) if node.op_type == "DequantizeLinear" else 0.0


def _compare(model, feeds):
    want = _ort(model, feeds)[0]
    got = ponnx.load(model).run(feeds, "cpu:0")[model.graph.output[0].name]
    assert got.shape == want.shape and got.dtype == want.dtype
    step = _output_step(model)
    if step:
        # Within int8 rounding: a value on a rounding boundary may land one step off. On the CPU
        # the convs are oneDNN int8 primitives, which requantize as (acc x_scale w_scale + bias) /
        # y_scale where onnxruntime computes (acc + bias) (x_scale w_scale / y_scale): ties round
        # apart, and through a deep net's 20 layers the steps compound.
        deep = len([n for n in model.graph.node if n.op_type == "QLinearConv"]) > 8
        err = np.abs(got - want) / step
        assert err.max() <= (4.01 if deep else 2.01), f"off by {err.max():.2f} steps"
        if deep:  # (and onnxruntime's own uint8 x int8 kernels saturate on CPUs without VNNI)
            assert err.mean() <= 0.5, f"{err.mean():.2f} steps off on average"
        else:
            assert np.mean(err < 0.5) >= 0.97, f"only {np.mean(err < 0.5):.1%} exactly equal"
    else:
        # Float outputs of dynamic quantization: onnxruntime's fused DynamicQuantizeMatMul
        # quantizes A multiplying by 1 / scale, so a value on a rounding tie may take the
        # neighbouring step (off spec, where polyhal divides as DynamicQuantizeLinear does).
        close = np.isclose(got, want, rtol=1e-5, atol=1e-6)
        assert np.mean(close) >= 0.75, f"only {np.mean(close):.1%} equal"
        np.testing.assert_allclose(got, want, atol=0.01)
    return got


QOPS = {"QGemm", "QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearAveragePool",
        "QLinearGlobalAveragePool", "QLinearConcat", "QLinearSoftmax", "DynamicQuantizeMatMul"}


@pytest.fixture(scope="module")
def families():
    return fam.quantized_families(np.random.default_rng(0))


@pytest.mark.parametrize("name", ["MLP int8 QOperator", "CNN int8 QOperator", "ResNet-18 int8 QOperator",
                                  "MLP int8 dynamic (MatMulInteger)", "MLP int8 DynamicQuantizeMatMul"])
@pytest.mark.parametrize("batch", [1, 5])
def test_quantized_models_match_onnxruntime(families, name, batch):
    model, feeds = families[name]
    assert {n.op_type for n in model.graph.node if n.domain == MS} <= QOPS
    _compare(model, feeds(batch))


@pytest.mark.parametrize("name", ["MLP int8 dynamic (MatMulInteger)", "MLP int8 DynamicQuantizeMatMul"])
def test_dynamic_int8_layers_are_one_quantize_and_one_int8_matmul_each_and_exact(families, name):
    # Each layer: dynamic_quantize, then one quantized_matmul taking a's run-time scale and the
    # weights' scale (multiplied in float32 first, as the model's Mul does), the bias and the relu.
    # Its outputs, read before the softmax, equal the unoptimized graph's bit for bit (onnx's
    # reference evaluator too, where it knows the ops).
    from onnx.reference import ReferenceEvaluator

    from bench.models import fix_dims

    model = onnx.ModelProto.FromString(families[name][0].SerializeToString())
    fix_dims(model, {"batch": 64})
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(n, T.FLOAT, None) for n in ("r0", "r1", "g2"))
    plan = ponnx.load(model).compile("cpu:0")
    text = plan.explain()
    assert text.startswith("plan @mlp: 6 dispatches"), text.splitlines()[0]
    fused = [line.split(": ")[1].split(" -> ")[0].split(" + ") for line in text.splitlines()
             if "-> quantized_matmul" in line]
    assert len(fused) == 3 and all(ops.count("mul") == 2 and "add" in ops for ops in fused), fused
    assert [ops[-1] for ops in fused] == ["relu", "relu", "add"], fused
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    reference = ReferenceEvaluator(model) if "MatMulInteger" in name else None
    rng = np.random.default_rng(6)
    for x in (rng.standard_normal((64, 32)) * 3, rng.uniform(0, 1, (64, 32))):
        feeds = {"x": x.astype(np.float32)}
        got = ponnx.load(model).run(feeds, "cpu:0")
        for want in [session.run(None, feeds)] + ([reference.run(None, feeds)] if reference else []):
            for n, w in zip(("r0", "r1", "g2"), want):
                np.testing.assert_array_equal(got[n], w, err_msg=n)


def test_the_quantizer_writes_the_contrib_ops_these_tests_cover(families):
    used = {n.op_type for m, _ in families.values() for n in m.graph.node if n.domain == MS}
    assert used == QOPS  # a new onnxruntime emitting others shows here


@pytest.mark.parametrize("options", [
    {"per_channel": True},
    "int8 symmetric activations",
])
def test_quantizer_variants_match_onnxruntime(options):
    from onnxruntime.quantization import QuantType

    if options == "int8 symmetric activations":
        options = {"activation_type": QuantType.QInt8, "weight_type": QuantType.QInt8,
                   "extra_options": {"ActivationSymmetric": True}}
    rng = np.random.default_rng(1)
    calibration = [{"x": rng.standard_normal((4, 3, 16, 16)).astype(np.float32)} for _ in range(3)]
    model = fam.quantize(fam.cnn(seed=1), calibration, **options)
    _compare(model, {"x": rng.standard_normal((3, 3, 16, 16)).astype(np.float32)})


# ------------------------------------------------------------------------------------ single ops

def _q(name, value, dtype=np.uint8):
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def _single(node, inputs, output, inits):
    return fam._model([node], inputs, [output], inits, domains=[(MS, 1)])


def _exact(model, feeds):
    want = _ort(model, feeds)
    got = list(ponnx.load(model).run(feeds, "cpu:0").values())
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert np.abs(g.astype(np.float64) - w.astype(np.float64)).max() <= 1, (g, w)


U8 = np.random.default_rng(2).integers(0, 256, (2, 3, 4, 5)).astype(np.uint8)


@pytest.mark.parametrize("op, attrs", [
    ("QLinearGlobalAveragePool", {"channels_last": 1}),
    ("QLinearAveragePool", {"kernel_shape": [2, 2], "strides": [1, 2], "pads": [1, 0, 1, 1], "count_include_pad": 1}),
    ("QLinearAveragePool", {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "channels_last": 1}),
    ("QLinearLeakyRelu", {"alpha": 0.3}),
    ("QLinearSigmoid", {}),
    ("QLinearSoftmax", {"opset": 12, "axis": 1}),
    ("QLinearSoftmax", {"opset": 13, "axis": 2}),
])
def test_unary_contrib_ops_match_onnxruntime(op, attrs):
    node = helper.make_node(op, ["x", "sx", "zx", "sy", "zy"], ["y"], domain=MS, **attrs)
    inits = [_q("sx", 0.05, np.float32), _q("zx", 128), _q("sy", 1 / 256 if "Softmax" in op else 0.04, np.float32),
             _q("zy", 0 if "Softmax" in op else 120)]
    model = _single(node, [helper.make_tensor_value_info("x", T.UINT8, U8.shape)],
                    helper.make_tensor_value_info("y", T.UINT8, None), inits)
    _exact(model, {"x": U8})


def test_qlinear_where_and_concat_requantize_each_input():
    rng = np.random.default_rng(3)
    a, b = (rng.integers(-128, 128, (3, 4)).astype(np.int8) for _ in range(2))
    cond = rng.random((3, 4)) > 0.5
    nodes = [helper.make_node("QLinearWhere", ["c", "a", "sa", "za", "b", "sb", "zb", "sy", "zy"], ["w"], domain=MS),
             helper.make_node("QLinearConcat", ["sy", "zy", "a", "sa", "za", "w", "sy", "zy"], ["y"], axis=-1, domain=MS)]
    inits = [_q("sa", 0.1, np.float32), _q("za", 3, np.int8), _q("sb", 0.02, np.float32), _q("zb", -5, np.int8),
             _q("sy", 0.07, np.float32), _q("zy", 1, np.int8)]
    model = fam._model(nodes, [helper.make_tensor_value_info("c", T.BOOL, [3, 4]),
                               helper.make_tensor_value_info("a", T.INT8, [3, 4]),
                               helper.make_tensor_value_info("b", T.INT8, [3, 4])],
                       [helper.make_tensor_value_info("w", T.INT8, None), helper.make_tensor_value_info("y", T.INT8, None)],
                       inits, domains=[(MS, 1)])
    _exact(model, {"c": cond, "a": a, "b": b})


@pytest.mark.parametrize("requantized", [True, False])
def test_qgemm_with_transposes_per_column_weights_and_float_output(requantized):
    rng = np.random.default_rng(4)
    a = rng.integers(0, 256, (6, 5)).astype(np.uint8)  # transA: A is K x M
    # transB: B is N x K. 7-bit weights, as the quantizer's reduce_range makes them: onnxruntime's
    # uint8 x int8 kernel saturates pairs of 8-bit products in int16 on CPUs without VNNI.
    b = rng.integers(-64, 64, (7, 6)).astype(np.int8)
    inputs = ["a", "sa", "za", "b", "sb", "zb", "c"] + (["sy", "zy"] if requantized else [])
    node = helper.make_node("QGemm", inputs, ["y"], domain=MS, transA=1, transB=1, alpha=0.5)
    inits = [_q("sa", 0.03, np.float32), _q("za", 100), _q("sb", rng.random(7) * 0.1 + 0.01, np.float32),
             _q("zb", np.zeros(7), np.int8), _q("c", rng.integers(-500, 500, 7), np.int32),
             _q("sy", 0.2, np.float32), _q("zy", 128)]
    out = T.UINT8 if requantized else T.FLOAT
    model = _single(node, [helper.make_tensor_value_info("a", T.UINT8, [6, 5]),
                           helper.make_tensor_value_info("b", T.INT8, [7, 6])],
                    helper.make_tensor_value_info("y", out, None), inits)
    feeds = {"a": a, "b": b}
    if requantized:
        _exact(model, feeds)
    else:
        # float32 rescaling in another order than onnxruntime's (oneDNN's int8 matmul: acc a_scale b_scale)
        np.testing.assert_allclose(ponnx.load(model).run(feeds, "cpu:0")["y"], _ort(model, feeds)[0], rtol=1e-5)


def test_matmul_integer_to_float_matches_onnxruntime():
    rng = np.random.default_rng(5)
    node = helper.make_node("MatMulIntegerToFloat", ["a", "b", "sa", "sb", "za", "zb", "bias"], ["y"], domain=MS)
    inits = [_q("b", rng.integers(0, 256, (8, 4))), _q("sa", 0.02, np.float32), _q("sb", [0.1, 0.2, 0.3, 0.4], np.float32),
             _q("za", 7), _q("zb", [1, 2, 3, 4]), _q("bias", rng.standard_normal(4), np.float32)]
    model = _single(node, [helper.make_tensor_value_info("a", T.UINT8, [2, 3, 8])],
                    helper.make_tensor_value_info("y", T.FLOAT, None), inits)
    feeds = {"a": rng.integers(0, 256, (2, 3, 8)).astype(np.uint8)}
    np.testing.assert_allclose(ponnx.load(model).run(feeds, "cpu:0")["y"], _ort(model, feeds)[0], rtol=1e-5)


def test_a_contrib_op_polyhal_lacks_names_op_and_domain_and_suggests_qdq():
    node = helper.make_node("QLinearReduceMean", ["x", "s", "z", "s", "z"], ["y"], domain=MS, axes=[1], keepdims=1)
    model = _single(node, [helper.make_tensor_value_info("x", T.UINT8, [2, 3])],
                    helper.make_tensor_value_info("y", T.UINT8, None), [_q("s", 0.1, np.float32), _q("z", 0)])
    with pytest.raises(OnnxUnsupportedError) as info:
        ponnx.load(model)
    text = str(info.value)
    assert "'QLinearReduceMean'" in text and "'com.microsoft'" in text and "QDQ" in text


def test_ops_the_quantizer_leaves_on_8_bit_data_match_onnxruntime():
    # Resize (linear, on uint8), Pad, Split, Transpose, Reshape and ArgMax run on the quantized
    # tensors as they are; Add becomes QLinearAdd, MatMul QLinearMatMul.
    rng = np.random.default_rng(6)
    f = fam._f32
    inits = [f("w1", rng.standard_normal((4, 3, 3, 3)) * 0.3), f("b1", np.zeros(4)),
             f("w2", rng.standard_normal((4, 4, 3, 3)) * 0.3), f("b2", np.zeros(4)), f("roi", np.zeros(0)),
             f("sc", [1, 1, 2, 2]), helper.make_tensor("pads", T.INT64, [8], [0, 0, 1, 1, 0, 0, 1, 1]),
             helper.make_tensor("split", T.INT64, [2], [2, 2]), helper.make_tensor("shp", T.INT64, [2], [-1, 2]),
             f("mm", rng.standard_normal((2, 6)))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1] * 4), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Resize", ["r1", "roi", "sc"], ["up"], mode="linear"),
             helper.make_node("Pad", ["up", "pads"], ["pd"]), helper.make_node("Conv", ["pd", "w2", "b2"], ["c2"]),
             helper.make_node("Split", ["c2", "split"], ["s1", "s2"], axis=1), helper.make_node("Add", ["s1", "s2"], ["a"]),
             helper.make_node("Transpose", ["a"], ["t"], perm=[0, 2, 3, 1]), helper.make_node("Reshape", ["t", "shp"], ["rs"]),
             helper.make_node("MatMul", ["rs", "mm"], ["m"]), helper.make_node("ArgMax", ["m"], ["y"], axis=1)]
    model = fam._model(nodes, [helper.make_tensor_value_info("x", T.FLOAT, [2, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", T.INT64, None)], inits)
    q = fam.quantize(model, [{"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(4)])
    assert {"Resize", "Pad", "Split", "QLinearAdd", "QLinearMatMul"} <= {n.op_type for n in q.graph.node}
    x = {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}
    assert np.mean(ponnx.load(q).run(x, "cpu:0")["y"] == _ort(q, x)[0]) >= 0.97


@pytest.mark.parametrize("dtype, elem", [(np.uint8, T.UINT8), (np.int8, T.INT8)])
def test_linear_resize_of_8_bit_data_truncates_as_onnxruntime(dtype, elem):
    node = helper.make_node("Resize", ["x", "roi", "sc"], ["y"], mode="linear")
    model = fam._model([node], [helper.make_tensor_value_info("x", elem, [1, 2, 5, 6])],
                       [helper.make_tensor_value_info("y", elem, None)], [fam._f32("roi", np.zeros(0)),
                                                                          fam._f32("sc", [1, 1, 2.0, 1.5])])
    info = np.iinfo(dtype)
    x = {"x": np.random.default_rng(7).integers(info.min, info.max + 1, (1, 2, 5, 6)).astype(dtype)}
    got, want = ponnx.load(model).run(x, "cpu:0")["y"], _ort(model, x)[0]
    assert got.dtype == want.dtype and np.abs(got.astype(int) - want.astype(int)).max() <= 1
    assert np.mean(got == want) >= 0.97
