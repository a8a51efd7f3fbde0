"""The ONNX front end: importing, running, placement across devices, `polyhal run`, and every
kind of bad input (each a clear polyhal error naming what and where), plus a fuzz test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import polyhal  # noqa: E402
import polyhal.onnx as ponnx  # noqa: E402
from polyhal.cli import main as cli_main  # noqa: E402
from polyhal.errors import PolyhalError  # noqa: E402
from polyhal.frontends.onnx import (  # noqa: E402
    OnnxInputError, OnnxModelError, OnnxUnsupportedError, StrictPlacementError,
)
from polyhal.frontends.onnx.backend import PolyhalBackend  # noqa: E402
from polyhal.frontends.onnx.staged import StagedOnnxProgram  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
F = TensorProto.FLOAT


def model_of(nodes, inputs, outputs, initializers=(), opset=17, name="g") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def vi(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def relu_model() -> onnx.ModelProto:
    return model_of([helper.make_node("Relu", ["x"], ["y"], name="act")], [vi("x", [2, 3])], [vi("y", [2, 3])])


# ------------------------------------------------------------------------------------ basics

def test_import_polyhal_does_not_import_onnx():
    code = "import sys, polyhal, polyhal.cli; print('onnx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_load_compile_run_by_name():
    program = ponnx.load(relu_model())
    assert isinstance(program, polyhal.Program) and program.input_names == ["x"]
    plan = polyhal.compile(program, "cpu:0")
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    np.testing.assert_array_equal(plan(x=x).numpy(), np.maximum(x, 0))
    assert program.run({"x": x}, "cpu:0")["y"].tolist() == np.maximum(x, 0).tolist()


def test_initializers_shape_subgraphs_fold_and_symbolic_dims():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Shape", ["h"], ["s"], name="shape"),
        helper.make_node("Reshape", ["h", "s"], ["y"], name="reshape"),
    ]
    m = model_of(nodes, [vi("x", ["batch", 3])], [vi("y", ["batch", 4])], [numpy_helper.from_array(w, "w")])
    assert isinstance(ponnx.load(m), ponnx.DynamicOnnxProgram)  # sized per call (tests/test_onnx_dynamic.py)
    program = ponnx.load(m, dims={"batch": 5})
    assert "shape (Shape)" in program.folded[0]
    assert [op.name for op in program.ops] == ["matmul", "reshape"]
    assert len(program.constants) == 1
    x = np.ones((5, 3), np.float32)
    np.testing.assert_allclose(program.run({"x": x})["y"], x @ w)


def test_examples_match_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(1)
    for file, feeds in [
        ("mlp.onnx", {"x": rng.standard_normal((8, 256)).astype(np.float32)}),
        ("transformer_block.onnx", {"x": rng.standard_normal((2, 16, 128)).astype(np.float32)}),
        ("detection_postprocess.onnx", {"boxes": rng.random((1, 1000, 4)).astype(np.float32),
                                        "scores": rng.random((1, 8, 1000)).astype(np.float32)}),
    ]:
        path = EXAMPLES / file
        ours = ponnx.load(path, shapes={k: v.shape for k, v in feeds.items()}).run(feeds, "cpu:0")
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for out, want in zip(session.get_outputs(), session.run(None, feeds)):
            got = ours[out.name]
            assert got.shape == want.shape, (file, out.name)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{file} {out.name}")


def test_values_fix_shape_inputs_and_backend_learns_them():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")]
    m = model_of(nodes, [vi("x", [2, 6]), vi("shape", [2], TensorProto.INT64)], [vi("y", ["a", "b"])])
    staged = ponnx.load(m)  # without values: staged, a plan per value of 'shape'
    assert isinstance(staged, StagedOnnxProgram)
    assert staged.run({"x": np.zeros((2, 6), np.float32), "shape": np.array([4, 3])}, "cpu:0")["y"].shape == (4, 3)
    program = ponnx.load(m, values={"shape": np.array([3, 4])})
    assert program.input_names == ["x"] and "shape" in program.frozen
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    rep = PolyhalBackend.prepare(m, "cpu:0")
    for shape in ([3, 4], [4, 3], [12, 1]):
        (y,) = rep.run([x, np.array(shape, np.int64)])
        np.testing.assert_array_equal(y, x.reshape(shape))


def test_matmul_and_bias_add_fuse_into_linear():
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    b = numpy_helper.from_array(np.array([1, 2, 3, 4], np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["y"], name="bias")]
    m = model_of(nodes, [vi("x", [2, 5, 3])], [vi("y", [2, 5, 4])], [w, b])
    program = ponnx.load(m)
    plan = program.compile("cpu:0")
    assert [op.name for op in plan.program.ops] == ["linear"]
    assert "mm (MatMul) + bias (Add): linear -> cpu:0" in program.explain(plan)
    x = np.random.default_rng(0).standard_normal((2, 5, 3)).astype(np.float32)
    want = x @ numpy_helper.to_array(w) + numpy_helper.to_array(b)
    np.testing.assert_allclose(program.execute(plan, {"x": x})["y"], want, rtol=1e-6)
    unfused = program.compile("cpu:0", fuse=False)
    assert [op.name for op in unfused.program.ops] == ["matmul", "add"]
    # A scalar scaling of a product moves onto the smaller operand (attention's 1/sqrt(d)).
    s = numpy_helper.from_array(np.array(0.25, np.float32), "s")
    nodes = [helper.make_node("MatMul", ["q", "k"], ["p"], name="qk"),
             helper.make_node("Mul", ["p", "s"], ["y"], name="scale")]
    m = model_of(nodes, [vi("q", [8, 2]), vi("k", [2, 8])], [vi("y", [8, 8])], [s])
    program = ponnx.load(m)
    plan = program.compile("cpu:0")
    assert [op.name for op in plan.program.ops] == ["mul", "matmul"]
    q, k = np.arange(16, dtype=np.float32).reshape(8, 2), np.ones((2, 8), np.float32)
    np.testing.assert_allclose(program.execute(plan, {"q": q, "k": k})["y"], q @ k * 0.25)


def test_function_ops_are_expanded():
    # MeanVarianceNormalization has no converter: ONNX's function body runs instead.
    m = model_of([helper.make_node("MeanVarianceNormalization", ["x"], ["y"], name="mvn")],
                 [vi("x", [2, 3, 4, 5])], [vi("y", [2, 3, 4, 5])], opset=13)
    program = ponnx.load(m)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = np.sqrt(((x - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True))
    np.testing.assert_allclose(program.run({"x": x})["y"], (x - mean) / (std + 1e-9), rtol=1e-4, atol=1e-5)
    assert all("mvn (MeanVarianceNormalization)" in program.origin(op) for op in program.ops)


def test_output_that_is_an_input_or_constant_is_copied():
    c = numpy_helper.from_array(np.array([1.5, 2.5], np.float32), "c")
    nodes = [helper.make_node("Identity", ["x"], ["y"], name="id"),
             helper.make_node("Identity", ["c"], ["z"], name="idc")]
    m = model_of(nodes, [vi("x", [2])], [vi("y", [2]), vi("z", [2])], [c])
    out = ponnx.load(m).run({"x": np.array([3, 4], np.float32)})
    assert out["y"].tolist() == [3, 4] and out["z"].tolist() == [1.5, 2.5]


# --------------------------------------------------------------------------- bad input

def test_truncated_file(tmp_path):
    data = (EXAMPLES / "mlp.onnx").read_bytes()
    for cut in (len(data) // 2, len(data) - 7, 40):
        path = tmp_path / f"cut{cut}.onnx"
        path.write_bytes(data[:cut])
        with pytest.raises(OnnxModelError, match=rf"cut{cut}\.onnx: .*(truncated|not an ONNX model)"):
            ponnx.load(path)


def test_bytes_that_are_not_a_model(tmp_path):
    with pytest.raises(OnnxModelError, match="not an ONNX model"):
        ponnx.load(b"this is certainly not an ONNX model\x00\xff")
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(OnnxModelError, match="notes.txt: not an ONNX model"):
        ponnx.load(path)
    with pytest.raises(OnnxModelError, match="empty"):
        ponnx.load(b"")
    with pytest.raises(OnnxModelError, match="no such file"):
        ponnx.load(tmp_path / "missing.onnx")


def test_opset_newer_than_supported():
    m = relu_model()
    m.opset_import[0].version = ponnx.MAX_OPSET + 2
    with pytest.raises(OnnxUnsupportedError, match=rf"opset {ponnx.MAX_OPSET + 2} is newer than polyhal supports "
                                                   rf"\(opsets {ponnx.MIN_OPSET} to {ponnx.MAX_OPSET}\)"):
        ponnx.load(m)


def test_unsupported_op_names_op_and_node():
    # a training op, which polyhal leaves unsupported
    node = helper.make_node("Momentum", ["r", "t", "x", "g", "v"], ["x2", "v2"], name="step",
                            domain="ai.onnx.preview.training", alpha=0.9, beta=1.0, mode="standard", norm_coefficient=0.0)
    m = model_of([node], [vi("r", []), vi("t", [], TensorProto.INT64), vi("x", [2]), vi("g", [2]), vi("v", [2])],
                 [vi("x2", [2]), vi("v2", [2])])
    m.opset_import.append(helper.make_opsetid("ai.onnx.preview.training", 1))
    with pytest.raises(OnnxUnsupportedError, match=r"node step \(Momentum\): Momentum is a training-only"):
        ponnx.load(m)


def test_unsupported_element_type():
    m = model_of([helper.make_node("Identity", ["x"], ["y"])], [vi("x", [2], TensorProto.COMPLEX64)],
                 [vi("y", [2], TensorProto.COMPLEX64)])
    with pytest.raises(OnnxUnsupportedError, match="input 'x' has element type COMPLEX64"):
        ponnx.load(m)


def test_missing_extra_and_mistyped_inputs():
    program = ponnx.load(relu_model(), source="relu.onnx")
    x = np.ones((2, 3), np.float32)
    with pytest.raises(OnnxInputError, match=r"relu.onnx: missing input 'x' \(float\[2,3\]\)"):
        program.check_feeds({})
    with pytest.raises(OnnxInputError, match="relu.onnx: the model has no input 'z'; its inputs are x"):
        program.check_feeds({"x": x, "z": x})
    with pytest.raises(OnnxInputError, match=r"input 'x' must have shape \(2, 3\) \(declared float\[2,3\]\), got \(3, 2\)"):
        program.check_feeds({"x": x.T})
    with pytest.raises(OnnxInputError, match="input 'x' must be float32 .* got float64"):
        program.check_feeds({"x": x.astype(np.float64)})
    with pytest.raises(OnnxInputError, match="no input 'q'"):
        ponnx.load(relu_model(), shapes={"q": (1,)})
    with pytest.raises(OnnxInputError, match=r"input 'x' dim 0 is fixed at 2 by the model \(declared float\[2,3\]\), got 4"):
        ponnx.load(relu_model(), shapes={"x": (4, 3)})


def test_declared_shapes_that_contradict_the_data():
    # The output is declared [2, 5] but Relu of a [2, 3] input is [2, 3].
    m = model_of([helper.make_node("Relu", ["x"], ["y"], name="act")], [vi("x", [2, 3])], [vi("y", [2, 5])])
    with pytest.raises(OnnxModelError, match=r"node act \(Relu\): output 'y' is declared float\[2,5\] but the data "
                                             r"gives shape \[2, 3\]"):
        ponnx.load(m, strict_shapes=True)
    # By default a graph output's declared shape gives way to the data, as in onnxruntime, with a warning.
    with pytest.warns(ponnx.DeclaredShapeWarning, match=r"output 'y' is declared float\[2,5\].*trusts the data"):
        program = ponnx.load(m)
    assert program.run({"x": -np.ones((2, 3), np.float32)}, "cpu:0")["y"].shape == (2, 3)
    # An initializer that is also an input, declared with another shape.
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    m = model_of([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [2, 3]), vi("w", [4, 3])],
                 [vi("y", [2, 4])], [w])
    with pytest.raises(OnnxModelError, match=r"input 'w' is declared float\[4,3\] but its initializer has shape \[3, 4\]|"
                                             r"(contradict|inconsistent|Inferred shape)"):
        ponnx.load(m)
    # Shapes that do not fit the op: a clear error naming the node.
    m = model_of([helper.make_node("Add", ["x", "z"], ["y"], name="plus")], [vi("x", [2, 3]), vi("z", [4])],
                 [vi("y", None)])
    with pytest.raises(PolyhalError, match=r"node plus \(Add\): add: shapes \(2,3\) and \(4,\) do not broadcast"):
        ponnx.load(m, validate=False)


def test_undefined_value_is_a_model_error():
    m = model_of([helper.make_node("Relu", ["nowhere"], ["y"], name="act")], [vi("x", [2])], [vi("y", [2])])
    with pytest.raises(OnnxModelError, match="nowhere"):
        ponnx.load(m, validate=False)


# ------------------------------------------------------------------------- placement

@pytest.fixture
def add_only_device(install_plugin, fresh_registry):
    """A second device ("tiny:0") whose backend has the kernels of add and identity only."""
    install_plugin("tiny", '''
import polyhal
from polyhal_cpu.allocator import host_heap
from polyhal_cpu.device import CPUDevice
POLYHAL_API_VERSION = polyhal.API_VERSION
class TinyDevice(CPUDevice):
    kernel_names = frozenset({"add", "identity"})
@polyhal.hookimpl
def register_devices():
    return [polyhal.DeviceSpec(name="tiny:0", backend="tiny", rank=9, factory=TinyDevice, heaps=(host_heap(),))]
''')
    return fresh_registry()


def test_heterogeneous_placement_and_strict(add_only_device):
    registry = add_only_device
    nodes = [helper.make_node("Add", ["x", "x"], ["a"], name="double"),
             helper.make_node("Relu", ["a"], ["y"], name="act")]
    m = model_of(nodes, [vi("x", [4])], [vi("y", [4])])
    program = ponnx.load(m, source="two.onnx")
    with pytest.raises(StrictPlacementError, match=r"two.onnx: 1 op\(s\) have no kernel on tiny:0 \(strict placement\): "
                                                   r"node act \(Relu\): op 'relu'.*would run on cpu:0"):
        program.compile("tiny:0", strict=True, registry=registry)
    plan = program.compile("tiny:0", registry=registry)
    devices = {program.origin(op): op.device for op in plan.program.ops if op.kind == "dispatch"}
    assert devices == {"double (Add)": "tiny:0", "act (Relu)": "cpu:0"}
    assert plan.placement.transfers >= 1
    explained = program.explain(plan)
    assert "act (Relu): relu -> cpu:0" in explained and "transfers:" in explained
    x = np.array([-1, 2, -3, 4], np.float32)
    np.testing.assert_array_equal(program.execute(plan, {"x": x})["y"], np.maximum(2 * x, 0))


# --------------------------------------------------------------------------------- CLI

def test_cli_run_random_inputs_explain_and_json(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("POLYHAL_PROGRESS", raising=False)
    assert cli_main(["run", str(EXAMPLES / "mlp.onnx"), "--dim", "batch=4", "--explain", "--repeat", "3",
                     "--device", "cpu:0"]) == 0
    out, err = capsys.readouterr()
    assert "output probs: float32[4, 16]" in out and "fc0 (Gemm) + relu0 (Relu): fused_linear -> cpu:0" in out
    assert "3 runs: median" in out and "runs," not in err  # stderr is no terminal: no progress bar
    monkeypatch.setenv("POLYHAL_PROGRESS", "1")  # asked for: one line at the end
    assert cli_main(["run", str(EXAMPLES / "mlp.onnx"), "--dim", "batch=4", "--repeat", "3", "--device", "cpu:0"]) == 0
    assert "3/3 runs" in capsys.readouterr().err
    assert cli_main(["run", str(EXAMPLES / "mlp.onnx"), "--json", "--output", str(tmp_path / "out")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["outputs"][0]["shape"] == [1, 16] and report["devices"]
    assert np.load(tmp_path / "out" / "probs.npy").shape == (1, 16)


def test_cli_run_explains_fusions_and_turns_them_off(capsys):
    model = str(EXAMPLES / "transformer_block.onnx")
    assert cli_main(["run", model, "--dim", "seq=8", "--explain", "--device", "cpu:0"]) == 0
    out = capsys.readouterr().out
    assert "fused attention: transpose + matmul + mul + softmax + matmul" in out
    assert "q.matmul (MatMul) + q.add (Add): linear -> cpu:0" in out
    assert cli_main(["run", model, "--dim", "seq=8", "--explain", "--device", "cpu:0", "--no-fuse"]) == 0
    out = capsys.readouterr().out
    assert "fusion: off" in out and "attention" not in out and "q.add (Add): add -> cpu:0" in out


def test_cli_run_inputs_from_files(capsys, tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.savez(tmp_path / "in.npz", x=x)
    for spec in (f"x={tmp_path / 'x.npy'}", str(tmp_path / "in.npz"), f"x={tmp_path / 'in.npz'}"):
        assert cli_main(["run", str(EXAMPLES / "mlp.onnx"), "--input", spec, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["inputs"][0] == {"name": "x", "shape": [3, 256], "dtype": "float32", "source": "file"}
        want = ponnx.load(EXAMPLES / "mlp.onnx", shapes={"x": x.shape}).run({"x": x})["probs"]
        np.testing.assert_allclose(report["outputs"][0]["values"], want, rtol=1e-6)


def test_cli_run_errors(capsys, tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    assert cli_main(["run", str(bad)]) == 2
    assert "bad.onnx" in capsys.readouterr().err
    np.save(tmp_path / "x.npy", np.ones((3, 7), np.float32))
    assert cli_main(["run", str(EXAMPLES / "mlp.onnx"), "--input", f"x={tmp_path / 'x.npy'}"]) == 2
    assert "input 'x' dim 1 is fixed at 256 by the model (declared float[batch,256]), got 7" in capsys.readouterr().err
    assert cli_main(["run", str(EXAMPLES / "mlp.onnx"), "--input", f"nope={tmp_path / 'x.npy'}"]) == 2
    assert "no input 'nope'" in capsys.readouterr().err
    assert cli_main(["run", str(EXAMPLES / "mlp.onnx"), "--input", "x=/no/such.npy"]) == 2
    assert "no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- fuzz

def _fuzz_targets():
    return [(EXAMPLES / "mlp.onnx").read_bytes(), (EXAMPLES / "detection_postprocess.onnx").read_bytes(),
            _small_transformer()]


def _small_transformer() -> bytes:
    # The example block's structure with few weights, so each fuzz case is quick.
    m = onnx.load(EXAMPLES / "transformer_block.onnx")
    return m.SerializeToString()


def _check_only_polyhal_errors(data: bytes) -> None:
    # Without validation the converters meet malformed graphs that ONNX's checker would stop.
    for validate in (True, False):
        try:
            program = ponnx.load(data, default_dim=2, validate=validate)
            feeds = {v.name: np.ones(v.type.shape, v.type.dtype) for v in program.inputs}
            program.run(feeds, "cpu:0")
        except PolyhalError:
            pass


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

_TARGETS = _fuzz_targets()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(which=st.integers(0, len(_TARGETS) - 1), cuts=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)),
                                                               min_size=1, max_size=6),
       truncate=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzz_mutated_bytes(which, cuts, truncate):
    data = bytearray(_TARGETS[which])
    # Mutations in the first 4 KiB hit the graph's structure (nodes, types); elsewhere weights.
    for pos, byte in cuts:
        i = int(pos * min(len(data) - 1, 4096))
        data[i] = byte
    if truncate is not None:
        data = data[: int(truncate * len(data))]
    _check_only_polyhal_errors(bytes(data))


_MUTATIONS = ["op_type", "attr_int", "dim", "elem_type", "drop_input", "rename_input", "swap_nodes", "drop_init"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
@given(which=st.integers(0, 1), steps=st.lists(st.tuples(st.sampled_from(_MUTATIONS), st.integers(0, 10**6)),
                                                min_size=1, max_size=4))
def test_fuzz_mutated_models(which, steps):
    m = onnx.ModelProto()
    m.ParseFromString(_TARGETS[[0, 2][which]])
    g = m.graph
    ops = ["Relu", "Gemm", "Softmax", "Reshape", "Transpose", "MatMul", "Add", "Gelu", "LayerNormalization",
           "TopK", "Gather", "Concat", "Shape", "Slice", "Erf", "NoSuchOp"]
    for kind, r in steps:
        node = g.node[r % len(g.node)]
        if kind == "op_type":
            node.op_type = ops[r % len(ops)]
        elif kind == "attr_int" and node.attribute:
            a = node.attribute[r % len(node.attribute)]
            a.type, a.i = onnx.AttributeProto.INT, (r % 7) - 3
        elif kind == "dim":
            dims = g.input[0].type.tensor_type.shape.dim
            dims[r % len(dims)].dim_value = r % 5
        elif kind == "elem_type":
            g.input[0].type.tensor_type.elem_type = r % 17
        elif kind == "drop_input" and node.input:
            del node.input[r % len(node.input)]
        elif kind == "rename_input" and node.input:
            node.input[r % len(node.input)] = g.node[(r // 7) % len(g.node)].output[0]
        elif kind == "swap_nodes" and len(g.node) > 1:
            i, j = r % len(g.node), (r // 3) % len(g.node)
            a, b = onnx.NodeProto(), onnx.NodeProto()
            a.CopyFrom(g.node[i])
            b.CopyFrom(g.node[j])
            g.node[i].CopyFrom(b)
            g.node[j].CopyFrom(a)
        elif kind == "drop_init" and g.initializer:
            del g.initializer[r % len(g.initializer)]
    _check_only_polyhal_errors(m.SerializeToString())


def test_a_string_field_that_is_not_utf8_is_a_polyhal_error():
    # Found by test_fuzz_mutated_bytes: byte 64 of mlp.onnx lies inside a text field.
    data = bytearray((EXAMPLES / "mlp.onnx").read_bytes())
    data[64] = 0x80
    with pytest.raises(PolyhalError, match="not UTF-8"):
        ponnx.load(bytes(data), default_dim=2)
