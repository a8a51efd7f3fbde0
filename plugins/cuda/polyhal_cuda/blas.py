"""cuBLAS called directly (ctypes), so that matrix products can be captured into CUDA graphs.

cupy's cuBLAS bindings set the handle's stream before every call and refuse to while a stream
is being captured, so a plan with a ``cupy.matmul`` step could not be replayed as a graph. This
module keeps one cuBLAS handle per device, bound once to the device's stream and given a
workspace from the device's pool (so that cuBLAS allocates nothing during capture), and calls
``cublasGemmStridedBatchedEx`` itself. float32 computes in float32 (``CUBLAS_COMPUTE_32F``: no
TF32 whatever the handle's math mode), float16 accumulates in float32, float64 in float64. A
contraction compiled with ``precision="tf32"`` (:mod:`polyhal.passes.precision`) asks for
``CUBLAS_COMPUTE_32F_FAST_TF32`` per call instead, so TF32 is a per-op choice and never a
handle-wide math mode that other plans on the device would inherit.

Operands may be views (:func:`operand_layout`): a matrix whose rows or columns are contiguous
goes to cuBLAS with the matching op flag and leading dimension, a batch whose matrices sit at
one stride with that batch stride -- so a transpose of the last two dims, a slice of rows or
columns, and the heads of a projection cost no copy. Products it does not cover (integer types,
partial batch broadcasting, other operand layouts) go through ``cupy.matmul`` as before; such
plans run eagerly.
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal_cuda.errors import CUDAError

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

OP_N, OP_T = 0, 1
_DATA = {np.dtype(np.float16): 2, np.dtype(np.float32): 0, np.dtype(np.float64): 1}  # cudaDataType
_COMPUTE = {np.dtype(np.float16): 68, np.dtype(np.float32): 68, np.dtype(np.float64): 70}  # cublasComputeType_t
_SCALAR = {np.dtype(np.float16): np.float32, np.dtype(np.float32): np.float32, np.dtype(np.float64): np.float64}
#: CUBLAS_COMPUTE_32F_FAST_TF32: float32 operands on TF32 tensor cores, float32 accumulation.
COMPUTE_32F_FAST_TF32 = 77
GEMM_DEFAULT = -1
WORKSPACE = 32 << 20

_lib: Any = None
_lib_lock = threading.Lock()


def mapped_library(name: str) -> ctypes.CDLL:
    """The shared library whose file name starts with ``name`` (``"libcublas.so"``) as this
    process already mapped it (the copy cupy loaded, found in ``/proc/self/maps``), else the
    one the dynamic loader finds by ``name``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.count("/") else ""
                if path.rsplit("/", 1)[-1].startswith(name):
                    return ctypes.CDLL(path)
    except OSError:
        pass
    return ctypes.CDLL(name)


def _library() -> Any:
    """libcublas as cupy loaded it (found in this process's mappings), with prototypes."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas)

        lib = mapped_library("libcublas.so")
        vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmStridedBatchedEx.argtypes = [
            vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll, i, i, i]
        lib.cublasGemmBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i, i]
        for fn in (lib.cublasCreate_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
                   lib.cublasGemmStridedBatchedEx, lib.cublasGemmBatchedEx):
            fn.restype = ctypes.c_int
        _lib = lib
        return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CUDAError(f"cuBLAS {what} failed with status {status}", status=status)


class Blas:
    """One cuBLAS handle of a device, bound to its stream (see the module docstring)."""

    def __init__(self, device: "Device") -> None:
        lib = _library()
        self.lib = lib
        self.handle = ctypes.c_void_p()
        with device.activate():
            _check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "create")
            _check(lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(device.stream.ptr)), "set stream")
            self._workspace = device.cuda_allocator.pool.malloc(WORKSPACE)
            _check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self._workspace.ptr), WORKSPACE),
                   "set workspace")


def blas_for(device: "Device") -> Blas | None:
    """The device's :class:`Blas` (made once), or None when libcublas cannot be called directly."""
    b = getattr(device, "_blas", None)
    if b is None:
        try:
            b = Blas(device)
        except Exception:  # noqa: BLE001 - fall back to cupy.matmul
            b = False
        device._blas = b
    return b or None


def _batch(shape: tuple, out_batch: tuple, per: int) -> int | None:
    """Batch stride of an operand: its matrix size when its batch dims equal the output's, 0 when
    it has none (or all ones), None for partial broadcasting."""
    if math.prod(shape) == 1 or not shape:
        return 0
    if tuple(shape) == tuple(out_batch):
        return per
    return None


def operand_layout(shape: tuple, strides: tuple, trans: bool = False) -> tuple[int, int, int] | None:
    """``(op, ld, batch_stride)`` with which cuBLAS reads an operand of ``shape`` laid out with
    element ``strides`` (its matrix is the last two dims, transposed first with ``trans``;
    batch dims before them), or None when it cannot: rows contiguous is ``OP_N`` with ``ld``
    the row stride, columns contiguous ``OP_T`` with ``ld`` the column stride (our row-major
    product is cuBLAS's column-major one, see :func:`_gemm_pointers`); the batch dims must sit
    at one stride (0 when there is one matrix)."""
    if len(shape) < 2:
        return None
    r, c = shape[-2:]
    sr, sc = strides[-2:]
    if trans:
        r, c, sr, sc = c, r, sc, sr
    if (c == 1 or sc == 1) and (r == 1 or sr >= max(c, 1)):
        layout = (OP_N, sr if r > 1 else max(c, 1))
    elif (r == 1 or sr == 1) and (c == 1 or sc >= max(r, 1)):
        layout = (OP_T, sc if c > 1 else max(r, 1))
    else:
        return None
    batch = [(d, st) for d, st in zip(shape[:-2], strides[:-2]) if d != 1]
    for (_d, outer), (d, inner) in zip(batch, batch[1:]):
        if outer != d * inner:
            return None  # the matrices do not sit at one stride
    return layout + (batch[-1][1] if batch else 0,)


def accepts_view(op: str, attrs: dict, ins, outs, index: int, strides: tuple, offset: int) -> bool:
    """Whether the cuBLAS kernel of ``op`` (matmul, gemm, linear) reads operand ``index`` as a view
    of these element ``strides`` without a copy (a gemm's C and a linear's bias are copied into
    the result, whatever their layout)."""
    t = ins[index]
    if op == "matmul":
        return index < 2 and t.rank >= 2 and operand_layout(t.shape, strides) is not None
    if op == "gemm":
        return index == 2 or operand_layout(t.shape, strides, bool(attrs["trans_a" if index == 0 else "trans_b"])) \
            is not None
    if index == 0:  # linear's x: its leading dims must flatten to the rows of one matrix
        from polyhal.dlpack import reshaped_strides

        k = ins[1].shape[0]
        flat = reshaped_strides(t.shape, strides, (t.size // k if k else 0, k))
        return flat is not None and operand_layout((t.size // k if k else 0, k), flat) is not None
    return index == 2 or operand_layout(t.shape, strides) is not None


def prepare_matmul(device: "Device", a_t, b_t, out_t, *, tf32: bool = False):
    """A capturable ``fn(a, b, out)`` for numpy-style matmul, or None when not covered (``tf32``:
    float32 products on TF32 tensor cores)."""
    dtype = out_t.dtype
    if dtype not in _DATA or a_t.dtype != dtype or b_t.dtype != dtype:
        return None
    a_shape = a_t.shape if a_t.rank > 1 else (1,) + a_t.shape
    b_shape = b_t.shape if b_t.rank > 1 else b_t.shape + (1,)
    m, k = a_shape[-2:]
    n = b_shape[-1]
    out_batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    sa, sb = _batch(a_shape[:-2], out_batch, m * k), _batch(b_shape[:-2], out_batch, k * n)
    if sa is None or sb is None or 0 in (m, n, k):
        return None
    return _gemm_call(device, dtype, m, n, k, False, False, sa, sb, math.prod(out_batch), 1.0, 0.0, tf32)


def prepare_gemm(device: "Device", a_t, b_t, out_t, trans_a: bool, trans_b: bool, alpha: float, beta: float, *,
                 tf32: bool = False):
    """``fn(a, b, out)``: out = alpha * op(a) @ op(b) + beta * out (out holds C, or beta is 0)."""
    dtype = out_t.dtype
    if dtype not in _DATA:
        return None
    m, n = out_t.shape
    k = a_t.shape[0] if trans_a else a_t.shape[1]
    if 0 in (m, n, k):
        return None
    return _gemm_call(device, dtype, m, n, k, trans_a, trans_b, 0, 0, 1, alpha, beta, tf32)


def prepare_batched(device: "Device", dtype: Any, m: int, n: int, k: int, batch: int, *,
                    trans_b: bool = False, alpha: float = 1.0, tf32: bool = False):
    """``fn(a, b, out)``: out[i] = alpha * a[i] @ op(b[i]) for ``batch`` dense stacked matrices --
    a (batch, m, k), b (batch, k, n) or with ``trans_b`` (batch, n, k), out (batch, m, n) -- or
    None when cuBLAS cannot be called directly or the type is not covered."""
    dtype = np.dtype(dtype)
    if dtype not in _DATA or 0 in (m, n, k, batch):
        return None
    return _gemm_call(device, dtype, m, n, k, False, trans_b, m * k, k * n, batch, alpha, 0.0, tf32)


def _gemm_call(device, dtype, m, n, k, trans_a, trans_b, stride_a, stride_b, batch, alpha, beta, tf32=False):
    call = _gemm_pointers(device, dtype, m, n, k, trans_a, trans_b, stride_a, stride_b, m * n, batch, alpha, beta,
                          tf32)
    if call is None:
        return None

    def run(a, b, out):
        if not out.flags.c_contiguous:
            raise CUDAError("cuBLAS path needs a contiguous result")
        if a.flags.c_contiguous and b.flags.c_contiguous:
            call(a.data.ptr, b.data.ptr, out.data.ptr)
            return
        # a view (bufferize made it after accepts_view said yes): its own op flag, ld, batch stride
        la = None if a.flags.c_contiguous else _layout_of(a, trans_a)
        lb = None if b.flags.c_contiguous else _layout_of(b, trans_b)
        if (la is None and not a.flags.c_contiguous) or (lb is None and not b.flags.c_contiguous):
            raise CUDAError(f"cuBLAS cannot read operands of strides {a.strides} and {b.strides} (bytes)")
        call(a.data.ptr, b.data.ptr, out.data.ptr, la, lb)

    run.consts = call.consts  # type: ignore[attr-defined]  (keeps the host scalars alive)
    return run


def _layout_of(x: Any, trans: bool) -> tuple[int, int, int] | None:
    """:func:`operand_layout` of a strided cupy array (element strides from its byte strides)."""
    return operand_layout(x.shape, tuple(st // x.itemsize for st in x.strides), trans)


def prepare_strided(device: "Device", dtype: Any, m: int, n: int, k: int, batch: int, stride_a: int,
                    stride_b: int, stride_c: int, *, tf32: bool = False):
    """``fn(a_ptr, b_ptr, c_ptr)``: for ``i < batch``, the row-major (m, n) matrix at ``c_ptr +
    i * stride_c`` elements = (m, k) at ``a_ptr + i * stride_a`` @ (k, n) at ``b_ptr + i *
    stride_b`` (a stride of 0 shares one matrix) -- device addresses, so that a caller can
    address slices of scratch and outputs without making arrays; None when not covered."""
    dtype = np.dtype(dtype)
    if dtype not in _DATA or 0 in (m, n, k, batch):
        return None
    return _gemm_pointers(device, dtype, m, n, k, False, False, stride_a, stride_b, stride_c, batch, 1.0, 0.0, tf32)


def _gemm_pointers(device, dtype, m, n, k, trans_a, trans_b, stride_a, stride_b, stride_c, batch, alpha, beta,
                   tf32=False):
    blas = blas_for(device)
    if blas is None:
        return None
    lib, handle = blas.lib, blas.handle
    scalar = _SCALAR[dtype]
    consts = np.array([alpha, beta], scalar)  # host pointers, read when the call is made or captured
    pa, pb = consts.ctypes.data, consts.ctypes.data + consts.itemsize
    dt, ct = _DATA[dtype], COMPUTE_32F_FAST_TF32 if tf32 and dtype == np.float32 else _COMPUTE[dtype]
    # Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS's "A" is our B.
    op_b, ld_b = (OP_T, k) if trans_b else (OP_N, n)
    op_a, ld_a = (OP_T, m) if trans_a else (OP_N, k)
    gemm = lib.cublasGemmStridedBatchedEx

    def call(a_ptr: int, b_ptr: int, c_ptr: int, layout_a: tuple | None = None, layout_b: tuple | None = None
             ) -> None:
        oa, la, sa = layout_a or (op_a, ld_a, stride_a)
        ob, lb, sb = layout_b or (op_b, ld_b, stride_b)
        status = gemm(handle, ob, oa, n, m, k, pa, b_ptr, dt, lb, sb, a_ptr, dt, la, sa, pb, c_ptr, dt, n,
                      stride_c, batch, ct, GEMM_DEFAULT)
        if status != 0:
            raise CUDAError(f"cublasGemmStridedBatchedEx failed with status {status}", status=status)

    call.consts = consts  # type: ignore[attr-defined]  (keeps the host scalars alive)
    return call


def prepare_pointer_batched(device: "Device", dtype: Any, m: int, n: int, k: int, batch: int, *,
                            alpha: float = 1.0, tf32: bool = False):
    """``fn(a_ptrs, b_ptrs, c_ptrs, layout_a, layout_b)``: for ``i < batch``, the dense row-major
    (m, n) matrix at ``c_ptrs[i]`` = alpha * (m, k) at ``a_ptrs[i]`` @ (k, n) at ``b_ptrs[i]``
    (``cublasGemmBatchedEx``: device arrays of device addresses), each operand read with its
    ``(op, ld)`` of :func:`operand_layout` -- for batches that sit at no one stride (the heads
    of a packed projection: batch and head at two strides), where the strided-batched call
    cannot reach them; None when not covered."""
    dtype = np.dtype(dtype)
    blas = blas_for(device)
    if blas is None or dtype not in _DATA or 0 in (m, n, k, batch):
        return None
    lib, handle = blas.lib, blas.handle
    consts = np.array([alpha, 0.0], _SCALAR[dtype])
    pa, pb = consts.ctypes.data, consts.ctypes.data + consts.itemsize
    dt, ct = _DATA[dtype], COMPUTE_32F_FAST_TF32 if tf32 and dtype == np.float32 else _COMPUTE[dtype]
    gemm = lib.cublasGemmBatchedEx

    def call(a_ptrs: int, b_ptrs: int, c_ptrs: int, layout_a: tuple, layout_b: tuple) -> None:
        (oa, la), (ob, lb) = layout_a[:2], layout_b[:2]
        status = gemm(handle, ob, oa, n, m, k, pa, b_ptrs, dt, lb, a_ptrs, dt, la, pb, c_ptrs, dt, n, batch, ct,
                      GEMM_DEFAULT)
        if status != 0:
            raise CUDAError(f"cublasGemmBatchedEx failed with status {status}", status=status)

    call.consts = consts  # type: ignore[attr-defined]  (keeps the host scalars alive)
    return call
