"""The real-model files of bench/models: cut/refill round trips, and every committed file is whole."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.models import (CUT_KEY, CutModelError, cut, fix_dims, load_cut, manifest, materialize, records,
                          refill)


def _tiny() -> onnx.ModelProto:
    """Conv (per-channel weight scales) -> Add(mask) -> MatMul, with a small bias and a big int table."""
    rng = np.random.default_rng(1)
    conv_w = (rng.standard_normal((8, 4, 3, 3)) * np.arange(1, 9).reshape(8, 1, 1, 1)).astype(np.float32)
    bias = rng.standard_normal(8).astype(np.float32)
    mask = np.where(rng.random((8, 6, 6)) < 0.5, 0.0, -1e9).astype(np.float32)
    mat = (rng.standard_normal((6, 300)) * 0.5 + 2.0).astype(np.float32)
    table = np.arange(5000, dtype=np.int64)
    inits = [numpy_helper.from_array(a, n) for a, n in
             ((conv_w, "conv_w"), (bias, "bias"), (mask, "mask"), (mat, "mat"), (table, "table"))]
    nodes = [helper.make_node("Conv", ["x", "conv_w", "bias"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "mask"], ["m"]),
             helper.make_node("MatMul", ["m", "mat"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6, 6])
    graph = helper.make_graph(nodes, "tiny", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 6, 300])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_cut_keeps_small_and_non_float_tensors_and_records_the_rest():
    model = _tiny()
    small = cut(model, above=100)
    assert set(_inits(small)) == {"bias", "table"}
    assert np.array_equal(_inits(small)["bias"], _inits(model)["bias"])
    rules = {r["name"]: r["rule"] for r in records(small)}
    assert rules == {"conv_w": "normal_per_channel", "mask": "zlib", "mat": "normal"}
    cut_bytes = sum(_inits(model)[n].nbytes for n in ("conv_w", "mask", "mat"))
    assert small.ByteSize() < model.ByteSize() - 0.8 * cut_bytes
    assert records(model) == []


def test_refill_round_trips_shapes_dtypes_and_statistics():
    model = _tiny()
    original, filled = _inits(model), _inits(refill(cut(model, above=100), seed=3))
    assert set(filled) == set(original)
    for name, want in original.items():
        assert filled[name].shape == want.shape and filled[name].dtype == want.dtype, name
    assert np.array_equal(filled["mask"], original["mask"])  # few distinct values: exact
    assert np.array_equal(filled["bias"], original["bias"])  # small: kept as exported
    assert not np.array_equal(filled["mat"], original["mat"])  # large: drawn again
    assert abs(filled["mat"].mean() - 2.0) < 0.05 and abs(filled["mat"].std() - 0.5) < 0.05
    per_channel = filled["conv_w"].reshape(8, -1).std(axis=1)
    np.testing.assert_allclose(per_channel, original["conv_w"].reshape(8, -1).std(axis=1), rtol=0.35)
    assert per_channel[-1] > 4 * per_channel[0]  # each output channel keeps its own scale
    onnx.checker.check_model(refill(cut(model, above=100)), full_check=True)


def test_refill_is_deterministic_per_seed():
    small = cut(_tiny(), above=100)
    a, b, c = (_inits(refill(small, seed=s)) for s in (0, 0, 1))
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert not np.array_equal(a["mat"], c["mat"])


def test_fix_dims_sets_symbolic_input_and_output_dims():
    model = fix_dims(refill(cut(_tiny(), above=100)), {"batch": 8})
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [8, 4, 6, 6]
    assert model.graph.output[0].type.tensor_type.shape.dim[0].dim_value == 8


def test_bad_files_are_refused_with_the_reason(tmp_path):
    small = cut(_tiny(), above=100)
    for prop in small.metadata_props:
        if prop.key == CUT_KEY:
            bad = json.loads(prop.value)
            bad[0]["rule"] = "uniform"
            prop.value = json.dumps(bad)
    with pytest.raises(CutModelError, match="unknown refill rule 'uniform'"):
        refill(small)
    with pytest.raises(CutModelError, match="no such cut model"):
        load_cut(tmp_path / "absent.cut.onnx")


@pytest.mark.parametrize("name", sorted(manifest()["models"]))
def test_committed_model_file_is_whole(name):
    """Every node input is a graph input, a kept initializer, a cut record or a node output, and
    the manifest's inputs are the file's (the graph is not run here)."""
    entry = manifest()["models"][name]
    assert "file" in entry, f"{name} was not exported: {entry.get('errors')}"
    model = load_cut(name)
    cut_names = {r["name"] for r in records(model)}
    kept = {t.name for t in model.graph.initializer}
    assert cut_names and not cut_names & kept
    produced = {i.name for i in model.graph.input} | kept | cut_names | {""}
    for node in model.graph.node:
        missing = [i for i in node.input if i not in produced]
        assert not missing, f"{name}: {node.op_type} {node.name} reads {missing}"
        produced.update(node.output)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
              for i in model.graph.input if i.name not in kept}
    assert inputs == {k: v["shape"] for k, v in entry["inputs"].items()}
    assert entry["refilled_output"]["finite"]


def test_a_committed_model_imports_into_polyhal():
    import polyhal.onnx

    program = polyhal.onnx.load(materialize("resnet50", {"batch": 1}))
    assert program.node_count == manifest()["models"]["resnet50"]["nodes"]
