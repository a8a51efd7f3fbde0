"""The CPU backend's kernels: a numpy implementation of every op of :mod:`polyhal.ops`.

:func:`prepare` does everything that depends only on the op, its attributes and the operand
types -- parsing attributes, normalising axes, choosing a code path, building constants -- and
returns a small closure, the hot path of a compiled plan. The closure is called as
``fn(*inputs, *outputs)`` and writes its results into ``outputs``:

* inputs are numpy arrays of the prepared shapes and dtypes (any strides);
* outputs are preallocated with the exact shape and dtype and are C-contiguous (possibly
  aligned views into a larger allocation); they must not alias the inputs, because multi-pass
  kernels (softmax, gelu, ...) read inputs after they started writing outputs;
* the return value is meaningless;
* closures keep no state between calls, so one prepared kernel may run on several threads at
  once -- except kernels that declared scratch (:mod:`polyhal_cpu.scratch`: attention, NMS),
  which work in the one buffer they were given; a plan serialises its runs.

The closures call ufuncs with ``out=`` and reduce into the outputs, so numpy creates no
full-size temporaries where it can avoid them; matmul goes through ``np.matmul(out=)`` and so
runs at BLAS speed, and through numpy's BLAS directly (:mod:`polyhal_cpu.blas`) where numpy
has no call for the job (batched strided GEMM, accumulating onto a bias). float32 kernels that
numpy would run as many passes (layer norm, GELU, softmax, relu) use fused loops compiled by
numba (:mod:`polyhal_cpu.native`), numpy's passes remaining the path for other dtypes and
machines without numba. Kernels are independent of the ops' reference functions, which are the
oracle they are tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import cache, partial
from typing import Any

import numpy as np

from polyhal.hal.scratch import MemorySpace, ScratchDecl
from polyhal.ir.types import TensorType
from polyhal.ops import normalize_axes, normalize_slice
from polyhal.ops.elementwise import cast_source, check_strict_cast
from polyhal.ops.quantized import dynamic_quantize_parameters
from polyhal_cpu import blas, encoding, native  # noqa: F401 (encoding: pack)
from polyhal_cpu import queue_layout as layout
from polyhal_cpu.blas import blas_layout
from polyhal_cpu.ops import BLOCKED_CONV, SCALE_SHIFT_CONV
from polyhal_cpu.parallel import GemmSplit, blocks, float_bits, gemm_fn, parallel, run_gemms, threads
from polyhal_cpu.parallel import run as run_pieces
from polyhal_cpu.scratch import array as scratch_array
from polyhal_cpu.table import TABLE, Kernel, Types, binary_ufuncs, compiled_loops, float16_via_float32

__all__ = ["KERNEL_NAMES", "TABLE", "erf", "prepare"]

_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


def prepare(op: str, attrs: Mapping[str, Any], in_types: Types, out_types: Types, scratch=None) -> Kernel:
    """``fn(*inputs, *outputs)`` computing ``op`` into ``outputs`` (see the module doc): the
    table's ``prepare`` without a device, which CPU kernels do not need (tests, benchmarks).

    ``in_types``/``out_types`` are trusted (prepare does not re-validate them). ``scratch`` is a
    plan's binding of the scratch the op's kernel declared; without it such a kernel gets its
    own, allocated here. Raises KernelNotFoundError for an op, or a tensor encoding, that this
    backend does not implement.
    """
    return TABLE.prepare(None, op, attrs, in_types, out_types, scratch)


#: Elements per piece for multi-pass elementwise kernels with float64 scratch (erf: input,
#: output and three float64 temporaries, ~1 MiB a piece).
_CHUNK = 32768
#: Elements per piece (float32; half as many float64) for those that work in place on their
#: output (~1 MiB of input and output a piece: smaller pieces only add calls).
_CHUNK_IN_PLACE = 131072


def _chunked(kernel: Callable[[np.ndarray, np.ndarray], None], size: int = _CHUNK
             ) -> Callable[[np.ndarray, np.ndarray], None]:
    """Run a unary elementwise ``kernel(x, out)`` over cache-sized pieces (``size`` elements)
    of large arrays.

    erf and gelu make ~30 passes over their data; on pieces that fit in L2 the later passes hit
    cache instead of memory, which makes them 2-3x faster on large tensors.
    """
    def run(x: np.ndarray, out: np.ndarray) -> None:
        if out.size <= size or not out.flags.c_contiguous:
            kernel(x, out)
            return
        flat_x, flat_out = x.reshape(-1), out.reshape(-1)  # a view of out: it is contiguous
        for start in range(0, flat_out.size, size):
            kernel(flat_x[start:start + size], flat_out[start:start + size])
    return run


def _const(value: float, dtype: np.dtype) -> np.ndarray:
    # A 0-d array of the operand type: no promotion, and cheaper per call than a Python float.
    return np.asarray(value, dtype=dtype)


# ----------------------------------------------------------------------------------------- erf
#
# numpy has no erf and scipy is not a dependency, so:
#  * float16/float32: the clamped rational approximation erf(x) ~= x * P(x^2) / Q(x^2) on
#    [-4, 4] that XLA and Eigen use for single precision (erf(+-4) rounds to +-1 in float32).
#    Its own error is 7e-8; evaluated in float32 the rounding of the two Horner chains adds up
#    to ~4e-7 (7 ulps of 1), and gelu(x) = x/2 * (1 + erf(x/sqrt 2)) multiplies that by |x|/2
#    where the result is tiny. So it is evaluated in float64: max abs error 1e-7 (under 2
#    float32 ulps), at ~2.5x the cost of float32 evaluation.
#  * float64: |x| < 1: the Maclaurin series x * sum_n c_n x^(2n) with exact coefficients, 20
#    terms (the first omitted one is < 1e-19); |x| >= 1: erf = 1 - exp(-x^2) * erfcx(x), where
#    erfcx(x) = exp(x^2) erfc(x) (smooth, no cancellation) is a degree-28 Chebyshev interpolant
#    on [1, 6] computed from math.erfc at the first float64 erf (not at import: it costs ~25 ms
#    of the plugin's import, fractions and numpy.polynomial included); beyond 6, erf is 1 in
#    float64. Max abs error ~1e-15.

_ERF_P, _ERF_Q = native.ERF_P, native.ERF_Q  # shared with the fused erf-GELU loop

_ERF_SERIES = tuple(  # highest power first, for Horner
    2.0 / math.sqrt(math.pi) * (-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in reversed(range(20))
)
_ERFCX_LO, _ERFCX_HI, _ERFCX_DEGREE = 1.0, 6.0, 28


@cache
def _erfcx_monomials() -> tuple[float, ...]:
    """Monomial coefficients (highest first) in u = (x - 3.5) / 2.5 of the Chebyshev
    interpolant of erfcx on [1, 6].

    Coefficients come from a 64-point discrete cosine sum (exact discrete orthogonality, cos
    computed directly) rather than numpy's chebinterpolate, whose interpolant reproduced its
    own node values only to ~3e-14 at this degree. exp(x^2) at a node uses the exact square
    of x (a double's square needs two doubles), since exp amplifies the rounding of x*x by
    x^2. The monomial form is safe here: its coefficients stay below 0.2 in magnitude.
    """
    from fractions import Fraction

    from numpy.polynomial import chebyshev

    n = 64
    theta = np.pi * (np.arange(n) + 0.5) / n
    mid, half = (_ERFCX_HI + _ERFCX_LO) / 2, (_ERFCX_HI - _ERFCX_LO) / 2
    values = []
    for x in (mid + half * np.cos(theta)).tolist():
        square = Fraction(x) ** 2
        hi = float(square)
        values.append(math.erfc(x) * math.exp(hi) * (1.0 + float(square - Fraction(hi))))
    values = np.array(values)
    coeffs = np.array([2.0 / n * math.fsum(values * np.cos(k * theta)) for k in range(_ERFCX_DEGREE + 1)])
    coeffs[0] /= 2
    return tuple(chebyshev.cheb2poly(coeffs)[::-1].tolist())



def _horner(z: np.ndarray, coeffs: tuple, acc: np.ndarray) -> np.ndarray:
    """acc = polynomial(z), coefficients highest power first; no temporaries."""
    np.multiply(z, coeffs[0], out=acc)
    np.add(acc, coeffs[1], out=acc)
    for c in coeffs[2:]:
        np.multiply(acc, z, out=acc)
        np.add(acc, c, out=acc)
    return acc


def _erf_single(x: np.ndarray, out: np.ndarray) -> None:
    """erf for float16/float32 ``x`` (see above); ``out`` may be ``x``."""
    # Explicit out= throughout: without it numpy returns scalars, not arrays, for 0-d operands.
    t = x.astype(_F64)
    np.clip(t, -4.0, 4.0, out=t)  # nan stays nan; +-inf -> +-4 -> +-1
    z = np.square(t, out=np.empty_like(t))
    num = _horner(z, _ERF_P, np.empty_like(z))
    np.multiply(num, t, out=num)
    np.divide(num, _horner(z, _ERF_Q, t), out=out, casting="same_kind")  # t is free: Q goes there


def _erf_double(x: np.ndarray, out: np.ndarray) -> None:
    """erf for float64 ``x`` (see above); ``out`` may be ``x``."""
    small = np.abs(x) < 1.0  # nan lands in the large branch, where it propagates
    large = ~small
    xs, xl = x[small], x[large]  # copies, taken before out (possibly x) is written
    out[small] = xs * _horner(xs * xs, _ERF_SERIES, np.empty_like(xs))
    if xl.size:
        a = np.minimum(np.abs(xl), _ERFCX_HI)
        u = a - (_ERFCX_HI + _ERFCX_LO) / 2
        u *= 2.0 / (_ERFCX_HI - _ERFCX_LO)
        erfc = _horner(u, _erfcx_monomials(), np.empty_like(u))
        erfc *= np.exp(-a * a)
        out[large] = np.copysign(1.0 - erfc, xl)


def erf(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Vectorised error function of a float array (the kernel of op ``erf``), into ``out``.

    ``out`` may be ``x`` itself. Max abs error: 1e-7 for float16/float32, ~1e-15 for float64.
    nan gives nan, +-inf gives +-1, -0.0 gives -0.0.
    """
    x = np.asarray(x)
    if out is None:
        out = np.empty(x.shape, x.dtype)
    (_erf_double_chunked if x.dtype == _F64 else _erf_single_chunked)(x, out)
    return out


_erf_single_chunked, _erf_double_chunked = _chunked(_erf_single), _chunked(_erf_double)


# ---------------------------------------------------------------------------------- elementwise

_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "maximum": np.maximum, "minimum": np.minimum,
    "equal": np.equal, "not_equal": np.not_equal, "less": np.less, "less_equal": np.less_equal,
    "greater": np.greater, "greater_equal": np.greater_equal,
}
_UNARY = {"neg": np.negative, "abs": np.absolute, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
          "tanh": np.tanh}


TABLE.register(*_BINARY)(binary_ufuncs(_BINARY))


@TABLE.register(*_UNARY)
def _unary(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    ufunc = _UNARY[op]

    def kernel(x, out):
        ufunc(x, out=out)
    return kernel


@TABLE.register("relu")
def _relu(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    if native.available(ins[0].dtype):  # ~2x numpy's maximum (polyhal_cpu.native)
        fused, contiguous = native.relu, np.ascontiguousarray

        def fused_kernel(x, out):
            fused(contiguous(x).reshape(-1), out.reshape(-1))
        return fused_kernel
    zero, maximum = _const(0, ins[0].dtype), np.maximum

    def kernel(x, out):
        maximum(x, zero, out=out)
    return kernel


@TABLE.register("sigmoid")
@parallel(factor=4)  # ~0.5 ns an element: only large ones are worth a thread
@float16_via_float32
def _sigmoid(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    dtype = ins[0].dtype
    # exp(-x) is capped below overflow (no warning): sigmoid there is < 1e-38 (float32) or
    # < 1e-307 (float64) and 1 / (1 + cap) gives it to within that.
    cap, one = _const(88.0 if dtype == _F32 else 709.0, dtype), _const(1.0, dtype)

    def kernel(x, out):
        np.negative(x, out=out)
        np.minimum(out, cap, out=out)
        np.exp(out, out=out)
        np.add(out, one, out=out)
        np.reciprocal(out, out=out)
    return _chunked(kernel, _CHUNK_IN_PLACE * 4 // dtype.itemsize)


@TABLE.register("erf")
@parallel()
def _erf(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    return _erf_double_chunked if ins[0].dtype == _F64 else _erf_single_chunked


@TABLE.register("gelu")
@parallel(factor=lambda attrs, ins: 4 if attrs["approximate"] == "tanh" else 1)  # tanh: ~1.3 ns an element, erf ~5
@float16_via_float32
def _gelu(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    dtype = ins[0].dtype
    erf_ = _erf_double if dtype == _F64 else _erf_single
    half = _const(0.5, dtype)
    if native.available(dtype):  # one fused pass (polyhal_cpu.native)
        fused, contiguous = native.gelu_tanh if attrs["approximate"] == "tanh" else native.gelu_erf, np.ascontiguousarray

        def fused_kernel(x, out):
            fused(contiguous(x).reshape(-1), out.reshape(-1))
        return fused_kernel
    if attrs["approximate"] == "tanh":
        # x/2 * (1 + tanh(u)) with u = c (x + 0.044715 x^3) is x * sigmoid(2u) = x / (1 + 2^(-2u
        # log2 e)): seven passes instead of eight, exp2 instead of the dearer tanh, and no
        # cancellation in 1 + tanh(u) for negative x. For x far below 0 the power overflows to
        # inf and x / inf is the limit, -0 (the overflow is expected: not warned about).
        k = -2.0 * math.sqrt(2.0 / math.pi) * math.log2(math.e)
        k1, k3, one = _const(k, dtype), _const(k * 0.044715, dtype), _const(1.0, dtype)
        errstate = np.errstate  # one per call: an errstate cannot be entered twice (threads)

        def kernel(x, out):
            with errstate(over="ignore", invalid="ignore"):  # invalid: -inf / inf is nan, as -inf * 0 is
                np.square(x, out=out)  # a unary loop: twice as fast as multiply(x, x)
                np.multiply(out, k3, out=out)
                np.add(out, k1, out=out)
                np.multiply(out, x, out=out)
                np.exp2(out, out=out)
                np.add(out, one, out=out)
                np.divide(x, out, out=out)
        return _chunked(kernel, _CHUNK_IN_PLACE * 4 // dtype.itemsize)

    inv_sqrt2 = _const(1.0 / math.sqrt(2.0), dtype)

    def kernel(x, out):  # x/2 * (1 + erf(x / sqrt(2)))
        np.multiply(x, inv_sqrt2, out=out)
        erf_(out, out)
        np.multiply(out, half, out=out)
        np.add(out, half, out=out)
        np.multiply(out, x, out=out)
    return _chunked(kernel)


#: Elements a piece of the bitwise select (its mask and masked operand live in declared scratch).
_SELECT_PIECE = 1 << 14
_SELECT_BITS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _bitwise_select(ins: Types, outs: Types) -> bool:
    """``where`` as bit operations: operands of one shape (no broadcast), and large enough that
    a piecewise loop pays (numpy's masked copy, the general path, costs ~7 ns an element)."""
    cond, x, y = ins
    return (cond.shape == x.shape == y.shape == outs[0].shape and cond.dtype == np.bool_
            and x.dtype == y.dtype == outs[0].dtype and x.dtype.itemsize in _SELECT_BITS and outs[0].size >= 4096)


def _select_bytes(problem, _workgroup_size: int) -> int:
    out = problem.out_types[0]
    return 2 * min(out.size, _SELECT_PIECE) * out.dtype.itemsize if _bitwise_select(problem.in_types,
                                                                                     problem.out_types) else 0


@TABLE.register("where", scratch=[
    ScratchDecl("select", shared=True, per_launch=_select_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="a piece's select mask and masked operand (where as bit operations)")])
def _where(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    copyto = np.copyto
    if not _bitwise_select(ins, outs):
        def kernel(cond, x, y, out):
            copyto(out, y)
            copyto(out, x, where=cond)
        return kernel

    bits, n = _SELECT_BITS[outs[0].dtype.itemsize], outs[0].size
    piece = min(n, _SELECT_PIECE)
    work = scratch_array(scratch, "select", bits, (2, piece))
    negative, invert, both, either = np.negative, np.invert, np.bitwise_and, np.bitwise_or

    def select(cond, x, y, out):
        # out = x & m | y & ~m with m = -cond (all ones where cond): five passes over a piece in
        # cache. y's part is taken before out is written, so out may be x's or y's buffer.
        c, xb, yb, ob = (a.reshape(-1).view(t) for a, t in ((cond, np.int8), (x, bits), (y, bits), (out, bits)))
        for start in range(0, n, piece):
            stop = min(n, start + piece)
            m, rest = work[0, :stop - start], work[1, :stop - start]
            negative(c[start:stop], out=m, casting="unsafe")
            invert(m, out=rest)
            both(yb[start:stop], rest, out=rest)
            both(xb[start:stop], m, out=ob[start:stop])
            either(ob[start:stop], rest, out=ob[start:stop])
    return select


def _quantize_bytes(problem, _workgroup_size: int) -> int:
    return 4 * max(1, min(problem.in_types[0].size, _SELECT_PIECE))


@TABLE.register("dynamic_quantize", scratch=[
    ScratchDecl("quantized", shared=True, per_launch=_quantize_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="a piece of x / scale before its rounding and saturation")])
def _dynamic_quantize(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """ONNX's DynamicQuantizeLinear in one dispatch: the two reductions, then the quantization
    over cache-sized pieces (divide, round half to even, add the zero point, saturate, narrow),
    the float32 arithmetic of the op's definition (:mod:`polyhal.ops.quantized`)."""
    n = ins[0].size
    piece = max(1, min(n, _SELECT_PIECE))
    work = scratch_array(scratch, "quantized", np.float32, (piece,))
    zero, top = np.float32(0), np.float32(255)
    parameters = dynamic_quantize_parameters
    divide, rint, add, minimum, maximum, copyto = np.divide, np.rint, np.add, np.minimum, np.maximum, np.copyto
    least, greatest = np.minimum.reduce, np.maximum.reduce  # ndarray.min / max wrap these (~0.3 us each)

    def kernel(x, y, scale, zero_point):
        flat, out = x.reshape(-1), y.reshape(-1)
        s, zp = parameters(least(flat), greatest(flat)) if n else (zero, zero)
        scale[...], zero_point[...] = s, zp
        if not s > 0:  # zeros (or nan): every element is the zero point, 0
            out[...] = 0
            return
        if n <= piece:  # one piece, no slices: 10.0 -> 9.1 us for 64 x 64 (the dynamic MLP's)
            divide(flat, s, out=work)
            rint(work, out=work)
            add(work, zp, out=work)
            minimum(work, top, out=work)
            maximum(work, zero, out=work)
            copyto(out, work, casting="unsafe")
            return
        for start in range(0, n, piece):
            stop = min(n, start + piece)
            w = work[:stop - start]
            divide(flat[start:stop], s, out=w)
            rint(w, out=w)
            add(w, zp, out=w)
            minimum(w, top, out=w)  # np.clip costs ~3 us more a call
            maximum(w, zero, out=w)
            copyto(out[start:stop], w, casting="unsafe")
    return kernel


@TABLE.register("cast")
def _cast(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    copyto = np.copyto
    if attrs.get("strict"):
        target = outs[0].dtype

        def strict_kernel(x, out):
            check_strict_cast(x, target)
            copyto(out, x, casting="unsafe")
        return strict_kernel

    if not np.can_cast(ins[0].dtype, outs[0].dtype, casting="unsafe"):
        def via_float32(x, out):
            copyto(out, cast_source(x, out.dtype), casting="unsafe")
        return via_float32

    def kernel(x, out):
        copyto(out, x, casting="unsafe")
    return kernel


# --------------------------------------------------------------------------------------- linalg

def _matmul_scratch(device, op: str, attrs: dict, ins: Types, outs: Types):
    """The oneDNN matmul's scratch where it serves the instance (the CPU's own GEMMs have none)."""
    # Imported on first use, as onednn_normalization: a program without matmuls, softmaxes or layer
    # norms imports neither (~2 ms of a process's first session).
    from polyhal_cpu import onednn_kernels
    return onednn_kernels.matmul_scratch(op, attrs, ins, outs) or ()


@TABLE.register("matmul", "gemm", scratch=_matmul_scratch)
def _matmul_family(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """A oneDNN matmul primitive where the library serves the instance, else the CPU's own GEMMs."""
    own = _matmul if op == "matmul" else _gemm
    from polyhal_cpu import onednn_kernels
    return onednn_kernels.matmul(op, attrs, ins, outs, scratch) or own(device, op, attrs, ins, outs, scratch)


@float16_via_float32
def _matmul(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    matmul = np.matmul
    a_type, b_type = ins
    if a_type.rank > 2 and b_type.rank == 2:
        # (batch..., M, K) @ (K, N) is one (batch*M, K) @ (K, N) GEMM: numpy would call BLAS
        # once per batch element instead (many small GEMMs, each with its own overhead).
        rows = math.prod(a_type.shape[:-1])
        a2, o2 = (rows, a_type.shape[-1]), (rows, b_type.shape[-1])
        split = GemmSplit(rows, b_type.shape[-1], a_type.shape[-1], queued=a_type.dtype == np.float32)

        def collapsed(a, b, out):
            b = blas_layout(b)
            if a.flags.c_contiguous:  # views: out is C-contiguous
                a, out = a.reshape(a2), out.reshape(o2)
                table = None if split.small else split.table(a, b, out)
                if table is not None:
                    run_gemms(table)
                else:
                    run_pieces(split.tasks(a, b, out))
            else:
                matmul(blas_layout(a), b, out=out)
        return collapsed
    if a_type.rank == 2 and b_type.rank == 2:
        split = GemmSplit(a_type.shape[0], b_type.shape[1], a_type.shape[1], queued=a_type.dtype == np.float32)

        def plain(a, b, out):
            a, b = blas_layout(a), blas_layout(b)
            table = None if split.small else split.table(a, b, out)
            if table is not None:
                run_gemms(table)
            else:
                run_pieces(split.tasks(a, b, out))
        return plain

    def kernel(a, b, out):
        matmul(blas_layout(a), blas_layout(b), out=out)
    return kernel


@float16_via_float32
def _gemm(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    dtype = ins[0].dtype
    trans_a, trans_b = bool(attrs["trans_a"]), bool(attrs["trans_b"])
    alpha, beta = float(attrs["alpha"]), float(attrs["beta"])
    alpha_c, beta_c = _const(alpha, dtype), _const(beta, dtype)
    has_c = len(ins) == 3
    blas_gemm = blas.gemm(dtype, outs[0].size)  # None: numpy's matmul, then alpha and C
    (m, n), k = outs[0].shape, ins[0].shape[0 if trans_a else 1]
    split = GemmSplit(m, n, k, queued=dtype == np.float32)

    def product(a, b, c, out):
        # BLAS's own GEMM does alpha A B + beta C in one call, onto C broadcast into out.
        if blas_gemm is not None:
            if c is not None:
                np.copyto(out, c)
            if blas_gemm(a, b, out, alpha, beta if c is not None else 0.0):
                return
        np.matmul(blas_layout(a), blas_layout(b), out=out)
        if alpha != 1.0:
            np.multiply(out, alpha_c, out=out)
        if c is not None:
            # beta * C is a temporary of C's size (usually a bias row), not of the result's.
            np.add(out, c if beta == 1.0 else np.multiply(c, beta_c), out=out)

    def kernel(a, b, *rest):
        out = rest[-1]
        a, b = (a.T if trans_a else a), (b.T if trans_b else b)
        if split.small:  # numpy's product (C broadcasts as it is added): cheaper than the queue here
            product(a, b, rest[0] if has_c else None, out)
            return
        table = split.table(a, b, out, alpha, beta, rest[0] if has_c else None)
        if table is not None:  # C, then the product onto it, piece by piece in compiled code
            run_gemms(table)
            return
        c = np.broadcast_to(rest[0], out.shape) if has_c else None
        if split.axis == 0:  # blocks of rows (C's cut alike), or of columns
            run_pieces([partial(product, a[lo:hi], b, None if c is None else c[lo:hi], out[lo:hi])
                          for lo, hi in split.bounds])
        else:
            run_pieces([partial(product, a, b[:, lo:hi], None if c is None else c[:, lo:hi], out[:, lo:hi])
                          for lo, hi in split.bounds])
    return kernel


# ----------------------------------------------------------------------------------- reductions

_REDUCE = {"reduce_sum": np.add.reduce, "reduce_max": np.maximum.reduce,
           "reduce_min": np.minimum.reduce}


#: A float sum over the last axis of at most this many elements, of at least _SHORT_SUM_ROWS rows,
#: is a BLAS matrix-vector product with ones: numpy's reduce runs one short inner loop per row
#: (an RBF SVM's squared distances, [N, V, features]: ~10 ns a row, BLAS ~1).
_SHORT_SUM, _SHORT_SUM_ROWS = 16, 1024


@TABLE.register("reduce_max", "reduce_min")
def _reduce(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    reduce, axes, keepdims = _REDUCE[op], normalize_axes(attrs["axes"], ins[0].rank), bool(attrs["keepdims"])
    x_type = ins[0]
    if op == "reduce_sum" and x_type.dtype in (_F32, _F64) and tuple(axes) == (x_type.rank - 1,) \
            and 1 < x_type.shape[-1] <= _SHORT_SUM and x_type.size // x_type.shape[-1] >= _SHORT_SUM_ROWS:
        length = x_type.shape[-1]
        rows, ones = x_type.size // length, np.ones(length, x_type.dtype)

        def short_rows(x, out):
            if x.flags.c_contiguous and out.flags.c_contiguous:
                np.dot(x.reshape(rows, length), ones, out=out.reshape(rows))
            else:
                reduce(x, axis=axes, out=out, keepdims=keepdims)
        return short_rows

    def kernel(x, out):
        reduce(x, axis=axes, out=out, keepdims=keepdims)
    return kernel


# Sums go through float32 for float16: numpy would accumulate float16 sums in float16.
TABLE.register("reduce_sum")(float16_via_float32(_reduce))


@TABLE.register("reduce_mean")
@float16_via_float32
def _reduce_mean(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    x_type = ins[0]
    axes, keepdims = normalize_axes(attrs["axes"], x_type.rank), bool(attrs["keepdims"])
    count = _const(math.prod(x_type.shape[a] for a in axes), x_type.dtype)
    reduce = np.add.reduce
    if (x_type.rank == 5 and x_type.shape[1] == 1 and axes == (2, 3) and keepdims and x_type.dtype == np.float32
            and x_type.shape[2] * x_type.shape[3] > 0):
        # A global average pool of channel-blocked storage (N, 1, H, W, C): one matrix-vector
        # product per image, (H * W) @ (H * W, C). numpy's reduce adds the H * W rows of C
        # one at a time (EfficientNet's 112x112x32 map: 380 -> 23 us).
        n, _, h, w, c = x_type.shape
        weights = np.full(h * w, 1 / (h * w), x_type.dtype)

        def global_pool(x, out):
            np.matmul(weights, x.reshape(n, h * w, c), out=out.reshape(n, c))
        return global_pool

    def kernel(x, out):
        reduce(x, axis=axes, out=out, keepdims=keepdims)
        np.divide(out, count, out=out)
    return kernel


@TABLE.register("argmax")
def _argmax(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    axis, keepdims = int(attrs["axis"]) % ins[0].rank, bool(attrs["keepdims"])

    def kernel(x, out):
        np.asarray(x).argmax(axis, out, keepdims=keepdims)  # the method: np.argmax's wrapper costs ~1 us
    return kernel


#: Softmax shifts each block of rows by the block's maximum, over this many elements at least
#: (see _softmax); a row whose shifted exponentials sum below _SOFTMAX_MIN_SUM is done again
#: with its own maximum.
_SOFTMAX_BLOCK = 8192
_SOFTMAX_MIN_SUM = 2.0 ** -10
#: Rows up to this length are summed by BLAS (a matrix-vector product with ones); longer ones
#: by numpy's pairwise summation, which is then as fast and more accurate.
_BLAS_ROW_SUM = 4096


def _rowwise_scratch(device, op: str, attrs: dict, ins: Types, outs: Types):
    """A oneDNN layer norm's or softmax's scratchpad where the library serves the instance."""
    from polyhal_cpu import onednn_normalization
    return onednn_normalization.scratch(op, attrs, ins, outs) or ()


def _softmax_factor(attrs: dict, ins: Types) -> float:
    """Softmaxes cut into blocks of rows on the pool, unless a oneDNN primitive (threaded by
    OpenMP) runs the whole."""
    from polyhal_cpu import onednn_normalization
    return math.inf if onednn_normalization.plan("softmax", attrs, ins, ins[:1]) is not None else 2


@TABLE.register("softmax", scratch=_rowwise_scratch)
@parallel(lambda attrs, ins: (int(attrs["axis"]),), factor=_softmax_factor)  # rows on several cores
@float16_via_float32
def _softmax(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    from polyhal_cpu import onednn_normalization
    primitive = onednn_normalization.softmax(attrs, ins, outs, scratch)
    if primitive is not None:
        return primitive
    x_type = ins[0]
    axis = int(attrs["axis"]) % x_type.rank
    if axis != x_type.rank - 1:
        def kernel(x, out):
            # Temporaries are the reduced (keepdims) shape only.
            np.subtract(x, np.maximum.reduce(x, axis=axis, keepdims=True), out=out)
            np.exp(out, out=out)
            np.divide(out, np.add.reduce(out, axis=axis, keepdims=True), out=out)
        return kernel

    rows, cols = math.prod(x_type.shape[:-1]), x_type.shape[-1]
    if native.available(x_type.dtype):  # max, exp and normalisation fused per row (polyhal_cpu.native)
        fused, contiguous = native.softmax_rows, np.ascontiguousarray

        def fused_kernel(x, out):
            fused(contiguous(x).reshape(rows, cols), out.reshape(rows, cols))
        return fused_kernel

    # Without the fused loop, softmax over the last axis on (rows, cols) views. exp(x - c) /
    # sum(exp(x - c)) is the same for any shift c; the row's maximum is the usual one (no overflow, the largest term
    # is 1), but numpy reduces short rows one inner loop per row, at several times the cost of
    # a long loop. So the shift is the maximum of a block of rows (long loops for the max and
    # for the subtraction): a row whose own maximum is d below its block's has every term
    # scaled by exp(-d), which costs nothing in accuracy while d is small (the sum is then at
    # least exp(-d)); rows whose sum falls below _SOFTMAX_MIN_SUM (d > ~7), or is nan (an inf
    # or nan in the block), are done again with their own maximum. Row sums are one BLAS
    # matrix-vector product with ones, and the division a multiplication by their inverses.
    per = max(1, min(rows, _SOFTMAX_BLOCK // cols))  # rows per block
    blocks, main = rows // per, rows // per * per
    dtype = x_type.dtype
    ones = np.ones(cols, dtype)
    min_sum = _const(_SOFTMAX_MIN_SUM, dtype)
    gemv = cols <= _BLAS_ROW_SUM
    maximum, subtract, matmul, add_reduce = np.maximum.reduce, np.subtract, np.matmul, np.add.reduce

    def kernel(x, out):
        x2, o2 = x.reshape(rows, cols), out.reshape(rows, cols)  # x2 is a copy if x is strided
        xb, ob = x2[:main].reshape(blocks, per * cols), o2[:main].reshape(blocks, per * cols)
        subtract(xb, maximum(xb, axis=1, keepdims=True), out=ob)
        if main < rows:
            xt, ot = x2[main:].reshape(1, -1), o2[main:].reshape(1, -1)
            subtract(xt, maximum(xt, axis=1, keepdims=True), out=ot)
        np.exp(out, out=out)
        sums = matmul(o2, ones) if gemv else add_reduce(o2, axis=1)
        redo = np.flatnonzero(~(sums >= min_sum))  # nan too
        if redo.size:
            xr = x2[redo]
            subtract(xr, maximum(xr, axis=1, keepdims=True), out=xr)
            np.exp(xr, out=xr)
            o2[redo] = xr
            sums[redo] = add_reduce(xr, axis=1)
        np.reciprocal(sums, out=sums)
        np.multiply(o2, sums.reshape(rows, 1), out=o2)
    return kernel


# Row-wise dot products without a full-size temporary: np.vecdot (numpy >= 2, BLAS dot) where
# available, einsum on numpy 1.x.
_row_dot = getattr(np, "vecdot", None) or (lambda a, b: np.einsum("ij,ij->i", a, b))


#: Elements of a layer norm's piece on the GEMM queue at least (~25 us of the compiled loop; a
#: queued run costs ~10 us of Python). Measured on a 2-core VM, one thread / two: 3136 x 96 95 /
#: ~80 us; 128 x 768 19 us whole, 25-32 us in two pieces (60 us in two pieces of run()).
LAYER_NORM_PIECE = 1 << 17


def _layer_norm_factor(attrs: dict, ins: Types) -> float:
    """float32 layer norms cut themselves (pieces on the GEMM queue, below); others through
    :func:`parallel`."""
    from polyhal_cpu import onednn_normalization
    if onednn_normalization.plan("layer_norm", attrs, ins, ins[:1]) is not None:
        return math.inf  # a oneDNN primitive, threaded by OpenMP, runs the whole
    return math.inf if native.available(ins[0].dtype) and ins[0].dtype == np.float32 else 1


@TABLE.register("layer_norm", scratch=_rowwise_scratch)
@parallel(lambda attrs, ins: range(int(attrs["axis"]) % ins[0].rank, ins[0].rank),  # rows on several cores
          lambda attrs, ins: (True, False, False), factor=_layer_norm_factor)  # scale and bias are whole
@float16_via_float32
def _layer_norm(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    from polyhal_cpu import onednn_normalization
    primitive = onednn_normalization.layer_norm(attrs, ins, outs, scratch)
    if primitive is not None:
        return primitive
    x_type = ins[0]
    axis = int(attrs["axis"]) % x_type.rank
    # Work on 2-D (rows, normalised elements) views: the normalised dims are trailing and
    # contiguous, so every step is a row-wise reduction or a broadcast over rows. Row means are
    # a BLAS matrix-vector product with 1/n (numpy reduces short rows one loop per row, several
    # times slower); the squares' sums are row dot products; rows are scaled by the inverse
    # deviation (a multiplication, not a division).
    rows, cols = math.prod(x_type.shape[:axis]), math.prod(x_type.shape[axis:])
    dtype = x_type.dtype
    inv_n, eps = _const(1.0 / cols, dtype), _const(float(attrs["epsilon"]), dtype)
    weights = np.full(cols, 1.0 / cols, dtype)
    gemv = cols <= _BLAS_ROW_SUM
    matmul, multiply = np.matmul, np.multiply
    if native.available(dtype):  # one fused loop per row (polyhal_cpu.native): ~5x fewer passes
        fused, contiguous, eps_f = native.layer_norm, np.ascontiguousarray, float(attrs["epsilon"])
        # blocks of rows on the pool's compiled queue (no GIL between the pieces), where cut
        bounds = blocks(rows, min(threads(), rows * cols // LAYER_NORM_PIECE))
        queued = len(bounds) > 1 and gemm_fn() is not None
        if queued:
            template = np.zeros((len(bounds), layout.G_FIELDS), np.int64)
            template[:, layout.G_KIND], template[:, layout.G_N] = layout.KIND_LAYER_NORM, cols
            template[:, layout.G_M] = [hi - lo for lo, hi in bounds]
            template[:, layout.G_ALPHA] = float_bits(eps_f)
            offsets = [lo * cols * 4 for lo, _ in bounds]

        def fused_kernel(x, scale, bias, out):
            x2, o2 = contiguous(x).reshape(rows, cols), out.reshape(rows, cols)
            s, b = contiguous(scale).reshape(cols), contiguous(bias).reshape(cols)
            if not queued:
                fused(x2, s, b, eps_f, o2)
                return
            t = template.copy()
            xa, oa = x2.ctypes.data, o2.ctypes.data
            for p, offset in enumerate(offsets):
                t[p, layout.G_A], t[p, layout.G_C] = xa + offset, oa + offset
            t[:, layout.G_B], t[:, layout.G_BIAS] = s.ctypes.data, b.ctypes.data
            run_gemms(t)
        return fused_kernel

    def kernel(x, scale, bias, out):
        x2, o2 = x.reshape(rows, cols), out.reshape(rows, cols)
        if gemv:
            mean = matmul(x2, weights)
        else:
            mean = np.add.reduce(x2, axis=1)
            multiply(mean, inv_n, out=mean)
        np.subtract(x2, mean.reshape(rows, 1), out=o2)
        var = _row_dot(o2, o2)  # row sums of squares, no full-size temporary
        multiply(var, inv_n, out=var)
        np.add(var, eps, out=var)
        np.sqrt(var, out=var)
        np.reciprocal(var, out=var)
        multiply(o2, var.reshape(rows, 1), out=o2)
        multiply(o2, scale.reshape(cols), out=o2)
        np.add(o2, bias.reshape(cols), out=o2)
    return kernel


# ---------------------------------------------------------------------------------------- shape

@TABLE.register("transpose")
def _transpose(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    rank = ins[0].rank
    perm = tuple(reversed(range(rank))) if attrs["perm"] is None else tuple(int(p) for p in attrs["perm"])
    copyto = np.copyto

    def kernel(x, out):
        copyto(out, x.transpose(perm))
    return kernel


@TABLE.register("reshape")
def _reshape(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    shape, copyto = ins[0].shape, np.copyto

    def kernel(x, out):
        copyto(out.reshape(shape), x)  # out is contiguous, so this is a view: one copy, even of a strided x
    return kernel


@TABLE.register("concat")
def _concat(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    n, axis, concatenate = len(ins), int(attrs["axis"]) % ins[0].rank, np.concatenate

    def kernel(*arrays):
        concatenate(arrays[:n], axis=axis, out=arrays[n])
    return kernel


@TABLE.register("slice")
def _slice(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    index = normalize_slice(ins[0].shape, attrs["starts"], attrs["ends"], attrs["axes"], attrs["steps"])
    copyto = np.copyto

    def kernel(x, out):
        copyto(out, x[index])
    return kernel


@TABLE.register("gather")
def _gather(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    axis, take = int(attrs["axis"]) % ins[0].rank, np.take
    head = (slice(None),) * axis
    if ins[1].rank == 0:
        # One index (Swin's q, k, v = qkv[0], qkv[1], qkv[2]): a slice, copied as a block --
        # np.take goes element-wise, 3x slower contiguous, 4-6x on a strided view.
        dim = ins[0].shape[axis]

        def one(data, indices, out):
            i = int(indices)
            if not -dim <= i < dim:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {dim}")
            np.copyto(out, data[head + (i,)])
        return one

    def kernel(data, indices, out):
        if not data.flags.c_contiguous:
            # np.take makes a contiguous copy of all of a strided operand first (147 MB and 0.2 s
            # for a GPT-2 lookup in its transposed embedding table); indexing reads only the rows
            # it takes, and raises IndexError for an index outside [-dim, dim) as take does.
            np.copyto(out, data[head + (indices,)])
            return
        # mode="raise": an index outside [-dim, dim) raises IndexError instead of reading garbage.
        take(data, indices, axis=axis, out=out, mode="raise")
    return kernel


# -------------------------------------------------------------------------------------- sorting
#
# Order (see polyhal.ops.sorting): stable; nan last ascending and first descending; ties keep
# input order in both directions. numpy's stable sort gives the ascending order. The descending
# order is the ascending stable order of the *reversed* lane, reversed back: reversing twice
# restores the input order among ties, and puts the nans (last ascending) first.

def _descending_order(x: np.ndarray, axis: int, last: int) -> np.ndarray:
    """Indices (a reversed view) of the stable descending order of ``x`` along ``axis``;
    ``last`` is the lane length - 1."""
    flipped = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
    np.subtract(last, flipped, out=flipped)  # index in the flipped lane -> index in x
    return np.flip(flipped, axis)


@TABLE.register("sort")
def _sort(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    axis = int(attrs["axis"]) % ins[0].rank
    if attrs["descending"]:
        def kernel(x, out):
            np.copyto(out, np.flip(np.sort(np.flip(x, axis), axis=axis, kind="stable"), axis))
        return kernel

    def kernel(x, out):
        np.copyto(out, x)
        out.sort(axis=axis, kind="stable")  # in place: no temporary
    return kernel


@TABLE.register("argsort")
def _argsort(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    axis = int(attrs["axis"]) % ins[0].rank
    if attrs["descending"]:
        last = ins[0].shape[axis] - 1

        def kernel(x, out):
            np.copyto(out, _descending_order(x, axis, last))
        return kernel

    def kernel(x, out):
        np.copyto(out, np.argsort(x, axis=axis, kind="stable"))
    return kernel


#: The element types polyhal_cpu.select_loops.topk is compiled for.
_SELECT_TYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


#: Input elements (of a kernel's piece) from which TopK takes the compiled partial selection:
#: TopK 10 of 1,000 in 64 lanes took 105x onnxruntime's time sorted, 1.0-1.7x selected, while a
#: detector's few thousand scores sort in tens of microseconds.
SELECT_MIN_ELEMENTS = 1 << 14


def _topk_split_factor(attrs: dict, ins: Types) -> float:
    """The :func:`~polyhal_cpu.parallel.parallel` factor of TopK (its output, k of each lane, is
    cut from MIN_ELEMENTS times it): from ~256k input elements where lanes hold 32 elements or
    more per k (the selection's first pass leaves most blocks out: ~1 ns an element), from ~32k
    where k is a larger part of the lane (the heap takes many elements: ~17 ns an element at
    k = 100 of 1,000)."""
    k, n = int(attrs["k"]), max(ins[0].shape[int(attrs["axis"])], 1)
    return k / n * (4 if 32 * k <= n else 0.5)


@TABLE.register("topk")
@parallel(fixed_axes=lambda attrs, ins: (int(attrs["axis"]),), split_inputs=lambda attrs, ins: (True,),
          factor=_topk_split_factor)
def _topk(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    # Lanes are independent: large inputs are cut (along an axis before or after the lanes', x
    # alike) across the backend's threads (_topk_split_factor). A small cut would pay a pool
    # thread's hand-off (15-80 us) for half of tens of microseconds: 64 lanes of 1,000, k = 10,
    # took 61 us on one thread, 73 us cut in two.
    x_type = ins[0]
    axis, k = int(attrs["axis"]) % x_type.rank, int(attrs["k"])
    largest, in_order = bool(attrs["largest"]), bool(attrs["sorted"])
    shape = x_type.shape
    # The partial selection (polyhal_cpu.select_loops) where the input is large enough to pay for
    # numba in the process: a small TopK (a detector's 1,000 scores) sorts in microseconds,
    # while loading the compiled selection costs numba's import (~0.6-1 s) at the first session.
    large = x_type.size >= SELECT_MIN_ELEMENTS
    loops = compiled_loops("select_loops") if large and x_type.dtype in _SELECT_TYPES else None
    if loops is not None:
        outer, inner = int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis + 1:], dtype=np.int64))
        select = loops.topk

        def kernel(x, values, indices):
            v, i = (o if o.flags.c_contiguous else np.empty(o.shape, o.dtype) for o in (values, indices))
            select(np.ascontiguousarray(x).reshape(outer, shape[axis], inner), v.reshape(outer, k, inner),
                   i.reshape(outer, k, inner), largest, in_order)
            if v is not values or i is not indices:  # (strided views)
                np.copyto(values, v)
                np.copyto(indices, i)
        return kernel

    # Without numba: a full stable sort, then the first k (argpartition does not honour the
    # tie rule at the cut).
    first_k = (slice(None),) * axis + (slice(0, k),)
    last = shape[axis] - 1

    def kernel(x, values, indices):
        order = _descending_order(x, axis, last) if largest else np.argsort(x, axis=axis, kind="stable")
        top = order[first_k]
        np.copyto(indices, top if in_order else np.sort(top, axis=axis))
        np.copyto(values, np.take_along_axis(x, indices, axis=axis))
    return kernel


#: The other kernel modules and the ops whose kernels each registers in :data:`TABLE`: each is
#: imported at the first question about one of its ops (``KernelTable.register_lazily``), so that
#: a session imports the kernel modules its program uses -- all of them were ~4 ms of CPU of a
#: process's first session (conv_kernels alone 1.5 ms), most of them for ops it did not have.
LAZY_MODULES: dict[str, tuple[str, ...]] = {
    "conv_kernels": ("avg_pool", "conv", "conv_transpose", BLOCKED_CONV, SCALE_SHIFT_CONV, "fused_conv",
                     "lp_pool", "max_pool"),
    "detection": ("non_max_suppression",),
    "indexing_kernels": ("argmin", "cumprod", "cumsum", "einsum", "expand", "gather_elements", "gather_nd", "pad",
                         "reduce_prod", "scatter_elements", "scatter_nd"),
    "math_kernels": ("acos", "acosh", "asin", "asinh", "atan", "atanh", "bit_shift", "bitcast", "bitwise_and",
                     "bitwise_not", "bitwise_or", "bitwise_xor", "ceil", "cos", "cosh", "det", "floor", "identity",
                     "isinf", "isnan", "logical_and", "logical_not", "logical_or", "logical_xor", "mod",
                     "reciprocal", "round", "sign", "sin", "sinh", "tan"),
    "ml_kernels": ("pairwise_coupling", "squared_distances", "tree_ensemble"),
    "nn_kernels": ("attention", "fused_linear", "linear", "masked_attention", "scale_shift"),
    "onednn_int8": ("quantized_conv", "quantized_matmul"),
    "recurrent_kernels": ("gru", "lstm", "rnn"),
    "text_kernels": ("tfidf_vectorizer",),
    "vision_kernels": ("grid_sample", "roi_align"),
}
for _module, _names in LAZY_MODULES.items():
    TABLE.register_lazily(f"polyhal_cpu.{_module}", _names)

#: Every op this backend implements.
KERNEL_NAMES: frozenset[str] = TABLE.kernel_names
