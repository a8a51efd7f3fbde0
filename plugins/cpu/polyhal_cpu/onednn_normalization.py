"""The CPU's layer normalization, last-axis softmax, per-channel ``scale_shift`` and max / average
pooling as oneDNN primitives (:mod:`polyhal_cpu.onednn`), one per op instance, made when the plan
is compiled.

The builders of ``layer_norm`` and ``softmax`` (:mod:`polyhal_cpu.kernels`) ask this module first
where the compiled loops of :mod:`polyhal_cpu.native` are not loaded -- a machine whose loops
module is still being built in the background (its first run), numba missing, or
``POLYHAL_CPU_NATIVE=0`` -- and, for the ops of :data:`PREFERRED_OVER_LOOPS`, where they are
(from :data:`PREFERRED_FROM_ELEMENTS` elements).
Without the loops they replace numpy's passes: measured on the 2-core VM (AMD EPYC,
AVX2, busy), oneDNN 3.2's ``jit:uni`` layer norm took 29-56 us against numpy's 55-224 us (128 x 128
to 128 x 768), its ``jit:avx2`` softmax 75 us against 198 us (4 heads of 128 x 128 scores).
Against the compiled loops: see :data:`PREFERRED_OVER_LOOPS`. ``scale_shift`` (a folded batch norm
and its activation: DenseNet's, before each conv) is a binary ``mul`` primitive by the per-channel
scale with a binary ``add`` of the shift and the activation as post-ops, one pass over x where
numpy makes three: measured on the 2-core VM (Sapphire Rapids, AVX-512, load ~3.5) 238 against
700 us for 1 x 256 x 56 x 56 with a ReLU, 21 against 74 us for 1 x 128 x 28 x 28. ``max_pool`` and
``avg_pool`` are oneDNN's pooling primitive on NCHW (``jit:avx512_core``; it relays the planes
through its scratchpad): DenseNet-121 b1's stem max pool (64 x 112 x 112, 3 x 3 stride 2) took
~300 us a call against numpy's ~2.2 ms (the compiled loop: ~330 us). An average pool with
``ceil_mode``'s extra end padding and ``count_include_pad`` stays on the CPU's own kernel (oneDNN
would count that padding too).

An instance oneDNN does not take (a type other than float32 on this CPU, a normalised span that
is not the trailing dimension's rows, a softmax over another axis) runs on the CPU's own kernel,
and :func:`polyhal_cpu.onednn_kernels.refusals` says why. Statistics are computed in the
primitive and never kept (``forward_inference``); the scratchpad, where an implementation wants
one, is declared scratch like every oneDNN primitive's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from polyhal.hal.scratch import KernelInfo, Problem

from polyhal_cpu import native, onednn
from polyhal_cpu.onednn import (ACTIVATIONS, ARG_DST, ARG_SCALE, ARG_SHIFT, ARG_SRC, ARG_SRC_1, BINARY_MUL, Attr,
                                 Primitive, Refused, address)
from polyhal_cpu.onednn_kernels import _bound, _planned, _requests, _served

__all__ = ["PREFERRED_OVER_LOOPS", "layer_norm", "pool", "scale_shift", "scratch", "softmax"]

#: The ops whose primitives run even where the compiled loops are loaded. Measured side by side
#: on the 2-core VM (AVX2, load ~6; min / median of 3000 alternating calls): softmax of 4 x 128 x
#: 128 61/106 us against the loop's 83/100 us, of 12 x 128 x 128 172/297 against 274/386 us; layer
#: norm of 128 x 128 22/36 us against 9/15 us, 128 x 768 43/68 against 27/40 us -- the loop keeps it.
PREFERRED_OVER_LOOPS = frozenset({"softmax"})
#: Elements from which the ops of :data:`PREFERRED_OVER_LOOPS` take the primitive over the loops:
#: below, a call's fixed cost decides. Measured on the 2-core Intel VM (AVX-512, load ~3, median
#: us, oneDNN 3.2's ``jit:avx512_core_fp16`` / the loop): softmax of 1 x 16 4.9 / 0.8, 4 x 16 x 16
#: 5.9 / 2.3, 4 x 32 x 32 7.6 / 5.9, 8 x 32 x 32 10.7 / 11.1, 16 x 512 8.9 / 11.7, 4 x 128 x 128
#: 40 / 85. An instance below it loads no library (~4 ms of a process's first session).
PREFERRED_FROM_ELEMENTS = 8192


@dataclass
class RowPlan:
    """One layer norm or softmax instance as a oneDNN primitive over (rows, cols)."""

    primitive: Primitive
    scratchpad_bytes: int
    single: bool  # runs on the calling thread alone (OpenMP told so around each call)
    weights_bytes: int = 0  # no weights layout: scale and shift are read as they lie
    weights: None = None
    name: str = ""


_PLANS: dict[tuple, RowPlan | None] = {}


def _wanted(op: str, ins, outs) -> bool:
    preferred = op in PREFERRED_OVER_LOOPS and outs[0].size >= PREFERRED_FROM_ELEMENTS
    return (preferred or not native.available(outs[0].dtype)) and _served(ins, outs)


def _rows(op: str, attrs: dict, x) -> tuple[int, int]:
    """The instance as (rows, cols): the normalised span is the trailing dims (scale_shift: all of x)."""
    if op in ("scale_shift", "max_pool", "avg_pool"):
        return 1, x.size
    axis = int(attrs["axis"]) % x.rank
    if op == "softmax" and axis != x.rank - 1:
        raise Refused("softmax over an inner axis: the CPU's own kernel (oneDNN's is asked for the last axis only)")
    return math.prod(x.shape[:axis]), math.prod(x.shape[axis:])


#: Elements from which a primitive is created (and run) on the thread budget's OpenMP threads;
#: smaller ones run on the calling thread alone. An OpenMP fork-join on a loaded 2-core VM waits
#: for the partner thread to be scheduled: the README's main job's 128 x 128 layer norms took
#: 4.7 ms a call on two threads (load ~11) against tens of microseconds on one.
THREADED_ELEMENTS = 1 << 20


def _make(op: str, attrs: dict, ins, outs) -> RowPlan:
    rows, cols = _rows(op, attrs, ins[0])
    loaded = onednn.lib()
    single = rows * cols < THREADED_ELEMENTS and loaded.omp_set_num_threads is not None
    if single:
        loaded.omp_set_num_threads(1)  # a primitive's work split is fixed when it is created
    else:
        loaded.set_threads()
    md = onednn.plain((rows, cols), None, outs[0].dtype)
    if op in ("max_pool", "avg_pool"):
        pd = _pooling_desc(op, attrs, ins[0], outs[0])
        args = (ARG_SRC, ARG_DST)
    elif op == "scale_shift":
        x = ins[0]
        md = onednn.plain(x.shape, None, x.dtype)
        per_channel = onednn.plain((1, x.shape[1]) + (1,) * (x.rank - 2), None, x.dtype)
        activation = attrs["activation"]
        if activation != "none" and activation not in ACTIVATIONS:
            raise Refused(f"scale_shift: oneDNN has no eltwise post-op for activation {activation!r}")
        attr = Attr([("add", per_channel), (activation, float(attrs["alpha"]), float(attrs["beta"]))])
        pd = onednn.binary_desc(op, BINARY_MUL, md, per_channel, md, attr)
        args = (ARG_SRC, ARG_SRC_1, ARG_DST) + attr.binary_args
    elif op == "layer_norm":
        pd = onednn.layer_norm_desc(op, md, md, float(attrs["epsilon"]), True, True, Attr())
        args = (ARG_SRC, ARG_SCALE, ARG_SHIFT, ARG_DST)
    else:
        pd = onednn.softmax_desc(op, md, md, 1, Attr())
        args = (ARG_SRC, ARG_DST)
    try:
        prim = Primitive(pd, args, op)
    finally:
        if single:
            loaded.set_threads()  # the budget again, for the primitives created after
    return RowPlan(prim, prim.scratchpad_bytes, single, name=f"oneDNN {op} [{prim.impl}]")


def _pooling_desc(op: str, attrs: dict, x, y):
    """A pooling primitive's descriptor on NCHW (1-D to 3-D): ONNX's geometry in oneDNN's terms,
    the end padding ``ceil_mode`` adds included."""
    n = x.rank - 2
    s = [int(v) for v in (attrs.get("strides") or [1] * n)]
    p = [int(v) for v in (attrs.get("pads") or [0] * (2 * n))]
    d = [int(v) for v in (attrs.get("dilations") or [1] * n)]
    k = [int(v) for v in attrs["kernel_shape"]]
    pad_r = []
    for i in range(n):
        need = (y.shape[2 + i] - 1) * s[i] + (k[i] - 1) * d[i] + 1
        pad_r.append(p[n + i] + max(need - (x.shape[2 + i] + p[i] + p[n + i]), 0))
    algorithm = onednn.POOLING_MAX
    if op == "avg_pool":
        if attrs["count_include_pad"] and any(pad_r[i] != p[n + i] for i in range(n)):
            raise Refused("avg_pool: ceil_mode's end padding with count_include_pad (oneDNN would count it)")
        algorithm = onednn.POOLING_AVG_INCLUDE_PADDING if attrs["count_include_pad"] and any(p) \
            else onednn.POOLING_AVG_EXCLUDE_PADDING
    src, dst = onednn.plain(x.shape, None, x.dtype), onednn.plain(y.shape, None, y.dtype)
    return onednn.pooling_desc(op, algorithm, src, dst, s, k, [v - 1 for v in d], p[:n], pad_r, Attr())


def plan(op: str, attrs: dict, ins, outs) -> RowPlan | None:
    """The oneDNN plan of a ``layer_norm`` / ``softmax`` / ``scale_shift`` instance, made once and kept; None where
    oneDNN does not serve it here (then the CPU's own kernel runs it)."""
    if not _wanted(op, ins, outs) or ins[0].size == 0:
        return None
    if op in ("max_pool", "avg_pool") and not 3 <= ins[0].rank <= 5:
        return None
    if op == "layer_norm" and any(t.size != _rows(op, attrs, ins[0])[1] for t in ins[1:3]):
        return None  # a scale or bias broadcast from fewer elements: the CPU's own kernel
    return _planned(_PLANS, _make, op, attrs, ins, outs)


def scratch(op: str, attrs: dict, ins, outs):
    """The declared scratch of a oneDNN layer norm / softmax / scale_shift instance (its scratchpad), or None
    where oneDNN does not serve it."""
    planned = plan(op, attrs, ins, outs)
    if planned is None:
        return None
    return _requests([], planned, planned.primitive.impl, Problem(op, attrs, tuple(ins), tuple(outs)),
                     KernelInfo(f"onednn_{op}", op, 1, 1, "cpu"))


def _on_one_thread(execute: Callable[..., None]) -> Callable[..., None]:
    """``execute`` with OpenMP's thread count 1 on the calling thread during the call (at
    execution oneDNN forks as many threads as OpenMP says then), the budget's after."""
    loaded = onednn.lib()
    one, threads = loaded.omp_set_num_threads, loaded.set_threads()

    def run(*addresses: int) -> None:
        one(1)
        try:
            execute(*addresses)
        finally:
            one(threads)
    return run


def _scratchpad(bound, op: str, attrs: dict, ins, outs) -> np.ndarray:
    """The scratchpad the plan placed, or one bound now, at prepare, where the instance was
    declared with other types (a float16 op run as float32 declares none)."""
    try:
        return bound.buffer("scratchpad")
    except (AttributeError, KeyError):
        return _bound(None, scratch(op, attrs, ins, outs)).buffer("scratchpad")


def _kernel(op: str, attrs: dict, ins, outs, bound) -> Callable[..., None] | None:
    planned = plan(op, attrs, ins, outs)
    if planned is None:
        return None
    execute = planned.primitive.executor()
    if planned.single:
        execute = _on_one_thread(execute)
    # the scratchpad array is held by the kernels below (one bound here, at prepare, is theirs alone)
    held = _scratchpad(bound, op, attrs, ins, outs) if planned.scratchpad_bytes else None
    pad = (address(held),) if held is not None else ()
    contiguous = np.ascontiguousarray
    # Contiguous copies are held in names while the primitive reads them: the address of a
    # temporary (address(contiguous(x))) is freed memory by the time the primitive runs (a
    # transposed view's copy: ConvNeXt's channel layer norms read garbage, 5% off at the output).
    if op == "layer_norm":
        def kernel(x, scale, bias, out):
            x, scale, bias = contiguous(x), contiguous(scale), contiguous(bias)
            execute(address(x), address(scale), address(bias), address(out), *pad)
    elif op == "scale_shift":  # x * scale, then + shift (the post-op's operand), then the activation
        def kernel(x, scale, shift, out):
            x, scale, shift = contiguous(x), contiguous(scale), contiguous(shift)
            execute(address(x), address(scale), address(out), address(shift), *pad)
    else:  # softmax, max_pool, avg_pool
        def kernel(x, out):
            x = contiguous(x)
            execute(address(x), address(out), *pad)
    kernel.kernel_name = planned.name  # type: ignore[attr-defined]
    kernel.scratchpad = held  # type: ignore[attr-defined]
    return kernel


def layer_norm(attrs: dict, ins, outs, bound) -> Callable[..., None] | None:
    """``layer_norm(x, scale, bias, out)`` as a oneDNN primitive, or None (the CPU's own kernel)."""
    return _kernel("layer_norm", attrs, ins, outs, bound)


def softmax(attrs: dict, ins, outs, bound) -> Callable[..., None] | None:
    """``softmax(x, out)`` over the last axis as a oneDNN primitive, or None (the CPU's own kernel)."""
    return _kernel("softmax", attrs, ins, outs, bound)


def scale_shift(attrs: dict, ins, outs, bound) -> Callable[..., None] | None:
    """``scale_shift(x, scale, shift, out)`` as a oneDNN binary primitive with post-ops, or None
    (the CPU's own kernel)."""
    return _kernel("scale_shift", attrs, ins, outs, bound)


def pool(op: str, attrs: dict, ins, outs, bound) -> Callable[..., None] | None:
    """``max_pool(x, out)`` / ``avg_pool(x, out)`` as a oneDNN pooling primitive, or None (the
    CPU's own kernel)."""
    return _kernel(op, attrs, ins, outs, bound)
