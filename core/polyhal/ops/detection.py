"""Detection ops: ``non_max_suppression`` with ONNX's semantics (as onnxruntime's CPU kernel).

**Inputs.** ``boxes`` float32 ``[num_batches, num_boxes, 4]``; ``scores`` float32
``[num_batches, num_classes, num_boxes]``. ``center_point_box=0``: a box is ``[y1, x1, y2, x2]``,
any two diagonal corners (inverted corners are normalised with min/max);
``center_point_box=1``: ``[x_center, y_center, width, height]``.

**Attributes.** ONNX passes ``max_output_boxes_per_class``, ``iou_threshold`` and
``score_threshold`` as optional scalar *inputs*; here they are attributes, compile-time
constants (a front end folds the constant inputs), because the output bound depends on
``max_output_boxes_per_class``. Defaults are ONNX's: ``max_output_boxes_per_class=0`` (no output;
a negative value counts as 0, as in onnxruntime), ``iou_threshold=0.0``, no score threshold
(``None``). ``iou_threshold`` outside ``[0, 1]`` is a ProgramError when the program is built
(onnxruntime rejects it too).

**Algorithm.** Per batch and class: the candidates are the boxes whose score is greater than
``score_threshold`` (all of them without one), visited by decreasing score; a candidate is
selected unless it overlaps an already selected box of that class with IoU strictly greater
than ``iou_threshold``; at most ``max_output_boxes_per_class`` are selected. IoU is computed in
float32 exactly as onnxruntime does (boxes with non-positive area, or an empty intersection,
overlap nothing), so that both select the same boxes, bit for bit.

* **Ties** in score are visited in increasing box index (stable), so the lower index wins.
  (onnxruntime's heap leaves the order of equal scores unspecified.)
* **NaN scores** are never selected: a NaN fails every comparison with a threshold, and it is
  dropped even without one (onnxruntime's order of NaNs is unspecified). A box with a NaN
  coordinate overlaps nothing, so it suppresses nothing and is never suppressed.

**Outputs, and the data-dependent shape.** ONNX's output is int64 ``[num_selected, 3]`` rows of
``(batch, class, box)``, whose length depends on the data. A plan's shapes are static, so the op
has two outputs: ``selected`` int64 ``[bound, 3]`` with
``bound = num_batches * num_classes * min(max_output_boxes_per_class, num_boxes)`` (the most
that can be selected), whose first ``num_selected`` rows are ONNX's rows in ONNX's order (batch,
then class, then selection order) and whose remaining rows are ``-1``; and ``num_selected``,
an int64 scalar. Every buffer is thus sized when the plan is compiled, on every backend; the
host compacts with :func:`compact` (``selected[:num_selected]``, a view, no copy), which is what
a front end returns for ONNX's output.
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import DTypeError, ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import define, float_attr, int_attr, pick

__all__ = ["compact", "iou_suppresses", "nms_bound", "corners"]

_F32 = np.dtype(np.float32)


def nms_bound(num_batches: int, num_classes: int, num_boxes: int, max_output_boxes_per_class: int) -> int:
    """Rows of the ``selected`` output: the most boxes that can be selected."""
    return num_batches * num_classes * min(max(int(max_output_boxes_per_class), 0), num_boxes)


def compact(selected, num_selected) -> np.ndarray:
    """ONNX's ``[num_selected, 3]`` output from the padded ``selected`` and the count (a view)."""
    sel = np.asarray(selected)
    return sel[: int(np.asarray(num_selected))]


def _check_thresholds(iou_threshold, score_threshold) -> tuple[float, float | None]:
    iou = float_attr(iou_threshold, "iou_threshold")
    if not 0.0 <= iou <= 1.0:  # also refuses nan
        raise ProgramError(f"iou_threshold must be in [0, 1] (as onnxruntime requires), got {iou!r}")
    score = None if score_threshold is None else float_attr(score_threshold, "score_threshold")
    return iou, score


def _infer(boxes: TensorType, scores: TensorType, *, max_output_boxes_per_class, iou_threshold,
           score_threshold, center_point_box):
    for i, t in enumerate((boxes, scores)):
        if t.dtype != _F32:
            raise DTypeError(f"operand {i} ({('boxes', 'scores')[i]}) has element type {t.dtype}, expected "
                             "float32 (as ONNX); insert a 'cast'")
    if boxes.rank != 3 or boxes.shape[2] != 4:
        raise ShapeError(f"boxes must be [num_batches, num_boxes, 4], got shape {boxes.shape}")
    if scores.rank != 3:
        raise ShapeError(f"scores must be [num_batches, num_classes, num_boxes], got shape {scores.shape}")
    if boxes.shape[0] != scores.shape[0]:
        raise ShapeError(f"boxes and scores have different num_batches: {boxes.shape[0]} and {scores.shape[0]}")
    if boxes.shape[1] != scores.shape[2]:
        raise ShapeError(f"boxes and scores have different num_boxes: {boxes.shape[1]} and {scores.shape[2]}")
    m = int_attr(max_output_boxes_per_class, "max_output_boxes_per_class")
    _check_thresholds(iou_threshold, score_threshold)
    if int_attr(center_point_box, "center_point_box") not in (0, 1):
        raise ProgramError(f"center_point_box must be 0 or 1, got {center_point_box!r}")
    bound = nms_bound(boxes.shape[0], scores.shape[1], boxes.shape[1], m)
    return TensorType((bound, 3), np.int64), TensorType((), np.int64)


# -------------------------------------------------------------------------------------- reference

def corners(boxes: np.ndarray, center_point_box: int) -> tuple[np.ndarray, ...]:
    """(xmin, ymin, xmax, ymax) float32 arrays of ``boxes [..., 4]``, computed as onnxruntime does
    (its MaxMin: ``lhs >= rhs ? (rhs, lhs) : (lhs, rhs)``, so a nan corner stays in place)."""
    b = np.asarray(boxes, _F32)
    if center_point_box:
        xc, yc, w, h = (b[..., i] for i in range(4))
        hw, hh = w / _F32.type(2), h / _F32.type(2)
        return xc - hw, yc - hh, xc + hw, yc + hh
    y1, x1, y2, x2 = (b[..., i] for i in range(4))
    sx, sy = x1 >= x2, y1 >= y2
    return np.where(sx, x2, x1), np.where(sy, y2, y1), np.where(sx, x1, x2), np.where(sy, y1, y2)


def iou_suppresses(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...], iou_threshold: float) -> np.ndarray:
    """Whether boxes ``a`` and ``b`` (corners, broadcasting) overlap with IoU > ``iou_threshold``,
    in float32 with onnxruntime's operation order. Symmetric, bit for bit."""
    ax1, ay1, ax2, ay2 = a
    bx1, by1, bx2, by2 = b
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ix1, ix2 = np.maximum(ax1, bx1), np.minimum(ax2, bx2)
        iy1, iy2 = np.maximum(ay1, by1), np.minimum(ay2, by2)
        inter = (ix2 - ix1) * (iy2 - iy1)
        area_a = (ax2 - ax1) * (ay2 - ay1)
        area_b = (bx2 - bx1) * (by2 - by1)
        union = area_a + area_b - inter
        ok = (ix2 > ix1) & (iy2 > iy1) & (inter > 0) & (area_a > 0) & (area_b > 0) & (union > 0)
        return ok & (inter / union > _F32.type(iou_threshold))


def _reference(boxes, scores, *, max_output_boxes_per_class=0, iou_threshold=0.0, score_threshold=None,
               center_point_box=0):
    boxes, scores = np.asarray(boxes, _F32), np.asarray(scores, _F32)
    nb, nc, n = scores.shape
    m = min(max(int(max_output_boxes_per_class), 0), n)
    rows = []
    for b in range(nb):
        c4 = corners(boxes[b], center_point_box)
        for c in range(nc):
            s = scores[b, c]
            keep = ~np.isnan(s)
            if score_threshold is not None:
                keep &= s > _F32.type(score_threshold)
            cand = np.flatnonzero(keep)
            cand = cand[np.argsort(-s[cand], kind="stable")]  # decreasing score, ties by index
            selected: list[int] = []
            for j in cand.tolist():
                if len(selected) >= m:
                    break
                if selected:
                    sel = np.array(selected)
                    if iou_suppresses(tuple(x[sel] for x in c4), tuple(x[j] for x in c4), iou_threshold).any():
                        continue
                selected.append(j)
                rows.append((b, c, j))
    bound = nms_bound(nb, nc, n, max_output_boxes_per_class)
    out = np.full((bound, 3), -1, np.int64)
    if rows:
        out[: len(rows)] = rows
    return out, np.array(len(rows), np.int64)


def _sample(rng: np.random.Generator):
    nb, nc = pick(rng, [1, 2]), pick(rng, [1, 2, 3])
    n = int(pick(rng, [0, 1, 5, 17, 40]))
    center = bool(rng.integers(2))
    if center:
        # Centers away from 0, widths and heights 0.5..4: many overlaps in a 10x10 field.
        xy = rng.uniform(1.0, 11.0, size=(nb, n, 2))
        wh = rng.uniform(0.5, 4.0, size=(nb, n, 2))
        boxes = np.concatenate([xy, wh], -1)
    else:
        lo = rng.uniform(1.0, 11.0, size=(nb, n, 2))
        hi = lo + rng.uniform(0.5, 4.0, size=(nb, n, 2))
        boxes = np.stack([lo[..., 0], lo[..., 1], hi[..., 0], hi[..., 1]], -1)
        flip = rng.random((nb, n)) < 0.3  # inverted corners: [y2, x2, y1, x1]
        boxes[flip] = boxes[flip][:, [2, 3, 0, 1]]
    scores = rng.uniform(0.05, 1.0, size=(nb, nc, n))
    if rng.random() < 0.4:
        scores = np.round(scores, 1) + 0.05  # ties
    if rng.random() < 0.2 and scores.size:
        scores.reshape(-1)[rng.integers(0, scores.size, size=max(1, scores.size // 10))] = np.nan
    attrs = {
        "max_output_boxes_per_class": int(pick(rng, [1, 3, 10, 100])),
        "iou_threshold": float(pick(rng, [0.0, 0.3, 0.5, 0.7, 1.0])),
        "score_threshold": pick(rng, [None, 0.3]),
        "center_point_box": int(center),
    }
    return [boxes.astype(np.float32), scores.astype(np.float32)], attrs


define("non_max_suppression", infer=_infer, reference=_reference, sample=_sample, arity=2,
       tolerance=(0.0, 0.0), doc="""
    ONNX NonMaxSuppression (onnxruntime's semantics, see polyhal.ops.detection): per batch and
    class, greedily select boxes by decreasing score (ties: lower index first; nan scores never),
    dropping those with IoU > iou_threshold against an already selected box, at most
    max_output_boxes_per_class each. Outputs: ``selected`` int64 [bound, 3] (batch, class, box)
    rows, padded with -1 past ``num_selected`` (an int64 scalar), bound =
    batches * classes * min(max_output_boxes_per_class, boxes). ``compact`` trims it.
""")
