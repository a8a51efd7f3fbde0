"""Fused CPU loops compiled to native code by numba (LLVM), for kernels that numpy can only do
pass by pass.

numpy runs one loop per ufunc call over the whole operand: a tanh-GELU is seven passes over its
data, a layer norm a dozen (several of them broadcasts, which numpy iterates one short row at a
time), an attention's softmax five. These loops make one pass per row instead, with everything
in registers or L1, vectorised by LLVM for the host's SIMD width -- the codegen IREE's llvm-cpu
backend or onnxruntime's MLAS do ahead of time. Measured on a 2-core VM (AVX-512): GELU of
256 x 512 floats 147 -> ~60 µs, layer norm of 256 x 128 ~55 -> ~15 µs.

**exp2.** LLVM vectorises a loop only if every call in it has a vector form, and numba links no
vector math library, so ``exp2`` here is computed in line: 2^t = 2^n * 2^f with n the nearest
integer and f in [-1/2, 1/2], 2^f by Cephes' degree-6 polynomial (within 2 ulp in float32),
2^n by building the float's exponent bits. t is clamped to [-127, 128] first: below, 2^t is 0
(results under 2^-126 flush to zero, where numpy would spend 10-300x longer on subnormals);
at 128 the exponent field is all ones, which is inf, so overflow still gives inf.

**When.** float32 only (float64 keeps numpy's loops, float16 runs as float32), C-contiguous
operands, numba importable and ``POLYHAL_CPU_NATIVE`` not ``0``. Each loop is compiled on its
first call (~0.2-0.6 s) and cached on disk beside this file (or in numba's user-wide cache
directory where that is read-only), so later processes load it in milliseconds. The loops
release the GIL.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

__all__ = ["available", "add_rows", "exp2_rows", "exp2_shifted_rows", "gelu_tanh", "layer_norm", "relu", "scale_rows",
           "softmax_rows"]

_F32 = np.dtype(np.float32)
_loops: dict[str, Callable] | None = None


def available(dtype=_F32) -> bool:
    """Whether the compiled loops serve ``dtype`` here (numba importable, float32, not disabled
    by ``POLYHAL_CPU_NATIVE=0``)."""
    if np.dtype(dtype) != _F32 or os.environ.get("POLYHAL_CPU_NATIVE", "1").strip() == "0":
        return False
    return bool(_compiled())


def _compiled() -> dict[str, Callable]:
    global _loops
    if _loops is None:
        try:
            _loops = _build()
        except ImportError:
            _loops = {}
    return _loops


def _build() -> dict[str, Callable]:
    from polyhal_cpu import native_loops  # imports numba

    return {name: getattr(native_loops, name) for name in native_loops.__all__}


def gelu_tanh(x: np.ndarray, out: np.ndarray) -> None:
    """tanh-approximated GELU of contiguous float32 ``x`` into ``out`` (1-D views)."""
    _compiled()["gelu_tanh"](x, out)


def relu(x: np.ndarray, out: np.ndarray) -> None:
    """max(x, 0) of contiguous float32 ``x`` into ``out`` (1-D views); nan stays nan."""
    _compiled()["relu"](x, out)


def softmax_rows(x: np.ndarray, out: np.ndarray) -> None:
    """Softmax of each row of (rows, cols) ``x`` into ``out``."""
    _compiled()["softmax_rows"](x, out)


def layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float, out: np.ndarray) -> None:
    """Layer norm of the rows of (rows, cols) ``x`` into ``out`` with (cols,) scale and bias."""
    _compiled()["layer_norm"](x, scale, bias, np.float32(eps), out)


def exp2_rows(s: np.ndarray, sums: np.ndarray) -> bool:
    """Rows of (rows, cols) ``s`` to 2^(s - row max) in place, their sums into ``sums``; False
    when a row's maximum is not finite (its sum is then nan)."""
    return bool(_compiled()["exp2_rows"](s, sums))


def exp2_shifted_rows(s: np.ndarray, shift: float, sums: np.ndarray) -> None:
    """(rows, cols) ``s`` to 2^(s - shift) in place, each row's sum into ``sums``."""
    _compiled()["exp2_shifted_rows"](s, np.float32(shift), sums)


def scale_rows(x: np.ndarray, factors: np.ndarray) -> None:
    """Divide row r of (rows, cols) ``x`` by ``factors[r]``, in place."""
    _compiled()["scale_rows"](x, factors)


def add_rows(x: np.ndarray, row: np.ndarray) -> None:
    """Add (cols,) ``row`` to every row of (rows, cols) ``x``, in place."""
    _compiled()["add_rows"](x, row)
