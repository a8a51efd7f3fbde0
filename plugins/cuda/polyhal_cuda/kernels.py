"""The op set on CUDA: ``KERNEL_NAMES``, ``scratch`` and ``prepare``.

:func:`prepare` does everything that depends only on the op, its attributes and the operand
types (parsing attributes, choosing a code path, compiling CUDA C, precomputing index maps,
placing scratch) and returns a closure, the plan's hot path, called as ``fn(*inputs,
*outputs)`` with ``cupy.ndarray`` operands; results are written into the outputs (``out=``
everywhere, no result arrays are returned). Closures run on the device's stream (the device
makes it current) and never synchronise with the host, so a plan's steps can be captured into
a CUDA graph — except the few marked ``capturable = False`` (host fallbacks), which make the
plan stay eager.

Families and how they run:

* elementwise (arithmetic, comparisons, logical, bitwise, math): cupy ufuncs with ``out=`` (one
  broadcasting kernel each), and ``cupy.ElementwiseKernel`` CUDA C for what numpy has no ufunc
  for or where the op's semantics differ from cupy's (relu, sigmoid, erf, gelu, sign, where,
  mod, bit_shift);
* matmul, gemm, einsum, mmt4d: cuBLAS through cupy (``cupy.matmul(out=)``, ``cupy.einsum``);
  linear (and gemm with a bias row as C) through cuBLAS, or cublasLt with the bias in its epilogue
  where that measures faster (:mod:`.blaslt`);
* reductions, argmax/argmin, cumsum: cupy's reduction kernels (CUB where cupy uses it);
* softmax and layer_norm: one CUDA C kernel per row (:mod:`.rowwise`), cupy ops otherwise;
* conv and fused_conv (:mod:`.cudnn`): depthwise convs by a CUDA C kernel with the epilogue
  fused (:mod:`.nn`); others as cuDNN graphs (conv + bias + residual + activation, the engine
  timed per shape) when ``nvidia-cudnn-frontend`` is installed, else im2col into declared
  scratch plus cuBLAS (:mod:`.nn`);
* concat: one CUDA C launch over every operand;
* conv_transpose (:mod:`.nn`): an index map plus cuBLAS and a scatter-add; the pools: one CUDA C
  kernel over a window map (float16 gathers with cupy);
* data movement: cupy copies; a constant pad fills its border and copies the operand into its
  interior; ops that are other pure gathers with a static pattern (edge and reflect pads, pack,
  unpack) use an *index map* computed once at prepare time by running the op's own numpy
  reference on an iota tensor, then one gather kernel per run;
* gather/scatter families: cupy fancy indexing and ``cupyx`` scatter kernels;
* sort, argsort, topk (:mod:`.sorting`) and non_max_suppression (:mod:`.suppression`): CUDA C with
  declared scratch (shared memory when it fits, global scratch otherwise);
* attention (:mod:`.attention`): two batched cuBLAS products around the row-wise softmax, its
  intermediates declared as global scratch;
* grid_sample, roi_align, det, tree_ensemble, tfidf_vectorizer (:mod:`.portable`): the C kernels
  polyhal-opencl runs too (:mod:`polyhal_gpu.portable`), compiled with NVRTC.

Operands that are views (the bufferize pass folds a transpose, a slice or a gather of one index
into its consumers instead of copying) reach the kernels registered with ``views``: cupy's
elementwise, reduction and copy kernels take any strides; the cuBLAS products take a matrix
whose rows or columns are contiguous and batches at one stride (:func:`.blas.accepts_view`);
attention q, k and v whose heads sit at one batch stride or two (:func:`.attention.accepts_view`).
The others (the row-wise, convolution, pooling and sorting kernels, which address rows by
pointer) get dense operands.

An op of :data:`polyhal.ops.OPS` without a CUDA kernel here (new ops added to the core after
this backend) still runs, through :func:`host_fallback` (download, the op's numpy reference,
upload): correct, slow, never captured. :data:`HOST_FALLBACK` names them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from polyhal.hal.kernels import KernelTable
from polyhal.ir.encoding import pack_split
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, normalize_axes, normalize_slice
from polyhal.ops.nn import CHANNEL_BLOCKED_CONV

from polyhal_cuda import attention, blas, blaslt, copies, cudnn, portable, sorting, suppression
from polyhal_gpu import storage
from polyhal_gpu.elementwise import PREAMBLE, SNIPPETS, snippet_key
from polyhal_gpu.fallback import host_fallback as reference_on_host
from polyhal_gpu.launch import BLOCK, grid, multiprocessors

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

Kernel = Callable[..., None]
Types = tuple[TensorType, ...]


def _cupy():
    import cupy

    return cupy


def host_fallback(device: "Device", op: str, attrs: dict, in_types: Types, out_types: Types,
                  scratch: Any = None) -> Kernel:
    """Download the inputs, run the op's numpy reference, upload the outputs (synchronous, so
    never captured into a CUDA graph)."""
    cp = _cupy()

    def upload(result: np.ndarray, out: Any) -> None:
        out.set(np.require(result.reshape(out.shape), requirements="C"))

    return reference_on_host(op, attrs, in_types, lambda a, t: cp.asnumpy(a), upload)


#: The op set (:class:`~polyhal.hal.kernels.KernelTable`): builders take ``(device, op, attrs,
#: in_types, out_types, scratch_binding)``; what none takes runs through :func:`host_fallback`.
#: The storage-only element types reach cast, identity and bitcast only (never the fallback).
TABLE = KernelTable("cuda", fallback=host_fallback, storage_types=storage.STORAGE_OPS)
register = TABLE.register


# ------------------------------------------------------------------------------------ elementwise

#: op -> cupy ufunc name (the same semantics as the op's numpy reference, out= supported).
UFUNCS = {
    "add": "add", "sub": "subtract", "mul": "multiply", "div": "true_divide", "pow": "power",
    "maximum": "maximum", "minimum": "minimum", "equal": "equal", "not_equal": "not_equal",
    "less": "less", "less_equal": "less_equal", "greater": "greater", "greater_equal": "greater_equal",
    "logical_and": "logical_and", "logical_or": "logical_or", "logical_xor": "logical_xor",
    "bitwise_and": "bitwise_and", "bitwise_or": "bitwise_or", "bitwise_xor": "bitwise_xor",
    "neg": "negative", "abs": "absolute", "exp": "exp", "log": "log", "sqrt": "sqrt", "tanh": "tanh",
    "sin": "sin", "cos": "cos", "tan": "tan", "asin": "arcsin", "acos": "arccos", "atan": "arctan",
    "sinh": "sinh", "cosh": "cosh", "asinh": "arcsinh", "acosh": "arccosh", "atanh": "arctanh",
    "floor": "floor", "ceil": "ceil", "round": "rint", "reciprocal": "reciprocal", "isnan": "isnan",
    "isinf": "isinf", "logical_not": "logical_not", "bitwise_not": "invert",
}


def _ufunc_kernel(ufunc: Any, nin: int) -> Kernel:
    if nin == 1:
        def k1(x, out):
            ufunc(x, out=out)
        return k1

    def k2(x, y, out):
        ufunc(x, y, out=out)
    return k2


@register(*UFUNCS, views=True)
def _ufunc(device, op, attrs, ins, outs, binding) -> Kernel:
    kernel = _ufunc_kernel(getattr(_cupy(), UFUNCS[op]), len(ins))
    kernel.kernel_name = f"cupy.{UFUNCS[op]}"  # type: ignore[attr-defined]
    return kernel


_EW_CACHE: dict[str, Any] = {}


def elementwise_kernel(key: str) -> Any:
    """The cupy ``ElementwiseKernel`` of snippet ``key`` (:data:`~polyhal_gpu.elementwise.SNIPPETS`;
    made once)."""
    k = _EW_CACHE.get(key)
    if k is None:
        ins, outs, code = SNIPPETS[key]
        k = _EW_CACHE[key] = _cupy().ElementwiseKernel(ins, outs, code, f"polyhal_{key}", preamble=PREAMBLE)
    return k


def _ew(key: str, nin: int) -> Kernel:
    ek = elementwise_kernel(key)
    if nin == 1:
        def k1(x, out):
            ek(x, out)
        kernel = k1
    elif nin == 2:
        def k2(x, y, out):
            ek(x, y, out)
        kernel = k2
    else:
        def k3(c, x, y, out):
            ek(c, x, y, out)
        kernel = k3
    kernel.kernel_name = f"polyhal_{key}"  # type: ignore[attr-defined]
    return kernel


@register("relu", "sign", "sigmoid", "erf", "gelu", "where", "bit_shift", "mod", views=True)
def _snippet(device, op, attrs, ins, outs, binding) -> Kernel:
    return _ew(snippet_key(op, attrs, ins[0].dtype), len(ins))


@register("cast", "identity", views=True)
def _cast(device, op, attrs, ins, outs, binding) -> Kernel:
    src, dst = ins[0].dtype, outs[0].dtype
    if src != dst and (storage.is_storage(src) or storage.is_storage(dst)):
        return _storage_cast(src, dst)
    if attrs.get("strict") and src.kind == "f" and dst.kind in "iu":
        return None  # nan/inf must be refused, which needs the values: the host fallback's reference checks
    copyto = _cupy().copyto

    def kernel(x, out):
        copyto(out, x, casting="unsafe")  # numpy's astype: floats truncate, nonzero is True
    return kernel


def storage_cast_code(src: np.dtype, dst: np.dtype) -> str:
    """The ``ElementwiseKernel`` body of a cast to or from a storage type (``X x`` -> ``Y y``)."""
    value = "((float)x)" if src == np.float16 else "x"  # cupy's float16 is a class: compare floats
    return f"y = (Y)({storage.cast_expr(src, dst, value)})"


def _storage_cast(src: np.dtype, dst: np.dtype) -> Kernel:
    """A cast to or from a storage-only type: the arrays hold its bits (unsigned integers, see
    :meth:`~polyhal_cuda.device.CUDADevice.view`), converted by the C that OpenCL runs too
    (:mod:`polyhal_gpu.storage`)."""
    key = f"cast_{src.name}_{dst.name}"
    k = _EW_CACHE.get(key)
    if k is None:
        k = _EW_CACHE[key] = _cupy().ElementwiseKernel("X x", "Y y", storage_cast_code(src, dst), f"polyhal_{key}",
                                                       preamble=storage.source())

    def kernel(x, out):
        k(x, out)
    kernel.kernel_name = f"polyhal_{key}"  # type: ignore[attr-defined]
    return kernel


# ----------------------------------------------------------------------------------------- linalg

@register("matmul", views=blas.accepts_view)
def _matmul(device, op, attrs, ins, outs, binding) -> Kernel:
    tf32 = attrs["precision"] == "tf32"
    direct = blas.prepare_matmul(device, ins[0], ins[1], outs[0], tf32=tf32)
    if direct is not None:  # cuBLAS called directly: capturable into a CUDA graph
        direct.kernel_name = "cublasGemmStridedBatchedEx" + (" (TF32)" if tf32 else "")  # type: ignore[attr-defined]
        return direct
    matmul = _cupy().matmul

    def kernel(a, b, out):
        matmul(a, b, out=out)  # cuBLAS (cupy picks gemm / strided batched gemm)
    kernel.kernel_name = "cublas gemm (cupy.matmul)"  # type: ignore[attr-defined]
    return kernel


@register("gemm", views=blas.accepts_view)
def _gemm(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    trans_a, trans_b = bool(attrs["trans_a"]), bool(attrs["trans_b"])
    alpha, beta = float(attrs["alpha"]), float(attrs["beta"])
    dtype = outs[0].dtype
    alpha_c, beta_c = dtype.type(alpha), dtype.type(beta)
    has_c = len(ins) == 3
    direct = blas.prepare_gemm(device, ins[0], ins[1], outs[0], trans_a, trans_b, alpha, beta if has_c else 0.0,
                               tf32=attrs["precision"] == "tf32")
    if direct is not None:
        copyto = cp.copyto

        def gemm(a, b, *rest):
            out = rest[-1]
            if has_c:
                copyto(out, rest[0])  # C broadcast into the result; cuBLAS adds beta * it
            direct(a, b, out)
        gemm.kernel_name = "cublasGemmStridedBatchedEx"  # type: ignore[attr-defined]
        m, n = outs[0].shape
        if has_c and beta == 1.0 and not trans_a and ins[2].shape in ((n,), (1, n)):
            # a linear layer's Gemm: cublasLt with C as the epilogue's bias where it measures faster
            return blaslt.prepare_linear(device, dtype, m, ins[0].shape[1], n, attrs["precision"] == "tf32", gemm,
                                         trans_b=trans_b, alpha=alpha) or gemm
        return gemm

    def kernel(a, b, *rest):
        out = rest[-1]
        cp.matmul(a.T if trans_a else a, b.T if trans_b else b, out=out)
        if alpha != 1.0:
            cp.multiply(out, alpha_c, out=out)
        if has_c:
            cp.add(out, rest[0] if beta == 1.0 else cp.multiply(rest[0], beta_c), out=out)
    return kernel


@register("einsum", "mmt4d")
def _einsum(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    equation = attrs["equation"] if op == "einsum" else "mkac,nkbc->mnab"

    def kernel(*arrays):
        cp.copyto(arrays[-1], cp.einsum(equation, *arrays[:-1]), casting="unsafe")
    return kernel


# ------------------------------------------------------------------------------------- reductions

_REDUCERS = {"reduce_sum": "sum", "reduce_mean": "mean", "reduce_max": "amax", "reduce_min": "amin",
             "reduce_prod": "prod"}


@register(*_REDUCERS, views=True)
def _reduce(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    axes, keepdims = normalize_axes(attrs["axes"], ins[0].rank), bool(attrs["keepdims"])
    if axes == ():  # reduces nothing: the operand itself
        copyto = cp.copyto

        def ident(x, out):
            copyto(out, x)
        return ident
    fn = getattr(cp, _REDUCERS[op])
    kw: dict[str, Any] = {}
    if op in ("reduce_sum", "reduce_prod") and ins[0].dtype.kind in "iub":
        kw["dtype"] = ins[0].dtype  # integer sums and products wrap in the operand type

    if op in ("reduce_max", "reduce_min"):
        # cupy's CUB path for amax/amin with out= fails a dtype check under numpy 2.5: reduce
        # into a temporary and copy (one small extra kernel).
        copyto = cp.copyto

        def extremum(x, out):
            copyto(out, fn(x, axis=axes, keepdims=keepdims))
        return extremum

    def kernel(x, out):
        fn(x, axis=axes, out=out, keepdims=keepdims, **kw)
    return kernel


@register("argmax", "argmin", views=True)
def _argext(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    fn = cp.argmax if op == "argmax" else cp.argmin
    axis = int(attrs["axis"]) % ins[0].rank
    shape = outs[0].shape  # keepdims or not: the result reshaped to the output's shape

    def kernel(x, out):
        cp.copyto(out, fn(x, axis=axis).reshape(shape), casting="unsafe")
    return kernel


@register("cumsum", "cumprod", views=True)
def _cumulative(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    axis = int(attrs["axis"]) % ins[0].rank
    exclusive, reverse = bool(attrs["exclusive"]), bool(attrs["reverse"])
    wide = np.float64 if ins[0].dtype.kind == "f" else ins[0].dtype  # as the reference (float64)
    fn = cp.cumsum if op == "cumsum" else cp.cumprod
    identity = 0 if op == "cumsum" else 1
    n = ins[0].shape[axis]
    head = tuple(slice(None) if i != axis else slice(0, 1) for i in range(ins[0].rank))
    body = tuple(slice(None) if i != axis else slice(0, n - 1) for i in range(ins[0].rank))

    def kernel(x, out):
        w = cp.flip(x, axis) if reverse else x
        y = fn(w, axis=axis, dtype=wide)
        if exclusive:  # shift by one along the axis, the identity first
            y = cp.concatenate([cp.full_like(y[head], identity), y[body]], axis=axis)
        cp.copyto(out, cp.flip(y, axis) if reverse else y, casting="unsafe")
    return kernel


@register("linear", views=blas.accepts_view)
def _linear(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    x_t, w_t, b_t = ins
    k, n = w_t.shape
    m = x_t.size // k if k else 0
    flat_x, flat_out = TensorType((m, k), x_t.dtype), TensorType((m, n), outs[0].dtype)
    direct = (blas.prepare_gemm(device, flat_x, w_t, flat_out, False, False, 1.0, 1.0,
                                tf32=attrs["precision"] == "tf32") if m else None)
    copyto = cp.copyto

    if direct is not None:
        def linear(x, w, b, out):
            o2 = out.reshape(m, n)
            copyto(o2, b)  # the bias, broadcast; cuBLAS adds x @ w to it
            direct(x.reshape(m, k), w, o2)
        linear.kernel_name = "cublasGemmStridedBatchedEx (linear)"  # type: ignore[attr-defined]
        if b_t.shape != (n,):  # a scalar bias: cublasLt's bias epilogue reads n values
            return linear
        # cublasLt with the bias in its epilogue where it measures faster for this shape
        return blaslt.prepare_linear(device, x_t.dtype, m, k, n, attrs["precision"] == "tf32", linear) or linear

    def linear_cupy(x, w, b, out):
        copyto(out, cp.matmul(x, w) + b, casting="unsafe")
    return linear_cupy


@register("bitcast", views=True)
def _bitcast(device, op, attrs, ins, outs, binding) -> Kernel:
    copyto, src = _cupy().copyto, storage.bits_dtype(ins[0].dtype)

    def kernel(x, out):
        copyto(out.view(src), x)  # the same bytes, no conversion (a storage type's as its bits)
    return kernel


@register("softmax", "layer_norm")
def _rowwise(device, op, attrs, ins, outs, binding) -> Kernel:
    from polyhal_cuda import rowwise

    return rowwise.prepare(device, op, attrs, ins, outs)


# ----------------------------------------------------------------------------------------- shape

@register("transpose", views=True)
def _transpose(device, op, attrs, ins, outs, binding) -> Kernel:
    copy = copies.prepare(device)  # a row at a time where the last axis stays (cupy's copy otherwise)
    rank = ins[0].rank
    perm = tuple(reversed(range(rank))) if attrs["perm"] is None else tuple(int(p) for p in attrs["perm"])

    def kernel(x, out):
        copy(x.transpose(perm), out)
    return kernel


@register("reshape", views=True)
def _reshape(device, op, attrs, ins, outs, binding) -> Kernel:
    copy = copies.prepare(device)

    def kernel(x, out):
        copy(x, out.reshape(x.shape))  # out is dense, so this is a view of it: no temporary, even of a strided x
    return kernel


@register("concat", views=True)
def _concat(device, op, attrs, ins, outs, binding) -> Kernel:
    """One launch for all operands (cupy's concatenate makes one copy per operand: a DenseNet
    concat of 30 feature maps took 90 us at batch 1). The instance's offsets are compiled in."""
    cp = _cupy()
    n, axis = len(ins), int(attrs["axis"]) % ins[0].rank
    item = outs[0].dtype.itemsize
    if item not in _BIT_TYPES or n > 256:
        def concatenate(*arrays):
            cp.concatenate(arrays[:n], axis=axis, out=arrays[n])
        return concatenate
    fn, name = _concat_function(device, [t.shape[axis] for t in ins], math.prod(outs[0].shape[axis + 1:]),
                                _BIT_TYPES[item])
    total = outs[0].size
    shape = grid(total, multiprocessors(device))
    count = np.int64(total)

    def concat(*arrays):
        if not all(a.flags.c_contiguous for a in arrays):
            cp.concatenate(arrays[:n], axis=axis, out=arrays[n])
            return
        device.launch(fn, name, shape, (BLOCK,), (*arrays, count))
    concat.kernel_name = f"{name} ({n} operands, one launch)"  # type: ignore[attr-defined]
    return concat


_BIT_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


def _concat_function(device, sizes: list[int], inner: int, ctype: str):
    """The compiled concat of operands with ``sizes`` along the axis (``inner`` elements after
    it): each output element finds its operand by the offsets, then copies its bits."""
    total_axis = sum(sizes)
    params = ", ".join(f"const T* __restrict__ in{k}" for k in range(len(sizes)))
    branches, off = [], 0
    for k, a in enumerate(sizes):
        if a:
            branches.append(f"if (c < {off + a}) {{ src = in{k}; a = {a}; off = {off}; }}")
        off += a
    body = " else ".join(branches)
    source = (f"typedef {ctype} T;\n"
              f"extern \"C\" __global__ void concat({params}, T* __restrict__ out, long long total) {{\n"
              f"  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;\n"
              f"       i += (long long)gridDim.x * blockDim.x) {{\n"
              f"    const long long o = i / {total_axis * inner}LL, r = i % {total_axis * inner}LL;\n"
              f"    const long long c = r / {inner}LL, j = r % {inner}LL;\n"
              f"    const T* src = in0; long long a = 1, off = 0;\n"
              f"    {body}\n"
              f"    out[i] = src[(o * a + (c - off)) * {inner}LL + j];\n"
              f"  }}\n}}\n")

    def build():
        import cupy

        mod = cupy.RawModule(code=source, options=("-std=c++17",))
        mod.compile()
        return mod

    return device.module(("concat", source), build).get_function("concat"), "concat"


@register("slice", views=True)
def _slice(device, op, attrs, ins, outs, binding) -> Kernel:
    copyto = _cupy().copyto
    index = normalize_slice(ins[0].shape, attrs["starts"], attrs["ends"], attrs["axes"], attrs["steps"])

    def kernel(x, out):
        copyto(out, x[index])
    return kernel


@register("gather", views=True)
def _gather(device, op, attrs, ins, outs, binding) -> Kernel:
    take = _cupy().take
    axis = int(attrs["axis"]) % ins[0].rank

    def kernel(data, indices, out):
        # cupy wraps indices into range (negative ones count from the end, as the op says); an
        # index outside [-dim, dim) is not checked, which would need a device-to-host sync.
        take(data, indices, axis=axis, out=out)
    return kernel


@register("expand", views=True)
def _expand(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    shape = outs[0].shape

    def kernel(x, out):
        cp.copyto(out, cp.broadcast_to(x, shape))
    return kernel


def _index_map(op: str, attrs: dict, in_types: Types, pad_attr: str | None) -> np.ndarray:
    """The flat source index of every output element of a pure data-movement op (-1 where the op
    writes padding), found by running the op's numpy reference on iota inputs."""
    iotas, base = [], 0
    for t in in_types:
        iotas.append(np.arange(base, base + t.size, dtype=np.int64).reshape(t.shape))
        base += t.size
    a = dict(attrs)
    if pad_attr is not None:
        a[pad_attr] = -1
    (out,) = OPS[op].reference(*iotas, **a)
    return np.ascontiguousarray(out, dtype=np.int64).reshape(-1)


@register("pad", "pack", "unpack")
def _gather_map(device, op, attrs, ins, outs, binding) -> Kernel:
    if op == "pad" and attrs["mode"] == "constant":
        return _constant_pad(attrs, ins[0], outs[0])
    cp = _cupy()
    if op in ("pack", "unpack"):
        copy = _strided_relayout(op, attrs, ins[0], outs[0])
        if copy is not None:
            return copy
    pad_attr = "padding_value" if op == "pack" else None  # pad's edge and reflect modes pad from x
    mapping = _index_map(op, attrs, ins, pad_attr)
    has_pad = bool((mapping < 0).any())
    dtype = outs[0].dtype
    fill = np.asarray(attrs[pad_attr] if pad_attr else 0).astype(dtype)
    with device.activate():
        dmap = cp.asarray(np.where(mapping < 0, 0, mapping))
        dvalid = cp.asarray(mapping >= 0) if has_pad else None
        dfill = cp.asarray(fill)
    where = elementwise_kernel("where")

    def kernel(x, out):
        flat = out.reshape(-1)
        if has_pad:
            where(dvalid, x.reshape(-1)[dmap], dfill, flat)
        else:
            cp.take(x.reshape(-1), dmap, out=flat)
    kernel.index_map = mapping  # type: ignore[attr-defined]
    return kernel


def _strided_relayout(op, attrs, x_t, out_t) -> Kernel | None:
    """A pack or unpack whose tiles divide their dims (e.g. NCHW <-> NHWC) as one strided copy:
    no index map (one int64 per element, held by the plan), or None where the pack pads."""
    dense = x_t.shape if op == "pack" else out_t.shape
    pos, tiles = tuple(attrs["inner_dims_pos"]), tuple(attrs["inner_tiles"])
    perm = None if attrs["outer_dims_perm"] is None else tuple(attrs["outer_dims_perm"])
    found = pack_split(tuple(dense), pos, tiles, perm)
    if found is None:
        return None
    split, order = found
    inverse = tuple(int(i) for i in np.argsort(order))
    copyto = _cupy().copyto

    if op == "pack":
        def relayout(x, out):
            copyto(out, x.reshape(split).transpose(order))
    else:
        def relayout(x, out):
            copyto(out.reshape(split), x.transpose(inverse))
    relayout.kernel_name = f"{op} (one strided copy)"  # type: ignore[attr-defined]
    return relayout


def _constant_pad(attrs: dict, x_t: TensorType, out_t: TensorType) -> Kernel:
    """A constant pad without an index map (one int64 per result element, held by the plan: 38
    MB for one Swin-T feature map at batch 16): the fill value where the result pads, then the
    operand (cropped where a pad is negative) copied into the result's interior."""
    rank = x_t.rank
    pads = [int(p) for p in attrs["pads"]]
    pairs = list(zip(pads[:rank], pads[rank:]))
    crop = tuple(slice(max(-b, 0), d - max(-e, 0)) for d, (b, e) in zip(x_t.shape, pairs))
    inner = tuple(slice(max(b, 0), d - max(e, 0)) for d, (b, e) in zip(out_t.shape, pairs))
    fill = np.asarray(attrs["value"]).astype(out_t.dtype)[()]
    pads_any = any(b > 0 or e > 0 for b, e in pairs)
    copyto = _cupy().copyto

    def pad(x, out):
        if pads_any:
            out.fill(fill)
        copyto(out[inner], x[crop])
    pad.kernel_name = "cupy fill + copy (constant pad)"  # type: ignore[attr-defined]
    return pad


@register("gather_elements")
def _gather_elements(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    axis = int(attrs["axis"]) % ins[0].rank
    dim = ins[0].shape[axis]

    idx_shape = ins[1].shape
    with device.activate():
        grid = [cp.arange(n).reshape([n if i == j else 1 for j in range(len(idx_shape))])
                for i, n in enumerate(idx_shape)]

    def kernel(data, indices, out):
        g = list(grid)
        g[axis] = cp.where(indices < 0, indices + dim, indices)
        cp.copyto(out, data[tuple(g)])
    return kernel


@register("gather_nd")
def _gather_nd(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    data_t, idx_t = ins
    b = int(attrs["batch_dims"])
    k = idx_t.shape[-1]
    batch = math.prod(data_t.shape[:b])
    dims = np.array(data_t.shape[b:b + k], dtype=np.int64)
    with device.activate():
        ddims = cp.asarray(dims)
        bidx = cp.arange(batch, dtype=np.int64)[:, None]
    out_shape = outs[0].shape

    def kernel(data, indices, out):
        d = data.reshape((batch,) + data_t.shape[b:])
        pos = indices.reshape(batch, -1, k).astype(np.int64)
        pos = cp.where(pos < 0, pos + ddims, pos)
        got = d[(bidx,) + tuple(pos[..., j] for j in range(k))]
        cp.copyto(out, got.reshape(out_shape))
    return kernel


_SCATTER_TYPES = frozenset(np.dtype(t) for t in (np.int32, np.int64, np.uint32, np.uint64, np.float32, np.float64))


def _scatter_apply(cp: Any, out: Any, where: tuple, updates: Any, reduction: str) -> bool:
    """Apply a scatter on the device; False when ``reduction`` has no device kernel here."""
    import cupyx

    if reduction != "none" and out.dtype not in _SCATTER_TYPES:
        # cupyx's atomics exist for 32/64-bit types: reduce in a wide copy, round once.
        wide = np.float64 if out.dtype.kind == "f" else np.int64 if out.dtype.kind == "i" else np.uint64
        tmp = out.astype(wide)
        ok = _scatter_apply(cp, tmp, where, updates.astype(wide), reduction)
        cp.copyto(out, tmp, casting="unsafe")
        return ok
    if reduction == "none":
        out[where] = updates
    elif reduction == "add":
        cupyx.scatter_add(out, where, updates)
    elif reduction == "max":
        cupyx.scatter_max(out, where, updates)
    elif reduction == "min":
        cupyx.scatter_min(out, where, updates)
    else:
        return False
    return True


@register("scatter_elements", "scatter_nd")
def _scatter(device, op, attrs, ins, outs, binding) -> Kernel:
    cp = _cupy()
    reduction = attrs["reduction"]
    if reduction == "mul":  # cupyx has no scatter_multiply: keep numpy's semantics on the host
        return host_fallback(device, op, attrs, ins, outs)
    data_t, idx_t = ins[0], ins[1]
    if op == "scatter_elements":
        axis = int(attrs["axis"]) % data_t.rank
        dim = data_t.shape[axis]
        with device.activate():
            grid = [cp.arange(n).reshape([n if i == j else 1 for j in range(idx_t.rank)])
                    for i, n in enumerate(idx_t.shape)]

        def kernel(data, indices, updates, out):
            cp.copyto(out, data)
            g = list(grid)
            g[axis] = cp.where(indices < 0, indices + dim, indices)
            g = [cp.broadcast_to(a, idx_t.shape) for a in g]
            _scatter_apply(cp, out, tuple(g), updates, reduction)
        return kernel

    k = idx_t.shape[-1]
    with device.activate():
        ddims = cp.asarray(np.array(data_t.shape[:k], dtype=np.int64))

    def kernel_nd(data, indices, updates, out):
        cp.copyto(out, data)
        pos = indices.reshape(-1, k).astype(np.int64)
        pos = cp.where(pos < 0, pos + ddims, pos)
        ups = updates.reshape((pos.shape[0],) + data_t.shape[k:])
        _scatter_apply(cp, out, tuple(pos[:, j] for j in range(k)), ups, reduction)
    return kernel_nd


# -------------------------------------------------------------------------------- conv, pooling

# conv and fused_conv: cuDNN graphs where cuDNN is usable and has an engine, else the im2col
# conv (plus one elementwise epilogue for fused_conv); see polyhal_cuda.cudnn. The plugin
# advertises fused_conv only where cuDNN is usable, so the compile fuses only there.
TABLE.define(cudnn.BLOCKED_CONV, **CHANNEL_BLOCKED_CONV)  # the channels-last convs of polyhal_cuda.layout
register("conv", "fused_conv", cudnn.BLOCKED_CONV, scratch=cudnn.scratch_requests)(cudnn.prepare)


@register("conv_transpose")
def _conv_transpose(device, op, attrs, ins, outs, binding) -> Kernel:
    from polyhal_cuda import nn

    return nn.prepare_conv_transpose(device, attrs, ins, outs)


@register("max_pool", "avg_pool", "lp_pool")
def _pool(device, op, attrs, ins, outs, binding) -> Kernel:
    from polyhal_cuda import nn

    return nn.prepare_pool(device, op, attrs, ins, outs)


# ---------------------------------------------------------------------------- sorting, detection

register("sort", "argsort", "topk", scratch=sorting.scratch_requests)(sorting.prepare)
register("attention", scratch=attention.scratch_requests, views=attention.accepts_view)(attention.prepare)
register("non_max_suppression", scratch=suppression.scratch_requests)(suppression.prepare)


@register(*portable.OPS)
def _portable(device, op, attrs, ins, outs, binding) -> Kernel:
    return portable.prepare(device, op, attrs, ins, outs, lambda: host_fallback(device, op, attrs, ins, outs))


#: Ops that run through the host fallback (no CUDA kernel yet), at import time.
HOST_FALLBACK: frozenset[str] = TABLE.fallback_ops
#: Every op this backend runs: all of polyhal.ops (a few through the host fallback).
KERNEL_NAMES: frozenset[str] = TABLE.kernel_names
