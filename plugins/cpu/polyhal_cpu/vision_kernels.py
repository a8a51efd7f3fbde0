"""CPU kernels of the sampling ops (:mod:`polyhal.ops.vision`): ``grid_sample`` and ``roi_align``.

Both are vectorised over every output point at once: an interpolation is separable, so each
spatial dim contributes a few (index, weight) taps per point, computed as whole arrays with the
op's per-dim arithmetic; a kernel then does one gather per combination of taps (1, 2^r or 4^r of
them) and accumulates in float64. No Python loop runs per point; ``roi_align`` loops per ROI
(its bins have per-ROI sizes).
"""

from __future__ import annotations

import itertools

import numpy as np

from polyhal.ops.vision import grid_coordinate, grid_index, grid_taps, roi_geometry
from polyhal_cpu.table import TABLE, Kernel, Types


@TABLE.register("grid_sample")
def _grid_sample(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    mode, padding = attrs["mode"], attrs["padding_mode"]
    align = bool(attrs["align_corners"])
    n, c, *dims = ins[0].shape
    points = int(np.prod(ins[1].shape[1:-1], dtype=np.int64))
    rank = len(dims)

    def kernel(x, grid, out):
        g = grid.reshape(n, points, rank).astype(np.float64)
        taps = [grid_taps(grid_coordinate(g[..., rank - 1 - d], dims[d], mode=mode, padding_mode=padding,
                                          align_corners=align), mode) for d in range(rank)]
        flat_x = x.reshape(n, c, -1)
        acc = np.zeros((n, c, points))
        for combo in itertools.product(*taps):
            flat = np.zeros((n, points), np.int64)
            weight = np.ones((n, points))
            for (i, w), length in zip(combo, dims):
                j, ok = grid_index(i, length, padding_mode=padding, align_corners=align)
                flat = flat * length + j
                weight = weight * w * ok
            acc += weight[:, None, :] * np.take_along_axis(flat_x, flat[:, None, :], axis=2)
        np.copyto(out, acc.reshape(out.shape), casting="unsafe")
    return kernel


def _roi_axis(coords: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear taps of sample coordinates along one axis: (low, high, low weight, high weight,
    inside) -- samples more than a pixel outside are not inside; those just outside clamp."""
    inside = (coords >= -1.0) & (coords <= size)
    v = np.maximum(coords, 0.0)
    low = v.astype(np.int64)
    edge = low >= size - 1
    low = np.where(edge, size - 1, low)
    high = np.where(edge, size - 1, low + 1)
    v = np.where(edge, low, v)
    frac = v - low
    return low, high, 1.0 - frac, frac, inside


@TABLE.register("roi_align")
def _roi_align(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    oh, ow = int(attrs["output_height"]), int(attrs["output_width"])
    mode = attrs["mode"]
    geometry = dict(spatial_scale=float(attrs["spatial_scale"]), output_height=oh, output_width=ow,
                    sampling_ratio=int(attrs["sampling_ratio"]),
                    half_pixel=attrs["coordinate_transformation_mode"] == "half_pixel")
    h, w = ins[0].shape[2:]

    def kernel(x, rois, batch_indices, out):
        for r in range(rois.shape[0]):
            y0, x0, bh, bw, gy, gx = roi_geometry(rois[r], **geometry)
            if gy == 0 or gx == 0:
                out[r] = 0
                continue
            ys = (y0 + np.arange(oh)[:, None] * bh + (np.arange(gy) + 0.5) * bh / gy).reshape(-1)
            xs = (x0 + np.arange(ow)[:, None] * bw + (np.arange(gx) + 0.5) * bw / gx).reshape(-1)
            yl, yh, wyl, wyh, iny = _roi_axis(ys, h)
            xl, xh, wxl, wxh, inx = _roi_axis(xs, w)
            keep = (iny[:, None] & inx[None, :])
            img = np.asarray(x[int(batch_indices[r])], np.float64)
            terms = [wy[:, None] * wx[None, :] * keep * img[:, ry][:, :, rx]
                     for ry, wy in ((yl, wyl), (yh, wyh)) for rx, wx in ((xl, wxl), (xh, wxh))]
            v = (sum(terms) if mode == "avg" else np.maximum.reduce(terms)).reshape(-1, oh, gy, ow, gx)
            out[r] = v.mean(axis=(2, 4)) if mode == "avg" else v.max(axis=(2, 4))
    return kernel
