"""The CPU tree-ensemble loops: the compare-all loop over complete trees and the branch-free walk
over paired trees against the walk over the compact arrays and the op's reference, on random
unbalanced trees of every branch mode, with nan and infinite inputs and thresholds, ties at
thresholds, depths 0 to 9 and batches that do and do not fill the loops' row blocks; which
ensembles each layout refuses; the layout kept for read-only constants only."""

from __future__ import annotations

import numpy as np
import pytest

from polyhal.ir.types import TensorType
from polyhal.ops import OPS, infer_types
from polyhal.ops.ml import AGGREGATES, BINARY, LEAF, MISSING_TRUE, MODE_BITS, POST_TRANSFORMS, random_ensemble

tree_loops = pytest.importorskip("polyhal_cpu.tree_loops", reason="the compiled loops need numba")
from polyhal_cpu import ml_kernels  # noqa: E402
from polyhal_cpu.kernels import prepare  # noqa: E402

#: Values that hit the thresholds exactly, sit either side of them, or are nan or infinite.
VALUES = [-np.inf, -1.5, -0.5, -0.0, 0.0, 0.5, 1.5, np.inf, np.nan]


def unbalanced_ensemble(rng, features: int, trees: int, depth: int, targets: int, dtype, modes=None):
    """Random trees of depth <= ``depth`` (leaves at every level, the root included), every mode
    in ``modes`` with and without the missing bit, thresholds from :data:`VALUES` (nan, +-inf
    and ties included); also the deepest path."""
    nodes, thresholds, leaf_values, roots = random_ensemble(rng, features, trees, depth, targets, dtype, modes=modes,
                                                            thresholds_from=VALUES, unbalanced=True)
    return nodes, thresholds, leaf_values, roots, max(_depth(nodes, r) for r in roots)


def _depth(nodes, i):
    return 0 if nodes[i, 1] == LEAF else 1 + max(_depth(nodes, nodes[i, 2]), _depth(nodes, nodes[i, 3]))


def _params(aggregate, binary, transform, base):
    return np.array([AGGREGATES.index(aggregate), BINARY.index(binary), POST_TRANSFORMS.index(transform), *base],
                    np.float64)


def _case(seed, depth, dtype, samples, modes=None):
    rng = np.random.default_rng(seed)
    binary = str(rng.choice(BINARY))
    targets = 1 if binary else int(rng.integers(1, 4))
    nodes, thresholds, leaf_values, roots, measured = unbalanced_ensemble(rng, 5, int(rng.integers(1, 7)), depth,
                                                                          targets, dtype, modes)
    if str(rng.choice(AGGREGATES)) == "sum":  # nan leaf values mean "no value" to min/max only
        aggregate = "sum"
        leaf_values = np.nan_to_num(leaf_values)
    else:
        aggregate = str(rng.choice(AGGREGATES[1:]))
    attrs = {"depth": measured, "aggregate": aggregate, "binary": binary,
             "post_transform": str(rng.choice(POST_TRANSFORMS)),
             "base": list(rng.standard_normal(targets)) if rng.random() < 0.5 else []}
    x = rng.choice(np.array(VALUES, dtype), size=(samples, 5))
    labels = rng.permutation(10)[:2 if binary else targets].astype(np.int64)
    return x, nodes, thresholds, leaf_values, roots, labels, attrs


def _run_both(x, nodes, thresholds, leaf_values, roots, labels, attrs, layouts=("complete",)):
    """(walk, then each of ``layouts``) outputs and labels: compare-all on the complete layout,
    walk_pairs on the paired one."""
    params = _params(attrs["aggregate"], attrs["binary"], attrs["post_transform"], attrs["base"])
    columns = 2 if attrs["binary"] else leaf_values.shape[1]
    results = []
    for layout in ("walk", *layouts):
        out, label_out = np.empty((len(x), columns), x.dtype), np.empty(len(x), np.int64)
        if layout == "complete":
            complete = ml_kernels.complete_trees(nodes, thresholds, leaf_values, roots, attrs["depth"])
            assert complete is not None
            tree_loops.compare_all(x, *complete, params, out, labels, label_out)
        elif layout == "paired":
            paired = ml_kernels.paired_trees(nodes, thresholds, leaf_values, roots)
            assert paired is not None
            tree_loops.walk_pairs(x, *paired, params, out, labels, label_out)
        else:
            tree_loops.tree_ensemble(x, nodes, thresholds, leaf_values, roots, params, out, labels, label_out)
        results.append((out, label_out))
    return results


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("depth", [0, 1, 2, 3, 5, 6])
@pytest.mark.parametrize("samples", [1, 7, 20, 64, 131, 150])
def test_compare_all_matches_the_walk(depth, dtype, samples):
    modes = [m for m in MODE_BITS.values() if m not in (2, 5)]  # all but EQ and NEQ
    for seed in range(6):
        x, nodes, thresholds, leaf_values, roots, labels, attrs = _case(seed, depth, dtype, samples, modes)
        (walk, walk_labels), (fast, fast_labels) = _run_both(x, nodes, thresholds, leaf_values, roots, labels,
                                                             attrs)
        np.testing.assert_array_equal(fast, walk)  # same leaves, same float64 sums in the same order
        np.testing.assert_array_equal(fast_labels, walk_labels)
        ref, ref_labels = OPS["tree_ensemble"].reference(x, nodes, thresholds, leaf_values, roots, labels, **attrs)
        np.testing.assert_allclose(fast, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("depth", [0, 1, 3, 7, 9])
@pytest.mark.parametrize("samples", [1, 15, 16, 17, 150])
def test_walk_pairs_matches_the_walk(depth, dtype, samples):
    """The paired layout's branch-free walk: the same leaves, sums and labels as the walk over
    the compact arrays, trees of unequal depths (leaves at every level) in one ensemble."""
    modes = [m for m in MODE_BITS.values() if m not in (2, 5)]  # all but EQ and NEQ
    for seed in range(6):
        x, nodes, thresholds, leaf_values, roots, labels, attrs = _case(seed, depth, dtype, samples, modes)
        (walk, walk_labels), (paired, paired_labels) = _run_both(x, nodes, thresholds, leaf_values, roots, labels,
                                                                 attrs, layouts=("paired",))
        np.testing.assert_array_equal(paired, walk)
        np.testing.assert_array_equal(paired_labels, walk_labels)
        ref, ref_labels = OPS["tree_ensemble"].reference(x, nodes, thresholds, leaf_values, roots, labels, **attrs)
        np.testing.assert_allclose(paired, ref, rtol=1e-6, atol=1e-6)


def test_paired_layout_puts_children_side_by_side():
    """Each branch's left child at the position its link names, the right one next to it,
    leaves linking to themselves, each tree's depth its own; EQ refused; subtrees shared by
    many parents copied while they fit, refused past that (the walk takes them)."""
    rng = np.random.default_rng(2)
    nodes, thresholds, leaf_values, roots, depth = unbalanced_ensemble(rng, 4, 6, 5, 1, np.float32,
                                                                       modes=[MODE_BITS["BRANCH_LEQ"]])
    links, thr, leaves, trees = ml_kernels.paired_trees(nodes, thresholds, leaf_values, roots)
    assert len(links) == len(nodes) and trees[:, 1].max() == depth
    assert [t[1] for t in trees] == [_depth(nodes, r) for r in roots]
    leaf = links[:, 1] == np.arange(len(links))
    assert leaf.sum() == (nodes[:, 1] == LEAF).sum() and np.all(thr[leaf] == np.inf) and np.all(links[leaf, 0] == 0)
    assert sorted(np.concatenate([trees[:, 0], links[~leaf, 1], links[~leaf, 1] + 1])) == list(range(len(links)))
    nodes_eq, thresholds_eq = nodes.copy(), thresholds.copy()
    nodes_eq[nodes[:, 1] != LEAF, 1] = MODE_BITS["BRANCH_EQ"]
    thresholds_eq[:] = 0.5
    assert ml_kernels.paired_trees(nodes_eq, thresholds_eq, leaf_values, roots) is None
    # a chain of 12 branches whose two children are the same node: 2**12 leaves once copied
    chain = [(0, MODE_BITS["BRANCH_LEQ"], i + 1, i + 1) for i in range(12)] + [(0, LEAF, 12, 12)]
    shared = np.array(chain, np.int64)
    args = (np.zeros(13, np.float32), np.ones((13, 1)), np.array([0], np.int64))
    assert ml_kernels.paired_trees(shared, *args) is None


def test_every_rule_routes_every_value_as_onnx_says():
    """One node per (mode, missing bit, threshold) against every value: the complete layout
    sends each value to the child the compact node does, nan thresholds and infinities included."""
    rows = []
    for mode in [m for m in MODE_BITS.values() if m not in (2, 5)] + [7, 0 | MISSING_TRUE]:
        for missing in (0, MISSING_TRUE):
            for t in VALUES + [np.float32(1e-45), -np.finfo(np.float32).max]:
                rows.append((mode | missing, t))
    nodes, thresholds, leaf_values, roots = [], [], [], []
    for mode, t in rows:
        base = len(nodes)
        nodes += [(0, mode, base + 1, base + 2), (0, LEAF, base + 1, base + 1), (0, LEAF, base + 2, base + 2)]
        thresholds += [t, 0.0, 0.0]
        leaf_values += [[0.0], [1.0], [2.0]]
        roots.append(base)
    nodes, roots = np.array(nodes, np.int64), np.array(roots, np.int64)
    leaf_values = np.array(leaf_values)
    for dtype in (np.float32, np.float64):
        th = np.array(thresholds, dtype)
        x = np.array(VALUES + [1e-45, -np.finfo(np.float32).max, 3e38], dtype).reshape(-1, 1)
        feature, threshold, leaves = ml_kernels.complete_trees(nodes, th, leaf_values, roots, 1)
        for t in range(len(roots)):
            expected = OPS["tree_ensemble"].reference(x, nodes, th, leaf_values, roots[t:t + 1], depth=1)[0][:, 0]
            f = feature[t, 0]
            v = x[:, 0]
            with np.errstate(invalid="ignore"):
                right = np.where(np.isnan(v), f < 0, v > threshold[t, 0])
            got = leaves[2 * t + right.astype(int), 0]
            np.testing.assert_array_equal(got, expected, err_msg=f"mode {rows[t][0]} threshold {rows[t][1]}")


def test_eq_neq_and_too_shallow_depth_keep_the_walk():
    rng = np.random.default_rng(1)
    nodes, thresholds, leaf_values, roots, depth = unbalanced_ensemble(rng, 4, 5, 3, 1, np.float32,
                                                                       modes=[MODE_BITS["BRANCH_EQ"]])
    assert ml_kernels.complete_trees(nodes, thresholds, leaf_values, roots, depth) is None
    nodes, thresholds, leaf_values, roots, depth = unbalanced_ensemble(rng, 4, 5, 3, 1, np.float32,
                                                                       modes=[MODE_BITS["BRANCH_LEQ"]])
    assert depth > 1 and ml_kernels.complete_trees(nodes, thresholds, leaf_values, roots, depth - 1) is None
    # a nan threshold makes EQ never true, which the layout can say
    branches = roots[nodes[roots, 1] != LEAF]
    nodes[branches, 1] = MODE_BITS["BRANCH_NEQ"]
    thresholds[branches] = np.nan
    nodes[nodes[:, 1] == MODE_BITS["BRANCH_EQ"], 1] = MODE_BITS["BRANCH_LT"]
    assert ml_kernels.complete_trees(nodes, thresholds, leaf_values, roots, depth) is not None


@pytest.mark.parametrize("modes", [None, [MODE_BITS["BRANCH_LEQ"]]], ids=["eq-walks", "leq-compares-all"])
def test_kernel_keeps_the_layout_of_read_only_constants_only(modes):
    """The prepared kernel (either loop) against the reference; a writable node array edited
    between calls is seen (relaid per call), read-only constants are relaid once."""
    rng = np.random.default_rng(5)
    nodes, thresholds, leaf_values, roots, depth = unbalanced_ensemble(rng, 5, 8, 4, 2, np.float32, modes)
    leaf_values = np.nan_to_num(leaf_values)
    x = rng.choice(np.array(VALUES, np.float32), size=(300, 5))
    ins = [x, nodes, thresholds, leaf_values, roots]
    attrs = {"depth": depth}
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    (out_type,) = infer_types("tree_ensemble", types, attrs)
    kernel = prepare("tree_ensemble", attrs, types, (out_type,))
    out = np.empty(out_type.shape, out_type.dtype)
    calls = []
    real = ml_kernels.complete_trees
    try:
        ml_kernels.complete_trees = lambda *a: calls.append(1) or real(*a)
        for edit in (False, True):
            if edit:
                leaf_values[:] = leaf_values[::-1]  # a writable array changed in place
            kernel(*ins, out)
            np.testing.assert_allclose(out, OPS["tree_ensemble"].reference(*ins, **attrs)[0], rtol=1e-6, atol=1e-6)
        assert len(calls) == 2
        for a in ins[1:]:
            a.flags.writeable = False
        for _ in range(3):
            kernel(*ins, out)
        assert len(calls) == 3
    finally:
        ml_kernels.complete_trees = real


@pytest.mark.parametrize("samples", [100, 300])  # pieces of 12-13 rows (walked) and of 37-38 (compared)
@pytest.mark.parametrize(("modes", "deepest"), [(None, 4), ([MODE_BITS["BRANCH_LEQ"], MODE_BITS["BRANCH_GT"]], 4),
                                              ([MODE_BITS["BRANCH_LEQ"], MODE_BITS["BRANCH_GT"]], 10)],
                         ids=["eq-walks", "compares-all", "walks-pairs"])
def test_split_across_threads_matches_the_reference(monkeypatch, samples, modes, deepest):
    from polyhal_cpu import parallel, threads

    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)  # split even this small batch
    monkeypatch.setenv("POLYHAL_CPU_THREADS", "2")
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    rng = np.random.default_rng(11)
    nodes, thresholds, leaf_values, roots, depth = unbalanced_ensemble(rng, 5, 6, deepest, 1, np.float32, modes)
    assert (depth > ml_kernels.COMPARE_ALL_DEPTH) == (deepest > ml_kernels.COMPARE_ALL_DEPTH)
    leaf_values = np.nan_to_num(leaf_values)
    x = rng.choice(np.array(VALUES, np.float32), size=(samples, 5))
    labels = np.array([4, 9], np.int64)
    ins = [x, nodes, thresholds, leaf_values, roots, labels]
    attrs = {"depth": depth, "binary": "probability", "post_transform": "logistic"}
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    out_types = infer_types("tree_ensemble", types, attrs)
    outs = [np.empty(t.shape, t.dtype) for t in out_types]
    prepare("tree_ensemble", attrs, types, out_types)(*ins, *outs)
    want = OPS["tree_ensemble"].reference(*ins, **attrs)
    np.testing.assert_allclose(outs[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(outs[1], want[1])
