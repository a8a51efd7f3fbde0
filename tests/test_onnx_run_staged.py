"""``polyhal run`` of models that run staged (an If decided by data, a sequence output): random
inputs, the outputs printed, saved and reported in JSON, and a clear error for options that
need one plan (--profile) or inputs it cannot draw (a sequence)."""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T, helper  # noqa: E402

from polyhal.cli import main as cli_main  # noqa: E402


def _sequence(name):
    return helper.make_value_info(name, helper.make_sequence_type_proto(helper.make_tensor_type_proto(T.FLOAT, None)))


def _if_model(path):
    x = helper.make_tensor_value_info("x", T.FLOAT, ["n"])
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", T.FLOAT, ["n"])])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", T.FLOAT, ["n"])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Constant", [], ["z"], value=helper.make_tensor("z", T.FLOAT, [], [0.0])),
             helper.make_node("Greater", ["s", "z"], ["c"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
             helper.make_node("SplitToSequence", ["y"], ["seq"], keepdims=0)]
    graph = helper.make_graph(nodes, "staged", [x], [helper.make_tensor_value_info("y", T.FLOAT, ["n"]),
                                                     _sequence("seq")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_run_drives_a_staged_model(tmp_path, capsys):
    path = tmp_path / "if.onnx"
    _if_model(path)
    x = np.array([1.0, -2.0, 0.5], np.float32)  # sum < 0: the else branch, |x|
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert cli_main(["run", str(path), "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out), "--explain",
                     "--repeat", "2"]) == 0
    text = capsys.readouterr().out
    assert "staged" in text and "output seq: sequence of 3 tensors" in text and "host ops If" in text
    np.testing.assert_array_equal(np.load(out / "y.npy"), np.abs(x))
    assert np.load(out / "seq.2.npy") == np.float32(0.5)
    assert cli_main(["run", str(path), "--dim", "n=5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["staged"] and report["inputs"][0]["shape"] == [5] and report["inputs"][0]["source"] == "random"
    assert [o["name"] for o in report["outputs"]][:2] == ["y", "seq.0"]


def test_run_refuses_what_a_staged_model_cannot_do(tmp_path, capsys):
    path = tmp_path / "if.onnx"
    _if_model(path)
    assert cli_main(["run", str(path), "--profile"]) != 0
    assert "--profile and --trace time the steps of one plan" in capsys.readouterr().err
    seq_in = helper.make_graph([helper.make_node("SequenceLength", ["s"], ["n"])], "g",
                               [_sequence("s")],
                               [helper.make_tensor_value_info("n", T.INT64, [])])
    onnx.save(helper.make_model(seq_in, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "seq.onnx")
    assert cli_main(["run", str(tmp_path / "seq.onnx")]) != 0
    assert "cannot draw at random" in capsys.readouterr().err


def test_run_passes_its_compile_options_to_a_staged_model(tmp_path, capsys):
    """--precision reaches a staged model's plans as it does a static model's (bf16 is refused,
    saying why, on both)."""
    path = tmp_path / "if.onnx"
    _if_model(path)
    assert cli_main(["run", str(path), "--dim", "n=4", "--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "bf16" in err and len(err.strip().splitlines()) == 1
