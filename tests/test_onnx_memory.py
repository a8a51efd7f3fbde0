"""Memory of an imported ONNX model: its weights are held once, not once per import step."""

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import polyhal.onnx
from polyhal.frontends.onnx import importer


def _model(n: int = 256) -> tuple[onnx.ModelProto, np.ndarray]:
    """x @ w + x @ identity(w): a weight used twice, once through Identity (as torch exports
    shared weights), large enough to be stripped from validation's copy."""
    w = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    nodes = [helper.make_node("Identity", ["w"], ["w2"]), helper.make_node("MatMul", ["x", "w"], ["a"]),
             helper.make_node("MatMul", ["x", "w2"], ["b"]), helper.make_node("Add", ["a", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, n])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, n])],
                              [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def test_weights_are_held_once_by_the_program():
    model, w = _model()
    program = polyhal.onnx.load(model.SerializeToString())
    held = {arr.__array_interface__["data"][0]: arr.nbytes for _, arr in program.constants}
    assert sum(held.values()) == w.nbytes, "the program holds a second copy of its weight"
    assert all(not arr.flags.writeable for _, arr in program.constants)
    (arr,) = [a for _, a in program.constants if a.nbytes == w.nbytes]
    root = arr
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    assert isinstance(root, bytes), "the weight was copied after it was read from the model"
    x = np.ones((2, w.shape[0]), np.float32)
    plan = program.compile("cpu:0")
    np.testing.assert_allclose(program.execute(plan, {"x": x})["y"], 2 * x @ w, rtol=1e-4)


def test_validation_sees_a_copy_without_the_weights():
    model, w = _model()
    light, weights = importer._strip_weights(model)
    assert set(weights) == {"w"} and weights["w"].raw_data == w.tobytes()
    assert not light.graph.initializer and "w" in {i.name for i in light.graph.input}
    checked = importer._restore_placeholders(importer._validate(light, "m"), model, weights)
    assert [i.name for i in checked.graph.input] == ["x"]
    (placeholder,) = checked.graph.initializer
    assert placeholder.name == "w" and list(placeholder.dims) == list(w.shape) and not placeholder.raw_data


def test_builder_constant_copies_unless_told_not_to():
    from polyhal.ir.program import ProgramBuilder

    b = ProgramBuilder("p")
    mine = np.zeros(4, np.float32)
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    b.constant(mine), b.constant(frozen), b.constant(mine, copy=False), b.constant(frozen, copy=False)
    arrays = [arr for _, arr in b._constants]
    assert not np.shares_memory(arrays[0], mine) and not np.shares_memory(arrays[1], frozen)
    assert not np.shares_memory(arrays[2], mine), "a writeable array is copied even with copy=False"
    assert arrays[3] is frozen or np.shares_memory(arrays[3], frozen)


def test_a_model_file_s_weights_are_read_into_arrays_of_their_own(tmp_path):
    """From a path, the large initializers go from the file into the program's arrays without a
    parsed copy in between (the ModelProto gets placeholders); the results are those of bytes."""
    model, w = _model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    program = polyhal.onnx.load(str(path))
    (arr,) = [a for _, a in program.constants if a.nbytes == w.nbytes]
    np.testing.assert_array_equal(arr, w)
    root = arr
    while root.base is not None:
        root = root.base
    assert isinstance(root, np.ndarray) and root.nbytes == w.nbytes and not arr.flags.writeable
    x = np.ones((2, w.shape[0]), np.float32)
    from_bytes = polyhal.onnx.load(model.SerializeToString())
    np.testing.assert_array_equal(program.execute(program.compile("cpu:0"), {"x": x})["y"],
                                  from_bytes.execute(from_bytes.compile("cpu:0"), {"x": x})["y"])


def test_the_wire_reader_takes_only_large_plain_initializers(tmp_path):
    from polyhal.frontends.onnx import wire

    model, w = _model()
    small = numpy_helper.from_array(np.arange(3, dtype=np.int64), "small")
    strings = numpy_helper.from_array(np.array([b"a" * 2000], dtype=object), "strings")
    model.graph.initializer.extend([small, strings])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with open(path, "rb") as f:
        stripped, arrays = wire.read_split(f, importer.STRIP_ABOVE)
    assert set(arrays) == {"w"} and arrays["w"].dtype == np.float32
    np.testing.assert_array_equal(arrays["w"], w.ravel())
    light = onnx.ModelProto()
    light.ParseFromString(stripped)
    by_name = {t.name: t for t in light.graph.initializer}
    assert not by_name["w"].raw_data and list(by_name["w"].dims) == list(w.shape)
    assert by_name["small"] == small and by_name["strings"] == strings
    assert [n.op_type for n in light.graph.node] == [n.op_type for n in model.graph.node]


def test_a_file_the_wire_reader_does_not_follow_is_parsed_whole(tmp_path):
    """A graph field written twice (protobuf merges the two) and a truncated file: the reader
    steps aside, and protobuf's parse decides (a merged model loads; a truncated one is refused)."""
    from polyhal.frontends.onnx import wire
    from polyhal.frontends.onnx.errors import OnnxModelError

    model, w = _model()
    data = model.SerializeToString()
    extra = onnx.ModelProto(graph=onnx.GraphProto(doc_string="merged")).SerializeToString()
    (tmp_path / "twice.onnx").write_bytes(data + extra)
    with open(tmp_path / "twice.onnx", "rb") as f:
        assert wire.read_split(f, importer.STRIP_ABOVE) is None
    program = polyhal.onnx.load(str(tmp_path / "twice.onnx"))
    x = np.ones((2, w.shape[0]), np.float32)
    np.testing.assert_allclose(program.execute(program.compile("cpu:0"), {"x": x})["y"], 2 * x @ w, rtol=1e-4)
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with open(tmp_path / "cut.onnx", "rb") as f:
        assert wire.read_split(f, importer.STRIP_ABOVE) is None
    with pytest.raises(OnnxModelError, match="truncated"):
        polyhal.onnx.load(str(tmp_path / "cut.onnx"))
