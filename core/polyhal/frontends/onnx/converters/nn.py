"""ONNX's neural-network ops: matrix products, convolution, pooling and normalisations.

Normalisations that polyhal has no single op for (BatchNormalization, InstanceNormalization,
LpNormalization, LayerNormalization with its optional statistics outputs) are composed from
reductions and elementwise ops. With known parameters BatchNormalization folds to one
multiply-add per element.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.elementwise import cast
from polyhal.frontends.onnx.converters.tensor import norm_axis, reshape
from polyhal.frontends.onnx.converters.vision import max_pool_indices
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError


@converter("MatMul")
def _matmul(ctx: NodeContext) -> list:
    return [ctx.op("matmul", ctx.input(0), ctx.input(1))]


@converter("Gemm")
def _gemm(ctx: NodeContext) -> list:
    a, b, c = ctx.input(0), ctx.input(1), ctx.input(2)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    ta, tb = bool(ctx.attr("transA", 0)), bool(ctx.attr("transB", 0))
    dt = ctx.dtype(a)
    if dt.kind == "f":
        args = (a, b) if c is None else (a, b, c)
        return [ctx.op("gemm", *args, alpha=alpha, beta=beta, trans_a=ta, trans_b=tb)]
    y = ctx.op("matmul", ctx.op("transpose", a) if ta else a, ctx.op("transpose", b) if tb else b)
    if alpha != 1.0:
        y = ctx.op("mul", y, ctx.scalar(alpha, dt))
    if c is not None:
        y = ctx.op("add", y, c if beta == 1.0 else ctx.op("mul", c, ctx.scalar(beta, dt)))
    return [y]


@converter("MatMulInteger")
def _matmul_integer(ctx: NodeContext) -> list:
    a, b = ctx.input(0), ctx.input(1)
    a = cast(ctx, a, np.int32)
    b = cast(ctx, b, np.int32)
    if ctx.has(2):
        za = cast(ctx, ctx.input(2), np.int32)
        if ctx.rank(za) == 1 and ctx.rank(a) >= 2:
            za = reshape(ctx, za, (ctx.shape(za)[0], 1))
        a = ctx.op("sub", a, za)
    if ctx.has(3):
        b = ctx.op("sub", b, cast(ctx, ctx.input(3), np.int32))
    return [ctx.op("matmul", a, b)]


# ------------------------------------------------------------------------------- conv, pooling

def _spatial_attrs(ctx: NodeContext, spatial: tuple[int, ...], kernel: tuple[int, ...]):
    """strides, dilations and [begin..., end...] pads, with auto_pad resolved."""
    n = len(spatial)
    strides = [int(s) for s in ctx.attr("strides", [1] * n)]
    dilations = [int(d) for d in ctx.attr("dilations", [1] * n)]
    pads = [int(p) for p in ctx.attr("pads", [0] * (2 * n))]
    if len(strides) != n or len(dilations) != n or len(pads) != 2 * n:
        raise OnnxModelError(f"strides {strides}, dilations {dilations} and pads {pads} do not fit "
                             f"{n} spatial dims")
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = [0] * (2 * n)
        for i, (d, k, s, dil) in enumerate(zip(spatial, kernel, strides, dilations)):
            out = -(-d // s)
            total = max((out - 1) * s + (k - 1) * dil + 1 - d, 0)
            small, big = total // 2, total - total // 2
            pads[i], pads[i + n] = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad == "VALID":
        pads = [0] * (2 * n)
    elif auto_pad != "NOTSET":
        raise OnnxModelError(f"auto_pad {auto_pad!r} is not one of NOTSET, SAME_UPPER, SAME_LOWER, VALID")
    return strides, dilations, pads


@converter("Conv")
def _conv(ctx: NodeContext) -> list:
    x, w, b = ctx.input(0), ctx.input(1), ctx.input(2)
    xs, ws = ctx.shape(x), ctx.shape(w)
    if len(xs) < 3:
        raise OnnxModelError(f"Conv needs (N, C, spatial...) input, got shape {list(xs)}")
    kernel = tuple(int(k) for k in ctx.attr("kernel_shape", ws[2:]))
    strides, dilations, pads = _spatial_attrs(ctx, xs[2:], kernel)
    args = (x, w) if b is None else (x, w, b)
    return [ctx.op("conv", *args, strides=strides, pads=pads, dilations=dilations, group=int(ctx.attr("group", 1)))]


@converter("ConvInteger")
def _conv_integer(ctx: NodeContext) -> list:
    x, w = ctx.input(0), ctx.input(1)
    xf, wf = cast(ctx, x, np.float64), cast(ctx, w, np.float64)
    if ctx.has(2):
        xf = ctx.op("sub", xf, cast(ctx, ctx.input(2), np.float64))
    if ctx.has(3):
        zw = cast(ctx, ctx.input(3), np.float64)
        if ctx.rank(zw) == 1:
            zw = reshape(ctx, zw, (ctx.shape(zw)[0],) + (1,) * (ctx.rank(w) - 1))
        wf = ctx.op("sub", wf, zw)
    kernel = tuple(int(k) for k in ctx.attr("kernel_shape", ctx.shape(w)[2:]))
    strides, dilations, pads = _spatial_attrs(ctx, ctx.shape(x)[2:], kernel)
    y = ctx.op("conv", xf, wf, strides=strides, pads=pads, dilations=dilations, group=int(ctx.attr("group", 1)))
    return [cast(ctx, y, np.int32)]


@converter("ConvTranspose")
def _conv_transpose(ctx: NodeContext) -> list:
    x, w, b = ctx.input(0), ctx.input(1), ctx.input(2)
    xs, ws = ctx.shape(x), ctx.shape(w)
    n = len(xs) - 2
    kernel = [int(k) for k in ctx.attr("kernel_shape", ws[2:])]
    strides = [int(s) for s in ctx.attr("strides", [1] * n)]
    dilations = [int(d) for d in ctx.attr("dilations", [1] * n)]
    out_pad = [int(p) for p in ctx.attr("output_padding", [0] * n)]
    pads = [int(p) for p in ctx.attr("pads", [0] * (2 * n))]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    out_shape = ctx.attr("output_shape", None)
    if out_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = ([int(d) for d in out_shape][-n:] if out_shape is not None
                  else [d * s for d, s in zip(xs[2:], strides)])
        pads = [0] * (2 * n)
        for i in range(n):
            total = strides[i] * (xs[2 + i] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1 - target[i]
            if total < 0:  # the output is larger than the full result: pad at the end with output_padding
                out_pad[i] -= total
                total = 0
            small, big = total // 2, total - total // 2
            pads[i], pads[i + n] = (small, big) if auto_pad != "SAME_UPPER" else (small, big)
            if auto_pad == "SAME_UPPER" or out_shape is not None:
                pads[i], pads[i + n] = total // 2, total - total // 2
    elif auto_pad == "VALID":
        pads = [0] * (2 * n)
    args = (x, w) if b is None else (x, w, b)
    return [ctx.op("conv_transpose", *args, strides=strides, pads=pads, dilations=dilations,
                   group=int(ctx.attr("group", 1)), output_padding=out_pad)]


def _pool(ctx: NodeContext, kind: str) -> list:
    x = ctx.input(0)
    xs = ctx.shape(x)
    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    strides, dilations, pads = _spatial_attrs(ctx, xs[2:], tuple(kernel))
    attrs = dict(kernel_shape=kernel, strides=strides, pads=pads, dilations=dilations,
                 ceil_mode=bool(ctx.attr("ceil_mode", 0)))
    if kind == "avg":
        attrs["count_include_pad"] = bool(ctx.attr("count_include_pad", 0))
    if kind == "lp":
        attrs["p"] = int(ctx.attr("p", 2))
    return [ctx.op(f"{kind}_pool", x, **attrs)]


@converter("MaxPool")
def _max_pool(ctx: NodeContext) -> list:
    (y,) = _pool(ctx, "max")
    if not ctx.wants(1):
        return [y]
    x = ctx.input(0)
    kernel = [int(k) for k in ctx.attr("kernel_shape")]
    strides, dilations, pads = _spatial_attrs(ctx, ctx.shape(x)[2:], tuple(kernel))
    return [y, max_pool_indices(ctx, x, ctx.shape(y)[2:], kernel, strides, dilations, pads,
                                int(ctx.attr("storage_order", 0)))]


@converter("AveragePool")
def _avg_pool(ctx: NodeContext) -> list:
    return _pool(ctx, "avg")


@converter("LpPool")
def _lp_pool(ctx: NodeContext) -> list:
    return _pool(ctx, "lp")


@converter("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(ctx: NodeContext) -> list:
    x = ctx.input(0)
    axes = list(range(2, ctx.rank(x)))
    if ctx.op_type == "GlobalAveragePool":
        return [ctx.op("reduce_mean", x, axes=axes, keepdims=True)]
    if ctx.op_type == "GlobalMaxPool":
        return [ctx.op("reduce_max", x, axes=axes, keepdims=True)]
    p = int(ctx.attr("p", 2))
    dt = ctx.dtype(x)
    s = ctx.op("reduce_sum", ctx.op("pow", ctx.op("abs", x), ctx.scalar(p, dt)), axes=axes, keepdims=True)
    return [ctx.op("pow", s, ctx.scalar(1.0 / p, dt))]


# ------------------------------------------------------------------------------ normalisations

def _per_channel(ctx: NodeContext, v, rank: int):
    """A (C,) parameter shaped (C, 1, ..., 1) to broadcast against (N, C, spatial...)."""
    return reshape(ctx, v, (ctx.shape(v)[0],) + (1,) * (rank - 2))


@converter("BatchNormalization")
def _batch_norm(ctx: NodeContext) -> list:
    x, scale, bias, mean, var = (ctx.input(i) for i in range(5))
    dt = ctx.dtype(x)
    eps = float(ctx.attr("epsilon", 1e-5))
    rank = ctx.rank(x)
    training = bool(ctx.attr("training_mode", 0)) if ctx.opset >= 14 else False
    if ctx.opset < 9 and not int(ctx.attr("spatial", 1)):
        raise OnnxUnsupportedError("BatchNormalization with spatial=0")
    if training or (ctx.opset < 14 and (ctx.wants(1) or ctx.wants(2))):
        if not training:
            raise OnnxUnsupportedError("BatchNormalization's running statistics outputs outside training mode")
        axes = [0] + list(range(2, rank))
        bm = ctx.op("reduce_mean", x, axes=axes, keepdims=False)
        centered = ctx.op("sub", x, _per_channel(ctx, bm, rank))
        bv = ctx.op("reduce_mean", ctx.op("mul", centered, centered), axes=axes, keepdims=False)
        inv = ctx.op("div", ctx.scalar(1, dt), ctx.op("sqrt", ctx.op("add", bv, ctx.scalar(eps, dt))))
        y = ctx.op("add", ctx.op("mul", ctx.op("mul", centered, _per_channel(ctx, inv, rank)),
                                 _per_channel(ctx, scale, rank)), _per_channel(ctx, bias, rank))
        momentum = float(ctx.attr("momentum", 0.9))
        mdt = ctx.dtype(mean)
        run_mean = ctx.op("add", ctx.op("mul", mean, ctx.scalar(momentum, mdt)),
                          ctx.op("mul", cast(ctx, bm, mdt), ctx.scalar(1 - momentum, mdt)))
        run_var = ctx.op("add", ctx.op("mul", var, ctx.scalar(momentum, mdt)),
                         ctx.op("mul", cast(ctx, bv, mdt), ctx.scalar(1 - momentum, mdt)))
        return [y, run_mean, run_var]
    # y = (x - mean) / sqrt(var + eps) * scale + bias = x * a + (bias - mean * a)
    a = ctx.op("div", cast(ctx, scale, dt), ctx.op("sqrt", ctx.op("add", cast(ctx, var, dt), ctx.scalar(eps, dt))))
    c = ctx.op("sub", cast(ctx, bias, dt), ctx.op("mul", cast(ctx, mean, dt), a))
    return [ctx.op("add", ctx.op("mul", x, _per_channel(ctx, a, rank)), _per_channel(ctx, c, rank))]


@converter("InstanceNormalization")
def _instance_norm(ctx: NodeContext) -> list:
    x, scale, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    dt = ctx.dtype(x)
    rank = ctx.rank(x)
    eps = float(ctx.attr("epsilon", 1e-5))
    axes = list(range(2, rank))
    mean = ctx.op("reduce_mean", x, axes=axes, keepdims=True)
    centered = ctx.op("sub", x, mean)
    var = ctx.op("reduce_mean", ctx.op("mul", centered, centered), axes=axes, keepdims=True)
    y = ctx.op("div", centered, ctx.op("sqrt", ctx.op("add", var, ctx.scalar(eps, dt))))
    return [ctx.op("add", ctx.op("mul", y, _per_channel(ctx, scale, rank)), _per_channel(ctx, bias, rank))]


@converter("LayerNormalization")
def _layer_norm(ctx: NodeContext) -> list:
    x, scale, bias = ctx.input(0), ctx.input(1), ctx.input(2)
    shape = ctx.shape(x)
    dt = ctx.dtype(x)
    axis = norm_axis(int(ctx.attr("axis", -1)), len(shape))
    eps = float(ctx.attr("epsilon", 1e-5))
    norm_shape = shape[axis:]
    if not ctx.wants(1) and not ctx.wants(2) and dt.kind == "f":
        if ctx.shape(scale) != norm_shape:
            scale = ctx.op("expand", scale, shape=list(norm_shape))
        if bias is None:
            bias = np.zeros(norm_shape, dt)
        elif ctx.shape(bias) != norm_shape:
            bias = ctx.op("expand", bias, shape=list(norm_shape))
        return [ctx.op("layer_norm", x, scale, bias, axis=axis, epsilon=eps)]
    # With the statistics outputs: compose, in the stash type (float32 unless stash_type says).
    stash = np.float32 if int(ctx.attr("stash_type", 1)) == 1 else dt
    xs = cast(ctx, x, stash)
    axes = list(range(axis, len(shape)))
    mean = ctx.op("reduce_mean", xs, axes=axes, keepdims=True)
    centered = ctx.op("sub", xs, mean)
    var = ctx.op("reduce_mean", ctx.op("mul", centered, centered), axes=axes, keepdims=True)
    inv = ctx.op("div", ctx.scalar(1, stash), ctx.op("sqrt", ctx.op("add", var, ctx.scalar(eps, stash))))
    y = cast(ctx, ctx.op("mul", centered, inv), dt)
    y = ctx.op("mul", y, scale)
    if bias is not None:
        y = ctx.op("add", y, bias)
    return [y, mean, inv]


@converter("LpNormalization")
def _lp_norm(ctx: NodeContext) -> list:
    x = ctx.input(0)
    axis = norm_axis(int(ctx.attr("axis", -1)), ctx.rank(x))
    p = int(ctx.attr("p", 2))
    if p == 1:
        norm = ctx.op("reduce_sum", ctx.op("abs", x), axes=[axis], keepdims=True)
    elif p == 2:
        norm = ctx.op("sqrt", ctx.op("reduce_sum", ctx.op("mul", x, x), axes=[axis], keepdims=True))
    else:
        raise OnnxModelError(f"LpNormalization p must be 1 or 2, got {p}")
    # ONNX's reference leaves a zero vector zero (0/0 would be nan).
    zero = ctx.scalar(0, ctx.dtype(x))
    safe = ctx.op("where", ctx.op("equal", norm, zero), ctx.scalar(1, ctx.dtype(x)), norm)
    return [ctx.op("div", x, safe)]


@converter("LRN")
def _lrn(ctx: NodeContext) -> list:
    """x / (bias + alpha / size * sum of x^2 over ``size`` neighbouring channels) ** beta."""
    x = ctx.input(0)
    size = int(ctx.attr("size"))
    alpha, beta, bias = float(ctx.attr("alpha", 1e-4)), float(ctx.attr("beta", 0.75)), float(ctx.attr("bias", 1.0))
    dt, rank = ctx.dtype(x), ctx.rank(x)
    c = ctx.shape(x)[1]
    sq = ctx.op("mul", x, x)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    pads = [0] * (2 * rank)
    pads[1], pads[1 + rank] = before, after
    padded = ctx.op("pad", sq, pads=pads, mode="constant", value=0.0)
    total = None
    for k in range(size):
        window = ctx.op("slice", padded, starts=[k], ends=[k + c], axes=[1], steps=[1])
        total = window if total is None else ctx.op("add", total, window)
    scale = ctx.op("add", ctx.op("mul", total, ctx.scalar(alpha / size, dt)), ctx.scalar(bias, dt))
    return [ctx.op("div", x, ctx.op("pow", scale, ctx.scalar(beta, dt)))]
