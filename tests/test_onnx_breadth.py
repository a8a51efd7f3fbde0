"""Models users bring that once were refused, against onnxruntime: onnxmltools' LightGBM (whose
declared label shape contradicts the data), Resize with tf_half_pixel_for_nn, graph outputs
without a shape, and scikit-learn pipelines over strings (OneHotEncoder in a ColumnTransformer,
TfidfVectorizer's Reshape and com.microsoft Tokenizer); a string tensor reaching a device op."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from bench import onnx_breadth as fam  # noqa: E402
from polyhal.frontends.onnx.errors import DeclaredShapeWarning, OnnxModelError, OnnxUnsupportedError  # noqa: E402


def _ort(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return session.run(None, feeds)


def _feeds_for_ort(feeds):
    return {k: v.astype(object) if v.dtype.kind in "OU" else v for k, v in feeds.items()}


def _matches(model, feeds, oracle=None, **load):
    want = _ort(oracle or model, _feeds_for_ort(feeds))
    got = ponnx.load(model, **load).run(feeds, "cpu:0")
    for (name, g), w in zip(got.items(), want):
        assert g.shape == w.shape, name
        if w.dtype.kind in "iub":
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
    return got


# --------------------------------------------------------------------------- declared shapes

def test_lightgbm_label_declared_int64_1_runs_at_any_batch_with_one_warning():
    pytest.importorskip("lightgbm")
    pytest.importorskip("onnxmltools")
    model, x = fam.lightgbm_classifier()
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [1]
    for batch in (1, 100):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _matches(model, {"input": x[:batch]}, shapes={"input": (batch, 8)})
        declared = [w for w in caught if issubclass(w.category, DeclaredShapeWarning)]
        assert len(declared) == (batch > 1), [str(w.message) for w in caught]
    # The symbolic-batch load specializes per shape: still one warning for the model.
    program = ponnx.load(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (5, 7, 9):
            assert program.run({"input": x[:batch]}, "cpu:0")["label"].shape == (batch,)
    assert len([w for w in caught if issubclass(w.category, DeclaredShapeWarning)]) <= 1
    with pytest.raises(OnnxModelError, match=r"output 'label' is declared int64\[1\] but the data gives shape \[100\]"):
        ponnx.load(model, shapes={"input": (100, 8)}, strict_shapes=True)


def test_graph_outputs_without_a_shape_field_run():
    y = helper.make_tensor_value_info("y", T.FLOAT, None)
    assert not y.type.tensor_type.HasField("shape")
    model = fam._model([helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Transpose", ["h"], ["y"])],
                       [helper.make_tensor_value_info("x", T.FLOAT, [2, 3])], [y])
    with pytest.raises(onnx.checker.ValidationError, match="shape"):
        onnx.checker.check_model(model)  # onnx refuses it; onnxruntime and polyhal run it
    _matches(model, {"x": np.arange(-3, 3, dtype=np.float32).reshape(2, 3)})


@pytest.mark.parametrize("mode, nearest_mode", [("nearest", "floor"), ("nearest", "round_prefer_ceil"),
                                                ("linear", "floor")])
def test_resize_tf_half_pixel_for_nn(mode, nearest_mode):
    model = fam.resize_tf_half_pixel_for_nn(mode, nearest_mode)
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 10)).astype(np.float32)
    _matches(model, {"x": x})


# -------------------------------------------------------------------------------------- strings

def test_onehot_encoder_over_string_columns_in_a_column_transformer():
    pytest.importorskip("skl2onnx")
    model, x = fam.column_transformer()
    feeds = {"input": x[:50].astype(str)}
    feeds["input"][3, 0] = "purple"  # a category the encoder never saw: ignored
    got = _matches(model, feeds)
    assert set(np.unique(got["label"])) <= {0, 1}
    program = ponnx.load(model)  # symbolic batch: one plan per shape
    for batch in (1, 7):
        _matches(model, {"input": x[:batch].astype(str)})
        assert program.run({"input": x[:batch].astype(str)}, "cpu:0")["probabilities"].shape == (batch, 2)


def test_tfidf_vectorizer_pipeline_with_the_microsoft_tokenizer():
    pytest.importorskip("skl2onnx")
    model, texts = fam.tfidf_pipeline()
    assert any(n.op_type == "Tokenizer" and n.domain == "com.microsoft" for n in model.graph.node)
    feeds = {"text": np.concatenate([texts[:20], [["zebra"], [""], ["the cat the cat"]]]).astype(str)}
    _matches(model, feeds, oracle=fam._with_locale(model))


@pytest.mark.parametrize("attrs, text", [
    ({"mark": 1, "pad_value": "#", "mincharnum": 2, "tokenexp": "[a-z]+"}, ["ab c def", "x", "gh ij"]),
    ({"mark": 0, "pad_value": "_", "mincharnum": 1, "separators": [" ", ","]}, ["a b,c", "de, f", "g"]),
    ({"mark": 0, "pad_value": "_", "mincharnum": 1, "separators": [""]}, ["abc", "d"]),
    ({"mark": 1, "pad_value": "#", "mincharnum": 1, "separators": [" "]}, ["a bb c", "x", "d e"]),
])
def test_tokenizer_matches_onnxruntime(attrs, text):
    node = helper.make_node("Tokenizer", ["s"], ["y"], domain="com.microsoft", **attrs)
    model = fam._model([node], [helper.make_tensor_value_info("s", T.STRING, [len(text)])],
                       [helper.make_tensor_value_info("y", T.STRING, None)], domains=[("com.microsoft", 1)])
    want = _ort(model, {"s": np.array(text, dtype=object)})[0]
    got = ponnx.load(model).run({"s": np.array(text)}, "cpu:0")["y"]
    assert got.shape == want.shape and got.tolist() == want.tolist()


def test_a_string_tensor_reaching_a_device_op_names_the_node():
    model = fam._model([helper.make_node("Relu", ["s"], ["y"], name="act")],
                       [helper.make_tensor_value_info("s", T.STRING, [2])],
                       [helper.make_tensor_value_info("y", T.FLOAT, [2])])
    with pytest.raises(OnnxUnsupportedError, match=r"node act \(Relu\).*holds strings.*device"):
        ponnx.load(model, validate=False)
