"""Convolution and pooling over N-d (N >= 1) spatial dims, layout (batch, channels, spatial...),
``linear`` (a matmul with a bias) and ``attention`` (softmax(q k^T) v, fused).

Attributes follow ONNX with padding made explicit (front ends resolve ``auto_pad``):
``strides`` and ``dilations`` have one entry per spatial dim, ``pads`` two (all begins, then all
ends). The references loop over output positions in float64; they are the oracle, not fast.
"""

from __future__ import annotations

import itertools
import types

import numpy as np

from polyhal.errors import ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import (
    FLOAT, NUMERIC, bool_attr, broadcast, check_dtype, check_same_dtype, define, float_attr, fmt_shape, int_attr,
    int_list_attr, narrow, nonzero, pick, wide,
)


def _spatial(name: str, value, n: int, default: int | None = None, count: int = 1) -> tuple[int, ...]:
    if value is None and default is not None:
        return (default,) * (n * count)
    vals = int_list_attr(value, name)
    if len(vals) != n * count:
        raise ProgramError(f"attribute {name!r} needs {n * count} entries for {n} spatial dims, got {len(vals)}")
    return vals


def _window_attrs(rank: int, strides, pads, dilations):
    n = rank - 2
    if n < 1:
        raise ShapeError(f"operand 0 has rank {rank}; expected (batch, channels, spatial...) of rank >= 3")
    s = _spatial("strides", strides, n, 1)
    p = _spatial("pads", pads, n, 0, 2)
    d = _spatial("dilations", dilations, n, 1)
    if any(v < 1 for v in s + d) or any(v < 0 for v in p):
        raise ProgramError(f"strides {list(s)} and dilations {list(d)} must be >= 1 and pads {list(p)} >= 0")
    return s, p, d


def _out_size(size: int, k: int, s: int, pb: int, pe: int, d: int, ceil_mode: bool = False) -> int:
    span = (k - 1) * d + 1
    room = size + pb + pe - span
    if room < 0:
        raise ShapeError(f"the window (kernel {k}, dilation {d}) spans {span} elements, more than the "
                         f"padded input ({size + pb + pe})")
    out = (-(-room // s) if ceil_mode else room // s) + 1
    if ceil_mode and (out - 1) * s >= size + pb:
        out -= 1  # the last window would start in the end padding: drop it (as ONNX and PyTorch)
    return out


# ----------------------------------------------------------------------------------------- conv

def _infer_conv(x: TensorType, w: TensorType, b: TensorType | None = None, *, strides, pads, dilations, group):
    operands = (x, w) if b is None else (x, w, b)
    dtype = check_same_dtype(*operands)
    check_dtype(x, FLOAT)
    s, p, d = _window_attrs(x.rank, strides, pads, dilations)
    g = int_attr(group, "group")
    if w.rank != x.rank:
        raise ShapeError(f"weights {fmt_shape(w.shape)} must have the input's rank {x.rank}")
    n_, c = x.shape[:2]
    m = w.shape[0]
    if g < 1 or c % g or m % g or w.shape[1] * g != c:
        raise ShapeError(f"input channels {c}, output channels {m} and weight shape {fmt_shape(w.shape)} do "
                         f"not fit group={g} (weights must be (M, C/group, k...))")
    if b is not None and b.shape != (m,):
        raise ShapeError(f"bias has shape {fmt_shape(b.shape)}, expected ({m},)")
    n = x.rank - 2
    out = tuple(_out_size(x.shape[2 + i], w.shape[2 + i], s[i], p[i], p[i + n], d[i]) for i in range(n))
    return (TensorType((n_, m) + out, dtype),)


def _ref_conv(x, w, b=None, *, strides=None, pads=None, dilations=None, group=1):
    n = x.ndim - 2
    s, p, d = _window_attrs(x.ndim, strides, pads, dilations)
    xw = np.pad(wide(x), [(0, 0), (0, 0)] + [(p[i], p[i + n]) for i in range(n)])
    ww = wide(w)
    (out_type,) = _infer_conv(TensorType(x.shape, x.dtype), TensorType(w.shape, w.dtype),
                              None if b is None else TensorType(b.shape, b.dtype),
                              strides=strides, pads=pads, dilations=dilations, group=group)
    out = np.zeros(out_type.shape)
    m, cg = w.shape[0], w.shape[1]
    mg = m // group
    for pos in itertools.product(*(range(o) for o in out_type.shape[2:])):
        window = tuple(slice(pos[i] * s[i], pos[i] * s[i] + (w.shape[2 + i] - 1) * d[i] + 1, d[i]) for i in range(n))
        for g in range(group):
            patch = xw[(slice(None), slice(g * cg, (g + 1) * cg)) + window]  # (N, cg, k...)
            out[(slice(None), slice(g * mg, (g + 1) * mg)) + pos] = np.tensordot(
                patch, ww[g * mg:(g + 1) * mg], axes=(list(range(1, n + 2)), list(range(1, n + 2))))
    if b is not None:
        out += wide(b).reshape((m,) + (1,) * n)
    return (narrow(out, x.dtype),)


def _sample_conv(rng: np.random.Generator):
    n = int(pick(rng, [1, 2, 2, 3]))
    g = int(pick(rng, [1, 1, 2]))
    c, m = g * int(rng.integers(1, 3)), g * int(rng.integers(1, 3))
    k = tuple(int(v) for v in rng.integers(1, 4, size=n))
    d = tuple(int(v) for v in rng.integers(1, 3, size=n))
    size = tuple(max(int(v), (ki - 1) * di + 1) for v, ki, di in
                 zip(rng.integers(4, 8 if n < 3 else 6, size=n), k, d))
    x = nonzero(rng, (int(rng.integers(1, 3)), c) + size)
    w = nonzero(rng, (m, c // g) + k)
    attrs = {"strides": [int(v) for v in rng.integers(1, 3, size=n)], "pads": [int(v) for v in rng.integers(0, 2, size=2 * n)],
             "dilations": list(d), "group": g}
    return ([x, w, nonzero(rng, (m,))] if rng.random() < 0.6 else [x, w]), attrs


define("conv", infer=_infer_conv, reference=_ref_conv, sample=_sample_conv, arity=(2, 3),
       tolerance=(1e-4, 1e-5), contraction=True, doc="""
    N-d convolution (cross-correlation, as ONNX Conv): x (N, C, spatial...), w (M, C/group,
    k...), optional bias (M,); explicit ``pads`` [begins..., ends...], ``strides``,
    ``dilations`` and ``group``. Float types.
""")


# ------------------------------------------------------------------------------------ fused_conv

#: The activations a fused epilogue applies (``fused_conv``'s ``activation``), with what
#: ``alpha`` and ``beta`` mean for each.
ACTIVATIONS = {
    "none": "y",
    "relu": "max(y, 0)",
    "clip": "min(max(y, alpha), beta)",
    "hard_sigmoid": "max(0, min(1, alpha y + beta))",
    "hard_swish": "y max(0, min(1, alpha y + beta))",
    "sigmoid": "1 / (1 + exp(-y))",
    "silu": "y / (1 + exp(-y))",
    "gelu": "y/2 (1 + erf(y / sqrt(2)))",
    "gelu_tanh": "y/2 (1 + tanh(sqrt(2/pi) (y + 0.044715 y^3)))",
}


def apply_activation(y: np.ndarray, activation: str, alpha: float, beta: float) -> np.ndarray:
    """``activation`` (one of :data:`ACTIVATIONS`) of float64 ``y``: the epilogues' reference."""
    if activation == "none":
        return y
    if activation == "relu":
        return np.maximum(y, 0.0)
    if activation == "clip":
        return np.minimum(np.maximum(y, alpha), beta)
    if activation in ("hard_sigmoid", "hard_swish"):
        h = np.clip(alpha * y + beta, 0.0, 1.0)
        return h if activation == "hard_sigmoid" else y * h
    if activation in ("sigmoid", "silu"):
        s = 1.0 / (1.0 + np.exp(-y))
        return s if activation == "sigmoid" else y * s
    from polyhal.ops.elementwise import _ref_gelu

    return _ref_gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")[0]


def sample_activation(rng: np.random.Generator) -> dict:
    """A random activation of :data:`ACTIVATIONS` with parameters that exercise it:
    ``{"activation", "alpha", "beta"}`` (samplers of ops with an epilogue or a prologue)."""
    activation = str(pick(rng, list(ACTIVATIONS)))
    alpha, beta = {"clip": (-0.5, 1.5), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}.get(activation, (0, 0))
    return {"activation": activation, "alpha": alpha, "beta": beta}


def _check_activation(activation, alpha, beta) -> None:
    """Check an activation and its parameters."""
    if activation not in ACTIVATIONS:
        raise ProgramError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    a, b = float_attr(alpha, "alpha"), float_attr(beta, "beta")
    if np.isnan(a) or np.isnan(b) or (activation != "clip" and not (np.isfinite(a) and np.isfinite(b))):
        raise ProgramError(f"activation {activation!r}: alpha={alpha} and beta={beta} must "
                           "be finite numbers (clip's bounds may be infinite)")


def _infer_fused_conv(x: TensorType, w: TensorType, b: TensorType, r: TensorType | None = None, *, strides, pads,
                      dilations, group, activation, alpha, beta):
    _check_activation(activation, alpha, beta)
    (out,) = _infer_conv(x, w, b, strides=strides, pads=pads, dilations=dilations, group=group)
    if r is not None and (r.shape != out.shape or r.dtype != out.dtype):
        raise ShapeError(f"the residual operand is {r}; it must be the convolution's result type {out}")
    return (out,)


def _ref_fused_conv(x, w, b, r=None, *, strides=None, pads=None, dilations=None, group=1, activation="none",
                    alpha=0.0, beta=0.0):
    (y,) = _ref_conv(x, w, b, strides=strides, pads=pads, dilations=dilations, group=group)
    y = wide(y) if r is None else wide(y) + wide(r)
    return (narrow(apply_activation(y, activation, float(alpha), float(beta)), x.dtype),)


def _sample_fused_conv(rng: np.random.Generator):
    (x, w, *b), attrs = _sample_conv(rng)
    (out,) = _infer_conv(TensorType(x.shape, x.dtype), TensorType(w.shape, w.dtype), strides=attrs["strides"],
                         pads=attrs["pads"], dilations=attrs["dilations"], group=attrs["group"])
    activation = str(pick(rng, list(ACTIVATIONS)))
    alpha, beta = {"clip": (-0.5, 1.5), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}.get(activation, (0, 0))
    ins = [x, w, b[0] if b else nonzero(rng, (w.shape[0],))]
    if rng.random() < 0.5:
        ins.append(nonzero(rng, out.shape))
    return ins, {**attrs, "activation": activation, "alpha": alpha, "beta": beta}


define("fused_conv", infer=_infer_fused_conv, reference=_ref_fused_conv, sample=_sample_fused_conv, arity=(3, 4),
       tolerance=(1e-4, 1e-5), fused=True, contraction=True, doc="""
    ``conv`` with its epilogue: activation(conv(x, w, b) + residual), in one pass over the result.
    x, w and the bias b as for ``conv``; the optional residual has the result's type.
    ``activation`` is one of :data:`ACTIVATIONS` (default "none"), ``alpha`` and ``beta`` its
    parameters (clip: the bounds, inf allowed; hard_sigmoid and hard_swish: the slope and offset).
    What a convolution followed by a bias, a residual Add and an activation becomes
    (:mod:`polyhal.passes.fuse_conv`), on devices that have its kernel.
""")


# ---------------------------------------------------------------------------------- scale_shift

def _check_per_channel(x: TensorType, scale: TensorType, shift: TensorType) -> None:
    """Check a float x (N, C, ...) and one scale and one shift of its type per channel."""
    check_dtype(x, FLOAT, 0)
    if x.rank < 2:
        raise ShapeError(f"operand 0 has rank {x.rank}; expected (batch, channels, ...) of rank >= 2")
    for i, t in ((1, scale), (2, shift)):
        if t.shape != (x.shape[1],) or t.dtype != x.dtype:
            raise ShapeError(f"operand {i} is {t}; it must be one {x.dtype} per channel, shape ({x.shape[1]},)")


def _infer_scale_shift(x: TensorType, scale: TensorType, shift: TensorType, *, activation, alpha, beta):
    _check_activation(activation, alpha, beta)
    _check_per_channel(x, scale, shift)
    return (TensorType(x.shape, x.dtype),)


def _ref_scale_shift(x, scale, shift, *, activation="none", alpha=0.0, beta=0.0):
    per_channel = (1, -1) + (1,) * (x.ndim - 2)
    y = wide(x) * wide(scale).reshape(per_channel) + wide(shift).reshape(per_channel)
    return (narrow(apply_activation(y, activation, float(alpha), float(beta)), x.dtype),)


def _sample_scale_shift(rng: np.random.Generator):
    shape = tuple(int(v) for v in rng.integers(1, 6, size=int(rng.integers(2, 5))))
    activation = str(pick(rng, list(ACTIVATIONS)))
    alpha, beta = {"clip": (-0.5, 1.5), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}.get(activation, (0, 0))
    c = shape[1]
    return [nonzero(rng, shape), nonzero(rng, (c,)), nonzero(rng, (c,))], \
        {"activation": activation, "alpha": alpha, "beta": beta}


define("scale_shift", infer=_infer_scale_shift, reference=_ref_scale_shift, sample=_sample_scale_shift, arity=3,
       tolerance=(1e-4, 1e-5), fused=True, doc="""
    activation(x * scale + shift) with one scale and one shift per channel: x is (N, C, ...),
    scale and shift (C,) of x's type; ``activation``, ``alpha`` and ``beta`` as for ``fused_conv``.
    What a BatchNormalization (a per-channel ``mul`` and ``add`` by constants) and the activation
    after it become where no convolution before them takes the scale and shift into its weights
    (DenseNet's norm and ReLU after each concatenation; :func:`polyhal.passes.fuse_conv.fuse_scale_shift`),
    on devices that have its kernel: one pass over x instead of three.
""")


# ------------------------------------------------------------------ conv on channel-blocked maps

def _unblocked(t: TensorType) -> TensorType:
    """The (N, C, H, W) type of a (N, 1, H, W, C) channel-blocked storage type."""
    if t.rank != 5 or t.shape[1] != 1:
        raise ShapeError(f"operand {t} is not a one-block channel-blocked feature map (N, 1, H, W, C)")
    n, _, h, w, c = t.shape
    return TensorType((n, c, h, w), t.dtype)


def _blocked(t: TensorType) -> TensorType:
    n, c, h, w = t.shape
    return TensorType((n, 1, h, w, c), t.dtype)


def _infer_on_blocked(x: TensorType, w: TensorType, b: TensorType | None = None, r: TensorType | None = None, *,
                      strides, pads, dilations, group, activation, alpha, beta):
    if b is None:
        b = TensorType((w.shape[0],), w.dtype)
    if w.rank == 5:  # the filter channels-last too: (M, 1, kh, kw, C/group)
        w = _unblocked(w)
    # x may be an image as it lies, (N, C, H, W): a chain's first conv (see CHANNEL_BLOCKED_CONV's doc)
    (out,) = _infer_fused_conv(x if x.rank == 4 else _unblocked(x), w, b, None if r is None else _unblocked(r),
                               strides=strides, pads=pads, dilations=dilations, group=group, activation=activation,
                               alpha=alpha, beta=beta)
    return (_blocked(out),)


def _ref_on_blocked(x, w, b=None, r=None, *, strides=None, pads=None, dilations=None, group=1, activation="none",
                    alpha=0.0, beta=0.0):
    unblock = lambda a: a[:, 0].transpose(0, 3, 1, 2)  # noqa: E731
    w = unblock(w) if w.ndim == 5 else w
    args = (x if x.ndim == 4 else unblock(x), w, np.zeros(w.shape[0], w.dtype) if b is None else b) + \
        (() if r is None else (unblock(r),))
    (y,) = _ref_fused_conv(*args, strides=strides, pads=pads, dilations=dilations, group=group,
                           activation=activation, alpha=alpha, beta=beta)
    return (np.ascontiguousarray(y.transpose(0, 2, 3, 1)[:, None]),)


def _sample_on_blocked(rng: np.random.Generator):
    n, c = int(rng.integers(1, 3)), int(pick(rng, [3, 4, 8]))
    kind = pick(rng, ["depthwise", "pointwise", "general"])
    k = 1 if kind == "pointwise" else int(pick(rng, [3, 5]))
    group = c if kind == "depthwise" else 1
    m = c * int(pick(rng, [1, 2])) if kind == "depthwise" else int(rng.integers(1, 9))
    h, wd = (int(v) for v in rng.integers(k, k + 6, size=2))
    s = [1, 1] if kind == "pointwise" else [int(v) for v in rng.integers(1, 3, size=2)]
    p = [0] * 4 if kind == "pointwise" else [int(v) for v in rng.integers(0, k // 2 + 1, size=4)]
    attrs = {"strides": s, "pads": p, "dilations": [1, 1], "group": group}
    x = nonzero(rng, (n, c, h, wd))
    w = nonzero(rng, (m, c // group, k, k))
    (out,) = _infer_conv(TensorType(x.shape, x.dtype), TensorType(w.shape, w.dtype), **attrs)
    activation = str(pick(rng, list(ACTIVATIONS)))
    alpha, beta = {"clip": (-0.5, 1.5), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}.get(activation, (0, 0))
    block = lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)[:, None])  # noqa: E731
    image = kind == "general" and rng.random() < 0.5  # a stem reading the image as it lies
    ins = [x if image else block(x), w, nonzero(rng, (m,))]
    if rng.random() < 0.5:
        ins.append(block(nonzero(rng, out.shape)))
    return ins, {**attrs, "activation": activation, "alpha": alpha, "beta": beta}


#: The schema of a conv on channel-blocked storage: :func:`polyhal.ops.define`'s arguments but the
#: name. Not an op of the core set: a backend whose layouts lower convs between channel-blocked
#: maps (:class:`polyhal.ir.encoding.ChannelBlockedLayout`'s ``conv_op``) defines it as its own op
#: with these, ``TABLE.define("mydev.nchwc_conv", **CHANNEL_BLOCKED_CONV)``, and serves it.
CHANNEL_BLOCKED_CONV = types.MappingProxyType(dict(
    infer=_infer_on_blocked, reference=_ref_on_blocked, sample=_sample_on_blocked, arity=(2, 4),
    tolerance=(1e-4, 1e-5), fused=True, contraction=True, doc="""
    ``fused_conv`` on channel-blocked storage (NCHWc with one block of all channels: (N, 1, H, W, C),
    each pixel's channels contiguous): x and the optional residual in that storage, w (M,
    C/group, kh, kw) dense or in the same storage ((M, 1, kh, kw, C/group): cuDNN's channels-last
    filters), the optional bias (M,) dense, the result (N, 1, OH, OW, M). 2-D only.
    x may also be dense (N, C, H, W): a chain's first conv reading an image of few channels as it
    lies (a network's stem), whose result is blocked. What a conv between channel-blocked feature
    maps lowers to
    (:class:`polyhal.ir.encoding.ChannelBlockedLayout`); attributes as ``fused_conv``.
"""))


# ------------------------------------------------------------------------------- conv_transpose

def _infer_conv_transpose(x: TensorType, w: TensorType, b: TensorType | None = None, *, strides, pads,
                          dilations, group, output_padding):
    operands = (x, w) if b is None else (x, w, b)
    dtype = check_same_dtype(*operands)
    check_dtype(x, FLOAT)
    s, p, d = _window_attrs(x.rank, strides, pads, dilations)
    n = x.rank - 2
    op = _spatial("output_padding", output_padding, n, 0)
    g = int_attr(group, "group")
    if w.rank != x.rank:
        raise ShapeError(f"weights {fmt_shape(w.shape)} must have the input's rank {x.rank}")
    c = x.shape[1]
    if g < 1 or c % g or w.shape[0] != c:
        raise ShapeError(f"input channels {c} and weight shape {fmt_shape(w.shape)} do not fit group={g} "
                         "(weights must be (C, M/group, k...))")
    m = w.shape[1] * g
    if b is not None and b.shape != (m,):
        raise ShapeError(f"bias has shape {fmt_shape(b.shape)}, expected ({m},)")
    out = []
    for i in range(n):
        size = s[i] * (x.shape[2 + i] - 1) + op[i] + (w.shape[2 + i] - 1) * d[i] + 1 - p[i] - p[i + n]
        if size < 0:
            raise ShapeError(f"pads {list(p)} remove more than the output of spatial dim {i}")
        out.append(size)
    return (TensorType((x.shape[0], m) + tuple(out), dtype),)


def _ref_conv_transpose(x, w, b=None, *, strides=None, pads=None, dilations=None, group=1, output_padding=None):
    n = x.ndim - 2
    s, p, d = _window_attrs(x.ndim, strides, pads, dilations)
    op = _spatial("output_padding", output_padding, n, 0)
    c, mg = w.shape[0], w.shape[1]
    cg = c // group
    full_shape = [s[i] * (x.shape[2 + i] - 1) + op[i] + (w.shape[2 + i] - 1) * d[i] + 1 for i in range(n)]
    full = np.zeros((x.shape[0], mg * group) + tuple(full_shape))
    xw, ww = wide(x), wide(w)
    for pos in itertools.product(*(range(v) for v in x.shape[2:])):
        for g in range(group):
            vals = xw[(slice(None), slice(g * cg, (g + 1) * cg)) + pos]  # (N, cg)
            contrib = np.tensordot(vals, ww[g * cg:(g + 1) * cg], axes=([1], [0]))  # (N, mg, k...)
            window = tuple(slice(pos[i] * s[i], pos[i] * s[i] + (w.shape[2 + i] - 1) * d[i] + 1, d[i]) for i in range(n))
            full[(slice(None), slice(g * mg, (g + 1) * mg)) + window] += contrib
    crop = tuple(slice(p[i], full_shape[i] - p[i + n]) for i in range(n))
    out = full[(slice(None), slice(None)) + crop]
    if b is not None:
        out = out + wide(b).reshape((-1,) + (1,) * n)
    return (narrow(out, x.dtype),)


def _sample_conv_transpose(rng: np.random.Generator):
    n = int(pick(rng, [1, 2, 2]))
    g = int(pick(rng, [1, 1, 2]))
    c, mg = g * int(rng.integers(1, 3)), int(rng.integers(1, 3))
    k = tuple(int(v) for v in rng.integers(1, 4, size=n))
    x = nonzero(rng, (int(rng.integers(1, 3)), c) + tuple(int(v) for v in rng.integers(2, 5, size=n)))
    w = nonzero(rng, (c, mg) + k)
    s = [int(v) for v in rng.integers(1, 3, size=n)]
    attrs = {"strides": s, "pads": [int(v) for v in rng.integers(0, 2, size=2 * n)],
             "dilations": [int(v) for v in rng.integers(1, 3, size=n)], "group": g,
             "output_padding": [int(rng.integers(0, v)) for v in s]}
    return ([x, w, nonzero(rng, (mg * g,))] if rng.random() < 0.5 else [x, w]), attrs


define("conv_transpose", infer=_infer_conv_transpose, reference=_ref_conv_transpose, sample=_sample_conv_transpose,
       arity=(2, 3), tolerance=(1e-4, 1e-5), contraction=True, doc="""
    N-d transposed convolution (ONNX ConvTranspose): x (N, C, spatial...), w (C, M/group, k...),
    optional bias (M,). Output dim i is strides[i] * (in - 1) + output_padding[i] +
    (k - 1) * dilations[i] + 1 - pads_begin[i] - pads_end[i]. Float types.
""")


# -------------------------------------------------------------------------------------- pooling

def _infer_pool(kind: str):
    def infer(x: TensorType, *, kernel_shape, strides, pads, dilations, ceil_mode, **extra):
        check_dtype(x, NUMERIC if kind == "max" else FLOAT)
        s, p, d = _window_attrs(x.rank, strides, pads, dilations)
        n = x.rank - 2
        k = _spatial("kernel_shape", kernel_shape, n)
        if any(v < 1 for v in k):
            raise ProgramError(f"kernel_shape {list(k)} must be >= 1")
        if kind == "lp" and int_attr(extra["p"], "p") < 1:
            raise ProgramError(f"attribute 'p' must be >= 1, got {extra['p']}")
        for i in range(n):
            if p[i] >= (k[i] - 1) * d[i] + 1 or p[i + n] >= (k[i] - 1) * d[i] + 1:
                raise ShapeError(f"pads {list(p)} must be smaller than the window along every dim")
        ceil_mode = bool_attr(ceil_mode, "ceil_mode")
        out = tuple(_out_size(x.shape[2 + i], k[i], s[i], p[i], p[i + n], d[i], ceil_mode) for i in range(n))
        return (TensorType(x.shape[:2] + out, x.dtype),)
    return infer


def _ref_pool(kind: str):
    def reference(x, *, kernel_shape, strides=None, pads=None, dilations=None, ceil_mode=False,
                  count_include_pad=False, p=2):
        n = x.ndim - 2
        s, pd, d = _window_attrs(x.ndim, strides, pads, dilations)
        k = _spatial("kernel_shape", kernel_shape, n)
        (out_type,) = _infer_pool(kind)(TensorType(x.shape, x.dtype), kernel_shape=kernel_shape, strides=strides,
                                        pads=pads, dilations=dilations, ceil_mode=ceil_mode, p=p)
        w = wide(x)
        out = np.zeros(out_type.shape, dtype=np.float64 if x.dtype.kind == "f" else x.dtype)
        for pos in itertools.product(*(range(o) for o in out_type.shape[2:])):
            idx, inside = [], 1
            for i in range(n):
                taps = [pos[i] * s[i] - pd[i] + j * d[i] for j in range(k[i])]
                valid = [t for t in taps if 0 <= t < x.shape[2 + i]]
                idx.append(valid)
                if count_include_pad:
                    inside *= sum(1 for t in taps if -pd[i] <= t < x.shape[2 + i] + pd[i + n])
            window = w[np.ix_(range(x.shape[0]), range(x.shape[1]), *idx)].reshape(x.shape[0], x.shape[1], -1)
            if kind == "max":
                out[(slice(None), slice(None)) + pos] = window.max(axis=-1)
            elif kind == "avg":
                count = inside if count_include_pad else window.shape[-1]
                out[(slice(None), slice(None)) + pos] = window.sum(axis=-1) / count
            else:
                out[(slice(None), slice(None)) + pos] = (np.abs(window) ** p).sum(axis=-1) ** (1.0 / p)
        return (narrow(out, x.dtype),)
    return reference


def _sample_pool(kind: str):
    def sample(rng: np.random.Generator):
        n = int(pick(rng, [1, 2, 2, 3]))
        k = [int(v) for v in rng.integers(1, 4, size=n)]
        d = [int(v) for v in rng.integers(1, 3, size=n)] if rng.random() < 0.3 else [1] * n
        pads = [int(rng.integers(0, min(2, (k[i % n] - 1) * d[i % n] + 1))) for i in range(2 * n)]
        size = tuple(max(int(v), (ki - 1) * di + 1) for v, ki, di in
                     zip(rng.integers(4, 8 if n < 3 else 6, size=n), k, d))
        x = nonzero(rng, (int(rng.integers(1, 3)), int(rng.integers(1, 4))) + size)
        attrs = {"kernel_shape": k, "strides": [int(v) for v in rng.integers(1, 3, size=n)], "pads": pads,
                 "dilations": d, "ceil_mode": bool(rng.integers(2))}
        if kind == "avg":
            attrs["count_include_pad"] = bool(rng.integers(2))
        if kind == "lp":
            attrs["p"] = int(pick(rng, [1, 2, 3]))
        return [x], attrs
    return sample


def _define_pool(kind: str, doc: str) -> None:
    infer = _infer_pool(kind)
    ref = _ref_pool(kind)
    # The keyword-only parameters of the registered reference declare each op's attributes.
    if kind == "max":
        def reference(x, *, kernel_shape, strides=None, pads=None, dilations=None, ceil_mode=False):
            return ref(x, kernel_shape=kernel_shape, strides=strides, pads=pads, dilations=dilations,
                       ceil_mode=ceil_mode)
    elif kind == "avg":
        def reference(x, *, kernel_shape, strides=None, pads=None, dilations=None, ceil_mode=False,
                      count_include_pad=False):
            return ref(x, kernel_shape=kernel_shape, strides=strides, pads=pads, dilations=dilations,
                       ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    else:
        def reference(x, *, kernel_shape, strides=None, pads=None, dilations=None, ceil_mode=False, p=2):
            return ref(x, kernel_shape=kernel_shape, strides=strides, pads=pads, dilations=dilations,
                       ceil_mode=ceil_mode, p=p)
    define(f"{kind}_pool", infer=infer, reference=reference, sample=_sample_pool(kind), arity=1,
           tolerance=(1e-5, 1e-6), doc=doc)


_POOL_DOC = """over windows of ``kernel_shape`` (per spatial dim) with ``strides``, ``pads``
    [begins..., ends...] (each smaller than the window) and ``dilations``; ``ceil_mode`` rounds
    the output size up (a last window that would start in the end padding is dropped)."""

_define_pool("max", f"Max {_POOL_DOC} Padding never wins. Numeric types.")
_define_pool("avg", f"Mean {_POOL_DOC} The divisor counts the window's elements inside the input, or, with "
                    "``count_include_pad``, inside the padded input too. Float types.")
_define_pool("lp", f"(sum |x|^p)^(1/p) {_POOL_DOC} Float types.")


# --------------------------------------------------------------------------------------- linear

def _infer_linear(x: TensorType, w: TensorType, b: TensorType):
    dtype = check_same_dtype(x, w, b)
    check_dtype(x, NUMERIC)
    if x.rank < 1 or w.rank != 2:
        raise ShapeError(f"linear needs x of rank >= 1 and 2-D weights, got {fmt_shape(x.shape)} and "
                         f"{fmt_shape(w.shape)}")
    if x.shape[-1] != w.shape[0]:
        raise ShapeError(f"inner dimensions do not match: x {fmt_shape(x.shape)} (K={x.shape[-1]}) but w "
                         f"{fmt_shape(w.shape)} (K={w.shape[0]})")
    if b.shape not in ((w.shape[1],), (), (1,)):
        raise ShapeError(f"bias has shape {fmt_shape(b.shape)}, expected ({w.shape[1]},) or a scalar")
    return (TensorType(x.shape[:-1] + (w.shape[1],), dtype),)


def _ref_linear(x, w, b):
    return (narrow(np.matmul(wide(x), wide(w)) + wide(b), x.dtype),)


def _sample_linear(rng: np.random.Generator):
    lead = pick(rng, [(4,), (2, 3), (), (1, 5, 2), (64,)])
    k, n = (int(v) for v in rng.integers(1, 33, size=2))
    b_shape = pick(rng, [(n,), (n,), ()])
    return [nonzero(rng, lead + (k,)), nonzero(rng, (k, n)), nonzero(rng, b_shape)], {}


define("linear", infer=_infer_linear, reference=_ref_linear, sample=_sample_linear, arity=3,
       tolerance=(1e-4, 1e-5), contraction=True, doc="""
    x @ w + b: x of any rank >= 1 (leading dims are batch), w 2-D (K, N), b of shape (N,) or a
    scalar. What a MatMul followed by a bias Add becomes (one pass over the result, not two).
""")


def _infer_fused_linear(x: TensorType, w: TensorType, b: TensorType, r: TensorType | None = None, *, activation,
                        alpha, beta):
    _check_activation(activation, alpha, beta)
    check_dtype(x, FLOAT)
    (out,) = _infer_linear(x, w, b)
    if r is not None and (r.shape != out.shape or r.dtype != out.dtype):
        raise ShapeError(f"the residual operand is {r}; it must be the product's result type {out}")
    return (out,)


def _ref_fused_linear(x, w, b, r=None, *, activation="none", alpha=0.0, beta=0.0):
    y = np.matmul(wide(x), wide(w)) + wide(b)
    if r is not None:
        y = y + wide(r)
    return (narrow(apply_activation(y, activation, float(alpha), float(beta)), x.dtype),)


def _sample_fused_linear(rng: np.random.Generator):
    (x, w, b), _ = _sample_linear(rng)
    activation = str(pick(rng, list(ACTIVATIONS)))
    alpha, beta = {"clip": (-0.5, 1.5), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}.get(activation, (0, 0))
    ins = [x, w, b]
    if rng.random() < 0.5:
        ins.append(nonzero(rng, x.shape[:-1] + w.shape[1:]))
    return ins, {"activation": activation, "alpha": alpha, "beta": beta}


define("fused_linear", infer=_infer_fused_linear, reference=_ref_fused_linear, sample=_sample_fused_linear,
       arity=(3, 4), tolerance=(1e-4, 1e-5), fused=True, contraction=True, doc="""
    ``linear`` with its epilogue: activation(x @ w + b + residual), the bias, residual and
    activation applied in one pass over the product. Operands as for ``linear`` (float types);
    the optional residual has the result's type; ``activation``, ``alpha`` and ``beta`` as for
    ``fused_conv``. What a MatMul (or Gemm) with a bias, a residual Add and an activation becomes
    (:mod:`polyhal.passes.fuse_conv`), on devices that have its kernel.
""")


# ------------------------------------------------------------------------------------ attention

def _infer_attention(q: TensorType, k: TensorType, v: TensorType, *, scale):
    dtype = check_same_dtype(q, k, v)
    check_dtype(q, FLOAT)
    if q.rank < 2 or k.rank != q.rank or v.rank != q.rank:
        raise ShapeError(f"q, k and v need one rank >= 2 ((batch..., L, D)), got {fmt_shape(q.shape)}, "
                         f"{fmt_shape(k.shape)} and {fmt_shape(v.shape)}")
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ShapeError(f"batch dims differ: q {fmt_shape(q.shape)}, k {fmt_shape(k.shape)}, v {fmt_shape(v.shape)} "
                         "(they must be equal; broadcast them first)")
    if k.shape[-1] != q.shape[-1]:
        raise ShapeError(f"q {fmt_shape(q.shape)} and k {fmt_shape(k.shape)} differ in the last dim (D)")
    if v.shape[-2] != k.shape[-2]:
        raise ShapeError(f"k {fmt_shape(k.shape)} and v {fmt_shape(v.shape)} differ in the key count (dim -2)")
    if scale is not None and not np.isfinite(float_attr(scale, "scale")):
        raise ProgramError(f"attribute 'scale' must be finite, got {scale}")
    return (TensorType(q.shape[:-1] + (v.shape[-1],), dtype),)


def _ref_attention(q, k, v, mask=None, *, scale=None):
    wq, wk, wv = wide(q), wide(k), wide(v)
    s = np.matmul(wq, np.swapaxes(wk, -1, -2)) * (1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale))
    if mask is not None:
        s = s + wide(mask)
    e = np.exp(s - np.max(s, axis=-1, keepdims=True))
    return (narrow(np.matmul(e / np.sum(e, axis=-1, keepdims=True), wv), q.dtype),)


def _sample_attention(rng: np.random.Generator):
    batch = pick(rng, [(), (2,), (1, 3), (2, 2)])
    lq, lk, d, dv = (int(n) for n in rng.integers(1, 17, size=4))
    scale = pick(rng, [None, None, 0.5, 1.0])
    attrs = {} if scale is None else {"scale": scale}
    return [nonzero(rng, batch + (lq, d)), nonzero(rng, batch + (lk, d)), nonzero(rng, batch + (lk, dv))], attrs


define("attention", infer=_infer_attention, reference=_ref_attention, sample=_sample_attention, arity=3,
       tolerance=(1e-4, 1e-5), contraction=True, doc="""
    Scaled dot-product attention without a mask: softmax(scale * q @ k^T, over the keys) @ v,
    for q (batch..., Lq, D), k (batch..., Lk, D) and v (batch..., Lk, Dv) with equal batch dims;
    the result is (batch..., Lq, Dv). ``scale`` defaults to 1/sqrt(D). What MatMul, Softmax and
    MatMul of a self-attention head become (polyhal.passes.fuse_attention): one op, so that a
    kernel can normalise the (Lq, Dv) result instead of the (Lq, Lk) weights and keep only one
    head's weights in memory at a time.
""")


# ----------------------------------------------------------------------------- masked_attention

def _infer_masked_attention(q: TensorType, k: TensorType, v: TensorType, mask: TensorType, *, scale):
    (out,) = _infer_attention(q, k, v, scale=scale)
    check_same_dtype(q, mask)
    scores = q.shape[:-1] + (k.shape[-2],)
    if mask.rank > len(scores) or broadcast(scores, mask.shape) != scores:
        raise ShapeError(f"the mask {fmt_shape(mask.shape)} does not broadcast to the scores "
                         f"{fmt_shape(scores)} (batch..., Lq, Lk)")
    return (out,)


def _sample_masked_attention(rng: np.random.Generator):
    (q, k, v), attrs = _sample_attention(rng)
    lq, lk = q.shape[-2], k.shape[-2]
    shape = pick(rng, [(lq, lk), (1, lk), q.shape[:-2] + (lq, lk)])
    # causal: -1e9 above the diagonal, a small bias elsewhere (samples hold no zeros); every row
    # keeps its first key
    causal = np.where(np.tri(lq, lk, dtype=bool), np.float32(0.25), np.float32(-1e9))
    mask = np.broadcast_to(causal[:shape[-2]], shape) if rng.random() < 0.5 else nonzero(rng, shape)
    return [q, k, v, np.ascontiguousarray(mask)], attrs


define("masked_attention", infer=_infer_masked_attention, reference=_ref_attention,
       sample=_sample_masked_attention, arity=4, tolerance=(1e-4, 1e-5), fused=True, contraction=True, doc="""
    attention with an additive mask: softmax(scale * q @ k^T + mask, over the keys) @ v, the
    mask of the element type broadcasting to the scores (batch..., Lq, Lk) -- a padding mask
    (0 or a large negative value per key), a causal one (large negatives above the diagonal),
    or a bias. What exporters write as MatMul, scaling, Add of the mask, Softmax and MatMul
    becomes (polyhal.passes.fuse_attention); a separate op from ``attention`` so that the fusion
    asks each device for the masked kernel by name. A row whose every score is masked by the
    same large negative value gets uniform weights, as the unfused ops give it.
""")
