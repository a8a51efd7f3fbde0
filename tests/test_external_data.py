"""External tensor data is read from the model's folder and from nowhere else, for every tensor
at every depth (top level, If/Loop bodies, nested bodies, Constant values, sparse tensors), with
ONNX's rules: no absolute path, no ``..``, no link leaving the folder, offset and length within
the file. The first test is the attack an audit found (issue 27): a model kept elsewhere, run
from a folder holding ``.ssh/id_test``, returned that file's bytes."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from polyhal.cli import main
from polyhal.frontends.onnx.errors import OnnxModelError
from polyhal.frontends.onnx.importer import load

F4 = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])]
K = np.arange(1, 5, dtype=np.float32)  # the external tensor's true value
SECRET = b"-----BEGIN PRIVATE KEY----- 0123456789abcdef"


def _external(name: str, array: np.ndarray, location: str, offset: int | None = None,
              length: int | None = None) -> onnx.TensorProto:
    """A tensor of ``array``'s type and shape whose data is at ``location`` (not written)."""
    t = numpy_helper.from_array(array, name)
    set_external_data(t, location, offset, len(t.raw_data) if length is None else length)
    t.ClearField("raw_data")
    return t


def _model(nodes, inputs=(), outputs=F4, initializers=(), functions=(), **kw) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", list(inputs), list(outputs), initializer=list(initializers), **kw)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], functions=list(functions))


def _if_model(then_initializer: onnx.TensorProto) -> onnx.ModelProto:
    """y = then-branch's initializer if c else zeros; c is data, so the model runs staged."""
    name = then_initializer.name
    then = helper.make_graph([helper.make_node("Identity", [name], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])], initializer=[then_initializer])
    other = helper.make_graph([helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(np.zeros(4, np.float32)))],
                              "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])])
    return _model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                  [helper.make_tensor_value_info("c", TensorProto.BOOL, [])])


def _loop_body(initializer: onnx.TensorProto) -> onnx.GraphProto:
    """A Loop body carrying v: v + initializer."""
    return helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]), helper.make_node("Add", ["v_in", initializer.name], ["v_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [4])], initializer=[initializer])


def _loop_model(body_initializer: onnx.TensorProto) -> onnx.ModelProto:
    """y = v0 + n * the body's initializer, n an input (so the Loop runs staged)."""
    return _model([helper.make_node("Loop", ["n", "", "v0"], ["y"], body=_loop_body(body_initializer))],
                  [helper.make_tensor_value_info("n", TensorProto.INT64, []),
                   helper.make_tensor_value_info("v0", TensorProto.FLOAT, [4])])


def _save(folder, model: onnx.ModelProto, files: dict[str, bytes] = {}) -> str:
    os.makedirs(folder, exist_ok=True)
    for name, data in files.items():
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    path = os.path.join(folder, "model.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def _run_if(path) -> np.ndarray:
    return load(path).run({"c": np.array(True)}, "cpu:0")["y"]


# ------------------------------------------------------------------------------- the audit's attack

@pytest.fixture
def attacker_cwd(tmp_path, monkeypatch):
    """The process runs in a folder holding ``.ssh/id_test``; the model is kept elsewhere."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_test").write_bytes(SECRET[:16])  # exactly what a float32[4] needs
    monkeypatch.chdir(home)
    return home


def test_a_subgraph_initializer_never_reads_the_working_directory(tmp_path, attacker_cwd):
    path = _save(tmp_path / "models", _if_model(_external("k", K, ".ssh/id_test")))
    with pytest.raises(OnnxModelError, match=r"initializer 'k' keeps its data in '\.ssh/id_test', which cannot be "
                                             r"opened in the model's folder"):
        _run_if(path)


def test_a_subgraph_initializer_reads_the_model_folder_even_when_the_cwd_has_the_same_name(tmp_path, attacker_cwd):
    path = _save(tmp_path / "models", _if_model(_external("k", K, ".ssh/id_test")), {".ssh/id_test": K.tobytes()})
    np.testing.assert_array_equal(_run_if(path), K)


def test_the_attack_through_the_cli_is_one_line_and_no_secret(tmp_path, attacker_cwd, capsys):
    path = _save(tmp_path / "models", _if_model(_external("k", K, ".ssh/id_test")))
    np.save(tmp_path / "c.npy", np.array(True))
    assert main(["run", path, "--input", f"c={tmp_path / 'c.npy'}", "--json"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("polyhal: error: ") and "cannot be opened in the model's folder" in err, err
    assert "Traceback" not in err and out == ""


# ------------------------------------------------------------------------------- escape routes

@pytest.mark.parametrize("location, message", [
    ("/etc/hostname", "is an absolute path"),
    ("../outside.bin", "has a '..' component"),
    ("sub/../w.bin", "has a '..' component"),  # onnx's checker lets this one through: polyhal refuses every '..'
    ("sub\\..\\w.bin", "has a '..' component"),
    ("w.bin\0.txt", "contains a NUL byte"),  # onnx's opener would read w.bin
    ("", "names no file"),
    ("nosuch.bin", "cannot be opened in the model's folder .*No such file"),
    ("sub", "is not a regular file"),
])
def test_names_that_point_outside_or_nowhere_are_refused(tmp_path, location, message):
    (tmp_path / "outside.bin").write_bytes(K.tobytes())
    path = _save(tmp_path / "m", _if_model(_external("k", K, location)), {"w.bin": K.tobytes(), "sub/x": b""})
    with pytest.raises(OnnxModelError, match=message.replace("(", r"\(")):
        load(path)


def test_a_link_out_of_the_folder_is_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(K.tobytes())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.bin").symlink_to(tmp_path / "secret.bin")
    (tmp_path / "m" / "d").symlink_to(tmp_path)  # a linked folder leading out
    for location in ("w.bin", "d/secret.bin"):
        path = _save(tmp_path / "m", _if_model(_external("k", K, location)))
        with pytest.raises(OnnxModelError, match="symbolic link that points outside the model's folder"):
            load(path)


def test_a_link_inside_the_folder_is_followed(tmp_path):
    # onnx's checker refuses every link; one that stays beside the model is harmless, and common
    # (a model folder laid out with links to a shared weights file).
    folder = tmp_path / "m"
    path = _save(folder, _if_model(_external("k", K, "w.bin")), {"data/real.bin": K.tobytes()})
    (folder / "w.bin").symlink_to("data/real.bin")
    np.testing.assert_array_equal(_run_if(path), K)
    (folder / "linked").symlink_to("data")
    path = _save(folder, _if_model(_external("k", K, "linked/real.bin")))
    np.testing.assert_array_equal(_run_if(path), K)


def test_a_loop_of_links_is_refused(tmp_path):
    folder = tmp_path / "m"
    path = _save(folder, _if_model(_external("k", K, "a.bin")))
    (folder / "a.bin").symlink_to("b.bin")
    (folder / "b.bin").symlink_to("a.bin")
    with pytest.raises(OnnxModelError, match="'a.bin', which cannot be opened in the model's folder .*symbolic links"):
        load(path)


@pytest.mark.parametrize("offset, length, message", [
    (64, None, "outside that file"),         # offset past the end
    (24, 16, "outside that file"),           # length past the end
    (0, 8, "needs 16 bytes"),               # shorter than the dims need
    (0, None, "needs 16 bytes"),            # the rest of the file is longer than the dims need
    (0, 1 << 62, "outside that file"),       # a huge length is never read
])
def test_offset_and_length_are_checked_against_the_file_and_the_dims(tmp_path, offset, length, message):
    t = _external("k", K, "w.bin", offset, length)
    if length is None:
        del t.external_data[2:]  # no length: the data runs to the end of the file
    path = _save(tmp_path / "m", _if_model(t), {"w.bin": K.tobytes() * 2})
    with pytest.raises(OnnxModelError, match=message):
        load(path)


def test_a_negative_offset_is_refused(tmp_path):
    t = _external("k", K, "w.bin")
    t.external_data[1].value = "-4"
    path = _save(tmp_path / "m", _if_model(t), {"w.bin": K.tobytes()})
    with pytest.raises(OnnxModelError, match="offset"):
        load(path)


def test_a_later_location_entry_cannot_slip_past_the_checks(tmp_path):
    # onnx takes the last 'location' entry: the one checked must be the one read
    (tmp_path / "secret.bin").write_bytes(K.tobytes())
    t = _external("k", K, "w.bin")
    extra = t.external_data.add()
    extra.key, extra.value = "location", "../secret.bin"
    path = _save(tmp_path / "m", _if_model(t), {"w.bin": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(OnnxModelError, match="'..' component"):
        load(path)


# ------------------------------------------------------------------------------- every depth

def test_top_level_initializer_with_offset(tmp_path):
    t = _external("k", K, "w.bin", offset=8)
    model = _model([helper.make_node("Add", ["x", "k"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                   initializers=[t])
    path = _save(tmp_path / "m", model, {"w.bin": b"\xff" * 8 + K.tobytes()})
    np.testing.assert_array_equal(load(path).run({"x": np.ones(4, np.float32)}, "cpu:0")["y"], K + 1)


def test_loop_body_initializer(tmp_path):
    path = _save(tmp_path / "m", _loop_model(_external("k", K, "w.bin")), {"w.bin": K.tobytes()})
    y = load(path).run({"n": np.array(3), "v0": np.ones(4, np.float32)}, "cpu:0")["y"]
    np.testing.assert_array_equal(y, 1 + 3 * K)
    path = _save(tmp_path / "out", _loop_model(_external("k", K, "../m/w.bin")))
    with pytest.raises(OnnxModelError, match="'..' component"):
        load(path)


def test_nested_subgraph_initializer(tmp_path, monkeypatch):
    # If(c) then Loop(n) whose body reads the external tensor: two levels down
    loop = helper.make_node("Loop", ["n", "", "v0"], ["t"], body=_loop_body(_external("k", K, "deep/w.bin")))
    then = helper.make_graph([loop], "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])])
    other = helper.make_graph([helper.make_node("Identity", ["v0"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])])
    model = _model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                   [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                    helper.make_tensor_value_info("n", TensorProto.INT64, []),
                    helper.make_tensor_value_info("v0", TensorProto.FLOAT, [4])])
    path = _save(tmp_path / "m", model, {"deep/w.bin": K.tobytes()})
    cwd = tmp_path / "cwd"
    (cwd / "deep").mkdir(parents=True)
    (cwd / "deep" / "w.bin").write_bytes(np.full(4, 99, np.float32).tobytes())  # must never be read
    monkeypatch.chdir(cwd)
    y = load(path).run({"c": np.array(True), "n": np.array(2), "v0": np.zeros(4, np.float32)}, "cpu:0")["y"]
    np.testing.assert_array_equal(y, 2 * K)
    os.remove(tmp_path / "m" / "deep" / "w.bin")
    with pytest.raises(OnnxModelError, match=r"If node 'y' > then_branch > Loop node 't' > body > initializer 'k'"):
        load(path)


def test_constant_values_at_the_top_and_in_a_body(tmp_path):
    top = _model([helper.make_node("Constant", [], ["y"], value=_external("v", K, "w.bin"))])
    path = _save(tmp_path / "top", top, {"w.bin": K.tobytes()})
    np.testing.assert_array_equal(load(path).run({}, "cpu:0")["y"], K)
    const = helper.make_node("Constant", [], ["t"], value=_external("v", K, "/etc/hostname"))
    then = helper.make_graph([const], "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [4])])
    other = helper.make_graph([helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(K))], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [4])])
    model = _model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                   [helper.make_tensor_value_info("c", TensorProto.BOOL, [])])
    with pytest.raises(OnnxModelError, match="Constant node 't' attribute 'value' keeps its data in '/etc/hostname', "
                                             "which is an absolute path"):
        load(_save(tmp_path / "body", model))


def test_a_constant_in_a_model_local_function(tmp_path):
    const = helper.make_node("Constant", [], ["o"], value=_external("v", K, "../w.bin"))
    function = helper.make_function("local", "F", [], ["o"], [const], [helper.make_opsetid("", 17)])
    model = _model([helper.make_node("F", [], ["y"], domain="local")], functions=[function])
    model.opset_import.append(helper.make_opsetid("local", 1))
    (tmp_path / "w.bin").write_bytes(K.tobytes())
    with pytest.raises(OnnxModelError, match=r"function 'F' > Constant node 'o' attribute 'value' keeps its data in "
                                             r"'\.\./w\.bin', which has a '\.\.' component"):
        load(_save(tmp_path / "m", model))


def test_sparse_initializer_data_is_checked_too(tmp_path):
    # polyhal does not run sparse tensors, but their files are names from the model all the same
    values = _external("s", np.ones(2, np.float32), "../secret.bin")
    indices = numpy_helper.from_array(np.array([0, 3], np.int64), "s_indices")
    sparse = helper.make_sparse_tensor(values, indices, [4])
    model = _model([helper.make_node("Identity", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                   sparse_initializer=[sparse])
    with pytest.raises(OnnxModelError, match=r"sparse initializer 's' \(values\) keeps its data in '\.\./secret\.bin'"):
        load(_save(tmp_path / "m", model))


# ------------------------------------------------------------------------------- no folder

def test_a_model_without_a_folder_is_told_to_load_from_its_path(tmp_path, attacker_cwd):
    model = _if_model(_external("k", K, ".ssh/id_test"))  # the cwd holds the file: it must not be read
    for given in (model.SerializeToString(), model):
        with pytest.raises(OnnxModelError, match=r"has no folder to find it in; load the model from its path"):
            load(given)
    assert model.graph.node[0].attribute[1].g.initializer[0].data_location == TensorProto.EXTERNAL  # unchanged


def test_the_cli_names_a_missing_file_in_one_line(tmp_path, capsys):
    path = _save(tmp_path / "m", _if_model(_external("k", K, "weights.bin")))
    assert main(["run", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'weights.bin', which cannot be opened in the model's folder" in err, err
