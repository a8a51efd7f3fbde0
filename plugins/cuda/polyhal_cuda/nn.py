"""conv, conv_transpose and the pools on CUDA: static index maps plus cuBLAS.

Which input element every (window tap, output position) pair reads depends only on the shapes
and attributes, so :func:`window_map` computes it once, at prepare time, on the host (numpy,
vectorised) and uploads it:

* conv is im2col + matmul: ``cols[n, c, tap, pos] = x[n, c, map[tap, pos]]`` (0 where the tap
  falls in the padding), then a batched cuBLAS product per group with the weights;
* the pools gather the same columns and reduce over the taps (padding never wins a max; the
  average divides by the taps inside the input, or inside the padded input with
  ``count_include_pad``; lp computes in float64);
* conv_transpose is the adjoint: a batched product gives every (output channel, tap, input
  position) contribution, scattered (atomic adds) into the output positions a second map
  names, dropping those the ``pads`` crop away.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one


def _spatial(value: Any, n: int, default: int, count: int = 1) -> tuple[int, ...]:
    return (default,) * (n * count) if value is None else tuple(int(v) for v in value)


def window_map(size: tuple, kernel: tuple, strides: tuple, pads_begin: tuple, dilations: tuple,
               out: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(flat input index, valid) arrays of shape (taps, positions): tap ``j`` of output position
    ``o`` reads input coordinate ``o * s - pb + j * d`` per dim (valid when inside the input)."""
    n = len(size)
    taps = [np.arange(k) for k in kernel]
    pos = [np.arange(o) for o in out]
    flat = np.zeros((math.prod(kernel), math.prod(out)), np.int64)
    valid = np.ones(flat.shape, bool)
    stride = 1
    for i in reversed(range(n)):
        t = pos[i][None, :] * strides[i] - pads_begin[i] + taps[i][:, None] * dilations[i]  # (K_i, O_i)
        shape_k = [1] * n
        shape_k[i] = kernel[i]
        shape_o = [1] * n
        shape_o[i] = out[i]
        ti = t.reshape(shape_k + shape_o)
        ti = np.broadcast_to(ti, tuple(kernel) + tuple(out)).reshape(flat.shape)
        valid &= (ti >= 0) & (ti < size[i])
        flat += np.clip(ti, 0, size[i] - 1) * stride
        stride *= size[i]
    return flat, valid


def prepare_conv(device: "Device", attrs: dict, ins, outs):
    import cupy as cp

    x_t, w_t = ins[0], ins[1]
    n = x_t.rank - 2
    s = _spatial(attrs["strides"], n, 1)
    p = _spatial(attrs["pads"], n, 0, 2)
    d = _spatial(attrs["dilations"], n, 1)
    g = int(attrs["group"])
    N, C = x_t.shape[:2]
    M = w_t.shape[0]
    k = w_t.shape[2:]
    out_sp = outs[0].shape[2:]
    flat, valid = window_map(x_t.shape[2:], k, s, p[:n], d, out_sp)
    K, L, S = flat.shape[0], flat.shape[1], math.prod(x_t.shape[2:])
    cg, mg = C // g, M // g
    dtype = outs[0].dtype
    with device.activate():
        dmap, dmask = cp.asarray(flat), cp.asarray(valid.astype(dtype))
    has_bias = len(ins) == 3

    def kernel(x, w, *rest):
        out = rest[-1]
        cols = x.reshape(N, C, S)[:, :, dmap]  # (N, C, K, L)
        cols *= dmask  # taps in the padding read 0
        cols = cols.reshape(N, g, cg * K, L)
        res = cp.matmul(w.reshape(g, mg, cg * K), cols)  # (N, g, mg, L)
        res = res.reshape((N, M) + tuple(out_sp))
        if has_bias:
            res += rest[0].reshape((M,) + (1,) * n)
        cp.copyto(out, res)
    kernel.kernel_name = "conv (im2col gather + cuBLAS)"  # type: ignore[attr-defined]
    return kernel


def prepare_conv_transpose(device: "Device", attrs: dict, ins, outs):
    import cupy as cp
    import cupyx

    x_t, w_t = ins[0], ins[1]
    n = x_t.rank - 2
    s = _spatial(attrs["strides"], n, 1)
    p = _spatial(attrs["pads"], n, 0, 2)
    d = _spatial(attrs["dilations"], n, 1)
    g = int(attrs["group"])
    N, C = x_t.shape[:2]
    mg = w_t.shape[1]
    M = mg * g
    cg = C // g
    k = w_t.shape[2:]
    K = math.prod(k)
    in_sp, out_sp = x_t.shape[2:], outs[0].shape[2:]
    Lin, Sout = math.prod(in_sp), math.prod(out_sp)
    # tap j of input position l lands on output coordinate l * s + j * d - pad_begin
    flat, valid = _transpose_map(in_sp, k, s, p[:n], d, out_sp)
    dest = (np.arange(N * g * mg)[:, None, None] * Sout + flat[None]).reshape(-1)  # (N*g*mg, K, Lin)
    keep = np.broadcast_to(valid[None], (N * g * mg, K, Lin)).reshape(-1)
    with device.activate():
        ddest = cp.asarray(dest[keep])
        dkeep = cp.asarray(np.flatnonzero(keep))
    has_bias = len(ins) == 3
    dtype = outs[0].dtype
    wide = np.float64 if dtype != np.float32 else np.float32

    def kernel(x, w, *rest):
        out = rest[-1]
        xs = x.reshape(N, g, cg, Lin)
        wt = w.reshape(g, cg, mg * K).transpose(0, 2, 1)  # (g, mg*K, cg)
        contrib = cp.matmul(wt, xs).astype(wide, copy=False)  # (N, g, mg*K, Lin)
        acc = cp.zeros(N * M * Sout, wide)
        cupyx.scatter_add(acc, ddest, contrib.reshape(-1)[dkeep])
        acc = acc.reshape((N, M) + tuple(out_sp))
        if has_bias:
            acc += rest[0].reshape((M,) + (1,) * n).astype(wide)
        cp.copyto(out, acc, casting="unsafe")
    kernel.kernel_name = "conv_transpose (cuBLAS + scatter-add)"  # type: ignore[attr-defined]
    return kernel


def _transpose_map(in_sp, k, s, pb, d, out_sp) -> tuple[np.ndarray, np.ndarray]:
    """(flat output index, valid) of shape (taps, input positions) for conv_transpose."""
    n = len(in_sp)
    K, L = math.prod(k), math.prod(in_sp)
    flat = np.zeros((K, L), np.int64)
    valid = np.ones((K, L), bool)
    stride = 1
    for i in reversed(range(n)):
        t = np.arange(in_sp[i])[None, :] * s[i] + np.arange(k[i])[:, None] * d[i] - pb[i]  # (K_i, L_i)
        shape_k, shape_l = [1] * n, [1] * n
        shape_k[i], shape_l[i] = k[i], in_sp[i]
        ti = np.broadcast_to(t.reshape(shape_k + shape_l), tuple(k) + tuple(in_sp)).reshape(K, L)
        valid &= (ti >= 0) & (ti < out_sp[i])
        flat += np.clip(ti, 0, out_sp[i] - 1) * stride
        stride *= out_sp[i]
    return flat, valid


def prepare_pool(device: "Device", op: str, attrs: dict, ins, outs):
    import cupy as cp

    x_t = ins[0]
    n = x_t.rank - 2
    s = _spatial(attrs["strides"], n, 1)
    p = _spatial(attrs["pads"], n, 0, 2)
    d = _spatial(attrs["dilations"], n, 1)
    k = tuple(int(v) for v in attrs["kernel_shape"])
    N, C = x_t.shape[:2]
    size, out_sp = x_t.shape[2:], outs[0].shape[2:]
    flat, valid = window_map(size, k, s, p[:n], d, out_sp)
    S = math.prod(size)
    dtype = x_t.dtype
    kind = op.split("_")[0]
    if kind == "avg":
        if attrs["count_include_pad"]:
            # taps inside the padded input [-pb, size + pe)
            padded_size = tuple(size[i] + p[i] + p[i + n] for i in range(n))
            _, inside = window_map(padded_size, k, s, (0,) * n, d, out_sp)
            count = inside.sum(0)
        else:
            count = valid.sum(0)
    with device.activate():
        dmap, dvalid = cp.asarray(flat), cp.asarray(valid)
        dcount = cp.asarray(count.astype(np.float64)) if kind == "avg" else None
    if kind == "max":
        # a Python scalar: cupy's where takes no numpy arrays, and a weak scalar keeps the dtype
        fill = float("-inf") if dtype.kind == "f" else int(np.iinfo(dtype).min)

        def max_pool(x, out):
            cols = x.reshape(N, C, S)[:, :, dmap]
            cp.copyto(out, cp.where(dvalid, cols, fill).max(axis=2).reshape(out.shape))
        return max_pool
    if kind == "avg":
        def avg_pool(x, out):
            cols = cp.where(dvalid, x.reshape(N, C, S)[:, :, dmap].astype(np.float64), 0.0)
            cp.copyto(out, (cols.sum(axis=2) / dcount).reshape(out.shape), casting="unsafe")
        return avg_pool
    pw = float(attrs["p"])

    def lp_pool(x, out):
        cols = cp.where(dvalid, cp.abs(x.reshape(N, C, S)[:, :, dmap].astype(np.float64)), 0.0)
        cp.copyto(out, ((cols ** pw).sum(axis=2) ** (1.0 / pw)).reshape(out.shape), casting="unsafe")
    return lp_pool


#: A fused epilogue's activation on ``v`` (compute type ``C``; ``a``, ``b`` are alpha and beta),
#: as ``polyhal.ops.nn.apply_activation`` (nan stays nan: comparisons, not fmin/fmax).
_ACTIVATION_C = {
    "none": "v",
    "relu": "v < (C)0 ? (C)0 : v",
    "clip": "v < a ? a : (v > b ? b : v)",
    "hard_sigmoid": "polyhal_unit(a * v + b)",
    "hard_swish": "v * polyhal_unit(a * v + b)",
    "sigmoid": "(C)1 / ((C)1 + exp(-v))",
    "silu": "v / ((C)1 + exp(-v))",
    "gelu": "(C)0.5 * v * ((C)1 + erf(v * (C)0.70710678118654752440))",
    "gelu_tanh": "(C)0.5 * v * ((C)1 + tanh((C)0.79788456080286535588 * (v + (C)0.044715 * v * v * v)))",
}
_EPILOGUES: dict = {}


def epilogue(dtype: Any, activation: str, alpha: float, beta: float, *, bias: bool, residual: bool):
    """``fn(y, [bias], [residual], out)``: out = activation(y + bias + residual) in one
    elementwise kernel (the bias broadcast from ``(M, 1, ...)``; ``out`` may be ``y``)."""
    from polyhal_gpu.elementwise import PREAMBLE

    key = (activation, bias, residual)
    ek = _EPILOGUES.get(key)
    if ek is None:
        import cupy as cp

        params = ", ".join(["T y"] + (["T bias"] if bias else []) + (["T res"] if residual else []) + ["T a0, T b0"])
        sums = "".join([" + (C)bias" if bias else "", " + (C)res" if residual else ""])
        code = (f"typedef typename polyhal_ct<T>::type C; C a = (C)a0, b = (C)b0; C v = (C)y{sums}; "
                f"out = (T)({_ACTIVATION_C[activation]})")
        preamble = PREAMBLE + ("template <typename C> __device__ C polyhal_unit(C h) "
                               "{ return h < (C)0 ? (C)0 : (h > (C)1 ? (C)1 : h); }\n")
        ek = _EPILOGUES[key] = cp.ElementwiseKernel(params, "T out", code, f"polyhal_epilogue_{activation}",
                                                    preamble=preamble)
    a, b = np.dtype(dtype).type(alpha), np.dtype(dtype).type(beta)

    def apply(*arrays):
        ek(*arrays[:-1], a, b, arrays[-1])
    return apply
