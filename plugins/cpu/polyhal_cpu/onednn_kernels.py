"""The CPU's convolutions and matmuls as oneDNN primitives (:mod:`polyhal_cpu.onednn`), one per op
instance, made when the plan is compiled.

Where the library is usable (:func:`polyhal_cpu.onednn.usable`), the builders of ``conv``,
``fused_conv``, ``cpu.blocked_conv`` (:mod:`polyhal_cpu.conv_kernels`), ``matmul``, ``gemm``,
``linear`` and ``fused_linear`` (:mod:`polyhal_cpu.kernels`, :mod:`polyhal_cpu.nn_kernels`) ask
this module first; an instance it does not take (a type other than float32, a shape oneDNN
refuses: ``unimplemented``) runs on the CPU's own kernels, and :func:`refusals` says which and why.

**Convolutions.** One primitive serves each fused op: the bias is the primitive's, the residual a
``sum`` post-op (the residual placed in the destination first), the activation an ``eltwise``
post-op. The primitive is created on layouts ``any`` -- oneDNN picks the blocked layout its
fastest implementation wants (on AVX2, ``brgconv`` takes nhwc; on AVX-512 ``nChw16c``) -- except
for a ``cpu.blocked_conv``, whose maps are channels-last storage already: it is created on that
layout first, so a chain of such convs hands its maps over as they lie. A map whose layout
differs from the one chosen pays a reorder into (or out of) a declared scratch, and the
scratch's purpose names the reorder, so ``Plan.explain()`` lists every reorder left. Weights are
reordered once, on the first call, into an array kept while the plan hands the kernel the same
read-only weights (its constants); weights that can change are reordered on every call into
declared scratch. The scratchpad (user mode) is declared scratch too.

**Matmuls.** ``matmul`` (batched, broadcasting), ``gemm`` (transposes through strides, ``alpha``
and ``beta`` C), ``linear`` and ``fused_linear`` (bias, residual, activation) are oneDNN matmul
primitives on the operands as they lie (strided descriptors: no copy for a transposed operand);
``beta`` C and the residual are ``binary add`` post-ops, the activation an ``eltwise`` one.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl, ScratchRequest
from polyhal.ir.types import TensorType

from polyhal_cpu import onednn, parallel
from polyhal_cpu.onednn import ARG_BIAS, ARG_DST, ARG_SRC, ARG_WEIGHTS, Attr, MemoryDesc, Primitive, Refused, address
from polyhal_cpu.ops import BLOCKED_CONV
from polyhal_cpu.scratch import array as scratch_array
from polyhal_cpu.settings import CPUSettings

__all__ = ["conv", "conv_chosen", "conv_scratch", "matmul", "matmul_scratch", "refusals"]


#: op instance -> why oneDNN does not serve it (for tests and explain's kernel names).
_REFUSED: dict[tuple, str] = {}
_lock = threading.Lock()


def refusals() -> dict[tuple, str]:
    """The op instances oneDNN refused in this process, and why (they run on the CPU's own kernels)."""
    return dict(_REFUSED)


def _asked(ins, outs) -> bool:
    """Whether oneDNN is asked about operands of these types (one type, one it names; whether a
    primitive takes it is the library's answer)."""
    dtype = outs[0].dtype
    return dtype.name in onednn.DATA_TYPES and all(t.dtype == dtype for t in (*ins, *outs))


def _served(ins, outs) -> bool:
    """Whether oneDNN is usable and asked about operands of these types (:func:`_asked`)."""
    return _asked(ins, outs) and onednn.usable()


def _key(op: str, attrs: dict, ins, outs) -> tuple:
    def frozen(v):
        return tuple(frozen(x) for x in v) if isinstance(v, (list, tuple)) else v
    return (op, tuple(sorted((k, frozen(v)) for k, v in attrs.items())), tuple(ins), tuple(outs))


# ---------------------------------------------------------------------------------- convolution

def _row_major(shape) -> tuple[int, ...]:
    return tuple(int(math.prod(shape[i + 1:])) for i in range(len(shape)))


def _map_md(t: TensorType, blocked: bool) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(logical dims, element strides, name) of a feature map: dense (N, C, spatial...) or, for
    a ``cpu.blocked_conv`` (``blocked``), channel-blocked storage (N, 1, H, W, C), which is nhwc."""
    if blocked and t.rank == 5:
        n, _, h, w, c = t.shape
        return (n, c, h, w), (h * w * c, 1, w * c, c), "nhwc"
    return t.shape, _row_major(t.shape), "nchw" if t.rank == 4 else "plain"


def _filter_md(t: TensorType, group: int, blocked: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(logical dims, element strides) of a conv's weights, dense (M, C/g, k...) or, for a
    ``cpu.blocked_conv``, maybe channels-last (M, 1, kh, kw, C/g); grouped ones as oneDNN wants
    them, (g, M/g, C/g, k...)."""
    if blocked and t.rank == 5:
        m, _, kh, kw, cg = t.shape
        dims, strides = (m, cg, kh, kw), (kh * kw * cg, 1, kw * cg, cg)
    else:
        dims, strides = t.shape, _row_major(t.shape)
    if group == 1:
        return dims, strides
    m = dims[0]
    return (group, m // group, *dims[1:]), (strides[0] * (m // group), *strides)


@dataclass
class _Relayout:
    """A reorder the kernel pays on every call: from the user's layout to the primitive's (or back)."""

    name: str  # scratch name
    primitive: Primitive
    nbytes: int
    purpose: str


@dataclass
class ConvPlan:
    """One conv instance as oneDNN computes it: the primitive and the reorders around it."""

    conv: Primitive
    has_bias: bool
    has_residual: bool
    src: _Relayout | None
    dst: _Relayout | None
    residual: _Relayout | None
    weights: Primitive | None  # None: the primitive takes the weights as they lie
    weights_bytes: int
    scratchpad_bytes: int
    name: str
    single: bool = False  # made for one thread, and run on one (SMALL_MACS)
    requests: tuple = field(default=())


_PLANS: dict[tuple, ConvPlan | None] = {}

#: Multiply-adds below which a primitive is made, and run, on one thread: waking OpenMP's
#: sleeping (passive) workers costs more than the work (a 64 x 32 x 64 matmul took 0.6 ms a call
#: on two threads of the busy 2-core VM, against 0.45 ms for onnxruntime's whole three-layer MLP;
#: EfficientNet-B0's squeeze-excitation convs 20-40 us on two threads against 15-20 us on one).
SMALL_MACS = 1 << 22


def single_threaded(macs: int) -> bool:
    """Whether a primitive of ``macs`` multiply-adds is made for one thread (see
    :data:`SMALL_MACS`), and if so, set OpenMP's thread count to 1 for its creation (the caller
    sets the budget's back with ``onednn.lib().set_threads()`` afterwards)."""
    one = onednn.lib().omp_set_num_threads
    if macs >= SMALL_MACS or one is None:
        return False
    one(1)
    return True


def conv_plan(op: str, attrs: dict, ins, outs) -> ConvPlan | None:
    """The oneDNN plan of a ``conv`` / ``fused_conv`` / ``cpu.blocked_conv`` instance, made once
    per instance and kept; None where oneDNN does not serve it (not usable, not float32, or
    refused: see :func:`refusals`)."""
    if not _served(ins, outs) or ins[0].rank not in (3, 4, 5):
        return None
    return _planned(_PLANS, _make_conv_plan, op, attrs, ins, outs)


def _planned(cache: dict, make: Callable, op: str, attrs: dict, ins, outs):
    """``cache``'s plan of this instance, made by ``make`` the first time; None (and the reason
    kept for explain) where oneDNN refuses it."""
    key = _key(op, attrs, ins, outs)
    with _lock:
        if key not in cache:
            try:
                cache[key] = make(op, attrs, ins, outs)
                # OpenMP's workers and the pool's now share the budget's CPUs: the pool stops
                # spinning. Only once a primitive exists -- loading the library (asked at every
                # compile) must not slow the pool's own kernels (the README's main job, no convs:
                # 1.95-2.36 ms against 1.16-1.31 ms on the 2-core VM).
                parallel.stop_spinning()
            except Refused as exc:
                _REFUSED[key] = str(exc)
                cache[key] = None
        return cache[key]


def _make_conv_plan(op: str, attrs: dict, ins, outs) -> ConvPlan:
    loaded = onednn.lib()
    loaded.set_threads()  # a primitive's work split is fixed when it is created
    single = single_threaded(outs[0].size * math.prod(ins[1].shape[1:]))
    try:
        plan = _make_conv(op, attrs, ins, outs)
    finally:
        loaded.set_threads()
    plan.single = single
    return plan


def _make_conv(op: str, attrs: dict, ins, outs) -> ConvPlan:
    fused = op != "conv"
    activation = attrs.get("activation", "none") if fused else "none"
    alpha, beta = float(attrs.get("alpha", 0.0)), float(attrs.get("beta", 0.0))
    has_bias, has_residual = len(ins) >= 3, len(ins) == 4
    blocked = op == BLOCKED_CONV
    x_dims, x_strides, x_name = _map_md(ins[0], blocked)
    y_dims, y_strides, y_name = _map_md(outs[0], blocked)
    group = int(attrs["group"])
    w_dims, w_strides = _filter_md(ins[1], group, blocked)
    n = len(x_dims) - 2
    strides = [int(v) for v in attrs.get("strides") or [1] * n]
    pads = [int(v) for v in attrs.get("pads") or [0] * (2 * n)]
    dilations = [int(v) - 1 for v in attrs.get("dilations") or [1] * n]  # oneDNN's: 0 is dense
    # The end padding as far as the windows read it: ONNX allows pads that no window reaches
    # (the output size is floored), oneDNN checks that its sizes add up exactly.
    k_dims = w_dims[len(w_dims) - n:]
    pad_r = [(y_dims[2 + i] - 1) * strides[i] + (k_dims[i] - 1) * (dilations[i] + 1) + 1 - x_dims[2 + i] - pads[i]
             for i in range(n)]
    dt = outs[0].dtype
    x_user, y_user = onednn.plain(x_dims, x_strides, dt), onednn.plain(y_dims, y_strides, dt)
    w_user = onednn.plain(w_dims, w_strides, dt)
    bias = onednn.plain((w_dims[0] * (w_dims[1] if group > 1 else 1),), None, dt) if has_bias else None
    attr = Attr([("sum",)] * has_residual + [(activation, alpha, beta)])
    # A blocked conv's maps are channels-last storage: created on that layout first, so a chain
    # hands its maps over as they lie; otherwise (and if that is refused) on layouts "any".
    # A pointwise conv on NCHW maps is a GEMM as they lie (oneDNN's gemm:jit): that beat brgconv
    # between two reorders on the 2-core VM (512 -> 128 at 14x14, batch 1: 0.84 against 1.9 ms;
    # 256 -> 64 at 56x56: 5.6 against 24 ms); a 3x3 one lost (128 -> 32 at 14x14: 1.3 against 0.8 ms).
    pointwise = all(k == 1 for k in k_dims) and all(v == 1 for v in strides) and not any(pads) and group == 1
    tries = []
    if x_name == "nhwc" or y_name == "nhwc" or pointwise:
        tries.append((x_user, y_user))
    tries.append((onednn.any_layout(x_dims, dt), onednn.any_layout(y_dims, dt)))
    refused = None
    for x_md, y_md in tries:
        try:
            pd = onednn.conv_desc(op, x_md, onednn.any_layout(w_dims, dt), bias, y_md, strides, dilations, pads[:n],
                                  pad_r, attr)
            break
        except Refused as exc:
            refused = exc
    else:
        raise refused  # type: ignore[misc]
    args = (ARG_SRC, ARG_WEIGHTS) + ((ARG_BIAS,) if has_bias else ()) + (ARG_DST,)
    prim = Primitive(pd, args, op)
    src_md, dst_md, w_md = prim.mds[ARG_SRC], prim.mds[ARG_DST], prim.mds[ARG_WEIGHTS]
    rank = len(x_dims)
    chosen_x, chosen_y = onednn.describe(src_md, rank), onednn.describe(dst_md, rank)
    src = dst = residual = None
    if src_md != x_user:
        src = _Relayout("src", onednn.reorder(op, x_user, src_md), src_md.nbytes,
                        f"oneDNN reorder of the input {x_name} -> {chosen_x} before the conv [{prim.impl}]")
    if dst_md != y_user:
        dst = _Relayout("dst", onednn.reorder(op, dst_md, y_user), dst_md.nbytes,
                        f"oneDNN conv result in {chosen_y} [{prim.impl}], reordered -> {y_name}")
        if has_residual:
            residual = _Relayout("dst", onednn.reorder(op, y_user, dst_md), 0, "")
    weights = None if w_md == w_user else onednn.reorder(op, w_user, w_md)
    scratchpad = max([prim.scratchpad_bytes] + [r.primitive.scratchpad_bytes for r in (src, dst, residual) if r]
                     + ([weights.scratchpad_bytes] if weights is not None else []))
    reorders = [f"{x_name}->{chosen_x}"] * bool(src) + [f"{chosen_y}->{y_name}"] * bool(dst)
    fused = [p for p, on in (("bias", has_bias), ("sum", has_residual), (activation, activation != "none")) if on]
    name = (f"oneDNN conv [{prim.impl}] on {chosen_x}" + (f" +{'+'.join(fused)}" if fused else "")
            + (f"; reorders {', '.join(reorders)}" if reorders else ""))
    return ConvPlan(prim, has_bias, has_residual, src, dst, residual, weights, w_md.nbytes if weights else 0,
                    scratchpad, name)


def conv_scratch(op: str, attrs: dict, ins, outs) -> tuple[ScratchRequest, ...] | None:
    """The declared scratch of a oneDNN conv instance (the reordered maps and weights, the
    scratchpad), or None where oneDNN does not serve it."""
    plan = conv_plan(op, attrs, ins, outs)
    if plan is None:
        return None
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    kernel = KernelInfo("onednn_conv", op, 1, 1, "cpu")
    decls = [ScratchDecl(r.name, shared=True, per_launch=r.nbytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                         purpose=r.purpose) for r in (plan.src, plan.dst) if r is not None]
    return _requests(decls, plan, plan.conv.impl, problem, kernel)


def _requests(decls: list, plan, impl: str, problem: Problem, kernel: KernelInfo) -> tuple:
    """``decls`` plus the scratch every oneDNN plan may need (weights in the primitive's layout,
    the user-mode scratchpad), as requests of this instance."""
    if plan.weights is not None:
        decls.append(ScratchDecl("weights", shared=True, per_launch=plan.weights_bytes, spaces=(MemorySpace.GLOBAL,),
                                 alignment=64, purpose="oneDNN's weights layout, for weights that are not constants "
                                                       "(constants are reordered once and kept)"))
    if plan.scratchpad_bytes:
        decls.append(ScratchDecl("scratchpad", shared=True, per_launch=plan.scratchpad_bytes,
                                 spaces=(MemorySpace.GLOBAL,), alignment=64,
                                 purpose=f"oneDNN's scratchpad (user mode) of {impl}"))
    return tuple(d.request(problem, kernel) for d in decls)


def _bound(scratch, requests):
    """``scratch``, or for a kernel prepared by hand without its declared scratch, a binding made
    now, at prepare (never in a call)."""
    from polyhal_cpu.scratch import standalone

    return scratch if scratch is not None or not requests else standalone(None, requests)


def _kept_weights(reorder: Callable[..., None] | None, nbytes: int, scratch_weights: np.ndarray | None,
                  pad: tuple[int, ...]):
    """``weights(w) -> address`` in the primitive's layout: ``w`` itself when it needs no reorder;
    else reordered once and kept while the same read-only array comes again (a plan's constant),
    or into ``scratch_weights`` on every call. ``pad`` is the scratchpad's address (a reorder
    may need one too), or nothing. ``w`` may have any strides: a read-only view (a constant's
    transposed view, of which the compile keeps no row-major copy of its own) is made row-major,
    or reordered, once and kept; a writable one is copied row-major on every call. (GPT-2's tied LM
    head is its embedding transposed, 154 MB: made row-major per call, it was a fresh array each
    run, so its reorder was paid on every run, 0.5 s of GPT-2's 0.8 s.)"""
    from polyhal_cpu.table import frozen

    kept: list = [None, None]  # the array the kept copy was made from, the copy
    held: list = [None]  # this call's row-major copy of a writable strided w: alive until the next call

    def weights(w: np.ndarray) -> int:
        if kept[0] is w:
            return address(kept[1])
        contiguous = w.flags.c_contiguous
        if contiguous and reorder is None:
            return address(w)
        source = w if contiguous else np.ascontiguousarray(w)
        if frozen(w):
            if reorder is None:
                copy = source
            else:
                copy = np.empty(max(nbytes, 1), np.uint8)
                reorder(address(source), address(copy), *pad)
            kept[0], kept[1] = w, copy
            return address(copy)
        if reorder is None:
            held[0] = source
            return address(source)
        reorder(address(source), address(scratch_weights), *pad)
        return address(scratch_weights)
    return weights


def conv(op: str, attrs: dict, ins, outs, scratch) -> Callable[..., None] | None:
    """The kernel ``fn(x, w[, b][, r], out)`` of a conv instance as a oneDNN primitive, or None
    where oneDNN does not serve it (the CPU's own conv runs it)."""
    plan = conv_plan(op, attrs, ins, outs)
    if plan is None:
        return None
    scratch = _bound(scratch, conv_scratch(op, attrs, ins, outs))
    execute = plan.conv.executor()
    pad = plan.scratchpad_bytes

    def buf(name: str) -> np.ndarray:
        return scratch_array(scratch, name, np.uint8, (scratch.buffer(name).nbytes,))

    pad_address = (address(buf("scratchpad")),) if pad else ()
    weights = _kept_weights(plan.weights.executor() if plan.weights else None, plan.weights_bytes,
                            buf("weights") if plan.weights else None, pad_address)
    src_in = plan.src.primitive.executor() if plan.src else None
    src_at = address(buf("src")) if plan.src else 0
    dst_out = plan.dst.primitive.executor() if plan.dst else None
    dst_at = address(buf("dst")) if plan.dst else 0
    res_in = plan.residual.primitive.executor() if plan.residual else None
    has_bias, has_residual = plan.has_bias, plan.has_residual
    contiguous, copyto = np.ascontiguousarray, np.copyto

    def run(x, w, *rest):
        out = rest[-1]
        if not x.flags.c_contiguous:
            x = contiguous(x)
        if src_in is not None:
            src_in(address(x), src_at, *pad_address)
            xa = src_at
        else:
            xa = address(x)
        da = dst_at if dst_out is not None else address(out)
        # (a contiguous copy is held in a name while the primitive reads it: address() of a
        # temporary would be freed before the call)
        if has_residual:
            if res_in is not None:
                residual = contiguous(rest[1])
                res_in(address(residual), da, *pad_address)
            else:
                copyto(out, rest[1])
        if has_bias:
            bias = contiguous(rest[0])
            execute(xa, weights(w), address(bias), da, *pad_address)
        else:
            execute(xa, weights(w), da, *pad_address)
        if dst_out is not None:
            dst_out(da, address(out), *pad_address)

    kernel = run
    set_count = onednn.lib().omp_set_num_threads
    if plan.single:
        threads = onednn.lib().set_threads()

        def kernel(*arrays):
            # Some implementations (AVX2's depthwise jit, reorders) split their loops by the
            # thread count of the moment, not the one they were made with.
            set_count(1)
            try:
                run(*arrays)
            finally:
                set_count(threads)
    kernel.kernel_name = plan.name + (" (one thread)" if plan.single else "")  # type: ignore[attr-defined]
    kernel.plan = plan  # type: ignore[attr-defined]  (the primitives live as long as the kernel)
    kernel.scratch = scratch  # type: ignore[attr-defined]  (so does its scratch: it runs on addresses)
    return kernel


#: Multiply-adds from which a conv instance is left to oneDNN untimed: there its primitives
#: measured ahead of the CPU's own kernels (ResNet-50 b8 0.79x onnxruntime's time against 2.8x),
#: and timing both costs compile time in proportion (ResNet-50 b1's compile took 1.6 s instead
#: of 0.4 s with its convs timed up to 2^27). Below, either may win: on the 2-core VM
#: (AVX-512, its other core busy) EfficientNet-B0's squeeze-excitation 1x1 convs on a 1x1 map
#: took 17-40 us as primitives against 5-15 us on the own kernel, its stem 460 against 360 us.
TIMED_MACS = 1 << 25
#: Timed calls of each kernel (alternating, after one untimed call each); the fastest counts.
TIMED_RUNS = 3
#: The own kernel runs an instance only where it took at most this share of the primitive's
#: time: a choice on a noisy machine (other processes, a pool thread waking late) is kept from
#: flipping on a few microseconds (ResNet-50 b1, timed up to 2^27 multiply-adds with no margin:
#: 6 convs went to the own kernel and the model ran ~5% slower).
OWN_MARGIN = 0.8

#: Conv instances the CPU's own kernel measured faster on when a plan was compiled: key -> why.
_OUTRUN: dict[tuple, str] = {}
#: Conv instances timed or left untimed: key -> whether oneDNN runs them.
_CHOSEN: dict[tuple, bool] = {}


def conv_chosen(op: str, attrs: dict, ins, outs, own: Callable[[], Callable[..., None]]) -> bool:
    """Whether oneDNN runs this conv instance: it serves it (:func:`conv_plan`), and, for one of
    fewer than :data:`TIMED_MACS` multiply-adds, the CPU's own kernel (``own()`` builds it, with
    its scratch) did not take :data:`OWN_MARGIN` of its primitive's time or less on constant-filled
    operands of the instance's types -- as the CUDA plugin times cuDNN's engines. Timed once per
    instance, in the compile, under
    the thread budget of the moment (``POLYHAL_CPU_ONEDNN_TIMED=0``: not timed, oneDNN runs
    every instance it serves). The chosen primitive's kernel name carries both times."""
    timed = CPUSettings.from_env().onednn_timed
    key = _key(op, attrs, ins, outs)
    if timed and key in _CHOSEN:
        return _CHOSEN[key]
    plan = conv_plan(op, attrs, ins, outs)
    if plan is None:
        return False
    if not timed:
        return True
    if outs[0].size * math.prod(ins[1].shape[1:]) >= TIMED_MACS:
        _CHOSEN[key] = True
        return True
    try:
        theirs = own()
    except Exception:  # noqa: BLE001 -- an own path that cannot take the instance: oneDNN runs it
        _CHOSEN[key] = True
        return True
    ours = conv(op, attrs, ins, outs, None)
    # A constant fill: neither kernel's time depends on the values, and drawing random maps at
    # batch 8 took a second of EfficientNet-B0's compile.
    arrays = [np.full(t.shape, 0.25, t.dtype) for t in (*ins, *outs)]
    for a in arrays[1:len(ins)]:
        a.flags.writeable = False  # weights and bias are a plan's constants: kept, as they will be
    taken: dict = {ours: [], theirs: []}
    for fn in (ours, theirs) * (TIMED_RUNS + 1):
        t0 = time.perf_counter()
        fn(*arrays)
        taken[fn].append(time.perf_counter() - t0)
    mine, other = min(taken[ours][1:]), min(taken[theirs][1:])  # the first calls reorder weights
    times = f"oneDNN {mine * 1e6:.0f} us, own {other * 1e6:.0f} us"
    chosen = other > OWN_MARGIN * mine
    if chosen:
        plan.name += f" (timed: {times})"
    else:
        _OUTRUN[key] = f"it measured faster than oneDNN when the plan was compiled ({times})"
        with _lock:  # its primitive is not kept: ~0.5 MB each of jit code and descriptors
            _PLANS.pop(key, None)
    _CHOSEN[key] = chosen
    return chosen


# ---------------------------------------------------------------------------------------- matmul

@dataclass
class MatmulPlan:
    """One matmul-family instance as a oneDNN matmul primitive."""

    matmul: Primitive
    has_bias: bool
    binary: tuple[int, ...]  # which kernel operands feed the binary post-ops, in order
    weights: Primitive | None  # the reorder into the primitive's weights layout (None: as they lie)
    weights_bytes: int
    scratchpad_bytes: int
    shapes: tuple  # (a, b, out) shapes the primitive sees (leading dims collapsed or padded)
    name: str


_MATMULS: dict[tuple, MatmulPlan | None] = {}
#: Rows (of A and the result) below which a product with a weight matrix stays on the CPU's own
#: GEMMs: it reads each weight about once, so it is bound by memory either way (a classifier at
#: batch 1: own 385 us, oneDNN's brgemm ~360 us on the 2-core VM), and oneDNN's weights layout
#: would be a second, kept copy of the matrix (MobileNetV3-large's classifier: 10 MB of its
#: ~47 MB above onnxruntime's peak at batch 1, AVX-512).
FEW_ROWS = 16
#: The matmul implementations taken (prefixes of oneDNN's names): the brgemm ones. oneDNN 3.2 has
#: them from AVX-512 on; on AVX2 its matmul is ``gemm:jit``, which measured slower than the CPU's
#: own GEMMs, so matmuls stay on those there.
MATMUL_IMPLEMENTATIONS = ("brg",)


def _broadcast_md(shape: tuple[int, ...], rank: int, dtype) -> MemoryDesc:
    """A row-major descriptor of an operand of ``shape`` broadcast to ``rank`` dims (leading 1s)."""
    full = (1,) * (rank - len(shape)) + tuple(shape)
    return onednn.plain(full, None, dtype)


def matmul_plan(op: str, attrs: dict, ins, outs) -> MatmulPlan | None:
    """The oneDNN plan of a ``matmul`` / ``gemm`` / ``linear`` / ``fused_linear`` instance, made
    once per instance and kept; None where oneDNN does not serve it."""
    if not _asked(ins, outs) or any(t.size == 0 for t in ins):
        return None
    if op == "matmul" and (ins[0].rank < 2 or ins[1].rank < 2):
        return None
    few = _few_rows(op, attrs, ins, outs)
    if few is not None:  # decided by the shapes: without loading the library (~4 ms of a first session)
        if CPUSettings.from_env().onednn:
            with _lock:
                key = _key(op, attrs, ins, outs)
                _REFUSED[key], _MATMULS[key] = few, None
        return None
    if not onednn.usable():
        return None
    return _planned(_MATMULS, _make_matmul_plan, op, attrs, ins, outs)


def _few_rows(op: str, attrs: dict, ins, outs) -> str | None:
    """Why a product with a weight matrix (``gemm``, ``linear``, ``fused_linear``, a ``matmul`` by
    a 2-D operand) of fewer than :data:`FEW_ROWS` rows stays on the CPU's own GEMMs, or None."""
    if op == "matmul" and ins[1].rank != 2:
        return None
    rows, n = math.prod(outs[0].shape[:-1]), outs[0].shape[-1]
    if rows >= FEW_ROWS:
        return None
    k = ins[1].shape[1 if op == "gemm" and attrs["trans_b"] else 0]
    return (f"{op}: {rows} row(s) against {k} x {n} weights is bound by reading them, which the CPU's own GEMMs "
            "do as they lie, where oneDNN would keep a copy in its layout")


def _make_matmul_plan(op: str, attrs: dict, ins, outs) -> MatmulPlan:
    onednn.lib().set_threads()
    a_t, b_t, out_t = ins[0], ins[1], outs[0]
    dt = out_t.dtype
    post: list = []
    binary: list[int] = []
    bias = None
    if op == "gemm":
        trans_a, trans_b = bool(attrs["trans_a"]), bool(attrs["trans_b"])
        alpha, beta = float(attrs["alpha"]), float(attrs["beta"])
        (m, n) = out_t.shape
        k = a_t.shape[0 if trans_a else 1]
        a_dims, a_strides = (m, k), ((1, m) if trans_a else (k, 1))
        b_dims, b_strides = (k, n), ((1, k) if trans_b else (n, 1))
        out_dims = (m, n)
        with_c = len(ins) == 3 and beta != 0.0
        # alpha A B + beta C = beta ((alpha / beta) A B + C): post-ops scale, add, scale.
        scale = alpha / beta if with_c else alpha
        if scale != 1.0:
            post.append(("linear", scale, 0.0))
        if with_c:
            post.append(("add", _broadcast_md(ins[2].shape, 2, dt)))
            binary.append(2)
            if beta != 1.0:
                post.append(("linear", beta, 0.0))
        constant_b = True
    elif op in ("linear", "fused_linear"):
        rows = math.prod(a_t.shape[:-1])
        k, n = b_t.shape
        a_dims, a_strides = (rows, k), (k, 1)
        b_dims, b_strides = (k, n), (n, 1)
        out_dims = (rows, n)
        c = ins[2]
        if c.size not in (1, n) or (c.size == n != 1 and c.shape[-1] != n):
            raise Refused(f"{op}: a bias of shape {c.shape} is not a row (the CPU's own kernel broadcasts it)")
        bias = onednn.plain((1, 1 if c.size == 1 and n != 1 else n), None, dt)
        if op == "fused_linear":
            if len(ins) == 4:
                post.append(("add", onednn.plain(out_dims, None, dt)))
                binary.append(3)
            post.append((attrs["activation"], float(attrs["alpha"]), float(attrs["beta"])))
        constant_b = True
    else:  # matmul, numpy's: batch dims broadcast
        if b_t.rank == 2:  # (batch..., M, K) @ (K, N): one GEMM over the collapsed rows
            rows = math.prod(a_t.shape[:-1])
            a_dims, b_dims, out_dims = (rows, a_t.shape[-1]), b_t.shape, (rows, b_t.shape[-1])
        else:
            rank = out_t.rank
            a_dims = (1,) * (rank - a_t.rank) + a_t.shape
            b_dims = (1,) * (rank - b_t.rank) + b_t.shape
            out_dims = out_t.shape
        a_strides, b_strides = _row_major(a_dims), _row_major(b_dims)
        constant_b = b_t.rank == 2  # a weight matrix, most likely a constant: worth a layout of its own
    a_md, b_user = onednn.plain(a_dims, a_strides, dt), onednn.plain(b_dims, b_strides, dt)
    out_md = onednn.plain(out_dims, None, dt)
    attr = Attr(post)
    b_md = onednn.any_layout(b_dims, dt) if constant_b else b_user
    pd = onednn.matmul_desc(op, a_md, b_md, bias, out_md, attr)
    impl = onednn.implementation(pd)
    if not impl.startswith(MATMUL_IMPLEMENTATIONS):
        onednn.lib().primitive_desc_destroy(pd)
        raise Refused(f"oneDNN's matmul here is {impl}, which lost to the CPU's own GEMMs (GPT-2 b1 on the 2-core "
                      "AVX2 VM: 1.5-1.7 s against 0.66-0.70 s); its brgemm matmuls (AVX-512 and up) are used")
    args = (ARG_SRC, ARG_WEIGHTS) + ((ARG_BIAS,) if bias is not None else ()) + (ARG_DST,) + attr.binary_args
    prim = Primitive(pd, args, op)
    w_md = prim.mds[ARG_WEIGHTS]
    weights = None if w_md == b_user else onednn.reorder(op, b_user, w_md)
    scratchpad = max(prim.scratchpad_bytes, weights.scratchpad_bytes if weights is not None else 0)
    layout = f" on weights {w_md.format}" if weights is not None else ""
    extras = [p[0] for p in post if p[0] not in ("none",)]
    name = f"oneDNN matmul [{prim.impl}]{layout}" + (f" +{'+'.join(['bias'] * (bias is not None) + extras)}"
                                                      if bias is not None or extras else "")
    return MatmulPlan(prim, bias is not None, tuple(binary), weights, w_md.nbytes if weights else 0, scratchpad,
                      (a_dims, b_dims, out_dims), name)


def matmul_scratch(op: str, attrs: dict, ins, outs) -> tuple[ScratchRequest, ...] | None:
    """The declared scratch of a oneDNN matmul instance, or None where oneDNN does not serve it."""
    plan = matmul_plan(op, attrs, ins, outs)
    if plan is None:
        return None
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    kernel = KernelInfo("onednn_matmul", op, 1, 1, "cpu")
    decls = []
    return _requests(decls, plan, plan.matmul.impl, problem, kernel)


def matmul(op: str, attrs: dict, ins, outs, scratch) -> Callable[..., None] | None:
    """The kernel of a matmul-family instance as a oneDNN matmul primitive, or None where oneDNN
    does not serve it (the CPU's own kernel runs it)."""
    plan = matmul_plan(op, attrs, ins, outs)
    if plan is None:
        return None
    scratch = _bound(scratch, matmul_scratch(op, attrs, ins, outs))
    execute = plan.matmul.executor()
    pad = (address(scratch.buffer("scratchpad")),) if plan.scratchpad_bytes else ()
    weights = _kept_weights(plan.weights.executor() if plan.weights else None, plan.weights_bytes,
                            scratch.buffer("weights") if plan.weights else None, pad)
    has_bias, binary = plan.has_bias, plan.binary
    contiguous = np.ascontiguousarray

    def kernel(*arrays):
        a, b, out = arrays[0], arrays[1], arrays[-1]
        if not a.flags.c_contiguous:
            a = contiguous(a)
        held = [contiguous(arrays[i]) for i in binary]  # held while the primitive reads them
        extra = tuple(address(h) for h in held)
        if has_bias:
            bias = contiguous(arrays[2])
            execute(address(a), weights(b), address(bias), address(out), *extra, *pad)
        else:
            execute(address(a), weights(b), address(out), *extra, *pad)
    kernel.kernel_name = plan.name  # type: ignore[attr-defined]
    kernel.plan = plan  # type: ignore[attr-defined]
    kernel.scratch = scratch  # type: ignore[attr-defined]
    return kernel


# ------------------------------------------------------------------------------------ explain

#: The ops this module serves.
SERVED = frozenset({"conv", "fused_conv", BLOCKED_CONV, "matmul", "gemm", "linear", "fused_linear"})
#: Refused instances explain names one by one, at most.
EXPLAINED_REFUSALS = 8


def cpu_dispatches(compilation, served: frozenset) -> list:
    """The dispatches of ``served`` ops that a compilation placed on CPU devices (what the
    oneDNN report passes explain)."""
    placement = compilation.placement
    return [op for op in compilation.current_program.ops
            if op.kind == "dispatch" and op.name in served and op.outputs
            and placement.value_device.get(op.outputs[0].id, "").startswith("cpu")]


def note_own_kernels(compilation, own: list, kernel: str) -> None:
    """Name in explain, up to :data:`EXPLAINED_REFUSALS`, the ``(op, reason)`` pairs that run on
    the CPU's ``kernel`` ("own kernel", "own float kernel") instead of oneDNN."""
    for op, reason in own[:EXPLAINED_REFUSALS]:
        compilation.notes.append(f"  %{op.outputs[0].name} ({op.name}) runs on the CPU's {kernel}: {reason}")
    if len(own) > EXPLAINED_REFUSALS:
        compilation.notes.append(f"  ... and {len(own) - EXPLAINED_REFUSALS} more on the CPU's {kernel}s")


def report(compilation, target) -> None:
    """Say in explain which conv and matmul dispatches on CPU devices oneDNN runs, and why the
    others run on the CPU's own kernels (the library missing, or a refused instance)."""
    from polyhal.ops import resolve_attrs

    ours = cpu_dispatches(compilation, SERVED)
    if not ours:
        return
    settings = CPUSettings.from_env()
    # Where every instance was refused by its shape, the library was never loaded: nor is it to
    # say so (its version). A library that is missing loads nothing to say why.
    path = onednn.library_path()
    unloaded = settings.onednn and not onednn.asked() and path is not None and path.exists()
    version, why = ("oneDNN (not loaded)", "") if unloaded else onednn.status()
    if version is None:
        compilation.notes.append(f"oneDNN unusable ({why}): the CPU's own kernels run all {len(ours)} conv/matmul "
                                 "dispatches")
        return
    own = []
    timed = settings.onednn_timed
    for op in ours:
        attrs = resolve_attrs(op.name, dict(op.attrs))
        ins, outs = tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs)
        key = _key(op.name, attrs, ins, outs)
        if key in _OUTRUN and timed:
            own.append((op, _OUTRUN[key]))
            continue
        planned = (matmul_plan if op.name in ("matmul", "gemm", "linear", "fused_linear") else conv_plan)(
            op.name, attrs, ins, outs)
        if planned is None:
            own.append((op, _REFUSED.get(key, "a type oneDNN is not asked about")))
    compilation.notes.append(f"{version}: {len(ours) - len(own)} of {len(ours)} conv/matmul dispatches on the CPU "
                             "run as oneDNN primitives")
    note_own_kernels(compilation, own, "own kernel")
