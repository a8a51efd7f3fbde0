"""Resize (and the older Upsample) as per-axis interpolation with constant weights.

Every ONNX resize mode is separable: resizing an N-d tensor is a 1-d resize along each axis in
turn. Along one axis the result is a fixed linear map of the input, so the importer computes
that map once (an ``out x in`` weight matrix, from the mode, the coordinate transformation,
the scale, antialiasing and ``exclude_outside``) and emits a ``matmul`` with it; ``nearest``
picks one input per output, which is a ``gather`` (exact for any value, inf and nan included).
The ops are ordinary ones, so a resize runs on any device that has matmul and gather.

The coefficients follow the ONNX specification (and its reference implementation's choices:
the n input points nearest to the source coordinate, edge-replicated past the ends).
"""

from __future__ import annotations

import math

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.tensor import ints, norm_axis
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError

_COORDINATE_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                     "tf_crop_and_resize", "tf_half_pixel_for_nn")


def _source_coordinates(mode: str, out_len: int, in_len: int, scale: float, roi: tuple[float, float] | None):
    """Source coordinate of each output position, and which are outside the crop (or None)."""
    y = np.arange(out_len, dtype=np.float64)
    out_f = scale * in_len
    outside = None
    if mode == "align_corners":
        x = np.zeros(out_len) if out_f == 1 else y * (in_len - 1) / (out_f - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        lo, hi = roi if roi is not None else (0.0, 1.0)
        x = np.full(out_len, (hi - lo) * (in_len - 1) / 2) if out_f == 1 else y * (hi - lo) * (in_len - 1) / (out_f - 1)
        x = x + lo * (in_len - 1)
        outside = (x < 0) | (x > in_len - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(out_len, -0.5) if out_f == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "tf_half_pixel_for_nn":  # opset 11 only (TensorFlow converters write it)
        x = (y + 0.5) / scale
    elif mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_f)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise OnnxUnsupportedError(f"coordinate_transformation_mode {mode!r} (expected one of {_COORDINATE_MODES})")
    return x, outside


def _coefficients(kind: str, ratio: float, scale: float, *, a: float, antialias: bool, nearest: str) -> np.ndarray:
    """The weights of the n nearest input points for one output (``ratio`` in (0, 1])."""
    if kind == "nearest":
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        if nearest == "round_prefer_floor":
            return np.array([ratio <= 0.5, ratio > 0.5], dtype=np.float64)
        if nearest == "round_prefer_ceil":
            return np.array([ratio < 0.5, ratio >= 0.5], dtype=np.float64)
        if nearest == "floor":
            return np.array([1.0, 0.0])
        if nearest == "ceil":
            return np.array([0.0, 1.0])
        raise OnnxUnsupportedError(f"nearest_mode {nearest!r}")
    if kind == "linear":
        if not antialias:
            return np.array([1 - ratio, ratio])
        s = min(scale, 1.0)  # antialiasing widens the kernel when downsampling
        start = int(np.floor(-1 / s) + 1)
        taps = np.clip(1 - np.abs((np.arange(start, 2 - start) - ratio) * s), 0, 1)
        return taps / taps.sum()
    if kind == "cubic":
        if not antialias:
            r = ratio
            return np.array([
                ((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
                ((a + 2) * r - (a + 3)) * r * r + 1,
                ((a + 2) * (1 - r) - (a + 3)) * (1 - r) * (1 - r) + 1,
                ((a * (2 - r) - 5 * a) * (2 - r) + 8 * a) * (2 - r) - 4 * a,
            ])
        s = min(scale, 1.0)
        start = int(np.floor(-2 / s) + 1)

        def cubic(t: float) -> float:
            t = abs(t)
            if t <= 1:
                return (a + 2) * t**3 - (a + 3) * t**2 + 1
            return a * t**3 - 5 * a * t**2 + 8 * a * t - 4 * a if t < 2 else 0.0

        taps = np.array([cubic(s * (i - ratio)) for i in range(start, 2 - start)])
        return taps / taps.sum()
    raise OnnxUnsupportedError(f"Resize mode {kind!r} (expected nearest, linear or cubic)")


def axis_weights(kind: str, coordinate_mode: str, in_len: int, out_len: int, scale: float,
                 roi: tuple[float, float] | None = None, *, cubic_a: float = -0.75, antialias: bool = False,
                 exclude_outside: bool = False, nearest: str = "round_prefer_floor"):
    """(weights ``[out_len, in_len]``, outside mask or None) of a 1-d resize along one axis."""
    x, outside = _source_coordinates(coordinate_mode, out_len, in_len, scale, roi)
    weights = np.zeros((out_len, in_len))
    for i, xi in enumerate(x.tolist()):
        base = math.floor(xi)
        ratio = 1.0 if xi == base else xi - base  # prefer the point left of x
        c = _coefficients(kind, ratio, scale, a=cubic_a, antialias=antialias, nearest=nearest)
        n = len(c)
        # The n points nearest to x (ties to the smaller index), in edge-padded coordinates.
        pad = math.ceil(n / 2)
        xp = xi + pad
        p = math.floor(xp)
        frac = xp - p
        if n % 2 == 0:
            start = p - n // 2 if frac == 0 else p - n // 2 + 1
        else:
            start = p - (n - 1) // 2 + (0 if frac <= 0.5 else 1)
        idx = np.arange(start, start + n) - pad
        if exclude_outside:
            c = np.where((idx < 0) | (idx >= in_len), 0.0, c)
            total = c.sum()
            c = c / (total if total else 1.0)
        np.add.at(weights[i], np.clip(idx, 0, in_len - 1), c)
    return weights, outside


def _apply_axis(ctx: NodeContext, x, axis: int, weights: np.ndarray, kind: str):
    rank = ctx.rank(x)
    if kind == "nearest":
        return ctx.op("gather", x, np.argmax(weights, axis=1).astype(np.int64), axis=axis)
    dt = ctx.dtype(x)
    w = weights.astype(dt)
    if axis == rank - 1:
        return ctx.op("matmul", x, np.ascontiguousarray(w.T))
    if axis == rank - 2:
        return ctx.op("matmul", w, x)
    perm = [i for i in range(rank) if i != axis] + [axis]
    moved = ctx.op("matmul", ctx.op("transpose", x, perm=perm), np.ascontiguousarray(w.T))
    back = [0] * rank
    for i, p in enumerate(perm):
        back[p] = i
    return ctx.op("transpose", moved, perm=back)


def resize(ctx: NodeContext, x, out_shape: list[int], scales: list[float], axes: list[int], *, kind: str,
           coordinate_mode: str, roi: list[float] | None, cubic_a: float, antialias: bool, exclude_outside: bool,
           extrapolation: float, nearest: str):
    """Emit the per-axis resizes of ``x`` to ``out_shape``."""
    rank = ctx.rank(x)
    integer = None
    if kind != "nearest" and ctx.dtype(x).kind != "f":
        if ctx.dtype(x).kind not in "iu":
            raise OnnxUnsupportedError(f"Resize mode {kind!r} of {ctx.dtype(x)} data (polyhal interpolates numbers)")
        # Integer data (onnxruntime's quantizer resizes int8 activations as they are): interpolated
        # in float32 and truncated toward zero into the type's range, as onnxruntime's kernel does.
        integer = ctx.dtype(x)
        x = ctx.op("cast", x, dtype="float32")
    for axis in axes:
        in_len, out_len, scale = ctx.shape(x)[axis], out_shape[axis], scales[axis]
        axis_roi = None if roi is None else (roi[axis], roi[axis + rank])
        if math.isclose(scale, 1.0) and out_len == in_len and (
                axis_roi is None or (math.isclose(axis_roi[0], 0.0) and math.isclose(axis_roi[1], 1.0))):
            continue  # identity along this axis
        if out_len == 0 or in_len == 0:
            raise OnnxUnsupportedError("Resize to or from an empty axis")
        weights, outside = axis_weights(kind, coordinate_mode, in_len, out_len, scale, axis_roi, cubic_a=cubic_a,
                                        antialias=antialias, exclude_outside=exclude_outside, nearest=nearest)
        x = _apply_axis(ctx, x, axis, weights, kind)
        if outside is not None and outside.any():
            mask = outside.reshape((out_len,) + (1,) * (rank - axis - 1))
            x = ctx.op("where", mask, ctx.scalar(extrapolation, ctx.dtype(x)), x)
    if integer is not None:
        info = np.iinfo(integer)
        x = ctx.op("maximum", ctx.op("minimum", x, ctx.scalar(info.max, np.float32)), ctx.scalar(info.min, np.float32))
        x = ctx.op("cast", x, dtype=str(integer))
    return x


@converter("Resize")
def _resize(ctx: NodeContext) -> list:
    x = ctx.input(0)
    rank = ctx.rank(x)
    shape = list(ctx.shape(x))
    if ctx.opset < 11:  # Resize-10: (X, scales), asymmetric coordinates
        scales_in, sizes_in, roi_in = ctx.const(1, "the scales"), None, None
        coordinate_mode = "asymmetric"
    else:
        roi_in = ctx.const(1, "the roi")
        scales_in = ctx.const(2, "the scales")
        sizes_in = ctx.const(3, "the sizes")
        coordinate_mode = ctx.attr("coordinate_transformation_mode", "half_pixel")
    kind = ctx.attr("mode", "nearest")
    axes = ctx.attr("axes", None)
    axes = list(range(rank)) if axes is None else [norm_axis(int(a), rank, "axes entry") for a in axes]
    scales_list = None if scales_in is None or np.asarray(scales_in).size == 0 else \
        [float(v) for v in np.asarray(scales_in).reshape(-1)]
    sizes_list = None if sizes_in is None or np.asarray(sizes_in).size == 0 else ints(sizes_in)
    roi = None if roi_in is None or np.asarray(roi_in).size == 0 else [float(v) for v in np.asarray(roi_in).reshape(-1)]
    if roi is not None and len(roi) == 2 * len(axes) and len(axes) != rank:
        full = [0.0] * rank + [1.0] * rank
        for i, a in enumerate(axes):
            full[a], full[a + rank] = roi[i], roi[len(axes) + i]
        roi = full
    scales = [1.0] * rank
    out_shape = list(shape)
    if sizes_list is not None:
        if len(sizes_list) != len(axes):
            raise OnnxModelError(f"sizes {sizes_list} must have one entry per axis of {axes}")
        for a, s in zip(axes, sizes_list):
            out_shape[a] = s
            scales[a] = s / shape[a] if shape[a] else 1.0
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            pick = min if policy == "not_larger" else max if policy == "not_smaller" else None
            if pick is None:
                raise OnnxModelError(f"keep_aspect_ratio_policy {policy!r}")
            common = pick(scales[a] for a in axes)
            for a in axes:
                scales[a] = common
                out_shape[a] = int(common * shape[a] + 0.5)
    elif scales_list is not None:
        if len(scales_list) != len(axes):
            raise OnnxModelError(f"scales {scales_list} must have one entry per axis of {axes}")
        for a, s in zip(axes, scales_list):
            if s <= 0:
                raise OnnxModelError(f"scales must be positive, got {scales_list}")
            scales[a] = s
            out_shape[a] = int(s * shape[a])
    else:
        raise OnnxModelError("Resize needs scales or sizes")
    if coordinate_mode == "tf_crop_and_resize" and roi is None:
        raise OnnxModelError("coordinate_transformation_mode tf_crop_and_resize needs a roi")
    return [resize(ctx, x, out_shape, scales, axes, kind=kind, coordinate_mode=coordinate_mode,
                   roi=roi if coordinate_mode == "tf_crop_and_resize" else None,
                   cubic_a=float(ctx.attr("cubic_coeff_a", -0.75)), antialias=bool(ctx.attr("antialias", 0)),
                   exclude_outside=bool(ctx.attr("exclude_outside", 0)),
                   extrapolation=float(ctx.attr("extrapolation_value", 0.0)),
                   nearest=ctx.attr("nearest_mode", "round_prefer_floor"))]


@converter("Upsample")
def _upsample(ctx: NodeContext) -> list:
    x = ctx.input(0)
    scales = [float(v) for v in (ctx.attr("scales") if ctx.opset < 9 else np.asarray(ctx.const(1, "the scales")).reshape(-1))]
    kind = ctx.attr("mode", "nearest")
    shape = list(ctx.shape(x))
    if len(scales) != len(shape):
        raise OnnxModelError(f"scales {scales} must have one entry per dim of {shape}")
    out_shape = [int(s * d) for s, d in zip(scales, shape)]
    # Upsample's nearest repeats each element (floor of the asymmetric source coordinate).
    return [resize(ctx, x, out_shape, scales, list(range(len(shape))), kind="linear" if kind in ("linear", "bilinear")
                   else "nearest", coordinate_mode="asymmetric", roi=None, cubic_a=-0.75, antialias=False,
                   exclude_outside=False, extrapolation=0.0, nearest="floor")]
