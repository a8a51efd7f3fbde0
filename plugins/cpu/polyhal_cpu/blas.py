"""GEMM calls into the BLAS numpy itself runs on, for what ``np.matmul`` does not offer.

BLAS runs on one thread (:mod:`polyhal_cpu.threads`): a large product is cut into blocks of rows
or columns by :class:`polyhal_cpu.parallel.GemmSplit`, each block one of these calls (ctypes
releases the GIL for the call, as numpy's matmul does), run on polyhal's pool.

**Accumulating GEMM** (:func:`gemm`: ``C = alpha A B + beta C``). ``np.matmul(out=)`` always
overwrites, so a bias or a residual is a second pass over the result -- and OpenBLAS clears C
in a pass of its own before accumulating. A linear layer as "C = bias (a broadcast copy), then
C += A B" skips both: 256 x 128 @ 128 x 512 with its bias took 213 µs as matmul + add and
169 µs this way on a 2-core VM.

**Strided batched GEMM** (:func:`batched_matmul`). ``np.matmul`` of stacked matrices calls BLAS
once per matrix, through numpy's loop, for products as small as an attention head's (256 x 32
@ 32 x 256): on a 2-core VM four heads' scores took 240 µs in numpy against 94 µs in one
``cblas_sgemm_batch_strided`` call (measured with two BLAS threads; BLAS now runs on one, and
:mod:`polyhal_cpu.parallel` cuts a batch of heads into blocks instead). The batched call also takes any operand
strides (a head of a (seq, heads * d) projection is a (seq, d) matrix with a leading dimension
of heads * d) and a transpose flag, so neither the heads nor k's transpose need copying first.

OpenBLAS (0.3.29 and later, which numpy's wheels bundle) exports it; :func:`numpy_openblas`
finds the library numpy loaded (threadpoolctl where it cannot). :func:`batched_matmul` is
``None`` where there is no such library or symbol (numpy on Accelerate or MKL, an older
OpenBLAS), and callers keep to numpy.

Only products of more than :data:`MIN_MACS` multiply-adds per matrix go this way: OpenBLAS
routes smaller ones (m * n * k <= 100**3) to its small-matrix kernels, and in the batched call
that path crashed the process (OpenBLAS 0.3.31, numpy 2.4's wheel: a segmentation fault for
4 x (32 x 8 @ 8 x 32)). Those small products are cheap in numpy's loop anyway.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import numpy as np

_ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
#: Per-matrix multiply-adds at or below which :func:`batched_matmul` declines (see above).
MIN_MACS = 100 ** 3
#: Result elements from which accumulating in :func:`gemm` beats numpy's matmul and a pass after
#: it: the passes saved must outweigh the ctypes call (~5 µs). Measured in a transformer block's
#: plan: a 256 x 512 result 193 -> 173 µs; 256 x 128 results ~5 µs slower.
ACCUMULATE_ELEMENTS = 1 << 16

#: Symbol names tried, in order: OpenBLAS's own, then the renamed ones of scipy-openblas builds.
_NAMES = {
    "config": ("openblas_get_config", "scipy_openblas_get_config64_", "scipy_openblas_get_config",
               "openblas_get_config64_"),
    np.dtype(np.float32): ("cblas_sgemm_batch_strided", "scipy_cblas_sgemm_batch_strided64_",
                           "scipy_cblas_sgemm_batch_strided", "cblas_sgemm_batch_strided64_"),
    np.dtype(np.float64): ("cblas_dgemm_batch_strided", "scipy_cblas_dgemm_batch_strided64_",
                           "scipy_cblas_dgemm_batch_strided", "cblas_dgemm_batch_strided64_"),
    ("gemm", np.dtype(np.float32)): ("cblas_sgemm", "scipy_cblas_sgemm64_", "scipy_cblas_sgemm", "cblas_sgemm64_"),
    ("gemm", np.dtype(np.float64)): ("cblas_dgemm", "scipy_cblas_dgemm64_", "scipy_cblas_dgemm", "cblas_dgemm64_"),
    ("gemv", np.dtype(np.float32)): ("cblas_sgemv", "scipy_cblas_sgemv64_", "scipy_cblas_sgemv", "cblas_sgemv64_"),
}

#: Thread-count setters tried, in order (OpenBLAS's own, then scipy-openblas builds' renamed ones).
_SET_THREADS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                "openblas_set_num_threads64_")

_loaded: dict | None = None
_numpy_libs: list[str] | None = None


def numpy_openblas() -> list[str]:
    """Paths of the OpenBLAS that numpy itself loaded: one its wheel bundles (``numpy.libs`` beside
    the package, ``numpy/.libs``, ``numpy/.dylibs``) that the dynamic loader says is loaded
    (``RTLD_NOLOAD``); empty where there is none (numpy on MKL or Accelerate, a system numpy,
    Windows), and callers ask threadpoolctl. Found once: ~0.1 ms, where threadpoolctl's import
    and scan of every loaded library took ~3 ms of a process's first session."""
    global _numpy_libs
    if _numpy_libs is None:
        found: list[str] = []
        noload = getattr(os, "RTLD_NOLOAD", None)
        package = os.path.dirname(np.__file__)
        for folder in (package + ".libs", os.path.join(package, ".libs"), os.path.join(package, ".dylibs")):
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            for name in names:
                if noload is None or "openblas" not in name.lower():
                    continue
                path = os.path.join(folder, name)
                try:
                    ctypes.CDLL(path, mode=noload | getattr(os, "RTLD_LOCAL", 0))  # fails unless loaded
                except OSError:
                    continue
                found.append(path)
        _numpy_libs = found
    return _numpy_libs


def limit_numpy_threads(threads: int) -> bool:
    """Set numpy's own OpenBLAS (:func:`numpy_openblas`) to ``threads`` threads; False where it
    was not found or has no setter (callers then ask threadpoolctl)."""
    done = False
    for path in numpy_openblas():
        try:
            setter = _symbol(ctypes.CDLL(path), _SET_THREADS)
        except OSError:
            continue
        if setter is not None:
            setter.argtypes, setter.restype = [ctypes.c_int], None
            setter(threads)
            done = True
    return done


def _symbol(lib: ctypes.CDLL, names: tuple[str, ...]):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def _load() -> dict:
    """{dtype: batched GEMM, ("gemm", dtype): GEMM} of numpy's BLAS, for the dtypes it has
    (found once; a thread that asks meanwhile gets a result of its own, the same)."""
    global _loaded
    if _loaded is None:
        _loaded = _find()
    return _loaded


def _find() -> dict:
    found: dict = {}
    # numpy's own first (numpy/ or numpy.libs/ beside it): another OpenBLAS in the process
    # (scipy's) would work too, but with a second pool of threads. threadpoolctl's scan of every
    # loaded library only where numpy's lacks one of the calls.
    _bind(numpy_openblas(), found)
    if all(want in found for want in _WANTED):
        return found
    try:
        from threadpoolctl import ThreadpoolController

        libs = ThreadpoolController().select(internal_api="openblas").lib_controllers
    except Exception:  # noqa: BLE001 -- no threadpoolctl, or it cannot inspect this process
        return found
    home = os.path.dirname(np.__file__)
    libs = sorted(libs, key=lambda c: not str(c.filepath).startswith(home))
    _bind([str(c.filepath) for c in libs], found)
    return found


#: What :func:`_find` binds where the library has it.
_WANTED = (np.dtype(np.float32), np.dtype(np.float64), ("gemm", np.dtype(np.float32)),
           ("gemm", np.dtype(np.float64)), ("gemv", np.dtype(np.float32)))


def _bind(paths: list[str], found: dict) -> None:
    """Bind the calls of the OpenBLAS libraries at ``paths`` into ``found``, the first library's
    where several have one."""
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        config = _symbol(lib, _NAMES["config"])
        if config is None:
            continue
        config.restype = ctypes.c_char_p
        # The integer width of every size argument: a 64-bit-integer build says so in its config.
        index = ctypes.c_int64 if b"USE64BITINT" in (config() or b"") else ctypes.c_int32
        enum, ptr = ctypes.c_int, ctypes.c_void_p
        for dtype, scalar in ((np.dtype(np.float32), ctypes.c_float), (np.dtype(np.float64), ctypes.c_double)):
            fn = _symbol(lib, _NAMES[dtype])
            if fn is not None:
                fn.argtypes = [enum, enum, enum, index, index, index, scalar,
                               ptr, index, index, ptr, index, index, scalar, ptr, index, index, index]
                fn.restype = None
                found.setdefault(dtype, fn)
            fn = _symbol(lib, _NAMES["gemm", dtype])
            if fn is not None:
                fn.argtypes = [enum, enum, enum, index, index, index, scalar, ptr, index, ptr, index, scalar, ptr, index]
                fn.restype = None
                found.setdefault(("gemm", dtype), fn)
        fn = _symbol(lib, _NAMES["gemv", np.dtype(np.float32)])
        if fn is not None:  # called from compiled code only (gemm_address), through its address
            fn.argtypes = [enum, enum, index, index, ctypes.c_float, ptr, index, ptr, index, ctypes.c_float, ptr, index]
            fn.restype = None
            found.setdefault(("gemv", np.dtype(np.float32)), fn)


def _layout(x: np.ndarray) -> tuple[int, int, int] | None:
    """(transpose flag, leading dimension, batch stride) in elements for a (batch, rows, cols)
    view that BLAS can read in place, or None (a copy is needed)."""
    item = x.itemsize
    batch, rows, cols = x.shape
    s0, s1, s2 = x.strides
    if s0 % item or s1 % item or s2 % item or min(s0, s1, s2) < 0:
        return None
    s0, s1, s2 = s0 // item, s1 // item, s2 // item
    stride = s0 if batch > 1 else 0
    if (s2 == 1 or cols == 1) and (s1 >= cols or rows == 1):
        return NO_TRANS, max(s1 if rows > 1 else cols, cols, 1), stride
    if (s1 == 1 or rows == 1) and (s2 >= rows or cols == 1):
        return TRANS, max(s2 if cols > 1 else rows, rows, 1), stride
    return None


def batched_matmul(dtype: np.dtype) -> Callable[..., bool] | None:
    """``matmul(a, b, out, alpha=1.0) -> bool``: ``out[i] = alpha * a[i] @ b[i]`` for stacked
    (batch, m, k) ``a``, (batch, k, n) ``b`` and (batch, m, n) ``out`` views of any strides with
    one unit stride per matrix, in one BLAS call; False (nothing done) when an operand's
    strides are not of that kind or the matrices have :data:`MIN_MACS` multiply-adds or fewer.
    None when numpy's BLAS has no batched GEMM for ``dtype``."""
    fn = _load().get(np.dtype(dtype))
    if fn is None:
        return None

    def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, alpha: float = 1.0) -> bool:
        batch, m, k = a.shape
        n = b.shape[2]
        if m * n * k <= MIN_MACS:
            return False
        la, lb, lc = _layout(a), _layout(b), _layout(out)
        if la is None or lb is None or lc is None or lc[0] != NO_TRANS:
            return False
        fn(_ROW_MAJOR, la[0], lb[0], m, n, k, alpha, a.ctypes.data, la[1], la[2],
           b.ctypes.data, lb[1], lb[2], 0.0, out.ctypes.data, lc[1], lc[2], batch)
        return True
    return matmul


def layout2(x: np.ndarray) -> tuple[int, int] | None:
    """(transpose flag, leading dimension) of a 2-D view BLAS can read in place, or None."""
    if x.flags.c_contiguous:  # the common case, without the stride arithmetic
        return NO_TRANS, max(x.shape[1], 1)
    layout = _layout(x[None])
    return None if layout is None else layout[:2]


def gemm(dtype: np.dtype, size: int | None = None) -> Callable[..., bool] | None:
    """``gemm(a, b, out, alpha=1.0, beta=0.0) -> bool``: ``out = alpha * a @ b + beta * out``
    for 2-D views of any strides with one unit stride each (``out`` row-major), in one BLAS
    call; False (nothing done) for other strides. None when numpy's BLAS is not one this module
    can call (see the module doc), or when the result's ``size`` (elements, if given) is below
    :data:`ACCUMULATE_ELEMENTS`."""
    fn = _load().get(("gemm", np.dtype(dtype)))
    if fn is None or (size is not None and size < ACCUMULATE_ELEMENTS):
        return None

    def call(a: np.ndarray, b: np.ndarray, out: np.ndarray, alpha: float = 1.0, beta: float = 0.0) -> bool:
        la, lb, lc = layout2(a), layout2(b), layout2(out)
        if la is None or lb is None or lc is None or lc[0] != NO_TRANS:
            return False
        (m, k), n = a.shape, b.shape[1]
        if m and n:
            fn(_ROW_MAJOR, la[0], lb[0], m, n, k, alpha, a.ctypes.data, la[1], b.ctypes.data, lb[1],
               beta, out.ctypes.data, lc[1])
        return True
    return call


def gemm_address() -> tuple[int, int, int] | None:
    """(address of cblas_sgemm, 1 if its integers are 64 bits wide else 0, address of
    cblas_sgemv or 0) of numpy's BLAS, for compiled code that calls them itself; None where
    this module finds no sgemm."""
    found = _load()
    fn, gemv = found.get(("gemm", np.dtype(np.float32))), found.get(("gemv", np.dtype(np.float32)))
    if fn is None:
        return None
    wide = fn.argtypes[3] is ctypes.c_int64
    if gemv is not None and (gemv.argtypes[2] is ctypes.c_int64) != wide:
        gemv = None
    address = ctypes.cast(fn, ctypes.c_void_p).value
    return address, int(wide), 0 if gemv is None else ctypes.cast(gemv, ctypes.c_void_p).value


def blas_layout(a: np.ndarray) -> np.ndarray:
    """``a``, or a row-major copy of it when its last two dims have no unit stride (a strided
    view, e.g. a transpose the plan did not copy): numpy's matmul hands BLAS any matrix with a
    unit stride along either dim (as is, or with BLAS's transpose flag), and falls back to its
    own loops, many times slower, for the rest."""
    if a.ndim < 2 or a.flags.c_contiguous:
        return a
    item = a.itemsize
    (m, n), (s0, s1) = a.shape[-2:], a.strides[-2:]
    if (s1 == item and s0 % item == 0 and s0 >= n * item) or (s0 == item and s1 % item == 0 and s1 >= m * item) \
            or m == 1 or n == 1:
        return a
    return np.ascontiguousarray(a)
