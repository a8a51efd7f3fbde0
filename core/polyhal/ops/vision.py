"""Sampling ops of vision models: ``grid_sample`` (ONNX GridSample) and ``roi_align`` (ONNX RoiAlign).

**grid_sample** ``(x, grid)``: ``x`` ``[N, C, D1..Dr]`` is sampled at the points of ``grid``
``[N, O1..Or, r]``, whose last dim holds normalized coordinates in ``[-1, 1]`` in *reverse*
spatial order (x, y[, z]) as in PyTorch; the result is ``[N, C, O1..Or]``.

* ``align_corners``: -1 and 1 are the centers of the corner pixels (True) or their outer edges.
* ``mode``: ``nearest`` (round half to even, as PyTorch), ``linear`` (2^r neighbours), ``cubic``
  (4^r neighbours, Keys' kernel with a = -0.75).
* ``padding_mode``: where a point or a neighbour falls outside, ``zeros`` reads 0, ``border``
  clamps to the edge, ``reflection`` mirrors at the border (the pixel edges, or the corner
  centers with ``align_corners``) until inside. ``border`` and ``reflection`` first move the point
  itself inside, then its neighbours.

The per-dim arithmetic (:func:`grid_coordinate`, :func:`grid_taps`, :func:`grid_index`) works on
scalars and arrays alike: the reference calls it per point, kernels over whole grids.

**roi_align** ``(x, rois, batch_indices)``: ``x`` ``[N, C, H, W]``, ``rois`` ``[R, 4]`` boxes
``(x1, y1, x2, y2)`` in input coordinates times ``spatial_scale``, ``batch_indices`` int64
``[R]``; the result ``[R, C, output_height, output_width]`` holds per bin the average (``mode
avg``) or maximum (``mode max``) of ``sampling_ratio``^2 bilinear samples (``0``: adaptive,
``ceil(roi size / bins)`` per axis). ``half_pixel`` shifts the box by -0.5 (ONNX's
``coordinate_transformation_mode``; ``output_half_pixel`` is the legacy, opset-10 behaviour:
no shift and boxes at least 1 pixel wide). Samples more than a pixel outside read 0; samples
just outside are clamped. ``mode max`` takes the maximum of the bilinear *terms* (each
weight times its pixel), as onnxruntime does.
"""

from __future__ import annotations

import itertools

import numpy as np

from polyhal.errors import DTypeError, ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import FLOAT, bool_attr, check_dtype, define, float_attr, fmt_shape, int_attr, nonzero, pick

__all__ = ["GRID_MODES", "GRID_PADDING", "cubic_weights", "grid_coordinate", "grid_index", "grid_taps",
           "reflect", "roi_align_bin"]

GRID_MODES = ("nearest", "linear", "cubic")
GRID_PADDING = ("zeros", "border", "reflection")
_I64 = np.dtype(np.int64)


def reflect(x, lo: float, hi: float):
    """``x`` mirrored at ``lo`` and ``hi`` until inside ``[lo, hi]`` (scalars or arrays)."""
    x = np.asarray(x, np.float64)
    span = hi - lo
    if span <= 0:
        return np.full_like(x, lo)
    below, above = x < lo, x > hi
    d = np.where(below, lo - x, np.where(above, x - hi, 0.0))
    flips = np.floor(d / span)
    r = d - flips * span
    even = flips % 2 == 0
    inside_from_lo = np.where(even, lo + r, hi - r)
    inside_from_hi = np.where(even, hi - r, lo + r)
    return np.where(below, inside_from_lo, np.where(above, inside_from_hi, x))


def _bounds(length: int, align_corners: bool) -> tuple[float, float]:
    return (0.0, length - 1.0) if align_corners else (-0.5, length - 0.5)


def grid_coordinate(g, length: int, *, mode: str, padding_mode: str, align_corners: bool):
    """Normalized coordinate(s) ``g`` as a pixel coordinate along a dim of ``length``, moved
    inside the image for ``border`` and ``reflection`` padding (float64)."""
    g = np.asarray(g, np.float64)
    x = (g + 1) / 2 * (length - 1) if align_corners else ((g + 1) * length - 1) / 2
    if mode == "nearest":
        x = np.rint(x)
    lo, hi = _bounds(length, align_corners)
    if padding_mode == "border":
        x = np.where((x < lo) | (x > hi), np.clip(x, 0, length - 1), x)
    elif padding_mode == "reflection":
        x = reflect(x, lo, hi)
    return x


def cubic_weights(t):
    """Keys' cubic weights (a = -0.75) of the taps at offsets -1, 0, 1, 2 from ``floor(x)``, for
    the fraction ``t = x - floor(x)``: a list of four (arrays of) weights."""
    a = -0.75
    t = np.asarray(t, np.float64)

    def near(d):  # |d| <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d):  # 1 < |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def grid_taps(x, mode: str) -> list[tuple]:
    """The neighbours a coordinate (array) reads: ``[(index, weight), ...]``, int64 indices."""
    if mode == "nearest":
        return [(np.asarray(x).astype(np.int64), np.ones_like(x))]
    base = np.floor(x)
    t = x - base
    base = base.astype(np.int64)
    if mode == "linear":
        return [(base, 1 - t), (base + 1, t)]
    return [(base + k - 1, w) for k, w in enumerate(cubic_weights(t))]


def grid_index(i, length: int, *, padding_mode: str, align_corners: bool):
    """(index inside ``[0, length)``, valid): where a neighbour reads; ``valid`` is False where
    ``zeros`` padding makes it read 0."""
    i = np.asarray(i, np.int64)
    if padding_mode == "zeros":
        valid = (i >= 0) & (i < length)
        return np.clip(i, 0, length - 1), valid
    if padding_mode == "border":
        return np.clip(i, 0, length - 1), np.ones(i.shape, bool)
    lo, hi = _bounds(length, align_corners)
    return np.clip(reflect(i, lo, hi).astype(np.int64), 0, length - 1), np.ones(i.shape, bool)


def _infer_grid_sample(x: TensorType, grid: TensorType, *, mode, padding_mode, align_corners):
    check_dtype(x, FLOAT)
    check_dtype(grid, FLOAT, 1)
    r = x.rank - 2
    if r < 1 or grid.rank != x.rank or grid.shape[-1] != r or grid.shape[0] != x.shape[0]:
        raise ShapeError(f"x {fmt_shape(x.shape)} is [N, C, D1..Dr] and grid must be [N, O1..Or, r]; "
                         f"got grid {fmt_shape(grid.shape)}")
    if mode not in GRID_MODES:
        raise ProgramError(f"mode must be one of {', '.join(GRID_MODES)}, got {mode!r}")
    if padding_mode not in GRID_PADDING:
        raise ProgramError(f"padding_mode must be one of {', '.join(GRID_PADDING)}, got {padding_mode!r}")
    bool_attr(align_corners, "align_corners")
    return (TensorType(x.shape[:2] + grid.shape[1:-1], x.dtype),)


def _ref_grid_sample(x, grid, *, mode="linear", padding_mode="zeros", align_corners=False):
    n_, c_ = x.shape[:2]
    dims = x.shape[2:]
    out = np.zeros(x.shape[:2] + grid.shape[1:-1], np.float64)
    for n in range(n_):
        for o in itertools.product(*(range(s) for s in grid.shape[1:-1])):
            coords = np.asarray(grid[(n, *o)], np.float64)[::-1]  # (x, y, z) -> spatial order
            taps = []
            for g, length in zip(coords, dims):
                xc = grid_coordinate(g, length, mode=mode, padding_mode=padding_mode, align_corners=align_corners)
                taps.append(grid_taps(xc, mode))
            acc = np.zeros(c_)
            for combo in itertools.product(*taps):
                w, at = 1.0, []
                for (i, wi), length in zip(combo, dims):
                    j, ok = grid_index(i, length, padding_mode=padding_mode, align_corners=align_corners)
                    w = w * float(wi) * bool(ok)
                    at.append(int(j))
                acc += w * x[(n, slice(None), *at)]
            out[(n, slice(None), *o)] = acc
    return (out.astype(x.dtype),)


def _sample_grid_sample(rng: np.random.Generator):
    r = pick(rng, [1, 2, 2, 3])
    dims = tuple(int(d) for d in rng.integers(1, 5, size=r))
    outs = tuple(int(d) for d in rng.integers(1, 4, size=r))
    x = nonzero(rng, (2, 3) + dims)
    grid = rng.uniform(-1.3, 1.3, size=(2,) + outs + (r,)).astype(np.float32)
    return [x, grid], {"mode": pick(rng, list(GRID_MODES)), "padding_mode": pick(rng, list(GRID_PADDING)),
                       "align_corners": bool(rng.integers(2))}


define("grid_sample", infer=_infer_grid_sample, reference=_ref_grid_sample, sample=_sample_grid_sample, arity=2,
       tolerance=(1e-4, 1e-5), doc="""
    Samples x [N, C, D1..Dr] at the normalized points of grid [N, O1..Or, r] (ONNX GridSample,
    any r): nearest, linear or cubic; zeros, border or reflection padding (see polyhal.ops.vision).
""")


# ------------------------------------------------------------------------------------ roi_align

_ROI_MODES = ("avg", "max")
_ROI_TRANSFORMS = ("half_pixel", "output_half_pixel")


def roi_align_bin(img: np.ndarray, ys: np.ndarray, xs: np.ndarray, mode: str) -> np.ndarray:
    """One bin of one ROI: ``img`` ``[C, H, W]`` sampled at the rows ``ys`` x columns ``xs``
    (float64 sample coordinates); avg or max over the samples, per channel."""
    h, w = img.shape[1:]
    if len(ys) == 0 or len(xs) == 0:  # an empty ROI with an adaptive sampling ratio reads nothing
        return np.zeros(img.shape[0])
    vals = []
    for y in ys:
        for x in xs:
            if y < -1.0 or y > h or x < -1.0 or x > w:
                vals.append(np.zeros(img.shape[0]))
                continue
            y, x = max(y, 0.0), max(x, 0.0)
            y0, x0 = int(y), int(x)
            if y0 >= h - 1:
                y0 = y1 = h - 1
                y = float(y0)
            else:
                y1 = y0 + 1
            if x0 >= w - 1:
                x0 = x1 = w - 1
                x = float(x0)
            else:
                x1 = x0 + 1
            ly, lx = y - y0, x - x0
            hy, hx = 1 - ly, 1 - lx
            terms = [hy * hx * img[:, y0, x0], hy * lx * img[:, y0, x1], ly * hx * img[:, y1, x0],
                     ly * lx * img[:, y1, x1]]
            vals.append(np.sum(terms, axis=0) if mode == "avg" else np.max(terms, axis=0))
    v = np.stack(vals)
    return v.mean(axis=0) if mode == "avg" else v.max(axis=0)


def roi_geometry(roi, *, spatial_scale: float, half_pixel: bool, output_height: int, output_width: int,
                 sampling_ratio: int) -> tuple[float, float, float, float, int, int]:
    """(y start, x start, bin height, bin width, samples per bin along y, along x) of one ROI."""
    off = 0.5 if half_pixel else 0.0
    x1, y1, x2, y2 = (float(v) * spatial_scale - off for v in roi)
    rw, rh = x2 - x1, y2 - y1
    if not half_pixel:
        rw, rh = max(rw, 1.0), max(rh, 1.0)
    bh, bw = rh / output_height, rw / output_width
    gy = sampling_ratio if sampling_ratio > 0 else int(np.ceil(rh / output_height))
    gx = sampling_ratio if sampling_ratio > 0 else int(np.ceil(rw / output_width))
    return y1, x1, bh, bw, gy, gx


def _infer_roi_align(x: TensorType, rois: TensorType, batch_indices: TensorType, *, mode, output_height,
                     output_width, sampling_ratio, spatial_scale, coordinate_transformation_mode):
    check_dtype(x, FLOAT)
    if x.rank != 4:
        raise ShapeError(f"x must be [N, C, H, W], got {fmt_shape(x.shape)}")
    if rois.dtype != x.dtype or rois.rank != 2 or rois.shape[1] != 4:
        raise ShapeError(f"rois must be {x.dtype} [R, 4], got {rois}")
    if batch_indices.dtype != _I64 or batch_indices.shape != (rois.shape[0],):
        raise DTypeError(f"batch_indices must be int64 [{rois.shape[0]}], got {batch_indices}")
    if mode not in _ROI_MODES:
        raise ProgramError(f"mode must be 'avg' or 'max', got {mode!r}")
    if coordinate_transformation_mode not in _ROI_TRANSFORMS:
        raise ProgramError(f"coordinate_transformation_mode must be one of {', '.join(_ROI_TRANSFORMS)}, "
                           f"got {coordinate_transformation_mode!r}")
    oh, ow = int_attr(output_height, "output_height"), int_attr(output_width, "output_width")
    if oh < 1 or ow < 1 or int_attr(sampling_ratio, "sampling_ratio") < 0:
        raise ProgramError(f"output_height/output_width must be >= 1 and sampling_ratio >= 0, got {oh}, {ow}, "
                           f"{sampling_ratio}")
    float_attr(spatial_scale, "spatial_scale")
    return (TensorType((rois.shape[0], x.shape[1], oh, ow), x.dtype),)


def _ref_roi_align(x, rois, batch_indices, *, mode="avg", output_height=1, output_width=1, sampling_ratio=0,
                   spatial_scale=1.0, coordinate_transformation_mode="half_pixel"):
    out = np.zeros((rois.shape[0], x.shape[1], output_height, output_width))
    for r in range(rois.shape[0]):
        y0, x0, bh, bw, gy, gx = roi_geometry(
            rois[r], spatial_scale=spatial_scale, half_pixel=coordinate_transformation_mode == "half_pixel",
            output_height=output_height, output_width=output_width, sampling_ratio=sampling_ratio)
        img = np.asarray(x[int(batch_indices[r])], np.float64)
        for ph in range(output_height):
            ys = y0 + ph * bh + (np.arange(gy) + 0.5) * bh / gy
            for pw in range(output_width):
                xs = x0 + pw * bw + (np.arange(gx) + 0.5) * bw / gx
                out[r, :, ph, pw] = roi_align_bin(img, ys, xs, mode)
    return (out.astype(x.dtype),)


def _sample_roi_align(rng: np.random.Generator):
    x = nonzero(rng, (2, 3, 6, 7))
    r = 4
    a = rng.uniform(-1.0, 7.0, size=(r, 2))
    b = a + rng.uniform(0.2, 5.0, size=(r, 2))
    rois = np.concatenate([a, b], axis=1).astype(np.float32)
    attrs = {"mode": pick(rng, list(_ROI_MODES)), "output_height": int(rng.integers(1, 4)),
             "output_width": int(rng.integers(1, 4)), "sampling_ratio": int(rng.integers(0, 3)),
             "spatial_scale": pick(rng, [1.0, 0.5]), "coordinate_transformation_mode": pick(rng, list(_ROI_TRANSFORMS))}
    return [x, rois, rng.integers(0, 2, size=r).astype(np.int64)], attrs


define("roi_align", infer=_infer_roi_align, reference=_ref_roi_align, sample=_sample_roi_align, arity=3,
       tolerance=(1e-4, 1e-5), doc="""
    Region-of-interest align (ONNX RoiAlign): per ROI and output bin, the average or maximum of
    bilinear samples of x [N, C, H, W] (see polyhal.ops.vision).
""")
