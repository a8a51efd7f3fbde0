"""Run-time shape operands: TopK's k and Range's bounds given as inputs or computed from data load
without values and run staged, one plan per value (the bounded specialization cache), matching
onnxruntime; a recurrent layer's sequence lengths are an operand (one plan for every value)."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from polyhal.errors import PolyhalError  # noqa: E402
from polyhal.frontends.onnx.errors import NeedsValue  # noqa: E402
from polyhal.frontends.onnx.staged import StagedOnnxProgram  # noqa: E402


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _same_as_onnxruntime(model, plan, program, feeds):
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = program.execute(plan, feeds)
    for (name, g), w in zip(got.items(), want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)


TOPK = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)],
              [vi("x", T.FLOAT, ["batch", 10]), vi("k", T.INT64, [1])],
              [vi("v", T.FLOAT, ["batch", "k"]), vi("i", T.INT64, ["batch", "k"])])


def test_topk_k_as_an_input_loads_without_values_and_specializes_per_value():
    program = ponnx.load(TOPK)
    assert isinstance(program, StagedOnnxProgram)
    plan = program.compile("cpu:0")
    rng = np.random.default_rng(0)
    for k, batch in ((3, 2), (7, 2), (3, 2), (10, 4)):
        _same_as_onnxruntime(TOPK, plan, program, {"x": rng.standard_normal((batch, 10)).astype(np.float32),
                                                   "k": np.array([k])})
    assert plan.cache.misses == 3 and plan.cache.hits == 1  # k=3 at batch 2 compiled once


def test_values_still_fix_a_shape_operand_at_load():
    program = ponnx.load(TOPK, values={"k": np.array([2])}, shapes={"x": (3, 10)})
    assert program.input_names == ["x"] and "k" in program.frozen


def test_topk_k_larger_than_the_axis_is_refused_as_onnxruntime_refuses_it():
    feeds = {"x": np.zeros((2, 10), np.float32), "k": np.array([12])}
    with pytest.raises(Exception, match="should not be greater"):  # onnxruntime's own refusal
        ort.InferenceSession(TOPK.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    with pytest.raises(PolyhalError, match=r"TopK.*k=12 is out of range for axis 1 of size 10"):
        ponnx.load(TOPK).run(feeds, "cpu:0")


def test_topk_k_computed_from_the_data():
    # k = the number of positive entries of the first row (at least 1): decided by the data.
    nodes = [helper.make_node("Slice", ["x", "zero", "one", "zero"], ["row"]),
             helper.make_node("Greater", ["row", "fzero"], ["pos"]),
             helper.make_node("Cast", ["pos"], ["posi"], to=T.INT64),
             helper.make_node("ReduceSum", ["posi"], ["n"], keepdims=0),
             helper.make_node("Max", ["n", "one1"], ["k0"]),
             helper.make_node("Reshape", ["k0", "one"], ["k"]),
             helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array(1, np.int64), "one1"),
             numpy_helper.from_array(np.array(0, np.float32), "fzero")]
    model = _model(nodes, [vi("x", T.FLOAT, [3, 8])], [vi("v", T.FLOAT, [3, "k"]), vi("i", T.INT64, [3, "k"])], inits)
    program = ponnx.load(model)
    plan = program.compile("cpu:0")
    rng = np.random.default_rng(1)
    for _ in range(3):
        _same_as_onnxruntime(model, plan, program, {"x": rng.standard_normal((3, 8)).astype(np.float32)})


def test_range_bounds_from_inputs():
    model = _model([helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
                    helper.make_node("Mul", ["r", "r"], ["y"])],
                   [vi("start", T.FLOAT, []), vi("limit", T.FLOAT, []), vi("delta", T.FLOAT, [])],
                   [vi("y", T.FLOAT, ["n"])])
    program = ponnx.load(model)
    plan = program.compile("cpu:0")
    for start, limit, delta in ((1, 7.5, 1.5), (0, 3, 1), (5, -2, -0.5), (2, 2, 1)):
        feeds = {k: np.array(v, np.float32) for k, v in zip(("start", "limit", "delta"), (start, limit, delta))}
        _same_as_onnxruntime(model, plan, program, feeds)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_sequence_lengths_as_an_input(kind, direction):
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[kind]
    hidden, features, dirs = 4, 3, 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in
             (("W", (dirs, gates * hidden, features)), ("R", (dirs, gates * hidden, hidden)),
              ("B", (dirs, 2 * gates * hidden)), ("h0", (dirs, 3, hidden)))]
    node = helper.make_node(kind, ["x", "W", "R", "B", "lens", "h0"], ["Y", "Yh"], hidden_size=hidden,
                            direction=direction)
    model = _model([node], [vi("x", T.FLOAT, [5, 3, features]), vi("lens", T.INT32, [3])],
                   [vi("Y", T.FLOAT, [5, dirs, 3, hidden]), vi("Yh", T.FLOAT, [dirs, 3, hidden])], inits)
    program = ponnx.load(model)
    plan = program.compile("cpu:0")
    x = rng.standard_normal((5, 3, features)).astype(np.float32)
    for lens in ([5, 3, 1], [5, 5, 5], [2, 0, 4]):
        _same_as_onnxruntime(model, plan, program, {"x": x, "lens": np.array(lens, np.int32)})


def test_a_shape_operand_from_nothing_at_run_time_still_says_what_to_give():
    # A Reshape target computed from an input that is fixed by values= cannot be re-specialized:
    # the load names it, as before.
    model = _model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")],
                   [vi("x", T.FLOAT, [2, 6]), vi("shape", T.INT64, [2])], [vi("y", T.FLOAT, ["a", "b"])])
    program = ponnx.load(model)
    assert isinstance(program, StagedOnnxProgram)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert program.run({"x": x, "shape": np.array([3, 4])}, "cpu:0")["y"].shape == (3, 4)
    assert issubclass(NeedsValue, PolyhalError)


def test_a_staged_model_with_large_weights_keeps_them():
    # Weights above the strip size are read apart from the ModelProto at load; staging cuts
    # submodels out of the whole model, so they must be back in it.
    w = np.random.default_rng(4).standard_normal((8, 300)).astype(np.float32)
    model = _model([helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("TopK", ["m", "k"], ["v", "i"])],
                   [vi("x", T.FLOAT, [3, 8]), vi("k", T.INT64, [1])],
                   [vi("v", T.FLOAT, [3, "k"]), vi("i", T.INT64, [3, "k"])], [numpy_helper.from_array(w, "W")])
    assert max(len(t.raw_data) for t in model.graph.initializer) > 1024
    program = ponnx.load(model.SerializeToString())
    assert isinstance(program, StagedOnnxProgram)
    plan = program.compile("cpu:0")
    x = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    _same_as_onnxruntime(model, plan, program, {"x": x, "k": np.array([4])})


def test_sequence_lengths_as_an_input_need_no_staging():
    from bench import onnx_breadth as fam

    program = ponnx.load(fam.lstm_sequence_lens(seq=6, batch=3, features=8, hidden=16))
    assert not isinstance(program, StagedOnnxProgram)
