"""Classical machine-learning ops: ``tree_ensemble`` (what ONNX's ai.onnx.ml tree ensembles
compute), as a compact array walk, and ``pairwise_coupling`` (an SVM's class probabilities from
its pairwise ones).

**The compact form.** Every tree's nodes sit in one set of flat arrays (one row per node, all
trees together), so a kernel walks all trees of all samples with the same few loads, and no
Python object per tree exists:

* ``nodes`` int64 ``[K, 4]``: per node ``(feature, mode, true_next, false_next)``. ``next`` are
  row indices into these arrays (not per-tree node ids). ``mode`` is a bit set: the branch goes
  to ``true_next`` when ``x < t`` and bit 1 is set, or ``x == t`` and bit 2, or ``x > t`` and
  bit 4 (ONNX's BRANCH_LEQ is 1|2, BRANCH_LT 1, BRANCH_GTE 2|4, BRANCH_GT 4, BRANCH_EQ 2,
  BRANCH_NEQ 1|4); a nan feature goes to ``true_next`` when bit 8 is set
  (``nodes_missing_value_tracks_true``). ``mode`` 0 is a leaf.
* ``thresholds`` ``[K]``, in ``x``'s element type (float32 models compare in float32, as
  onnxruntime does).
* ``leaf_values`` float64 ``[K, n_targets]``: what reaching node k adds to each target (the
  sum of ONNX's ``target_weights``/``class_weights`` entries for that node; zero for branches).
* ``roots`` int64 ``[T]``: the root row of each tree.

**Semantics.** ``s[n, j] = base[j] + sum over trees t of leaf_values[leaf(t, x[n]), j]``
in float64 (``aggregate="min"``/``"max"``: the smallest/largest of those leaf values instead of
their sum, a nan entry meaning "this leaf gives target j nothing", 0 where no tree gives one, as
onnxruntime does), then the epilogue a classifier needs, all before one rounding to ``x``'s
element type (float32 or float64: ONNX's opset-5 TreeEnsemble outputs ``X``'s type; the older
TreeEnsembleRegressor/Classifier output float, a cast after this op):

* ``binary``: one target made two columns, ``"probability"`` ``[1 - s, s]`` or ``"margin"``
  ``[-s, s]`` (a binary classifier that scores the second class only);
* ``post_transform``: ``"none"``, ``"logistic"``, ``"softmax"`` or ``"softmax_zero"`` (softmax
  over a row's nonzero entries; zeros stay zero), as ONNX defines them.

With a sixth operand ``labels`` (int64 ``[C]``, one per output column) the op has a second
result, int64 ``[samples]``: the label of each row's largest output (the first on ties, after
rounding), which is what a classifier's label output is. Having the epilogue in the op keeps a
scikit-learn classifier one dispatch. ``depth`` bounds the walk: every root-to-leaf path has at
most ``depth`` branches (a front end computes it when it builds the arrays, and refuses cycles).
"""

from __future__ import annotations

import warnings

import numpy as np

from polyhal.errors import DTypeError, ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import define, int_attr

__all__ = ["AGGREGATES", "BINARY", "LEAF", "MISSING_TRUE", "MODE_BITS", "POST_TRANSFORMS", "coupling_row", "tree_epilogue",
           "tree_walk_reference"]

_F32, _F64, _I64 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)

#: ``mode`` of a leaf, and the bit that sends a nan feature to ``true_next``.
LEAF, MISSING_TRUE = 0, 8
#: ONNX's branch rules as ``mode`` bits (1: x < t, 2: x == t, 4: x > t go to true_next).
MODE_BITS = {"BRANCH_LEQ": 3, "BRANCH_LT": 1, "BRANCH_GTE": 6, "BRANCH_GT": 4, "BRANCH_EQ": 2, "BRANCH_NEQ": 5}
#: The attribute values, in the order of the codes a kernel may use for them (their index).
AGGREGATES = ("sum", "min", "max")
BINARY = ("", "probability", "margin")
POST_TRANSFORMS = ("none", "logistic", "softmax", "softmax_zero")


def _infer(x: TensorType, nodes: TensorType, thresholds: TensorType, leaf_values: TensorType, roots: TensorType,
           labels: TensorType | None = None, *, depth, aggregate, base, binary, post_transform):
    if x.dtype not in (_F32, _F64):
        raise DTypeError(f"x has element type {x.dtype}, expected float32 or float64; insert a 'cast'")
    if x.rank != 2:
        raise ShapeError(f"x must be [samples, features], got shape {x.shape}")
    if nodes.dtype != _I64 or nodes.rank != 2 or nodes.shape[1] != 4:
        raise ShapeError(f"nodes must be int64 [K, 4] (feature, mode, true_next, false_next), got {nodes}")
    k = nodes.shape[0]
    if thresholds.dtype != x.dtype or thresholds.shape != (k,):
        raise ShapeError(f"thresholds must be {x.dtype} [{k}] (one per node, in x's type), got {thresholds}")
    if leaf_values.dtype != _F64 or leaf_values.rank != 2 or leaf_values.shape[0] != k:
        raise ShapeError(f"leaf_values must be float64 [{k}, n_targets], got {leaf_values}")
    if roots.dtype != _I64 or roots.rank != 1:
        raise ShapeError(f"roots must be int64 [trees], got {roots}")
    if int_attr(depth, "depth") < 0:
        raise ProgramError(f"depth must be >= 0, got {depth}")
    for name, value, allowed in (("aggregate", aggregate, AGGREGATES), ("binary", binary, BINARY),
                                 ("post_transform", post_transform, POST_TRANSFORMS)):
        if value not in allowed:
            raise ProgramError(f"{name} is {value!r}; expected one of {', '.join(map(repr, allowed))}")
    targets = leaf_values.shape[1]
    if binary and targets != 1:
        raise ShapeError(f"binary={binary!r} makes one target two columns, but leaf_values has {targets} targets")
    if len(base) not in (0, targets):
        raise ShapeError(f"base has {len(base)} values; give one per target ({targets}) or none")
    columns = 2 if binary else targets
    scores = TensorType((x.shape[0], columns), x.dtype)
    if labels is None:
        return (scores,)
    if labels.dtype != _I64 or labels.shape != (columns,):
        raise ShapeError(f"labels must be int64 [{columns}] (one per output column), got {labels}")
    return scores, TensorType((x.shape[0],), _I64)


def tree_walk_reference(x, nodes, thresholds, roots, depth):
    """The leaf row reached in each tree by each sample: int64 ``[samples, trees]`` (a plain
    loop, the oracle of the kernels)."""
    x = np.asarray(x)
    leaves = np.empty((x.shape[0], len(roots)), np.int64)
    for n in range(x.shape[0]):
        for t, i in enumerate(roots):
            for _ in range(depth + 1):
                feature, mode, true_next, false_next = (int(v) for v in nodes[i])
                if mode == LEAF:
                    break
                v, th = x[n, feature], thresholds[i]
                if np.isnan(v):
                    go = bool(mode & MISSING_TRUE)
                else:
                    go = bool((mode & 1 and v < th) or (mode & 2 and v == th) or (mode & 4 and v > th))
                i = true_next if go else false_next
            else:
                raise ProgramError(f"tree {t} is deeper than depth={depth}")
            leaves[n, t] = i
    return leaves


def tree_epilogue(reached: np.ndarray, dtype, aggregate: str = "sum", base=(), binary: str = "",
                  post_transform: str = "none") -> np.ndarray:
    """The op's output from the leaf values each sample reached, float64 ``[samples, trees,
    targets]``: aggregate, base, binary columns and post transform, rounded once to ``dtype``."""
    if aggregate == "sum":
        s = reached.sum(axis=1)
    else:
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-nan: no tree gave the target a value
            s = (np.nanmin if aggregate == "min" else np.nanmax)(reached, axis=1)
        s = np.nan_to_num(s, nan=0.0, posinf=np.inf, neginf=-np.inf)
    if len(base):
        s = s + np.asarray(base, np.float64)
    if binary:
        s = np.concatenate([1.0 - s if binary == "probability" else -s, s], axis=1)
    if post_transform == "logistic":
        with np.errstate(over="ignore"):
            s = 1.0 / (1.0 + np.exp(-s))
    elif post_transform in ("softmax", "softmax_zero"):
        keep = s != 0 if post_transform == "softmax_zero" else np.ones(s.shape, bool)
        m = np.max(np.where(keep, s, -np.inf), axis=1, keepdims=True)
        e = np.where(keep, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
        total = e.sum(axis=1, keepdims=True)
        s = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return s.astype(dtype)


def _reference(x, nodes, thresholds, leaf_values, roots, labels=None, *, depth, aggregate="sum", base=(),
               binary="", post_transform="none"):
    leaves = tree_walk_reference(x, nodes, thresholds, roots, depth)
    out = tree_epilogue(np.asarray(leaf_values)[leaves], np.asarray(x).dtype, aggregate, base, binary,
                        post_transform)
    if labels is None:
        return (out,)
    return out, np.asarray(labels)[np.argmax(out, axis=1)] if out.shape[1] else np.zeros(len(out), np.int64)


def random_ensemble(rng: np.random.Generator, features: int, trees: int, depth: int, targets: int,
                    dtype=_F32, *, modes=None, thresholds_from=None, unbalanced: bool = False
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A random ensemble in the compact form: ``(nodes, thresholds, leaf_values, roots)``, every
    mode of ``modes`` (default: all of ONNX's) with and without the missing bit.

    By default the trees are complete and thresholds are values samples hit exactly (ties
    exercise the == bit) or normal draws; leaf values of branches are never read and nonzero, as
    conformance samples must be. ``unbalanced``: leaves at every level (the root included) and
    a fifth of the leaf values nan ("no value" to min/max aggregates); ``thresholds_from``: the
    values thresholds are drawn from (four in five; normal draws otherwise)."""
    modes = list(MODE_BITS.values()) if modes is None else modes
    nodes, thresholds, values, roots = [], [], [], []

    def grow(level: int) -> int:
        row = len(nodes)
        nodes.append(None)
        if thresholds_from is None:
            thresholds.append(float(rng.choice([0.5, -0.5, 1.5, rng.standard_normal()])))
            values.append(rng.uniform(0.5, 2.0, targets))
        else:
            thresholds.append(float(rng.choice(thresholds_from)) if rng.random() < 0.8
                              else float(rng.standard_normal()))
            values.append(np.zeros(targets))
        if level == depth or (unbalanced and rng.random() < (0.3 if level else 0.1)):
            nodes[row] = (0, LEAF, row, row)
            values[row] = (np.where(rng.random(targets) < 0.2, np.nan, rng.standard_normal(targets)) if unbalanced
                           else rng.standard_normal(targets))
            return row
        mode = int(rng.choice(modes)) | (MISSING_TRUE if rng.random() < 0.5 else 0)
        t, f = grow(level + 1), grow(level + 1)
        nodes[row] = (int(rng.integers(features)), mode, t, f)
        return row

    for _ in range(trees):
        roots.append(grow(0))
    return (np.array(nodes, np.int64), np.array(thresholds, dtype), np.array(values, np.float64),
            np.array(roots, np.int64))


def _sample(rng: np.random.Generator):
    x = rng.choice(np.array([-0.5, 0.5, np.nan, 1.5, -2.0], np.float32), size=(7, 5))
    binary = str(rng.choice(BINARY))
    nodes, thresholds, leaf_values, roots = random_ensemble(rng, 5, 4, 3, 1 if binary else 2)
    attrs = {"depth": 3, "aggregate": str(rng.choice(AGGREGATES)), "binary": binary,
             "post_transform": str(rng.choice(POST_TRANSFORMS)), "base": (0.25,) if binary else (0.25, -0.5)}
    operands = [x, nodes, thresholds, leaf_values, roots]
    if rng.random() < 0.5:
        operands.append(np.array([3, 7], np.int64))
    return operands, attrs


define("tree_ensemble", infer=_infer, reference=_reference, sample=_sample, arity=(5, 6), tolerance=(1e-5, 1e-5),
       doc="""Sum over trees of the leaf values each sample reaches (ONNX ai.onnx.ml tree ensembles,
       compact form: see polyhal.ops.ml).""")


# ------------------------------------------------------------------------- pairwise coupling

def _infer_coupling(r: TensorType, *, classes):
    k = int_attr(classes, "classes")
    if r.dtype not in (_F32, _F64):
        raise DTypeError(f"r has element type {r.dtype}, expected float32 or float64; insert a 'cast'")
    if r.rank != 2:
        raise ShapeError(f"r must be [samples, pairs], got shape {r.shape}")
    if k < 2 or r.shape[1] != k * (k - 1) // 2:
        raise ShapeError(f"r has {r.shape[1]} columns; {k} classes make {k * (k - 1) // 2} pairs (classes >= 2)")
    return (TensorType((r.shape[0], k), r.dtype),)


def coupling_row(pairs: np.ndarray, k: int) -> np.ndarray:
    """Class probabilities from one row of pairwise ones (``pairs[p]``: P(class i | i or j)
    for the pairs i < j in order), by Wu, Lin and Weng's method 2 as libsvm (and onnxruntime)
    iterate it: at most max(100, k) sweeps, stopping at error 0.005 / k."""
    r = np.zeros((k, k), pairs.dtype)
    rows, cols = np.triu_indices(k, 1)
    r[rows, cols] = pairs
    r[cols, rows] = 1 - pairs
    q = np.empty((k, k), pairs.dtype)
    for t in range(k):
        q[t, t] = (r[:t, t] ** 2).sum() + (r[t + 1:, t] ** 2).sum()
        q[t, :t] = q[:t, t]
        q[t, t + 1:] = -r[t + 1:, t] * r[t, t + 1:]
    p = np.full(k, 1.0 / k, pairs.dtype)
    for _ in range(max(100, k)):
        qp = q @ p
        pqp = (p * qp).sum()
        if np.abs(qp - pqp).max() < 0.005 / k:
            break
        for t in range(k):
            diff = (-qp[t] + pqp) / q[t, t]
            p[t] += diff
            pqp = (pqp + diff * (diff * q[t, t] + 2 * qp[t])) / (1 + diff) ** 2
            p /= 1 + diff
            qp = (qp + diff * q[t]) / (1 + diff)
    return p


def _coupling_reference(r, *, classes):
    r = np.asarray(r)
    return (np.array([coupling_row(row, int(classes)) for row in r], r.dtype).reshape(len(r), int(classes)),)


def _coupling_sample(rng: np.random.Generator):
    return [rng.uniform(0.05, 0.95, (5, 6)).astype(np.float32)], {"classes": 4}


define("pairwise_coupling", infer=_infer_coupling, reference=_coupling_reference, sample=_coupling_sample, arity=1,
       tolerance=(1e-5, 1e-6),
       doc="""Class probabilities [samples, classes] from pairwise ones [samples, classes*(classes-1)/2]
       (libsvm's multiclass probability: what ONNX's SVMClassifier computes from prob_a/prob_b).""")


# ------------------------------------------------------------------------- squared_distances

def _infer_squared_distances(x: TensorType, y: TensorType):
    if x.rank != 2 or y.rank != 2 or x.shape[1] != y.shape[1]:
        raise ShapeError(f"x [N, F] and y [V, F] must be matrices of the same width, got {x.shape} and {y.shape}")
    if x.dtype != y.dtype or x.dtype.kind != "f":
        raise DTypeError(f"x and y must have one float element type, got {x.dtype} and {y.dtype}")
    return (TensorType((x.shape[0], y.shape[0]), x.dtype),)


def _squared_distances_reference(x, y):
    d = np.asarray(x, _F64)[:, None, :] - np.asarray(y, _F64)[None, :, :]
    return ((d * d).sum(axis=2).astype(np.asarray(x).dtype),)


def _squared_distances_sample(rng: np.random.Generator):
    n, v, f = (int(a) for a in rng.integers(1, 12, 3))
    return [rng.standard_normal((n, f)).astype(np.float32), rng.standard_normal((v, f)).astype(np.float32)], {}


define("squared_distances", infer=_infer_squared_distances, reference=_squared_distances_reference,
       sample=_squared_distances_sample, arity=2, tolerance=(1e-5, 1e-5),
       doc="""The squared Euclidean distance between every row of x [N, F] and every row of y [V, F]:
       [N, V], summed from the differences (not from expanded norms, which cancel where rows are
       close), as onnxruntime computes an SVM's RBF kernel. One op so that a device sums each
       difference where it is made; devices without its kernel get ``sub``, ``mul`` and
       ``reduce_sum`` over an [N, V, F] intermediate (:mod:`polyhal.passes.decompose`).""")
