"""CPU kernels of :mod:`polyhal.ops.nn` but the convolution family (:mod:`polyhal_cpu.conv_kernels`):
linear, scale_shift, and attention (a group of heads at a time, its scores in planned scratch; see the notes
above its kernel).
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from polyhal.hal.scratch import MemorySpace, ScratchDecl
from polyhal_cpu import blas, native, onednn_kernels, onednn_normalization, parallel
from polyhal_cpu import queue_layout as layout
from polyhal_cpu.blas import blas_layout
from polyhal_cpu.scratch import array as scratch_array
from polyhal_cpu.table import TABLE, Kernel, Types, float16_via_float32, numpy_activation


def _linear_scratch(device, op: str, attrs: dict, ins: Types, outs: Types):
    """The oneDNN matmul's scratch where it serves the instance (the CPU's own GEMMs have none)."""
    return onednn_kernels.matmul_scratch(op, attrs, ins, outs) or ()


@TABLE.register("linear", "fused_linear", scratch=_linear_scratch)
def _linear_family(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """A oneDNN matmul primitive (bias, residual, activation as post-ops) where the library serves
    the instance, else the CPU's own GEMMs."""
    own = _linear if op == "linear" else _fused_linear
    return onednn_kernels.matmul(op, attrs, ins, outs, scratch) or own(device, op, attrs, ins, outs, scratch)


#: Rows from which a bias row is added by the compiled loop (fewer: numpy's one add costs less
#: than the loop's call).
_BIAS_LOOP_ROWS = 8


@float16_via_float32
def _linear(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    x_type, w_type, _ = ins
    rows = math.prod(x_type.shape[:-1])
    x2, o2 = (rows, w_type.shape[0]), (rows, w_type.shape[1])
    matmul, dot, add, copyto = np.matmul, np.dot, np.add, np.copyto
    gemm = blas.gemm(x_type.dtype, rows * w_type.shape[1])  # None: numpy's matmul, then the bias
    # numpy adds a bias row one short inner loop per row; the fused loop is ~3x faster.
    add_rows = native.add_rows if native.available(x_type.dtype) else None
    split = parallel.GemmSplit(rows, w_type.shape[1], w_type.shape[0], queued=x_type.dtype == np.float32)

    def product(xm, w, b, o):
        # With BLAS's own GEMM the bias rows go in first and the product accumulates onto them
        # (beta = 1): no pass over the result after it, and none inside BLAS to clear it.
        if gemm is not None:
            copyto(o, b)
            if gemm(xm, w, o, 1.0, 1.0):
                return
        if o.flags.c_contiguous:  # np.dot: the same BLAS call as matmul, ~1.5 us less to reach it
            dot(blas_layout(xm), blas_layout(w), out=o)
        else:
            matmul(blas_layout(xm), blas_layout(w), out=o)
        if add_rows is not None and len(o) >= _BIAS_LOOP_ROWS and b.shape == o.shape[1:] and b.flags.c_contiguous:
            add_rows(o, b)
        else:
            add(o, b, out=o)

    def kernel(x, w, b, out, residual=None, act=0, alpha=0.0, beta=0.0):
        # One GEMM over all leading dims (out is C-contiguous, so its reshape is a view; numpy
        # copies a strided x), in blocks of rows or columns (the bias cut alike), each block
        # finished (bias, product, residual and activation) in compiled code on the pool's
        # GEMM queue where it can be, else through numpy and ctypes (no residual or activation).
        xm, o = x.reshape(x2), out.reshape(o2)
        table = None if split.small else split.table(xm, w, o, 1.0, 1.0, b, residual, act, alpha, beta)
        if table is not None:
            parallel.run_gemms(table)
            return True
        if residual is not None or act:
            return False
        if len(split) == 1:
            product(xm, w, b, o)
            return True
        bb = np.broadcast_to(b, o2)
        if split.axis == 0:
            parallel.run([partial(product, xm[lo:hi], w, bb[lo:hi], o[lo:hi]) for lo, hi in split.bounds])
        else:
            parallel.run([partial(product, xm, w[:, lo:hi], bb[:, lo:hi], o[:, lo:hi]) for lo, hi in split.bounds])
        return True
    return kernel


@float16_via_float32
def _fused_linear(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """``linear``'s kernel (the bias added by BLAS's beta), then one pass for the residual and
    the activation: a compiled loop for float32, numpy's ufuncs otherwise."""
    product = _linear(device, "linear", {}, ins[:3], outs, None)
    activation, alpha, beta = attrs["activation"], float(attrs["alpha"]), float(attrs["beta"])
    has_residual = len(ins) == 4
    n = outs[0].shape[-1] if outs[0].rank else 1
    shape2d = (outs[0].size // max(n, 1), n)
    # A small product (a scikit-learn model at batch 1) finishes with numpy's ufuncs: a compiled
    # loop's call costs more than they do on a few elements.
    small = math.prod(ins[0].shape[:-1]) * ins[1].shape[0] * ins[1].shape[1] <= parallel.SMALL_PRODUCT
    if native.available(outs[0].dtype) and not small:
        act, zero = native.activation_code(activation), np.zeros(1, outs[0].dtype)
        pieces = [rs for rs, _ in parallel.grid(shape2d[0], 1, n, factor=2)]

        def kernel(x, w, b, *rest):
            out = rest[-1]
            r = np.ascontiguousarray(rest[0]).reshape(shape2d) if has_residual else None
            if product(x, w, b, out, r, act, alpha, beta):  # all in the GEMM's pieces
                return
            product(x, w, b, out)
            o = out.reshape(shape2d)
            parallel.run([partial(native.epilogue, o[rs], zero, None if r is None else r[rs], act, alpha, beta)
                          for rs in pieces])
        return kernel
    finish = numpy_activation(device, activation, alpha, beta, outs[0])

    def kernel(x, w, b, *rest):
        out = rest[-1]
        product(x, w, b, out)
        if has_residual:
            out += rest[0]
        if finish is not None:
            finish(out)
    return kernel


# ------------------------------------------------------------------------------------ attention
#
# softmax(scale q k^T [+ mask]) v for a group of heads at a time (as many as fit _ATTENTION_GROUP
# score elements; one head at least), through one (heads, Lq, Lk) buffer:
#  * masked_attention adds the mask, times log2(e), to the scores once they are out of the
#    GEMM (one pass; a mask of -3.4e38 overflows to -inf there and gives weight 0); a row the
#    mask leaves without a finite score is computed again on its own in natural units, where
#    the mask stays finite, as the unfused ops compute it;
#  * the scores come out of the GEMMs in log2 units (q is scaled by scale * log2(e)), so the
#    exponentials are exp2, which numpy computes ~1.7x faster than exp, and no pass over the
#    scores scales them;
#  * softmax is shift-invariant, and the shift only has to keep exp2 finite and the row sums
#    away from underflow. A row whose sum falls below 2**-10 (its own maximum is far below
#    the shift) or is not finite (overflow, inf, nan) is computed again on its own with its
#    own maximum, so any shift gives the right result and the shift is chosen from a sample,
#    every 8th row of the group's scores: when the sample's largest score lies in
#    [0, maxexp/2] the scores are used as they are (no pass), else its maximum is subtracted;
#  * exp2 of scores below 2**minexp (subnormal results, or underflow to 0, e.g. of -inf)
#    runs 10-300x slower in numpy, so when such scores show up in the sample (dense regions
#    cannot hide from it; a few elsewhere cost little) the scores are clamped to it first (a
#    weight of at most 2**-116 relative to the row's sum instead of 0);
#  * the weights are never normalised: the row sums divide the (Lq, Dv) result of the second
#    GEMM instead of the (Lq, Lk) weights;
#  * with numpy's OpenBLAS reachable (polyhal_cpu.blas), each GEMM is one strided batched call
#    over the group's heads, reading q, k^T (through the transpose flag) and v in place and
#    scaling by alpha: one call instead of numpy's per-head calls (4 heads of 256 x 32 on two
#    BLAS threads: scores 240 -> ~100 µs, context 156 -> ~105 µs). A group's heads are cut into
#    blocks run in parallel (polyhal_cpu.parallel), each through its own part of the scores. For
#    float32 the shift, exp2 and row sums are one fused loop, as is the final row scaling
#    (polyhal_cpu.native), and the score block is planned scratch, not allocated per call;
#  * otherwise the scores' GEMM runs on a row-major copy of the scaled q and a row-major (D, Lk) copy of
#    each head's k^T, one block of query rows at a time (_ATTENTION_SCORE_MACS): with a short
#    contraction (D = 32 in a transformer block) OpenBLAS runs these blocks ~1.5x faster than
#    the whole (Lq, Lk) product, on strided operands (the heads of a (batch, seq, heads * d)
#    projection) ~2x slower (measured on a 2-core VM). The second GEMM (contraction Lk) stays
#    whole: in blocks it was slower. k is transposed tile by tile (_TRANSPOSE_TILE columns):
#    numpy's transposing copy of a whole head strides through memory, ~2x slower.

_LOG2E = 1.4426950408889634
_MIN_ROW_SUM = 2.0 ** -10
#: Score elements per group of heads (1 MiB of float32: the group's passes stay in L2).
_ATTENTION_GROUP = 1 << 18
#: Multiply-adds per head of one block of the scores' GEMM (rows * Lk * D; 16 rows at least).
_ATTENTION_SCORE_MACS = 1 << 19
#: Columns of k per transposing copy (64 rows of a (seq, heads * d) projection stay in L1).
_TRANSPOSE_TILE = 64


def _attention_shape(ins: Types) -> tuple[int, int, int, int]:
    """(heads per group, Lq, Lk, bytes per score element) of an attention's score block."""
    q_type, v_type = ins[0], ins[2]
    lq, lk = q_type.shape[-2], v_type.shape[-2]
    group = max(1, min(math.prod(q_type.shape[:-2]), _ATTENTION_GROUP // max(lq * lk, 1)))
    return group, lq, lk, max(q_type.dtype.itemsize, 4)  # float16 runs as float32


def _scores_bytes(problem, _workgroup_size: int) -> int:
    group, lq, lk, item = _attention_shape(problem.in_types)
    return group * lq * lk * item


#: Elements per (image, channel) row from which scale_shift takes the compiled loop, a row at a
#: time; shorter rows ((N, C) or tiny planes) go to numpy's broadcasting ufuncs.
SCALE_SHIFT_ROW = 16
#: Nanoseconds per element of scale_shift's compiled loop on one thread, by activation, to
#: estimate its time (:func:`parallel.queue_parts`): what it took in cache plus 0.1 for an input
#: last written by the kernels before it (L3, or the other core's cache). Measured on a 2-core
#: AVX-512 VM: in cache (256x28x28) 0.10 with none or a ReLU (in the loop's own pass), 0.14 with
#: clip and the hard ones, 0.30 sigmoid and silu, 0.34 gelu_tanh, 0.74 gelu; in DenseNet-121 at
#: batch 1 (ReLU) 0.15-0.3 on one thread (56x56x256 120-200 us). Its pieces take 15 us at least
#: (:data:`parallel.GEMM_QUEUE_PIECE_US`), so DenseNet's are cut from ~75k elements (28x28 from
#: 96 channels, 14x14 from 384); its 7x7 ones stay whole (cut, they took 5-10% longer). In the
#: model, 0.1 and 0.35 for the ReLU did as well as 0.2; cutting none, or all, took longer.
SCALE_SHIFT_NS = {"none": 0.2, "relu": 0.2, "clip": 0.25, "hard_sigmoid": 0.25, "hard_swish": 0.25, "sigmoid": 0.4,
                  "silu": 0.4, "gelu_tanh": 0.45, "gelu": 0.85}


def _scale_shift_scratch(device, op: str, attrs: dict, ins: Types, outs: Types):
    """The oneDNN primitive's scratchpad where it runs the instance (the library tier)."""
    return onednn_normalization.scratch(op, attrs, ins, outs) or ()


@TABLE.register("scale_shift", scratch=_scale_shift_scratch)
@float16_via_float32
def _scale_shift(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    # without the compiled loops: one oneDNN binary primitive with post-ops (one pass over x;
    # numpy's passes below are three)
    primitive = onednn_normalization.scale_shift(attrs, ins, outs, scratch)
    if primitive is not None:
        return primitive
    x_type = ins[0]
    activation, alpha, beta = attrs["activation"], float(attrs["alpha"]), float(attrs["beta"])
    n, c = x_type.shape[:2]
    plane = math.prod(x_type.shape[2:])
    if native.available(x_type.dtype) and native.gemm_queue() is not None and plane >= SCALE_SHIFT_ROW:
        # blocks of (image, channel) rows on the pool's compiled queue (handed out by run(), a
        # piece cost ~80 us on a 2-core VM, as much as a batch-1 DenseNet's whole scale_shift)
        us = n * c * plane * SCALE_SHIFT_NS.get(activation, max(SCALE_SHIFT_NS.values())) / 1000
        table = _scale_shift_table(n, c, plane, parallel.queue_parts(us), native.activation_code(activation), alpha,
                                   beta)
        contiguous, run_gemms = np.ascontiguousarray, parallel.run_gemms

        def kernel(x, scale, shift, out):
            run_gemms(table(contiguous(x), contiguous(scale), contiguous(shift), out))
        return kernel
    per_channel = (c,) + (1,) * (x_type.rank - 2)
    act_numpy = numpy_activation(device, activation, alpha, beta, outs[0])

    def kernel(x, scale, shift, out):
        np.multiply(x, scale.reshape(per_channel), out=out)
        out += shift.reshape(per_channel)
        if act_numpy is not None:
            act_numpy(out)
    return kernel


def _scale_shift_table(n: int, c: int, plane: int, parts: int, act: int, alpha: float,
                       beta: float) -> parallel.PieceTable:
    """scale_shift's pieces as descriptors of the compiled GEMM queue (queue_layout's
    KIND_SCALE_SHIFT; operands x, scale, shift, out): ``parts`` blocks of its n * c rows of
    ``plane`` elements (fewer where there are fewer rows)."""
    bounds = parallel.blocks(n * c, parts)
    descs = np.zeros((len(bounds), layout.G_FIELDS), np.int64)
    descs[:, layout.G_KIND], descs[:, layout.G_N], descs[:, layout.G_K] = layout.KIND_SCALE_SHIFT, plane, c
    descs[:, layout.G_M] = [hi - lo for lo, hi in bounds]
    descs[:, layout.G_LDA] = [lo % c for lo, _ in bounds]
    descs[:, layout.G_ACT] = act
    descs[:, layout.G_ACT_ALPHA], descs[:, layout.G_ACT_BETA] = parallel.float_bits(alpha), parallel.float_bits(beta)
    offsets, whole = [lo * plane * 4 for lo, _ in bounds], [0] * len(bounds)
    return parallel.PieceTable(descs, [(layout.G_A, 0, offsets), (layout.G_B, 1, whole), (layout.G_BIAS, 2, whole),
                                       (layout.G_C, 3, offsets)])


@TABLE.register("attention", "masked_attention", scratch=[
    ScratchDecl("scores", shared=True, per_launch=_scores_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="one group of heads' attention weights (Lq x Lk each)")])
@float16_via_float32
def _attention(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    q_type, k_type, v_type = ins[:3]
    dtype = q_type.dtype
    lq, d = q_type.shape[-2:]
    lk, dv = v_type.shape[-2:]
    heads = math.prod(q_type.shape[:-2])
    scores_shape = q_type.shape[:-1] + (lk,)
    group = _attention_shape(ins)[0]
    block = max(1, min(lq, max(16, _ATTENTION_SCORE_MACS // max(lk * d, 1))))
    scale = 1.0 / math.sqrt(d) if attrs["scale"] is None else float(attrs["scale"])
    factor = np.asarray(scale * _LOG2E, dtype)
    scale_c, log2e = np.asarray(scale, dtype), np.asarray(_LOG2E, dtype)
    info = np.finfo(dtype)
    floor, top = float(info.minexp), float(info.maxexp // 2)  # float32: -126, 64
    floor_c, min_sum = np.asarray(floor, dtype), np.asarray(_MIN_ROW_SUM, dtype)
    ones = np.ones(lk, dtype)
    gemv = lk <= 4096  # longer rows: numpy's pairwise sum (as fast, more accurate)
    matmul, multiply, subtract, exp2, copyto = np.matmul, np.multiply, np.subtract, np.exp2, np.copyto
    maximum, hi_of, lo_of, add_reduce = np.maximum, np.maximum.reduce, np.minimum.reduce, np.add.reduce

    batched = blas.batched_matmul(dtype)
    alpha = float(factor)
    fused = native.available(dtype)
    scale_rows = native.scale_rows if fused else None
    exp2_rows = native.exp2_shifted_rows if fused else None

    def scores(q3, k3, s):
        """s = factor * q3 @ k3^T: one batched BLAS call on the operands as they lie, or numpy's
        GEMMs on a scaled copy of q and a row-major copy of k^T, a block of rows at a time."""
        if batched is not None and batched(q3, k3.transpose(0, 2, 1), s, alpha):
            return
        qs = multiply(q3, factor, order="C")
        kt = np.empty((len(k3), d, lk), dtype)
        for c0 in range(0, lk, _TRANSPOSE_TILE):
            copyto(kt[:, :, c0:c0 + _TRANSPOSE_TILE], k3[:, c0:c0 + _TRANSPOSE_TILE].transpose(0, 2, 1))
        for r0 in range(0, lq, block):
            matmul(qs[:, r0:r0 + block], kt, out=s[:, r0:r0 + block])

    buf = scratch_array(scratch, "scores", dtype, (group, lq, lk))
    # a group's heads in blocks run in parallel, each through its own part of the score block
    head_blocks = parallel.blocks(group, parallel.gemm_pieces(lq, lk, d + dv, batch=group))

    def head_block(q3, k3, v3, o3, m3, m3_2, g0, g1, s):
        """Heads g0..g1 through score block ``s``."""
        scores(q3[g0:g1], k3[g0:g1], s)
        if m3_2 is not None:
            np.add(s, m3_2[g0:g1], out=s)
        sample = s[:, ::8]
        hi = float(hi_of(sample, axis=None))
        if math.isfinite(hi):
            shift = 0.0 if 0.0 <= hi <= top else hi
            if exp2_rows is not None:  # one fused pass: shift, exp2 (no subnormals), row sums
                sums = np.empty((g1 - g0, lq), dtype)
                exp2_rows(s.reshape(-1, lk), shift, sums.reshape(-1))
            else:
                if shift:
                    subtract(s, np.asarray(shift, dtype), out=s)
                if float(lo_of(sample, axis=None)) < floor:
                    maximum(s, floor_c, out=s)
                exp2(s, out=s)
                sums = matmul(s, ones) if gemv else add_reduce(s, axis=2)
            ok = float(lo_of(sums, axis=None)) >= _MIN_ROW_SUM and math.isfinite(float(hi_of(sums, axis=None)))
        else:  # an inf or nan among the scores: every row on its own
            sums, ok = np.zeros((g1 - g0, lq), dtype), False
        if not ok:
            redo = ~((sums >= min_sum) & (sums < np.inf))  # nan too
            for h in np.flatnonzero(redo.any(axis=1)).tolist():
                rows = np.flatnonzero(redo[h])
                r = matmul(q3[g0 + h][rows], k3[g0 + h].T)
                multiply(r, scale_c, out=r)  # in natural units here: a finite mask stays finite
                if m3 is not None:
                    np.add(r, m3[g0 + h][rows], out=r)
                subtract(r, hi_of(r, axis=1, keepdims=True), out=r)
                multiply(r, log2e, out=r)
                maximum(r, floor_c, out=r)  # nan stays nan
                exp2(r, out=r)
                s[h, rows] = r
                sums[h, rows] = add_reduce(r, axis=1)
        og, vg = o3[g0:g1], v3[g0:g1]
        if batched is None or not batched(s, vg, og):
            matmul(s, vg, out=og)
        if scale_rows is not None:  # rows of (lq, dv) divided by their sums, one fused loop
            scale_rows(og.reshape((g1 - g0) * lq, dv), np.ascontiguousarray(sums).reshape(-1))
        else:
            np.reciprocal(sums, out=sums)
            multiply(og, sums.reshape(g1 - g0, lq, 1), out=og)

    queued = _QueuedAttention(group, lq, lk, d, dv, alpha) if fused and op == "attention" else None

    def kernel(q, k, v, *rest):
        out = rest[-1]
        q3, k3 = q.reshape(heads, lq, d), k.reshape(heads, lk, d)  # views where the strides allow
        v3, o3 = v.reshape(heads, lk, dv), out.reshape(heads, lq, dv)
        if queued is not None:
            tables = [queued.table(q3, k3, v3, o3, buf, g0, min(heads, g0 + group)) for g0 in range(0, heads, group)]
            if all(t is not None for t in tables):
                for t in tables:
                    parallel.run_gemms(t)
                return
        if len(rest) == 2:  # masked_attention: the mask in the scores' base-2 units, broadcast
            m3 = np.broadcast_to(rest[0], scores_shape).reshape(heads, lq, lk)  # a view if heads share it
            with np.errstate(over="ignore"):  # a -3.4e38 "minus infinity" becomes -inf: weight 0
                m3_2 = np.broadcast_to(multiply(rest[0], log2e), scores_shape).reshape(heads, lq, lk)
        else:
            m3 = m3_2 = None
        for g0 in range(0, heads, group):
            g1 = min(heads, g0 + group)
            # the last group may hold fewer heads: its last block (and its scores) is cut short
            parallel.run([partial(head_block, q3, k3, v3, o3, m3, m3_2, g0 + lo, min(g0 + hi, g1),
                                  buf[lo:min(hi, g1 - g0)])
                          for lo, hi in head_blocks if g0 + lo < g1])
    return kernel


class _QueuedAttention:
    """Unmasked attention on the pool's compiled GEMM queue (:func:`polyhal_cpu.parallel.run_gemms`):
    a group's heads in blocks of query rows, each piece two GEMMs -- its scores (scaled into
    base-2 units) with a softmax of each row as their epilogue (the row's own maximum, exp2,
    the weights normalised in L1), then the weights times v -- with no Python and no GIL
    between them. (Run by :func:`~polyhal_cpu.parallel.run`, a piece's numpy steps took the
    GIL between its BLAS calls, and each time one thread found it taken, it slept ~25 us.)"""

    def __init__(self, group: int, lq: int, lk: int, d: int, dv: int, alpha: float) -> None:
        self.lq, self.lk, self.alpha = lq, lk, alpha
        parts = parallel.gemm_pieces(lq, lk, d + dv, batch=group, piece_us=parallel.GEMM_QUEUE_PIECE_US)
        self.row_blocks = parallel.blocks(lq, -(-parts // group), 8 if lq >= 16 else 1)
        self.shape = (lk, d, dv)
        self._templates: dict = {}

    def table(self, q3, k3, v3, o3, buf, g0: int, g1: int) -> np.ndarray | None:
        """Heads g0..g1's pieces (``buf`` their scores), or None where the queue is off or an
        operand's strides do not do (each matrix needs rows of unit stride)."""
        key = (q3.strides, k3.strides, v3.strides, o3.strides, g1 - g0)
        made = self._templates.get(key, False)
        if made is False:
            made = self._templates[key] = self._template(q3, k3, v3, o3, g1 - g0)
        if made is None:
            return None
        template, offsets = made
        t = template.copy()
        g = layout
        base = (q3.ctypes.data + g0 * q3.strides[0], k3.ctypes.data + g0 * k3.strides[0], buf.ctypes.data,
                v3.ctypes.data + g0 * v3.strides[0], o3.ctypes.data + g0 * o3.strides[0])
        for (step, field), operand, off in zip(((0, g.G_A), (0, g.G_B), (0, g.G_C), (1, g.G_B), (1, g.G_C)),
                                               range(5), offsets):
            t[:, step, field] = base[operand] + off
        t[:, 1, g.G_A] = t[:, 0, g.G_C]
        return t

    def _template(self, q3, k3, v3, o3, heads: int):
        fn = parallel.gemm_fn()
        if fn is None or any(x.strides[2] != 4 or min(x.strides) < 0 or x.strides[1] % 4 for x in (q3, k3, v3, o3)):
            return None
        g = layout
        lk, d, dv = self.shape
        pieces = [(h, r0, r1) for h in range(heads) for r0, r1 in self.row_blocks]
        t = np.zeros((len(pieces), 2, g.G_FIELDS), np.int64)
        t[:, :, g.G_FN], t[:, :, g.G_WIDE], t[:, :, g.G_GEMV] = fn
        t[:, :, g.G_TA] = blas.NO_TRANS
        t[:, 0, g.G_TB], t[:, 1, g.G_TB] = blas.TRANS, blas.NO_TRANS
        t[:, :, g.G_M] = [[r1 - r0] * 2 for _, r0, r1 in pieces]
        t[:, 0, g.G_N], t[:, 0, g.G_K], t[:, 1, g.G_N], t[:, 1, g.G_K] = lk, d, dv, lk
        t[:, 0, g.G_ALPHA], t[:, 1, g.G_ALPHA] = parallel.float_bits(self.alpha), parallel.float_bits(1.0)
        t[:, 0, g.G_LDA], t[:, 0, g.G_LDB], t[:, 0, g.G_LDC] = q3.strides[1] // 4, k3.strides[1] // 4, lk
        t[:, 1, g.G_LDA], t[:, 1, g.G_LDB], t[:, 1, g.G_LDC] = lk, v3.strides[1] // 4, o3.strides[1] // 4
        t[:, 0, g.G_ACT] = g.SOFTMAX2
        h, r0 = (np.array(c, np.int64) for c in zip(*[(h, r0) for h, r0, _ in pieces]))
        # bytes from each operand's group start: q rows, k's head, the scores' rows, v's head, out rows
        offsets = (h * q3.strides[0] + r0 * q3.strides[1], h * k3.strides[0], (h * self.lq + r0) * lk * 4,
                   h * v3.strides[0], h * o3.strides[0] + r0 * o3.strides[1])
        return t, offsets
