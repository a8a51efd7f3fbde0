"""Recurrent layers (ONNX RNN, GRU, LSTM) as one op each, and Scans evaluated over every step at
once (scikit-learn's nearest neighbours), checked against onnxruntime and onnx.reference."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from polyhal.errors import PolyhalError  # noqa: E402
from polyhal.frontends.onnx.errors import OnnxUnsupportedError  # noqa: E402

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def recurrent(kind, *, seq=5, batch=3, features=4, hidden=6, direction="forward", inputs=(), layout=0, seed=0,
              **attrs):
    """A one-node model; ``inputs`` names the optional operands given as graph inputs (``lens``,
    ``h0``, ``c0``), ``p`` adds peepholes."""
    rng = np.random.default_rng(seed)
    gates, dirs = GATES[kind], 2 if direction == "bidirectional" else 1
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n) for n, s in
             (("W", (dirs, gates * hidden, features)), ("R", (dirs, gates * hidden, hidden)),
              ("B", (dirs, 2 * gates * hidden)))]
    if "p" in inputs:
        inits.append(numpy_helper.from_array((rng.standard_normal((dirs, 3 * hidden)) * 0.5).astype(np.float32), "P"))
    state = [batch, dirs, hidden] if layout else [dirs, batch, hidden]
    graph_inputs = [helper.make_tensor_value_info("x", T.FLOAT, [batch, seq, features] if layout else
                                                  [seq, batch, features])]
    names = ["x", "W", "R", "B", "", "", "", ""]
    for i, name in ((4, "lens"), (5, "h0"), (6, "c0")):
        if name in inputs:
            names[i] = name
            graph_inputs.append(helper.make_tensor_value_info(name, T.INT32 if name == "lens" else T.FLOAT,
                                                              [batch] if name == "lens" else state))
    if "p" in inputs:
        names[7] = "P"
    names = names[:8 if kind == "LSTM" else 6]
    while not names[-1]:
        names.pop()
    outs = ["Y", "Y_h"] + (["Y_c"] if kind == "LSTM" else [])
    node = helper.make_node(kind, names, outs, hidden_size=hidden, direction=direction, **attrs,
                            **({"layout": 1} if layout else {}))
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info(o, T.FLOAT, None)
                                                          for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def feeds_for(model, seed=1):
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.name == "lens":
            seq = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim][0]
            out[vi.name] = rng.integers(0, seq + 1, shape).astype(np.int32)
        else:
            out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def _run(model, feeds, device="cpu:0"):
    program = ponnx.load(model)
    plan = program.compile(device)
    return program, plan, program.execute(plan, feeds)


def _close(got, want, names, tol=2e-5):
    for name, w in zip(names, want):
        np.testing.assert_allclose(np.asarray(got[name]), w, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_matches_onnxruntime_with_lengths_and_initial_states_in_one_dispatch(kind, direction):
    inputs = ("lens", "h0", "c0", "p") if kind == "LSTM" else ("lens", "h0")
    model = recurrent(kind, direction=direction, inputs=inputs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    program, plan, _ = _run(model, feeds_for(model))
    assert " 1 dispatches" in plan.explain()
    for seed in range(3):  # lengths vary per call: one plan serves them (no staging, no unrolling)
        feeds = feeds_for(model, seed)
        _close(program.execute(plan, feeds), session.run(None, feeds), [o.name for o in model.graph.output])


@pytest.mark.parametrize("kind,attrs", [
    ("GRU", {"linear_before_reset": 1}),
    ("LSTM", {"clip": 0.4}),
    ("RNN", {"activations": ["Relu", "LeakyRelu"], "activation_alpha": [0.2], "direction": "bidirectional"}),
    ("GRU", {"activations": ["HardSigmoid", "Softsign"], "activation_alpha": [0.3], "activation_beta": [0.4]}),
    ("LSTM", {"activations": ["HardSigmoid", "Tanh", "Elu"], "activation_alpha": [0.25, 0.9],
              "activation_beta": [0.45]}),
    ("RNN", {"activations": ["ScaledTanh"], "activation_alpha": [1.5], "activation_beta": [0.7]}),
])
def test_attributes_match_onnxruntime(kind, attrs):
    direction = attrs.pop("direction", "forward")
    model = recurrent(kind, direction=direction, inputs=("h0",), **attrs)
    feeds = feeds_for(model)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    _close(_run(model, feeds)[2], want, [o.name for o in model.graph.output])


@pytest.mark.parametrize("n_threads", ["1", "2"])
@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("kind,attrs", [("LSTM", {}), ("GRU", {}), ("GRU", {"linear_before_reset": 1}), ("RNN", {})])
def test_large_layers_run_in_blocks_of_rows_on_the_pool_match_onnxruntime(kind, attrs, direction, n_threads,
                                                                          monkeypatch):
    # seq * batch * gates * hidden * (features + hidden) >= PARALLEL_MACS: on two threads the
    # directions run at once, and a forward layer's rows in two blocks (here one of a single
    # row: BLAS's matrix-vector products), each gathering its rows of x for its input product
    from polyhal_cpu import threads
    from polyhal_cpu.recurrent_kernels import PARALLEL_MACS

    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    # few steps (the test's weights make a chaotic recurrence: float32 roundings grow step by step)
    seq, batch, features, hidden = 8, 3, 576, {"LSTM": 64, "GRU": 80, "RNN": 128}[kind]
    assert seq * batch * GATES[kind] * hidden * (features + hidden) >= PARALLEL_MACS
    model = recurrent(kind, seq=seq, batch=batch, features=features, hidden=hidden, direction=direction,
                      inputs=("lens", "h0"), **attrs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    program, plan, _ = _run(model, feeds_for(model))
    for seed in range(2):
        feeds = feeds_for(model, seed)
        _close(program.execute(plan, feeds), session.run(None, feeds), [o.name for o in model.graph.output], tol=1e-4)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_batch_first_layout_matches_onnx_reference(kind):
    # onnxruntime refuses layout=1; onnx's reference evaluator runs it.
    model = recurrent(kind, layout=1, inputs=("h0",))
    feeds = feeds_for(model)
    want = ReferenceEvaluator(model).run(None, feeds)
    _close(_run(model, feeds)[2], want, [o.name for o in model.graph.output])


def test_float64_and_omitted_outputs():
    model = recurrent("LSTM", direction="bidirectional", inputs=("h0",))
    model.graph.node[0].output[:] = ["", "Y_h"]
    del model.graph.output[0]
    del model.graph.output[1]
    feeds = feeds_for(model)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    _close(_run(model, feeds)[2], want, ["Y_h"])
    # float64: the CPU kernel against the op's float64 reference
    from polyhal.ops.recurrent import recurrence
    rng = np.random.default_rng(0)
    x, w, r, b = (rng.standard_normal(s) * 0.5 for s in ((4, 2, 3), (1, 16, 3), (1, 16, 4), (1, 32)))
    lens, h0, c0, p = np.array([4, 2], np.int32), np.zeros((1, 2, 4)), np.zeros((1, 2, 4)), np.zeros((1, 12))
    from polyhal.ir.types import TensorType
    from polyhal_cpu.table import TABLE

    args = (x, w, r, b, lens, h0, c0, p)
    outs = [np.empty((4, 1, 2, 4)), np.empty((1, 2, 4)), np.empty((1, 2, 4))]
    kernel = TABLE.prepare(None, "lstm", {}, [TensorType(a.shape, a.dtype) for a in args],
                           [TensorType(o.shape, o.dtype) for o in outs])
    kernel(*args, *outs)
    for got, want in zip(outs, recurrence("lstm", *args)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_bad_lengths_and_unsupported_attributes_are_refused_clearly():
    model = recurrent("GRU", inputs=("lens",))
    program, plan, _ = _run(model, feeds_for(model))
    with pytest.raises(PolyhalError, match="sequence lengths must be from 0 to 5"):
        program.execute(plan, {**feeds_for(model), "lens": np.array([1, 9, 2], np.int32)})
    with pytest.raises(OnnxUnsupportedError, match="input_forget"):
        ponnx.load(recurrent("LSTM", input_forget=1))
    with pytest.raises(OnnxUnsupportedError, match="'gelu'"):
        ponnx.load(recurrent("RNN", activations=["Gelu"]))


# ------------------------------------------------------------------------------ Scan over steps

def _scan_model(in_axis=0, in_dir=0, out_axis=0, out_dir=0, opset=17):
    """Pairwise squared distances, written as skl2onnx's cdist writes them (a Scan over the rows
    of ``y`` with ``x`` as a state that passes through), with the scan's axes and directions."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["s_in"], ["s_out"]),
         helper.make_node("Sub", ["s_in", "row"], ["diff"]),
         helper.make_node("ReduceSumSquare", ["diff"], ["dist"], axes=[1], keepdims=0),
         helper.make_node("Identity", ["dist"], ["out"])],
        "body", [helper.make_tensor_value_info("s_in", T.FLOAT, None),
                 helper.make_tensor_value_info("row", T.FLOAT, None)],
        [helper.make_tensor_value_info("s_out", T.FLOAT, None), helper.make_tensor_value_info("out", T.FLOAT, None)])
    scan = helper.make_node("Scan", ["x", "y"], ["x_out", "d"], body=body, num_scan_inputs=1,
                            scan_input_axes=[in_axis], scan_input_directions=[in_dir], scan_output_axes=[out_axis],
                            scan_output_directions=[out_dir])
    y_shape = [7, 3] if in_axis == 0 else [3, 7]
    graph = helper.make_graph([scan], "g", [helper.make_tensor_value_info("x", T.FLOAT, [5, 3]),
                                            helper.make_tensor_value_info("y", T.FLOAT, y_shape)],
                              [helper.make_tensor_value_info("x_out", T.FLOAT, None),
                               helper.make_tensor_value_info("d", T.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("in_axis,in_dir,out_axis,out_dir", [(0, 0, 0, 0), (1, 1, 1, 0), (0, 1, 0, 1), (1, 0, -1, 1)])
def test_scan_whose_steps_are_independent_runs_all_steps_at_once(in_axis, in_dir, out_axis, out_dir):
    model = _scan_model(in_axis, in_dir, out_axis, out_dir)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((5, 3)).astype(np.float32),
             "y": rng.standard_normal((7, 3) if in_axis == 0 else (3, 7)).astype(np.float32)}
    program, plan, got = _run(model, feeds)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    _close(got, want, ["x_out", "d"], tol=1e-5)
    # one subtraction and one reduction over every step, not seven of each
    assert plan.explain().count("sub ->") == 1


def _sklearn_knn(regressor: bool):
    sklearn = pytest.importorskip("sklearn.neighbors")
    skl2onnx = pytest.importorskip("skl2onnx")
    from skl2onnx.common.data_types import FloatTensorType

    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 6)).astype(np.float32)
    y = x[:, 0] + x[:, 1] if regressor else (x[:, 0] > 0).astype(int) + (x[:, 1] > 1)
    est = (sklearn.KNeighborsRegressor if regressor else sklearn.KNeighborsClassifier)(5).fit(x, y)
    options = {} if regressor else {id(est): {"zipmap": False}}
    model = skl2onnx.convert_sklearn(est, initial_types=[("input", FloatTensorType([None, 6]))], options=options,
                                     target_opset=17)
    return model, rng.standard_normal((40, 6)).astype(np.float32)


@pytest.mark.parametrize("regressor", [False, True])
def test_kneighbors_models_match_onnxruntime_without_unrolling_the_training_rows(regressor):
    model, x = _sklearn_knn(regressor)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    program = ponnx.load(model)
    for batch in (1, 40):
        feeds = {"input": x[:batch]}
        got = program.run(feeds, "cpu:0")
        for name, want in zip(program.output_names, session.run(None, feeds)):
            if want.dtype.kind == "f":
                np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5)
            else:
                assert got[name].tolist() == want.tolist()
    # the Scan over the 300 training rows is a handful of ops, not 300 copies of its body
    assert len(program.specialize({"input": (40, 6)}).ops) < 60
