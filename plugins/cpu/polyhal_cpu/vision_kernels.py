"""CPU kernels of the sampling ops (:mod:`polyhal.ops.vision`): ``grid_sample`` and ``roi_align``.

float32 and float64 images run compiled loops (:mod:`polyhal_cpu.vision_loops`: the taps of each
point once, then a weighted sum per point and channel; RoiAlign's over a channels-last copy of
the images, channels at a time), split across the backend's threads by batch or ROI where the
work pays for a hand-off. Without numba (or with float16), the numpy
path: both are vectorised over every output point at once: an interpolation is separable, so each
spatial dim contributes a few (index, weight) taps per point, computed as whole arrays with the
op's per-dim arithmetic; a kernel then does one gather per combination of taps (1, 2^r or 4^r of
them) and accumulates in float64. No Python loop runs per point; ``roi_align`` loops per ROI
(its bins have per-ROI sizes).
"""

from __future__ import annotations

import itertools

import numpy as np

from polyhal.ops.vision import grid_coordinate, grid_index, grid_taps, roi_geometry
from polyhal_cpu.parallel import MIN_ELEMENTS, parallel
from polyhal_cpu.table import TABLE, Kernel, Types, compiled_loops

_NATIVE = (np.dtype(np.float32), np.dtype(np.float64))
#: Output elements per MIN_ELEMENTS from which the loops split across threads (a hand-off costs
#: ~30-80 us; a tap costs ~1 ns).
_SPLIT_FACTOR = 1
#: RoiAlign's work (ns) from which it splits across threads, and a tap's cost on a channel when
#: the images are read channels last (64 ROIs x 32 channels x 7 x 7 bins x 16 taps: ~0.27 ms on
#: one thread of a 2-core VM); a sampling ratio of 0 (adaptive) is counted as 2.
_ROI_SPLIT_NS, _ROI_TAP_NS = 500_000, 0.17


def _roi_split_factor(attrs: dict, ins: Types) -> float:
    ratio = max(int(attrs["sampling_ratio"]), 2)
    return _ROI_SPLIT_NS / (_ROI_TAP_NS * 4 * ratio * ratio) / MIN_ELEMENTS


def _loops(dtype):
    return compiled_loops("vision_loops") if dtype in _NATIVE else None


@TABLE.register("grid_sample")
@parallel(split_inputs=lambda attrs, ins: (True, ins[0].shape[0] > 1), factor=_SPLIT_FACTOR)
def _grid_sample(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    # Split by batch (x and grid cut alike), or for a batch of one by channel (the grid whole).
    mode, padding = attrs["mode"], attrs["padding_mode"]
    align = bool(attrs["align_corners"])
    n, c, *dims = ins[0].shape
    points = int(np.prod(ins[1].shape[1:-1], dtype=np.int64))
    rank = len(dims)
    loops = _loops(ins[0].dtype)
    if loops is not None:
        sample = loops.grid_sample
        codes = (loops.MODES.index(mode), loops.PADDINGS.index(padding))
        sizes = np.array(dims, np.int64)

        def kernel(x, grid, out):
            g = np.ascontiguousarray(grid.reshape(grid.shape[0], points, rank), np.float64)
            dst = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)  # (a strided view)
            sample(np.ascontiguousarray(x).reshape(n, c, -1), g, sizes, *codes, align, dst.reshape(n, c, points))
            if dst is not out:
                np.copyto(out, dst)
        return kernel

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
@parallel(split_inputs=lambda attrs, ins: (ins[1].shape[0] == 1, ins[1].shape[0] > 1, ins[1].shape[0] > 1),
          factor=_roi_split_factor)
def _roi_align(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    # Split by ROI (x whole), or for one ROI by channel (x cut alike).
    oh, ow = int(attrs["output_height"]), int(attrs["output_width"])
    mode = attrs["mode"]
    geometry = dict(spatial_scale=float(attrs["spatial_scale"]), output_height=oh, output_width=ow,
                    sampling_ratio=int(attrs["sampling_ratio"]),
                    half_pixel=attrs["coordinate_transformation_mode"] == "half_pixel")
    h, w = ins[0].shape[2:]
    loops = _loops(ins[0].dtype)
    if loops is not None:
        align, dtype = loops.roi_align, ins[0].dtype
        params = np.array([geometry["spatial_scale"], geometry["half_pixel"], geometry["sampling_ratio"]], np.float64)
        average = mode == "avg"

        def kernel(x, rois, batch_indices, out):
            if batch_indices.size and (batch_indices.min() < 0 or batch_indices.max() >= x.shape[0]):
                raise IndexError(f"roi_align: a batch index is out of range for the {x.shape[0]} images of x")
            dst = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)  # (a strided view)
            align(np.ascontiguousarray(x), np.ascontiguousarray(rois, dtype), np.ascontiguousarray(batch_indices),
                  params, average, dst)
            if dst is not out:
                np.copyto(out, dst)
        return kernel

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
