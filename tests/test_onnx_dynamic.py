"""Shape-polymorphic ONNX models: loaded once, a plan specialized per input shape and cached
(bounded LRU, statistics in explain); contradictory shapes name the dim and both sizes;
``polyhal run`` draws dynamic dims at a default it reports."""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import polyhal  # noqa: E402
import polyhal.onnx as ponnx  # noqa: E402
from polyhal.cli import main as cli_main  # noqa: E402
from polyhal.errors import PolyhalError  # noqa: E402
from polyhal.frontends.onnx import OnnxInputError  # noqa: E402
from polyhal.specialization import SpecializationCache  # noqa: E402

F = TensorProto.FLOAT
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 10


def model_of(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def matmul_model(batch=None) -> onnx.ModelProto:
    """y = relu(x @ W) + b: ``x`` is float[batch, 3] (batch unnamed when None), ``b`` float[batch, 4]."""
    dim = batch if batch is not None else ""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Add", ["r", "b"], ["y"])]
    return model_of(nodes, [helper.make_tensor_value_info("x", F, [dim, 3]),
                            helper.make_tensor_value_info("b", F, [dim, 4])],
                    [helper.make_tensor_value_info("y", F, [dim, 4])], [numpy_helper.from_array(W, "w")])


def feeds(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 3)).astype(np.float32), rng.standard_normal((n, 4)).astype(np.float32)


def expected(x, b):
    return np.maximum(x @ W, 0) + b


@pytest.mark.parametrize("batch", ["batch", None], ids=["named", "unnamed"])
def test_load_once_run_any_batch_compiles_once_per_shape(batch):
    program = ponnx.load(matmul_model(batch))
    assert isinstance(program, ponnx.DynamicOnnxProgram)
    plan = program.compile("cpu:0")
    for n in (1, 7, 1, 1000, 7):
        x, b = feeds(n, seed=n)
        np.testing.assert_allclose(plan(x, b).numpy(), expected(x, b), rtol=1e-5, atol=1e-6)
    assert plan.cache.stats() == {"capacity": 16, "size": 3, "hits": 2, "misses": 3, "evictions": 0}
    text = plan.explain()
    assert "3 specialization(s) of at most 16; 2 hits, 3 misses" in text
    assert "x[1000, 3], b[1000, 4]" in text and "plan @g" in text
    x, b = feeds(2)
    out = program.execute(plan, {"x": x, "b": b})  # the front end's numpy path, by name
    np.testing.assert_allclose(out["y"], expected(x, b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(plan.run_numpy(x=x, b=b)[0], expected(x, b), rtol=1e-5, atol=1e-6)
    assert program.run({"x": x, "b": b})["y"].shape == (2, 4)


def test_the_model_is_one_core_program_with_symbolic_dims():
    # polyhal.compile takes the model's one program (symbolic dims) and specializes it per shape.
    dynamic = ponnx.load(matmul_model("batch"))
    assert dynamic.reimport == "" and str(dynamic.program.inputs[0].type) == "tensor<batchx3xfloat32>"
    plan = polyhal.compile(dynamic.program, "cpu:0")
    x, b = feeds(5)
    np.testing.assert_allclose(plan(x=x, b=b).numpy(), expected(x, b), rtol=1e-5, atol=1e-6)


def test_bounded_cache_evicts_least_recently_used(monkeypatch):
    plan = ponnx.load(matmul_model("batch")).compile("cpu:0", cache_size=2)
    for n in (1, 2, 1, 3):  # 2 is least recently used when 3 arrives
        plan(*feeds(n))
    assert [k[0][0] for k in plan.cache.keys()] == [1, 3]
    assert plan.cache.evictions == 1 and len(plan.plans) == 2
    plan(*feeds(2))  # compiled again
    assert plan.cache.misses == 4
    monkeypatch.setenv("POLYHAL_SHAPE_CACHE", "3")
    assert ponnx.load(matmul_model("batch")).compile("cpu:0").cache.capacity == 3
    monkeypatch.setenv("POLYHAL_SHAPE_CACHE", "zero")
    with pytest.raises(PolyhalError, match="POLYHAL_SHAPE_CACHE='zero' is not an integer >= 1"):
        ponnx.load(matmul_model("batch")).compile("cpu:0")


def test_cache_counts():
    cache = SpecializationCache(1)
    assert cache.get_or_make("a", str.upper) == "A" and cache.get_or_make("a", str.upper) == "A"
    cache.get_or_make("b", str.upper)
    assert cache.stats() == {"capacity": 1, "size": 1, "hits": 1, "misses": 2, "evictions": 1}


def test_contradictory_shapes_name_the_dim_and_both_sizes():
    plan = ponnx.load(matmul_model("batch")).compile("cpu:0")
    x, _ = feeds(3)
    _, b = feeds(5)
    with pytest.raises(OnnxInputError, match=r"symbolic dim 'batch' has two sizes: 3 \(input 'x' dim 0\) and 5 "
                                             r"\(input 'b' dim 0\)"):
        plan(x, b)
    with pytest.raises(OnnxInputError, match=r"input 'x' dim 1 is fixed at 3 by the model \(declared "
                                             r"float\[batch,3\]\), got 2"):
        plan(np.ones((3, 2), np.float32), b[:3])
    with pytest.raises(OnnxInputError, match="input 'x' must have rank 2"):
        plan(np.ones(3, np.float32), b[:3])
    assert plan.cache.misses == 0  # nothing was compiled for bad shapes


def test_unnamed_dims_are_independent_per_input():
    # Unnamed dims carry no promise that two inputs agree: the mismatch reaches the Add, whose
    # shape error names the node.
    plan = ponnx.load(matmul_model(None)).compile("cpu:0")
    with pytest.raises(PolyhalError, match="Add"):
        plan(feeds(3)[0], feeds(5)[1])


def test_dims_bind_symbols_and_a_changed_dim_is_refused():
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    m = model_of(nodes, [helper.make_tensor_value_info("x", F, ["batch", "seq"])],
                 [helper.make_tensor_value_info("y", F, ["batch", "seq"])])
    # Every dim given: a static program, as before; a changed batch is refused naming the dim.
    static = ponnx.load(m, dims={"batch": 2, "seq": 4})
    assert isinstance(static, ponnx.OnnxProgram)
    with pytest.raises(OnnxInputError, match=r"dim 0 is 2 in this program, got 3"):
        static.run({"x": np.ones((3, 4), np.float32)})
    # Some given: those stay bound, the rest follow each call.
    program = ponnx.load(m, dims={"seq": 4})
    assert isinstance(program, ponnx.DynamicOnnxProgram) and program.bound == {"seq": 4}
    plan = program.compile("cpu:0")
    for n in (1, 6):
        assert plan(np.ones((n, 4), np.float32)).shape == (n, 4)
    with pytest.raises(OnnxInputError, match=r"symbolic dim 'seq' has two sizes: 4 \(dims= at load\) and 5 "
                                             r"\(input 'x' dim 1\)"):
        plan(np.ones((1, 5), np.float32))
    with pytest.raises(OnnxInputError, match="no symbolic dim 'sequence'"):
        ponnx.load(m, dims={"sequence": 4})
    assert "bound at load: seq=4" in program.explain(plan)


def test_shapes_given_for_one_input_size_its_symbols_for_the_others():
    m = matmul_model("batch")
    program = ponnx.load(m, shapes={"x": (6, 3)}, default_dim=1)
    assert [v.type.shape for v in program.inputs] == [(6, 3), (6, 4)]
    with pytest.raises(OnnxInputError, match=r"symbolic dim 'batch' has two sizes: 2 \(dims= at load\) and 6"):
        ponnx.load(m, shapes={"x": (6, 3)}, dims={"batch": 2})


def test_cli_run_draws_dynamic_dims_at_one_and_says_so(capsys, tmp_path):
    path = tmp_path / "dyn.onnx"
    onnx.save(matmul_model("batch"), path)
    assert cli_main(["run", str(path), "--device", "cpu:0"]) == 0
    out = capsys.readouterr().out
    assert "dim    batch = 1 (default; give --dim/--shape to change it)" in out
    assert "output y: float32[1, 4]" in out
    assert cli_main(["run", str(path), "--dim", "batch=3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["default_dims"] == [] and report["outputs"][0]["shape"] == [3, 4]
    onnx.save(matmul_model(None), path)
    assert cli_main(["run", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["default_dims"] == [{"dim": "x[0]", "size": 1},
                                                                  {"dim": "b[0]", "size": 1}]
    np.save(tmp_path / "x.npy", np.ones((5, 3), np.float32))
    assert cli_main(["run", str(path), "--input", f"x={tmp_path / 'x.npy'}"]) == 0  # b[1, 4] broadcasts
    assert "dim    b[0] = 1 (default" in capsys.readouterr().out
    onnx.save(matmul_model("batch"), path)
    assert cli_main(["run", str(path), "--input", f"x={tmp_path / 'x.npy'}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # batch from the file, b drawn to match
    assert report["default_dims"] == [] and report["outputs"][0]["shape"] == [5, 4]


def test_specializations_come_from_the_one_program_not_a_reimport():
    dynamic = ponnx.load(matmul_model("batch"))

    def reimport(shapes):
        raise AssertionError(f"re-imported for {shapes}")

    dynamic._specialize = reimport  # the model's ops allow symbolic dims: nothing is imported again
    plan = dynamic.compile("cpu:0")
    for n in (2, 7):
        x, b = feeds(n)
        np.testing.assert_allclose(plan(x, b).numpy(), expected(x, b), rtol=1e-5, atol=1e-6)
        assert plan.specialization(x, b).program.origins == dynamic.program.origins
    assert "one program with symbolic dims" in dynamic.explain(plan)


def test_a_shape_read_of_a_symbol_falls_back_to_a_reimport_per_shape():
    # Shape(x) feeding Reshape: the shape is data computed from the symbol, which the importer
    # folds to a constant only for a concrete size.
    model = model_of([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    dynamic = ponnx.load(model)
    assert dynamic.program is None and "(Shape): dim batch is symbolic" in dynamic.reimport
    plan = dynamic.compile("cpu:0")
    for n in (1, 3):
        x = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
        np.testing.assert_array_equal(plan(x).numpy(), x)
    assert plan.cache.misses == 2 and "imported per input shape: " in dynamic.explain(plan)
