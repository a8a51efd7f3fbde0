"""Quantized contractions: ``quantized_conv`` and ``quantized_matmul`` (int8 / uint8 operands, int8
weights, int32 accumulation, scales and zero points), what an ONNX QDQ conv or matmul
(DequantizeLinear -> Conv / MatMul -> QuantizeLinear, as onnxruntime's quantizer writes them),
QLinearConv, QLinearMatMul and MatMulInteger followed by its rescaling become on devices with
int8 kernels (:mod:`polyhal.passes.fuse_quantized`). Elsewhere those stay float ops.

Both are fused forms (``OpDef.fused``): only that pass creates them. Their arithmetic, in real
numbers::

    real = activation(contract((x - x_zero_point) x_scale, w w_scale) + bias)
    y    = saturate(round_half_even(real / y_scale) + y_zero_point)   # with y_scale, y_zero_point
    y    = real (float32)                                             # without them

with ``x_scale`` and ``x_zero_point`` one per tensor (x's element type for the zero point),
``w_scale`` one per tensor or one per output channel, ``bias`` float32 in real units. A device
computes the contraction exactly (int32) and rounds once when it requantizes: results may differ
from this float64 reference by one quantization step where ``real / y_scale`` lies within float32
rounding of a half.
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import DTypeError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import define, fmt_shape
from polyhal.ops.nn import _check_activation, _infer_conv, _ref_conv, _sample_conv, apply_activation

__all__ = ["QUANTIZED_TYPES", "dynamic_quantize_parameters"]

#: The element types of quantized maps (x, y) and of their zero points.
QUANTIZED_TYPES = frozenset(np.dtype(n) for n in ("int8", "uint8"))
_F32, _I8 = np.dtype(np.float32), np.dtype(np.int8)


def _scalar(t: TensorType, what: str, dtype) -> None:
    if t.size != 1 or t.rank > 1:
        raise ShapeError(f"{what} must be one value (shape () or (1,)), got {fmt_shape(t.shape)}")
    if t.dtype != np.dtype(dtype):
        raise DTypeError(f"{what} has element type {t.dtype}, expected {np.dtype(dtype)}")


def _check_quantized(x: TensorType, x_scale: TensorType, x_zero_point: TensorType, w: TensorType,
                     w_scale: TensorType, bias: TensorType, channels: int, out: tuple) -> np.dtype:
    """Check the operands; return the result's element type."""
    if x.dtype not in QUANTIZED_TYPES:
        raise DTypeError(f"x has element type {x.dtype}, expected int8 or uint8")
    _scalar(x_scale, "x_scale", _F32)
    _scalar(x_zero_point, f"x_zero_point (x is {x.dtype})", x.dtype)
    if w.dtype != _I8:
        raise DTypeError(f"w has element type {w.dtype}, expected int8")
    if w_scale.dtype != _F32 or w_scale.shape not in ((), (1,), (channels,)):
        raise ShapeError(f"w_scale must be float32 of shape () or ({channels},) (one per output channel), got "
                         f"{w_scale.dtype} {fmt_shape(w_scale.shape)}")
    if bias.dtype != _F32 or bias.shape != (channels,):
        raise ShapeError(f"bias must be float32 of shape ({channels},), got {bias.dtype} {fmt_shape(bias.shape)}")
    if not out:
        return _F32
    y_scale, y_zero_point = out
    _scalar(y_scale, "y_scale", _F32)
    if y_zero_point.dtype not in QUANTIZED_TYPES:
        raise DTypeError(f"y_zero_point has element type {y_zero_point.dtype}, expected int8 or uint8 (the "
                         "result's type)")
    _scalar(y_zero_point, "y_zero_point", y_zero_point.dtype)
    return y_zero_point.dtype


def _requantize(real: np.ndarray, out: tuple) -> np.ndarray:
    if not out:
        return real.astype(_F32)
    y_scale, y_zero_point = out
    info = np.iinfo(y_zero_point.dtype)
    q = np.round(real / float(np.asarray(y_scale).reshape(()))) + float(np.asarray(y_zero_point).reshape(()))
    return np.clip(q, info.min, info.max).astype(y_zero_point.dtype)


def _real(x, x_scale, x_zero_point) -> np.ndarray:
    return (x.astype(np.float64) - float(np.asarray(x_zero_point).reshape(()))) * float(np.asarray(x_scale).reshape(()))


# -------------------------------------------------------------------------------- quantized_conv

def _infer_quantized_conv(x, x_scale, x_zero_point, w, w_scale, bias, *out, strides, pads, dilations, group,
                          activation, alpha, beta):
    _check_activation(activation, alpha, beta)
    if x.rank < 3:
        raise ShapeError(f"x must be (N, C, spatial...), got {fmt_shape(x.shape)}")
    dtype = _check_quantized(x, x_scale, x_zero_point, w, w_scale, bias, w.shape[0], out)
    (t,) = _infer_conv(TensorType(x.shape, _F32), TensorType(w.shape, _F32), strides=strides, pads=pads,
                       dilations=dilations, group=group)
    return (TensorType(t.shape, dtype),)


def _ref_quantized_conv(x, x_scale, x_zero_point, w, w_scale, bias, *out, strides=None, pads=None, dilations=None,
                        group=1, activation="none", alpha=0.0, beta=0.0):
    n = w.ndim - 2
    ws = np.asarray(w_scale, np.float64).reshape((-1,) + (1,) * (n + 1))
    (acc,) = _ref_conv(_real(x, x_scale, x_zero_point), w.astype(np.float64) * ws, np.asarray(bias, np.float64),
                       strides=strides, pads=pads, dilations=dilations, group=group)
    return (_requantize(apply_activation(acc, activation, alpha, beta), out),)


def _quantized_operands(rng: np.random.Generator, x: np.ndarray, channels: int):
    """x as uint8 or int8 with its scale and zero point, a per-tensor or per-channel weight
    scale, and maybe the result's scale and zero point."""
    qtype = np.dtype(rng.choice(["uint8", "int8"]))
    info = np.iinfo(qtype)
    xq = rng.integers(info.min, info.max + 1, x.shape).astype(qtype)
    x_zp = np.array(rng.integers(info.min // 2, info.max // 2 + 1), qtype)
    w_scale = (rng.uniform(0.002, 0.02, channels) if rng.random() < 0.5 else rng.uniform(0.002, 0.02, ())
               ).astype(_F32)
    out = []
    if rng.random() < 0.7:
        oq = np.dtype(rng.choice(["uint8", "int8"]))
        out = [np.array(rng.uniform(0.05, 0.2), _F32), np.array(rng.integers(-10, 11) + (128 if oq == np.uint8 else 0),
                                                                  oq)]
    return xq, np.array(rng.uniform(0.01, 0.05), _F32), x_zp, w_scale, out


#: The weights' range the samplers draw from: int8 products summed in pairs into int16 (AVX2's
#: vpmaddubsw, what oneDNN and onnxruntime's MLAS use without AVX-512 VNNI) saturate beyond it, a
#: known limit of int8 on such CPUs (onnxruntime's quantizer offers reduce_range, 7-bit weights).
SAMPLE_WEIGHTS = 64


def _sample_quantized_conv(rng: np.random.Generator):
    (x, w, *_), attrs = _sample_conv(rng)
    xq, x_scale, x_zp, w_scale, out = _quantized_operands(rng, x, w.shape[0])
    wq = rng.integers(-SAMPLE_WEIGHTS, SAMPLE_WEIGHTS + 1, w.shape).astype(_I8)
    bias = rng.standard_normal(w.shape[0]).astype(_F32)
    activation = str(rng.choice(["none", "relu"]))
    return [xq, x_scale, x_zp, wq, w_scale, bias, *out], {**attrs, "activation": activation, "alpha": 0.0, "beta": 0.0}


define("quantized_conv", infer=_infer_quantized_conv, reference=_ref_quantized_conv, sample=_sample_quantized_conv,
       arity=(6, 8), tolerance=(1e-4, 1.0), fused=True, doc="""
    An int8 convolution: x (N, C, spatial...) int8 or uint8 with x_scale (float32) and
    x_zero_point (x's type) one per tensor; w (M, C/group, k...) int8 with w_scale (float32, () or
    (M,)); bias (M,) float32 in real units; then optionally y_scale (float32) and y_zero_point
    (int8 or uint8: the result's type), else a float32 result. Attributes as ``fused_conv``'s
    (``strides``, ``pads``, ``dilations``, ``group``, ``activation``, ``alpha``, ``beta``). The
    arithmetic: see :mod:`polyhal.ops.quantized`; within one quantization step of the reference.
""")


# ------------------------------------------------------------------------------ quantized_matmul

def _infer_quantized_matmul(a, a_scale, a_zero_point, b, b_scale, bias, *out, activation, alpha, beta):
    _check_activation(activation, alpha, beta)
    if a.rank < 1 or b.rank != 2 or a.shape[-1] != b.shape[0]:
        raise ShapeError(f"a (..., K) and b (K, N) do not fit: {fmt_shape(a.shape)} and {fmt_shape(b.shape)}")
    dtype = _check_quantized(a, a_scale, a_zero_point, b, b_scale, bias, b.shape[1], out)
    return (TensorType(a.shape[:-1] + (b.shape[1],), dtype),)


def _ref_quantized_matmul(a, a_scale, a_zero_point, b, b_scale, bias, *out, activation="none", alpha=0.0, beta=0.0):
    real = _real(a, a_scale, a_zero_point) @ (b.astype(np.float64) * np.asarray(b_scale, np.float64)) \
        + np.asarray(bias, np.float64)
    return (_requantize(apply_activation(real, activation, alpha, beta), out),)


def _sample_quantized_matmul(rng: np.random.Generator):
    lead = tuple(int(v) for v in rng.integers(1, 6, size=int(rng.integers(1, 3))))
    k, n = (int(v) for v in rng.integers(1, 40, size=2))
    aq, a_scale, a_zp, b_scale, out = _quantized_operands(rng, np.zeros(lead + (k,)), n)
    b = rng.integers(-SAMPLE_WEIGHTS, SAMPLE_WEIGHTS + 1, (k, n)).astype(_I8)
    bias = rng.standard_normal(n).astype(_F32)
    activation = str(rng.choice(["none", "relu"]))
    return [aq, a_scale, a_zp, b, b_scale, bias, *out], {"activation": activation, "alpha": 0.0, "beta": 0.0}


define("quantized_matmul", infer=_infer_quantized_matmul, reference=_ref_quantized_matmul,
       sample=_sample_quantized_matmul, arity=(6, 8), tolerance=(1e-4, 1.0), fused=True, doc="""
    An int8 matmul: a (..., K) int8 or uint8 with a_scale (float32) and a_zero_point (a's type)
    one per tensor; b (K, N) int8 with b_scale (float32, () or (N,)); bias (N,) float32 in real
    units; then optionally y_scale and y_zero_point (the result's int8 or uint8 type), else a
    float32 result. ``activation``, ``alpha``, ``beta`` as ``fused_linear``'s. The arithmetic:
    see :mod:`polyhal.ops.quantized`; within one quantization step of the reference.
""")


# ------------------------------------------------------------------------------ dynamic_quantize

_U8 = np.dtype(np.uint8)
_ZERO, _TOP = np.float32(0), np.float32(255)


def _infer_dynamic_quantize(x):
    if x.dtype != _F32:
        raise DTypeError(f"x has element type {x.dtype}, expected float32")
    return TensorType(x.shape, _U8), TensorType((), _F32), TensorType((), _U8)


def dynamic_quantize_parameters(lo: np.float32, hi: np.float32) -> tuple[np.float32, np.float32]:
    """The scale and (float) zero point DynamicQuantizeLinear takes from a tensor's least and
    greatest values, in float32 as ONNX computes them; a tensor of zeros gets scale 0 and zero
    point 0 (ONNX's formula divides 0 by 0 there)."""
    zero, top = _ZERO, _TOP
    if lo != lo or hi != hi:  # nan: no range (Python comparisons: a kernel calls this per run)
        return np.float32(np.nan), zero
    lo, hi = (lo if lo < zero else zero), (hi if hi > zero else zero)
    scale = np.float32((hi - lo) / top)
    if not scale > 0:  # zeros: no range to spread
        return scale, zero
    return scale, min(max(np.rint(zero - lo / scale), zero), top)


def _ref_dynamic_quantize(x):
    flat = np.asarray(x, _F32).reshape(-1)
    lo, hi = (flat.min(), flat.max()) if flat.size else (np.float32(0), np.float32(0))
    scale, zp = dynamic_quantize_parameters(lo, hi)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.clip(np.rint(x / scale) + zp, 0, 255) if scale > 0 else np.zeros_like(x)
    return y.astype(_U8), np.array(scale, _F32), np.array(zp, _U8)


def _sample_dynamic_quantize(rng: np.random.Generator):
    shape = tuple(int(v) for v in rng.integers(1, 9, size=int(rng.integers(1, 4))))
    return [(rng.standard_normal(shape) * rng.uniform(0.1, 10) + rng.uniform(-2, 2)).astype(_F32)], {}


define("dynamic_quantize", infer=_infer_dynamic_quantize, reference=_ref_dynamic_quantize,
       sample=_sample_dynamic_quantize, arity=1, tolerance=(0.0, 0.0), doc="""
    ONNX's DynamicQuantizeLinear: float32 x quantized to uint8 over its own range widened to
    include 0, returning (y, scale, zero_point): ``scale = (max(x, 0) - min(x, 0)) / 255``,
    ``zero_point = saturate(round(-min(x, 0) / scale))``, ``y = saturate(round(x / scale) +
    zero_point)``, rounding half to even, in float32. One op, so that a device runs the two
    reductions and the quantization as one kernel (onnxruntime's dynamic int8 models quantize
    every matmul's input this way); devices without its kernel get the elementwise ops
    (:mod:`polyhal.passes.decompose`). A tensor of zeros gets scale 0 and zero point 0.
""")
