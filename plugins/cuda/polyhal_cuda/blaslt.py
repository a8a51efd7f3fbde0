"""``linear`` through cublasLt: ``x @ w + bias`` with the bias added in the GEMM's epilogue.

The cuBLAS path of :mod:`.blas` writes the bias into the result first and lets the GEMM add its
product (``beta = 1``): one more kernel, and the GEMM reads the result once more. cublasLt adds the
bias as the product is stored (``CUBLASLT_EPILOGUE_BIAS``: exact float32, nothing approximated),
and its heuristics pick other kernels than ``cublasGemmStridedBatchedEx`` does -- faster for some
shapes, slower for others (an H200 ran a 3152x768 @ 768x3072 linear in 383 us through cublasLt
against 414 us, but a 3152x3072 @ 3072x768 one in 437 us against 372 us). So the choice is
measured once per shape at prepare time, when a plan is compiled: the first algorithms of
cublasLt's heuristics against the cuBLAS path, on operands of the instance's shape in a pool of
their own (returned to the driver afterwards), the fastest kept. Called through ctypes with the
device's stream and the cuBLAS handle's workspace, so that it allocates nothing and is captured
into CUDA graphs like the rest; float32 only (float32 compute, or TF32 where the contraction's
precision asks for it), contiguous operands 16-byte aligned -- anything else takes the cuBLAS
path.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from polyhal_cuda import blas

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

_R_32F, _COMPUTE_32F = 0, 68
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_EPILOGUE_BIAS = 4
_PREF_MAX_WORKSPACE_BYTES = 1
#: How many of the heuristics' algorithms are timed against the cuBLAS path.
CANDIDATES = 4


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_lib: Any = None
_lock = threading.Lock()


def _library() -> Any:
    """libcublasLt as libcublas loaded it (found in this process's mappings), with prototypes."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        blas._library()  # libcublas links libcublasLt: loading it maps both
        lib = blas.mapped_library("libcublasLt.so")
        vp, i, sz, p = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.POINTER
        protos = {
            "cublasLtCreate": [p(vp)],
            "cublasLtMatmulDescCreate": [p(vp), i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatrixLayoutCreate": [p(vp), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatmulPreferenceCreate": [p(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, p(_Heuristic), p(i)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, p(_Algo), vp, sz, vp],
        }
        for name, args in protos.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        _lib = lib
        return lib


def _handle(device: "Device") -> Any:
    h = getattr(device, "_blaslt", None)
    if h is None:
        h = ctypes.c_void_p()
        blas._check(_library().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
        device._blaslt = h
    return h


def prepare_linear(device: "Device", dtype: Any, m: int, k: int, n: int, tf32: bool,
                   fallback: Callable[..., None], *, trans_b: bool = False,
                   alpha: float = 1.0) -> Callable[..., None] | None:
    """``fn(x, w, bias, out)`` (x (m, k), w (k, n) -- (n, k) read transposed with ``trans_b``, as
    ONNX's Gemm of a linear layer has it --, bias (n,), out (m, n) = alpha * x @ w + bias) through
    cublasLt where it measured faster than ``fallback`` (the cuBLAS path, same signature), else
    None."""
    if np.dtype(dtype) != np.float32 or 0 in (m, k, n):
        return None
    gemm = blas.blas_for(device)
    if gemm is None:
        return None
    try:
        lib, handle = _library(), _handle(device)
        call, algos = _matmul(lib, handle, gemm, device, m, k, n, tf32, trans_b, alpha)
    except Exception:  # noqa: BLE001 - no cublasLt (or no algorithm): the cuBLAS path
        return None
    if not algos:
        return None
    choice = _fastest(device, m, k, n, fallback, call, algos, trans_b)
    if choice is None:
        return None
    algo = algos[choice]

    def linear(x, w, b, out):
        ptrs = (x.data.ptr, w.data.ptr, b.data.ptr, out.data.ptr)
        if not (x.flags.c_contiguous and w.flags.c_contiguous and b.flags.c_contiguous) or any(q % 16 for q in ptrs):
            fallback(x, w, b, out)  # a view, or an address the algorithm was not chosen for
            return
        call(algo, *ptrs)
    linear.kernel_name = "cublasLtMatmul (bias epilogue)"  # type: ignore[attr-defined]
    return linear


def _matmul(lib, handle, gemm, device, m, k, n, tf32, trans_b=False, alpha=1.0):
    """The descriptors of one instance and ``(call, algorithms)``: ``call(algo, x, w, bias, out)``
    on device addresses; row-major out = x @ w is column-major out^T = w^T x^T (w is cuBLAS's A,
    transposed once more where w is (n, k))."""
    vp, chk = ctypes.c_void_p, blas._check
    desc = vp()
    chk(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), blas.COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F,
                                     _R_32F), "cublasLtMatmulDescCreate")
    op_n, op_a = ctypes.c_int32(blas.OP_N), ctypes.c_int32(blas.OP_T if trans_b else blas.OP_N)
    epilogue = ctypes.c_uint32(_EPILOGUE_BIAS)
    for attr, value in ((_DESC_TRANSA, op_a), (_DESC_TRANSB, op_n), (_DESC_EPILOGUE, epilogue)):
        chk(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
            "cublasLtMatmulDescSetAttribute")
    layouts = []
    for rows, cols in ((k, n) if trans_b else (n, k), (k, m), (n, m)):  # w^T (or w), x^T, out^T: column-major
        layout = vp()
        chk(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _R_32F, rows, cols, rows),
            "cublasLtMatrixLayoutCreate")
        layouts.append(layout)
    a_desc, b_desc, d_desc = layouts
    bias_ptr = ctypes.c_void_p(gemm._workspace.ptr)  # aligned, as the plan's buffers are
    chk(lib.cublasLtMatmulDescSetAttribute(desc, _DESC_BIAS_POINTER, ctypes.byref(bias_ptr), 8), "bias pointer")
    pref = vp()
    chk(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    ws = ctypes.c_uint64(blas.WORKSPACE)
    chk(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
        "cublasLtMatmulPreferenceSetAttribute")
    results = (_Heuristic * CANDIDATES)()
    count = ctypes.c_int(0)
    chk(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, a_desc, b_desc, d_desc, d_desc, pref, CANDIDATES,
                                           results, ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
    algos = [results[i].algo for i in range(count.value)
             if results[i].state == 0 and results[i].workspace_size <= blas.WORKSPACE]
    consts = np.array([alpha, 0.0], np.float32)  # alpha, beta: host memory, read when the call is made
    alpha, beta = consts.ctypes.data, consts.ctypes.data + 4
    workspace, stream, matmul = gemm._workspace.ptr, device.stream.ptr, lib.cublasLtMatmul
    bias_box = ctypes.c_void_p()

    def call(algo, x_ptr, w_ptr, b_ptr, out_ptr):
        bias_box.value = b_ptr
        status = lib.cublasLtMatmulDescSetAttribute(desc, _DESC_BIAS_POINTER, ctypes.byref(bias_box), 8)
        if status == 0:
            status = matmul(handle, desc, alpha, w_ptr, a_desc, x_ptr, b_desc, beta, out_ptr, d_desc, out_ptr,
                            d_desc, ctypes.byref(algo), workspace, blas.WORKSPACE, stream)
        if status != 0:
            raise blas.CUDAError(f"cublasLtMatmul failed with status {status}", status=status)

    call.keep = (consts, desc, layouts, pref, results)  # type: ignore[attr-defined]
    return call, algos


def _fastest(device, m, k, n, fallback, call, algos, trans_b=False) -> int | None:
    """Index of the fastest algorithm, or None when the cuBLAS path (``fallback``) is faster."""
    import cupy as cp

    pool = cp.cuda.MemoryPool()
    timings: dict[int | None, float] = {}
    best: int | None = None
    with device.activate(), cp.cuda.using_allocator(pool.malloc):
        rng = cp.random.default_rng(0)
        x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((m, k), (n, k) if trans_b else (k, n), (n,)))
        out = cp.empty((m, n), np.float32)
        stream = device.stream
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        ptrs = (x.data.ptr, w.data.ptr, b.data.ptr, out.data.ptr)
        runs = [(None, lambda: fallback(x, w, b, out))] + [
            (i, lambda a=a: call(a, *ptrs)) for i, a in enumerate(algos)]
        for key, run in runs:
            try:
                for rep in range(6):  # one warm-up, five timed
                    if rep == 1:
                        start.record(stream)
                    run()
                stop.record(stream)
                stop.synchronize()
            except Exception:  # noqa: BLE001 - an algorithm that fails is not chosen
                continue
            timings[key] = cp.cuda.get_elapsed_time(start, stop)
        best = min(timings, key=lambda key: timings[key]) if timings else None
        if best is not None:  # the same numbers as the cuBLAS path, or not chosen
            fallback(x, w, b, out)
            want = out.copy()
            call(algos[best], *ptrs)
            if not bool(cp.allclose(out, want, rtol=1e-4, atol=1e-4 * float(cp.abs(want).max()))):
                best = None
        del x, w, b, out
    pool.free_all_blocks()
    return best
