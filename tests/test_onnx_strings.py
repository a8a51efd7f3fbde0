"""ONNX string ops on the host around the device plan, and TfIdfVectorizer, against onnx.reference."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from polyhal.cli import main as cli_main  # noqa: E402
from polyhal.frontends.onnx.errors import OnnxInputError, OnnxUnsupportedError  # noqa: E402

ML = "ai.onnx.ml"


def _model(nodes, inputs, outputs, opset=20):
    def info(name, elem, shape):  # shape None: of a rank and size only the data decides
        return helper.make_tensor_value_info(name, elem, shape if shape is not None else ["?"])

    graph = helper.make_graph(nodes, "g", [info(*i) for i in inputs], [info(*o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(ML, 4)])


def _check(model, feeds):
    got = ponnx.load(model).run(feeds, "cpu:0")
    ref_feeds = {k: v.astype(object) if v.dtype.kind == "U" else v for k, v in feeds.items()}
    want = ReferenceEvaluator(model).run(None, ref_feeds)
    for (name, g), w in zip(got.items(), want):
        assert g.shape == np.asarray(w).shape, name
        if np.asarray(w).dtype.kind in "OU":
            assert g.dtype == object and g.tolist() == np.asarray(w).astype(object).tolist(), name
        else:
            np.testing.assert_allclose(g, w, err_msg=name)
    return got


WORDS = np.array([["Monday", "tuesday", "the"], ["a b  c", "", "x,y,,z"]])


@pytest.mark.parametrize("node, out", [
    (helper.make_node("StringConcat", ["s", "s"], ["y"]), (T.STRING, [2, 3])),
    (helper.make_node("RegexFullMatch", ["s"], ["y"], pattern=r"[a-z]+day"), (T.BOOL, [2, 3])),
    (helper.make_node("Equal", ["s", "s"], ["y"]), (T.BOOL, [2, 3])),
    (helper.make_node("Identity", ["s"], ["y"]), (T.STRING, [2, 3])),
    (helper.make_node("LabelEncoder", ["s"], ["y"], domain=ML, keys_strings=["the", ""], values_int64s=[7, 8]),
     (T.INT64, [2, 3])),
])
def test_elementwise_string_ops_match_the_reference(node, out):
    _check(_model([node], [("s", T.STRING, [2, 3])], [("y", out[0], out[1])]), {"s": WORDS})


@pytest.mark.parametrize("attrs", [{}, {"delimiter": ","}, {"delimiter": ",", "maxsplit": 1}, {"delimiter": " "}])
def test_string_split_pads_to_the_longest_split(attrs):
    node = helper.make_node("StringSplit", ["s"], ["y", "n"], **attrs)
    _check(_model([node], [("s", T.STRING, [2, 3])], [("y", T.STRING, [2, 3, "k"]), ("n", T.INT64, [2, 3])]), {"s": WORDS})


@pytest.mark.parametrize("attrs", [
    {"case_change_action": "UPPER"},
    {"case_change_action": "LOWER", "stopwords": ["monday"], "is_case_sensitive": 0},
    {"case_change_action": "NONE", "stopwords": ["Monday", "the"], "is_case_sensitive": 1},
])
def test_string_normalizer_changes_case_and_drops_stopwords(attrs):
    node = helper.make_node("StringNormalizer", ["s"], ["y"], **attrs)
    _check(_model([node], [("s", T.STRING, [1, 3])], [("y", T.STRING, [1, "k"])]), {"s": WORDS[:1]})


def test_every_word_a_stopword_leaves_one_empty_string():
    # Stopwords match regardless of case by default (is_case_sensitive=0), as the ONNX spec says;
    # onnx.reference compares case-insensitively only after a case change, so it is not the oracle here.
    node = helper.make_node("StringNormalizer", ["s"], ["y"], stopwords=["a", "b"])
    model = _model([node], [("s", T.STRING, [2])], [("y", T.STRING, ["k"])])
    assert ponnx.load(model).run({"s": np.array(["a", "B"])})["y"].tolist() == [""]


def test_strings_feed_the_plan_and_the_plan_feeds_strings():
    """Strings -> numbers (host, before the plan) -> Add (device) -> strings (host, after it)."""
    model = _model([
        helper.make_node("StringNormalizer", ["s"], ["n"], case_change_action="LOWER"),
        helper.make_node("LabelEncoder", ["n"], ["ids"], domain=ML, keys_strings=["a", "b"], values_int64s=[1, 2]),
        helper.make_node("Add", ["ids", "k"], ["y"]),
        helper.make_node("Cast", ["y"], ["ys"], to=T.STRING),
        helper.make_node("StringConcat", ["ys", "n"], ["z"]),
        helper.make_node("LabelEncoder", ["y"], ["w"], domain=ML, keys_int64s=[11], values_strings=["eleven"]),
    ], [("s", T.STRING, [3]), ("k", T.INT64, [3])], [("y", T.INT64, [3]), ("z", T.STRING, [3]), ("w", T.STRING, [3])])
    got = _check(model, {"s": np.array(["A", "b", "C"]), "k": np.array([10, 20, 30])})
    assert got["z"].tolist() == ["11a", "22b", "29c"] and got["w"].tolist() == ["eleven", "_Unused", "_Unused"]
    program = ponnx.load(model)
    assert [op.name for op in program.ops] == ["add"]  # only numbers run on the device
    assert "before the plan" in program.explain() and "after the plan" in program.explain()


def test_cast_between_strings_and_numbers():
    model = _model([helper.make_node("Cast", ["s"], ["f"], to=T.FLOAT),
                    helper.make_node("Cast", ["f"], ["back"], to=T.STRING)],
                   [("s", T.STRING, [4])], [("f", T.FLOAT, [4]), ("back", T.STRING, [4])])
    got = _check(model, {"s": np.array(["1.5", "-2", "inf", "1e3"])})
    assert got["f"].dtype == np.float32


def test_string_constants_fold_at_import():
    const = helper.make_tensor("c", T.STRING, [2], [b"x", b"y"])
    model = _model([helper.make_node("Constant", [], ["c"], value=const),
                    helper.make_node("StringConcat", ["c", "s"], ["y"])],
                   [("s", T.STRING, [2])], [("y", T.STRING, [2])])
    assert _check(model, {"s": np.array(["1", "2"])})["y"].tolist() == ["x1", "y2"]


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("strings", [False, True])
def test_tfidf_vectorizer_matches_the_reference(mode, strings):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, size=(4, 12))
    pool = [2, 3, 5, 0, 1, 3, 4, 2, 2, 0, 4, 1, 2, 3]  # 3 unigrams, 4 bigrams (one repeated), 1 trigram
    attrs = dict(ngram_counts=[0, 3, 11], ngram_indexes=[6, 0, 1, 2, 3, 4, 5, 7], min_gram_length=1,
                 max_gram_length=3, max_skip_count=2, mode=mode, weights=[0.5, 1, 2, 3, 4, 5, 6, 7])
    if strings:
        words = np.array([f"w{t}" for t in range(6)])
        node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], pool_strings=[f"w{t}" for t in pool], **attrs)
        model, feeds = _model([node], [("x", T.STRING, [4, 12])], [("y", T.FLOAT, [4, 8])]), {"x": words[tokens]}
    else:
        node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], pool_int64s=pool, **attrs)
        model, feeds = _model([node], [("x", T.INT32, [4, 12])], [("y", T.FLOAT, [4, 8])]), {"x": tokens.astype(np.int32)}
    _check(model, feeds)


# ------------------------------------------------------------------------------- bad input

def test_a_device_op_on_strings_is_refused_clearly():
    model = _model([helper.make_node("Tile", ["s", "r"], ["y"])], [("s", T.STRING, [2, 3]), ("r", T.INT64, [2])],
                   [("y", T.STRING, [4, 3])])
    with pytest.raises(OnnxUnsupportedError, match="holds strings.*device buffers hold numbers.*Tile has no string form"):
        ponnx.load(model, values={"r": np.array([2, 1])})


@pytest.mark.parametrize("node, out", [
    (helper.make_node("Transpose", ["s"], ["y"]), [3, 2]),
    (helper.make_node("Reshape", ["s", "shape"], ["y"]), [3, 2]),
    (helper.make_node("Flatten", ["s"], ["y"], axis=0), [1, 6]),
    (helper.make_node("Flatten", ["s"], ["y"], axis=-1), [2, 3]),
    (helper.make_node("Squeeze", ["s1", "axes"], ["y"]), [2, 3]),
    (helper.make_node("Unsqueeze", ["s", "axes"], ["y"]), [2, 1, 3]),
    (helper.make_node("Gather", ["s", "idx"], ["y"], axis=1), [2, 2]),
    (helper.make_node("Concat", ["s", "s"], ["y"], axis=0), [4, 3]),
])
def test_data_movement_ops_move_strings_on_the_host(node, out):
    inits = [helper.make_tensor("shape", T.INT64, [2], [3, -1]), helper.make_tensor("axes", T.INT64, [1], [1]),
             helper.make_tensor("idx", T.INT64, [2], [2, -3])]
    name = node.input[0]
    model = _model([node], [(name, T.STRING, [2, 1, 3] if name == "s1" else [2, 3])], [("y", T.STRING, out)])
    model.graph.initializer.extend(i for i in inits if i.name in node.input)
    _check(model, {name: WORDS.reshape(2, 1, 3) if name == "s1" else WORDS})


def test_strings_made_from_plan_results_cannot_feed_the_device_again():
    model = _model([helper.make_node("Neg", ["x"], ["n"]),
                    helper.make_node("Cast", ["n"], ["s"], to=T.STRING),
                    helper.make_node("Equal", ["s", "s"], ["e"]),
                    helper.make_node("Not", ["e"], ["y"])],
                   [("x", T.FLOAT, [3])], [("y", T.BOOL, [3])])
    with pytest.raises(OnnxUnsupportedError, match="before and after the plan"):
        ponnx.load(model)


def test_numbers_given_for_a_string_input_are_refused():
    model = _model([helper.make_node("Identity", ["s"], ["y"])], [("s", T.STRING, [2])], [("y", T.STRING, [2])])
    with pytest.raises(OnnxInputError, match="holds strings, got an array of int64"):
        ponnx.load(model).run({"s": np.array([1, 2])})


def test_cli_run_needs_a_file_for_string_inputs(tmp_path, capsys):
    model = _model([helper.make_node("StringConcat", ["s", "s"], ["y"])], [("s", T.STRING, [2])],
                   [("y", T.STRING, [2])])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert cli_main(["run", str(path), "--device", "cpu:0"]) != 0
    assert "cannot draw at random" in capsys.readouterr().err
    np.save(tmp_path / "s.npy", np.array(["ab", "c"]))
    assert cli_main(["run", str(path), "--input", f"s={tmp_path / 's.npy'}", "--output", str(tmp_path / "out")]) == 0
    assert np.load(tmp_path / "out" / "y.npy").tolist() == ["abab", "cc"]
