"""ai.onnx.ml: scikit-learn pipelines exported by skl2onnx run on polyhal and match onnxruntime
(labels exactly, scores to float32 rounding, ZipMap's list of dicts); the tree-ensemble walk
(native and numpy) against its reference; placement falls back to the CPU with a reason; tree
ensembles with inconsistent node arrays are refused naming the attribute."""

from __future__ import annotations

import warnings

import numpy as np
import re

import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import polyhal  # noqa: E402
import polyhal.onnx as ponnx  # noqa: E402
from polyhal.frontends.onnx import OnnxModelError, StrictPlacementError  # noqa: E402
from polyhal.ir.types import TensorType  # noqa: E402
from polyhal.ops import OPS, infer_types  # noqa: E402
from polyhal.ops.ml import random_ensemble  # noqa: E402

F = TensorProto.FLOAT
RNG = np.random.default_rng(7)
X = RNG.standard_normal((300, 8)).astype(np.float32)
Y_BIN = (X[:, 0] + X[:, 1] > 0).astype(np.int64)
Y_MULTI = RNG.integers(0, 3, 300)
Y_REG = X[:, 0] * 2 + X[:, 2]


def _pipelines():
    """name -> (pipeline, targets, input matrix); built lazily so that collection needs no sklearn."""
    pytest.importorskip("sklearn", reason="scikit-learn is in requirements-test.txt")
    pytest.importorskip("skl2onnx", reason="skl2onnx is in requirements-test.txt")
    from sklearn.ensemble import (
        GradientBoostingClassifier, GradientBoostingRegressor, RandomForestClassifier, RandomForestRegressor,
    )
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LinearRegression, LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import Binarizer, MinMaxScaler, Normalizer, OneHotEncoder, StandardScaler
    from sklearn.tree import DecisionTreeClassifier

    cats = RNG.integers(0, 4, (300, 3)).astype(np.int64)
    return {
        "gb_binary": (make_pipeline(StandardScaler(), GradientBoostingClassifier(n_estimators=6, max_depth=3)),
                      Y_BIN, X),
        "gb_multiclass": (make_pipeline(StandardScaler(), GradientBoostingClassifier(n_estimators=4, max_depth=3)),
                          Y_MULTI, X),
        "gb_regressor": (make_pipeline(MinMaxScaler(), GradientBoostingRegressor(n_estimators=6, max_depth=3)),
                         Y_REG, X),
        "forest_string_labels": (make_pipeline(Normalizer(), RandomForestClassifier(n_estimators=4, max_depth=4)),
                                 np.array(["cat", "dog", "eel"])[Y_MULTI], X),
        "forest_regressor": (RandomForestRegressor(n_estimators=4, max_depth=4), Y_REG, X),
        "logistic_binary": (make_pipeline(StandardScaler(), LogisticRegression()), Y_BIN, X),
        "logistic_multiclass": (make_pipeline(Normalizer("l1"), LogisticRegression()), Y_MULTI, X),
        "imputer_linear": (make_pipeline(SimpleImputer(), LinearRegression()), Y_REG, X),
        "binarizer_tree": (make_pipeline(Binarizer(threshold=0.1), DecisionTreeClassifier(max_depth=3)), Y_BIN, X),
        "one_hot_logistic": (make_pipeline(OneHotEncoder(handle_unknown="ignore"), LogisticRegression()),
                             Y_BIN, cats),
    }


def _convert(pipeline, y, x):
    from skl2onnx import to_onnx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline.fit(x, y)
        return to_onnx(pipeline, x[:1]).SerializeToString()


def _same(ours, theirs):
    if isinstance(theirs, list):  # ZipMap: a list of {label: probability}
        assert isinstance(ours, list) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert list(a) == list(b)
            np.testing.assert_allclose(list(a.values()), list(b.values()), rtol=1e-5, atol=1e-6)
    elif theirs.dtype.kind in "iuUO":
        assert ours.shape == theirs.shape and ours.tolist() == theirs.tolist()
    else:
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


NAMES = ["gb_binary", "gb_multiclass", "gb_regressor", "forest_string_labels", "forest_regressor", "logistic_binary",
         "logistic_multiclass", "imputer_linear", "binarizer_tree", "one_hot_logistic"]


@pytest.mark.parametrize("name", NAMES)
def test_sklearn_pipeline_matches_onnxruntime(name):
    pipeline, y, x = _pipelines()[name]
    model = _convert(pipeline, y, x)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    names = [o.name for o in session.get_outputs()]
    program = ponnx.load(model)
    assert isinstance(program, ponnx.DynamicOnnxProgram)  # skl2onnx exports [None, features]
    plan = program.compile("cpu:0")
    test = x[:40].copy()
    if name in ("gb_regressor", "forest_regressor", "imputer_linear"):
        test[3, 2] = np.nan  # missing values take the tree's default branch / the imputed value
    for batch in (test[:1], test):
        ours = program.execute(plan, {input_name: batch})
        for n, theirs in zip(names, session.run(None, {input_name: batch})):
            _same(ours[n], theirs)
    if name == "one_hot_logistic":  # an unknown category gives an all-zero row
        unknown = np.array([[7, 1, 2]], np.int64)
        _same(program.execute(plan, {input_name: unknown})[names[1]], session.run(None, {input_name: unknown})[1])


def test_zipmap_and_string_labels_are_host_values():
    pipeline, y, x = _pipelines()["forest_string_labels"]
    out = ponnx.load(_convert(pipeline, y, x)).run({"X": x[:3]})
    assert out["output_label"].dtype.kind == "U" and set(out["output_label"]) <= {"cat", "dog", "eel"}
    probs = out["output_probability"]
    assert isinstance(probs, list) and len(probs) == 3 and list(probs[0]) == ["cat", "dog", "eel"]
    assert all(isinstance(v, float) for v in probs[0].values())


@pytest.mark.parametrize("native", ["1", "0"], ids=["numba", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tree_walk_matches_reference(native, dtype, monkeypatch):
    from polyhal_cpu.table import compiled_loops

    monkeypatch.setenv("POLYHAL_CPU_NATIVE", native)
    if native == "1" and compiled_loops("tree_loops") is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    nodes, thresholds, leaf_values, roots = random_ensemble(rng, 6, 9, 4, 3, dtype)
    x = rng.choice(np.array([-1, -0.5, 0, 0.5, 1, np.nan], dtype), size=(33, 6))
    ins = [x, nodes, thresholds, leaf_values, roots]
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    (out_type,) = infer_types("tree_ensemble", types, {"depth": 4})
    kernel = polyhal.get_device("cpu:0").prepare("tree_ensemble", {"depth": 4}, types, (out_type,))
    out = np.empty(out_type.shape, out_type.dtype)
    kernel(*ins, out)
    np.testing.assert_allclose(out, OPS["tree_ensemble"].reference(*ins, depth=4)[0], rtol=1e-6, atol=1e-6)


def test_tree_ensemble_runs_on_opencl():
    if "opencl:0" not in {s.name for s in polyhal.devices()}:
        pytest.skip("no OpenCL device here")
    pipeline, y, x = _pipelines()["gb_regressor"]
    model = _convert(pipeline, y, x)
    program = ponnx.load(model)
    out = program.execute(program.compile("opencl:0", strict=True), {"X": x[:5]})["variable"]
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"X": x[:5]})[0]
    np.testing.assert_allclose(out, theirs, rtol=1e-5, atol=1e-5)


def test_placement_falls_back_to_the_cpu_and_says_why(template_registry):
    """The backend template (mydev:0) has no tree_ensemble kernel."""
    pipeline, y, x = _pipelines()["gb_regressor"]
    model = _convert(pipeline, y, x)
    program = ponnx.load(model)
    plan = program.compile(["mydev:0", "cpu:0"])
    out = program.execute(plan, {"X": x[:5]})["variable"]
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"X": x[:5]})[0]
    np.testing.assert_allclose(out, theirs, rtol=1e-5, atol=1e-5)
    text = plan.explain()
    assert re.search(r"tree_ensemble -> cpu:0 \(candidates \['cpu:0'\]; mydev:0 has no 'tree_ensemble' kernel",
                     text), text
    with pytest.raises(StrictPlacementError, match="tree_ensemble"):
        program.compile("mydev:0", strict=True)(x[:5])


# --------------------------------------------------------------------------------- bad input

def _tree_model(**changes) -> onnx.ModelProto:
    """A two-tree regressor over 2 features (tree 0: a branch and two leaves; tree 1: a leaf)."""
    attrs = dict(nodes_treeids=[0, 0, 0, 1], nodes_nodeids=[0, 1, 2, 0], nodes_featureids=[1, 0, 0, 0],
                 nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF", "LEAF"], nodes_values=[0.5, 0, 0, 0],
                 nodes_truenodeids=[1, 0, 0, 0], nodes_falsenodeids=[2, 0, 0, 0],
                 target_treeids=[0, 0, 1], target_nodeids=[1, 2, 0], target_ids=[0, 0, 0],
                 target_weights=[1.0, 2.0, 10.0], n_targets=1)
    attrs.update(changes)
    node = helper.make_node("TreeEnsembleRegressor", ["x"], ["y"], domain="ai.onnx.ml", **attrs)
    graph = helper.make_graph([node], "trees", [helper.make_tensor_value_info("x", F, [None, 2])],
                              [helper.make_tensor_value_info("y", F, [None, 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])


def test_hand_built_tree_ensemble():
    x = np.array([[0, 0.25], [0, 0.75], [0, np.nan]], np.float32)
    out = ponnx.load(_tree_model()).run({"x": x})["y"]
    assert out.ravel().tolist() == [11.0, 12.0, 12.0]  # nan goes to the false branch by default
    out = ponnx.load(_tree_model(nodes_missing_value_tracks_true=[1, 0, 0, 0])).run({"x": x})["y"]
    assert out.ravel().tolist() == [11.0, 12.0, 11.0]


@pytest.mark.parametrize("changes, message", [
    ({"nodes_falsenodeids": [2, 0, 0]}, "attribute 'nodes_falsenodeids' has 3 entries but 'nodes_treeids' has 4"),
    ({"nodes_truenodeids": [5, 0, 0, 0]}, "attribute 'nodes_truenodeids' entry 0 .* points at node 5, which tree 0"),
    ({"nodes_featureids": [2, 0, 0, 0]}, "attribute 'nodes_featureids' entry 0 is 2, but the input has 2 features"),
    ({"nodes_modes": ["BRANCH_LEQ", "LEAF", "BRANCH_GT", "LEAF"], "nodes_truenodeids": [1, 0, 0, 0],
      "nodes_falsenodeids": [2, 0, 2, 0]}, "form a cycle in tree 0"),
    ({"nodes_modes": ["BRANCH_MAYBE", "LEAF", "LEAF", "LEAF"]}, "attribute 'nodes_modes' entry 0 is 'BRANCH_MAYBE'"),
    ({"nodes_nodeids": [0, 1, 1, 0]}, "list tree 0 node 1 twice"),
    ({"target_weights": [1.0, 2.0]}, "attribute 'target_weights' has 2 entries but 'target_treeids' has 3"),
    ({"target_nodeids": [1, 7, 0]}, "attribute 'target_nodeids' entry 1 names tree 0 node 7"),
    ({"target_ids": [0, 3, 0]}, "attribute 'target_ids' entry 1 is 3; the model has 1 targets"),
])
def test_inconsistent_tree_arrays_are_refused_naming_the_attribute(changes, message):
    with pytest.raises(OnnxModelError, match=message):
        ponnx.load(_tree_model(**changes)).run({"x": np.zeros((1, 2), np.float32)})


# ------------------------------------------------------------------ TreeEnsemble (ai.onnx.ml opset 5)

def _tree_ensemble_v5(rng, dtype, trees, features, n_targets, edit=None, **extra) -> onnx.ModelProto:
    """A random opset-5 TreeEnsemble: complete trees of depth 3 whose branches use every mode
    (BRANCH_MEMBER with sets of 1 to 3 members), each leaf one target; ``edit(attrs)`` may
    change the attributes before the node is made."""
    modes, splits, feats, tn, fn, tl, fl, leaf_t, leaf_w, roots, sets = ([] for _ in range(11))

    def grow(level):
        if level == 3:
            leaf_t.append(int(rng.integers(n_targets)))
            leaf_w.append(float(rng.standard_normal()))
            return len(leaf_t) - 1, 1
        row = len(modes)
        mode = int(rng.integers(7))
        modes.append(mode)
        splits.append(float(rng.choice([-0.5, 0.5, 1.5])))
        feats.append(int(rng.integers(features)))
        if mode == 6:
            sets.extend(rng.choice([-0.5, 0.5, 1.5, 2.5], size=int(rng.integers(1, 4)), replace=False).tolist())
            sets.append(np.nan)
        for ids, leafs in ((tn, tl), (fn, fl)):
            ids.append(None)
            leafs.append(None)
        (tn[row], tl[row]), (fn[row], fl[row]) = grow(level + 1), grow(level + 1)
        return row, 0

    for _ in range(trees):
        roots.append(grow(0)[0])
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    attrs = dict(nodes_modes=numpy_helper.from_array(np.array(modes, np.uint8)), nodes_featureids=feats,
                 nodes_splits=numpy_helper.from_array(np.array(splits, np_type)), nodes_truenodeids=tn,
                 nodes_falsenodeids=fn, nodes_trueleafs=tl, nodes_falseleafs=fl, leaf_targetids=leaf_t,
                 leaf_weights=numpy_helper.from_array(np.array(leaf_w, np_type)), tree_roots=roots,
                 n_targets=n_targets, nodes_missing_value_tracks_true=rng.integers(0, 2, len(modes)).tolist())
    if sets:
        attrs["membership_values"] = numpy_helper.from_array(np.array(sets, np_type))
    attrs.update(extra)
    if edit is not None:
        edit(attrs)
    node = helper.make_node("TreeEnsemble", ["x"], ["y"], domain="ai.onnx.ml", **attrs)
    graph = helper.make_graph([node], "trees", [helper.make_tensor_value_info("x", dtype, [None, features])],
                              [helper.make_tensor_value_info("y", dtype, [None, n_targets])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("ai.onnx.ml", 5)])


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE], ids=TensorProto.DataType.Name)
@pytest.mark.parametrize("aggregate", [0, 1, 2, 3], ids=["average", "sum", "min", "max"])
def test_tree_ensemble_v5_matches_onnx_reference(dtype, aggregate):
    from onnx.reference import ReferenceEvaluator
    rng = np.random.default_rng(dtype * 10 + aggregate)
    model = _tree_ensemble_v5(rng, dtype, trees=5, features=4, n_targets=3, aggregate_function=aggregate)
    x = rng.choice([-0.5, 0.5, 1.5, 2.5, 0.7, np.nan], size=(40, 4)).astype(helper.tensor_dtype_to_np_dtype(dtype))
    got = ponnx.load(model).run({"x": x})["y"]
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    assert got.dtype == want.dtype
    if aggregate >= 2:
        # A target no tree gives a weight: 0, as onnxruntime's aggregators leave it (onnx's
        # reference leaves the float type's max/min).
        untouched = np.abs(want) == np.finfo(want.dtype).max
        assert untouched.any() and not untouched.all()
        want = np.where(untouched, 0, want)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("transform", [1, 2, 3], ids=["softmax", "logistic", "softmax_zero"])
def test_tree_ensemble_v5_post_transforms(transform):
    # onnx's reference evaluator leaves post_transform out: the transform is applied to its scores here.
    from onnx.reference import ReferenceEvaluator

    def no_target_1(attrs):  # a column of zeros, which softmax_zero leaves out
        attrs["leaf_targetids"] = [t if t != 1 else 2 for t in attrs["leaf_targetids"]]

    model = _tree_ensemble_v5(np.random.default_rng(transform), TensorProto.FLOAT, trees=6, features=4,
                              n_targets=3, edit=no_target_1, post_transform=transform)
    x = np.random.default_rng(9).choice([-0.5, 0.5, 1.5, 0.7, np.nan], size=(40, 4)).astype(np.float32)
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    next(a for a in plain.graph.node[0].attribute if a.name == "post_transform").i = 0
    (s,) = ReferenceEvaluator(plain).run(None, {"x": x})
    s = s.astype(np.float64)
    if transform == 2:
        want = 1 / (1 + np.exp(-s))
    else:
        keep = s != 0 if transform == 3 else np.ones(s.shape, bool)
        e = np.where(keep, np.exp(s - s.max(axis=1, keepdims=True)), 0)
        want = e / e.sum(axis=1, keepdims=True)
    assert transform != 3 or (want[:, 1] == 0).all()
    np.testing.assert_allclose(ponnx.load(model).run({"x": x})["y"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("edit, message", [
    (lambda a: a.update(nodes_falseleafs=a["nodes_falseleafs"][:2]),
     "attribute 'nodes_falseleafs' has 2 entries but 'nodes_modes' has"),
    (lambda a: a["leaf_targetids"].__setitem__(0, 9), "attribute 'leaf_targetids' entry 0 is 9; the model has 3 targets"),
    (lambda a: a["nodes_truenodeids"].__setitem__(0, 99), "attribute 'nodes_truenodeids' entry 0 is 99, but the model"),
    (lambda a: a.update(tree_roots=[999]), "attribute 'tree_roots' entry 0 is not a branch node"),
    (lambda a: a.update(membership_values=numpy_helper.from_array(np.array([1.0], np.float32))),
     "'membership_values' holds 0 nan-terminated sets, but the model has"),
    (lambda a: a.update(aggregate_function=7), "attribute 'aggregate_function' is 7"),
    (lambda a: a.update(post_transform=4), "PROBIT"),
])
def test_inconsistent_tree_ensemble_v5_is_refused_naming_the_attribute(edit, message):
    from polyhal.frontends.onnx import OnnxUnsupportedError
    model = _tree_ensemble_v5(np.random.default_rng(3), TensorProto.FLOAT, trees=2, features=4, n_targets=3,
                              edit=edit)
    with pytest.raises((OnnxModelError, OnnxUnsupportedError), match=message):
        ponnx.load(model).run({"x": np.zeros((1, 4), np.float32)})


def test_sklearn_example_runs():
    import subprocess
    import sys
    from pathlib import Path

    _pipelines()  # skips without scikit-learn / skl2onnx
    example = Path(__file__).resolve().parent.parent / "examples" / "sklearn_pipeline.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("labels match onnxruntime, probabilities match") == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scaling_folds_into_thresholds_exactly(dtype):
    # Every mode and missing bit, scales of both signs, inputs on and around each node's moved
    # threshold: the raw input through the folded trees reaches the leaves the scaled input
    # reaches through the given ones.
    from polyhal.frontends.onnx.converters.ml import fold_scaling
    from polyhal.ops.ml import tree_walk_reference
    rng = np.random.default_rng(5)
    features = 6
    nodes, thresholds, _, roots = random_ensemble(rng, features, 30, 4, 1, dtype)
    offset = rng.standard_normal(features).astype(dtype)
    scale = (rng.uniform(0.1, 3, features) * rng.choice([-1, 1], features)).astype(dtype)
    # The identity scaling folds every mode (EQ and NEQ included: one float maps onto each threshold).
    for offset, scale in ((np.zeros(1, dtype), np.ones(1, dtype)), (offset, scale)):
        folded = fold_scaling(nodes, thresholds, offset, scale)
        if folded is None:  # an EQ/NEQ node that a range of floats maps onto: refused; those as LEQ/GT
            assert scale.size > 1
            mode = nodes[:, 1] & 7
            nodes = nodes.copy()
            nodes[:, 1] = np.where(mode == 2, 3, np.where(mode == 5, 4, mode)) | (nodes[:, 1] & 8)
            folded = fold_scaling(nodes, thresholds, offset, scale)
        new_nodes, new_thresholds = folded
        moved = new_thresholds[new_nodes[:, 1] != 0]
        near = np.concatenate([moved, np.nextafter(moved, dtype(np.inf)), np.nextafter(moved, dtype(-np.inf))])
        x = rng.choice(np.concatenate([near, [np.nan, np.inf, -np.inf, 0.0, -0.0]]).astype(dtype), (400, features))
        scaled = ((x - offset).astype(dtype) * scale).astype(dtype)
        np.testing.assert_array_equal(tree_walk_reference(x, new_nodes, new_thresholds, roots, 4),
                                      tree_walk_reference(scaled, nodes, thresholds, roots, 4))
    assert fold_scaling(nodes, thresholds, offset, np.zeros(features, dtype)) is None


def test_scaler_feeding_trees_and_another_output_is_kept():
    # The tree ensemble reads the raw input; the Scaler's ops stay for the graph output that reads them.
    pipeline, y, x = _pipelines()["gb_binary"]
    model = onnx.load_from_string(_convert(pipeline, y, x))
    scaled = model.graph.node[0].output[0]
    model.graph.output.append(helper.make_tensor_value_info(scaled, TensorProto.FLOAT, [None, x.shape[1]]))
    program = ponnx.load(model)
    out = program.run({"X": x[:5]})
    np.testing.assert_allclose(out[scaled], pipeline[0].transform(x[:5]), rtol=1e-5, atol=1e-6)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert out["output_label"].tolist() == session.run(None, {"X": x[:5]})[0].tolist()
