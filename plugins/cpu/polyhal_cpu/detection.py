"""non_max_suppression on the CPU: a vectorised greedy NMS, exact to onnxruntime's selection.

onnxruntime visits boxes by decreasing score and compares each with every box selected so far
(O(boxes x selected) IoUs, with an early exit). Doing that one box at a time in numpy would be a
Python loop per box. Instead, per batch and class:

1. **Candidates**: score > score_threshold (nan never), in decreasing score, ties by index.
2. **Blocks**: the candidates are taken in rank-ordered blocks (64 boxes, doubling up to 1024,
   so that dense problems, where a few boxes suppress everything, stop early). For a block:

   * *cross*: the IoU pairs between the block and the boxes already selected are found through
     a spatial index (below) and any block box they suppress is dropped;
   * *self*: the greedy order inside the block is resolved: among the survivors, the pairs
     (earlier, later) that suppress are found the same way, and the greedy rule ``keep[j] = not
     any(keep[i] for earlier i suppressing j)`` is iterated to its fixed point. The rule makes
     ``keep[j]`` depend only on earlier boxes, so its fixed point is unique and is the greedy
     answer; iteration from "all kept" converges in as many rounds as the longest suppression
     chain (a few);
   * the selected boxes join the index; at ``max_output_boxes_per_class`` the class stops.

**Spatial index, and why it is exact.** IoU > t >= 0 needs an x overlap greater than
``t * max(w_i, w_j)`` (the intersection is at most the smaller height times the overlap, the
union at least the larger area), so for the box further left ``x1_j - x1_i < (1 - t) w_i``; the
same holds for y, and the two sides cannot differ by more than a factor 1/t. A box's *window*
is ``(1 - t) * side`` plus a margin far above float32 rounding. Selected boxes are indexed by
(size level, y strip, rank of x1): a level holds boxes whose larger side is within a factor 2,
its strips are as high as its largest y window, so a query only looks at the levels its size
allows and at the few strips and the x range its window and the level's largest window reach.
Every pair the index returns is then checked with both windows, and the survivors with the
exact float32 IoU of :func:`polyhal.ops.detection.iou_suppresses` -- onnxruntime's arithmetic,
so the selected indices are identical. A box with a non-positive area (or a nan) overlaps
nothing (as in onnxruntime) and is never indexed.

**Scratch.** The kernel declares its per-box arrays (corners, windows, orders, ranks) as one
global scratch, sized from the problem; the bufferize pass places it and the plan allocates it
once, so a run allocates none of them. numpy still allocates the temporaries of the pair
computations, whose sizes depend on the data.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyhal.hal.scratch import MemorySpace, Problem, ScratchDecl
from polyhal.ops.detection import iou_suppresses
from polyhal_cpu.table import TABLE

__all__ = ["build_nms", "nms_class"]

_F32 = np.float32
#: Size levels of the index: larger sides in (top / 2^(l+1), top / 2^l]; the last takes the rest.
LEVELS = 8
#: Strips per level at most (bounds the key space: level, strip, x rank).
STRIPS = 4096
#: First block size and largest block size.
BLOCK0, BLOCK = 64, 1024
#: Pair counts up to which a block is compared densely (every pair, no spatial index): building
#: and querying the index costs tens of numpy calls, which only pays off for larger blocks
#: (detection post-processing of 200 boxes: 564 us through the index, dense much less).
DENSE_PAIRS = 1 << 14

# Bytes of scratch per box: x1 y1 x2 y2 xw yw xs (float32), then xrank, level, rank (int64).
_PER_BOX = 7 * 4 + 3 * 8


def _nms_decl(problem: Problem, _wg: int) -> int:
    boxes = problem.in_types[0]
    return _PER_BOX * boxes.shape[1] + 64


#: The kernel's one scratch: global (the CPU has no workgroup memory), sized from the problem.
_BOXES = ScratchDecl("boxes", shared=True, per_workgroup=_nms_decl, spaces=(MemorySpace.GLOBAL,),
                     purpose="per-box corners, windows, x order, levels, score order and ranks of one batch")


# ----------------------------------------------------------------------------------------- index

def _expand(cnt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, k) for k in range(cnt[owner]), for every owner, as two flat arrays."""
    total = int(cnt.sum())
    owner = np.repeat(np.arange(len(cnt)), cnt)
    start = np.cumsum(cnt)
    start -= cnt
    k = np.arange(total)
    k -= start[owner]
    return owner, k


class _Geometry:
    """Per-box arrays of one batch, in float32 as onnxruntime computes them, held in scratch."""

    def __init__(self, boxes: np.ndarray, center: int, iou: float, scratch: np.ndarray) -> None:
        n = boxes.shape[0]
        self.n, self.t = n, float(iou)
        f = scratch[: 7 * 4 * n].view(_F32).reshape(7, n)
        i8 = scratch[7 * 4 * n: _PER_BOX * n].view(np.int64).reshape(3, n)
        x1, y1, x2, y2, xw, yw, xs = f
        self.rank = i8[2]
        b = boxes
        with np.errstate(invalid="ignore", over="ignore"):
            if center:
                np.divide(b[:, 2], _F32(2), out=x2)
                np.divide(b[:, 3], _F32(2), out=y2)
                np.subtract(b[:, 0], x2, out=x1)
                np.subtract(b[:, 1], y2, out=y1)
                np.add(b[:, 0], x2, out=x2)
                np.add(b[:, 1], y2, out=y2)
            else:  # onnxruntime's MaxMin: lhs >= rhs ? (rhs, lhs) : (lhs, rhs)
                sx, sy = b[:, 1] >= b[:, 3], b[:, 0] >= b[:, 2]
                np.copyto(x1, np.where(sx, b[:, 3], b[:, 1]))
                np.copyto(x2, np.where(sx, b[:, 1], b[:, 3]))
                np.copyto(y1, np.where(sy, b[:, 2], b[:, 0]))
                np.copyto(y2, np.where(sy, b[:, 0], b[:, 2]))
            w, h = x2 - x1, y2 - y1
            self.ok = (w * h) > 0  # onnxruntime: a box with area <= 0 overlaps nothing
        self.c4 = (x1, y1, x2, y2)
        self.x1, self.y1 = x1, y1
        self._index_parts = (w, h, xw, yw, xs, i8)
        self.indexed = False

    def prepare_index(self) -> None:
        """Windows, size levels, strips and x order (see the module docstring): what the spatial
        index needs, computed on its first use -- blocks compared densely never need them."""
        if self.indexed:
            return
        self.indexed = True
        w, h, xw, yw, xs, i8 = self._index_parts
        x1, y1, x2, y2 = self.c4
        ok, iou, n = self.ok, self.t, self.n
        with np.errstate(invalid="ignore", over="ignore"):
            k = _F32(1) - _F32(iou)
            # Windows (see the module docstring) with a margin of 1e-4 relative to the side and
            # 1e-5 relative to the coordinates: both far above float32 rounding (6e-8).
            np.multiply(w, k * _F32(1.0001), out=xw)
            xw += _F32(1e-5) * (np.abs(x1) + np.abs(x2)) + _F32(1e-30)
            np.multiply(h, k * _F32(1.0001), out=yw)
            yw += _F32(1e-5) * (np.abs(y1) + np.abs(y2)) + _F32(1e-30)
            size = np.maximum(w, h).astype(np.float64)
        self.xw, self.yw = xw, yw
        # x1 of indexable boxes in increasing order, and each box's rank in it.
        okx = np.where(ok, x1, np.inf)
        order = np.argsort(okx, kind="stable")
        np.take(okx, order, out=xs)
        self.xs = xs
        self.xrank = i8[0]
        self.xrank[order] = np.arange(n)
        finite = ok & np.isfinite(size) & np.isfinite(xw) & np.isfinite(yw) & np.isfinite(y1) & np.isfinite(x1)
        # Infinite sides or coordinates make every window unbounded: one level, one strip, all x.
        self.unbounded = bool(ok.any() and not finite[ok].all())
        if ok.any() and not self.unbounded:
            self.top = float(size[ok].max())
            self.ymin = float(y1[ok].min())
            span = float(y1[ok].max()) - self.ymin
        else:
            self.top, self.ymin, span = 1.0, 0.0, 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            lv = np.floor(np.log2(self.top / size))
        self.level = i8[1]
        np.copyto(self.level, np.clip(np.nan_to_num(lv, nan=LEVELS - 1, posinf=LEVELS - 1, neginf=0),
                                      0, LEVELS - 1).astype(np.int64))
        if self.unbounded:
            self.level[:] = 0
        # Per level, the largest x and y window of its boxes: how far left and down a partner
        # of that level can start.
        self.lx = np.zeros(LEVELS, _F32)
        self.ly = np.zeros(LEVELS, _F32)
        if ok.any():
            np.maximum.at(self.lx, self.level[ok], xw[ok])
            np.maximum.at(self.ly, self.level[ok], yw[ok])
        if self.unbounded:
            self.lx[:] = np.inf
            self.ly[:] = np.inf
        self.strip_h = np.maximum(np.nan_to_num(self.ly.astype(np.float64), posinf=1e300), span / (STRIPS - 1) + 1e-300)
        self.strip_h[self.ly == 0] = 1e300  # an empty level: a single strip
        self.size = size

    def strip(self, y: np.ndarray, lv: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", over="ignore"):
            s = np.floor((np.asarray(y, np.float64) - self.ymin) / self.strip_h[lv])
        return np.clip(np.nan_to_num(s, nan=0.0, posinf=STRIPS - 1, neginf=0), 0, STRIPS - 1).astype(np.int64)

    def levels(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The levels that can hold a partner of each box of ``q``: sides within 1/t of its own."""
        if self.unbounded or self.t <= 0:
            return np.zeros(len(q), np.int64), np.full(len(q), LEVELS - 1, np.int64)
        s = self.size[q]
        r = self.t * (1 - 1e-4)
        with np.errstate(divide="ignore", invalid="ignore"):
            lo = np.floor(np.log2(self.top / (s / r)))
            hi = np.floor(np.log2(self.top / (s * r)))
        lo = np.clip(np.nan_to_num(lo, nan=0, posinf=LEVELS - 1, neginf=0), 0, LEVELS - 1).astype(np.int64)
        hi = np.clip(np.nan_to_num(hi, nan=LEVELS - 1, posinf=LEVELS - 1, neginf=0), 0, LEVELS - 1).astype(np.int64)
        return lo, hi


class _Index:
    """Boxes sorted by (level, strip, x rank): each (level, strip) holds an x-sorted run."""

    def __init__(self, g: _Geometry, ids: np.ndarray) -> None:
        g.prepare_index()
        lv = g.level[ids]
        key = (lv * STRIPS + g.strip(g.y1[ids], lv)) * g.n + g.xrank[ids]
        o = np.argsort(key, kind="stable")
        self.id, self.key = ids[o], key[o]

    def pairs(self, g: _Geometry, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query box, indexed box) pairs that pass both windows of both boxes."""
        if not len(self.id) or not len(q):
            e = np.empty(0, np.intp)
            return e, e
        llo, lhi = g.levels(q)
        qi, k = _expand(lhi - llo + 1)
        lv = llo[qi] + k
        qy = g.y1[q][qi]
        s_lo, s_hi = g.strip(qy - g.ly[lv], lv), g.strip(qy + g.yw[q][qi], lv)
        o, k = _expand(s_hi - s_lo + 1)
        qi, lv, s = qi[o], lv[o], s_lo[o] + k
        qx = g.x1[q][qi]
        r_lo = np.searchsorted(g.xs, qx - g.lx[lv], "left")
        r_hi = np.searchsorted(g.xs, qx + g.xw[q][qi], "right")
        base = (lv * STRIPS + s) * g.n
        lo = np.searchsorted(self.key, base + r_lo, "left")
        hi = np.searchsorted(self.key, base + r_hi, "left")
        o, k = _expand(hi - lo)
        a, b = q[qi[o]], self.id[lo[o] + k]
        dx, dy = g.x1[b] - g.x1[a], g.y1[b] - g.y1[a]
        keep = (dx <= g.xw[a]) & (-dx <= g.xw[b]) & (dy <= g.yw[a]) & (-dy <= g.yw[b])
        return a[keep], b[keep]


def _suppress(g: _Geometry, a: np.ndarray, b: np.ndarray, iou: float) -> np.ndarray:
    return iou_suppresses(tuple(c[a] for c in g.c4), tuple(c[b] for c in g.c4), iou)


def _dense(g: _Geometry, a: np.ndarray, b: np.ndarray, iou: float) -> np.ndarray:
    """Whether box a[i] and box b[j] suppress each other, for every pair: (len(a), len(b))."""
    return iou_suppresses(tuple(c[a][:, None] for c in g.c4), tuple(c[b][None, :] for c in g.c4), iou)


def _cross_dead(g: _Geometry, ids: np.ndarray, kept: np.ndarray, index: "_Index | None", iou: float
                ) -> tuple[np.ndarray, "_Index | None"]:
    """Positions in ``ids`` of the boxes a selected box (``kept``) suppresses, and the index of
    ``kept`` (built here when the pairs are too many to compare densely; reused next time)."""
    q = ids[g.ok[ids]]
    if len(q) * len(kept) <= DENSE_PAIRS:
        return g.rank[q[_dense(g, q, kept, iou).any(axis=1)]], index
    index = index or _Index(g, kept)
    a, b = index.pairs(g, q)
    return g.rank[a[_suppress(g, a, b, iou)]] if len(a) else np.empty(0, np.intp), index


def _self_pairs(g: _Geometry, live: np.ndarray, iou: float) -> tuple[np.ndarray, np.ndarray]:
    """Ranks (earlier, later) of the pairs of ``live`` boxes (rank order) where the earlier
    suppresses the later."""
    if len(live) * len(live) <= DENSE_PAIRS:
        first, second = np.nonzero(np.triu(_dense(g, live, live, iou), 1))
        return g.rank[live[first]], g.rank[live[second]]
    a, b = _Index(g, live).pairs(g, live)
    ra, rb = g.rank[a], g.rank[b]
    earlier = rb < ra  # b comes first, so b may suppress a
    a, b, ra, rb = a[earlier], b[earlier], ra[earlier], rb[earlier]
    if not len(a):
        return ra, rb
    hit = _suppress(g, a, b, iou)
    return rb[hit], ra[hit]


def nms_class(g: _Geometry, scores: np.ndarray, score_threshold: float | None, iou: float, limit: int) -> np.ndarray:
    """Selected box indices of one class, in selection order (see the module docstring)."""
    keep = ~np.isnan(scores)
    if score_threshold is not None:
        keep &= scores > _F32(score_threshold)
    cand = np.flatnonzero(keep)
    order = cand[np.argsort(-scores[cand], kind="stable")]  # decreasing score, ties by index
    rank = g.rank
    rank[order] = np.arange(len(order))
    chosen: list[np.ndarray] = []
    count = 0
    index: _Index | None = None
    kept = np.empty(0, np.intp)
    start, size = 0, BLOCK0
    while start < len(order) and count < limit:
        ids = order[start:start + size]
        dead = np.zeros(len(ids), bool)
        if len(kept):
            gone, index = _cross_dead(g, ids, kept, index, iou)
            dead[gone - start] = True
        alive = ~dead
        x = alive
        live = ids[alive & g.ok[ids]]
        if len(live) > 1:
            first, second = _self_pairs(g, live, iou)
            if len(first):
                first, second = first - start, second - start
                x = alive.copy()
                while True:  # the greedy rule, to its (unique) fixed point
                    sup = np.zeros(len(ids), bool)
                    sup[second[x[first]]] = True
                    nxt = alive & ~sup
                    if np.array_equal(nxt, x):
                        break
                    x = nxt
        take = ids[x][: limit - count]
        chosen.append(take)
        count += len(take)
        new = take[g.ok[take]]
        if len(new) and count < limit:
            kept = np.concatenate([kept, new])
            index = None  # rebuilt on demand for the larger set
        start += size
        size = min(2 * size, BLOCK)
    return np.concatenate(chosen) if chosen else np.empty(0, np.intp)


@TABLE.register("non_max_suppression", scratch=[_BOXES])
def build_nms(device, op: str, attrs: dict, ins, outs, scratch) -> Any:
    """The kernel ``fn(boxes, scores, selected, num_selected)`` using the planned scratch."""
    limit = max(int(attrs["max_output_boxes_per_class"]), 0)
    iou = float(attrs["iou_threshold"])
    thr = attrs["score_threshold"]
    thr = None if thr is None else float(thr)
    center = int(attrs["center_point_box"])
    nb, nc, n = ins[1].shape
    limit = min(limit, n)
    buf = scratch.buffer("boxes")

    def kernel(boxes, scores, selected, num_selected):
        selected.fill(-1)
        row = 0
        if limit:
            for b in range(nb):
                g = _Geometry(np.asarray(boxes[b], _F32), center, iou, buf)
                for c in range(nc):
                    sel = nms_class(g, scores[b, c], thr, iou, limit)
                    k = len(sel)
                    if k:
                        block = selected[row:row + k]
                        block[:, 0] = b
                        block[:, 1] = c
                        block[:, 2] = sel
                        row += k
        num_selected[...] = row

    return kernel
