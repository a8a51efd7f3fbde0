"""CPU kernels of the classical ML ops (:mod:`polyhal.ops.ml`).

``tree_ensemble`` walks all trees of all samples:

* **native** (numba importable, ``POLYHAL_CPU_NATIVE`` not ``0``): compiled loops
  (:mod:`polyhal_cpu.tree_loops`). Ensembles of depth <= 6 whose nodes all compare ``x`` against
  a threshold by order (every ONNX mode but BRANCH_EQ/BRANCH_NEQ) are relaid once as complete
  trees (:func:`complete_trees`) and run by :func:`~polyhal_cpu.tree_loops.compare_all`, which
  compares all of a tree's nodes for a block of rows with vector instructions and no branches
  (gradient boosting's depth-3 trees: ~4x faster than a walk); deeper ones are relaid with each
  branch's children side by side (:func:`paired_trees`) and walked without branches by
  :func:`~polyhal_cpu.tree_loops.walk_pairs`, a block of rows a tree at a time (a random
  forest of depth 8: ~2.7x faster than a walk with a branch per level); the rest (BRANCH_EQ,
  BRANCH_NEQ) take the walk over the compact arrays, a branch per level.
* **numpy** otherwise: the walk is vectorised over ``[samples, trees]`` -- ``depth`` steps, each
  a few gathers and compares over the whole batch at once (leaves point at themselves, so rows
  that arrive early stay put), then one gather of the leaf values and the op's epilogue
  (:func:`polyhal.ops.ml.tree_epilogue`).

The node arrays are the op's constant operands, so a plan binds them once (read-only: the
complete trees made from them are kept while the kernel is given the same arrays). Their
structure was checked by the front end (rows in range, no cycles, ``depth`` the longest path),
which the walk relies on to terminate.
"""

from __future__ import annotations


import numpy as np

from polyhal.hal.scratch import MemorySpace, ScratchDecl
from polyhal.ops.ml import AGGREGATES, BINARY, POST_TRANSFORMS, coupling_row, tree_epilogue
from polyhal_cpu.parallel import MIN_ELEMENTS, parallel
from polyhal_cpu.scratch import array as scratch_array
from polyhal_cpu.table import TABLE, Kernel, Types, compiled_loops, frozen

__all__ = ["complete_trees", "paired_trees", "tree_walk_numpy"]

#: The deepest ensemble that runs as complete trees: a tree's nodes are the bits of an int64
#: (2**6 - 1 = 63), and compares double with every level where a walk's grow by one (at depth
#: 5, 100 random trees: 6 ns a tree and row against the walk's 48).
COMPARE_ALL_DEPTH = 6
#: Kernel time (ns) from which a batch is split across threads: a hand-off costs ~30-80 us, more
#: on a loaded machine, so a split pays for itself only well above that.
SPLIT_NS = 500_000


def _threshold_rules(nodes: np.ndarray, thresholds: np.ndarray) -> tuple | None:
    """Every node as "left when ``x <= a``": ``(branch, feature, a, left, right)`` per compact
    node, ``feature`` negative (~f) where a nan goes right -- or None where a node's rule is not of
    that form (BRANCH_EQ and BRANCH_NEQ).

    Every other rule sends to one child exactly the values up to some float ``a``: BRANCH_LEQ
    t (a = t), BRANCH_LT t (a = the float below t), and BRANCH_GT/BRANCH_GTE with the children
    swapped; a rule no value meets (a nan threshold, BRANCH_LT -inf) or every value meets
    (BRANCH_GTE -inf) is "left when x <= inf" with the children in the order that gives it.
    Comparing in x's type against ``a`` of x's type is exact, so the routing is the same for
    every x. A nan x goes where ``nodes_missing_value_tracks_true`` says: the sign of
    ``feature``."""
    feature, mode, true_next, false_next = (nodes[:, c] for c in range(4))
    rule, t = mode & 7, thresholds
    branch = mode != 0
    if np.any(branch & ((rule == 2) | (rule == 5)) & ~np.isnan(t)):
        return None
    inf = np.array(np.inf, t.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        below = np.nextafter(t, -inf)  # x < t  <=>  x <= below (t > -inf)
    strict = (rule == 1) | (rule == 6)  # LT, GTE
    # the set of x that goes to true_next: (-inf, a] (keep), its complement (swap), none or all
    none = np.isnan(t) | (rule == 0) | ((rule == 1) & (t == -inf))
    every = (rule == 7) | ((rule == 6) & (t == -inf))
    swap = none | (~every & ((rule == 4) | (rule == 6)))
    a = np.where(none | every, inf, np.where(strict, below, t))
    nan_right = ((mode & 8) != 0) == swap  # nan goes to true_next iff bit 8; left is true_next iff not swap
    return (branch, np.where(nan_right, ~feature, feature), a, np.where(swap, false_next, true_next),
            np.where(swap, true_next, false_next))


def complete_trees(nodes: np.ndarray, thresholds: np.ndarray, leaf_values: np.ndarray, roots: np.ndarray,
                   depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The ensemble as complete trees of depth ``depth`` in heap order, each node sending a
    row left (to 2i + 1) when ``x <= threshold`` (:func:`_threshold_rules`) -- ``(feature,
    threshold, leaves)`` as :func:`polyhal_cpu.tree_loops.compare_all` takes them -- or None
    where a node's rule is not of that form (BRANCH_EQ and BRANCH_NEQ) or a tree is deeper than
    ``depth``. A leaf above the last level becomes a branch whose subtrees are all that leaf."""
    rules = _threshold_rules(nodes, thresholds)
    if rules is None:
        return None
    branch, signed, a, left_of, right_of = rules
    inf = np.array(np.inf, thresholds.dtype)
    trees, inner = len(roots), 2 ** depth - 1
    itype = np.int32 if depth <= 5 else np.int64  # the loop's bit masks: one bit a node
    feat = np.zeros((trees, inner), itype)
    thr = np.full((trees, inner), inf, thresholds.dtype)
    at = roots.reshape(trees, 1)  # compact rows of the nodes at each heap position of a level
    for level in range(depth):
        lo, width = 2 ** level - 1, 2 ** level
        b = branch[at]
        feat[:, lo:lo + width] = np.where(b, signed[at], 0).astype(itype)
        thr[:, lo:lo + width] = np.where(b, a[at], inf)  # a leaf: both subtrees are it
        left = np.where(b, left_of[at], at)
        right = np.where(b, right_of[at], at)
        at = np.stack([left, right], axis=-1).reshape(trees, -1)
    if np.any(branch[at]):
        return None
    return feat, thr, np.ascontiguousarray(leaf_values[at.reshape(-1)])


def paired_trees(nodes: np.ndarray, thresholds: np.ndarray, leaf_values: np.ndarray, roots: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """The ensemble with each branch's children side by side, every node sending a row left when
    ``x <= threshold`` (:func:`_threshold_rules`) -- ``(links, threshold, leaves, trees)`` as
    :func:`polyhal_cpu.tree_loops.walk_pairs` takes them -- or None where a node's rule is not of
    that form (BRANCH_EQ and BRANCH_NEQ) or the trees, with the subtrees they share copied, would
    outgrow the compact arrays.

    ``links`` int32 ``[P, 2]``: a branch's feature (negative: ~f, a nan goes right) and the
    position of its left child (the right one is next to it); a leaf reads feature 0 against an
    infinite threshold and links to itself, so a walk of a fixed number of levels stays there.
    ``leaves`` float64 ``[P, n_targets]``: the leaf values by position; ``trees`` int32 ``[T, 2]``:
    each tree's root position and depth. Positions are laid out a level at a time over all
    trees, breadth first."""
    rules = _threshold_rules(nodes, thresholds)
    if rules is None:
        return None
    branch, signed, a, left_of, right_of = rules
    count = len(roots)
    room = len(nodes) + count  # each node once (its tree's root, or one of a branch's pair)
    links = np.zeros((room, 2), np.int32)
    thr = np.full(room, np.inf, thresholds.dtype)
    compact = np.empty(room, np.int64)
    depths = np.zeros(count, np.int32)
    at, where, tree = roots.astype(np.int64), np.arange(count), np.arange(count)
    used, level = count, 0
    while len(at):
        compact[where] = at
        b = branch[at]
        links[where[~b], 1] = where[~b]
        at, where, tree = at[b], where[b], tree[b]
        if used + 2 * len(at) > room:
            return None
        links[where, 0] = signed[at]
        links[where, 1] = used + 2 * np.arange(len(at))
        thr[where] = a[at]
        level += 1
        depths[tree] = level  # the trees with a branch at this level
        at = np.stack([left_of[at], right_of[at]], axis=1).reshape(-1)
        where, tree = used + np.arange(len(at)), np.repeat(tree, 2)
        used += len(at)
    trees = np.stack([np.arange(count), depths], axis=1).astype(np.int32)
    return links[:used].copy(), thr[:used].copy(), np.ascontiguousarray(leaf_values[compact[:used]]), trees


def _relay(kept: list, depth: int, loops, nodes, thresholds, leaf_values, roots) -> tuple:
    """``(nodes, thresholds, leaf_values, roots, loop, operands)`` for a kernel's call: the loop
    of :mod:`polyhal_cpu.tree_loops` that runs the ensemble and its node operands (complete
    trees to depth :data:`COMPARE_ALL_DEPTH`, paired trees deeper, the compact arrays where
    neither layout takes the rules), kept in ``kept[0]`` where the arrays are read-only (a
    plan's constants: relaid at the first call, then found by identity); arrays that may change
    are relaid per call. One tuple in one list item, so that a kernel called from two threads
    never pairs one call's arrays with another's layout."""
    if depth <= COMPARE_ALL_DEPTH:
        loop, layout = loops.compare_all, complete_trees(nodes, thresholds, leaf_values, roots, depth)
    else:
        loop, layout = loops.walk_pairs, paired_trees(nodes, thresholds, leaf_values, roots)
    if layout is None:
        loop, layout = loops.tree_ensemble, (nodes, thresholds, leaf_values, roots)
    entry = (nodes, thresholds, leaf_values, roots, loop, layout)
    if all(frozen(a) for a in entry[:4]):
        kept[0] = entry
    return entry


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


def _split_factor(attrs: dict, ins: Types) -> float:
    """The :func:`~polyhal_cpu.parallel.parallel` factor: output elements (over MIN_ELEMENTS)
    from which the kernel takes :data:`SPLIT_NS`. A row costs a tree ~0.25 ns per compare in
    :func:`~polyhal_cpu.tree_loops.compare_all` (2**depth - 1 compares and depth steps), ~2.5 ns
    per level in :func:`~polyhal_cpu.tree_loops.walk_pairs` (measured on 2-core VMs): a GB model
    of 40 trees of depth 3 splits from ~4,500 rows, a forest of 50 trees of depth 8 from 500."""
    trees, depth = ins[4].shape[0], int(attrs["depth"])
    row_ns = trees * ((2 ** depth + depth) * 0.25 if depth <= COMPARE_ALL_DEPTH else 2.5 * depth)
    columns = 2 if attrs.get("binary") else ins[3].shape[1]
    return SPLIT_NS / max(row_ns, 1.0) * columns / MIN_ELEMENTS


@TABLE.register("tree_ensemble")
@parallel(split_inputs=lambda attrs, ins: (True,) + (False,) * (len(ins) - 1), factor=_split_factor,
          pieces_per_thread=4)
def _tree_ensemble(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    # Rows are independent: large batches run in pieces on the backend's threads (the loops
    # release the GIL).
    depth = int(attrs["depth"])
    aggregate, binary, transform = (str(attrs.get(k, d)) for k, d in
                                    (("aggregate", "sum"), ("binary", ""), ("post_transform", "none")))
    base = np.asarray(attrs.get("base", ()), np.float64)
    loops = compiled_loops("tree_loops")
    if loops is not None:
        params = np.array([AGGREGATES.index(aggregate), BINARY.index(binary), POST_TRANSFORMS.index(transform),
                           *base], np.float64)
        kept = [(None,) * 6]
        no_labels = np.zeros(0, np.int64)

        # A batch of one costs ~1.5 us in the loop: this wrapper stays a few attribute reads.
        def kernel(x, nodes, thresholds, leaf_values, roots, a, b=None, c=None):
            out, labels, label_out = (a, no_labels, no_labels) if b is None else (b, a, c)
            k = kept[0]
            if k[0] is not nodes or k[1] is not thresholds or k[2] is not leaf_values or k[3] is not roots:
                k = _relay(kept, depth, loops, nodes, thresholds, leaf_values, roots)
            k[4](x, *k[5], params, out, labels, label_out)
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
    # make each cheap, so a row loop over the shared iteration is what the kernel is --
    # compiled (polyhal_cpu.coupling_loops) where numba is, else numpy's per row.
    k = int(attrs["classes"])
    loops = compiled_loops("coupling_loops")
    if loops is not None:
        couple = loops.pairwise_coupling

        def kernel(r, out):
            dst = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)  # (a strided view)
            couple(np.ascontiguousarray(r), dst)
            if dst is not out:
                np.copyto(out, dst)
        return kernel

    def kernel(r, out):
        for n in range(r.shape[0]):
            out[n] = coupling_row(r[n], k)
    return kernel


#: Elements a piece of rows works on at once (kept in cache).
_DISTANCE_PIECE = 1 << 16
#: Widths up to which the distances are summed feature by feature over [rows, V] planes: numpy
#: sums a short last axis slowly (an SVC's 100 x 596 vectors of 10 features: 376 us by feature,
#: 686 us by einsum over [rows, V, F], ~1 ms as sub, mul and reduce_sum); wider, einsum wins
#: (5 x 50 x 784: 109 us against 1.4 ms).
_BY_FEATURE = 32


def _distance_plan(ins: Types) -> tuple[int, tuple[int, ...]]:
    """(rows a piece, the piece's scratch shape)."""
    (n, f), (v, _) = ins[0].shape, ins[1].shape
    width = v if f <= _BY_FEATURE else v * f
    rows = max(1, min(n, _DISTANCE_PIECE // max(1, width)))
    return rows, ((rows, v) if f <= _BY_FEATURE else (rows, v, f))


def _distance_bytes(problem, _workgroup_size: int) -> int:
    _, shape = _distance_plan(problem.in_types)
    return max(1, int(np.prod(shape))) * problem.in_types[0].dtype.itemsize


@TABLE.register("squared_distances", scratch=[
    ScratchDecl("differences", shared=True, per_launch=_distance_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="a piece of rows' differences from every vector")])
def _squared_distances(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """An SVM's RBF distances from the differences, by pieces of rows that stay in cache (no
    [N, V, F] intermediate in memory): feature by feature for narrow rows, else one einsum."""
    (n, f), (v, _) = ins[0].shape, ins[1].shape
    rows, shape = _distance_plan(ins)
    work = scratch_array(scratch, "differences", ins[0].dtype, shape)
    subtract, multiply, add, einsum = np.subtract, np.multiply, np.add, np.einsum

    if f <= _BY_FEATURE:
        kept: list = [None, None]  # a read-only y (the support vectors) and its columns as rows

        def by_feature(x, y, out):
            if kept[0] is not y:
                columns = np.ascontiguousarray(y.T)
                kept[:] = (y, columns) if frozen(y) else (None, None)
            else:
                columns = kept[1]
            for lo in range(0, n, rows):
                hi = min(n, lo + rows)
                o, t = out[lo:hi], work[:hi - lo]
                if f == 0:
                    o[...] = 0
                    continue
                subtract(x[lo:hi, 0:1], columns[0], out=o)
                multiply(o, o, out=o)
                for k in range(1, f):
                    subtract(x[lo:hi, k:k + 1], columns[k], out=t)
                    multiply(t, t, out=t)
                    add(o, t, out=o)
        return by_feature

    def by_piece(x, y, out):
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            d = work[:hi - lo]
            subtract(x[lo:hi, None, :], y[None, :, :], out=d)
            einsum("nvf,nvf->nv", d, d, out=out[lo:hi])
    return by_piece
