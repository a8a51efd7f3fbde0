"""onnxruntime's ``com.microsoft`` quantized ops: what its quantizer writes in QOperator format
(``quantize_static`` / ``quantize_dynamic`` with ``QuantFormat.QOperator``) for everything but
Conv and MatMul, and the two integer matmuls its graph optimizer fuses dynamic quantization into.

``QGemm``, ``QLinearAdd``, ``QLinearMul``, ``QLinearSigmoid``, ``QLinearLeakyRelu``,
``QLinearAveragePool``, ``QLinearGlobalAveragePool``, ``QLinearConcat``, ``QLinearSoftmax``,
``QLinearWhere``, ``MatMulIntegerToFloat`` and ``DynamicQuantizeMatMul``.

Each is what onnxruntime computes, written with polyhal's portable ops, so it runs on every
device: the integer products of QGemm and the matmuls in float32 (exact while a dot product
stays below 2**24, as onnxruntime's int32 accumulator is), requantized in float32 with rounding
half to even; the others as the float op between a dequantize and a quantize (onnxruntime's
kernels are lookup tables or float loops of exactly that), so results match onnxruntime's
within one unit of the output's quantization step where a value lies on a rounding boundary.
"""

from __future__ import annotations

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.elementwise import cast
from polyhal.frontends.onnx.converters.quantize import _QUANT_INT, _dequantized, _quantize, _saturate
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.tensor import norm_axis, reshape
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.proto import pb

#: onnxruntime's contrib-op domain.
MS_DOMAIN = "com.microsoft"

_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)


def _scalar(ctx: NodeContext, p, what: str):
    """A per-tensor parameter (a scalar or one-element tensor) as a float32 scalar."""
    if ctx.type(p).size != 1:
        raise OnnxModelError(f"{ctx.op_type}: {what} must be a scalar or a one-element tensor (per tensor), "
                             f"got shape {list(ctx.shape(p))}")
    return reshape(ctx, cast(ctx, p, _F32), ())


def _dequantize(ctx: NodeContext, x, scale, zero_point):
    """``(x - zero_point) * scale`` in float32, per tensor."""
    if ctx.dtype(x) not in _QUANT_INT:
        raise OnnxUnsupportedError(f"{ctx.op_type} on {ctx.dtype(x)} (onnxruntime's are int8/uint8)")
    y = cast(ctx, x, _F32)
    if zero_point is not None:
        y = ctx.op("sub", y, _scalar(ctx, zero_point, "a zero point"))
    return ctx.op("mul", y, _scalar(ctx, scale, "a scale"))


def _requant(ctx: NodeContext, y, scale, zero_point, out: np.dtype):
    """Float ``y`` quantized per tensor to ``out`` (the zero point's type, else uint8)."""
    return _quantize(ctx, y, _scalar(ctx, scale, "the output scale"),
                     None if zero_point is None else reshape(ctx, zero_point, ()), out, 0, precision=_F32)


def _out_type(ctx: NodeContext, zero_point, x) -> np.dtype:
    return ctx.dtype(zero_point) if zero_point is not None else ctx.dtype(x)


def _float_node(ctx: NodeContext, op_type: str, inputs: list, *, drop: tuple[str, ...] = (),
                opset: int | None = None) -> object:
    """The result of ONNX op ``op_type`` on float ``inputs``, with this node's attributes (less
    ``drop``), converted by that op's own converter."""
    names = [f"x{i}" for i in range(len(inputs))]
    node = pb.NodeProto(op_type=op_type, input=names, output=["y"])
    node.attribute.extend(a for a in ctx.node.attribute if a.name not in drop)
    env = dict(zip(names, inputs))
    opsets = dict(ctx.opsets)
    opsets[""] = opset or ctx.importer.opset
    ctx.convert_nodes([node], env, opsets=opsets, scope=op_type)
    return env["y"]


def _channels_first(ctx: NodeContext, x, channels_last: bool):
    """An NHWC... input (``channels_last``) moved to NCHW..., and the permutation back."""
    if not channels_last:
        return x, None
    r = ctx.rank(x)
    to_first = [0, r - 1] + list(range(1, r - 1))
    back = [0] + list(range(2, r)) + [1]
    return ctx.op("transpose", x, perm=to_first), back


# ---------------------------------------------------------------------------------- matmuls

def _minus_zero_point(ctx: NodeContext, x, zero_point):
    """Integer ``x`` as int32 less its zero point (a scalar, or a 1-D one along x's last dim):
    exact, as onnxruntime's int32 accumulator is, and the MatMulInteger form the int8 fusion
    matches (:mod:`polyhal.passes.fuse_quantized`)."""
    y = cast(ctx, x, _I32)
    if zero_point is None:
        return y
    zp = cast(ctx, zero_point, _I32)
    if ctx.type(zp).size == 1:
        zp = reshape(ctx, zp, ())
    return ctx.op("sub", y, zp)


def _column_param(ctx: NodeContext, p):
    """A per-column (N,) scale as float32, broadcasting over the rows of the product."""
    p = cast(ctx, p, _F32)
    return reshape(ctx, p, ()) if ctx.type(p).size == 1 else reshape(ctx, p, (ctx.type(p).size,))


@converter("QGemm", domain=MS_DOMAIN)
def _qgemm(ctx: NodeContext) -> list:
    a, sa, za, b, sb, zb, c, sy, zy = (ctx.input(i) for i in range(9))
    if ctx.dtype(a) not in _QUANT_INT or ctx.dtype(b) not in _QUANT_INT:
        raise OnnxUnsupportedError(f"QGemm on {ctx.dtype(a)} x {ctx.dtype(b)} (onnxruntime's are int8/uint8)")
    trans_a, trans_b = bool(ctx.attr("transA", 0)), bool(ctx.attr("transB", 0))
    alpha = float(ctx.attr("alpha", 1.0))
    # As DequantizeLinear -> Gemm -> QuantizeLinear in float32 (the QDQ form, which devices with
    # int8 kernels fuse back into one int8 matmul); C (int32) is in units of a_scale * b_scale.
    af = _dequantize(ctx, a, sa, za)
    bf = _dequantized(ctx, b, sb, zb, (0 if trans_b else 1) if ctx.type(sb).size > 1 else 0)
    args = [af, bf]
    if c is not None:
        args.append(ctx.op("mul", cast(ctx, c, _F32), ctx.op("mul", ctx.op("mul", _scalar(ctx, sa, "a_scale"),
                                                                          _column_param(ctx, sb)),
                                                              np.array(alpha, _F32))))
    y = ctx.op("gemm", *args, alpha=alpha, beta=1.0, trans_a=trans_a, trans_b=trans_b)
    if sy is None:
        return [y]
    return [_requant(ctx, y, sy, zy, _out_type(ctx, zy, a))]


@converter("MatMulIntegerToFloat", domain=MS_DOMAIN)
def _matmul_integer_to_float(ctx: NodeContext) -> list:
    a, b, sa, sb, za, zb, bias = (ctx.input(i) for i in range(7))
    return [_integer_matmul(ctx, a, b, sa, sb, za, zb, bias)]


def _integer_matmul(ctx: NodeContext, a, b, sa, sb, za, zb, bias):
    """``(A - za) @ (B - zb) * sa * sb + bias`` in float32 (A's parameters per tensor or per row;
    B's per tensor or per column)."""
    if ctx.dtype(a) not in _QUANT_INT or ctx.dtype(b) not in _QUANT_INT:
        raise OnnxUnsupportedError(f"{ctx.op_type} on {ctx.dtype(a)} x {ctx.dtype(b)} (onnxruntime's are int8/uint8)")
    acc = cast(ctx, ctx.op("matmul", _minus_zero_point(ctx, a, za), _minus_zero_point(ctx, b, zb)), _F32)
    scale = ctx.op("mul", _column_param(ctx, sa), _column_param(ctx, sb))
    y = ctx.op("mul", acc, scale)
    return y if bias is None else ctx.op("add", y, cast(ctx, bias, _F32))


@converter("DynamicQuantizeMatMul", domain=MS_DOMAIN)
def _dynamic_quantize_matmul(ctx: NodeContext) -> list:
    a, b, sb, zb, bias = (ctx.input(i) for i in range(5))
    # A quantized to uint8 over its whole range as DynamicQuantizeLinear does (onnxruntime's kernel).
    aq, sa, za = ctx.op("dynamic_quantize", a)
    return [_integer_matmul(ctx, aq, b, sa, sb, za, zb, bias)]


# -------------------------------------------------------------------- float op between Q/DQ

@converter("QLinearAdd", "QLinearMul", domain=MS_DOMAIN)
def _qlinear_binary(ctx: NodeContext) -> list:
    a, sa, za, b, sb, zb, sc, zc = (ctx.input(i) for i in range(8))
    y = ctx.op("add" if ctx.op_type == "QLinearAdd" else "mul", _dequantize(ctx, a, sa, za), _dequantize(ctx, b, sb, zb))
    return [_requant(ctx, y, sc, zc, _out_type(ctx, zc, a))]


@converter("QLinearSigmoid", "QLinearLeakyRelu", domain=MS_DOMAIN)
def _qlinear_activation(ctx: NodeContext) -> list:
    x, sx, zx, sy, zy = (ctx.input(i) for i in range(5))
    y = _float_node(ctx, ctx.op_type[len("QLinear"):], [_dequantize(ctx, x, sx, zx)])
    return [_requant(ctx, y, sy, zy, _out_type(ctx, zy, x))]


@converter("QLinearAveragePool", "QLinearGlobalAveragePool", domain=MS_DOMAIN)
def _qlinear_pool(ctx: NodeContext) -> list:
    x, sx, zx, sy, zy = (ctx.input(i) for i in range(5))
    xf, back = _channels_first(ctx, _dequantize(ctx, x, sx, zx), bool(ctx.attr("channels_last", 0)))
    y = _float_node(ctx, ctx.op_type[len("QLinear"):], [xf], drop=("channels_last",))
    if back is not None:
        y = ctx.op("transpose", y, perm=back)
    return [_requant(ctx, y, sy, zy, _out_type(ctx, zy, x))]


@converter("QLinearConcat", domain=MS_DOMAIN)
def _qlinear_concat(ctx: NodeContext) -> list:
    sy, zy = ctx.input(0), ctx.input(1)
    if (ctx.num_inputs - 2) % 3 or ctx.num_inputs < 5:
        raise OnnxModelError("QLinearConcat takes Y_scale, Y_zero_point, then (X, X_scale, X_zero_point) per input")
    parts = [ctx.input(i) for i in range(2, ctx.num_inputs)]
    xs = [_dequantize(ctx, x, s, z) for x, s, z in zip(parts[0::3], parts[1::3], parts[2::3])]
    axis = norm_axis(int(ctx.attr("axis")), ctx.rank(xs[0]))
    return [_requant(ctx, ctx.op("concat", *xs, axis=axis), sy, zy, _out_type(ctx, zy, parts[0]))]


@converter("QLinearWhere", domain=MS_DOMAIN)
def _qlinear_where(ctx: NodeContext) -> list:
    cond, x, sx, zx, y, sy, zy, sz, zz = (ctx.input(i) for i in range(9))
    out = ctx.op("where", cond, _dequantize(ctx, x, sx, zx), _dequantize(ctx, y, sy, zy))
    return [_requant(ctx, out, sz, zz, _out_type(ctx, zz, x))]


@converter("QLinearSoftmax", domain=MS_DOMAIN)
def _qlinear_softmax(ctx: NodeContext) -> list:
    x, sx, zx, sy, zy = (ctx.input(i) for i in range(5))
    opset = int(ctx.attr("opset"))
    p = _float_node(ctx, "Softmax", [_dequantize(ctx, x, sx, zx)], drop=("opset",), opset=opset)
    # onnxruntime multiplies by floor(1 / y_scale) rather than dividing by y_scale (for the
    # quantizer's y_scale of 1/256 the same; for 1/255 one step less at the top).
    inverse = ctx.op("floor", ctx.op("div", np.array(1, _F32), _scalar(ctx, sy, "y_scale")))
    q = ctx.op("round", ctx.op("mul", p, inverse))
    if zy is not None:
        q = ctx.op("add", q, _scalar(ctx, zy, "y_zero_point"))
    return [_saturate(ctx, q, _out_type(ctx, zy, x))]
