"""The CPU's int8 contractions, ``quantized_conv`` and ``quantized_matmul`` (:mod:`polyhal.ops.quantized`),
as oneDNN int8 primitives (:mod:`polyhal_cpu.onednn`), one per op instance, made when the plan is
compiled.

The quantization parameters are oneDNN 3.2 attributes given at run time: the source's scale and
zero point (one per tensor), the weights' scale (one per tensor or per output channel: mask over
the output-channel dims), the destination's scale and zero point where the result is quantized
(none where it is float32), and the activation an ``eltwise`` post-op, so one primitive computes
``activation(x_scale w_scale sum((x - x_zp) w) + bias) / y_scale + y_zp``, accumulating in int32
and rounding once. The zero points arrive as the operand's type and are widened to the int32
that oneDNN takes, into a buffer made at prepare (no allocation in a call).

Layouts: oneDNN's int8 convs on AVX2 (``jit_uni_int8:avx2``) take channels-last maps and blocked
weights, so the primitive is created on layouts ``any`` (on plain NCHW oneDNN offers only its
reference loop); a map whose layout differs pays a reorder into declared scratch, named in
explain, as the float convs' do (:mod:`polyhal_cpu.onednn_kernels`, whose plumbing this module
shares). Constant weights are reordered once.

Where oneDNN refuses an instance (no implementation, or only its reference one) or is not
usable, the CPU's own float kernels run it (dequantize, ``fused_conv`` / ``fused_linear``,
requantize), and explain names the instance and why (:func:`report`).

A CPU without an int8 dot-product instruction (AVX2, such as the AMD EPYC VM this was first
measured on) has oneDNN multiply int8 with ``vpmaddubsw`` + ``vpmaddwd`` pairs, about half of
what VNNI does, and sum them in int16 (see :func:`report`); with AVX-512 VNNI or AMX (a Sapphire
Rapids Xeon) its primitives sum in int32 and are exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl
from polyhal.ir.types import TensorType

from polyhal_cpu import onednn
from polyhal_cpu.onednn import (ARG_ATTR_SCALES, ARG_ATTR_ZERO_POINTS, ARG_BIAS, ARG_DST, ARG_SRC, ARG_WEIGHTS, Attr,
                                Primitive, Refused, address)
from polyhal_cpu.onednn_kernels import (_REFUSED, _bound, _filter_md, _kept_weights, _key, _planned, _Relayout,
                                        _requests, _row_major, cpu_dispatches, note_own_kernels, single_threaded)
from polyhal_cpu.scratch import array as scratch_array
from polyhal_cpu.table import TABLE, Kernel, Types, frozen

__all__ = ["int8_plan", "report", "registrations"]

_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)
#: The ops this module serves.
SERVED = ("quantized_conv", "quantized_matmul")


@dataclass
class Int8Plan:
    """One quantized contraction as a oneDNN int8 primitive and the reorders around it."""

    primitive: Primitive
    quantized: bool  # the result is int8 / uint8 (dst scale and zero point), else float32
    padded: bool  # x is reordered into a buffer padded with its zero point
    signed: bool  # x is int8, shifted to uint8 (x + 128) for oneDNN
    src: _Relayout | None
    dst: _Relayout | None
    weights: Primitive | None  # None: the primitive takes the weights as they lie
    weights_bytes: int
    scratchpad_bytes: int
    name: str


_PLANS: dict[tuple, Int8Plan | None] = {}


def int8_plan(op: str, attrs: dict, ins, outs) -> Int8Plan | None:
    """The oneDNN plan of a ``quantized_conv`` / ``quantized_matmul`` instance, made once per
    instance and kept; None where oneDNN does not serve it (see :func:`report`)."""
    if not onednn.usable() or any(t.size == 0 for t in (*ins, *outs)):
        return None
    if op == "quantized_conv" and ins[0].rank not in (3, 4, 5):
        return None
    return _planned(_PLANS, _make_plan, op, attrs, ins, outs)


def _attr(attrs: dict, per_channel_mask: int, quantized: bool) -> Attr:
    activation = attrs.get("activation", "none")
    scales = {ARG_SRC: 0, ARG_WEIGHTS: per_channel_mask}
    zero_points = {ARG_SRC: 0}
    if quantized:
        scales[ARG_DST] = 0
        zero_points[ARG_DST] = 0
    return Attr([(activation, float(attrs.get("alpha", 0.0)), float(attrs.get("beta", 0.0)))], scales=scales,
                zero_points=zero_points)


def _runtime_args(quantized: bool, channels: int, per_channel: bool) -> dict:
    """The execution arguments of the runtime scales and zero points, with their descriptors."""
    given = {ARG_ATTR_SCALES | ARG_SRC: onednn.plain((1,), None, _F32),
             ARG_ATTR_SCALES | ARG_WEIGHTS: onednn.plain((channels if per_channel else 1,), None, _F32)}
    if quantized:
        given[ARG_ATTR_SCALES | ARG_DST] = onednn.plain((1,), None, _F32)
    given[ARG_ATTR_ZERO_POINTS | ARG_SRC] = onednn.plain((1,), None, _I32)
    if quantized:
        given[ARG_ATTR_ZERO_POINTS | ARG_DST] = onednn.plain((1,), None, _I32)
    return given


def _make_plan(op: str, attrs: dict, ins, outs) -> Int8Plan:
    loaded = onednn.lib()
    loaded.set_threads()  # a primitive's work split is fixed when it is created
    w = ins[3]
    single_threaded(outs[0].size * (math.prod(w.shape[1:]) if op == "quantized_conv" else w.shape[0]))
    try:
        return _make(op, attrs, ins, outs)
    finally:
        loaded.set_threads()


def _make(op: str, attrs: dict, ins, outs) -> Int8Plan:
    x, w, w_scale, y = ins[0], ins[3], ins[4], outs[0]
    quantized = len(ins) == 8
    per_channel = w_scale.size > 1
    # int8 x is given to oneDNN as uint8 x + 128 (zero point + 128): on AVX2 without VNNI its
    # int8-source primitives halve the weights (oneDNN's scale adjustment), which measured 2-6
    # steps off; its uint8 ones are exact.
    signed = x.dtype == np.int8
    x = TensorType(x.shape, np.dtype(np.uint8))
    if op == "quantized_conv":
        group = int(attrs["group"])
        x_dims, y_dims = x.shape, y.shape
        x_strides, y_strides = _row_major(x_dims), _row_major(y_dims)
        w_dims, w_strides = _filter_md(w, group, False)
        n = len(x_dims) - 2
        strides = [int(v) for v in attrs.get("strides") or [1] * n]
        pads = [int(v) for v in attrs.get("pads") or [0] * (2 * n)]
        dilations = [int(v) - 1 for v in attrs.get("dilations") or [1] * n]
        mask = (0b11 if group > 1 else 0b1) if per_channel else 0  # the output channels: (g, M/g) grouped
        channels = w.shape[0]
    else:
        # A matmul as a 1x1 conv on channels-last maps: (rows, K) row-major is (1, K, rows, 1)
        # nhwc, so neither operand moves. oneDNN's int8 matmul on AVX2 (gemm:jit) multiplies
        # uint8 by int8 with vpmaddubsw, whose int16 sums saturate (measured: 81102 for 83109);
        # its int8 convs there do not.
        rows, k, channels = math.prod(x.shape[:-1]), x.shape[-1], w.shape[1]
        x_dims, x_strides = (1, k, rows, 1), (rows * k, 1, k, k)
        y_dims, y_strides = (1, channels, rows, 1), (rows * channels, 1, channels, channels)
        w_dims, w_strides = (channels, k, 1, 1), (1, channels, 1, 1)
        n, group, strides, pads, dilations = 2, 1, [1, 1], [0, 0, 0, 0], [0, 0]
        mask = 0b1 if per_channel else 0
    k_dims = w_dims[len(w_dims) - n:]
    pad_r = [(y_dims[2 + i] - 1) * strides[i] + (k_dims[i] - 1) * (dilations[i] + 1) + 1 - x_dims[2 + i] - pads[i]
             for i in range(n)]
    # ONNX pads x with its zero point (a real 0); oneDNN pads with 0 whatever the zero point
    # (measured). A padded conv reads x from a buffer of the padded size, filled with the zero
    # point, into whose interior x is reordered: the conv itself pads nothing.
    padded = any(pads[:n]) or any(p > 0 for p in pad_r)
    src_dims = x_dims
    if padded:
        src_dims = (*x_dims[:2], *(x_dims[2 + i] + pads[i] + max(pad_r[i], 0) for i in range(n)))
        conv_pads, conv_pad_r = [0] * n, [min(p, 0) for p in pad_r]
    else:
        conv_pads, conv_pad_r = pads[:n], pad_r
    attr = _attr(attrs, mask, quantized)
    x_user, y_user = onednn.plain(x_dims, x_strides, x.dtype), onednn.plain(y_dims, y_strides, y.dtype)
    w_user = onednn.plain(w_dims, w_strides, w.dtype)
    bias = onednn.plain((channels,), None, _F32)
    tries = [(x_user, y_user)] if op == "quantized_matmul" else []
    tries.append((onednn.any_layout(src_dims, x.dtype), onednn.any_layout(y_dims, y.dtype)))
    for x_md, y_md in tries:
        try:
            pd = onednn.conv_desc(op, x_md, onednn.any_layout(w_dims, w.dtype), bias, y_md, strides, dilations,
                                  conv_pads, conv_pad_r, attr)
            break
        except Refused as exc:
            refused = exc
    else:
        raise refused
    given = _runtime_args(quantized, channels, per_channel)
    args = (ARG_SRC, ARG_WEIGHTS, ARG_BIAS, ARG_DST, *given)
    prim = Primitive(pd, args, op, given)
    src_md, dst_md, w_md = prim.mds[ARG_SRC], prim.mds[ARG_DST], prim.mds[ARG_WEIGHTS]
    rank = len(x_dims)
    chosen_x, chosen_y = onednn.describe(src_md, rank), onednn.describe(dst_md, rank)
    plain_name = "nchw" if rank == 4 and op == "quantized_conv" else "plain"
    src = dst = None
    if padded:
        window = onednn.submemory(src_md, x_dims, (0, 0, *pads[:n]))
        src = _Relayout("src", onednn.reorder(op, x_user, window), src_md.nbytes,
                        f"oneDNN reorder of the {x.dtype} input {plain_name} -> {chosen_x}, padded with its zero "
                        f"point, before the int8 {op[10:]} [{prim.impl}]")
    elif src_md != x_user:
        src = _Relayout("src", onednn.reorder(op, x_user, src_md), src_md.nbytes,
                        f"oneDNN reorder of the {x.dtype} input {plain_name} -> {chosen_x} before the int8 "
                        f"{op[10:]} [{prim.impl}]")
    if dst_md != y_user:
        dst = _Relayout("dst", onednn.reorder(op, dst_md, y_user), dst_md.nbytes,
                        f"oneDNN int8 {op[10:]} result in {chosen_y} [{prim.impl}], reordered -> {plain_name}")
    weights = None if w_md == w_user else onednn.reorder(op, w_user, w_md)
    scratchpad = max([prim.scratchpad_bytes] + [r.primitive.scratchpad_bytes for r in (src, dst) if r]
                     + ([weights.scratchpad_bytes] if weights is not None else []))
    reorders = ([f"{plain_name}->{chosen_x}" + " padded" * padded] * bool(src)
                + [f"{chosen_y}->{plain_name}"] * bool(dst))
    activation = attrs.get("activation", "none")
    name = (f"oneDNN int8 {op[10:]} [{prim.impl}] {x.dtype}->{y.dtype}"
            + (" per-channel" if per_channel else "") + (f" +{activation}" if activation != "none" else "")
            + (f"; reorders {', '.join(reorders)}" if reorders else ""))
    return Int8Plan(prim, quantized, padded, signed, src, dst, weights, w_md.nbytes if weights else 0, scratchpad, name)


def _scratch(device, op: str, attrs: dict, ins: Types, outs: Types):
    """The declared scratch of a oneDNN int8 instance (reordered maps and weights, the
    scratchpad); none where the CPU's own kernels run it."""
    plan = int8_plan(op, attrs, ins, outs)
    if plan is None:
        return ()
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    kernel = KernelInfo("onednn_int8", op, 1, 1, "cpu")
    decls = [ScratchDecl(r.name, shared=True, per_launch=r.nbytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                         purpose=r.purpose) for r in (plan.src, plan.dst) if r is not None]
    if plan.signed:
        decls.append(ScratchDecl("unsigned", shared=True, per_launch=ins[0].size, spaces=(MemorySpace.GLOBAL,),
                                 alignment=64, purpose="the int8 input + 128, as uint8 (oneDNN's uint8-source "
                                                       "primitives are exact on every CPU)"))
    return _requests(decls, plan, plan.primitive.impl, problem, kernel)


def _onednn_kernel(op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel | None:
    plan = int8_plan(op, attrs, ins, outs)
    if plan is None:
        return None
    scratch = _bound(scratch, _scratch(None, op, attrs, ins, outs))
    execute = plan.primitive.executor()

    def buf(name: str) -> np.ndarray:
        return scratch_array(scratch, name, np.uint8, (scratch.buffer(name).nbytes,))

    pad = (address(buf("scratchpad")),) if plan.scratchpad_bytes else ()
    weights = _kept_weights(plan.weights.executor() if plan.weights else None, plan.weights_bytes,
                            buf("weights") if plan.weights else None, pad)
    src_in = plan.src.primitive.executor() if plan.src else None
    src_at = address(buf("src")) if plan.src else 0
    dst_out = plan.dst.primitive.executor() if plan.dst else None
    dst_at = address(buf("dst")) if plan.dst else 0
    zero_points = np.zeros(2, _I32)  # x's and y's, widened to oneDNN's int32 at each call
    zx_at, zy_at = address(zero_points), address(zero_points) + 4
    quantized = plan.quantized
    # The padded source's border holds x's zero point: filled again when the zero point changes.
    border = buf("src") if plan.padded else None
    filled = [None]
    contiguous = np.ascontiguousarray
    unsigned = scratch_array(scratch, "unsigned", np.uint8, ins[0].shape) if plan.signed else None
    shift = 128 if plan.signed else 0
    xor = np.bitwise_xor

    # Operand addresses, looked up again only when another array comes (a plan hands a kernel
    # the same arrays every run; __array_interface__ costs microseconds a call).
    seen: list = [None] * 9
    addresses = [0] * 9

    def at(i: int, a: np.ndarray) -> int:
        if seen[i] is not a:
            seen[i], addresses[i] = a, address(a)
        return addresses[i]

    def weights_at(w: np.ndarray) -> int:  # constant weights: the kept reordered copy's address
        if seen[6] is w:
            return addresses[6]
        found = weights(w)
        if frozen(w):
            seen[6], addresses[6] = w, found
        return found

    def kernel(x, x_scale, x_zp, w, w_scale, bias, *rest):
        out = rest[-1]
        if not x.flags.c_contiguous:
            x = contiguous(x)
        zx = int(x_zp.reshape(-1)[0]) + shift
        if unsigned is not None:
            xor(x.view(np.uint8), 0x80, out=unsigned)  # x + 128, modulo 256
            x = unsigned
        if border is not None and filled[0] != zx:
            border.fill(zx)
            filled[0] = zx
        if src_in is not None:
            src_in(at(0, x), src_at, *pad)
            xa = src_at
        else:
            xa = at(0, x)
        da = dst_at if dst_out is not None else at(1, out)
        zero_points[0] = zx
        # (scales and bias are scalars or 1-D: contiguous as they come)
        scales = (at(2, x_scale), at(3, w_scale))
        if quantized:
            zero_points[1] = rest[1].reshape(-1)[0]
            execute(xa, weights_at(w), at(4, bias), da, *scales, at(5, rest[0]), zx_at, zy_at, *pad)
        else:
            execute(xa, weights_at(w), at(4, bias), da, *scales, zx_at, *pad)
        if dst_out is not None:
            dst_out(da, at(1, out), *pad)
    kernel.kernel_name = plan.name  # type: ignore[attr-defined]
    kernel.plan = plan  # type: ignore[attr-defined]  (the primitives live as long as the kernel)
    kernel.scratch = scratch  # type: ignore[attr-defined]  (so does its scratch: it runs on addresses)
    return kernel


def _own_kernel(device, op: str, attrs: dict, ins: Types, outs: Types) -> Kernel:
    """The CPU's own kernel of an instance oneDNN does not serve: x dequantized to float32, the
    float ``fused_conv`` / ``fused_linear`` kernel (weights dequantized once while they are the
    same constant), the result requantized with numpy (round half to even, saturate)."""
    x, w, y = ins[0], ins[3], outs[0]
    epilogue = {k: attrs[k] for k in ("activation", "alpha", "beta")}
    if op == "quantized_conv":
        conv = {k: attrs[k] for k in ("strides", "pads", "dilations", "group")}
        float_op, float_attrs = "fused_conv", {**conv, **epilogue}
        float_ins = (TensorType(x.shape, _F32), TensorType(w.shape, _F32), TensorType((w.shape[0],), _F32))
        channel_shape = (-1,) + (1,) * (w.rank - 1)
    else:
        float_op, float_attrs = "fused_linear", epilogue
        float_ins = (TensorType(x.shape, _F32), TensorType(w.shape, _F32), TensorType((w.shape[1],), _F32))
        channel_shape = (-1,)
    contract = TABLE.prepare(device, float_op, float_attrs, float_ins, (TensorType(y.shape, _F32),))
    quantized = len(ins) == 8
    info = np.iinfo(y.dtype) if quantized else None
    real = np.empty(y.shape, _F32)
    xf = np.empty(x.shape, _F32)
    kept: list = [None, None]

    def dequantized_weights(w, w_scale):
        if kept[0] is w and frozen(w_scale):
            return kept[1]
        wf = w.astype(_F32) * w_scale.reshape(channel_shape if w_scale.size > 1 else ())
        if frozen(w) and frozen(w_scale):
            kept[0], kept[1] = w, wf
        return wf

    def kernel(x, x_scale, x_zp, w, w_scale, bias, *rest):
        out = rest[-1]
        np.subtract(x, x_zp.reshape(()).astype(_F32), out=xf, dtype=_F32)
        np.multiply(xf, x_scale.reshape(()), out=xf)
        contract(xf, dequantized_weights(w, w_scale), bias, real if quantized else out)
        if quantized:
            np.divide(real, rest[0].reshape(()), out=real)
            np.rint(real, out=real)
            np.add(real, rest[1].reshape(()).astype(_F32), out=real)
            np.clip(real, info.min, info.max, out=real)
            np.copyto(out, real, casting="unsafe")
    kernel.kernel_name = f"CPU's own float {float_op} between numpy dequantize / requantize"  # type: ignore[attr-defined]
    return kernel


#: The largest |weight| that cannot saturate oneDNN's int16 pair sums on a CPU without VNNI,
#: whatever the uint8 input: 2 * 255 * 64 = 32640 <= 32767.
SAFE_WEIGHT = 64


def _has_vnni(impl: str) -> bool:
    return "vnni" in impl or "amx" in impl


@TABLE.register(*SERVED, scratch=_scratch)
def _quantized(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """A oneDNN int8 primitive where the library serves the instance, else the CPU's own kernels.

    An int8 input shifted to uint8 (x + 128, see :func:`_make`) is large where x is near its zero
    point, so on a CPU without VNNI its pair sums saturate wherever weights exceed
    :data:`SAFE_WEIGHT` (27 steps off on onnxruntime's symmetric-int8 CNN, where onnxruntime's own
    int8 x int8 kernel is exact): such an instance runs on the CPU's own float kernels (exact),
    decided on the first call, which sees the weights."""
    fast = _onednn_kernel(op, attrs, ins, outs, scratch)
    if fast is None:
        return _own_kernel(device, op, attrs, ins, outs)
    if not fast.plan.signed or _has_vnni(fast.plan.primitive.impl):
        return fast
    exact = _own_kernel(device, op, attrs, ins, outs)
    chosen: list = [None, None]  # the weights it was chosen for, the kernel

    def kernel(*arrays):
        w = arrays[3]
        if chosen[0] is not w:
            chosen[0] = w
            chosen[1] = fast if int(np.abs(w.astype(np.int16)).max(initial=0)) <= SAFE_WEIGHT else exact
        chosen[1](*arrays)
    kernel.kernel_name = f"{fast.kernel_name} where the weights are 7-bit, else {exact.kernel_name}"  # type: ignore[attr-defined]
    kernel.plan, kernel.scratch = fast.plan, fast.scratch  # type: ignore[attr-defined]
    return kernel


# ------------------------------------------------------------------------------------ explain

def report(compilation, target) -> None:
    """Say in explain which quantized contractions on CPU devices run as oneDNN int8 primitives,
    and why the others run on the CPU's own float kernels."""
    from polyhal.ops import resolve_attrs

    ours = cpu_dispatches(compilation, SERVED)
    if not ours:
        return
    version, why = onednn.status()
    if version is None:
        compilation.notes.append(f"oneDNN unusable ({why}): the CPU's own float kernels run all {len(ours)} "
                                 "quantized contractions (dequantized, then requantized)")
        return
    own, impls = [], set()
    for op in ours:
        attrs = resolve_attrs(op.name, dict(op.attrs))
        ins, outs = tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs)
        plan = int8_plan(op.name, attrs, ins, outs)
        if plan is not None:
            impls.add(plan.primitive.impl)
            continue
        why = _REFUSED.get(_key(op.name, attrs, ins, outs))
        if why is None:
            why = ("an empty tensor" if any(t.size == 0 for t in (*ins, *outs))
                   else f"{ins[0].rank - 2} spatial dims (oneDNN's convolutions take 1 to 3)")
        own.append((op, why))
    compilation.notes.append(f"{version}: {len(ours) - len(own)} of {len(ours)} quantized contractions on the CPU "
                             "run as oneDNN int8 primitives")
    if impls and not any(_has_vnni(i) for i in impls):
        compilation.notes.append(
            "  this CPU has no int8 dot-product instruction (VNNI): oneDNN sums uint8 x int8 products in pairs into "
            "int16, which saturate where weights beyond 64 meet large inputs, as onnxruntime's uint8 x int8 kernels "
            "do here (7-bit weights, onnxruntime's reduce_range, are exact); int8 inputs (shifted to uint8 for "
            "oneDNN) with such weights run on the CPU's own float kernels instead")
    note_own_kernels(compilation, own, "own float kernel")
