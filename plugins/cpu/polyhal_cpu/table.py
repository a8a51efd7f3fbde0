"""The CPU backend's kernel table, and what its builders share.

:data:`TABLE` is the CPU's :class:`~polyhal.hal.kernels.KernelTable`: every kernel module of this
plugin (:mod:`~polyhal_cpu.kernels`, :mod:`~polyhal_cpu.math_kernels`,
:mod:`~polyhal_cpu.indexing_kernels`, :mod:`~polyhal_cpu.nn_kernels`, :mod:`~polyhal_cpu.conv_kernels`,
:mod:`~polyhal_cpu.encoding`, :mod:`~polyhal_cpu.detection`) registers its builders here, and
:mod:`polyhal_cpu.kernels` declares which module registers which ops (``LAZY_MODULES``: each is
imported at the first question about one of its ops). Kernel modules import this module, never
each other, so the plugin has no import circle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np

from polyhal.hal.kernels import Builder, Kernel, KernelTable
from polyhal.ir.types import TensorType

from polyhal_cpu import scratch
from polyhal_cpu.settings import CPUSettings

__all__ = ["TABLE", "Kernel", "Types", "binary_ufuncs", "compiled_loops", "float16_via_float32", "frozen",
           "numpy_activation"]

Types = tuple[TensorType, ...]

#: The CPU's kernels. Kernels with scratch prepared without a plan get a binding of numpy
#: buffers made once, at prepare (:func:`polyhal_cpu.scratch.standalone`).
TABLE = KernelTable("cpu", standalone=scratch.standalone, storage_types=True)  # ml_dtypes holds them

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)


def frozen(a: np.ndarray) -> bool:
    """Whether nothing can write ``a``'s elements: it and every array it views are read-only
    (a plan's constants). A kernel may keep what it derives from such an array while it is
    given the same array again."""
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    return True


_loop_modules: dict[str, object] = {}


def compiled_loops(name: str):
    """This plugin's numba loops module ``name`` (``tree_loops``, ``vision_loops``, ...), imported
    on first use, or None where numba is missing or ``POLYHAL_CPU_NATIVE=0`` turns the loops
    off: kernels then take their numpy path."""
    if not CPUSettings.from_env().native:
        return None
    if name not in _loop_modules:
        try:
            _loop_modules[name] = importlib.import_module(f"polyhal_cpu.{name}")
        except ImportError:
            _loop_modules[name] = None
    return _loop_modules[name]


def float16_via_float32(builder: Builder) -> Builder:
    """Run float16 ops as float32 on upcast copies and round the results once.

    numpy's float16 loops round after every pass, which multi-pass kernels would compound
    (and float16 matmul has no BLAS). Kernels that are one ufunc call do not need this.
    """
    def build(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
        if all(t.dtype != _F16 for t in (*ins, *outs)):
            return builder(device, op, attrs, ins, outs, scratch)

        def up(types: Types) -> Types:
            return tuple(TensorType(t.shape, _F32 if t.dtype == _F16 else t.dtype) for t in types)

        inner = builder(device, op, attrs, up(ins), up(outs), scratch)
        n = len(ins)
        in_half = [t.dtype == _F16 for t in ins]
        out_half = [(t.shape if t.dtype == _F16 else None) for t in outs]

        def kernel(*arrays: np.ndarray) -> None:
            args = [a.astype(_F32) if h else a for a, h in zip(arrays, in_half)]
            results = [o if s is None else np.empty(s, _F32) for o, s in zip(arrays[n:], out_half)]
            inner(*args, *results)
            for o, r, s in zip(arrays[n:], results, out_half):
                if s is not None:
                    np.copyto(o, r, casting="same_kind")
        return kernel
    return build


def binary_ufuncs(ufuncs: dict[str, np.ufunc]) -> Builder:
    """The builder of the binary ops of ``ufuncs`` (op -> numpy ufunc): ``ufunc(x, y, out=out)``,
    numpy broadcasting the operands."""
    def build(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
        ufunc = ufuncs[op]

        def kernel(x, y, out):
            ufunc(x, y, out=out)
        return kernel
    return build


def numpy_activation(device, activation: str, alpha: float, beta: float, out_type: TensorType):
    """``act(y)`` in place by numpy's ufuncs, for an activation of :data:`polyhal.ops.nn.ACTIVATIONS`
    (GELU through this table's own kernel), or None for "none": the epilogue of fused ops where
    the compiled loops are not available."""
    if activation == "none":
        return None
    a, b = np.asarray(alpha, out_type.dtype), np.asarray(beta, out_type.dtype)
    if activation in ("gelu", "gelu_tanh"):
        gelu = TABLE.prepare(device, "gelu", {"approximate": "tanh" if activation == "gelu_tanh" else "none"},
                             (out_type,), (out_type,))

        def act(y):
            gelu(y.copy(), y)
        return act

    def act(y):
        if activation == "relu":
            np.maximum(y, 0, out=y)
        elif activation == "clip":
            np.minimum(np.maximum(y, a, out=y), b, out=y)
        elif activation in ("hard_sigmoid", "hard_swish"):
            h = np.clip(y * a + b, 0, 1)
            np.multiply(y, h, out=y) if activation == "hard_swish" else np.copyto(y, h)
        elif activation == "sigmoid":  # 1 / (1 + exp(-y)), in place: no temporaries
            np.negative(y, out=y)
            np.exp(y, out=y)
            np.add(y, 1, out=y)
            np.reciprocal(y, out=y)
        else:  # silu
            np.multiply(y, 1 / (1 + np.exp(-y)), out=y)
    return act
