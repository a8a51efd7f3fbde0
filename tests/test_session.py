"""``polyhal.InferenceSession`` against ``onnxruntime.InferenceSession``: the same script runs
on both (only the class differs) and their answers are compared -- the inputs and outputs they
describe, and the outputs of runs on the example models and on a model with If and Loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto as T, helper as h

import polyhal
from polyhal.frontends.onnx.errors import OnnxInputError

ort = pytest.importorskip("onnxruntime")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _onnxruntime(model):
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _polyhal(model):
    return polyhal.InferenceSession(model, "cpu:0")


def _feeds(session, sizes: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs made from the session's declaration (symbolic dims from ``sizes``)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes[d] for d in arg.shape]
        dtype = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(bool)": np.bool_}[arg.type]
        feeds[arg.name] = (rng.standard_normal(shape) > 0 if dtype is np.bool_
                           else rng.integers(0, 5, shape) if dtype is np.int64
                           else rng.random(shape, np.float32))
    return feeds


def _script(session, sizes: dict[str, int], seed: int = 0):
    """What an onnxruntime user writes: describe the model, make inputs from its declaration
    (symbolic dims from ``sizes``), run for every output, then for the last one alone."""
    feeds = _feeds(session, sizes, seed)
    described = ([(a.name, a.shape, a.type) for a in session.get_inputs()],
                 [(a.name, a.shape, a.type) for a in session.get_outputs()])
    last = session.get_outputs()[-1].name
    return described, session.run(None, feeds), session.run([last], feeds)


def _same(model, sizes, tol=1e-4):
    (want_io, want_all, want_last), (got_io, got_all, got_last) = (_script(_onnxruntime(model), sizes),
                                                                   _script(_polyhal(model), sizes))
    assert got_io == want_io
    assert len(got_all) == len(want_all) and len(got_last) == 1
    for g, w in zip(got_all + got_last, want_all + want_last):
        assert isinstance(g, np.ndarray) and g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("name, sizes", [
    ("mlp", {"batch": 4}),
    ("transformer_block", {"batch": 2, "seq": 5}),
    ("detection_postprocess", {}),  # NMS: its output trimmed to the boxes selected, no hidden count
])
def test_example_models_answer_as_onnxruntime_does(name, sizes):
    _same(str(EXAMPLES / f"{name}.onnx"), sizes)


def test_a_dynamic_dim_takes_each_call_its_own_size():
    session = _polyhal(str(EXAMPLES / "transformer_block.onnx"))
    reference = _onnxruntime(str(EXAMPLES / "transformer_block.onnx"))
    for seq in (3, 7, 3):
        x = np.random.default_rng(seq).random((1, seq, 128), np.float32)
        (got,), (want,) = session.run(None, {"x": x}), reference.run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _control_flow_model() -> bytes:
    """y = (x * 2 if sum(x) > 0 else -x), then added to itself ``n`` times by a Loop."""
    vi = h.make_tensor_value_info
    then = h.make_graph([h.make_node("Add", ["x", "x"], ["t"])], "then", [], [vi("t", T.FLOAT, [4])])
    other = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [vi("e", T.FLOAT, [4])])
    body = h.make_graph([h.make_node("Identity", ["c"], ["c_out"]), h.make_node("Add", ["a", "y"], ["a_out"])],
                        "body", [vi("i", T.INT64, []), vi("c", T.BOOL, []), vi("a", T.FLOAT, [4])],
                        [vi("c_out", T.BOOL, []), vi("a_out", T.FLOAT, [4])])
    graph = h.make_graph(
        [h.make_node("ReduceSum", ["x"], ["s"], keepdims=0), h.make_node("Greater", ["s", "zero"], ["c"]),
         h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
         h.make_node("Loop", ["n", "", "y"], ["z"], body=body)],
        "control", [vi("x", T.FLOAT, [4]), vi("n", T.INT64, [])], [vi("y", T.FLOAT, [4]), vi("z", T.FLOAT, [4])],
        initializer=[h.make_tensor("zero", T.FLOAT, [], [0.0])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=8).SerializeToString()


def test_if_and_loop_answer_as_onnxruntime_does():
    model = _control_flow_model()
    session, reference = _polyhal(model), _onnxruntime(model)
    for x, n in ((np.arange(4, dtype=np.float32), 3), (-np.arange(4, dtype=np.float32), 5)):
        feeds = {"x": x, "n": np.array(n)}
        for g, w in zip(session.run(["z", "y"], feeds), reference.run(["z", "y"], feeds)):
            np.testing.assert_allclose(g, w)


@pytest.fixture(scope="module")
def mlp():
    return _polyhal(str(EXAMPLES / "mlp.onnx"))


@pytest.mark.parametrize("names, feeds, message", [
    (["nope"], {"x": np.zeros((2, 256), np.float32)}, "no output 'nope'; its outputs are probs (tensor(float))"),
    (None, {}, "missing input 'x' (float[batch,256])"),
    (None, {"x": np.zeros((2, 256), np.float32), "y": np.zeros(1)}, "no input 'y'"),
    (None, {"x": np.zeros((2, 256), np.float64)}, "input 'x' must be float32 (declared float[batch,256]), got float64"),
    (None, {"x": np.zeros((2, 255), np.float32)}, "input 'x' dim 1 is fixed at 256"),
    (None, {"x": np.zeros(256, np.float32)}, "input 'x' must have rank 2"),
])
def test_misuse_is_a_polyhal_error_naming_the_input_and_what_was_expected(mlp, names, feeds, message):
    with pytest.raises(OnnxInputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        mlp.run(names, feeds)


def test_an_input_that_decides_a_shape_is_imported_per_value():
    vi = h.make_tensor_value_info
    graph = h.make_graph([h.make_node("Reshape", ["x", "shape"], ["y"]), h.make_node("Relu", ["y"], ["z"])], "reshape",
                         [vi("x", T.FLOAT, [6]), vi("shape", T.INT64, [2])], [vi("z", T.FLOAT, [None, None])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=8).SerializeToString()
    session, reference = _polyhal(model), _onnxruntime(model)
    x = np.arange(-3, 3, dtype=np.float32)
    for shape in ((2, 3), (3, 2), (2, 3)):
        feeds = {"x": x, "shape": np.array(shape)}
        (got,), (want,) = session.run(None, feeds), reference.run(None, feeds)
        assert got.shape == want.shape == shape
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------- device-resident runs

@pytest.mark.parametrize("name, sizes", [("mlp", {"batch": 4}), ("transformer_block", {"batch": 2, "seq": 5}),
                                         ("detection_postprocess", {})])
def test_run_with_dlpack_gives_tensors_equal_to_onnxruntimes_outputs(name, sizes):
    model = str(EXAMPLES / f"{name}.onnx")
    session = _polyhal(model)
    feeds = _feeds(session, sizes)
    want = _onnxruntime(model).run(None, feeds)
    tensors = {k: polyhal.from_dlpack(v) for k, v in feeds.items()}  # polyhal Tensors in
    got = session.run_with_dlpack(None, tensors)
    assert all(isinstance(t, polyhal.Tensor) for t in got)
    for g, w in zip(got, want):
        g = np.from_dlpack(g)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    # DLPack producers in (numpy here; cupy and torch arrays alike), the last output alone
    (last,) = session.run_with_dlpack([session.get_outputs()[-1].name], feeds)
    np.testing.assert_allclose(np.from_dlpack(last), want[-1], rtol=1e-4, atol=1e-4)


def test_run_with_dlpack_keeps_data_where_it_lives():
    """No host copy on the way in or out: the input is read in place and the output is a tensor
    of the device, whose memory numpy then views without a copy."""
    session = polyhal.InferenceSession(str(EXAMPLES / "mlp.onnx"), "cpu:0")
    x = np.ones((4, 256), np.float32)
    t = polyhal.from_dlpack(x)
    (y,) = session.run_with_dlpack(None, {"x": t})
    assert isinstance(y, polyhal.Tensor) and y.device.name == "cpu:0"
    before = np.from_dlpack(y).copy()
    x[:] = 0  # the session reads x itself: a run on the changed memory gives another answer
    (y0,) = session.run_with_dlpack(None, {"x": t})
    assert not np.allclose(np.from_dlpack(y0), before)
    np.testing.assert_allclose(np.from_dlpack(y0), session.run(None, {"x": x})[0], rtol=1e-6)


def test_run_with_dlpack_says_what_was_wrong():
    session = polyhal.InferenceSession(str(EXAMPLES / "mlp.onnx"), "cpu:0")
    with pytest.raises(OnnxInputError, match="'x' is a list; run_with_dlpack takes polyhal Tensors"):
        session.run_with_dlpack(None, {"x": [[1.0] * 256]})
    with pytest.raises(OnnxInputError, match="'x' cannot be exported through DLPack .*use run\\(\\) for other"):
        session.run_with_dlpack(None, {"x": np.array([["a"] * 256] * 4, object)})
    with pytest.raises(OnnxInputError, match="no input 'y'"):
        session.run_with_dlpack(None, {"y": np.ones((4, 256), np.float32)})
    with pytest.raises(OnnxInputError, match=r"'x' must be float32\[4, 256\].*got a tensor of float64\[4, 256\]"):
        session.run_with_dlpack(None, {"x": np.ones((4, 256))})


def test_kernels_say_nothing_about_ieee_results():
    """log(0), 0/0, overflowing exp: IEEE results (-inf, nan, inf) as onnxruntime gives them, and
    no numpy RuntimeWarning that would reach the user with polyhal's source paths."""
    import warnings

    nodes = [h.make_node("Log", ["a"], ["log"]), h.make_node("Div", ["a", "a"], ["div"]),
             h.make_node("Exp", ["b"], ["exp"]), h.make_node("Sqrt", ["c"], ["sqrt"])]
    io = [h.make_tensor_value_info(n, T.FLOAT, [3]) for n in ("a", "b", "c")]
    outs = [h.make_tensor_value_info(n, T.FLOAT, [3]) for n in ("log", "div", "exp", "sqrt")]
    model = h.make_model(h.make_graph(nodes, "ieee", io, outs), opset_imports=[h.make_opsetid("", 17)])
    model = model.SerializeToString()
    feeds = {"a": np.array([0, 1, 2], np.float32), "b": np.array([100, 0, 1], np.float32),
             "c": np.array([-1, 0, 4], np.float32)}
    want = _onnxruntime(model).run(None, feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _polyhal(model).run(None, feeds)
        import polyhal.eager

        eager = polyhal.eager.log(polyhal.asarray(np.zeros(3, np.float32), device="cpu:0"))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w)  # -inf, nan and inf where onnxruntime has them
    assert np.all(np.isneginf(eager.numpy()))


def test_run_with_dlpack_takes_and_gives_gpu_memory_in_place():
    """On a GPU: a cupy array in, read in place on cuda:0; a cuda:0 tensor out, which cupy views
    without a copy. Skips without cupy and a CUDA device."""
    cp = pytest.importorskip("cupy")
    if "cuda:0" not in {s.name for s in polyhal.devices()}:
        pytest.skip("no cuda:0 (polyhal devices says why)")
    session = polyhal.InferenceSession(str(EXAMPLES / "mlp.onnx"), "cuda:0")
    x = cp.random.default_rng(0).random((4, 256), dtype=cp.float32)
    (y,) = session.run_with_dlpack(None, {"x": x})
    assert isinstance(y, polyhal.Tensor) and y.device.name == "cuda:0"
    view = cp.from_dlpack(y)
    assert view.data.ptr == cp.from_dlpack(y).data.ptr  # the tensor's own memory, not a copy
    np.testing.assert_allclose(cp.asnumpy(view), _onnxruntime(str(EXAMPLES / "mlp.onnx")).run(None, {"x": cp.asnumpy(x)})[0],
                               rtol=1e-4, atol=1e-4)


def _static_model(scale: float = 2.0) -> bytes:
    """y = softmax(x @ w * scale) with x of a fixed shape: a static model, compiled at creation."""
    vi = h.make_tensor_value_info
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Mul", ["m", "s"], ["p"]),
         h.make_node("Softmax", ["p"], ["y"], axis=-1)],
        "static", [vi("x", T.FLOAT, [2, 4])], [vi("y", T.FLOAT, [2, 3])],
        initializer=[h.make_tensor("w", T.FLOAT, [4, 3], w.ravel()), h.make_tensor("s", T.FLOAT, [], [scale])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=8).SerializeToString()


def test_a_later_session_of_a_static_model_binds_the_same_compile_with_its_own_buffers(tmp_path):
    path = tmp_path / "static.onnx"
    path.write_bytes(_static_model())
    first, again = _polyhal(str(path)), _polyhal(str(path))
    assert again.program is first.program  # not imported again ...
    assert again.plan is not first.plan and again.plan.compilation is first.plan.compilation  # ... nor compiled
    assert again.plan._buffers is not first.plan._buffers
    x = np.random.default_rng(0).random((2, 4), np.float32)
    (want,) = _onnxruntime(str(path)).run(None, {"x": x})
    for session in (first, again):
        np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    assert [(a.name, a.shape, a.type) for a in again.get_inputs()] == [("x", [2, 4], "tensor(float)")]
    # The cache keeps the compile, not the first session's plan (its buffers, device copies).
    import gc
    import weakref

    gone = weakref.ref(first.plan)
    del first
    gc.collect()
    assert gone() is None


def test_sessions_sharing_a_compile_run_at_once_without_mixing_their_results():
    import threading

    model = _static_model()  # MatMul (a oneDNN primitive where it serves), Mul, Softmax
    sessions = [_polyhal(model) for _ in range(2)]
    assert sessions[1].program is sessions[0].program
    inputs = [np.random.default_rng(k).random((2, 4), np.float32) for k in range(2)]
    want = [sessions[0].run(None, {"x": x})[0] for x in inputs]
    failures = []

    def work(k):
        for _ in range(1000):
            (got,) = sessions[k].run(None, {"x": inputs[k]})
            if not np.array_equal(got, want[k]):
                failures.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_another_model_or_other_options_or_the_cache_off_compile_again(monkeypatch):
    first = _polyhal(_static_model(2.0))
    assert _polyhal(_static_model(3.0)).program is not first.program  # other bytes
    assert polyhal.InferenceSession(_static_model(2.0), "cpu:0", fuse=False).program is not first.program
    assert polyhal.InferenceSession(_static_model(2.0), ["cpu:0"]).program is first.program  # the same device list
    monkeypatch.setenv("POLYHAL_PRECISION", "fp32")  # the environment chooses compile policies
    assert _polyhal(_static_model(2.0)).program is not first.program
    monkeypatch.setenv("POLYHAL_SESSION_CACHE", "0")
    assert _polyhal(_static_model(2.0)).program is not _polyhal(_static_model(2.0)).program


def test_a_model_with_external_data_is_read_and_compiled_per_session(tmp_path):
    import onnx

    model = onnx.load_from_string(_static_model())
    onnx.save_model(model, str(tmp_path / "ext.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.bin", size_threshold=0)
    first = _polyhal(str(tmp_path / "ext.onnx"))
    x = np.ones((2, 4), np.float32)
    before = first.run(None, {"x": x})[0]
    # The weights change on disk, the model file does not: a later session reads the new ones.
    onnx.save_model(onnx.load_from_string(_static_model(3.0)), str(tmp_path / "ext.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="ext.bin", size_threshold=0)
    again = _polyhal(str(tmp_path / "ext.onnx"))
    assert again.program is not first.program
    (want,) = _onnxruntime(str(tmp_path / "ext.onnx")).run(None, {"x": x})
    np.testing.assert_allclose(again.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(before, want)
