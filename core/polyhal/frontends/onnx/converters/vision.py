"""Vision, signal and linear-algebra ops: Det (a core op), GridSample, RoiAlign (core sampling ops), Col2Im and MaxUnpool (a grouped
conv_transpose and a scatter), STFT (frames gathered, windowed and transformed by the DFT
matrix), MelWeightMatrix (a constant), and the ops polyhal refuses with a reason (training-only
optimizers). ImageDecoder is in :mod:`~polyhal.frontends.onnx.converters.images`.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.signal import dft_matrix
from polyhal.frontends.onnx.converters.tensor import ints, reshape
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.types import np_dtype

_I64 = np.dtype(np.int64)
#: GridSample's opset-16 mode names and their opset-20 ones.
_GRID_MODE = {"bilinear": "linear", "bicubic": "cubic", "linear": "linear", "cubic": "cubic", "nearest": "nearest"}


def _scalar(ctx: NodeContext, i: int, what: str):
    v = ctx.const(i, what)
    return None if v is None else np.asarray(v).reshape(-1)[0]


@converter("GridSample")
def _grid_sample(ctx: NodeContext) -> list:
    mode = str(ctx.attr("mode", "linear" if ctx.opset >= 20 else "bilinear"))
    if mode not in _GRID_MODE:
        raise OnnxModelError(f"GridSample mode {mode!r} is not one of {', '.join(_GRID_MODE)}")
    return [ctx.op("grid_sample", ctx.input(0), ctx.input(1), mode=_GRID_MODE[mode],
                   padding_mode=str(ctx.attr("padding_mode", "zeros")),
                   align_corners=bool(ctx.attr("align_corners", 0)))]


@converter("RoiAlign")
def _roi_align(ctx: NodeContext) -> list:
    x, rois, batch = ctx.input(0), ctx.input(1), ctx.input(2)
    if ctx.dtype(batch) != _I64:
        batch = ctx.op("cast", batch, dtype=_I64)
    transform = ctx.attr("coordinate_transformation_mode", "half_pixel" if ctx.opset >= 16 else "output_half_pixel")
    return [ctx.op("roi_align", x, rois, batch, mode=str(ctx.attr("mode", "avg")),
                   output_height=int(ctx.attr("output_height", 1)), output_width=int(ctx.attr("output_width", 1)),
                   sampling_ratio=int(ctx.attr("sampling_ratio", 0)),
                   spatial_scale=float(ctx.attr("spatial_scale", 1.0)), coordinate_transformation_mode=str(transform))]


@converter("Col2Im")
def _col2im(ctx: NodeContext) -> list:
    """Col2Im sums each column's block back into the image: a conv_transpose, grouped per channel,
    whose kernel routes input channel (c, k) to block position k of output channel c."""
    x = ctx.input(0)
    image = ints(ctx.const(1, "image_shape"))
    block = ints(ctx.const(2, "block_shape"))
    r = len(block)
    strides = [int(s) for s in ctx.attr("strides", [1] * r)]
    dilations = [int(d) for d in ctx.attr("dilations", [1] * r)]
    pads = [int(p) for p in ctx.attr("pads", [0] * 2 * r)]
    n, ck, cols = ctx.shape(x)
    k = int(np.prod(block))
    if len(image) != r or ck % k:
        raise OnnxModelError(f"Col2Im: input {ctx.shape(x)} needs C * prod(block_shape {block}) channels and "
                             f"image_shape of {r} dims, got image_shape {image}")
    grid = [(image[i] + pads[i] + pads[i + r] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(r)]
    if int(np.prod(grid)) != cols:
        raise OnnxModelError(f"Col2Im: {cols} columns do not match the {grid} block positions that image_shape "
                             f"{image}, block_shape {block}, strides, dilations and pads give")
    c = ck // k
    w = np.zeros((ck, 1, *block), ctx.dtype(x))
    for ch in range(c):
        for kk in range(k):
            w[(ch * k + kk, 0, *np.unravel_index(kk, block))] = 1
    span = [(grid[i] - 1) * strides[i] + dilations[i] * (block[i] - 1) + 1 - pads[i] - pads[i + r] for i in range(r)]
    y = ctx.op("conv_transpose", reshape(ctx, x, (n, ck, *grid)), w, strides=strides, pads=pads, dilations=dilations,
               group=c, output_padding=[image[i] - span[i] for i in range(r)])
    return [y]


@converter("MaxUnpool")
def _max_unpool(ctx: NodeContext) -> list:
    """Scatter the values to their flat indices in a zero tensor of the unpooled shape (what
    MaxPool's Indices count over), then pad to output_shape when one is given."""
    x, idx = ctx.input(0), ctx.input(1)
    xs = ctx.shape(x)
    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    r = len(kernel)
    strides = [int(s) for s in ctx.attr("strides", [1] * r)]
    pads = [int(p) for p in ctx.attr("pads", [0] * 2 * r)]
    inferred = list(xs[:2]) + [(xs[2 + i] - 1) * strides[i] - pads[i] - pads[i + r] + kernel[i] for i in range(r)]
    total = int(np.prod(inferred))
    if ctx.dtype(idx) != _I64:
        idx = ctx.op("cast", idx, dtype=_I64)
    flat = ctx.op("scatter_elements", ctx.full((total,), 0, ctx.dtype(x)), reshape(ctx, idx, (-1,)),
                  reshape(ctx, x, (-1,)), axis=0)
    y = reshape(ctx, flat, inferred)
    if ctx.has(2):
        shape = ints(ctx.const(2, "output_shape"))
        if len(shape) != len(inferred) or any(s < i for s, i in zip(shape, inferred)):
            raise OnnxModelError(f"MaxUnpool output_shape {shape} is smaller than the unpooled shape {inferred}")
        if shape != inferred:
            y = ctx.op("pad", y, pads=[0] * len(shape) + [s - i for s, i in zip(shape, inferred)])
    return [y]


@converter("STFT")
def _stft(ctx: NodeContext) -> list:
    x = ctx.input(0)
    batch, length, comps = ctx.shape(x)
    step = int(_scalar(ctx, 1, "frame_step"))
    window = ctx.input(2)
    fl = _scalar(ctx, 3, "frame_length") if ctx.has(3) else None
    frame = int(fl) if fl is not None else (ctx.shape(window)[0] if window is not None else length)
    onesided = bool(ctx.attr("onesided", 1))
    if step < 1 or not 1 <= frame <= length:
        raise OnnxModelError(f"STFT: frame_step {step} must be >= 1 and frame_length {frame} within the signal "
                             f"length {length}")
    if onesided and comps == 2:
        raise OnnxModelError("STFT: onesided output needs a real signal (last dim 1)")
    frames = (length - frame) // step + 1
    at = np.arange(frames)[:, None] * step + np.arange(frame)[None, :]
    y = ctx.op("gather", x, at.astype(_I64), axis=1)  # [batch, frames, frame, comps]
    if window is not None:
        y = ctx.op("mul", y, reshape(ctx, window, (frame, 1)))
    t, bins, out_comps = dft_matrix(frame, comps, frame, inverse=False, onesided=onesided)
    y = ctx.op("matmul", reshape(ctx, y, (batch, frames, frame * comps)), t.astype(ctx.dtype(x)))
    return [reshape(ctx, y, (batch, frames, bins, out_comps))]


@converter("MelWeightMatrix")
def _mel_weight_matrix(ctx: NodeContext) -> list:
    """The triangular mel filter bank ONNX defines, computed once (its operands are sizes)."""
    mels, dft_length, rate = (int(_scalar(ctx, i, w)) for i, w in
                              enumerate(("num_mel_bins", "dft_length", "sample_rate")))
    low, high = float(_scalar(ctx, 3, "lower_edge_hertz")), float(_scalar(ctx, 4, "upper_edge_hertz"))
    if mels < 1 or dft_length < 1 or rate < 1:
        raise OnnxModelError(f"MelWeightMatrix: num_mel_bins {mels}, dft_length {dft_length} and sample_rate {rate} "
                             "must be >= 1")

    def to_mel(hz: float) -> float:
        return 2595 * np.log1p(hz / 700) / np.log(10)
    step = (to_mel(high) - to_mel(low)) / (mels + 2)
    hz = 700 * np.expm1((np.arange(mels + 2) * step + to_mel(low)) / 2595 * np.log(10))
    edges = (((dft_length + 1) * hz) // rate).astype(int)
    out = np.zeros((dft_length // 2 + 1, mels))
    for i in range(mels):
        lo, mid, hi = edges[i], edges[i + 1], edges[i + 2]
        if mid == lo:
            out[mid, i] = 1
        else:
            out[lo:mid + 1, i] = (np.arange(lo, mid + 1) - lo) / (mid - lo)
        if hi > mid:
            out[mid:hi, i] = (hi - np.arange(mid, hi)) / (hi - mid)
    return [out.astype(np_dtype(int(ctx.attr("output_datatype", 1)), "MelWeightMatrix's output_datatype"))]


@converter("Adam", "Adagrad", "Momentum", domain="ai.onnx.preview.training")
def _training(ctx: NodeContext) -> list:
    raise OnnxUnsupportedError(f"{ctx.op_type} is a training-only optimizer update (ai.onnx.preview.training); "
                               "polyhal runs inference models: apply the update in the training framework")


@converter("Det")
def _det(ctx: NodeContext) -> list:
    return [ctx.op("det", ctx.input(0))]


@converter("DeformConv")
def _deform_conv(ctx: NodeContext) -> list:
    """Deformable convolution: each offset group's input is bilinearly sampled (grid_sample,
    zeros outside) at the kernel taps moved by the offsets, scaled by the mask, and the columns
    are multiplied by the weights per group (one batched matmul)."""
    x, w, offset, bias, mask = (ctx.input(i) for i in range(5))
    if ctx.rank(x) != 4:
        raise OnnxUnsupportedError(f"DeformConv on a {ctx.rank(x) - 2}-D input (polyhal's is 2-D)")
    n, c, h, wd = ctx.shape(x)
    oc, cg, kh, kw = ctx.shape(w)
    oh, ow = ctx.shape(offset)[2:]
    group, og = int(ctx.attr("group", 1)), int(ctx.attr("offset_group", 1))
    strides = [int(s) for s in ctx.attr("strides", [1, 1])]
    dil = [int(d) for d in ctx.attr("dilations", [1, 1])]
    pads = [int(p) for p in ctx.attr("pads", [0, 0, 0, 0])]
    k, dt = kh * kw, ctx.dtype(x)
    if cg * group != c or oc % group or c % og or ctx.shape(offset)[1] != og * k * 2:
        raise OnnxModelError(f"DeformConv: X {ctx.shape(x)}, W {ctx.shape(w)}, offset {ctx.shape(offset)} do not fit "
                             f"group={group}, offset_group={og}")
    # Tap positions before the offsets, per (kernel tap, output row/column), as normalized grid
    # coordinates of grid_sample without align_corners: g = (2 p + 1) / size - 1.
    ty, tx = np.meshgrid(np.arange(kh) * dil[0], np.arange(kw) * dil[1], indexing="ij")
    base_y = ty.reshape(k, 1, 1) + (np.arange(oh) * strides[0] - pads[0]).reshape(1, oh, 1)
    base_x = tx.reshape(k, 1, 1) + (np.arange(ow) * strides[1] - pads[1]).reshape(1, 1, ow)
    off = reshape(ctx, offset, (n, og, k, 2, oh, ow))

    def normalized(axis: int, base: np.ndarray, size: int):
        p = ctx.op("add", ctx.op("gather", off, np.array(axis, _I64), axis=3), base.astype(dt))
        return reshape(ctx, ctx.op("sub", ctx.op("mul", p, ctx.scalar(2.0 / size, dt)),
                                   ctx.scalar(1.0 - 1.0 / size, dt)), (n, og, k, oh, ow, 1))
    grid = ctx.op("concat", normalized(1, base_x, wd), normalized(0, base_y, h), axis=-1)
    if mask is not None:
        mask = reshape(ctx, mask, (n, og, 1, k, oh * ow))
    per = c // og
    cols = []
    for g in range(og):
        xg = x if og == 1 else ctx.op("gather", x, np.arange(g * per, (g + 1) * per, dtype=_I64), axis=1)
        gg = reshape(ctx, ctx.op("gather", grid, np.array(g, _I64), axis=1), (n, k * oh, ow, 2))
        s = reshape(ctx, ctx.op("grid_sample", xg, gg, mode="linear", padding_mode="zeros", align_corners=False),
                    (n, per, k, oh * ow))
        if mask is not None:
            s = ctx.op("mul", s, ctx.op("gather", mask, np.array(g, _I64), axis=1))
        cols.append(s)
    col = cols[0] if og == 1 else ctx.op("concat", *cols, axis=1)
    y = ctx.op("matmul", reshape(ctx, w, (group, oc // group, cg * k)), reshape(ctx, col, (n, group, cg * k, oh * ow)))
    y = reshape(ctx, y, (n, oc, oh, ow))
    if bias is not None:
        y = ctx.op("add", y, reshape(ctx, bias, (oc, 1, 1)))
    return [y]


def max_pool_indices(ctx: NodeContext, x, out_spatial, kernel, strides, dilations, pads, storage_order: int):
    """MaxPool's Indices output: per window, the flat index (over the whole input, row-major, or
    with the spatial dims column-major for ``storage_order=1``) of its first maximum. The padded
    input's windows are gathered as [N, C, windows, taps], argmax picks the tap, and a constant
    table maps (window, tap) to the unpadded index."""
    n, c, *spatial = ctx.shape(x)
    r = len(spatial)
    dt = ctx.dtype(x)
    low = np.finfo(dt).min if dt.kind == "f" else np.iinfo(dt).min
    ends = [max((out_spatial[i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - spatial[i] - pads[i], 0)
            for i in range(r)]
    xp = ctx.op("pad", x, pads=[0, 0, *pads[:r], 0, 0, *ends], mode="constant", value=float(-np.inf) if dt.kind == "f"
                else int(low))
    padded = ctx.shape(xp)[2:]
    win = np.stack(np.meshgrid(*(np.arange(o) * s for o, s in zip(out_spatial, strides)), indexing="ij"), -1).reshape(-1, 1, r)
    tap = np.stack(np.meshgrid(*(np.arange(k) * d for k, d in zip(kernel, dilations)), indexing="ij"), -1).reshape(1, -1, r)
    pos = win + tap  # [windows, taps, r] in padded coordinates
    gather_at = np.ravel_multi_index(tuple(np.moveaxis(pos, -1, 0)), padded)
    orig = pos - np.array(pads[:r])
    inside = np.all((orig >= 0) & (orig < np.array(spatial)), axis=-1)
    orig = np.where(inside[..., None], orig, 0)
    order = "F" if storage_order else "C"
    flat = np.ravel_multi_index(tuple(np.moveaxis(orig, -1, 0)), spatial, order=order)
    vals = ctx.op("gather", reshape(ctx, xp, (n, c, -1)), gather_at.astype(_I64), axis=2)
    best = ctx.op("argmax", vals, axis=-1, keepdims=True)
    windows, taps = flat.shape
    idx = ctx.op("gather_elements", ctx.op("expand", flat.astype(_I64), shape=[n, c, windows, taps]), best, axis=-1)
    base = (np.arange(n * c, dtype=_I64) * int(np.prod(spatial))).reshape(n, c, 1, 1)
    return reshape(ctx, ctx.op("add", idx, base), (n, c, *out_spatial))


@converter("Bernoulli", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Multinomial")
def _random(ctx: NodeContext) -> list:
    raise OnnxUnsupportedError(f"{ctx.op_type} draws random numbers, and polyhal has no random-number ops; ONNX "
                               "leaves the generator unspecified, so feed the random tensor as an input instead")
