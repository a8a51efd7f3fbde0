"""Converters of the ``ai.onnx.ml`` domain: what scikit-learn pipelines export (skl2onnx).

Most of these ops are a few core ops each (Scaler is a subtract and a multiply, LinearClassifier
a gemm, a post transform and an argmax), so they run on every device. Tree ensembles become one
``tree_ensemble`` op over compact node arrays (:mod:`polyhal.ops.ml`), built and checked here:
a model whose node arrays are inconsistent (lengths that differ, a child that is not a node of
its tree, a cycle, a feature out of range) is refused naming the attribute.

**Values polyhal cannot hold.** String class labels and ZipMap's sequence of maps are made on
the host after the run (:class:`~polyhal.frontends.onnx.types.HostOutput`): the plan computes
the label indices (or the probability matrix) and :meth:`OnnxProgram.execute` returns a numpy
array of ``str`` (or a list of ``{label: float}`` dicts, one per sample, as onnxruntime returns).
Such values can only be model outputs. String *inputs* (LabelEncoder, OneHotEncoder over string
categories) are computed on the host around the plan (:mod:`~polyhal.frontends.onnx.converters.strings`).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.types import HostOutput
from polyhal.ir.program import Value
from polyhal.ops.ml import LEAF, MISSING_TRUE, MODE_BITS

ML = "ai.onnx.ml"
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def _float_input(ctx: NodeContext, i: int = 0) -> Any:
    """Input ``i`` as float32 (float64 stays float64), as the ai.onnx.ml ops read numbers."""
    x = ctx.input(i)
    return x if ctx.dtype(x) in (_F32, _F64) else ctx.op("cast", x, dtype=_F32)


def _as_matrix(ctx: NodeContext, x: Any) -> Any:
    """A 1-D input as one row (the ops take ``[N, C]``, or ``[C]`` for one sample)."""
    return ctx.op("reshape", x, shape=[1, ctx.shape(x)[0]]) if ctx.rank(x) == 1 else x


def _floats(ctx: NodeContext, name: str, dtype=_F32) -> np.ndarray | None:
    """A float list attribute (or its ``*_as_tensor`` form) as an array, or None if absent."""
    if ctx.has_attr(f"{name}_as_tensor"):
        return np.asarray(ctx.attr(f"{name}_as_tensor"), dtype).reshape(-1)
    return np.asarray(ctx.attr(name), dtype) if ctx.has_attr(name) else None


# ------------------------------------------------------------------------------- preprocessing

#: Scaler results -> (its input, offset, scale): a tree ensemble reading one compares the
#: unscaled input against thresholds moved through the scaling (:func:`fold_scaling`), and the
#: scaling's ops are dropped at import when nothing else reads them.
_SCALED: "weakref.WeakKeyDictionary[Value, tuple[Value, np.ndarray, np.ndarray]]" = weakref.WeakKeyDictionary()


@converter("Scaler", domain=ML)
def _scaler(ctx: NodeContext) -> list:
    x = _float_input(ctx)
    dtype = ctx.dtype(x)
    offset = np.asarray(ctx.attr("offset", [0.0]), dtype)
    scale = np.asarray(ctx.attr("scale", [1.0]), dtype)
    y = ctx.op("mul", ctx.op("sub", x, offset), scale)
    if isinstance(y, Value) and ctx.rank(x) == 2:
        _SCALED[y] = (x, offset, scale)
    return [y]


@converter("Normalizer", domain=ML)
def _normalizer(ctx: NodeContext) -> list:
    x = _as_matrix(ctx, _float_input(ctx))
    norm = ctx.attr("norm", "MAX")
    if norm == "MAX":
        d = ctx.op("reduce_max", x, axes=[1], keepdims=True)
    elif norm == "L1":
        d = ctx.op("reduce_sum", ctx.op("abs", x), axes=[1], keepdims=True)
    elif norm == "L2":
        d = ctx.op("sqrt", ctx.op("reduce_sum", ctx.op("mul", x, x), axes=[1], keepdims=True))
    else:
        raise OnnxModelError(f"attribute 'norm' is {norm!r}; ONNX defines MAX, L1 and L2")
    # A row whose norm is zero stays as it is (onnxruntime and scikit-learn), not 0/0.
    zero = np.zeros((), ctx.dtype(d))
    return [ctx.op("div", x, ctx.op("where", ctx.op("equal", d, zero), np.ones((), ctx.dtype(d)), d))]


@converter("Binarizer", domain=ML)
def _binarizer(ctx: NodeContext) -> list:
    x = ctx.input(0)
    threshold = np.array(ctx.attr("threshold", 0.0), ctx.dtype(x))
    return [ctx.op("cast", ctx.op("greater", x, threshold), dtype=ctx.dtype(x))]


@converter("Imputer", domain=ML)
def _imputer(ctx: NodeContext) -> list:
    x = ctx.input(0)
    dtype = ctx.dtype(x)
    if dtype.kind == "f":
        imputed, replaced = _floats(ctx, "imputed_value_floats", dtype), ctx.attr("replaced_value_float", 0.0)
    else:
        imputed, replaced = np.asarray(ctx.attr("imputed_value_int64s", []), dtype), \
            ctx.attr("replaced_value_int64", 0)
    if imputed is None or not imputed.size:
        raise OnnxModelError("attribute 'imputed_value_floats' (or 'imputed_value_int64s') is empty")
    replaced = np.array(replaced, dtype)
    mask = ctx.op("isnan", x) if dtype.kind == "f" and np.isnan(replaced) else ctx.op("equal", x, replaced)
    return [ctx.op("where", mask, imputed, x)]


@converter("ArrayFeatureExtractor", domain=ML)
def _array_feature_extractor(ctx: NodeContext) -> list:
    x, indices = _as_matrix(ctx, ctx.input(0)), ctx.input(1)
    flat = ctx.op("reshape", indices, shape=[int(np.prod(ctx.shape(indices)))])
    return [ctx.op("gather", x, flat, axis=ctx.rank(x) - 1)]


@converter("OneHotEncoder", domain=ML)
def _one_hot_encoder(ctx: NodeContext) -> list:
    # zeros=0 asks for an error on a category not listed; polyhal's kernels cannot raise on data,
    # so such a value gives an all-zero row in either case (documented in README).
    # (over strings, cats_strings: converters/strings.py)
    cats = np.asarray(ctx.attr("cats_int64s"), np.int64)
    x = ctx.input(0)
    if ctx.dtype(x) != np.int64:
        x = ctx.op("cast", x, dtype=np.int64)
    hot = ctx.op("equal", ctx.op("reshape", x, shape=[*ctx.shape(x), 1]), cats)
    return [ctx.op("cast", hot, dtype=_F32)]


@converter("LabelEncoder", domain=ML)
def _label_encoder(ctx: NodeContext) -> list:
    keys = _first_attr(ctx, ("keys_int64s", "keys_floats", "keys_tensor", "keys_strings"))
    values = _first_attr(ctx, ("values_int64s", "values_floats", "values_tensor", "values_strings"))
    if keys is None or values is None or keys.dtype.kind in "OUS" or values.dtype.kind in "OUS":
        raise OnnxUnsupportedError("LabelEncoder with string keys or values: polyhal has no string tensors")
    if len(keys) != len(values):
        raise OnnxModelError(f"LabelEncoder has {len(keys)} keys but {len(values)} values; give one value per key")
    default = _first_attr(ctx, ("default_int64", "default_float", "default_tensor"), values.dtype)
    default = np.array(default.reshape(-1)[0] if default is not None and default.size else
                       (-1 if values.dtype.kind == "i" else -0.0), values.dtype)
    x = ctx.input(0)
    if ctx.dtype(x) != keys.dtype:
        raise OnnxModelError(f"LabelEncoder input is {ctx.dtype(x)} but its keys are {keys.dtype}")
    hits = ctx.op("equal", ctx.op("reshape", x, shape=[*ctx.shape(x), 1]), keys)  # [..., K]
    last = ctx.rank(x)
    found = ctx.op("reduce_max", ctx.op("cast", hits, dtype=np.int8), axes=[last])
    index = ctx.op("argmax", ctx.op("cast", hits, dtype=np.int8), axis=last)
    found = ctx.op("cast", found, dtype=np.bool_)
    return [ctx.op("where", found, ctx.op("gather", values, index, axis=0), default)]


def _first_attr(ctx: NodeContext, names: Sequence[str], dtype=None) -> np.ndarray | None:
    for name in names:
        if ctx.has_attr(name):
            value = ctx.attr(name)
            kind = name.rsplit("_", 1)[1]
            want = dtype or {"int64s": np.int64, "floats": _F32, "int64": np.int64, "float": _F32}.get(kind)
            return np.asarray(value, want) if want is not None else np.asarray(value)
    return None


# ------------------------------------------------------------------------------ linear models

def _post_transform(ctx: NodeContext, scores: Any, transform: str | None = None) -> Any:
    """``scores`` after the node's post transform (``transform``: its name, when the node codes
    it as a number)."""
    transform = transform or ctx.attr("post_transform", "NONE")
    if transform == "NONE":
        return scores
    if transform == "LOGISTIC":
        return ctx.op("sigmoid", scores)
    if transform == "SOFTMAX":
        return ctx.op("softmax", scores, axis=-1)
    raise OnnxUnsupportedError(f"{ctx.op_type} with post_transform {transform!r} is not supported by polyhal "
                               "(NONE, LOGISTIC and SOFTMAX are)")


def _class_labels(ctx: NodeContext, index: Any, ints_attr: str, strings_attr: str) -> Any:
    """The label output from the chosen class ``index`` (int64 [N]): int labels gathered in the
    plan, string labels made on the host."""
    if ctx.has_attr(strings_attr):
        labels = np.array(ctx.attr(strings_attr), dtype=object)
        return HostOutput(index, lambda a: labels[np.asarray(a)].astype(str), "string class labels")
    labels = np.asarray(ctx.attr(ints_attr, []), np.int64)
    if not labels.size:
        raise OnnxModelError(f"neither {ints_attr!r} nor {strings_attr!r} is given")
    return ctx.op("gather", labels, index, axis=0)


def _n_labels(ctx: NodeContext, ints_attr: str, strings_attr: str) -> int:
    return len(ctx.attr(strings_attr, [])) or len(ctx.attr(ints_attr, []))


def _binary_columns(ctx: NodeContext, s: Any) -> Any:
    """One score column ``s`` [N, 1] as two: ``[1 - s, s]`` without a post transform (a
    probability), ``[-s, s]`` with one (a margin), as onnxruntime does."""
    first = ctx.op("sub", np.ones((), ctx.dtype(s)), s) if ctx.attr("post_transform", "NONE") == "NONE" \
        else ctx.op("neg", s)
    return ctx.op("concat", first, s, axis=1)


@converter("LinearRegressor", domain=ML)
def _linear_regressor(ctx: NodeContext) -> list:
    x = _as_matrix(ctx, _float_input(ctx))
    dtype, features = ctx.dtype(x), ctx.shape(x)[1]
    coefficients = np.asarray(ctx.attr("coefficients"), dtype).reshape(-1, features)
    targets = int(ctx.attr("targets", 1))
    if coefficients.shape[0] != targets:
        raise OnnxModelError(f"attribute 'coefficients' holds {coefficients.shape[0]} rows of {features}, "
                             f"but 'targets' is {targets}")
    intercepts = np.asarray(ctx.attr("intercepts", [0.0] * targets), dtype)
    y = ctx.op("gemm", x, coefficients, intercepts, trans_b=True)
    return [_post_transform(ctx, y)]


@converter("LinearClassifier", domain=ML)
def _linear_classifier(ctx: NodeContext) -> list:
    x = _as_matrix(ctx, _float_input(ctx))
    dtype, features = ctx.dtype(x), ctx.shape(x)[1]
    coefficients = np.asarray(ctx.attr("coefficients"), dtype)
    if coefficients.size % features:
        raise OnnxModelError(f"attribute 'coefficients' has {coefficients.size} entries, not a multiple of the "
                             f"{features} features")
    coefficients = coefficients.reshape(-1, features)
    intercepts = np.asarray(ctx.attr("intercepts", [0.0] * len(coefficients)), dtype)
    scores = ctx.op("gemm", x, coefficients, intercepts, trans_b=True)
    if coefficients.shape[0] == 1 and _n_labels(ctx, "classlabels_ints", "classlabels_strings") == 2:
        scores = _binary_columns(ctx, scores)
    scores = _post_transform(ctx, scores)
    index = ctx.op("argmax", scores, axis=1)
    return [_class_labels(ctx, index, "classlabels_ints", "classlabels_strings"), scores]


# --------------------------------------------------------------------------------- tree ensembles

_NODE_ATTRS = ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_modes", "nodes_truenodeids",
               "nodes_falsenodeids")


def compact_trees(ctx: NodeContext, features: int, dtype: np.dtype, prefix: str, n_targets: int,
                  single_target: bool = False, aggregate: str = "sum"):
    """The compact arrays of :mod:`polyhal.ops.ml` from the node's ``nodes_*`` and
    ``{prefix}_*`` attributes, checked: ``(nodes, thresholds, leaf_values, roots, depth)``
    (leaf values for ``aggregate``: see :func:`_leaf_table`)."""
    arrays = {name: ctx.attr(name, None) for name in _NODE_ATTRS}
    missing = [n for n, v in arrays.items() if v is None]
    if missing:
        raise OnnxModelError(f"required attribute {missing[0]!r} is missing")
    thresholds = _floats(ctx, "nodes_values", dtype)
    arrays["nodes_values"] = thresholds if thresholds is not None else np.zeros(0)
    tracks = ctx.attr("nodes_missing_value_tracks_true", None)
    if tracks is not None:
        arrays["nodes_missing_value_tracks_true"] = tracks
    count = len(arrays["nodes_treeids"])
    for name, values in arrays.items():
        if len(values) != count:
            raise OnnxModelError(f"attribute {name!r} has {len(values)} entries but 'nodes_treeids' has {count}; "
                                 "every nodes_* attribute has one entry per node")
    tree_ids, node_ids = arrays["nodes_treeids"], arrays["nodes_nodeids"]
    row_of: dict[tuple[int, int], int] = {}
    for row, key in enumerate(zip(tree_ids, node_ids)):
        if key in row_of:
            raise OnnxModelError(f"attributes 'nodes_treeids'/'nodes_nodeids' list tree {key[0]} node {key[1]} twice")
        row_of[key] = row
    nodes = np.zeros((count, 4), np.int64)
    for row in range(count):
        mode_name = arrays["nodes_modes"][row]
        if mode_name == "LEAF":
            nodes[row] = (0, LEAF, row, row)
            continue
        if mode_name not in MODE_BITS:
            raise OnnxModelError(f"attribute 'nodes_modes' entry {row} is {mode_name!r}; ONNX defines LEAF and "
                                 f"{', '.join(MODE_BITS)}")
        feature = int(arrays["nodes_featureids"][row])
        if not 0 <= feature < features:
            raise OnnxModelError(f"attribute 'nodes_featureids' entry {row} is {feature}, but the input has "
                                 f"{features} features")
        nexts = []
        for name in ("nodes_truenodeids", "nodes_falsenodeids"):
            target = row_of.get((tree_ids[row], arrays[name][row]))
            if target is None:
                raise OnnxModelError(f"attribute {name!r} entry {row} (tree {tree_ids[row]}, node {node_ids[row]}) "
                                     f"points at node {arrays[name][row]}, which tree {tree_ids[row]} does not have")
            nexts.append(target)
        nodes[row] = (feature, _mode_bits(mode_name, tracks is not None and tracks[row]), *nexts)
    roots: dict[int, int] = {}
    for row, tid in enumerate(tree_ids):
        roots.setdefault(tid, row)
    root_rows = np.array([roots[t] for t in sorted(roots)], np.int64)
    depth = _depth(nodes, root_rows, tree_ids)
    weights = {n: ctx.attr(f"{prefix}_{n}", None) for n in ("treeids", "nodeids", "ids")}
    weights["weights"] = _floats(ctx, f"{prefix}_weights", np.float64)
    for name, values in weights.items():
        if values is None:
            raise OnnxModelError(f"required attribute '{prefix}_{name}' is missing")
        if len(values) != len(weights["treeids"]):
            raise OnnxModelError(f"attribute '{prefix}_{name}' has {len(values)} entries but "
                                 f"'{prefix}_treeids' has {len(weights['treeids'])}; give one per leaf weight")
    leaf_rows, leaf_targets = [], []
    for i, (tid, nid, target) in enumerate(zip(weights["treeids"], weights["nodeids"], weights["ids"])):
        row = row_of.get((tid, nid))
        if row is None:
            raise OnnxModelError(f"attribute '{prefix}_nodeids' entry {i} names tree {tid} node {nid}, which is "
                                 "not a node")
        target = 0 if single_target else int(target)
        if not 0 <= target < n_targets:
            raise OnnxModelError(f"attribute '{prefix}_ids' entry {i} is {target}; the model has {n_targets} "
                                 "targets or classes")
        leaf_rows.append(row)
        leaf_targets.append(target)
    leaf_values = _leaf_table(count, n_targets, leaf_rows, leaf_targets, weights["weights"], aggregate)
    thresholds = np.asarray(arrays["nodes_values"], dtype) if count else np.zeros(0, dtype)
    return nodes, thresholds, leaf_values, root_rows, depth


def _leaf_table(rows: int, n_targets: int, leaf_rows, targets, weights, aggregate: str) -> np.ndarray:
    """``leaf_values`` float64 ``[rows, n_targets]``: the weights a leaf gives each target,
    summed (``aggregate`` "sum"), or their min/max with nan where a leaf gives a target nothing
    (how the op tells that from a weight of 0 when it takes the min or max over trees)."""
    if aggregate == "sum":
        table = np.zeros((rows, n_targets), np.float64)
        np.add.at(table, (np.asarray(leaf_rows, np.int64), np.asarray(targets, np.int64)), weights)
        return table
    table = np.full((rows, n_targets), np.nan)
    combine = np.fmin if aggregate == "min" else np.fmax
    combine.at(table, (np.asarray(leaf_rows, np.int64), np.asarray(targets, np.int64)), weights)
    return table


def _mode_bits(name: str, missing_tracks_true: bool) -> int:
    """The ``mode`` of a branch (see :mod:`polyhal.ops.ml`). A nan feature goes to the true
    child when the node tracks missing values true, and at BRANCH_NEQ always: ``nan != t``
    holds, as onnxruntime and onnx's reference evaluate it."""
    return MODE_BITS[name] | (MISSING_TRUE if missing_tracks_true or name == "BRANCH_NEQ" else 0)


def _depth(nodes: np.ndarray, roots: np.ndarray, tree_ids) -> int:
    """The longest root-to-leaf path in branches; OnnxModelError for a cycle."""
    deepest = 0
    for root in roots:
        stack = [(int(root), 0)]
        seen_depth: dict[int, int] = {}
        while stack:
            row, level = stack.pop()
            if level > len(nodes):
                raise OnnxModelError(f"attributes 'nodes_truenodeids'/'nodes_falsenodeids' form a cycle in tree "
                                     f"{tree_ids[root]}")
            if seen_depth.get(row, -1) >= level:
                continue
            seen_depth[row] = level
            if nodes[row, 1] == LEAF:
                deepest = max(deepest, level)
            else:
                stack.append((int(nodes[row, 2]), level + 1))
                stack.append((int(nodes[row, 3]), level + 1))
    return deepest


def _walk(ctx: NodeContext, x: Any, prefix: str, n_targets: int, single_target: bool = False, *,
          average: bool = False, labels: np.ndarray | None = None, aggregate: str = "sum", **epilogue: Any) -> Any:
    """One ``tree_ensemble`` op for the node (its epilogue in ``epilogue``; ``average`` folds
    1/trees into the leaf values; ``labels``: the op's second result, the label column).
    Returns the scores as float (cast for float64 input: these ops output float) and the
    labels when asked."""
    dtype, features = ctx.dtype(x), ctx.shape(x)[1]
    nodes, thresholds, leaf_values, roots, depth = compact_trees(ctx, features, dtype, prefix, n_targets,
                                                                 single_target, aggregate)
    if average:
        leaf_values = leaf_values / max(len(roots), 1)
    return _tree_op(ctx, x, nodes, thresholds, leaf_values, roots, depth, labels, aggregate=aggregate, **epilogue)


def _tree_op(ctx: NodeContext, x: Any, nodes, thresholds, leaf_values, roots, depth, labels=None,
             out_dtype=_F32, **epilogue: Any) -> Any:
    """The ``tree_ensemble`` op, reading the unscaled input of a Scaler where the scaling
    folds into the thresholds exactly; its scores in ``out_dtype`` (and its labels)."""
    scaled = _SCALED.get(x) if isinstance(x, Value) else None
    if scaled is not None:
        folded = fold_scaling(nodes, thresholds, *scaled[1:])
        if folded is not None:
            x, (nodes, thresholds) = scaled[0], folded
    operands = [x, nodes, thresholds, leaf_values, roots] + ([labels] if labels is not None else [])
    epilogue = {k: v for k, v in epilogue.items() if v and v not in ("sum", "none")}
    result = ctx.op("tree_ensemble", *operands, depth=depth, **epilogue)
    y, label = result if labels is not None else (result, None)
    if ctx.dtype(y) != out_dtype:
        y = ctx.op("cast", y, dtype=out_dtype)
    return (y, label) if labels is not None else y


def fold_scaling(nodes: np.ndarray, thresholds: np.ndarray, offset: np.ndarray, scale: np.ndarray):
    """``(nodes, thresholds)`` that route the raw input ``x`` as the given ones route the
    Scaler's ``(x - offset) * scale`` (each rounded to x's type, as the Scaler computes it), or
    None where no single threshold per node does.

    A feature's scaling ``g`` is monotone, so ``g(x) < t`` holds exactly for the ``x`` below the
    smallest value ``A`` with ``g(A) >= t``, ``g(x) > t`` exactly from the smallest ``B`` with
    ``g(B) > t`` on: both are found by bisecting the ordered floats of x's type (no rounding
    of the comparison changes). A negative scale mirrors the comparison. EQ/NEQ nodes fold
    only when one float maps onto the threshold; a zero or non-finite scale does not fold."""
    dtype = thresholds.dtype
    branch = np.flatnonzero((nodes[:, 1] & 7) % 7 != 0)  # nodes whose comparison reads x's value
    features = nodes[branch, 0]
    o = np.broadcast_to(offset, (max(features.max(initial=0) + 1, offset.size),))[features] if offset.size else \
        np.zeros(len(branch), dtype)
    s = np.broadcast_to(scale, (max(features.max(initial=0) + 1, scale.size),))[features] if scale.size else \
        np.ones(len(branch), dtype)
    if not (np.all(np.isfinite(o)) and np.all(np.isfinite(s)) and np.all(s != 0)):
        return None
    flip = s < 0
    t = thresholds[branch]
    uint = np.dtype(f"u{dtype.itemsize}")
    sign = np.uint64(1) << np.uint64(8 * dtype.itemsize - 1)

    def key(v: np.ndarray) -> np.ndarray:  # float -> unsigned key in float order
        u = np.ascontiguousarray(v, dtype).view(uint).astype(np.uint64)
        return np.where(u & sign, ~u & (sign | (sign - np.uint64(1))), u | sign)

    def value(k: np.ndarray) -> np.ndarray:
        u = np.where(k & sign, k ^ sign, ~k & (sign | (sign - np.uint64(1))))
        return u.astype(uint).view(dtype)

    def g(k: np.ndarray) -> np.ndarray:  # the scaling seen from x (mirrored for a negative scale)
        v = value(k)
        with np.errstate(all="ignore"):
            return ((np.where(flip, -v, v) - o).astype(dtype) * s).astype(dtype)

    first, last = key(np.array([-np.inf])), key(np.array([np.inf]))
    none = last + np.uint64(1)

    def smallest(holds) -> np.ndarray:  # the smallest key where holds(g(key)), else ``none``
        lo, hi = np.full(len(branch), first[0]), np.full(len(branch), none[0])
        while np.any(lo < hi):
            mid = lo + (hi - lo) // np.uint64(2)
            ok = holds(g(mid))
            hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid + np.uint64(1))
        return lo

    a, b = smallest(lambda y: y >= t), smallest(lambda y: y > t)
    inf = np.array(np.inf, dtype)
    modes = nodes[branch, 1] & 7
    new_mode = np.zeros(len(branch), np.int64)
    new_t = np.zeros(len(branch), dtype)

    def below(k, rows):  # "x < value(k)"
        never_false = k[rows] == none[0]
        new_mode[rows] = np.where(never_false, MODE_BITS["BRANCH_LEQ"], MODE_BITS["BRANCH_LT"])
        new_t[rows] = np.where(never_false, inf, value(np.minimum(k[rows], last[0])))

    def from_(k, rows):  # "x >= value(k)"
        never = k[rows] == none[0]
        new_mode[rows] = np.where(never, MODE_BITS["BRANCH_GT"], MODE_BITS["BRANCH_GTE"])
        new_t[rows] = np.where(never, inf, value(np.minimum(k[rows], last[0])))

    below(a, modes == 1)
    below(b, modes == 3)
    from_(a, modes == 6)
    from_(b, modes == 4)
    point = modes % 3 == 2  # EQ (2) and NEQ (5): the floats from A up to B
    if point.any():
        a_p, b_p = a[point], b[point]
        empty = a_p == b_p
        single = ~empty & (value(np.minimum(a_p, last[0])) == value(np.minimum(b_p - np.uint64(1), last[0])))
        if not np.all(empty | single):
            return None
        eq = modes[point] == 2
        new_mode[point] = np.where(empty, np.where(eq, MODE_BITS["BRANCH_GT"], MODE_BITS["BRANCH_LEQ"]),
                                   modes[point])
        new_t[point] = np.where(empty, inf, value(np.minimum(a_p, last[0])))
    # A mirrored comparison: g(x) = h(-x), so "-x < T" is "x > -T" (swap the < and > bits).
    lt, gt = new_mode & 1, new_mode & 4
    new_mode = np.where(flip, (new_mode & 2) | (lt << 2) | (gt >> 2), new_mode)
    new_t = np.where(flip, -new_t, new_t).astype(dtype)
    nodes, thresholds = nodes.copy(), thresholds.copy()
    nodes[branch, 1] = new_mode | (nodes[branch, 1] & MISSING_TRUE)
    thresholds[branch] = new_t
    return nodes, thresholds


#: TreeEnsemble's (opset 5) ``nodes_modes`` codes; 6 is BRANCH_MEMBER (set membership).
_MODE_CODES = ("BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ")
_MEMBER = 6
#: Its ``post_transform`` and ``aggregate_function`` codes.
_POST_TRANSFORMS = ("NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT")
_AGGREGATES = ("sum", "sum", "min", "max")  # AVERAGE is a sum of leaf values divided by the tree count
_AVERAGE = 0


def compact_tree_ensemble(ctx: NodeContext, features: int, dtype: np.dtype, n_targets: int,
                          aggregate: str = "sum"):
    """The compact arrays of :mod:`polyhal.ops.ml` from TreeEnsemble's (ai.onnx.ml opset 5)
    layout, checked: ``(nodes, thresholds, leaf_values, roots, depth)``.

    Its branches are rows ``0..N-1`` (``nodes_*``), its leaves a second index space
    (``leaf_*``; ``nodes_trueleafs``/``nodes_falseleafs`` say which space a child id is in): the
    leaves become rows ``N..N+L-1``. A BRANCH_MEMBER node (``x`` in a set: the node's run of
    ``membership_values``, runs ending at nan) becomes a chain of BRANCH_EQ rows, one per member,
    each sending a match to the node's true child and a mismatch to the next (the last to its
    false child), so the walk needs no set test; a nan feature follows
    ``nodes_missing_value_tracks_true`` at the chain's first row."""
    def ints(name, required=True):
        value = ctx.attr(name, None)
        if value is None and required:
            raise OnnxModelError(f"required attribute {name!r} is missing")
        return None if value is None else np.asarray(value, np.int64).reshape(-1)

    modes = ints("nodes_modes")
    count = len(modes)
    arrays = {name: ints(name) for name in ("nodes_featureids", "nodes_truenodeids", "nodes_falsenodeids",
                                             "nodes_trueleafs", "nodes_falseleafs")}
    arrays["nodes_splits"] = np.asarray(ctx.attr("nodes_splits"), np.float64).reshape(-1)
    tracks = ints("nodes_missing_value_tracks_true", required=False)
    if tracks is not None:
        arrays["nodes_missing_value_tracks_true"] = tracks
    for name, values in arrays.items():
        if len(values) != count:
            raise OnnxModelError(f"attribute {name!r} has {len(values)} entries but 'nodes_modes' has {count}; "
                                 "every nodes_* attribute has one entry per branch node")
    targets = ints("leaf_targetids")
    weights = np.asarray(ctx.attr("leaf_weights"), np.float64).reshape(-1)
    if len(weights) != len(targets):
        raise OnnxModelError(f"attribute 'leaf_weights' has {len(weights)} entries but 'leaf_targetids' has "
                             f"{len(targets)}; give one weight per leaf")
    bad = np.flatnonzero((targets < 0) | (targets >= n_targets))
    if bad.size:
        raise OnnxModelError(f"attribute 'leaf_targetids' entry {bad[0]} is {targets[bad[0]]}; the model has "
                             f"{n_targets} targets (n_targets)")
    members = ctx.attr("membership_values", None)
    sets = _member_sets(members, int((modes == _MEMBER).sum()))
    n_leaves = len(targets)
    rows: list[tuple[int, int, int, int]] = []
    thresholds: list[float] = []

    def child(row: int, side: str) -> int:
        target, leaf = arrays[f"nodes_{side}nodeids"][row], arrays[f"nodes_{side}leafs"][row]
        limit = n_leaves if leaf else count
        if not 0 <= target < limit:
            raise OnnxModelError(f"attribute 'nodes_{side}nodeids' entry {row} is {target}, but the model has "
                                 f"{limit} {'leaves' if leaf else 'branch nodes'} (nodes_{side}leafs says which)")
        return count + target if leaf else target

    chains = []  # (row, members): the extra rows of each BRANCH_MEMBER node, added after the leaves
    for row in range(count):
        mode = int(modes[row])
        feature = int(arrays["nodes_featureids"][row])
        if not 0 <= mode <= _MEMBER:
            raise OnnxModelError(f"attribute 'nodes_modes' entry {row} is {mode}; ONNX defines 0 to 6 "
                                 f"({', '.join(_MODE_CODES)}, BRANCH_MEMBER)")
        if not 0 <= feature < features:
            raise OnnxModelError(f"attribute 'nodes_featureids' entry {row} is {feature}, but the input has "
                                 f"{features} features")
        missing = MISSING_TRUE if tracks is not None and tracks[row] else 0
        true_next, false_next = child(row, "true"), child(row, "false")
        if mode == _MEMBER:
            chains.append((row, next(sets), true_next, false_next, missing))
            rows.append(None)  # filled below, once the chain's rows are numbered
            thresholds.append(0.0)
            continue
        rows.append((feature, _mode_bits(_MODE_CODES[mode], missing), true_next, false_next))
        thresholds.append(arrays["nodes_splits"][row])
    for leaf in range(n_leaves):
        rows.append((0, LEAF, count + leaf, count + leaf))
        thresholds.append(0.0)
    for row, values, true_next, false_next, missing in chains:
        feature = int(arrays["nodes_featureids"][row])
        if not values:  # the empty set: nothing matches; a nan follows the missing rule (mode 0 is a leaf)
            rows[row] = (feature, missing, true_next, false_next) if missing \
                else (feature, MODE_BITS["BRANCH_NEQ"], false_next, false_next)
            continue
        link = [row] + list(range(len(rows), len(rows) + len(values) - 1))
        for k, (at, value) in enumerate(zip(link, values)):
            after = link[k + 1] if k + 1 < len(link) else false_next
            entry = (feature, MODE_BITS["BRANCH_EQ"] | (missing if k == 0 else 0), true_next, after)
            if at == row:
                rows[row], thresholds[row] = entry, value
            else:
                rows.append(entry)
                thresholds.append(value)
    nodes = np.array(rows, np.int64).reshape(-1, 4)
    leaf_values = _leaf_table(len(nodes), n_targets, count + np.arange(n_leaves), targets, weights, aggregate)
    roots = ints("tree_roots")
    bad = np.flatnonzero((roots < 0) | (roots >= max(count, 1)))
    if bad.size or not count:
        raise OnnxModelError(f"attribute 'tree_roots' entry {bad[0] if bad.size else 0} is not a branch node "
                             f"(the model has {count})")
    # A tree that is one leaf is a root whose children are that same leaf: start at the leaf.
    roots = np.array([child(r, "true") if arrays["nodes_trueleafs"][r] and arrays["nodes_falseleafs"][r]
                      and arrays["nodes_truenodeids"][r] == arrays["nodes_falsenodeids"][r] else r
                      for r in roots], np.int64)
    depth = _depth(nodes, roots, {int(r): t for t, r in enumerate(roots)})
    return nodes, np.asarray(thresholds, dtype), leaf_values, roots, depth


def _member_sets(members: Any, count: int):
    """The member sets of ``count`` BRANCH_MEMBER nodes, in node order: ``membership_values``
    split at its nans (one run per such node)."""
    if count == 0:
        return iter(())
    if members is None:
        raise OnnxModelError(f"the model has {count} BRANCH_MEMBER nodes but no 'membership_values'")
    values = np.asarray(members, np.float64).reshape(-1)
    ends = np.flatnonzero(np.isnan(values))
    if len(ends) != count:
        raise OnnxModelError(f"attribute 'membership_values' holds {len(ends)} nan-terminated sets, but the model "
                             f"has {count} BRANCH_MEMBER nodes; give one set per such node")
    starts = np.concatenate([[0], ends[:-1] + 1])
    return iter([list(dict.fromkeys(values[a:b].tolist())) for a, b in zip(starts, ends)])


@converter("TreeEnsemble", domain=ML)
def _tree_ensemble(ctx: NodeContext) -> list:
    x = ctx.input(0)
    out_dtype = ctx.dtype(x)
    x = _as_matrix(ctx, _float_input(ctx))
    n_targets = int(ctx.attr("n_targets", 1))
    aggregate = int(ctx.attr("aggregate_function", 1))  # SUM
    if not 0 <= aggregate < len(_AGGREGATES):
        raise OnnxModelError(f"attribute 'aggregate_function' is {aggregate}; ONNX defines 0 to 3 "
                             "(AVERAGE, SUM, MIN, MAX)")
    nodes, thresholds, leaf_values, roots, depth = compact_tree_ensemble(ctx, ctx.shape(x)[1], ctx.dtype(x),
                                                                         n_targets, _AGGREGATES[aggregate])
    if aggregate == _AVERAGE:
        leaf_values = leaf_values / len(roots)
    transform = int(ctx.attr("post_transform", 0))
    if not 0 <= transform < len(_POST_TRANSFORMS):
        raise OnnxModelError(f"attribute 'post_transform' is {transform}; ONNX defines 0 to 4")
    return [_tree_op(ctx, x, nodes, thresholds, leaf_values, roots, depth, out_dtype=out_dtype,
                     aggregate=_AGGREGATES[aggregate],
                     post_transform=_tree_transform(ctx, _POST_TRANSFORMS[transform]))]


def _tree_transform(ctx: NodeContext, transform: str | None = None) -> str:
    """The ``post_transform`` of the tree_ensemble op for the node's (``transform``: its name,
    when the node codes it as a number)."""
    transform = transform or ctx.attr("post_transform", "NONE")
    if transform not in ("NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"):
        raise OnnxUnsupportedError(f"{ctx.op_type} with post_transform {transform!r} is not supported by polyhal "
                                   "(NONE, LOGISTIC, SOFTMAX and SOFTMAX_ZERO are)")
    return transform.lower()


@converter("TreeEnsembleRegressor", domain=ML)
def _tree_ensemble_regressor(ctx: NodeContext) -> list:
    x = _as_matrix(ctx, _float_input(ctx))
    n_targets = int(ctx.attr("n_targets", 1))
    aggregate = ctx.attr("aggregate_function", "SUM")
    if aggregate not in ("SUM", "AVERAGE", "MIN", "MAX"):
        raise OnnxModelError(f"attribute 'aggregate_function' is {aggregate!r}; ONNX defines SUM, AVERAGE, MIN "
                             "and MAX")
    base = _floats(ctx, "base_values", np.float64)
    return [_walk(ctx, x, "target", n_targets, average=aggregate == "AVERAGE",
                  aggregate=aggregate.lower() if aggregate != "AVERAGE" else "sum",
                  base=tuple(base.tolist()) if base is not None else (), post_transform=_tree_transform(ctx))]


@converter("TreeEnsembleClassifier", domain=ML)
def _tree_ensemble_classifier(ctx: NodeContext) -> list:
    x = _as_matrix(ctx, _float_input(ctx))
    n_classes = _n_labels(ctx, "classlabels_int64s", "classlabels_strings")
    class_ids = ctx.attr("class_ids", [])
    binary = n_classes == 2 and len(set(class_ids)) <= 1  # one score, for the second class
    base = _floats(ctx, "base_values", np.float64)
    base = () if base is None or not base.size else tuple((base[:1] if binary else base).tolist())
    strings = ctx.has_attr("classlabels_strings")
    labels = np.arange(n_classes, dtype=np.int64) if strings else \
        np.asarray(ctx.attr("classlabels_int64s", []), np.int64)
    if not labels.size:
        raise OnnxModelError("neither 'classlabels_int64s' nor 'classlabels_strings' is given")
    transform = _tree_transform(ctx)
    scores, label = _walk(ctx, x, "class", 1 if binary else n_classes, single_target=binary, labels=labels,
                          base=base, post_transform=transform,
                          binary=("probability" if transform == "none" else "margin") if binary else "")
    if strings:
        names = np.array(ctx.attr("classlabels_strings"), dtype=object)
        label = HostOutput(label, lambda a: names[np.asarray(a)].astype(str), "string class labels")
    return [label, scores]


# ------------------------------------------------------------------------------------------ SVMs

def _svm_kernel(ctx: NodeContext, x: Any, vectors: np.ndarray) -> Any:
    """The node's kernel between every row of ``x`` [N, F] and every row of ``vectors`` [V, F]:
    [N, V], as onnxruntime computes it (RBF from the differences, not from expanded norms)."""
    kind = ctx.attr("kernel_type", "LINEAR")
    gamma, coef0, degree = (list(ctx.attr("kernel_params", [])) + [0.0, 0.0, 0.0])[:3]
    dtype = ctx.dtype(x)
    if kind == "RBF":
        distance = ctx.op("squared_distances", x, np.ascontiguousarray(vectors, dtype))
        return ctx.op("exp", ctx.op("mul", distance, np.array(-gamma, dtype)))
    dot = ctx.op("gemm", x, vectors, trans_b=True)
    if kind == "LINEAR":
        return dot
    inner = ctx.op("add", ctx.op("mul", dot, np.array(gamma, dtype)), np.array(coef0, dtype))
    if kind == "POLY":
        return ctx.op("pow", inner, np.array(degree, dtype))
    if kind == "SIGMOID":
        return ctx.op("tanh", inner)
    raise OnnxModelError(f"attribute 'kernel_type' is {kind!r}; ONNX defines LINEAR, POLY, RBF and SIGMOID")


def _svm_vectors(ctx: NodeContext, features: int, count: int, dtype) -> np.ndarray:
    vectors = _floats(ctx, "support_vectors", dtype)
    if vectors is None or vectors.size != count * features:
        raise OnnxModelError(f"attribute 'support_vectors' has {0 if vectors is None else vectors.size} entries; "
                             f"{count} support vectors of {features} features need {count * features}")
    return vectors.reshape(count, features)


@converter("SVMRegressor", domain=ML)
def _svm_regressor(ctx: NodeContext) -> list:
    x = _as_matrix(ctx, _float_input(ctx))
    dtype, features = ctx.dtype(x), ctx.shape(x)[1]
    count = int(ctx.attr("n_supports", 0))
    coefficients = _floats(ctx, "coefficients", dtype)
    rho = _floats(ctx, "rho", dtype)
    if coefficients is None or not coefficients.size or rho is None or not rho.size:
        raise OnnxModelError("SVMRegressor needs the attributes 'coefficients' and 'rho'")
    if count > 0:
        if coefficients.size != count:
            raise OnnxModelError(f"attribute 'coefficients' has {coefficients.size} entries but 'n_supports' is "
                                 f"{count}; give one per support vector")
        scores = _svm_kernel(ctx, x, _svm_vectors(ctx, features, count, dtype))
    else:  # linear: the coefficients are the weights of the features
        if coefficients.size != features:
            raise OnnxModelError(f"attribute 'coefficients' has {coefficients.size} entries; without support "
                                 f"vectors it holds one weight per feature ({features})")
        scores = x
    y = ctx.op("gemm", scores, coefficients.reshape(1, -1), rho[:1], trans_b=True)  # [N, 1]
    if ctx.attr("one_class", 0):
        y = ctx.op("where", ctx.op("greater", y, np.zeros((), dtype)), np.ones((), dtype), -np.ones((), dtype))
    return [_post_transform(ctx, y)]


@converter("SVMClassifier", domain=ML)
def _svm_classifier(ctx: NodeContext) -> list:
    """onnxruntime's SVMClassifier: one-vs-one decision values of the support vectors' kernel
    (SVC mode, ``vectors_per_class`` given), whose votes pick the label, or one linear score
    per class; with ``prob_a``/``prob_b`` the scores are pairwise Platt probabilities coupled into
    class probabilities (``pairwise_coupling``)."""
    x = _as_matrix(ctx, _float_input(ctx))
    dtype, features = ctx.dtype(x), ctx.shape(x)[1]
    strings = ctx.has_attr("classlabels_strings")
    labels = np.arange(_n_labels(ctx, "classlabels_ints", "classlabels_strings"), dtype=np.int64) if strings \
        else np.asarray(ctx.attr("classlabels_ints", []), np.int64)
    k = max(len(labels), 1)
    coefficients = _floats(ctx, "coefficients", dtype)
    rho = _floats(ctx, "rho", dtype)
    if coefficients is None or not coefficients.size or rho is None or not rho.size:
        raise OnnxModelError("SVMClassifier needs the attributes 'coefficients' and 'rho'")
    per_class = np.asarray(ctx.attr("vectors_per_class", []), np.int64)
    count = int(per_class.sum())
    prob_a, prob_b = _floats(ctx, "prob_a", dtype), _floats(ctx, "prob_b", dtype)
    all_positive = bool(coefficients.min() >= 0)
    if count > 0:
        if len(per_class) != k:
            raise OnnxModelError(f"attribute 'vectors_per_class' has {len(per_class)} entries for {k} classes")
        pairs = k * (k - 1) // 2
        if coefficients.size != (k - 1) * count or rho.size < pairs:
            raise OnnxModelError(f"attributes 'coefficients' ({coefficients.size}) and 'rho' ({rho.size}) do not fit "
                                 f"{k} classes of {count} support vectors: they need {(k - 1) * count} and {pairs}")
        coefs = coefficients.reshape(k - 1, count)
        starts = np.concatenate([[0], np.cumsum(per_class)[:-1]])
        # Decision value of pair (i, j): rho + K[:, class i] . coefs[j-1, class i] + K[:, class j] . coefs[i, class j],
        # one column of a [V, pairs] matrix; votes from its sign through two [pairs, k] matrices.
        weights = np.zeros((count, pairs), dtype)
        win, lose = np.zeros((pairs, k), dtype), np.zeros((pairs, k), dtype)
        p = 0
        for i in range(k):
            for j in range(i + 1, k):
                a, b = slice(starts[i], starts[i] + per_class[i]), slice(starts[j], starts[j] + per_class[j])
                weights[a, p], weights[b, p] = coefs[j - 1, a], coefs[i, b]
                win[p, i], lose[p, j] = 1, 1
                p += 1
        decision = ctx.op("gemm", _svm_kernel(ctx, x, _svm_vectors(ctx, features, count, dtype)), weights,
                          rho[:pairs])
        positive = ctx.op("cast", ctx.op("greater", decision, np.zeros((), dtype)), dtype=dtype)
        votes = ctx.op("add", ctx.op("matmul", positive, win - lose), lose.sum(axis=0))
        if prob_a is not None and prob_a.size:
            if prob_a.size != pairs or prob_b is None or prob_b.size != pairs:
                raise OnnxModelError(f"attributes 'prob_a'/'prob_b' need one entry per class pair ({pairs})")
            # Platt's sigmoid per pair, kept inside (1e-7, 1 - 1e-7), then coupled.
            pair_p = ctx.op("sub", np.ones((), dtype),
                            ctx.op("sigmoid", ctx.op("add", ctx.op("mul", decision, prob_a), prob_b)))
            pair_p = ctx.op("minimum", ctx.op("maximum", pair_p, np.array(1e-7, dtype)), np.array(1 - 1e-7, dtype))
            scores = ctx.op("pairwise_coupling", pair_p, classes=k)
        else:
            scores = decision
        index = ctx.op("argmax", votes, axis=1)  # the votes pick the label, probabilities or not
        if k == 2 and all_positive and not (prob_a is not None and prob_a.size):
            # onnxruntime's rule for two classes of all-positive weights
                index = ctx.op("cast", ctx.op("greater", ctx.op("reduce_max", votes, axes=[1], keepdims=False),
                                              np.array(0.5, dtype)), dtype=np.int64)
    else:  # linear: one score per class
        if coefficients.size % features:
            raise OnnxModelError(f"attribute 'coefficients' has {coefficients.size} entries, not a multiple of the "
                                 f"{features} features")
        scores = ctx.op("gemm", x, coefficients.reshape(-1, features), rho[:1], trans_b=True)
        index = ctx.op("argmax", scores, axis=1)
        if rho.size == 1 and k == 2 and all_positive:
            index = ctx.op("cast", ctx.op("greater", ctx.op("reduce_max", scores, axes=[1], keepdims=False),
                                          np.array(0.5 if all_positive else 0, dtype)), dtype=np.int64)
    if ctx.shape(scores)[1] == 1 and k == 2:
        scores = ctx.op("concat", ctx.op("neg", scores), scores, axis=1)  # [-s, s], as onnxruntime writes it
    scores = _post_transform(ctx, scores)
    if strings:
        names = np.array(ctx.attr("classlabels_strings"), dtype=object)
        return [HostOutput(index, lambda a: names[np.asarray(a)].astype(str), "string class labels"), scores]
    if not labels.size:
        return [index, scores]
    return [ctx.op("gather", labels, index, axis=0), scores]


# ------------------------------------------------------------------------------------- ZipMap

@converter("ZipMap", domain=ML)
def _zipmap(ctx: NodeContext) -> list:
    x = ctx.input(0)
    if ctx.has_attr("classlabels_strings"):
        labels: list = list(ctx.attr("classlabels_strings"))
    else:
        labels = [int(v) for v in ctx.attr("classlabels_int64s")]
    if ctx.rank(x) != 2 or ctx.shape(x)[1] != len(labels):
        raise OnnxModelError(f"ZipMap's input has shape {list(ctx.shape(x))}, but it names {len(labels)} class "
                             f"labels; the input must be [N, {len(labels)}]")

    def finish(scores: np.ndarray) -> list[dict]:
        s = np.asarray(scores)
        if len(labels) == 2:  # a binary classifier's rows: dict displays build 2-3x faster than dict(zip())
            first, second = labels
            if len(s) > 8:  # from columns, which cost a few us to slice and then pay
                return [{first: a, second: b} for a, b in zip(s[:, 0].tolist(), s[:, 1].tolist())]
            return [{first: a, second: b} for a, b in s.tolist()]
        return [dict(zip(labels, row)) for row in s.tolist()]

    return [HostOutput(x, finish, "a sequence of maps (ZipMap)")]
