"""Quantization: QuantizeLinear, DequantizeLinear (per tensor, per axis and blocked; integer,
int4/uint4/int2/uint2, float8 and float4 types), DynamicQuantizeLinear, QLinearMatMul and
QLinearConv.

Everything is computed in float (float32, or float64 where the operands are; ONNX defines the
ops that way: divide, round half to even, add the zero point, saturate), with the elementwise
ops, so the arithmetic runs on any device; only the conversions to and from the low-precision
storage types (bfloat16, float8, int4, ...) need the CPU's kernels. Blocked parameters are
repeated along their axis by one ``gather``.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.elementwise import _FLOAT8, cast, onnx_cast
from polyhal.frontends.onnx.converters.nn import _spatial_attrs
from polyhal.frontends.onnx.converters.tensor import norm_axis, reshape
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.types import np_dtype
from polyhal.ir.types import DTypeSet

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_UINT8 = np.dtype(np.uint8)
#: float4e2m1 (a set of the one type, as the sets below: ml_dtypes is imported only once one of
#: its types can exist, :class:`~polyhal.ir.types.DTypeSet`).
_FLOAT4 = DTypeSet(("float4_e2m1fn",))
#: The integer types ONNX quantizes to, numpy's and ml_dtypes' sub-byte ones.
_QUANT_INT = DTypeSet(("int4", "uint4", "int2", "uint2"), frozenset(np.dtype(n) for n in ("int8", "uint8", "int16", "uint16")))


def _param(ctx: NodeContext, p, x, axis: int, block_size: int, dtype: np.dtype):
    """Quantization parameter ``p`` (a scale or zero point) as ``dtype``, shaped to broadcast
    against ``x``: a scalar (per tensor), a 1-D tensor along ``axis`` (per axis), or with
    ``block_size``, a tensor of ``x``'s rank whose ``axis`` has one entry per block."""
    p = cast(ctx, p, dtype)
    rank, shape = ctx.rank(x), ctx.shape(x)
    if ctx.rank(p) == 0 or ctx.type(p).size == 1 and ctx.rank(p) <= 1:
        return reshape(ctx, p, ())
    axis = norm_axis(axis, rank)
    if not block_size:
        if ctx.rank(p) != 1 or ctx.shape(p)[0] != shape[axis]:
            raise OnnxModelError(f"{ctx.op_type}: a per-axis parameter must have shape [{shape[axis]}] "
                                 f"(input dim {axis}), got {list(ctx.shape(p))}; blocked quantization "
                                 "needs the block_size attribute")
        return reshape(ctx, p, (shape[axis],) + (1,) * (rank - axis - 1))
    if block_size < 0:
        raise OnnxModelError(f"{ctx.op_type}: block_size must be positive, got {block_size}")
    blocks = -(-shape[axis] // block_size)
    want = tuple(blocks if d == axis else n for d, n in enumerate(shape))
    if tuple(ctx.shape(p)) != want:
        raise OnnxModelError(f"{ctx.op_type}: with block_size {block_size} along axis {axis} a parameter "
                             f"must have shape {list(want)} for input shape {list(shape)}, got "
                             f"{list(ctx.shape(p))}")
    index = np.arange(shape[axis], dtype=np.int64) // block_size
    return ctx.op("gather", p, index, axis=axis)


def _saturate(ctx: NodeContext, y, dtype: np.dtype):
    """Float ``y`` (already integral) clamped to integer type ``dtype``'s range and converted."""
    try:
        info = np.iinfo(dtype)
    except ValueError:  # a sub-byte integer of ml_dtypes (imported already: ``dtype`` is one of its types)
        import ml_dtypes

        info = ml_dtypes.iinfo(dtype)
    y = ctx.op("maximum", ctx.op("minimum", y, ctx.scalar(info.max, ctx.dtype(y))), ctx.scalar(info.min, ctx.dtype(y)))
    return cast(ctx, y, dtype)


def _float_of(*dtypes: np.dtype) -> np.dtype:
    """float64 if any of ``dtypes`` is, else float32: where quantization arithmetic happens."""
    return _F64 if _F64 in dtypes else _F32


def _quantize(ctx: NodeContext, x, scale, zero_point, out: np.dtype, axis: int, block_size: int = 0,
              saturate: bool = True, precision: np.dtype | None = None):
    work = precision or _float_of(ctx.dtype(x), ctx.dtype(scale))
    y = ctx.op("div", cast(ctx, x, work), _param(ctx, scale, x, axis, block_size, work))
    if out in _FLOAT8:  # ONNX: a float8 zero point is zero
        return onnx_cast(ctx, y, out, saturate)
    if out in _FLOAT4:
        if zero_point is not None:
            y = ctx.op("add", y, _param(ctx, zero_point, x, axis, block_size, work))
        return cast(ctx, y, out)
    y = cast(ctx, ctx.op("round", y), _float_of(work))  # zero points up to 65535 stay exact
    if zero_point is not None:
        y = ctx.op("add", y, _param(ctx, zero_point, x, axis, block_size, ctx.dtype(y)))
    return _saturate(ctx, y, out)


@converter("QuantizeLinear")
def _quantize_linear(ctx: NodeContext) -> list:
    x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
    out_attr = int(ctx.attr("output_dtype", 0))
    out = np_dtype(out_attr, "QuantizeLinear's output_dtype") if out_attr else None
    if zp is not None:
        if out is not None and out != ctx.dtype(zp):
            raise OnnxModelError(f"QuantizeLinear: output_dtype {out} differs from the zero point's type "
                                 f"{ctx.dtype(zp)}")
        out = ctx.dtype(zp)
    out = out or _UINT8
    if out not in _QUANT_INT and out not in _FLOAT8 and out not in _FLOAT4:
        raise OnnxUnsupportedError(f"QuantizeLinear to {out}: ONNX quantizes to (u)int2/4/8/16, float8 or "
                                   "float4e2m1")
    prec = int(ctx.attr("precision", 0))
    return [_quantize(ctx, x, scale, zp, out, int(ctx.attr("axis", 1)), int(ctx.attr("block_size", 0)),
                      bool(ctx.attr("saturate", 1)), np_dtype(prec, "QuantizeLinear's precision") if prec else None)]


@converter("DequantizeLinear")
def _dequantize_linear(ctx: NodeContext) -> list:
    x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
    axis, block = int(ctx.attr("axis", 1)), int(ctx.attr("block_size", 0))
    out_attr = int(ctx.attr("output_dtype", 0))
    out = np_dtype(out_attr, "DequantizeLinear's output_dtype") if out_attr else ctx.dtype(scale)
    work = _float_of(ctx.dtype(scale))
    y = cast(ctx, x, work)
    # ONNX: float8 and float4 values have no zero point (a float8 one must be zero).
    if zp is not None and ctx.dtype(x) not in _FLOAT8 and ctx.dtype(x) not in _FLOAT4:
        y = ctx.op("sub", y, _param(ctx, zp, x, axis, block, work))
    y = ctx.op("mul", y, _param(ctx, scale, x, axis, block, work))
    return [cast(ctx, y, out)]


@converter("DynamicQuantizeLinear")
def _dynamic_quantize_linear(ctx: NodeContext) -> list:
    return list(ctx.op("dynamic_quantize", ctx.input(0)))


def _dequantized(ctx: NodeContext, x, scale, zero_point, axis: int):
    """DequantizeLinear of integer ``x`` in float32, per tensor or along ``axis``: the form the
    int8 fusion matches (:mod:`polyhal.passes.fuse_quantized`)."""
    y = cast(ctx, x, _F32)
    if zero_point is not None:
        y = ctx.op("sub", y, _param(ctx, zero_point, x, axis, 0, _F32))
    return ctx.op("mul", y, _param(ctx, scale, x, axis, 0, _F32))


def _check_zero_point(ctx: NodeContext, x, zero_point, what: str) -> None:
    """ONNX: a zero point has its tensor's type."""
    if zero_point is not None and ctx.dtype(zero_point) != ctx.dtype(x):
        raise OnnxModelError(f"{ctx.op_type}: {what}_zero_point is {ctx.dtype(zero_point)} but {what} is "
                             f"{ctx.dtype(x)}; ONNX requires a zero point of its tensor's type (re-quantize the "
                             "model, or cast the zero point initializer)")


@converter("QLinearMatMul")
def _qlinear_matmul(ctx: NodeContext) -> list:
    a, sa, za, b, sb, zb, sy, zy = (ctx.input(i) for i in range(8))
    if ctx.dtype(a) not in _QUANT_INT or ctx.dtype(b) not in _QUANT_INT:
        raise OnnxUnsupportedError(f"QLinearMatMul on {ctx.dtype(a)} x {ctx.dtype(b)} (polyhal's are integer)")
    for v, z, what in ((a, za, "a"), (b, zb, "b")):
        _check_zero_point(ctx, v, z, what)
    # As DequantizeLinear -> MatMul -> QuantizeLinear in float32 (the QDQ form, which devices
    # with int8 kernels fuse back into one int8 matmul): a's per-row parameters along dim -2,
    # b's per-column ones along dim -1.
    af = _dequantized(ctx, a, sa, za, ctx.rank(a) - 2 if ctx.type(sa).size > 1 else 0)
    bf = _dequantized(ctx, b, sb, zb, ctx.rank(b) - 1 if ctx.type(sb).size > 1 else 0)
    return [_quantize(ctx, ctx.op("matmul", af, bf), sy, zy, ctx.dtype(zy), 0)]


@converter("QLinearConv")
def _qlinear_conv(ctx: NodeContext) -> list:
    x, sx, zx, w, sw, zw, sy, zy, bias = (ctx.input(i) for i in range(9))
    if ctx.dtype(x) not in _QUANT_INT or ctx.dtype(w) not in _QUANT_INT:
        raise OnnxUnsupportedError(f"QLinearConv on {ctx.dtype(x)} x {ctx.dtype(w)} (polyhal's are integer)")
    for v, z, what in ((x, zx, "x"), (w, zw, "w")):
        _check_zero_point(ctx, v, z, what)
    if zy is not None and ctx.dtype(zy) not in _QUANT_INT:
        raise OnnxModelError(f"QLinearConv: y_zero_point is {ctx.dtype(zy)}, not an integer type")
    # As DequantizeLinear -> Conv -> QuantizeLinear in float32 (the QDQ form, which devices with
    # int8 kernels fuse back into one int8 conv); the int32 bias in units of x_scale * w_scale.
    xf = _dequantized(ctx, x, sx, zx, 1)
    wf = _dequantized(ctx, w, sw, zw, 0)
    kernel = tuple(int(k) for k in ctx.attr("kernel_shape", ctx.shape(w)[2:]))
    strides, dilations, pads = _spatial_attrs(ctx, ctx.shape(x)[2:], kernel)
    args = [xf, wf]
    if bias is not None:
        bias_scale = ctx.op("mul", reshape(ctx, cast(ctx, sx, _F32), ()), reshape(ctx, cast(ctx, sw, _F32), (-1,)))
        args.append(ctx.op("mul", cast(ctx, bias, _F32), bias_scale))
    y = ctx.op("conv", *args, strides=strides, pads=pads, dilations=dilations, group=int(ctx.attr("group", 1)))
    return [_quantize(ctx, y, sy, zy, ctx.dtype(x) if zy is None else ctx.dtype(zy), 1)]
