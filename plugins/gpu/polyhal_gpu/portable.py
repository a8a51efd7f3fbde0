"""Kernels written once for OpenCL, CUDA and HIP: ``polyhal_gpu/c/*.c``, in the C that OpenCL C
1.2 and CUDA C++ (HIP alike) share, behind the few macros of ``c/portable.h``.

:func:`plan` turns one op instance into a :class:`PortableKernel`: the full source (the header,
a block of ``#define`` lines with every extent, element type and table of the instance, then the
op's file), the kernel's name and how many work-items it takes (one per output element, or one
per matrix for ``det``). The backends only compile and launch it: polyhal-opencl as a recipe
(one launch, the operands in order), polyhal-cuda with NVRTC and polyhal-hip with hiprtc, both
CUDA-style (:attr:`PortableKernel.launch_shape`, :meth:`PortableKernel.arguments`). The ops'
semantics are in their :mod:`polyhal.ops` modules; the C files say how a work-item computes its
element.

=====================  =====================================================================
op                     what runs
=====================  =====================================================================
``grid_sample``        ``c/sampling.c``: per output element, 1, 2^r or 4^r taps (r <= 3)
``roi_align``          ``c/sampling.c``: per output bin, its bilinear samples
``det``                ``c/linalg.c``: per matrix, elimination in private memory (M <= 16)
``tree_ensemble``      ``c/ml.c``: per (sample, target), a walk of every tree
``tfidf_vectorizer``   ``c/text.c``: per (row, column), the pool n-grams of that column
=====================  =====================================================================

Element types: float32 and float64 data (float16 and the storage types are refused with
:class:`~polyhal.errors.KernelNotFoundError`, as are matrices too large for private memory);
sums and coordinates are in ``double`` where the device has it (``fp64``), as the numpy
references compute, else in ``float``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from polyhal.errors import KernelNotFoundError
from polyhal.ops.ml import AGGREGATES, BINARY, POST_TRANSFORMS
from polyhal.ops.text import TFIDF_MODES, pool_ngrams
from polyhal.ops.vision import GRID_MODES, GRID_PADDING

from polyhal_gpu.launch import BLOCK

__all__ = ["OPS", "PortableKernel", "plan", "prepare"]

#: numpy element type -> the C type of its buffers (the same word in OpenCL C and CUDA C++,
#: through portable.h's ``i64``).
_C = {"float32": "float", "float64": "double", "int32": "int", "int64": "i64"}
_FLOATS = ("float32", "float64")
_ZERO = np.uint64(0)
#: The largest matrix order ``det`` eliminates in private memory (16 x 16 doubles: 2 KiB).
MAX_DET_ORDER = 16


@dataclass(frozen=True)
class PortableKernel:
    """One op instance, ready to compile: ``source`` defines ``__kernel``/``extern "C"`` function
    ``name``, launched over ``work_items`` (one dimension, a guard in the kernel) with the op's
    operands in order as its buffers."""

    source: str
    name: str
    work_items: int
    fp64: bool

    @property
    def launch_shape(self) -> tuple[tuple[int], tuple[int]]:
        """(grid, block) of a CUDA-style launch (CUDA, HIP): a thread per work-item, in blocks
        of :data:`~polyhal_gpu.launch.BLOCK`."""
        return (-(-self.work_items // BLOCK),), (BLOCK,)

    @staticmethod
    def arguments(arrays: Sequence[Any]) -> tuple[Any, ...]:
        """The arguments of a CUDA-style launch over dense ``arrays`` (the operands in order):
        each array followed by its element offset, 0 (``BUF`` in ``portable.h``)."""
        return tuple(v for a in arrays for v in (a, _ZERO))


@functools.lru_cache(maxsize=None)
def _text(name: str) -> str:
    return (resources.files("polyhal_gpu") / "c" / name).read_text(encoding="utf-8")


def _define(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("(1.0/0.0)" if value > 0 else "(-1.0/0.0)")
    if isinstance(value, (list, tuple)):
        return ", ".join(_define(v) for v in value)
    return str(value)


def _source(file: str, flag: str, fp64: bool, data: np.dtype, tables: str = "", **defines: Any) -> str:
    values = {flag: 1, "USE_FP64": fp64, "T": _C[data.name], "ACC": "double" if fp64 else "float", **defines}
    return (_text("portable.h") + "\n" + "".join(f"#define {k} {_define(v)}\n" for k, v in values.items())
            + tables + "\n" + _text(file))


def _require(op: str, dtype: np.dtype, allowed: Sequence[str]) -> None:
    if dtype.name not in allowed:
        raise KernelNotFoundError(f"{op} on {dtype} has no portable GPU kernel (it takes {', '.join(allowed)}); "
                                  "cast to float32 first or run the op on cpu:0")


def _grid_sample(attrs: Mapping[str, Any], ins, outs, fp64: bool) -> PortableKernel:
    x, y = ins[0], outs[0]
    dims = x.shape[2:]
    if len(dims) > 3:
        raise KernelNotFoundError(f"grid_sample over {len(dims)} spatial dims has no GPU kernel (it takes up to 3); "
                                  "run it on cpu:0")
    src = _source("sampling.c", "GRID_SAMPLE", fp64, x.dtype, R=len(dims), N=x.shape[0], C=x.shape[1],
                  P=math.prod(y.shape[2:]), SPATIAL=math.prod(dims), DIMS=tuple(dims),
                  MODE=GRID_MODES.index(attrs["mode"]), PAD=GRID_PADDING.index(attrs["padding_mode"]),
                  ALIGN=bool(attrs["align_corners"]), TOTAL=y.size)
    return PortableKernel(src, "grid_sample", y.size, fp64)


def _roi_align(attrs: Mapping[str, Any], ins, outs, fp64: bool) -> PortableKernel:
    x, y = ins[0], outs[0]
    src = _source("sampling.c", "ROI_ALIGN", fp64, x.dtype, C=x.shape[1], H=x.shape[2], W=x.shape[3],
                  OH=int(attrs["output_height"]), OW=int(attrs["output_width"]),
                  SCALE=f"((ACC){float(attrs['spatial_scale'])!r})", SAMPLING=int(attrs["sampling_ratio"]),
                  HALF_PIXEL=attrs["coordinate_transformation_mode"] == "half_pixel", MAX_MODE=attrs["mode"] == "max",
                  TOTAL=y.size)
    return PortableKernel(src, "roi_align", y.size, fp64)


def _det(attrs: Mapping[str, Any], ins, outs, fp64: bool) -> PortableKernel:
    x, y = ins[0], outs[0]
    m = x.shape[-1]
    if m > MAX_DET_ORDER:
        raise KernelNotFoundError(f"det of {m} x {m} matrices has no GPU kernel (it eliminates up to "
                                  f"{MAX_DET_ORDER} x {MAX_DET_ORDER} in private memory); run it on cpu:0")
    return PortableKernel(_source("linalg.c", "DET", fp64, x.dtype, M=m, TOTAL=y.size), "det", y.size, fp64)


def _tree_ensemble(attrs: Mapping[str, Any], ins, outs, fp64: bool) -> PortableKernel:
    x, y = ins[0], outs[0]
    if not fp64:
        raise KernelNotFoundError("tree_ensemble sums float64 leaf values: it needs a device with float64; "
                                  "run it on cpu:0")
    samples, columns, targets = x.shape[0], y.shape[1], ins[3].shape[1]
    base = [float(v) for v in attrs["base"]] or [0.0] * targets
    src = _source("ml.c", "TREE_ENSEMBLE", fp64, x.dtype, _constant_array("BASE", "double", base),
                  FEATURES=x.shape[1], TREES=ins[4].shape[0], TARGETS=max(targets, 1), COLUMNS=max(columns, 1),
                  DEPTH=int(attrs["depth"]), SAMPLES=samples, AGG=AGGREGATES.index(attrs["aggregate"]),
                  BINARY=BINARY.index(attrs["binary"]), POST=POST_TRANSFORMS.index(attrs["post_transform"]),
                  LABELS=int(len(ins) == 6))
    return PortableKernel(src, "tree_ensemble", samples if columns else 0, fp64)


def _constant_array(name: str, ctype: str, values: Sequence[Any]) -> str:
    """A constant table (one dummy entry where it is empty: C has no empty arrays)."""
    items = list(values) or [0]
    return f"CONSTANT {ctype} {name}[{len(items)}] = {{{', '.join(_define(v) for v in items)}}};\n"


def _tfidf_vectorizer(attrs: Mapping[str, Any], ins, outs, fp64: bool) -> PortableKernel:
    x, y = ins[0], outs[0]
    width = y.shape[-1]
    columns: dict[int, dict[tuple, None]] = {c: {} for c in range(width)}
    for n, (grams, cols) in pool_ngrams(attrs["pool"], attrs["ngram_counts"], attrs["ngram_indexes"],
                                        int(attrs["min_gram"]), int(attrs["max_gram"])).items():
        last = {tuple(int(v) for v in g): int(c) for g, c in zip(grams, cols)}  # a repeat counts in its last column
        for gram, col in last.items():
            columns[col][gram] = None
    starts, sizes, at, ids = [0], [], [], []
    for col in range(width):
        for gram in columns[col]:
            sizes.append(len(gram))
            at.append(len(ids))
            ids.extend(gram)
        starts.append(len(sizes))
    weights = [float(np.float32(w)) for w in attrs["weights"]][:width]
    tables = (_constant_array("COL_START", "int", starts) + _constant_array("ENTRY_N", "int", sizes)
              + _constant_array("ENTRY_AT", "int", at) + _constant_array("GRAMS", "i64", ids)
              + _constant_array("WEIGHTS", "float", [f"{w!r}f" for w in weights]))
    src = _source("text.c", "TFIDF", fp64, x.dtype, tables, LEN=x.shape[-1] if x.rank else 1, WIDTH=width,
                  MAX_SKIP=int(attrs["max_skip"]), MODE=TFIDF_MODES.index(attrs["mode"]),
                  HAS_WEIGHTS=bool(weights), TOTAL=y.size)
    return PortableKernel(src, "tfidf_vectorizer", y.size, fp64)


#: op -> (planner, the element types of its first input it takes).
_PLANNERS: dict[str, tuple[Callable[..., PortableKernel], tuple[str, ...]]] = {
    "grid_sample": (_grid_sample, _FLOATS), "roi_align": (_roi_align, _FLOATS), "det": (_det, _FLOATS),
    "tree_ensemble": (_tree_ensemble, _FLOATS), "tfidf_vectorizer": (_tfidf_vectorizer, ("int32", "int64")),
}
#: The ops with a portable kernel.
OPS: frozenset[str] = frozenset(_PLANNERS)


def plan(op: str, attrs: Mapping[str, Any], in_types: Sequence[Any], out_types: Sequence[Any], *,
         fp64: bool) -> PortableKernel:
    """The kernel of one instance of ``op`` (``attrs`` resolved), for a device with (``fp64``) or
    without double precision; KernelNotFoundError where no portable kernel serves it."""
    planner, dtypes = _PLANNERS[op]
    _require(op, np.dtype(in_types[0].dtype), dtypes)
    return planner(attrs, tuple(in_types), tuple(out_types), fp64)


def prepare(op: str, attrs: Mapping[str, Any], in_types: Sequence[Any], out_types: Sequence[Any], *,
            make: Callable[[PortableKernel], Any], fallback: Callable[[], Any]) -> Any:
    """The kernel of one instance on a CUDA-style backend (CUDA, HIP; float64 everywhere):
    ``make(kernel)`` of its portable kernel, or ``fallback()`` (the backend's host fallback)
    where no portable kernel serves it."""
    try:
        kernel = plan(op, attrs, in_types, out_types, fp64=True)
    except KernelNotFoundError:
        return fallback()
    return make(kernel)
