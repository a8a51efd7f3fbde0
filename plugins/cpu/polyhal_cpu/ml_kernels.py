"""CPU kernels of the classical ML ops (:mod:`polyhal.ops.ml`).

``tree_ensemble`` walks all trees of all samples over the compact node arrays:

* **native** (numba importable, ``POLYHAL_CPU_NATIVE`` not ``0``): one compiled loop per sample
  and tree (:mod:`polyhal_cpu.tree_loops`), a branch per level, no temporaries. This is what
  onnxruntime's tree kernels do; a numpy walk pays a dozen array calls per level.
* **numpy** otherwise: the walk is vectorised over ``[samples, trees]`` -- ``depth`` steps, each
  a few gathers and compares over the whole batch at once (leaves point at themselves, so rows
  that arrive early stay put), then one gather of the leaf values and the op's epilogue
  (:func:`polyhal.ops.ml.tree_epilogue`).

The node arrays are the op's constant operands, so a plan binds them once. Their structure was
checked by the front end (rows in range, no cycles, ``depth`` the longest path), which the native
loop relies on to terminate.
"""

from __future__ import annotations

import os

import numpy as np

from polyhal.ops.ml import AGGREGATES, BINARY, POST_TRANSFORMS, coupling_row, tree_epilogue
from polyhal_cpu.parallel import parallel
from polyhal_cpu.table import TABLE, Kernel, Types

__all__ = ["tree_walk_numpy"]

_loop = None


def _native():
    """The compiled walk, or None (numba missing or disabled by ``POLYHAL_CPU_NATIVE=0``)."""
    global _loop
    if os.environ.get("POLYHAL_CPU_NATIVE", "1").strip() == "0":
        return None
    if _loop is None:
        try:
            from polyhal_cpu.tree_loops import tree_ensemble
        except ImportError:
            _loop = False
        else:
            _loop = tree_ensemble
    return _loop or None


def tree_walk_numpy(x: np.ndarray, nodes: np.ndarray, thresholds: np.ndarray, roots: np.ndarray,
                    depth: int) -> np.ndarray:
    """The leaf row each sample reaches in each tree, int64 ``[samples, trees]``, vectorised."""
    samples, features = x.shape
    feature, mode, true_next, false_next = (np.ascontiguousarray(nodes[:, c]) for c in range(4))
    flat = np.ascontiguousarray(x).reshape(-1)
    base = (np.arange(samples, dtype=np.int64) * features)[:, None]
    idx = np.broadcast_to(roots, (samples, len(roots))).copy()
    for _ in range(depth):
        m = mode[idx]
        v = flat[base + feature[idx]]
        th = thresholds[idx]
        with np.errstate(invalid="ignore"):
            go = ((m & 1).astype(bool) & (v < th)) | ((m & 2).astype(bool) & (v == th)) \
                | ((m & 4).astype(bool) & (v > th))
        nan = np.isnan(v)
        if nan.any():
            go = np.where(nan, (m & 8).astype(bool), go)
        idx = np.where(go, true_next[idx], false_next[idx])
    return idx


@TABLE.register("tree_ensemble")
@parallel(split_inputs=lambda attrs, ins: (True,) + (False,) * (len(ins) - 1),
          factor=lambda attrs, ins: 2.0 / max(ins[4].shape[0] * int(attrs["depth"]), 1), pieces_per_thread=4)
def _tree_ensemble(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    # Rows are independent: large batches run in pieces on the backend's threads (the walk
    # releases the GIL); a row costs trees x depth branches, so the split starts at a few
    # hundred rows for a GB model of 40 trees of depth 3.
    depth = int(attrs["depth"])
    aggregate, binary, transform = (str(attrs.get(k, d)) for k, d in
                                    (("aggregate", "sum"), ("binary", ""), ("post_transform", "none")))
    base = np.asarray(attrs.get("base", ()), np.float64)
    loop = _native()
    if loop is not None:
        params = np.array([AGGREGATES.index(aggregate), BINARY.index(binary), POST_TRANSFORMS.index(transform),
                           *base], np.float64)
        no_labels = np.zeros(0, np.int64)
        if len(ins) == 5:
            def kernel(x, nodes, thresholds, leaf_values, roots, out):
                loop(x, nodes, thresholds, leaf_values, roots, params, out, no_labels, no_labels)
            return kernel

        def kernel(x, nodes, thresholds, leaf_values, roots, labels, out, label_out):
            loop(x, nodes, thresholds, leaf_values, roots, params, out, labels, label_out)
        return kernel

    def kernel(x, nodes, thresholds, leaf_values, roots, *rest):
        leaves = tree_walk_numpy(x, nodes, thresholds, roots, depth)
        scores = tree_epilogue(leaf_values[leaves], outs[0].dtype, aggregate, base, binary, transform)
        np.copyto(rest[-len(outs)], scores)
        if len(outs) == 2:
            rest[-1][...] = rest[0][np.argmax(scores, axis=1)] if scores.shape[1] else 0
    return kernel


@TABLE.register("pairwise_coupling")
def _pairwise_coupling(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    # An iteration per row with a data-dependent stop: rows are independent and few classes
    # make each cheap, so a row loop over the shared iteration is what the kernel is.
    k = int(attrs["classes"])

    def kernel(r, out):
        for n in range(r.shape[0]):
            out[n] = coupling_row(r[n], k)
    return kernel
