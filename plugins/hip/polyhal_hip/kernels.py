"""The op set on HIP: ``KERNEL_NAMES``, ``scratch`` and ``prepare``.

:func:`prepare` does everything that depends on the op instance (choosing a code path,
generating and compiling HIP C for the device's architecture, precomputing strides, placing
scratch) and returns ``fn(*inputs, *outputs)`` over :class:`~polyhal_hip.array.HipArray`
operands, which launches on the device's stream and never waits for the host.

Families and how they run:

* elementwise -- arithmetic, comparisons, logical, bitwise, math, relu/sigmoid/erf/gelu/sign,
  where, mod, bit_shift, cast/identity: one generated instance of ``hip/elementwise.hip`` per
  (op, element types): broadcasting and strided reads in one kernel. The snippets of relu,
  sign, sigmoid, erf, gelu, where, bit_shift and mod are the CUDA C ones polyhal-cuda runs too
  (:mod:`polyhal_gpu.elementwise`);
* data movement -- transpose, expand, slice: the same kernel as a strided copy; reshape: a
  device-to-device copy;
* reductions -- reduce_sum/mean/max/min/prod over any axes: ``hip/reduce.hip``, one workgroup
  per output;
* matmul (batched, broadcasting): ``hip/matmul.hip``, 16 x 16 shared-memory tiles;
* softmax, layer_norm (trailing axes, float32/float64): polyhal-gpu's ``cu/rowwise.cu``
  (:mod:`polyhal_gpu.rowwise`);
* sort, argsort, topk and non_max_suppression: polyhal-gpu's ``cu/sort.cu`` and ``cu/nms.cu``,
  with their scratch declared to the bufferization pass (:mod:`polyhal_hip.sorting`);
* grid_sample, roi_align, det, tree_ensemble, tfidf_vectorizer: polyhal-gpu's portable C, the
  kernels polyhal-opencl and polyhal-cuda run too (:mod:`polyhal_hip.portable`);
* everything else (gemm, einsum, conv, pooling, gather/scatter, cumsum, argmax, concat, pad,
  pack/unpack, ...): the host fallback -- download, the op's numpy reference, upload. Correct,
  slow; :data:`HOST_FALLBACK` names these ops.

None of this has run on an AMD GPU (see the README's hardware table); every source is compiled
for real by the tests, for several architectures.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from polyhal.errors import KernelNotFoundError
from polyhal.hal.kernels import KernelTable
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, normalize_axes, normalize_slice

from polyhal_gpu import rowwise
from polyhal_gpu.elementwise import PREAMBLE, SNIPPETS, snippet_key
from polyhal_gpu.launch import BLOCK, multiprocessors
from polyhal_gpu.launch import grid as launch_grid
from polyhal_gpu.fallback import host_fallback as reference_on_host
from polyhal_hip import compiler, portable, sorting
from polyhal_hip.launch import dims_struct

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the HIP device; its module imports this one

Kernel = Callable[..., None]
Types = tuple[TensorType, ...]

MAX_DIMS = 8

CTYPES = {
    np.dtype(np.bool_): "bool", np.dtype(np.int8): "signed char", np.dtype(np.uint8): "unsigned char",
    np.dtype(np.int16): "short", np.dtype(np.uint16): "unsigned short", np.dtype(np.int32): "int",
    np.dtype(np.uint32): "unsigned int", np.dtype(np.int64): "long long", np.dtype(np.uint64): "unsigned long long",
    np.dtype(np.float16): "_Float16", np.dtype(np.float32): "float", np.dtype(np.float64): "double",
}


def ctype(dtype: Any) -> str:
    return CTYPES[np.dtype(dtype)]


def compute_type(dtype: Any) -> str:
    """The type arithmetic happens in: float for float16, else the type itself."""
    dt = np.dtype(dtype)
    return "float" if dt == np.float16 else CTYPES[dt]


def host_fallback(device: "Device", op: str, attrs: dict, in_types: Types, out_types: Types,
                  scratch: Any = None) -> Kernel:
    """Download the inputs, run the op's numpy reference, upload the outputs (synchronous)."""
    def download(array: Any, t: TensorType) -> np.ndarray:
        host = np.empty(t.shape, t.dtype)
        device.download(array, host)
        return host

    def upload(result: np.ndarray, out: Any) -> None:
        device.upload(np.ascontiguousarray(result), out)

    return reference_on_host(op, attrs, in_types, download, upload)


#: The op set (:class:`~polyhal.hal.kernels.KernelTable`): builders take ``(device, op, attrs,
#: in_types, out_types, scratch_binding)`` and may return None (the instance runs through
#: :func:`host_fallback`).
TABLE = KernelTable("hip", fallback=host_fallback)
register = TABLE.register


def _grid(n: int, device: "Device") -> tuple[int]:
    return launch_grid(n, multiprocessors(device))


# ------------------------------------------------------------------------------------ elementwise

def _float(dt: np.dtype) -> bool:
    return dt.kind == "f"


_BINARY_EXPR = {
    "add": "(CO)a + (CO)b", "sub": "(CO)a - (CO)b", "mul": "(CO)a * (CO)b", "div": "(CO)a / (CO)b",
    "maximum": "polyhal_max<CO>((CO)a, (CO)b)", "minimum": "polyhal_min<CO>((CO)a, (CO)b)",
    "equal": "a == b", "not_equal": "a != b", "less": "a < b", "less_equal": "a <= b", "greater": "a > b",
    "greater_equal": "a >= b", "logical_and": "(a != 0) && (b != 0)", "logical_or": "(a != 0) || (b != 0)",
    "logical_xor": "(a != 0) != (b != 0)", "bitwise_and": "a & b", "bitwise_or": "a | b", "bitwise_xor": "a ^ b",
}
_FLOAT_UNARY = {
    "exp": "exp(a)", "log": "log(a)", "sqrt": "sqrt(a)", "tanh": "tanh(a)", "sin": "sin(a)", "cos": "cos(a)",
    "tan": "tan(a)", "asin": "asin(a)", "acos": "acos(a)", "atan": "atan(a)", "sinh": "sinh(a)", "cosh": "cosh(a)",
    "asinh": "asinh(a)", "acosh": "acosh(a)", "atanh": "atanh(a)", "floor": "floor(a)", "ceil": "ceil(a)",
    "round": "rint(a)", "reciprocal": "(CO)1 / a", "abs": "fabs(a)", "neg": "-a", "isnan": "a != a",
    "isinf": "isinf(a)",
}
_INT_UNARY = {"abs": "(a < (CO)0 ? (CO)(-a) : a)", "neg": "(CO)(-a)", "isnan": "false", "isinf": "false",
              "floor": "a", "ceil": "a", "round": "a"}


def snippet_body(key: str) -> str:
    """A CUDA C elementwise snippet (:data:`~polyhal_gpu.elementwise.SNIPPETS`) as
    elementwise.hip's BODY: its parameters bound to in0..in2, its output to polyhal_out (``T`` is
    the output type)."""
    ins, outs, code = SNIPPETS[key]
    decls = ["typedef TOUT T;"]
    for i, p in enumerate(ins.split(",")):
        typ, name = p.strip().rsplit(" ", 1)
        decls.append(f"const {typ} {name} = ({typ})in{i};")
    otyp, oname = outs.strip().rsplit(" ", 1)
    return " ".join(decls) + f" {otyp} {oname}; {code}; polyhal_out = {oname};"


def elementwise_source(nin: int, in_dtypes: Sequence[Any], out_dtype: Any, expr: str | None = None,
                       body: str | None = None) -> str:
    """The full source of one elementwise instance."""
    lines = [f"#define NIN {nin}"]
    for i, dt in enumerate(in_dtypes):
        lines.append(f"#define T{i} {ctype(dt)}")
        lines.append(f"#define C{i} {compute_type(dt)}")
    lines.append(f"#define TOUT {ctype(out_dtype)}")
    lines.append(f"#define CO {compute_type(out_dtype)}")
    if body is not None:
        lines.append(f"#define BODY {body}")
    else:
        lines.append(f"#define EXPR(a, b, c) ({expr})")
    return compiler.wrap(PREAMBLE + "\n".join(lines) + "\n" + compiler._read("polyhal_hip", "hip", "elementwise.hip"))


def _broadcast_strides(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int]:
    """Element strides of a dense ``shape`` read over ``out_shape`` (0 where broadcast)."""
    dense, step = [], 1
    for e in reversed(shape):
        dense.append(step)
        step *= max(e, 1)
    dense.reverse()
    pad = len(out_shape) - len(shape)
    return [0] * pad + [0 if e == 1 and o != 1 else s for e, o, s in zip(shape, out_shape[pad:], dense)]


def strided_kernel(device: "Device", name: str, text: str, out_shape: tuple[int, ...],
                   in_strides: Sequence[Sequence[int]], offsets: Sequence[int] = (0, 0, 0)) -> Kernel:
    """Launch the elementwise kernel ``text`` over ``out_shape`` with each input read through
    ``in_strides`` (element strides over the output's dims) and ``offsets``."""
    shape = list(out_shape) or [1]
    strides = [list(s) or [0] for s in in_strides] + [[0] * len(shape)] * (3 - len(in_strides))
    if len(shape) > MAX_DIMS:
        raise KernelNotFoundError(f"hip: {name} over {len(shape)} dimensions; the kernel takes at most {MAX_DIMS}")
    offs = list(offsets) + [0] * (3 - len(offsets))
    dims = dims_struct([shape, *strides[:3], offs])
    n = math.prod(out_shape)
    fn = device.function(text, f"{name}.hip", "polyhal_elementwise")
    grid, launch = _grid(n, device), device.launch
    fixed = (np.int64(n), np.int32(len(shape)), dims)
    nin = len(in_strides)

    def kernel(*arrays: Any) -> None:
        ins, out = list(arrays[:nin]), arrays[nin]
        while len(ins) < 3:
            ins.append(None)
        launch(fn, name, grid, (BLOCK,), (*ins, out) + fixed)

    kernel.kernel_name = name  # type: ignore[attr-defined]
    return kernel


def _elementwise(device: "Device", op: str, ins: Types, outs: Types, expr: str | None = None,
                 body: str | None = None) -> Kernel:
    out = outs[0]
    text = elementwise_source(len(ins), [t.dtype for t in ins], out.dtype, expr, body)
    strides = [_broadcast_strides(t.shape, out.shape) for t in ins]
    return strided_kernel(device, f"polyhal_{op}", text, out.shape, strides)


@register(*_BINARY_EXPR)
def _binary(device, op, attrs, ins, outs, binding):
    return _elementwise(device, op, ins, outs, _BINARY_EXPR[op])


@register("pow")
def _pow(device, op, attrs, ins, outs, binding):
    expr = "pow((CO)a, (CO)b)" if _float(outs[0].dtype) else "polyhal_ipow<CO>((CO)a, (CO)b)"
    return _elementwise(device, op, ins, outs, expr)


@register(*_FLOAT_UNARY, "logical_not", "bitwise_not")
def _unary(device, op, attrs, ins, outs, binding):
    dt = ins[0].dtype
    if op == "logical_not":
        expr = "!(a != 0)"
    elif op == "bitwise_not":
        expr = "!a" if dt == np.bool_ else "~a"
    elif _float(dt):
        expr = _FLOAT_UNARY[op]
    elif op in _INT_UNARY:
        expr = _INT_UNARY[op]
    else:
        return None  # integer math (exp of ints, ...): the reference's promotions, on the host
    return _elementwise(device, op, ins, outs, expr)


@register("relu", "sign", "sigmoid", "erf", "gelu", "where", "bit_shift", "mod")
def _snippet(device, op, attrs, ins, outs, binding):
    if op in ("sigmoid", "erf") and not _float(outs[0].dtype):
        return None
    key = snippet_key(op, attrs, ins[0].dtype)
    return _elementwise(device, key, ins, outs, body=snippet_body(key))


@register("cast", "identity")
def _cast(device, op, attrs, ins, outs, binding):
    if attrs.get("strict") and ins[0].dtype.kind == "f" and outs[0].dtype.kind in "iu":
        return None  # nan/inf must be refused, which needs the values: the host fallback's reference checks
    expr = "a != 0" if outs[0].dtype == np.bool_ and ins[0].dtype != np.bool_ else "a"
    return _elementwise(device, f"{op}_{ins[0].dtype}_{outs[0].dtype}", ins, outs, expr)


# ----------------------------------------------------------------------------------- data movement

def _copy_source(dtype: Any) -> str:
    return elementwise_source(1, [dtype], dtype, "a")


@register("transpose")
def _transpose(device, op, attrs, ins, outs, binding):
    x = ins[0]
    perm = tuple(reversed(range(x.rank))) if attrs["perm"] is None else tuple(int(p) % x.rank for p in attrs["perm"])
    dense = _broadcast_strides(x.shape, x.shape)
    return strided_kernel(device, "polyhal_transpose", _copy_source(x.dtype), outs[0].shape, [[dense[p] for p in perm]])


@register("expand")
def _expand(device, op, attrs, ins, outs, binding):
    return strided_kernel(device, "polyhal_expand", _copy_source(ins[0].dtype), outs[0].shape,
                          [_broadcast_strides(ins[0].shape, outs[0].shape)])


@register("slice")
def _slice(device, op, attrs, ins, outs, binding):
    x = ins[0]
    index = normalize_slice(x.shape, attrs["starts"], attrs["ends"], attrs["axes"], attrs["steps"])
    dense = _broadcast_strides(x.shape, x.shape)
    offset, strides = 0, []
    for d, sl in enumerate(index):
        start, _stop, step = sl.indices(x.shape[d]) if isinstance(sl, slice) else (int(sl), 0, 1)
        offset += start * dense[d]
        strides.append(step * dense[d])
    return strided_kernel(device, "polyhal_slice", _copy_source(x.dtype), outs[0].shape, [strides], (offset,))


@register("reshape")
def _reshape(device, op, attrs, ins, outs, binding):
    from polyhal_hip import runtime as hip

    nbytes, rt = outs[0].nbytes, device.runtime

    def kernel(x, out):
        if x.is_contiguous:
            rt.memcpy_async(out.ptr, x.ptr, nbytes, hip.MEMCPY_DEVICE_TO_DEVICE, device.stream)
        else:
            strided(x, out)

    strided = strided_kernel(device, "polyhal_reshape", _copy_source(ins[0].dtype), ins[0].shape,
                             [_broadcast_strides(ins[0].shape, ins[0].shape)])
    kernel.kernel_name = "hipMemcpyAsync (reshape)"  # type: ignore[attr-defined]
    return kernel


# -------------------------------------------------------------------------------------- reductions

def reduce_source(op: str, dtype: Any) -> str | None:
    """The source of one reduction instance, or None where the reference's type rules need the host."""
    dt = np.dtype(dtype)
    if dt == np.bool_ or (op == "reduce_mean" and dt.kind != "f"):
        return None
    acc = "double" if dt == np.float64 else ("float" if dt.kind == "f" else CTYPES[dt])
    if dt.kind == "f":
        lo, hi = "(A)(-__builtin_inff())", "(A)__builtin_inff()"
    else:
        info = np.iinfo(dt)
        suffix = "ULL" if dt.kind == "u" else "LL"
        lo = f"(A)({int(info.min)}{suffix})" if info.min >= -(2**63) + 1 else "(A)(-9223372036854775807LL - 1)"
        hi = f"(A)({int(info.max)}{suffix})"
    init, combine, finish = {
        "reduce_sum": ("(A)0", "((p) + (q))", "(acc)"),
        "reduce_mean": ("(A)0", "((p) + (q))", "((acc) / (A)(count))"),
        "reduce_prod": ("(A)1", "((p) * (q))", "(acc)"),
        "reduce_max": (lo, "polyhal_rmax<A>((p), (q))", "(acc)"),
        "reduce_min": (hi, "polyhal_rmin<A>((p), (q))", "(acc)"),
    }[op]
    head = (f"#define T {CTYPES[dt]}\n#define A {acc}\n#define INIT {init}\n#define COMBINE(p, q) {combine}\n"
            f"#define FINISH(acc, count) {finish}\n")
    return compiler.wrap(head + compiler._read("polyhal_hip", "hip", "reduce.hip"))


@register("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod")
def _reduce(device, op, attrs, ins, outs, binding):
    x = ins[0]
    if outs[0].dtype != x.dtype or x.size == 0:
        return None
    text = reduce_source(op, x.dtype)
    if text is None:
        return None
    axes = normalize_axes(attrs["axes"], x.rank)
    dense = _broadcast_strides(x.shape, x.shape)
    kept = [d for d in range(x.rank) if d not in axes]
    if len(kept) > MAX_DIMS or len(axes) > MAX_DIMS:
        return None
    ks, kst = [x.shape[d] for d in kept], [dense[d] for d in kept]
    rs, rst = [x.shape[d] for d in axes], [dense[d] for d in axes]
    outputs, count = math.prod(ks), math.prod(rs)
    dims = dims_struct([ks, kst, rs, rst])
    fn = device.function(text, f"{op}.hip", "polyhal_reduce")
    block = max(32, min(1024, 1 << max(count - 1, 1).bit_length()))
    block = min(block, 256) if outputs > 1 else block
    grid = (max(1, min(outputs, 65535 * 4)),)
    fixed = (np.int64(outputs), np.int32(len(ks)), np.int64(count), np.int32(len(rs)), dims)
    launch = device.launch

    def kernel(x_, out):
        launch(fn, op, grid, (block,), (x_, out) + fixed)

    kernel.kernel_name = f"polyhal_reduce<{op}>"  # type: ignore[attr-defined]
    return kernel


# -------------------------------------------------------------------------------------------- linalg

def matmul_source(dtype: Any) -> str | None:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return None
    acc = "double" if dt == np.float64 else ("float" if dt.kind == "f" else CTYPES[dt])
    return compiler.wrap(f"#define T {CTYPES[dt]}\n#define ACC {acc}\n" + compiler._read("polyhal_hip", "hip", "matmul.hip"))


@register("matmul")
def _matmul(device, op, attrs, ins, outs, binding):
    a, b = ins
    out = outs[0]
    text = matmul_source(out.dtype)
    if text is None or a.dtype != out.dtype or b.dtype != out.dtype:
        return None
    a_shape = (1,) + a.shape if a.rank == 1 else a.shape
    b_shape = b.shape + (1,) if b.rank == 1 else b.shape
    m, k = a_shape[-2], a_shape[-1]
    n = b_shape[-1]
    batch = np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    if len(batch) > MAX_DIMS:
        return None
    sa = _broadcast_strides(a_shape[:-2], batch) if batch else []
    sb = _broadcast_strides(b_shape[:-2], batch) if batch else []
    sa = [s * m * k for s in sa]
    sb = [s * k * n for s in sb]
    batches = math.prod(batch)
    dims = dims_struct([list(batch), sa, sb])
    fn = device.function(text, "matmul.hip", "polyhal_matmul")
    grid = (-(-n // 16), -(-m // 16), max(1, min(batches, 65535)))
    fixed = (np.int64(m), np.int64(n), np.int64(k), np.int64(batches), np.int32(len(batch)), dims)
    launch = device.launch

    def kernel(x, y, o):
        launch(fn, "polyhal_matmul", grid, (16, 16), (x, y, o) + fixed)

    kernel.kernel_name = "polyhal_matmul"  # type: ignore[attr-defined]
    return kernel


# --------------------------------------------------------------------------------- rowwise (CUDA C)

@register("softmax", "layer_norm")
def _rowwise(device, op, attrs, ins, outs, binding):
    row_plan = rowwise.plan(op, attrs, ins)
    if row_plan is None:
        return None  # softmax over another axis, float16, ...: the reference on the host
    fn = device.function(compiler.source(rowwise.SOURCE), rowwise.SOURCE, row_plan.expression, rowwise.EXPRESSIONS)
    return rowwise.kernel(row_plan, fn, device.launch)


# ---------------------------------------------------------------------------- sorting, detection

register("sort", "argsort", "topk", scratch=sorting.scratch_requests)(sorting.prepare)
register("non_max_suppression", scratch=sorting.nms_scratch_requests)(sorting.prepare_nms)


# ------------------------------------------------------------------------ portable C (OpenCL, CUDA)

@register(*portable.OPS)
def _portable(device, op, attrs, ins, outs, binding) -> Kernel:
    return portable.prepare(device, op, attrs, ins, outs, lambda: host_fallback(device, op, attrs, ins, outs))

#: Ops without a HIP kernel here: they run through :func:`host_fallback`.
HOST_FALLBACK: frozenset[str] = TABLE.fallback_ops
#: Every op this backend runs (some, or some dtypes, through the host fallback).
KERNEL_NAMES: frozenset[str] = TABLE.kernel_names
