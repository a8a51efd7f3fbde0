"""Control flow, sequences, optionals and data-dependent shapes through the ONNX front end,
checked against onnx.reference: models that one static plan cannot hold run staged
(plans per segment, host control flow; polyhal.frontends.onnx.staged)."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h
from onnx.reference import ReferenceEvaluator

import polyhal
import polyhal.onnx as ponnx
from polyhal.frontends.onnx.staged import loop_limit

DEVICE = "cpu:0"


def _model(nodes, inputs, outputs, opset=18, **kw):
    graph = h.make_graph(nodes, "m", inputs, outputs, **kw)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def _check(model, feeds, oracle="reference", **tol):
    """polyhal's outputs against onnx.reference (or onnxruntime); returns the program and its outputs."""
    program = ponnx.load(model)
    got = program.run(feeds, DEVICE)
    if oracle == "onnxruntime":
        import onnxruntime as ort
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    else:
        want = ReferenceEvaluator(model).run(None, feeds)
    for name, w in zip(program.output_names, want):
        g = got[name]
        if isinstance(w, list):
            assert len(g) == len(w)
            for a, b in zip(g, w):
                np.testing.assert_allclose(a, b, **tol)
        else:
            assert g.dtype == w.dtype and g.shape == w.shape, (name, g.shape, w.shape)
            np.testing.assert_allclose(g, w, **tol)
    return program, got


def _vi(name, elem, shape):
    return h.make_tensor_value_info(name, elem, shape)


def _while_model():
    """x doubles until its sum exceeds `limit`: a Loop ended by its body's condition."""
    body = h.make_graph(
        [h.make_node("Add", ["x_in", "x_in"], ["x_out"]),
         h.make_node("ReduceSum", ["x_out"], ["s"], keepdims=0),
         h.make_node("Less", ["s", "limit"], ["c_out"]),
         h.make_node("Identity", ["x_out"], ["scan"])],
        "body", [_vi("i", T.INT64, []), _vi("c", T.BOOL, []), _vi("x_in", T.FLOAT, [3])],
        [_vi("c_out", T.BOOL, []), _vi("x_out", T.FLOAT, [3]), _vi("scan", T.FLOAT, [3])])
    return _model([h.make_node("Loop", ["", "go", "x"], ["y", "ys"], body=body)],
                  [_vi("go", T.BOOL, []), _vi("x", T.FLOAT, [3]), _vi("limit", T.FLOAT, [])],
                  [_vi("y", T.FLOAT, [3]), _vi("ys", T.FLOAT, [None, 3])])


def test_loop_ended_by_data_runs_staged_and_compiles_its_body_once():
    model = _while_model()
    x = np.array([1, 2, 3], np.float32)
    program, got = _check(model, {"go": np.array(True), "x": x, "limit": np.array(100, np.float32)})
    assert isinstance(program, ponnx.StagedOnnxProgram)
    assert got["ys"].shape == (5, 3)
    plan = program.compile(DEVICE)
    for limit in (10, 100, 1000):
        got = program.execute(plan, {"go": np.array(True), "x": x, "limit": np.array(limit, np.float32)})
        want = ReferenceEvaluator(model).run(None, {"go": np.array(True), "x": x,
                                                    "limit": np.array(limit, np.float32)})
        np.testing.assert_allclose(got["ys"], want[1])
    assert plan.cache.misses == 1  # one body segment, one shape: every iteration reuses its plan
    # The first iteration compiled the body; all others ran straight on its plan.
    assert plan.stats["direct_iterations"] > 0 and plan.stats["segment_runs"] == 1
    assert "staged plan" in program.explain(plan) and "straight on their body's plan" in program.explain(plan)


def _program_and_reference(model, feeds, device=DEVICE, oracle=None):
    program = ponnx.load(model)
    plan = program.compile(device)
    got = program.execute(plan, feeds)
    want = (oracle or ReferenceEvaluator(model)).run(None, feeds)
    for name, w in zip(program.output_names, want):
        assert got[name].dtype == w.dtype and got[name].shape == w.shape, name
        np.testing.assert_allclose(got[name], w, rtol=1e-6)
    return plan


def test_loop_whose_carried_value_grows_specializes_its_body_per_shape():
    """A carried value that changes shape needs another body plan each iteration: no direct runs."""
    body = h.make_graph(
        [h.make_node("Concat", ["x_in", "x_in"], ["x_out"], axis=0),
         h.make_node("ReduceSum", ["x_out"], ["s"], keepdims=0),
         h.make_node("Less", ["s", "limit"], ["c_out"])],
        "body", [_vi("i", T.INT64, []), _vi("c", T.BOOL, []), _vi("x_in", T.FLOAT, [None])],
        [_vi("c_out", T.BOOL, []), _vi("x_out", T.FLOAT, [None])])
    model = _model([h.make_node("Loop", ["", "go", "x"], ["y"], body=body)],
                   [_vi("go", T.BOOL, []), _vi("x", T.FLOAT, [2]), _vi("limit", T.FLOAT, [])],
                   [_vi("y", T.FLOAT, [None])])
    plan = _program_and_reference(model, {"go": np.array(True), "x": np.array([1, 2], np.float32),
                                          "limit": np.array(100, np.float32)})
    assert plan.cache.misses == plan.stats["segment_runs"] == 6  # results of 4, 8, ..., 128 elements
    assert plan.stats["direct_iterations"] == 0


def test_loop_body_outputs_the_plan_does_not_make_run_directly():
    """Body outputs that are not the plan's (a carried value passed through, the iteration number
    and a body initializer as scan outputs, the condition given back) on the direct path, run
    again with other trip counts and outer values."""
    body = h.make_graph(
        [h.make_node("Cast", ["i"], ["fi"], to=T.FLOAT),
         h.make_node("Mul", ["fi", "scale"], ["step"]),
         h.make_node("Add", ["a_in", "step"], ["a_out"]),
         h.make_node("Mul", ["a_out", "b_in"], ["prod"])],
        "body", [_vi("i", T.INT64, []), _vi("c", T.BOOL, []), _vi("a_in", T.FLOAT, [2]), _vi("b_in", T.FLOAT, [2])],
        [_vi("c", T.BOOL, []), _vi("a_out", T.FLOAT, [2]), _vi("b_in", T.FLOAT, [2]),
         _vi("i", T.INT64, []), _vi("half", T.FLOAT, []), _vi("prod", T.FLOAT, [2])],
        initializer=[h.make_tensor("half", T.FLOAT, [], [0.5])])
    model = _model([h.make_node("Loop", ["m", "", "a", "b"], ["a_end", "b_end", "iters", "scales", "prods"],
                                body=body)],
                   [_vi("m", T.INT64, []), _vi("a", T.FLOAT, [2]), _vi("b", T.FLOAT, [2]), _vi("scale", T.FLOAT, [])],
                   [_vi("a_end", T.FLOAT, [2]), _vi("b_end", T.FLOAT, [2]), _vi("iters", T.INT64, [None]),
                    _vi("scales", T.FLOAT, [None]), _vi("prods", T.FLOAT, [None, 2])])
    feeds = {"m": np.array(6), "a": np.array([1, -1], np.float32), "b": np.array([2, 3], np.float32),
             "scale": np.array(0.5, np.float32)}
    program = ponnx.load(model)
    plan = program.compile(DEVICE)
    # By hand: onnx.reference drops scan outputs that no node makes, and onnxruntime gives every
    # iteration's number as the last one.
    for m, scale in ((6, 0.5), (3, 2.0), (1, 4.0)):
        feeds.update(m=np.array(m), scale=np.array(scale, np.float32))
        got = program.execute(plan, feeds)
        a = feeds["a"] + scale * np.cumsum(np.arange(m, dtype=np.float32))[:, None]
        np.testing.assert_allclose(got["a_end"], a[-1])
        np.testing.assert_array_equal(got["b_end"], feeds["b"])
        np.testing.assert_array_equal(got["iters"], np.arange(m))
        np.testing.assert_array_equal(got["scales"], np.full(m, 0.5, np.float32))
        np.testing.assert_allclose(got["prods"], a * feeds["b"])
        assert got["iters"].dtype == np.int64 and got["prods"].dtype == np.float32
    assert plan.stats["direct_iterations"] == 5 + 3 + 1  # only the very first iteration compiled the body
    assert plan.cache.misses == 1


def _onnxruntime(model):
    import onnxruntime as ort
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_loop_carried_values_trading_places_run_through_the_interpreter():
    body = h.make_graph(
        [h.make_node("Add", ["x_in", "y_in"], ["total"])],
        "body", [_vi("i", T.INT64, []), _vi("c", T.BOOL, []), _vi("x_in", T.FLOAT, [2]), _vi("y_in", T.FLOAT, [2])],
        [_vi("c", T.BOOL, []), _vi("y_in", T.FLOAT, [2]), _vi("total", T.FLOAT, [2])])
    model = _model([h.make_node("Loop", ["m", "", "x", "y"], ["x_end", "y_end"], body=body)],
                   [_vi("m", T.INT64, []), _vi("x", T.FLOAT, [2]), _vi("y", T.FLOAT, [2])],
                   [_vi("x_end", T.FLOAT, [2]), _vi("y_end", T.FLOAT, [2])])
    plan = _program_and_reference(model, {"m": np.array(7), "x": np.array([0, 1], np.float32),
                                          "y": np.array([1, 1], np.float32)},  # Fibonacci
                                  oracle=_onnxruntime(model))  # (onnx.reference ignores the exchange)
    assert plan.stats["direct_iterations"] == 0


def test_threads_running_one_loop_at_once_get_their_own_results():
    """The direct path's result tensors serve one Loop run at a time; a run that finds them
    taken goes through the interpreter."""
    from concurrent.futures import ThreadPoolExecutor

    model = _while_model()
    program = ponnx.load(model)
    plan = program.compile(DEVICE)
    x = np.array([1, 2, 3], np.float32)

    def run(limit):
        feeds = {"go": np.array(True), "x": x, "limit": np.array(limit, np.float32)}
        for _ in range(20):
            got = program.execute(plan, feeds)
        return got, ReferenceEvaluator(model).run(None, feeds)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns within iterations
    try:
        with ThreadPoolExecutor(4) as pool:
            for got, want in pool.map(run, [10.0, 1e3, 1e6, 1e30] * 2):
                np.testing.assert_allclose(got["y"], want[0])
                np.testing.assert_allclose(got["ys"], want[1])
    finally:
        sys.setswitchinterval(interval)


def test_loop_carried_values_stay_on_an_opencl_device():
    if "opencl:0" not in {s.name for s in polyhal.devices()}:
        pytest.skip("no OpenCL device here")
    plan = _program_and_reference(_while_model(), {"go": np.array(True), "x": np.array([1, 2, 3], np.float32),
                                                   "limit": np.array(100, np.float32)}, "opencl:0")
    assert plan.stats["direct_iterations"] == 4


def test_if_on_data_picks_the_branch_at_run_time():
    then = h.make_graph([h.make_node("Mul", ["x", "x"], ["r"])], "then", [], [_vi("r", T.FLOAT, [4])])
    other = h.make_graph([h.make_node("Neg", ["x"], ["r2"])], "else", [], [_vi("r2", T.FLOAT, [4])])
    model = _model([h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
                    h.make_node("Greater", ["s", "zero"], ["c"]),
                    h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
                    h.make_node("Relu", ["y"], ["z"])],
                   [_vi("x", T.FLOAT, [4])], [_vi("z", T.FLOAT, [4])],
                   initializer=[h.make_tensor("zero", T.FLOAT, [], [0.0])])
    for x in (np.arange(4, dtype=np.float32), -np.arange(4, dtype=np.float32)):
        _check(model, {"x": x})


@pytest.mark.parametrize("seed", [0, 1])
def test_nonzero_feeds_later_ops_with_a_run_time_length(seed):
    model = _model([h.make_node("NonZero", ["x"], ["idx"]),
                    h.make_node("Transpose", ["idx"], ["pairs"]),
                    h.make_node("GatherND", ["x", "pairs"], ["vals"]),
                    h.make_node("Shape", ["vals"], ["n"]),
                    h.make_node("TopK", ["vals", "n"], ["top", "where"])],
                   [_vi("x", T.FLOAT, [3, 5])], [_vi("top", T.FLOAT, [None]), _vi("where", T.INT64, [None])])
    x = np.random.default_rng(seed).standard_normal((3, 5)).astype(np.float32)
    x[x < 0.2] = 0
    program, got = _check(model, {"x": x})
    assert isinstance(program, ponnx.StagedOnnxProgram)
    assert got["top"].shape == (np.count_nonzero(x),)


def test_nonzero_alone_is_one_static_plan_cut_after_the_run():
    model = _model([h.make_node("NonZero", ["x"], ["idx"])], [_vi("x", T.INT32, [2, 3])],
                   [_vi("idx", T.INT64, [2, None])])
    program, _ = _check(model, {"x": np.array([[0, 1, 0], [2, 0, 3]], np.int32)})
    assert isinstance(program, ponnx.OnnxProgram)


@pytest.mark.parametrize("sorted_", [1, 0])
def test_unique_on_the_device(sorted_):
    model = _model([h.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"], sorted=sorted_)],
                   [_vi("x", T.INT64, [12])],
                   [_vi("y", T.INT64, [None]), _vi("first", T.INT64, [None]), _vi("inverse", T.INT64, [12]),
                    _vi("counts", T.INT64, [None])])
    x = np.random.default_rng(3).integers(0, 6, 12)
    _check(model, {"x": x})


@pytest.mark.parametrize("axis,sorted_", [(0, 1), (1, 1), (-1, 0), (0, 0)])
def test_unique_along_an_axis_on_the_device(axis, sorted_):
    model = _model([h.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"], axis=axis, sorted=sorted_)],
                   [_vi("x", T.FLOAT, [6, 4])],
                   [_vi("y", T.FLOAT, [None, None]), _vi("first", T.INT64, [None]), _vi("inverse", T.INT64, [None]),
                    _vi("counts", T.INT64, [None])])
    rng = np.random.default_rng(4)
    if axis == 0:
        base = rng.integers(0, 3, (3, 4)).astype(np.float32)
        x = np.concatenate([base, base[::-1]])  # repeated rows
    else:
        base = rng.integers(0, 3, (6, 2)).astype(np.float32)
        x = np.concatenate([base, base[:, ::-1]], axis=1)  # repeated columns
    # onnx.reference reorders unsorted results along axis 0 whatever the axis; onnxruntime does not.
    oracle = "onnxruntime" if axis and not sorted_ else "reference"
    program, _ = _check(model, {"x": x}, oracle=oracle)
    assert isinstance(program, ponnx.OnnxProgram)  # one plan; its outputs are cut after the run


def test_sequence_ops():
    nodes = [h.make_node("SplitToSequence", ["x"], ["seq"], axis=0),
             h.make_node("SequenceErase", ["seq", "one"], ["seq2"]),
             h.make_node("SequenceInsert", ["seq2", "x0"], ["seq3"]),
             h.make_node("SequenceLength", ["seq3"], ["n"]),
             h.make_node("SequenceAt", ["seq3", "minus1"], ["last"]),
             h.make_node("ConcatFromSequence", ["seq3"], ["cat"], axis=1),
             h.make_node("Relu", ["cat"], ["out"])]
    inits = [h.make_tensor("one", T.INT64, [], [1]), h.make_tensor("minus1", T.INT64, [], [-1])]
    model = _model(nodes, [_vi("x", T.FLOAT, [3, 2]), _vi("x0", T.FLOAT, [1, 2])],
                   [_vi("n", T.INT64, []), _vi("last", T.FLOAT, [1, 2]), _vi("out", T.FLOAT, [1, 6])],
                   initializer=inits)
    rng = np.random.default_rng(0)
    _check(model, {"x": rng.standard_normal((3, 2)).astype(np.float32),
                   "x0": rng.standard_normal((1, 2)).astype(np.float32)})


def test_sequence_map_runs_its_body_per_element():
    body = h.make_graph([h.make_node("Add", ["e", "e"], ["d"])], "b", [_vi("e", T.FLOAT, [None])],
                        [_vi("d", T.FLOAT, [None])])
    def seq_t(name, elem, shape):
        return h.make_value_info(name, h.make_sequence_type_proto(h.make_tensor_type_proto(elem, shape)))
    model = _model([h.make_node("SequenceMap", ["s"], ["r"], body=body)],
                   [seq_t("s", T.FLOAT, [None])], [seq_t("r", T.FLOAT, [None])])
    _check(model, {"s": [np.arange(n, dtype=np.float32) for n in (1, 3, 2)]})


def test_optionals():
    opt = h.make_tensor_type_proto(T.FLOAT, [2])
    model = _model([h.make_node("OptionalHasElement", ["o"], ["has"])],
                   [h.make_value_info("o", h.make_optional_type_proto(opt))], [_vi("has", T.BOOL, [])])
    for feed in (None, np.ones(2, np.float32)):
        got = ponnx.load(model).run({"o": feed}, DEVICE)
        assert bool(got["has"]) == (feed is not None)
    get = _model([h.make_node("OptionalGetElement", ["o"], ["v"])],
                 [h.make_value_info("o", h.make_optional_type_proto(opt))], [_vi("v", T.FLOAT, [2])])
    with pytest.raises(ponnx.OnnxRunError, match="empty optional"):
        ponnx.load(get).run({"o": None}, DEVICE)


def test_tensor_scatter_with_run_time_write_indices():
    model = _model([h.make_node("TensorScatter", ["past", "update", "at"], ["present"], mode="circular")],
                   [_vi("past", T.FLOAT, [2, 5, 3]), _vi("update", T.FLOAT, [2, 2, 3]), _vi("at", T.INT64, [2])],
                   [_vi("present", T.FLOAT, [2, 5, 3])], opset=24)
    rng = np.random.default_rng(0)
    _check(model, {"past": rng.standard_normal((2, 5, 3)).astype(np.float32),
                   "update": rng.standard_normal((2, 2, 3)).astype(np.float32),
                   "at": np.array([4, 1], np.int64)})


def _counted_loop():
    body = h.make_graph([h.make_node("Add", ["a", "one"], ["b"]), h.make_node("Identity", ["c"], ["c_out"])],
                        "body", [_vi("i", T.INT64, []), _vi("c", T.BOOL, []), _vi("a", T.FLOAT, [])],
                        [_vi("c_out", T.BOOL, []), _vi("b", T.FLOAT, [])])
    return _model([h.make_node("Loop", ["m", "", "a0"], ["a"], body=body)],
                  [_vi("m", T.INT64, []), _vi("a0", T.FLOAT, [])], [_vi("a", T.FLOAT, [])],
                  initializer=[h.make_tensor("one", T.FLOAT, [], [1.0])])


def test_loop_trip_count_from_data_runs_and_is_bounded(monkeypatch):
    program = ponnx.load(_counted_loop())
    assert isinstance(program, ponnx.StagedOnnxProgram)
    assert program.run({"m": np.array(7), "a0": np.array(1, np.float32)}, DEVICE)["a"] == 8
    with pytest.raises(ponnx.OnnxRunError, match="trip count -3 is negative"):
        program.run({"m": np.array(-3), "a0": np.array(0, np.float32)}, DEVICE)
    with pytest.raises(ponnx.OnnxRunError, match="exceeds the loop limit of 1000000 .*POLYHAL_LOOP_LIMIT"):
        program.run({"m": np.array(2**62), "a0": np.array(0, np.float32)}, DEVICE)
    monkeypatch.setenv("POLYHAL_LOOP_LIMIT", "5")
    with pytest.raises(ponnx.OnnxRunError, match="exceeds the loop limit of 5"):
        program.run({"m": np.array(6), "a0": np.array(0, np.float32)}, DEVICE)


def test_a_loop_that_never_ends_stops_at_the_limit(monkeypatch):
    monkeypatch.setenv("POLYHAL_LOOP_LIMIT", "50")
    program = ponnx.load(_while_model())
    with pytest.raises(ponnx.OnnxRunError, match="ran 50 iterations without ending"):
        program.run({"go": np.array(True), "x": np.zeros(3, np.float32), "limit": np.array(1, np.float32)}, DEVICE)


def test_loop_limit_setting_is_checked(monkeypatch):
    monkeypatch.setenv("POLYHAL_LOOP_LIMIT", "lots")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_LOOP_LIMIT='lots' is not an integer >= 0"):
        loop_limit()


def test_negative_constant_trip_count_is_a_model_error():
    model = _counted_loop()
    model.graph.initializer.append(h.make_tensor("m", T.INT64, [], [-2]))
    with pytest.raises(ponnx.OnnxModelError, match="trip count -2 is negative"):
        ponnx.load(model)
