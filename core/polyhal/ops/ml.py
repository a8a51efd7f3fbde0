"""Classical machine-learning ops: ``tree_ensemble`` (what ONNX's ai.onnx.ml tree ensembles
compute), as a compact array walk.

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

**Semantics.** ``out[n, j] = sum over trees t of leaf_values[leaf(t, x[n]), j]`` in float64,
rounded once to ``x``'s element type (float32 or float64: ONNX's opset-5 TreeEnsemble outputs
``X``'s type; the older TreeEnsembleRegressor/Classifier output float, a cast after this op). ``depth`` bounds the walk:
every root-to-leaf path has at most ``depth`` branches (a front end computes it when it builds
the arrays, and refuses cycles). Base values, averaging and post transforms are other ops.
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import DTypeError, ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import define, int_attr

__all__ = ["LEAF", "MISSING_TRUE", "MODE_BITS", "tree_walk_reference"]

_F32, _F64, _I64 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64)

#: ``mode`` of a leaf, and the bit that sends a nan feature to ``true_next``.
LEAF, MISSING_TRUE = 0, 8
#: ONNX's branch rules as ``mode`` bits (1: x < t, 2: x == t, 4: x > t go to true_next).
MODE_BITS = {"BRANCH_LEQ": 3, "BRANCH_LT": 1, "BRANCH_GTE": 6, "BRANCH_GT": 4, "BRANCH_EQ": 2, "BRANCH_NEQ": 5}


def _infer(x: TensorType, nodes: TensorType, thresholds: TensorType, leaf_values: TensorType, roots: TensorType,
           *, depth):
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
    return (TensorType((x.shape[0], leaf_values.shape[1]), x.dtype),)


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


def _reference(x, nodes, thresholds, leaf_values, roots, *, depth):
    leaves = tree_walk_reference(x, nodes, thresholds, roots, depth)
    return (np.asarray(leaf_values)[leaves].sum(axis=1).astype(np.asarray(x).dtype),)


def random_ensemble(rng: np.random.Generator, features: int, trees: int, depth: int, targets: int,
                    dtype=_F32) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A random complete ensemble in the compact form: ``(nodes, thresholds, leaf_values, roots)``,
    every mode and the missing bit exercised (no zeros: leaf values of branches are never read)."""
    modes = list(MODE_BITS.values())
    nodes, thresholds, values, roots = [], [], [], []

    def grow(level: int) -> int:
        row = len(nodes)
        nodes.append(None)
        # Thresholds that samples hit exactly (ties exercise the == bit); a branch's values are
        # never read, and are nonzero as conformance samples must be.
        thresholds.append(float(rng.choice([0.5, -0.5, 1.5, rng.standard_normal()])))
        values.append(rng.uniform(0.5, 2.0, targets))
        if level == depth:
            nodes[row] = (0, LEAF, row, row)
            values[row] = rng.standard_normal(targets)
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
    nodes, thresholds, leaf_values, roots = random_ensemble(rng, 5, 4, 3, 2)
    return [x, nodes, thresholds, leaf_values, roots], {"depth": 3}


define("tree_ensemble", infer=_infer, reference=_reference, sample=_sample, arity=5, tolerance=(1e-5, 1e-5),
       doc="""Sum over trees of the leaf values each sample reaches (ONNX ai.onnx.ml tree ensembles,
       compact form: see polyhal.ops.ml).""")
