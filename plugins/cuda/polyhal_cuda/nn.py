"""conv (without cuDNN), conv_transpose and the pools on CUDA: static index maps, CUDA C and cuBLAS.

Which input element every (window tap, output position) pair reads depends only on the shapes
and attributes, so :func:`window_map` computes it once, at prepare time, on the host (numpy,
vectorised) and uploads it:

* conv is im2col + GEMM: the ``im2col`` kernel (``cu/window.cu``) writes ``cols[n, c, tap, pos]
  = x[n, c, map[tap, pos]]`` (0 where the tap falls in the padding) into the conv's *declared
  scratch* -- sized for a chunk of images so that it stays bounded (:data:`COLUMNS_BUDGET`) --
  and a strided-batched cuBLAS product per group writes the output in place. Nothing is
  allocated while it runs, so a plan with it replays as a CUDA graph. (cuBLAS's GEMM over
  explicit columns measured faster than a hand-written implicit GEMM would be on most shapes;
  the columns cost scratch, which the plan's arena shares between ops.)
* the pools run one CUDA C thread per output element over the taps (padding never wins a max;
  the average divides by the taps inside the input, or inside the padded input with
  ``count_include_pad``; lp computes in float64); float16 pools gather with cupy;
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


#: Bytes of im2col columns one conv's scratch holds at most (the conv runs that many images at a
#: time; one image's columns are always held, however large).
COLUMNS_BUDGET = 64 << 20
#: ``cu/window.cu``'s kernels and their template instances.
WINDOW_SOURCE = "window.cu"
_COPY_TYPES = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
_POOL_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
               np.dtype(np.int8): "signed char", np.dtype(np.uint8): "unsigned char"}
WINDOW_EXPRESSIONS = tuple(f"im2col<{t}>" for t in _COPY_TYPES.values()) + tuple(
    f"max_pool<{t}>" for t in _POOL_TYPES.values()) + ("sum_pool<float>", "sum_pool<double>")


class ConvShape:
    """One conv instance's geometry: images ``N``, channels ``C`` -> ``M`` in ``g`` groups, taps
    ``K``, input plane ``S`` and output positions ``L`` elements, and the images per chunk."""

    def __init__(self, attrs: dict, ins, outs) -> None:
        x_t, w_t = ins[0], ins[1]
        n = x_t.rank - 2
        self.strides = _spatial(attrs["strides"], n, 1)
        self.pads = _spatial(attrs["pads"], n, 0, 2)
        self.dilations = _spatial(attrs["dilations"], n, 1)
        self.g = int(attrs["group"])
        self.N, self.C = x_t.shape[:2]
        self.M = w_t.shape[0]
        self.kernel = tuple(w_t.shape[2:])
        self.size, self.out = tuple(x_t.shape[2:]), tuple(outs[0].shape[2:])
        self.K, self.L, self.S = math.prod(self.kernel), math.prod(self.out), math.prod(self.size)
        self.itemsize = outs[0].dtype.itemsize
        per_image = self.C * self.K * self.L * self.itemsize
        self.chunk = max(1, min(self.N, COLUMNS_BUDGET // max(per_image, 1)))
        self.columns_bytes = self.chunk * per_image

    def window_map(self) -> np.ndarray:
        """int32 map ``(K, L)``: the flat input index each tap of each position reads, -1 in the padding."""
        n = len(self.size)
        flat, valid = window_map(self.size, self.kernel, self.strides, self.pads[:n], self.dilations, self.out)
        return np.where(valid, flat, -1).astype(np.int32)


def columns_request(attrs: dict, ins, outs) -> tuple[str, int] | None:
    """(purpose, bytes) of the im2col columns a conv instance declares as scratch, or None when
    it has no columns to hold (empty operands)."""
    if any(t.size == 0 for t in (*ins, *outs)):
        return None
    c = ConvShape(attrs, ins, outs)
    return (f"im2col columns of {c.chunk} of {c.N} image(s) at a time", c.columns_bytes)


def prepare_conv(device: "Device", attrs: dict, ins, outs, columns_ptr: int | None = None):
    """``fn(x, w[, b], out)``: im2col into the scratch at ``columns_ptr`` + cuBLAS (see the
    module doc); the cupy gather + matmul, which allocates, where cuBLAS cannot be called
    directly, no scratch was given, or the operands are empty."""
    import cupy as cp

    from polyhal_cuda import blas
    from polyhal_cuda.cuda_source import function
    from polyhal_gpu.launch import BLOCK, grid, multiprocessors

    c = ConvShape(attrs, ins, outs)
    N, C, M, g, K, L, S = c.N, c.C, c.M, c.g, c.K, c.L, c.S
    cg, mg = C // g, M // g
    dtype = outs[0].dtype
    has_bias = len(ins) == 3
    n = len(c.size)
    bias_shape = (M,) + (1,) * n
    direct = columns_ptr is not None and dtype.itemsize in _COPY_TYPES and not any(
        t.size == 0 for t in (*ins, *outs))
    # Ungrouped convs batch the images of a chunk in one GEMM (shared weights), grouped ones one
    # GEMM per group over the chunk's images -- or, with more groups than images per chunk
    # (depthwise), one GEMM per image over its groups.
    by_group = g > 1 and g > c.chunk
    tf32 = attrs.get("precision") == "tf32"  # a contraction compiled with precision="tf32"
    chunks = [(n0, min(c.chunk, N - n0)) for n0 in range(0, N, c.chunk)]
    gemm = tail = None
    if direct:
        if by_group:
            gemm = blas.prepare_strided(device, dtype, mg, L, cg * K, g, mg * cg * K, cg * K * L, mg * L, tf32=tf32)
        else:
            gemm = blas.prepare_strided(device, dtype, mg, L, cg * K, c.chunk, 0, C * K * L, M * L, tf32=tf32)
            last = chunks[-1][1]
            tail = gemm if last == c.chunk else blas.prepare_strided(device, dtype, mg, L, cg * K, last, 0,
                                                                      C * K * L, M * L, tf32=tf32)
    if gemm is None:
        return _gathered_conv(device, c, has_bias, dtype)
    with device.activate():
        dmap = cp.asarray(c.window_map())
    copy = function(device, WINDOW_SOURCE, WINDOW_EXPRESSIONS, f"im2col<{_COPY_TYPES[dtype.itemsize]}>")
    launch, sms = device.launch, multiprocessors(device)
    item = dtype.itemsize
    s_, k_, l_ = np.int64(S), np.int32(K), np.int64(L)
    image_cols, image_out = C * K * L * item, M * L * item
    w_group, cols_group, out_group = mg * cg * K * item, cg * K * L * item, mg * L * item
    cols = np.uint64(columns_ptr)

    def conv(x, w, *rest):
        out = rest[-1]
        xp, wp, op = x.data.ptr, w.data.ptr, out.data.ptr
        for n0, nb in chunks:
            planes = nb * C
            launch(copy, "im2col", grid(planes * K * L, sms), (BLOCK,),
                   (np.uint64(xp + n0 * C * S * item), cols, dmap, np.int64(planes), s_, k_, l_))
            if by_group:
                for i in range(nb):
                    gemm(wp, columns_ptr + i * image_cols, op + (n0 + i) * image_out)
            else:
                call = gemm if nb == c.chunk else tail
                for gi in range(g):
                    call(wp + gi * w_group, columns_ptr + gi * cols_group, op + n0 * image_out + gi * out_group)
        if has_bias:
            out += rest[0].reshape(bias_shape)
    conv.kernel_name = "conv (im2col into scratch + cuBLAS)"  # type: ignore[attr-defined]
    return conv


#: Element types of the backend's own depthwise conv.
_DEPTHWISE_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def is_depthwise(attrs: dict, ins) -> bool:
    """Whether a conv instance is a 2-d depthwise conv the backend's own kernel computes (one
    filter per channel; float32/float64). cuDNN's fp32-exact engines ran these 3-10x slower
    than this kernel (a 7x7 depthwise conv of ConvNeXt at batch 16: ~200 us against ~40)."""
    x, w = ins[0], ins[1]
    return (x.rank == 4 and x.dtype in _DEPTHWISE_TYPES and int(attrs["group"]) == x.shape[1] == w.shape[0] > 1
            and w.shape[1] == 1 and x.size > 0)


def prepare_depthwise(device: "Device", attrs: dict, ins, outs, activation: str = "none", alpha: float = 0.0,
                      beta: float = 0.0, channels_last: bool = False):
    """``fn(x, w[, b][, r], out)``: a depthwise conv with its bias, residual and activation in
    one CUDA C kernel (one thread per output element; the instance's geometry compiled in).
    ``ins`` and ``outs`` are the NCHW types; with ``channels_last`` the maps are stored NHWC
    (the channel is the fastest index, so neighbouring threads read neighbouring channels)."""
    x_t, w_t, out_t = ins[0], ins[1], outs[0]
    N, C, H, W = x_t.shape
    OH, OW = out_t.shape[2:]
    KH, KW = w_t.shape[2:]
    sh, sw = _spatial(attrs["strides"], 2, 1)
    ph, pw = _spatial(attrs["pads"], 2, 0, 2)[:2]
    dh, dw = _spatial(attrs["dilations"], 2, 1)
    has_bias, has_res = len(ins) >= 3, len(ins) == 4
    ctype = _DEPTHWISE_TYPES[out_t.dtype]
    if channels_last:  # i runs over (n, oh, ow, c): a pixel's channels are adjacent
        index = (f"const int c = (int)(i % {C}), ow = (int)((i / {C}) % {OW}), oh = (int)((i / {C * OW}) % {OH});\n"
                 f"    const T* plane = x + (i / {C * OH * OW}LL) * {H * W * C}LL + c;")
        pixel = f" * {C}"
    else:  # i runs over (n, c, oh, ow)
        index = (f"const int ow = (int)(i % {OW}), oh = (int)((i / {OW}) % {OH});\n"
                 f"    const long long nc = i / {OH * OW}LL;\n    const int c = (int)(nc % {C});\n"
                 f"    const T* plane = x + nc * {H * W}LL;")
        pixel = ""
    # a and b are the activation's alpha and beta (the names _ACTIVATION_C's formulas use)
    params = ["const T* __restrict__ x", "const T* __restrict__ w"] + (
        ["const T* __restrict__ bias"] if has_bias else []) + (["const T* __restrict__ r"] if has_res else []) + [
        "T* __restrict__ y", "C a", "C b"]
    source = f"""typedef {ctype} T; typedef {ctype} C;
template <typename C> __device__ C polyhal_unit(C h) {{ return h < (C)0 ? (C)0 : (h > (C)1 ? (C)1 : h); }}
extern "C" __global__ void depthwise({", ".join(params)}) {{
  const long long total = {N * C * OH * OW}LL;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {{
    {index}
    const T* f = w + c * {KH * KW};
    C v = {"(C)bias[c]" if has_bias else "(C)0"};
    #pragma unroll
    for (int kh = 0; kh < {KH}; ++kh) {{
      const int ih = oh * {sh} - {ph} + kh * {dh};
      if (ih < 0 || ih >= {H}) continue;
      #pragma unroll
      for (int kw = 0; kw < {KW}; ++kw) {{
        const int iw = ow * {sw} - {pw} + kw * {dw};
        if (iw >= 0 && iw < {W}) v += (C)plane[(ih * {W} + iw){pixel}] * (C)__ldg(f + kh * {KW} + kw);
      }}
    }}
    {"v += (C)r[i];" if has_res else ""}
    y[i] = (T)({_ACTIVATION_C[activation]});
  }}
}}
"""

    def build():
        import cupy

        mod = cupy.RawModule(code=source, options=("-std=c++17",))
        mod.compile()
        return mod

    from polyhal_gpu.launch import BLOCK, grid, multiprocessors

    fn = device.module(("depthwise", source), build).get_function("depthwise")
    shape = grid(out_t.size, multiprocessors(device))
    scalars = (out_t.dtype.type(alpha), out_t.dtype.type(beta))
    launch = device.launch

    def depthwise(*arrays):
        launch(fn, "depthwise", shape, (BLOCK,), (*arrays, *scalars))
    depthwise.kernel_name = f"depthwise conv {KH}x{KW}{' NHWC' if channels_last else ''}{'+bias' if has_bias else ''}" \
                            f"{'+residual' if has_res else ''}{'+' + activation if activation != 'none' else ''} (CUDA C)"
    return depthwise


def _gathered_conv(device: "Device", c: ConvShape, has_bias: bool, dtype: Any):
    """The conv as cupy gather + matmul (allocates its columns while it runs)."""
    import cupy as cp

    N, C, M, g, K, L, S = c.N, c.C, c.M, c.g, c.K, c.L, c.S
    cg, mg = C // g, M // g
    n = len(c.size)
    flat, valid = window_map(c.size, c.kernel, c.strides, c.pads[:n], c.dilations, c.out)
    with device.activate():
        dmap, dmask = cp.asarray(flat), cp.asarray(valid.astype(dtype))

    def kernel(x, w, *rest):
        out = rest[-1]
        cols = x.reshape(N, C, S)[:, :, dmap]  # (N, C, K, L)
        cols *= dmask  # taps in the padding read 0
        cols = cols.reshape(N, g, cg * K, L)
        res = cp.matmul(w.reshape(g, mg, cg * K), cols)  # (N, g, mg, L)
        res = res.reshape((N, M) + c.out)
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
    if dtype in _POOL_TYPES and (kind == "max" or dtype.kind == "f"):
        return _window_pool(device, kind, dtype, np.where(valid, flat, -1).astype(np.int32),
                            count if kind == "avg" else None, float(attrs["p"]) if kind == "lp" else 0.0,
                            N * C, S, outs[0])
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


def _window_pool(device: "Device", kind: str, dtype: Any, wmap: np.ndarray, count: Any, p: float, planes: int,
                 S: int, out_t) -> Any:
    """``fn(x, out)``: a pool as one ``cu/window.cu`` kernel (one thread per output element)."""
    import cupy as cp

    from polyhal_cuda.cuda_source import function
    from polyhal_gpu.launch import BLOCK, grid, multiprocessors

    K, L = wmap.shape
    with device.activate():
        dmap = cp.asarray(wmap)
        dcount = cp.asarray(np.asarray(count, np.float64)) if count is not None else None
    ctype = _POOL_TYPES[dtype]
    expression = f"max_pool<{ctype}>" if kind == "max" else f"sum_pool<{ctype}>"
    fn = function(device, WINDOW_SOURCE, WINDOW_EXPRESSIONS, expression)
    launch, shape = device.launch, grid(planes * L, multiprocessors(device))
    geometry = (np.int64(planes), np.int64(S), np.int32(K), np.int64(L))
    if kind == "max":
        def max_pool(x, out):
            launch(fn, expression, shape, (BLOCK,), (x, out, dmap) + geometry)
        max_pool.kernel_name = expression  # type: ignore[attr-defined]
        return max_pool
    # lp pools pass no counts (a null pointer) and their p; averages pass p = 0
    counts = dcount if dcount is not None else np.uint64(0)
    pw = np.float64(p)

    def sum_pool(x, out):
        launch(fn, expression, shape, (BLOCK,), (x, out, dmap, counts) + geometry + (pw,))
    sum_pool.kernel_name = f"{expression} ({kind})"  # type: ignore[attr-defined]
    return sum_pool


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
