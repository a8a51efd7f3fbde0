"""The compiled loops of :mod:`polyhal_cpu.vision_kernels` (``grid_sample``, ``roi_align``), by numba
with declared signatures (float32 and float64 images), cached on disk. Importing this module
imports numba.

Both ops are an interpolation whose taps depend on the point but not on the channel, so each
loop works as onnxruntime's kernels do: first the taps of every output point (flat offsets into
a channel plane and their weights, with the padding rule folded into both), then, channel plane
by channel plane (which stays in cache), one weighted sum per point. The arithmetic per dim is
that of :mod:`polyhal.ops.vision` (float64 coordinates and weights, float64 sums, rounded once
into the output).

RoiAlign's bilinear taps are separable (a sample's y taps do not depend on its x), so a ROI's
taps are computed per row and per column of samples, and where there are enough taps it reads
a channels-last copy of the images: a tap's channels side by side, summed channels at a time in
vector instructions. 64 ROIs of 32 channels, 7 x 7 bins of 2 x 2 samples (float32, one thread,
a 2-core VM): 1.05 ms plane by plane, 0.27 ms channels last.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["CHANNELS_LAST_MIN", "MODES", "PADDINGS", "grid_sample", "roi_align"]

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


@njit(inline="always", **_opts)
def _roi_grid(rois, r, scale, half_pixel, ratio, oh, ow):
    """(x start, y start, bin width, bin height, samples along x, along y) of ROI ``r``
    (polyhal.ops.vision.roi_geometry)."""
    off = 0.5 if half_pixel else 0.0
    x1, y1 = rois[r, 0] * scale - off, rois[r, 1] * scale - off
    x2, y2 = rois[r, 2] * scale - off, rois[r, 3] * scale - off
    rw, rh = x2 - x1, y2 - y1
    if not half_pixel:
        rw, rh = max(rw, 1.0), max(rh, 1.0)
    gy = ratio if ratio > 0 else np.int64(math.ceil(rh / oh))
    gx = ratio if ratio > 0 else np.int64(math.ceil(rw / ow))
    return x1, y1, rw / ow, rh / oh, gx, gy


@njit(inline="always", **_opts)
def _roi_axis(start, size_of_bin, g, bins, size, pixels, weights):
    """The bilinear taps along one axis of sample ``j = bin * g + i`` at ``start + bin *
    size_of_bin + (i + 0.5) * size_of_bin / g``: its two pixels ``pixels[j]`` (-1 where the
    sample is more than a pixel outside the image) and their weights ``weights[j]``. Taps are
    separable: a sample's four are the products of its y and x taps."""
    for o in range(bins):
        for i in range(g):
            j = o * g + i
            v = start + o * size_of_bin + (i + 0.5) * size_of_bin / g
            if v < -1.0 or v > size:
                pixels[j, 0] = pixels[j, 1] = -1
                continue
            v = max(v, 0.0)
            lo = np.int64(v)
            if lo >= size - 1:
                lo = hi = size - 1
                v = float(lo)
            else:
                hi = lo + 1
            pixels[j, 0], pixels[j, 1] = lo, hi
            weights[j, 1] = v - lo
            weights[j, 0] = 1.0 - weights[j, 1]


@njit(inline="always", **_opts)
def _roi_tap(y_pixels, y_weights, x_pixels, x_weights, jy, jx, k, w):
    """Tap ``k`` (y0x0, y0x1, y1x0, y1x1) of the sample at y tap ``jy`` and x tap ``jx``: its
    offset into a plane of width ``w`` and its weight; (0, 0.0) for a sample outside."""
    if y_pixels[jy, 0] < 0 or x_pixels[jx, 0] < 0:
        return 0, 0.0
    a, b = k // 2, k % 2
    return y_pixels[jy, a] * w + x_pixels[jx, b], y_weights[jy, a] * x_weights[jx, b]


#: Channels from which :func:`roi_align` reads a channels-last copy of the images (a vector of
#: channels per tap); fewer gain too little from vectors to pay for the copy.
CHANNELS_LAST_MIN = 4


@njit(_ROI, **_opts)
def roi_align(x, rois, batch_indices, params, average, out):
    """ONNX RoiAlign: ``x`` ``[N, C, H, W]``, ``rois`` ``[R, 4]``, into ``out`` ``[R, C, OH, OW]``;
    ``params`` float64 ``(spatial_scale, half_pixel, sampling_ratio)``; ``average`` mode avg
    (else max: the largest bilinear term, as onnxruntime takes it).

    Where the taps outnumber the pixels of the images the ROIs read (and there are
    :data:`CHANNELS_LAST_MIN` channels or more), those images are first copied channels last,
    so that a tap reads its pixel's channels side by side and the sum over taps runs channels
    at a time in vector instructions; otherwise a tap is read plane by plane. Either way each
    output is the same float64 sum in the same order (a sample outside the image adds four
    0-weighted reads of the plane's first pixel, as onnxruntime's does), rounded once."""
    n_, c_, h, w = x.shape
    r_, _, oh, ow = out.shape
    scale, half_pixel, ratio = params[0], params[1] != 0.0, np.int64(params[2])
    used = np.zeros(n_, np.bool_)
    taps, most_y, most_x = 0, 1, 1
    for r in range(r_):
        used[batch_indices[r]] = True
        _, _, _, _, gx, gy = _roi_grid(rois, r, scale, half_pixel, ratio, oh, ow)
        if gx > 0 and gy > 0:
            taps += oh * ow * gy * gx * 4
            most_y, most_x = max(most_y, gy), max(most_x, gx)
    pixels = 0
    for n in range(n_):
        if used[n]:
            pixels += h * w
    last = c_ >= CHANNELS_LAST_MIN and taps >= pixels
    if last:
        xt = np.empty((n_, h * w, c_), x.dtype)
        for n in range(n_):
            if used[n]:
                planes = x[n].reshape(c_, h * w)
                for p in range(h * w):
                    for c in range(c_):
                        xt[n, p, c] = planes[c, p]
    else:
        xt = np.empty((0, 0, c_), x.dtype)
    y_pixels, y_weights = np.empty((oh * most_y, 2), np.int64), np.empty((oh * most_y, 2), np.float64)
    x_pixels, x_weights = np.empty((ow * most_x, 2), np.int64), np.empty((ow * most_x, 2), np.float64)
    acc = np.empty(c_, np.float64)
    for r in range(r_):
        x1, y1, bw, bh, gx, gy = _roi_grid(rois, r, scale, half_pixel, ratio, oh, ow)
        if gy <= 0 or gx <= 0:
            out[r] = 0.0
            continue
        samples = gy * gx
        _roi_axis(y1, bh, gy, oh, h, y_pixels, y_weights)
        _roi_axis(x1, bw, gx, ow, w, x_pixels, x_weights)
        if last:
            img = xt[batch_indices[r]]
            for ph in range(oh):
                for pw in range(ow):
                    start = 0.0 if average else -np.inf
                    for c in range(c_):
                        acc[c] = start
                    for iy in range(gy):
                        for ix in range(gx):
                            jy, jx = ph * gy + iy, pw * gx + ix
                            o0, w0 = _roi_tap(y_pixels, y_weights, x_pixels, x_weights, jy, jx, 0, w)
                            o1, w1 = _roi_tap(y_pixels, y_weights, x_pixels, x_weights, jy, jx, 1, w)
                            o2, w2 = _roi_tap(y_pixels, y_weights, x_pixels, x_weights, jy, jx, 2, w)
                            o3, w3 = _roi_tap(y_pixels, y_weights, x_pixels, x_weights, jy, jx, 3, w)
                            p0, p1, p2, p3 = img[o0], img[o1], img[o2], img[o3]
                            if average:  # the four terms added one by one, as plane by plane
                                for c in range(c_):
                                    acc[c] = (((acc[c] + w0 * p0[c]) + w1 * p1[c]) + w2 * p2[c]) + w3 * p3[c]
                            else:
                                for c in range(c_):
                                    top = acc[c]
                                    v = w0 * p0[c]
                                    top = v if v > top else top
                                    v = w1 * p1[c]
                                    top = v if v > top else top
                                    v = w2 * p2[c]
                                    top = v if v > top else top
                                    v = w3 * p3[c]
                                    acc[c] = v if v > top else top
                    for c in range(c_):
                        out[r, c, ph, pw] = acc[c] / samples if average else acc[c]
            continue
        offsets = np.empty((oh * ow, samples, 4), np.int64)
        weights = np.empty((oh * ow, samples, 4), np.float64)
        for ph in range(oh):
            for pw in range(ow):
                for iy in range(gy):
                    for ix in range(gx):
                        for k in range(4):
                            offsets[ph * ow + pw, iy * gx + ix, k], weights[ph * ow + pw, iy * gx + ix, k] = \
                                _roi_tap(y_pixels, y_weights, x_pixels, x_weights, ph * gy + iy, pw * gx + ix, k, w)
        img = x[batch_indices[r]]
        for c in range(c_):
            plane = img[c].reshape(h * w)
            dst = out[r, c].reshape(oh * ow)
            for b in range(oh * ow):
                if average:
                    total = 0.0
                    for s in range(samples):
                        for k in range(4):
                            total += weights[b, s, k] * plane[offsets[b, s, k]]
                    dst[b] = total / samples
                else:
                    top = -np.inf
                    for s in range(samples):
                        for k in range(4):
                            v = weights[b, s, k] * plane[offsets[b, s, k]]
                            if v > top:
                                top = v
                    dst[b] = top
