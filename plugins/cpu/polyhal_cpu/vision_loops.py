"""The compiled loops of :mod:`polyhal_cpu.vision_kernels` (``grid_sample``, ``roi_align``), by numba
with declared signatures (float32 and float64 images), cached on disk. Importing this module
imports numba.

Both ops are an interpolation whose taps depend on the point but not on the channel, so each
loop works as onnxruntime's kernels do: first the taps of every output point (flat offsets into
a channel plane and their weights, with the padding rule folded into both), then, channel plane
by channel plane (which stays in cache), one weighted sum per point. The arithmetic per dim is
that of :mod:`polyhal.ops.vision` (float64 coordinates and weights, float64 sums, rounded once
into the output).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["MODES", "PADDINGS", "grid_sample", "roi_align"]

#: The codes the loops take for ``mode`` and ``padding_mode`` (indices into these).
MODES = ("nearest", "linear", "cubic")
PADDINGS = ("zeros", "border", "reflection")

_opts = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")


@njit(inline="always", **_opts)
def _reflect(x, lo, hi):
    """``x`` mirrored at ``lo`` and ``hi`` until inside (polyhal.ops.vision.reflect, a scalar)."""
    span = hi - lo
    if span <= 0.0:
        return lo
    if x < lo:
        d = lo - x
        flips = math.floor(d / span)
        r = d - flips * span
        return lo + r if flips % 2 == 0 else hi - r
    if x > hi:
        d = x - hi
        flips = math.floor(d / span)
        r = d - flips * span
        return hi - r if flips % 2 == 0 else lo + r
    return x


@njit(inline="always", **_opts)
def _index(v):
    """``v`` truncated to an int64; nan and values past int64 give an index far outside any image
    (that ``zeros`` padding reads as 0; the other paddings moved the point inside first)."""
    return np.int64(v) if abs(v) < 4e18 else np.int64(-(1 << 40))


@njit(inline="always", **_opts)
def _cubic(d):
    """Keys' cubic kernel (a = -0.75) at distance ``d`` >= 0."""
    a = -0.75
    if d <= 1.0:
        return ((a + 2.0) * d - (a + 3.0)) * d * d + 1.0
    return ((a * d - 5.0 * a) * d + 8.0 * a) * d - 4.0 * a


@njit(inline="always", **_opts)
def _dim_taps(g, length, mode, padding, align, index, weight):
    """The taps of normalized coordinate ``g`` along a dim of ``length`` into ``index`` and
    ``weight`` (padding applied: a tap ``zeros`` padding reads 0 for has weight times 0, so a nan
    weight stays nan as in the reference); returns their count."""
    x = (g + 1.0) / 2.0 * (length - 1) if align else ((g + 1.0) * length - 1.0) / 2.0
    if mode == 0:
        x = np.rint(x)
    lo, hi = (0.0, length - 1.0) if align else (-0.5, length - 0.5)
    if padding == 1:
        if x < lo or x > hi:
            x = min(max(x, 0.0), length - 1.0)
    elif padding == 2:
        x = _reflect(x, lo, hi)
    if mode == 0:
        count = 1
        weight[0] = 1.0
        index[0] = _index(x)
    else:
        base = math.floor(x)
        t = x - base
        b = _index(base)
        if mode == 1:
            count = 2
            index[0], index[1] = b, b + 1
            weight[0], weight[1] = 1.0 - t, t
        else:
            count = 4
            for k in range(4):
                index[k] = b + k - 1
            weight[0], weight[1], weight[2], weight[3] = _cubic(t + 1.0), _cubic(t), _cubic(1.0 - t), _cubic(2.0 - t)
    for k in range(count):
        i = index[k]
        if padding == 0:
            if i < 0 or i >= length:
                weight[k] *= 0.0
                i = 0
        elif padding == 1:
            i = min(max(i, 0), length - 1)
        else:
            i = min(max(np.int64(_reflect(float(i), lo, hi)), 0), length - 1)
        index[k] = i
    return count


_GRID = ["void({x}[:, :, ::1], f8[:, :, ::1], i8[::1], i8, i8, b1, {x}[:, :, ::1])".format(x=x) for x in ("f4", "f8")]


@njit(_GRID, **_opts)
def grid_sample(x, grid, dims, mode, padding, align, out):
    """ONNX GridSample: ``x`` ``[N, C, S]`` (S the flattened spatial dims ``dims``, D1..Dr)
    sampled at ``grid`` ``[N, P, r]`` (normalized, in reverse spatial order: x, y[, z]) into
    ``out`` ``[N, C, P]``. ``mode`` and ``padding`` index :data:`MODES` and :data:`PADDINGS`."""
    n_, c_, _ = x.shape
    points, rank = grid.shape[1], grid.shape[2]
    per_dim = 1 if mode == 0 else (2 if mode == 1 else 4)
    taps = per_dim ** rank
    offsets = np.empty((points, taps), np.int64)
    weights = np.empty((points, taps), np.float64)
    index = np.empty((rank, 4), np.int64)
    weight = np.empty((rank, 4), np.float64)
    for n in range(n_):
        for p in range(points):
            # the taps of each dim, combined dim by dim (the last dim's fastest): m taps so far
            # become m * count, written from the end so that none is overwritten before it is read
            offsets[p, 0], weights[p, 0], m = 0, 1.0, 1
            for d in range(rank):
                count = _dim_taps(grid[n, p, rank - 1 - d], dims[d], mode, padding, align, index[d], weight[d])
                for t in range(m - 1, -1, -1):
                    base, w = offsets[p, t] * dims[d], weights[p, t]
                    for k in range(count - 1, -1, -1):
                        offsets[p, t * count + k] = base + index[d, k]
                        weights[p, t * count + k] = w * weight[d, k]
                m *= count
        for c in range(c_):
            plane = x[n, c]
            row = out[n, c]
            if taps == 4:  # bilinear: the taps spelled out, so that the loop has no inner loop
                for p in range(points):
                    row[p] = (weights[p, 0] * plane[offsets[p, 0]] + weights[p, 1] * plane[offsets[p, 1]]
                              + weights[p, 2] * plane[offsets[p, 2]] + weights[p, 3] * plane[offsets[p, 3]])
                continue
            for p in range(points):
                acc = 0.0
                for t in range(taps):
                    acc += weights[p, t] * plane[offsets[p, t]]
                row[p] = acc


_ROI = ["void({x}[:, :, :, ::1], {x}[:, ::1], i8[::1], f8[::1], b1, {x}[:, :, :, ::1])".format(x=x)
        for x in ("f4", "f8")]


@njit(_ROI, **_opts)
def roi_align(x, rois, batch_indices, params, average, out):
    """ONNX RoiAlign: ``x`` ``[N, C, H, W]``, ``rois`` ``[R, 4]``, into ``out`` ``[R, C, OH, OW]``;
    ``params`` float64 ``(spatial_scale, half_pixel, sampling_ratio)``; ``average`` mode avg
    (else max: the largest bilinear term, as onnxruntime takes it)."""
    _, c_, h, w = x.shape
    r_, _, oh, ow = out.shape
    scale, half_pixel, ratio = params[0], params[1] != 0.0, np.int64(params[2])
    off = 0.5 if half_pixel else 0.0
    for r in range(r_):
        x1, y1 = rois[r, 0] * scale - off, rois[r, 1] * scale - off
        x2, y2 = rois[r, 2] * scale - off, rois[r, 3] * scale - off
        rw, rh = x2 - x1, y2 - y1
        if not half_pixel:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        bh, bw = rh / oh, rw / ow
        gy = ratio if ratio > 0 else np.int64(math.ceil(rh / oh))
        gx = ratio if ratio > 0 else np.int64(math.ceil(rw / ow))
        if gy <= 0 or gx <= 0:
            out[r] = 0.0
            continue
        samples = gy * gx
        # the taps of every sample of every bin: 4 offsets into a plane and their weights
        offsets = np.empty((oh * ow, samples, 4), np.int64)
        weights = np.empty((oh * ow, samples, 4), np.float64)
        for ph in range(oh):
            for pw in range(ow):
                b = ph * ow + pw
                for iy in range(gy):
                    y = y1 + ph * bh + (iy + 0.5) * bh / gy
                    for ix in range(gx):
                        xx = x1 + pw * bw + (ix + 0.5) * bw / gx
                        s = iy * gx + ix
                        if y < -1.0 or y > h or xx < -1.0 or xx > w:
                            for k in range(4):
                                offsets[b, s, k] = 0
                                weights[b, s, k] = 0.0
                            continue
                        y, xx = max(y, 0.0), max(xx, 0.0)
                        y0, x0 = np.int64(y), np.int64(xx)
                        if y0 >= h - 1:
                            y0 = y1_ = h - 1
                            yv = float(y0)
                        else:
                            y1_ = y0 + 1
                            yv = y
                        if x0 >= w - 1:
                            x0 = x1_ = w - 1
                            xv = float(x0)
                        else:
                            x1_ = x0 + 1
                            xv = xx
                        ly, lx = yv - y0, xv - x0
                        hy, hx = 1.0 - ly, 1.0 - lx
                        offsets[b, s, 0], weights[b, s, 0] = y0 * w + x0, hy * hx
                        offsets[b, s, 1], weights[b, s, 1] = y0 * w + x1_, hy * lx
                        offsets[b, s, 2], weights[b, s, 2] = y1_ * w + x0, ly * hx
                        offsets[b, s, 3], weights[b, s, 3] = y1_ * w + x1_, ly * lx
        img = x[batch_indices[r]]
        for c in range(c_):
            plane = img[c].reshape(h * w)
            dst = out[r, c].reshape(oh * ow)
            for b in range(oh * ow):
                if average:
                    acc = 0.0
                    for s in range(samples):
                        for k in range(4):
                            acc += weights[b, s, k] * plane[offsets[b, s, k]]
                    dst[b] = acc / samples
                else:
                    top = -np.inf
                    for s in range(samples):
                        for k in range(4):
                            v = weights[b, s, k] * plane[offsets[b, s, k]]
                            if v > top:
                                top = v
                    dst[b] = top
