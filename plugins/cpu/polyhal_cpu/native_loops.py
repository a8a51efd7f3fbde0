"""The loops of :mod:`polyhal_cpu.native`, compiled by numba on first call (and cached on disk).

Importing this module imports numba; :mod:`polyhal_cpu.native` does so only when a kernel asks
for a loop. Every loop takes float32 C-contiguous arrays and releases the GIL.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from polyhal_cpu.queue_layout import (G_A, G_ACT, G_ACT_ALPHA, G_ACT_BETA, G_ALPHA, G_B, G_BETA, G_BIAS, G_BIAS_COL,
                                      G_BIAS_ROW, G_C, G_FIELDS, G_FN, G_GEMV, G_K, G_KIND, G_LDA, G_LDB, G_LDC, G_LDR,
                                      G_M, G_N, G_RES, G_TA, G_TB, G_WIDE, KIND_DEPTHWISE, KIND_DEPTHWISE_FLAT,
                                      KIND_IMAGE_CONV, KIND_LAYER_NORM, KIND_POINTWISE, KIND_POOL, KIND_PROLOGUE_GEMM,
                                      KIND_SCALE_SHIFT, KIND_TILES, KIND_TILES_SLAB, P_ACT, P_ALPHA, P_BETA, P_LDX,
                                      P_SCALE, P_SHIFT, P_X, Q_COUNT, Q_DESC,
                                      Q_FINISHED, Q_RUN, Q_STEPS, Q_TAKEN, RUN_SHIFT, SOFTMAX2, V_A, V_ACT, V_ALPHA,
                                      V_B, V_BETA, V_BIAS, V_BLOCK, V_C, V_DH, V_DW, V_H, V_KH, V_KW, V_M, V_N, V_N0,
                                      V_N1, V_OH, V_OUT, V_OW, V_PH, V_PLANE, V_PRE_ACT, V_PRE_ALPHA, V_PRE_BETA, V_PW,
                                      V_RES, V_ROWS, V_SCALE, V_SH, V_SHIFT, V_SW, V_W, V_WIDTH, V_X, V_Y0, V_Y1)
from polyhal_cpu.rational_erf import ERF_P, ERF_Q

__all__ = ["add_rows", "col2im", "conv_image_channels_last", "depthwise", "depthwise_channels_last",
           "depthwise_flat_rows", "drive_gemms", "epilogue", "epilogue_channels_last", "exp2_shifted_rows", "gelu_erf",
           "gelu_tanh", "gemm_channels_last", "gemm_pieces", "gemm_tiles", "im2col", "im2col_phases", "layer_norm",
           "matvec_channels_last", "pool2d", "relu", "scale_rows", "serve_gemms", "softmax_rows",
           "spin_wait", "take_gemms"]

# No "nnan"/"ninf": nan and inf keep their IEEE meaning (a nan input gives a nan result).
# "reassoc" lets LLVM vectorise the row sums (in any order, as numpy's pairwise sum does).
_jit = njit(fastmath={"contract", "arcp", "reassoc", "nsz", "afn"}, error_model="numpy", nogil=True,
            cache=True, boundscheck=False)
f32, i32 = np.float32, np.int32


# ------------------------------------------------------------------------------- the pool's wait

@intrinsic
def _load_acquire(typingctx, flags, index):
    """``flags[index]`` (int64) by an atomic load: a plain load of memory the loop never writes
    is hoisted out of the loop by LLVM, and the loop would never see another thread's store."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.load_atomic(builder.gep(array.data, [args[1]]), "acquire", 8)
    return types.int64(flags, types.intp), codegen


@intrinsic
def _pause(typingctx):
    """x86's ``pause`` (a spin-wait hint: the core backs off its speculative loads and leaves
    issue slots to its hyper-thread sibling); nothing on other CPUs."""
    def codegen(context, builder, signature, args):
        if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
            pause = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(pause, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def _store_release(typingctx, flags, index, value):
    """``flags[index] = value`` (int64) by an atomic store that no earlier store passes."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        builder.store_atomic(args[2], builder.gep(array.data, [args[1]]), "release", 8)
        return context.get_dummy_value()
    return types.void(flags, types.intp, types.int64), codegen


@_jit
def spin_wait(flags, post, value, index, target, rounds, linger):
    """polyhal_cpu.parallel's bounded spin, the GIL released: store ``value`` in
    ``flags[post]`` first (``post`` >= 0), then return once ``flags[index]`` has reached
    ``target`` (and ``linger`` more rounds have passed), or after ``rounds`` looks at it, a
    pause between two."""
    if post >= 0:
        _store_release(flags, post, value)
    for _ in range(rounds):
        if _load_acquire(flags, index) >= target:
            for _ in range(linger):
                _pause()
            return
        _pause()


# ------------------------------------------------------------- the pool's compiled GEMM queue
#
# A run of GEMM pieces (polyhal_cpu.parallel.run_gemms) is a table of descriptors (G_* fields,
# int64; floats as their bits) that a pool thread serves from inside its compiled spin, so that
# neither it nor the caller runs Python, or takes the GIL, for a piece. A piece is Q_STEPS
# GEMMs one after another (an attention block: scores with a softmax epilogue, then their
# product with v). The queue (an int64 vector) holds the run's number at Q_RUN, its table's
# address, length and steps at Q_DESC, Q_COUNT and Q_STEPS, and two counters tagged with the
# run's number (number << RUN_SHIFT | count): Q_TAKEN, the next piece (taken by
# compare-and-swap, so that a thread that looked at an older run takes nothing of a newer one),
# and Q_FINISHED, the pieces done.

@intrinsic
def _cas(typingctx, flags, index, expected, new):
    """Atomically ``flags[index] = new`` if it holds ``expected``; whether it did."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        pair = builder.cmpxchg(builder.gep(array.data, [args[1]]), args[2], args[3], "acq_rel", "acquire")
        return builder.extract_value(pair, 1)
    return types.boolean(flags, types.intp, types.int64, types.int64), codegen


@intrinsic
def _fetch_add(typingctx, flags, index, value):
    """Atomically ``flags[index] += value``."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        builder.atomic_rmw("add", builder.gep(array.data, [args[1]]), args[2], "acq_rel")
        return context.get_dummy_value()
    return types.void(flags, types.intp, types.int64), codegen


def _pointer_at(element: types.Type, llvm_type: ir.Type):
    """An intrinsic giving the ``element`` pointer at an integer address (for ``carray``)."""
    @intrinsic
    def pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], llvm_type.as_pointer())
        return types.CPointer(element)(types.int64), codegen
    return pointer


_f32_pointer = _pointer_at(types.float32, ir.FloatType())
_i64_pointer = _pointer_at(types.int64, ir.IntType(64))
_i32_pointer = _pointer_at(types.int32, ir.IntType(32))


@intrinsic
def _copy_bytes(typingctx, dst, src, n):
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (not overlapping): LLVM's memcpy,
    which a loop of float stores does not become where numba cannot tell the arrays apart
    (measured 3.5x slower for a padded image's rows)."""
    def codegen(context, builder, signature, args):
        bytes_ = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], bytes_), builder.inttoptr(args[1], bytes_), args[2], 1)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def _zero_bytes(typingctx, dst, n):
    """Zero ``n`` bytes from address ``dst`` (LLVM's memset)."""
    def codegen(context, builder, signature, args):
        cgutils.memset(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()), args[1], 0)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64), codegen


@intrinsic
def _f32_bits(typingctx, bits):
    """The float32 whose bits are the low 32 of ``bits``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())
    return types.float32(types.int64), codegen


@intrinsic
def _sgemm(typingctx, d):
    """Call the cblas_sgemm at ``d[G_FN]`` (row-major) with descriptor ``d``'s operands; its
    integers are 64 bits wide where ``d[G_WIDE]`` is set, else 32 (the two OpenBLAS builds).
    Where M is 1 and ``d[G_GEMV]`` holds cblas_sgemv's address, C's row is op(B)^T times A's
    row by that instead: OpenBLAS's sgemm packs all of B first, sgemv streams it once (1 x
    960 @ 960 x 1280: ~4x faster)."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        i32, i64, f32t = ir.IntType(32), ir.IntType(64), ir.FloatType()
        fptr = f32t.as_pointer()

        def field(k):
            return builder.load(builder.gep(array.data, [ir.Constant(i64, k)]))

        def real(k):
            return builder.bitcast(builder.trunc(field(k), i32), f32t)

        def call(idx):
            def size(k):
                return field(k) if idx is i64 else builder.trunc(field(k), i32)
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32, i32, idx, idx, idx, f32t, fptr, idx, fptr, idx, f32t,
                                                   fptr, idx])
            fn = builder.inttoptr(field(G_FN), fnty.as_pointer())
            builder.call(fn, [ir.Constant(i32, 101), builder.trunc(field(G_TA), i32),
                              builder.trunc(field(G_TB), i32), size(G_M), size(G_N), size(G_K), real(G_ALPHA),
                              builder.inttoptr(field(G_A), fptr), size(G_LDA), builder.inttoptr(field(G_B), fptr),
                              size(G_LDB), real(G_BETA), builder.inttoptr(field(G_C), fptr), size(G_LDC)])

        def gemv(idx):
            # y (N) = alpha op(B)^T x + beta y: B as stored is (K, N) row-major (B^T x: "trans"),
            # or (N, K) for a transposed B (then "no trans"); x is A's row (stride lda if A is transposed).
            def size(value):
                return value if idx is i64 else builder.trunc(value, i32)
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32, idx, idx, f32t, fptr, idx, fptr, idx, f32t, fptr, idx])
            fn = builder.inttoptr(field(G_GEMV), fnty.as_pointer())
            b_trans = builder.icmp_signed("==", field(G_TB), ir.Constant(i64, 112))
            rows = builder.select(b_trans, field(G_N), field(G_K))
            cols = builder.select(b_trans, field(G_K), field(G_N))
            flag = builder.select(b_trans, ir.Constant(i32, 111), ir.Constant(i32, 112))
            a_trans = builder.icmp_signed("==", field(G_TA), ir.Constant(i64, 112))
            incx = builder.select(a_trans, field(G_LDA), ir.Constant(i64, 1))
            builder.call(fn, [ir.Constant(i32, 101), flag, size(rows), size(cols), real(G_ALPHA),
                              builder.inttoptr(field(G_B), fptr), size(field(G_LDB)),
                              builder.inttoptr(field(G_A), fptr), size(incx), real(G_BETA),
                              builder.inttoptr(field(G_C), fptr), size(ir.Constant(i64, 1))])

        wide = builder.icmp_signed("!=", field(G_WIDE), ir.Constant(i64, 0))
        vector = builder.and_(builder.icmp_signed("==", field(G_M), ir.Constant(i64, 1)),
                              builder.icmp_signed("!=", field(G_GEMV), ir.Constant(i64, 0)))

        def by_width(emit):  # BLAS with 64-bit integers (an ILP64 build) or 32-bit ones
            with builder.if_else(wide) as (then, otherwise):
                with then:
                    emit(i64)
                with otherwise:
                    emit(i32)

        with builder.if_else(vector) as (is_vector, is_matrix):
            with is_vector:
                by_width(gemv)
            with is_matrix:
                by_width(call)
        return context.get_dummy_value()
    return types.void(d), codegen


@_jit
def gemm_piece(d):
    """One piece of a run (a layer norm's or scale_shift's rows where G_KIND says so, see queue_layout;
    with B made first by prologue_columns for KIND_PROLOGUE_GEMM): C (M x N at
    d[G_C], row stride d[G_LDC]) = its bias (d[G_BIAS] != 0: element (r, j) at bias + 4 * (r *
    G_BIAS_ROW + j * G_BIAS_COL), a broadcast by zero strides), then C = alpha A B + beta C by BLAS,
    then, row by row, + the residual (d[G_RES] != 0, row stride d[G_LDR]) and activation d[G_ACT]
    (see activate_row)."""
    kind = d[G_KIND]
    if kind == KIND_SCALE_SHIFT:
        scale_shift_piece(d)
        return
    if kind == KIND_PROLOGUE_GEMM:  # B made first, from the input through the prologue
        prologue_columns(d)
    elif kind >= KIND_POINTWISE:
        conv_piece(d)
        return
    m, n = d[G_M], d[G_N]
    if d[G_KIND] == KIND_LAYER_NORM:
        layer_norm(carray(_f32_pointer(d[G_A]), (m, n)), carray(_f32_pointer(d[G_B]), n),
                   carray(_f32_pointer(d[G_BIAS]), n), _f32_bits(d[G_ALPHA]), carray(_f32_pointer(d[G_C]), (m, n)))
        return
    ldc = d[G_LDC] * 4
    if d[G_BIAS] != 0:
        sr, sc = d[G_BIAS_ROW] * 4, d[G_BIAS_COL] * 4
        for r in range(m):
            row = carray(_f32_pointer(d[G_C] + r * ldc), n)
            if sc == 4:
                src = carray(_f32_pointer(d[G_BIAS] + r * sr), n)
                for j in range(n):
                    row[j] = src[j]
            else:  # a column (sc = 0) or a strided C
                for j in range(n):
                    row[j] = carray(_f32_pointer(d[G_BIAS] + r * sr + j * sc), 1)[0]
    if m > 0 and n > 0:
        _sgemm(d)
    act, has_residual = d[G_ACT], d[G_RES] != 0
    if act == SOFTMAX2:
        for r in range(m):
            softmax2_row(d[G_C] + r * ldc, n)
    elif act != 0 or has_residual:
        alpha, beta, ldr = _f32_bits(d[G_ACT_ALPHA]), _f32_bits(d[G_ACT_BETA]), d[G_LDR] * 4
        for r in range(m):
            row = carray(_f32_pointer(d[G_C] + r * ldc), n)
            if has_residual:
                res = carray(_f32_pointer(d[G_RES] + r * ldr), n)
                for j in range(n):
                    row[j] += res[j]
            activate_row(row, act, alpha, beta)


@_jit
def _f32_array(address, shape):
    """The C-contiguous float32 array of ``shape`` at ``address``."""
    return carray(_f32_pointer(address), shape)


@_jit
def conv_piece(d):
    """One piece of a channels-last convolution (d[G_KIND] one of queue_layout's KIND_POINTWISE,
    KIND_DEPTHWISE, KIND_DEPTHWISE_FLAT, KIND_IMAGE_CONV, or an NCHW one's KIND_TILES; or a 2-D
    pool's KIND_POOL; its fields the V_ ones): the loop the kernel otherwise calls for it, on
    arrays made from the descriptor's addresses and shapes."""
    kind, act, alpha, beta = d[G_KIND], d[V_ACT], _f32_bits(d[V_ALPHA]), _f32_bits(d[V_BETA])
    if kind == KIND_POOL:  # (planes, H, W) into (planes, oh, ow)
        planes, kw = d[V_N], d[V_KW]
        pool2d(_f32_array(d[V_X], (planes, d[V_H], d[V_WIDTH])), _f32_array(d[V_OUT], (planes, d[V_OH], d[V_OW])),
               _f32_array(d[V_A], (1, d[V_M])), _f32_array(d[V_B], d[V_N0]), carray(_i64_pointer(d[V_ROWS]), (4, kw)),
               d[V_KH], kw, d[V_SH], d[V_SW], d[V_PH], d[V_PW], d[V_DH], d[V_DW], act != 0)
        return
    has_residual, none = d[V_RES] != 0, d[V_RES] * 0  # none: a zero extent of the residual's type
    if kind == KIND_TILES_SLAB and d[V_C] == d[V_KH]:
        pointwise_slab_piece(d)
        return
    if kind == KIND_TILES or kind == KIND_TILES_SLAB:  # (M rows, K) packed @ B (K, columns) into (M rows, positions)
        rows, positions, kdim, panels = d[V_M], d[V_N], d[V_C], d[V_OH]
        src, size, first = d[V_X], d[V_N0], 0
        if kind == KIND_TILES_SLAB:  # B: the piece's own slab of the padded image, filled here
            src = d[V_DH]
            fill_slab(d[V_X], d[V_KH], d[V_SH], d[V_SW], d[V_PLANE], src, size, d[V_Y0], d[V_Y1], d[V_PH],
                      d[V_PW], d[V_WIDTH], d[V_DW], d[V_SCALE], d[V_SHIFT], d[V_PRE_ACT],
                      _f32_bits(d[V_PRE_ALPHA]), _f32_bits(d[V_PRE_BETA]))
            first = d[V_KW]  # B's columns from this place in the slab's first row
            src, size = src + first * 4, size - first
        gemm_tiles(_f32_array(d[V_W], (panels, kdim, GEMM_MR)), _f32_array(src, size),
                   carray(_i64_pointer(d[V_ROWS]), kdim), carray(_i64_pointer(d[V_N1]), kdim), d[V_H],
                   d[V_WIDTH], d[V_OW], _f32_array(d[V_OUT], (rows, positions)), _f32_array(d[V_BIAS], rows),
                   _f32_array(d[V_RES] if has_residual else d[V_OUT],
                              (rows, positions) if has_residual else (none, none)),
                   _f32_array(d[V_A], kdim * GEMM_NR), _f32_array(d[V_B], panels * GEMM_MR * d[V_BLOCK]),
                   d[V_BLOCK], act, alpha, beta, first)
        return
    if kind == KIND_POINTWISE:  # (pixels, C) @ (C, M padded) into (pixels, M)
        pixels, c, mpad, m = d[V_N], d[V_C], d[V_M], d[V_OW]
        gemm_channels_last(_f32_array(d[V_X], (pixels, c)), _f32_array(d[V_W], (c, mpad)),
                           carray(_i64_pointer(d[V_ROWS]), c), _f32_array(d[V_OUT], (pixels, m)),
                           _f32_array(d[V_BIAS], mpad),
                           _f32_array(d[V_RES] if has_residual else d[V_OUT],
                                      (pixels, m) if has_residual else (none, none)),
                           _f32_array(d[V_A], GEMM_MR * GEMM_NR), _f32_array(d[V_B], GEMM_MR * c), d[V_BLOCK],
                           act, alpha, beta)
        return
    if kind == KIND_IMAGE_CONV:  # (N, C, H, W) by (kh, C, kw, M) into (N, oh, ow, M)
        n, c, m, kh, kw = d[V_N], d[V_C], d[V_M], d[V_KH], d[V_KW]
        out_shape = (n, d[V_OH], d[V_OW], m)
        res_shape = out_shape if has_residual else (none, none, none, none)
        conv_image_channels_last(_f32_array(d[V_X], (n, c, d[V_H], d[V_WIDTH])), _f32_array(d[V_W], (kh, c, kw, m)),
                                 carray(_i64_pointer(d[V_A]), kh * c * kw), carray(_i64_pointer(d[V_B]), kh * c * kw),
                                 _f32_array(d[V_BIAS], m),
                                 _f32_array(d[V_RES] if has_residual else d[V_OUT], res_shape),
                                 _f32_array(d[V_OUT], out_shape), d[V_N0], d[V_N1], d[V_Y0], d[V_Y1], d[V_SH],
                                 d[V_SW], d[V_PH], d[V_PW], d[V_DH], d[V_DW], act, alpha, beta)
        return
    # depthwise: (N, H, W, C) by (kh, kw, M) taps (M = C, or ow * C tiled) into (N, oh, ow, C)
    n, c, m = d[V_N], d[V_C], d[V_M]
    out_shape = (n, d[V_OH], d[V_OW], c)
    x = _f32_array(d[V_X], (n, d[V_H], d[V_WIDTH], c))
    taps, bias = _f32_array(d[V_W], (d[V_KH], d[V_KW], m)), _f32_array(d[V_BIAS], m)
    residual = _f32_array(d[V_RES] if has_residual else d[V_OUT],
                          out_shape if has_residual else (none, none, none, none))
    out = _f32_array(d[V_OUT], out_shape)
    if kind == KIND_DEPTHWISE_FLAT:
        depthwise_flat_rows(x, taps, bias, residual, out, d[V_PH], d[V_PW], d[V_DH], d[V_DW], act, alpha, beta)
    else:
        depthwise_channels_last(x, taps, carray(_i64_pointer(d[V_A]), (2, d[V_KH] * d[V_KW])), bias, residual, out,
                                d[V_SH], d[V_SW], d[V_PH], d[V_PW], d[V_DH], d[V_DW],
                                act, alpha, beta)


@_jit
def pointwise_slab_piece(d):
    """A 1x1 conv's KIND_TILES_SLAB piece (one tap: V_C = V_KH channels): its V_H columns of the
    image (C, V_PLANE positions) at V_X, V_BLOCK at a time, each block filled into the slab
    (C x V_BLOCK, V_DW floats apart; through the prologue where V_SCALE is set) and computed
    while the slab is in L2 (a piece's whole columns filled first left them in L3: 160 channels
    of 1568 columns, 1 MB)."""
    rows, positions, c, panels, block = d[V_M], d[V_N], d[V_C], d[V_OH], d[V_BLOCK]
    slab, size, pitch, has_residual = d[V_DH], d[V_N0], d[V_DW], d[V_RES] != 0
    wp = _f32_array(d[V_W], (panels, c, GEMM_MR))
    rowoff, packed_rows = carray(_i64_pointer(d[V_ROWS]), c), carray(_i64_pointer(d[V_N1]), c)
    bias, bpack = _f32_array(d[V_BIAS], rows), _f32_array(d[V_A], c * GEMM_NR)
    cbuf = _f32_array(d[V_B], panels * GEMM_MR * block)
    act, alpha, beta = d[V_ACT], _f32_bits(d[V_ALPHA]), _f32_bits(d[V_BETA])
    pre_alpha, pre_beta = _f32_bits(d[V_PRE_ALPHA]), _f32_bits(d[V_PRE_BETA])
    ncols = d[V_H]
    for j in range(0, ncols, block):
        width = min(block, ncols - j)
        fill_slab(d[V_X] + j * 4, c, 1, width, d[V_PLANE], slab, size, 0, 1, 0, 0, width, pitch, d[V_SCALE],
                  d[V_SHIFT], d[V_PRE_ACT], pre_alpha, pre_beta)
        # the block's output from its first column (the arrays reach past the output's end by
        # those columns; the block's own are the only ones touched)
        out = _f32_array(d[V_OUT] + j * 4, (rows, positions))
        residual = _f32_array(d[V_RES] + j * 4, (rows, positions)) if has_residual else _f32_array(d[V_OUT], (0, 0))
        gemm_tiles(wp, _f32_array(slab, size), rowoff, packed_rows, width, width, width, out, bias, residual, bpack,
                   cbuf, block, act, alpha, beta, 0)


@_jit
def _row_max(address, n):
    """The largest of the ``n`` float32 at ``address``, as an integer maximum of their bits
    made monotonic (a negative float's magnitude bits flipped), which LLVM vectorises where a
    float maximum needs no-nan fast-math; a positive nan comes out as the maximum, a negative
    one never (either way it makes its row's exp2 pass nan, as the reference's row)."""
    bits = carray(_i32_pointer(address), n)
    top = np.int64(bits[0])
    top ^= (top >> 31) & 0x7FFFFFFF
    for j in range(1, n):
        key = np.int64(bits[j])
        key ^= (key >> 31) & 0x7FFFFFFF
        top = key if key > top else top
    top ^= (top >> 31) & 0x7FFFFFFF
    return _f32_bits(top)


@_jit
def softmax2_row(address, n):
    """In place over the ``n`` float32 at ``address`` (scores in base-2 units): 2^(y - max y)
    / its sum."""
    y = carray(_f32_pointer(address), n)
    top = _row_max(address, n)
    total = f32(0.0)
    for j in range(n):
        e = exp2(y[j] - top)
        y[j] = e
        total += e
    inv = f32(1.0) / total
    for j in range(n):
        y[j] *= inv


@_jit
def gemm_pieces(table):
    """Compute every row of (rows, G_FIELDS) ``table``, one after another."""
    for i in range(table.shape[0]):
        gemm_piece(table[i])


@_jit
def take_gemms(queue, run):
    """Take and compute pieces of GEMM run ``run`` from ``queue`` until none is left (or the
    queue has moved on to another run)."""
    while True:
        tagged = _load_acquire(queue, Q_TAKEN)
        i = tagged - (run << RUN_SHIFT)
        if i < 0 or i >= _load_acquire(queue, Q_COUNT):
            return
        table, steps = _load_acquire(queue, Q_DESC), _load_acquire(queue, Q_STEPS)
        if _cas(queue, Q_TAKEN, tagged, tagged + 1):
            for j in range(steps):
                gemm_piece(carray(_i64_pointer(table + (i * steps + j) * G_FIELDS * 8), G_FIELDS))
            _fetch_add(queue, Q_FINISHED, 1)


@_jit
def drive_gemms(queue, run, rounds):
    """The caller's part of GEMM run ``run``: take pieces until none is left, then wait for those
    other threads took (at most ``rounds`` pauses); whether every piece is done."""
    take_gemms(queue, run)
    done = (run << RUN_SHIFT) + _load_acquire(queue, Q_COUNT)
    for _ in range(rounds):
        if _load_acquire(queue, Q_FINISHED) >= done:
            return True
        _pause()
    return _load_acquire(queue, Q_FINISHED) >= done


@_jit
def serve_gemms(flags, queue, post, value, index, seen, rounds, linger):
    """A pool thread's spin (spin_wait's, the GIL released) that serves GEMM runs itself: store
    ``value`` in ``flags[post]`` first (``post`` >= 0), then wait for ``flags[index]`` to pass
    ``seen``; a GEMM run (``queue[Q_RUN]`` is its number) is served here and the wait goes on
    (``rounds`` pauses again), any other returns after ``linger`` pauses. Returns the number of
    the last run seen and served here (``seen`` if none)."""
    if post >= 0:
        _store_release(flags, post, value)
    left = rounds
    while left > 0:
        started = _load_acquire(flags, index)
        if started > seen:
            if _load_acquire(queue, Q_RUN) != started:
                for _ in range(linger):
                    _pause()
                return seen
            take_gemms(queue, started)
            seen, left = started, rounds
        else:
            _pause()
            left -= 1
    return seen


@_jit
def exp2(t):
    """2^t in float32, in line (see polyhal_cpu.native: Cephes' polynomial, exponent bits)."""
    t = min(max(t, f32(-127.0)), f32(128.0))
    n = np.floor(t + f32(0.5))
    f = t - n
    p = f32(1.535336188319500e-4)
    p = p * f + f32(1.339887440266574e-3)
    p = p * f + f32(9.618437357674640e-3)
    p = p * f + f32(5.550332471162809e-2)
    p = p * f + f32(2.402264791363012e-1)
    p = p * f + f32(6.931472028550421e-1)
    p = p * f + f32(1.0)
    bits = (i32(n) + i32(127)) << i32(23)  # numba widens the arithmetic to int64:
    return p * i32(bits).view(np.float32)  # back to 32 bits before reinterpreting


@_jit
def gelu_tanh(x, out):
    """x * sigmoid(2u) = x / (1 + 2^(-2u log2 e)), u = sqrt(2/pi) (x + 0.044715 x^3), over 1-D x."""
    k1 = f32(-2.0 * 0.7978845608028654 * 1.4426950408889634)
    k3 = f32(-2.0 * 0.7978845608028654 * 1.4426950408889634 * 0.044715)
    for i in range(x.size):
        v = x[i]
        out[i] = v / (f32(1.0) + exp2(v * (k1 + k3 * v * v)))


@_jit
def gelu_erf_one(x, p, q):
    """x/2 * (1 + erf(x / sqrt 2)) of one float32 x, erf(z) = z P(z^2) / Q(z^2) on z clamped
    to [-4, 4] (``p``, ``q``: 7 and 5 coefficients, highest power first), evaluated in float64
    and then combined in float32, as the numpy kernels of polyhal_cpu.kernels do (erf's error,
    1e-7, times |x| / 2). In line, without a libm call, so that loops over it are vectorised."""
    v = np.float64(x)
    z = min(max(v * 0.7071067811865476, -4.0), 4.0)  # nan stays nan (min/max pass it)
    z2 = z * z
    n = ((((((p[0] * z2 + p[1]) * z2 + p[2]) * z2 + p[3]) * z2 + p[4]) * z2 + p[5]) * z2 + p[6]) * z
    d = (((q[0] * z2 + q[1]) * z2 + q[2]) * z2 + q[3]) * z2 + q[4]
    e = f32(n / d)  # erf rounded to float32 first, as the numpy kernel does: erf(+-4) is +-1
    return (e * f32(0.5) + f32(0.5)) * x


@_jit
def gelu_erf(x, out, p, q):
    """The erf GELU (:func:`gelu_erf_one`) over 1-D x."""
    for i in range(x.size):
        out[i] = gelu_erf_one(x[i], p, q)


@_jit
def relu(x, out):
    """max(x, 0) over 1-D x; nan stays nan (as numpy's maximum)."""
    for i in range(x.size):
        v = x[i]
        out[i] = v if not v < f32(0.0) else f32(0.0)


@_jit
def softmax_rows(x, out):
    """Softmax of each row of (rows, cols) x into out, shifted by the row's maximum. A row with
    a nan, or whose maximum is +-inf, gives nan where x - max is nan, as the reference does."""
    rows, cols = x.shape
    log2e = f32(1.4426950408889634)
    for r in range(rows):
        m = x[r, 0]
        for c in range(1, cols):
            v = x[r, c]
            if v > m or v != v:
                m = v
        t = f32(0.0)
        for c in range(cols):
            e = exp2((x[r, c] - m) * log2e)
            out[r, c] = e
            t += e
        k = f32(1.0) / t
        for c in range(cols):
            out[r, c] *= k


@_jit
def layer_norm(x, scale, bias, eps, out):
    """Rows of (rows, cols) x normalised (mean 0, variance 1, then scale and bias) into out."""
    rows, cols = x.shape
    inv = f32(1.0) / f32(cols)
    for r in range(rows):
        s = f32(0.0)
        for c in range(cols):
            s += x[r, c]
        mean = s * inv
        v = f32(0.0)
        for c in range(cols):
            d = x[r, c] - mean
            v += d * d
        rstd = f32(1.0) / np.sqrt(v * inv + eps)
        for c in range(cols):
            out[r, c] = (x[r, c] - mean) * rstd * scale[c] + bias[c]


@_jit
def exp2_shifted_rows(s, shift, sums):
    """In place: (rows, cols) s becomes 2^(s - shift), sums[r] the sum of row r. Scores far
    below the shift give 0 (no subnormals); nan and +inf pass through to the sums."""
    rows, cols = s.shape
    for r in range(rows):
        t = f32(0.0)
        for c in range(cols):
            e = exp2(s[r, c] - shift)
            s[r, c] = e
            t += e
        sums[r] = t


@_jit
def scale_rows(x, factors):
    """In place: row r of (rows, cols) x divided by factors[r]."""
    rows, cols = x.shape
    for r in range(rows):
        k = f32(1.0) / factors[r]
        for c in range(cols):
            x[r, c] *= k


@_jit
def add_rows(x, row):
    """In place: (cols,) row added to every row of (rows, cols) x."""
    rows, cols = x.shape
    for r in range(rows):
        for c in range(cols):
            x[r, c] += row[c]


# ------------------------------------------------------------------------------ convolution
#
# 2-D only (1-D convolutions arrive as 2-D with a unit height). Activation codes are the index
# of the activation in polyhal.ops.nn.ACTIVATIONS: 0 none, 1 relu, 2 clip, 3 hard_sigmoid,
# 4 hard_swish, 5 sigmoid, 6 silu, 7 gelu, 8 gelu_tanh.

@_jit
def activate_row(y, act, alpha, beta):
    """In place over 1-D contiguous y: activation ``act`` (see above). One loop per activation,
    so that each is vectorised (a switch inside the loop is not)."""
    n = y.size
    zero, one = f32(0.0), f32(1.0)
    if act == 1:
        for i in range(n):
            v = y[i]
            y[i] = v if not v < zero else zero
    elif act == 2:
        for i in range(n):
            y[i] = min(max(y[i], alpha), beta)
    elif act == 3:
        for i in range(n):
            y[i] = min(max(alpha * y[i] + beta, zero), one)
    elif act == 4:
        for i in range(n):
            v = y[i]
            y[i] = v * min(max(alpha * v + beta, zero), one)
    elif act == 5:
        for i in range(n):
            y[i] = one / (one + exp2(-y[i] * f32(1.4426950408889634)))
    elif act == 6:
        for i in range(n):
            v = y[i]
            y[i] = v / (one + exp2(-v * f32(1.4426950408889634)))
    elif act == 7:  # erf GELU in line: math.erf is a libm call per element, never vectorised (~8x slower)
        for i in range(n):
            y[i] = gelu_erf_one(y[i], ERF_P, ERF_Q)
    elif act == 8:
        k1 = f32(-2.0 * 0.7978845608028654 * 1.4426950408889634)
        k3 = f32(-2.0 * 0.7978845608028654 * 1.4426950408889634 * 0.044715)
        for i in range(n):
            v = y[i]
            y[i] = v / (one + exp2(v * (k1 + k3 * v * v)))


@_jit
def epilogue(y, bias, residual, act, alpha, beta):
    """In place over (rows, cols) y, rows being (image, channel) pairs of ``bias``'s channels:
    y = act(y + bias[channel] (+ residual)). ``residual`` is (rows, cols), or (0, 0) for none.
    Row by row, so that the activation's pass finds the row in L1."""
    rows, cols = y.shape
    channels = bias.size
    has_residual = residual.shape[0] != 0
    for r in range(rows):
        b = bias[r % channels]
        row = y[r]
        if has_residual:
            res = residual[r]
            for c in range(cols):
                row[c] += b + res[c]
        else:
            for c in range(cols):
                row[c] += b
        activate_row(row, act, alpha, beta)


@_jit
def scale_shift_block(x, scale, shift, out, first, act, alpha, beta):
    """(rows, cols) x into out, rows being (image, channel) pairs of ``scale``'s channels, the
    first of channel ``first``: out = act(x * scale[channel] + shift[channel]), a row at a time: a ReLU (or none) in the same pass (~30% faster than a second pass over the row:
    0.09 against 0.13 ns an element, in cache, 2-core AVX-512 VM), another activation in a
    second pass, which finds the row in L1."""
    rows = x.shape[0]
    channels = scale.size
    c = first
    for r in range(rows):
        scale_shift_row(x[r], out[r], scale[c], shift[c], act, alpha, beta)
        c = c + 1 if c + 1 < channels else 0


@_jit
def scale_shift_row(src, dst, a, b, act, alpha, beta):
    """1-D ``dst`` = act(``src`` * a + b): a ReLU (or none) in the same pass, another
    activation in a second pass over ``dst`` (in L1)."""
    cols, zero = src.size, f32(0.0)
    if act == 1:
        for t in range(cols):
            v = src[t] * a + b
            dst[t] = v if not v < zero else zero
    else:
        for t in range(cols):
            dst[t] = src[t] * a + b
        if act != 0:
            activate_row(dst, act, alpha, beta)


@_jit
def scale_shift_piece(d):
    """A scale_shift's block of rows from its descriptor (queue_layout's KIND_SCALE_SHIFT)."""
    rows, cols, channels = d[G_M], d[G_N], d[G_K]
    scale_shift_block(_f32_array(d[G_A], (rows, cols)), _f32_array(d[G_B], channels), _f32_array(d[G_BIAS], channels),
                      _f32_array(d[G_C], (rows, cols)), d[G_LDA], d[G_ACT], _f32_bits(d[G_ACT_ALPHA]),
                      _f32_bits(d[G_ACT_BETA]))


@_jit
def prologue_columns(d):
    """A KIND_PROLOGUE_GEMM piece's B (queue_layout): its G_K channels' G_N columns of the input
    at d[P_X] (d[P_LDX] floats apart) through the prologue, into G_K contiguous rows at d[G_B]."""
    k, n, ldx = d[G_K], d[G_N], d[P_LDX] * 4
    scale, shift = _f32_array(d[P_SCALE], k), _f32_array(d[P_SHIFT], k)
    act, alpha, beta = d[P_ACT], _f32_bits(d[P_ALPHA]), _f32_bits(d[P_BETA])
    for r in range(k):
        scale_shift_row(_f32_array(d[P_X] + r * ldx, n), _f32_array(d[G_B] + r * n * 4, n), scale[r], shift[r], act,
                        alpha, beta)


@_jit
def _valid(o_count, start, stride, size):
    """The output range [lo, hi) whose input index start + o * stride lies in [0, size)."""
    lo = 0 if start >= 0 else (-start + stride - 1) // stride
    hi = 0 if start >= size else min(o_count, (size - 1 - start) // stride + 1)
    return lo, max(lo, hi)


@_jit
def _phase_tap(j, sw, pw, dw):
    """(q, r) with j * dw - pw = q * sw + r, 0 <= r < sw: kernel column j reads input column
    (xo + q) * sw + r, i.e. column xo + q of column phase r (:func:`_split_phases`)."""
    off = j * dw - pw
    q = off // sw
    return q, off - q * sw


@_jit
def _split_phases(src, height, width, sw, phases):
    """The (height, width) plane ``src`` (flat) split into its ``sw`` column phases: phase p,
    row y holds columns p, p + sw, ... of row y, at phases[(p * height + y) * ceil(width / sw)].
    A strided read is not vectorised; after this split a horizontally strided window reads a
    contiguous run of one phase."""
    pwidth = (width + sw - 1) // sw
    for y in range(height):
        row = src[y * width:(y + 1) * width]
        for p in range(sw):
            dst = phases[(p * height + y) * pwidth:(p * height + y + 1) * pwidth]
            for t in range((width - p + sw - 1) // sw):
                dst[t] = row[p + t * sw]


@_jit
def im2col(x, n0, cols, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow):
    """Images n0 .. n0 + nb of (N, C, H, W) x into (C * kh * kw, nb * oh * ow) columns: row
    (c, i, j) holds, for each image and output position, the input under tap (i, j) (0 in the
    padding). Flat offsets and views indexed by the loop counter, as in ``depthwise``: row views
    of the 3-D input cost reference counting per output row, and short rows (7-14 wide) made
    that overhead most of the time."""
    _, channels, height, width = x.shape
    ncols = cols.shape[1]
    plane = oh * ow
    nb = ncols // plane
    xf, cf = x.reshape(-1), cols.reshape(-1)
    zero = f32(0.0)
    for c in range(channels):
        for i in range(kh):
            for j in range(kw):
                r0 = ((c * kh + i) * kw + j) * ncols
                lo, hi = _valid(ow, j * dw - pw, sw, width)  # once per nb * oh rows: no table needed
                for b in range(nb):
                    xplane = ((n0 + b) * channels + c) * height * width
                    for yo in range(oh):
                        d0 = r0 + b * plane + yo * ow
                        row = cf[d0:d0 + ow]
                        iy = yo * sh - ph + i * dh
                        if iy < 0 or iy >= height or hi <= lo:
                            for t in range(ow):
                                row[t] = zero
                            continue
                        for t in range(lo):
                            row[t] = zero
                        for t in range(hi, ow):
                            row[t] = zero
                        s0 = xplane + iy * width + j * dw - pw + lo * sw
                        dst = row[lo:hi]
                        if sw == 1:
                            src = xf[s0:s0 + hi - lo]
                            for t in range(hi - lo):
                                dst[t] = src[t]
                        else:
                            for t in range(hi - lo):
                                dst[t] = xf[s0 + t * sw]


@_jit
def im2col_phases(x, n0, cols, phases, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow):
    """:func:`im2col` with a horizontal stride (sw > 1): each channel's planes are first split
    into column phases (:func:`_split_phases`, into ``phases``: scratch of nb * sw * H *
    ceil(W / sw) floats), so that every row of the columns is a contiguous
    copy (ResNet's 7x7 stride-2 stem: 836 -> 283 us single-threaded). The split reads the whole
    plane: it pays for kernels wider than 1 over long output rows, not for a 1x1 stride-2 conv
    (a quarter of the plane) or 7-14 wide rows (:func:`polyhal_cpu.native.im2col` chooses). A loop of its own: the
    branches in one loop made LLVM compile :func:`im2col`'s stride-1 copy ~1.3x slower."""
    _, channels, height, width = x.shape
    ncols = cols.shape[1]
    plane = oh * ow
    nb = ncols // plane
    xf, cf = x.reshape(-1), cols.reshape(-1)
    zero = f32(0.0)
    pwidth = (width + sw - 1) // sw
    span = sw * height * pwidth  # one image's phases of one channel
    for c in range(channels):
        for b in range(nb):
            xplane = ((n0 + b) * channels + c) * height * width
            _split_phases(xf[xplane:xplane + height * width], height, width, sw, phases[b * span:(b + 1) * span])
        for i in range(kh):
            for j in range(kw):
                r0 = ((c * kh + i) * kw + j) * ncols
                lo, hi = _valid(ow, j * dw - pw, sw, width)  # once per nb * oh rows: no table needed
                q, r = _phase_tap(j, sw, pw, dw)
                for b in range(nb):
                    for yo in range(oh):
                        d0 = r0 + b * plane + yo * ow
                        row = cf[d0:d0 + ow]
                        iy = yo * sh - ph + i * dh
                        if iy < 0 or iy >= height or hi <= lo:
                            for t in range(ow):
                                row[t] = zero
                            continue
                        for t in range(lo):
                            row[t] = zero
                        for t in range(hi, ow):
                            row[t] = zero
                        s0 = ((b * sw + r) * height + iy) * pwidth + lo + q
                        src, dst = phases[s0:s0 + hi - lo], row[lo:hi]
                        for t in range(hi - lo):
                            dst[t] = src[t]


@_jit
def depthwise(x, w, columns, bias, residual, out, sh, sw, ph, pw, dh, dw, act, alpha, beta):
    """Depthwise convolution with its epilogue: (N, C, H, W) x, (M, 1, kh, kw) w with M a
    multiple of C, (N, M, oh, ow) out; residual (N, M, oh, ow) or (0, 0, 0, 0). Each output row
    is accumulated tap by tap while it stays in L1, then finished (bias, residual, activation).
    Flat offsets, not row views: a view costs reference counting per row. ``columns``: the kernel
    columns' :func:`polyhal_cpu.native.column_table`."""
    n_img, channels, height, width = x.shape
    m_out, _, kh, kw = w.shape
    oh, ow = out.shape[2], out.shape[3]
    mult = m_out // channels
    has_residual = residual.shape[0] != 0
    xf, of, wf = x.reshape(-1), out.reshape(-1), w.reshape(-1)
    rf = residual.reshape(-1)
    los, his = columns[0], columns[1]
    for n in range(n_img):
        for m in range(m_out):
            xplane = (n * channels + m // mult) * height * width
            oplane = (n * m_out + m) * oh * ow
            b = bias[m]
            for yo in range(oh):
                o0 = oplane + yo * ow
                row = of[o0:o0 + ow]
                for xo in range(ow):
                    row[xo] = b
                for i in range(kh):
                    iy = yo * sh - ph + i * dh
                    if iy < 0 or iy >= height:
                        continue
                    for j in range(kw):
                        wv = wf[(m * kh + i) * kw + j]
                        lo, hi = los[j], his[j]
                        s0 = xplane + iy * width + j * dw - pw + lo * sw
                        # Views indexed by the loop counter itself: LLVM vectorises these
                        # loops, not ones indexed by counter + offset (measured 8x).
                        dst = row[lo:hi]
                        if sw == 1:  # a contiguous view (a slice with a step is typed strided)
                            src = xf[s0:s0 + hi - lo]
                            for t in range(hi - lo):
                                dst[t] += wv * src[t]
                        else:
                            for t in range(hi - lo):
                                dst[t] += wv * xf[s0 + t * sw]
                if has_residual:
                    res = rf[o0:o0 + ow]
                    for xo in range(ow):
                        row[xo] += res[xo]
            activate_row(of[oplane:oplane + oh * ow], act, alpha, beta)


@_jit
def col2im(cols, out, kh, kw, sh, sw, ph, pw, dh, dw, height, width):
    """Transposed convolution's scatter: (M * kh * kw, height * width) columns added into
    (M, OH, OW) out, tap (i, j) of input position (y, x) landing on (y sh + i dh - ph,
    x sw + j dw - pw) (positions cropped by the pads are dropped)."""
    m_out, oh, ow = out.shape
    for m in range(m_out):
        for i in range(kh):
            for j in range(kw):
                row = (m * kh + i) * kw + j
                x0 = j * dw - pw
                # input columns x whose output column x0 + x sw lies in [0, ow)
                lo = 0 if x0 >= 0 else (-x0 + sw - 1) // sw
                hi = 0 if x0 >= ow else min(width, (ow - 1 - x0) // sw + 1)
                for y in range(height):
                    yo = y * sh + i * dh - ph
                    if yo < 0 or yo >= oh:
                        continue
                    for x in range(lo, hi):
                        out[m, yo, x0 + x * sw] += cols[row, y * width + x]


@_jit
def pool2d(x, out, inv, phases, columns, kh, kw, sh, sw, ph, pw, dh, dw, is_max):
    """Max (is_max) or average pooling of (R, H, W) x into (R, oh, ow) out; taps in the
    padding are skipped; average multiplies the window's sum by inv (oh, ow). Each output row
    is accumulated tap by tap over the output positions the tap reaches (flat offsets and views
    indexed by the loop counter, as in ``depthwise``, so that LLVM vectorises the row: an element
    at a time, ResNet's first pool took ~10x onnxruntime's time). With a horizontal stride, each
    plane is first split into its ``sw`` column phases (phase r holds columns r, r + sw, ...), so
    that a tap reads a contiguous run of one phase rather than every sw-th element (a strided
    read is not vectorised: ResNet's 3x3 stride-2 pool went 1018 -> 525 us single-threaded).
    ``phases``: scratch of sw * H * ceil(W / sw) floats where sw > 1 (else unused); ``columns``: the
    kernel columns' :func:`polyhal_cpu.native.column_table`. The commonest windows take loops of
    their own (see ``_avg_pool_2x2``, ``_max_pool_2x2`` and ``_max_pool_3x3``)."""
    rows, height, width = x.shape
    oh, ow = out.shape[1], out.shape[2]
    xf, of, vf = x.reshape(-1), out.reshape(-1), inv.reshape(-1)
    plain = dh == 1 and dw == 1 and sh == 2 and sw == 2
    if plain and not is_max and kh == 2 and kw == 2 and ph == 0 and pw == 0 and 2 * oh <= height and 2 * ow <= width:
        _avg_pool_2x2(xf, of, vf, rows, height, width, oh, ow)
        return
    if plain and is_max and kh == 2 and kw == 2 and ph == 0 and pw == 0 and 2 * oh <= height and 2 * ow <= width:
        _max_pool_2x2(xf, of, rows, height, width, oh, ow)
        return
    if (plain and is_max and kh == 3 and kw == 3 and 0 <= ph <= 1 and 0 <= pw <= 1 and 2 * (oh - 1) - ph < height
            and phases.shape[0] >= width + 6):
        _max_pool_3x3(xf, of, rows, height, width, oh, ow, ph, pw, phases)
        return
    los, his, qs, rs = columns[0], columns[1], columns[2], columns[3]
    start = f32(-np.inf) if is_max else f32(0.0)
    pwidth = (width + sw - 1) // sw  # a phase's length
    for r in range(rows):
        if sw > 1:
            _split_phases(xf[r * height * width:(r + 1) * height * width], height, width, sw, phases)
        for yo in range(oh):
            o0 = (r * oh + yo) * ow
            row = of[o0:o0 + ow]
            for t in range(ow):
                row[t] = start
            for i in range(kh):
                iy = yo * sh - ph + i * dh
                if iy < 0 or iy >= height:
                    continue
                for j in range(kw):
                    lo, hi = los[j], his[j]
                    if sw == 1:
                        s0 = (r * height + iy) * width + j * dw - pw + lo
                        src = xf[s0:s0 + hi - lo]
                    else:
                        s0 = (rs[j] * height + iy) * pwidth + lo + qs[j]
                        src = phases[s0:s0 + hi - lo]
                    dst = row[lo:hi]
                    if is_max:
                        for t in range(hi - lo):
                            v, d = src[t], dst[t]
                            dst[t] = v if v > d or v != v else d
                    else:
                        for t in range(hi - lo):
                            dst[t] += src[t]
            if not is_max:
                scale = vf[yo * ow:yo * ow + ow]
                for t in range(ow):
                    row[t] *= scale[t]


@_jit
def _avg_pool_2x2(xf, of, vf, rows, height, width, oh, ow):
    """A 2x2 stride-2 average pool without padding whose windows all lie on the (R, H, W) input
    (flat ``xf``, ``of``; ``vf`` the (oh, ow) divisors' reciprocals): each output row from two
    input rows in one pass that LLVM vectorises (its stride-2 reads as interleaved loads).
    DenseNet's transition pools, single-threaded: 256x56x56 540 -> 85 us, 1024x14x14 450 ->
    55 us (2-core AVX-512 VM; the general loop split each plane into column phases first and
    paid its per-row set-up 2 x 2 times an output row)."""
    for r in range(rows):
        for yo in range(oh):
            a0 = (r * height + 2 * yo) * width
            a = xf[a0:a0 + width]
            b = xf[a0 + width:a0 + 2 * width]
            o0 = (r * oh + yo) * ow
            row = of[o0:o0 + ow]
            scale = vf[yo * ow:yo * ow + ow]
            for t in range(ow):
                row[t] = (a[2 * t] + a[2 * t + 1] + b[2 * t] + b[2 * t + 1]) * scale[t]


@_jit
def _nan_max(v, d):
    """max(v, d), nan where either is (a form LLVM vectorises, where an ``or`` of the two
    tests was not)."""
    m = v if v > d else d
    return v + d if v != v else m


@_jit
def _max_pool_2x2(xf, of, rows, height, width, oh, ow):
    """A 2x2 stride-2 max pool without padding whose windows all lie on the (R, H, W) input, as
    ``_avg_pool_2x2`` reads it (one pass per output row over two input rows); taps in the
    general loop's order, so ties and nan come out the same. The CNN QDQ bench's 8 x 16 x 8 x 8
    pool took 19.7 us in the general loop (column phases first) against 5.4 us for the average."""
    for r in range(rows):
        for yo in range(oh):
            a0 = (r * height + 2 * yo) * width
            a = xf[a0:a0 + width]
            b = xf[a0 + width:a0 + 2 * width]
            o0 = (r * oh + yo) * ow
            row = of[o0:o0 + ow]
            for t in range(ow):
                row[t] = _nan_max(b[2 * t + 1], _nan_max(b[2 * t], _nan_max(a[2 * t + 1], a[2 * t])))


@_jit
def _max_pool_3x3(xf, of, rows, height, width, oh, ow, ph, pw, work):
    """A 3x3 stride-2 max pool (pads 0 or 1 on each axis, ceil_mode's extra end column or row
    allowed) of the (R, H, W) input ``xf`` into ``of`` (flat): per output row, the maximum of
    the window's (up to) three input rows, split into its even and odd columns (work[1:] and
    work[ne + 3:], -inf on either side: the padding), then the window's three columns (even t,
    odd t - 1 and t with a left pad; even t and t + 1, odd t without) from those contiguous
    runs, both passes vectorised. ResNet's/DenseNet's stem pool (64x112x112), single-threaded:
    546 -> ~180 us (2-core AVX-512 VM)."""
    half, ne = width // 2, (width + 1) // 2
    odd = ne + 2  # the odd columns' guard, then the odd columns
    low = f32(-np.inf)
    work[0], work[1 + ne], work[odd], work[odd + 1 + half], work[odd + 2 + half] = low, low, low, low, low
    ev, od = work[1:1 + ne], work[odd + 1:odd + 1 + half]
    if pw == 1:  # input columns 2t - 1, 2t, 2t + 1
        c0, c1, c2 = work[odd:], work[1:], work[odd + 1:]
    else:  # 2t, 2t + 1, 2t + 2
        c0, c1, c2 = work[1:], work[odd + 1:], work[2:]
    for r in range(rows):
        for yo in range(oh):
            top = 2 * yo - ph
            i0, i1 = max(top, 0), min(top + 3, height)
            a0 = (r * height + i0) * width
            a = xf[a0:a0 + width]
            if i1 - i0 == 3:
                b, c = xf[a0 + width:a0 + 2 * width], xf[a0 + 2 * width:a0 + 3 * width]
                for t in range(half):
                    ev[t] = _nan_max(_nan_max(a[2 * t], b[2 * t]), c[2 * t])
                    od[t] = _nan_max(_nan_max(a[2 * t + 1], b[2 * t + 1]), c[2 * t + 1])
                if ne > half:
                    ev[half] = _nan_max(_nan_max(a[width - 1], b[width - 1]), c[width - 1])
            elif i1 - i0 == 2:
                b = xf[a0 + width:a0 + 2 * width]
                for t in range(half):
                    ev[t] = _nan_max(a[2 * t], b[2 * t])
                    od[t] = _nan_max(a[2 * t + 1], b[2 * t + 1])
                if ne > half:
                    ev[half] = _nan_max(a[width - 1], b[width - 1])
            else:
                for t in range(half):
                    ev[t] = a[2 * t]
                    od[t] = a[2 * t + 1]
                if ne > half:
                    ev[half] = a[width - 1]
            o0 = (r * oh + yo) * ow
            row = of[o0:o0 + ow]
            for t in range(ow):
                row[t] = _nan_max(_nan_max(c0[t], c1[t]), c2[t])


# ------------------------------------------------------------- channel-blocked (NCHWc, c = C)

@_jit
def epilogue_channels_last(y, bias, residual, act, alpha, beta):
    """In place over (pixels, C) y: act(y + bias[c] (+ residual)); residual (pixels, C) or (0, 0).
    2-D indexing with the channel as the loop counter (no row views: with 16-64 channels a view
    per pixel cost more than its arithmetic), and the activation over blocks of ~4096 elements
    at a time (one long vectorised loop, the block still in L1)."""
    rows, cols = y.shape
    has_residual = residual.shape[0] != 0
    flat = y.reshape(-1)
    block = max(1, 4096 // max(cols, 1))
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        for r in range(r0, r1):
            if has_residual:
                for c in range(cols):
                    y[r, c] += bias[c] + residual[r, c]
            else:
                for c in range(cols):
                    y[r, c] += bias[c]
        activate_row(flat[r0 * cols:r1 * cols], act, alpha, beta)


@_jit
def matvec_channels_last(x, wt, bias, residual, out, act, alpha, beta):
    """out (pixels, M) = act(x (pixels, C) @ wt (C, M) + bias (+ residual (pixels, M), or
    (0, 0))) for a few pixels (a squeeze-excite block's 1x1 convs over a 1x1 map): each row of
    the weights is read once, from memory, and added into every pixel's output row, which stay
    in L1 (a GEMM of one row packs all the weights first: OpenBLAS's sgemm took 60-100 us for
    MobileNetV3's 960 -> 240 channels, memory-bound at ~0.9 MB)."""
    pixels, cdim = x.shape
    m = out.shape[1]
    has_residual = residual.shape[0] != 0
    for p in range(pixels):
        orow = out[p]
        for k in range(m):
            orow[k] = bias[k]
    for c in range(cdim):
        wrow = wt[c]
        for p in range(pixels):
            v, orow = x[p, c], out[p]
            for k in range(m):
                orow[k] += v * wrow[k]
    for p in range(pixels):
        orow = out[p]
        if has_residual:
            for k in range(m):
                orow[k] += residual[p, k]
        activate_row(orow, act, alpha, beta)


#: Channels from which the depthwise loop takes 4 output pixels at a time (below, the wider
#: loop body measured slower: 112x112x16 3x3 380 -> 605 us, 14x14x672 5x5 209 -> 166 us).
QUAD_CHANNELS = 96


@_jit
def _row3_quad(orow, xr, wr, xo, x0, channels):
    """Output pixels xo..xo+3 of a row, a 3-wide stride-1 undilated kernel row whose first tap
    reads input column x0: 6 input columns loaded for 12 multiply-adds (3 per pixel alone)."""
    for c in range(channels):
        w0, w1, w2 = wr[0, c], wr[1, c], wr[2, c]
        a, b, d, e, f, g = xr[x0, c], xr[x0 + 1, c], xr[x0 + 2, c], xr[x0 + 3, c], xr[x0 + 4, c], xr[x0 + 5, c]
        orow[xo, c] += w0 * a + w1 * b + w2 * d
        orow[xo + 1, c] += w0 * b + w1 * d + w2 * e
        orow[xo + 2, c] += w0 * d + w1 * e + w2 * f
        orow[xo + 3, c] += w0 * e + w1 * f + w2 * g


@_jit
def _row5_quad(orow, xr, wr, xo, x0, channels):
    """As :func:`_row3_quad` for a 5-wide kernel row: 8 input columns for 20 multiply-adds."""
    for c in range(channels):
        w0, w1, w2, w3, w4 = wr[0, c], wr[1, c], wr[2, c], wr[3, c], wr[4, c]
        a, b, d, e, f = xr[x0, c], xr[x0 + 1, c], xr[x0 + 2, c], xr[x0 + 3, c], xr[x0 + 4, c]
        g, h, k = xr[x0 + 5, c], xr[x0 + 6, c], xr[x0 + 7, c]
        orow[xo, c] += w0 * a + w1 * b + w2 * d + w3 * e + w4 * f
        orow[xo + 1, c] += w0 * b + w1 * d + w2 * e + w3 * f + w4 * g
        orow[xo + 2, c] += w0 * d + w1 * e + w2 * f + w3 * g + w4 * h
        orow[xo + 3, c] += w0 * e + w1 * f + w2 * g + w3 * h + w4 * k


@_jit
def _row7_quad(orow, xr, wr, xo, x0, channels):
    """As :func:`_row3_quad` for a 7-wide kernel row (ConvNeXt's): 10 input columns for 28
    multiply-adds."""
    for c in range(channels):
        w0, w1, w2, w3, w4, w5, w6 = wr[0, c], wr[1, c], wr[2, c], wr[3, c], wr[4, c], wr[5, c], wr[6, c]
        a, b, d, e, f = xr[x0, c], xr[x0 + 1, c], xr[x0 + 2, c], xr[x0 + 3, c], xr[x0 + 4, c]
        g, h, k, l, q = xr[x0 + 5, c], xr[x0 + 6, c], xr[x0 + 7, c], xr[x0 + 8, c], xr[x0 + 9, c]
        orow[xo, c] += w0 * a + w1 * b + w2 * d + w3 * e + w4 * f + w5 * g + w6 * h
        orow[xo + 1, c] += w0 * b + w1 * d + w2 * e + w3 * f + w4 * g + w5 * h + w6 * k
        orow[xo + 2, c] += w0 * d + w1 * e + w2 * f + w3 * g + w4 * h + w5 * k + w6 * l
        orow[xo + 3, c] += w0 * e + w1 * f + w2 * g + w3 * h + w4 * k + w5 * l + w6 * q


@_jit
def _kernel_row(orow, xr, wr, xo, x0, width, dw, channels):
    """Output pixel xo of a row, one kernel row (kw, C) whose first tap reads input column x0:
    a 3- or 5-wide row inside the image in one expression (one load and store of the output per
    kernel row, not per tap), other widths and edge pixels tap by tap."""
    kw = wr.shape[0]
    if x0 >= 0 and x0 + (kw - 1) * dw < width and kw == 3:
        x1, x2 = x0 + dw, x0 + 2 * dw
        for c in range(channels):
            orow[xo, c] += wr[0, c] * xr[x0, c] + wr[1, c] * xr[x1, c] + wr[2, c] * xr[x2, c]
    elif x0 >= 0 and x0 + (kw - 1) * dw < width and kw == 5:
        x1, x2, x3, x4 = x0 + dw, x0 + 2 * dw, x0 + 3 * dw, x0 + 4 * dw
        for c in range(channels):
            orow[xo, c] += (wr[0, c] * xr[x0, c] + wr[1, c] * xr[x1, c] + wr[2, c] * xr[x2, c]
                            + wr[3, c] * xr[x3, c] + wr[4, c] * xr[x4, c])
    else:
        for j in range(kw):
            ix = x0 + j * dw
            if ix < 0 or ix >= width:
                continue
            for c in range(channels):
                orow[xo, c] += wr[j, c] * xr[ix, c]


#: Output pixels per conv tile (:func:`_tap_tile16`, :func:`_image_tile32`): a vector register
#: (or two) each.
DW_PIXELS = 8


def _image_tile_codegen(lanes: int, nvec: int, broadcast: bool = True):
    """IR of a dense conv's tile over an image's planes: DW_PIXELS output pixels of one output
    row x ``nvec`` vectors of ``lanes`` output channels, accumulated in registers over taps
    t0 .. t1 (tap t: the input value at x + xoff[t] + q * sp for pixel q, broadcast, times the
    weights' vector at w + woff[t]), from the bias at ``ba``, then stored once. Not
    ``broadcast``: a depthwise conv's tile, the input's vector of ``lanes`` channels at
    x + xoff[t] + q * sp (one vector: ``nvec`` 1)."""
    def codegen(context, builder, signature, args):
        from llvmlite import ir

        xa, sp, xoff, wa, woff, t0, t1, oa, op, ba = args
        i64, i32t, f32t = ir.IntType(64), ir.IntType(32), ir.FloatType()
        vec = ir.VectorType(f32t, lanes)
        fptr, vptr = f32t.as_pointer(), vec.as_pointer()
        name = f"llvm.fma.v{lanes}f32"
        fma = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(vec, [vec] * 3), name)
        px, pw, po, pb = (builder.inttoptr(a, fptr) for a in (xa, wa, oa, ba))
        pxo, pwo = builder.inttoptr(xoff, i64.as_pointer()), builder.inttoptr(woff, i64.as_pointer())
        undef = ir.Constant(vec, ir.Undefined)
        splat = ir.Constant(ir.VectorType(i32t, lanes), [0] * lanes)
        load = lambda base, at: builder.load(builder.bitcast(builder.gep(base, [at]), vptr), align=4)  # noqa: E731
        starts = [load(pb, ir.Constant(i64, lanes * v)) for v in range(nvec)]
        entry = builder.block
        loop = builder.append_basic_block("image.taps")
        done = builder.append_basic_block("image.done")
        builder.cbranch(builder.icmp_signed("<", t0, t1), loop, done)
        builder.position_at_end(loop)
        t = builder.phi(i64)
        accs = [builder.phi(vec) for _ in range(DW_PIXELS * nvec)]
        xt = builder.gep(px, [builder.load(builder.gep(pxo, [t]), align=8)])
        wt = builder.gep(pw, [builder.load(builder.gep(pwo, [t]), align=8)])
        wv = [load(wt, ir.Constant(i64, lanes * v)) for v in range(nvec)]
        new = []
        for q in range(DW_PIXELS):
            at = builder.mul(ir.Constant(i64, q), sp)
            if broadcast:
                value = builder.load(builder.gep(xt, [at]), align=4)
                xv = builder.shuffle_vector(builder.insert_element(undef, value, ir.Constant(i32t, 0)), undef, splat)
            else:
                xv = load(xt, at)
            new += [builder.call(fma, [xv, wv[v], accs[q * nvec + v]]) for v in range(nvec)]
        t_next = builder.add(t, ir.Constant(i64, 1))
        builder.cbranch(builder.icmp_signed("<", t_next, t1), loop, done)
        t.add_incoming(t0, entry)
        t.add_incoming(t_next, loop)
        for i, acc in enumerate(accs):
            acc.add_incoming(starts[i % nvec], entry)
            acc.add_incoming(new[i], loop)
        builder.position_at_end(done)
        finals = []
        for i in range(DW_PIXELS * nvec):  # the phis first: LLVM wants them at the top of the block
            final = builder.phi(vec)
            final.add_incoming(starts[i % nvec], entry)
            final.add_incoming(new[i], loop)
            finals.append(final)
        for q in range(DW_PIXELS):
            row = builder.gep(po, [builder.mul(ir.Constant(i64, q), op)])
            for v in range(nvec):
                builder.store(finals[q * nvec + v], builder.bitcast(builder.gep(row, [ir.Constant(i64, lanes * v)]),
                                                                    vptr), align=4)
        return context.get_dummy_value()
    return codegen


def _make_image_tile(lanes: int, nvec: int, broadcast: bool = True):
    from numba import types
    from numba.extending import intrinsic

    def typer(typingctx, xa, sp, xoff, wa, woff, t0, t1, oa, op, ba):
        return types.void(*[types.intp] * 10), _image_tile_codegen(lanes, nvec, broadcast)
    return intrinsic(typer)


#: ``_image_tile32(x, sp, xoff, w, woff, t0, t1, out, op, bias)`` (addresses; ``sp``, ``op``
#: strides in floats; ``xoff``, ``woff`` int64 offsets in floats): see :func:`_image_tile_codegen`;
#: 32 output channels at a time, ``_image_tile16`` 16 and ``_image_tile8`` 8.
_image_tile32, _image_tile16, _image_tile8 = _make_image_tile(16, 2), _make_image_tile(16, 1), _make_image_tile(8, 1)
#: ``_tap_tile16`` / ``_tap_tile8``: the same arguments, a depthwise conv's tile of 16 or 8
#: channels (the input's vectors, not broadcast values).
_tap_tile16, _tap_tile8 = _make_image_tile(16, 1, False), _make_image_tile(8, 1, False)

@_jit
def _finish_row(orow, residual, n, yo, has_residual, act, alpha, beta):
    """A channels-last output row (pixels, channels) finished: row (n, yo) of the residual added,
    then the activation."""
    if has_residual:
        rrow = residual[n, yo]
        for xo in range(orow.shape[0]):
            for c in range(orow.shape[1]):
                orow[xo, c] += rrow[xo, c]
    activate_row(orow.reshape(-1), act, alpha, beta)


@_jit
def depthwise_channels_last(x, taps, offsets, bias, residual, out, sh, sw, ph, pw, dh, dw, act, alpha, beta):
    """Depthwise convolution of (N, H, W, C) x with (kh, kw, C) taps into (N, oh, ow, C) out,
    residual (N, oh, ow, C) or (0, 0, 0, 0), vectorised across the channels whatever the stride.
    Output row by output row: the row (ow, C) starts as the bias, each kernel row adds its taps
    (:func:`_kernel_row`; the loop is bound by loads and stores: one expression per 3- or 5-wide
    kernel row measured 1.2-1.6x faster than tap by tap on MobileNet's shapes, and with many
    channels four pixels at a time, sharing their input columns, up to 1.5x more; 7-wide rows
    four pixels at a time only), then the residual and the activation finish it while it is in L1.
    Where the channels come in whole vector registers (8 or 16), the pixels whose taps all lie
    inside the image's width go DW_PIXELS at a time through :func:`_tap_tile16` / ``_tap_tile8``,
    which keep the pixels' sums in registers across all taps and store each once (measured
    single-threaded: EfficientNet's 56x56x144 3x3 0.49 -> 0.28 ms, 28x28x240 5x5 0.36 -> 0.20
    ms; 7x7 planes, with no 8 such pixels, as before). The tiles run one loop over the taps
    through per-tap offsets (a loop over kernel rows and one over their taps, each carrying the
    sums, measured 10-20% slower on MobileNetV3's 5x5 convs)."""
    n_img, height, width, channels = x.shape
    kh, kw = taps.shape[0], taps.shape[1]
    oh, ow = out.shape[1], out.shape[2]
    has_residual = residual.shape[0] != 0
    span = (kw - 1) * dw
    # channels a vector register at a time: the tiles serve the pixels whose taps all lie
    # inside the image's width, DW_PIXELS at a time (the loops below the rest)
    # (they address the arrays' memory directly: C-contiguous ones only)
    lanes = 16 if channels % 16 == 0 else 8 if channels % 8 == 0 else 0
    if not (x.flags.c_contiguous and taps.flags.c_contiguous and bias.flags.c_contiguous and out.flags.c_contiguous):
        lanes = 0
    quad = sw == 1 and dw == 1 and (kw == 3 or kw == 5 or kw == 7) and channels >= QUAD_CHANNELS
    # with quad: the first and last output columns whose taps all lie inside the image
    first, last = max(pw, 0), min(ow, width - kw + 1 + pw)
    t0 = min((pw + sw - 1) // sw, ow)  # the tiles' pixels: t0 .. t1
    t1 = t0 + max(0, min(ow, (width - 1 - span + pw) // sw + 1) - t0) // DW_PIXELS * DW_PIXELS if lanes else t0
    xa, wa, oa, ba = x.ctypes.data, taps.ctypes.data, out.ctypes.data, bias.ctypes.data
    # per tap (i, j): its input's and its weights' offsets, for the tiles' one loop over the taps
    # (kernel rows inside the image are one run of them)
    # (``offsets`` (2, kh * kw): made once, by :func:`polyhal_cpu.native.depthwise_offsets`)
    xoa, woa = offsets.ctypes.data, offsets.ctypes.data + kh * kw * 8
    for n in range(n_img):
        for yo in range(oh):
            orow = out[n, yo]
            if t1 > t0:
                top = yo * sh - ph
                i0 = max(0, (-top + dh - 1) // dh)
                i1 = max(i0, min(kh, (height - 1 - top) // dh + 1))
                for xo in range(t0, t1, DW_PIXELS):
                    base = xa + (((n * height + top) * width + xo * sw - pw) * channels) * 4
                    for c0 in range(0, channels, lanes):
                        args = (base + c0 * 4, sw * channels, xoa, wa + c0 * 4, woa, i0 * kw, i1 * kw,
                                oa + (((n * oh + yo) * ow + xo) * channels + c0) * 4, channels, ba + c0 * 4)
                        if lanes == 16:
                            _tap_tile16(*args)
                        else:
                            _tap_tile8(*args)
            for xo in range(ow):
                if xo < t0 or xo >= t1:
                    for c in range(channels):
                        orow[xo, c] = bias[c]
            for i in range(kh):
                iy = yo * sh - ph + i * dh
                if iy < 0 or iy >= height:
                    continue
                xr, wr = x[n, iy], taps[i]
                if not quad:  # _kernel_row's body in line: called per pixel it measured ~1.5x slower
                    for xo in range(ow):
                        if t0 <= xo < t1:
                            continue
                        x0 = xo * sw - pw
                        inside = x0 >= 0 and x0 + span < width
                        if inside and kw == 3:
                            x1, x2 = x0 + dw, x0 + 2 * dw
                            for c in range(channels):
                                orow[xo, c] += wr[0, c] * xr[x0, c] + wr[1, c] * xr[x1, c] + wr[2, c] * xr[x2, c]
                        elif inside and kw == 5:
                            x1, x2, x3, x4 = x0 + dw, x0 + 2 * dw, x0 + 3 * dw, x0 + 4 * dw
                            for c in range(channels):
                                orow[xo, c] += (wr[0, c] * xr[x0, c] + wr[1, c] * xr[x1, c] + wr[2, c] * xr[x2, c]
                                                + wr[3, c] * xr[x3, c] + wr[4, c] * xr[x4, c])
                        else:
                            for j in range(kw):
                                ix = x0 + j * dw
                                if ix < 0 or ix >= width:
                                    continue
                                for c in range(channels):
                                    orow[xo, c] += wr[j, c] * xr[ix, c]
                    continue
                for xo in range(min(first, ow)):
                    _kernel_row(orow, xr, wr, xo, xo - pw, width, dw, channels)
                xo = max(first, t1)  # the tiles' pixels start at first (stride 1: t0 == first)
                while xo + 4 <= last:
                    if kw == 3:
                        _row3_quad(orow, xr, wr, xo, xo - pw, channels)
                    elif kw == 5:
                        _row5_quad(orow, xr, wr, xo, xo - pw, channels)
                    else:
                        _row7_quad(orow, xr, wr, xo, xo - pw, channels)
                    xo += 4
                for xo in range(xo, ow):
                    _kernel_row(orow, xr, wr, xo, xo - pw, width, dw, channels)
            _finish_row(orow, residual, n, yo, has_residual, act, alpha, beta)


@_jit
def depthwise_flat_rows(x, wtile, btile, residual, out, ph, pw, dh, dw, act, alpha, beta):
    """:func:`depthwise_channels_last` at stride 1 for few channels: an output row (ow, C) is
    one flat run of ow * C elements, and so is the input under each tap, so with the taps tiled
    along a row (``wtile`` (kh, kw, ow * C), ``btile`` the bias likewise) each tap is one long
    vectorised multiply-add. (Vectorised across 16 or 24 channels alone, the loop ran mostly in
    its scalar remainder: 112x112x16 3x3 348 -> 185 us.)"""
    n_img, height, width, channels = x.shape
    kh, kw = wtile.shape[0], wtile.shape[1]
    oh, ow = out.shape[1], out.shape[2]
    has_residual = residual.shape[0] != 0
    rowlen = ow * channels
    xf, of, rf = x.reshape(-1), out.reshape(-1), residual.reshape(-1)
    for n in range(n_img):
        for yo in range(oh):
            o0 = (n * oh + yo) * rowlen
            orow = of[o0:o0 + rowlen]
            for t in range(rowlen):
                orow[t] = btile[t]
            for i in range(kh):
                iy = yo - ph + i * dh
                if iy < 0 or iy >= height:
                    continue
                x0 = (n * height + iy) * width * channels
                # a 3-wide kernel row's taps in one pass over the pixels all three reach (one
                # load and store of the output for three multiply-adds), the rest tap by tap
                # (each tap's valid range at stride 1: no division, no table)
                c_lo, c_hi = 0, 0
                if kw == 3:
                    (l0, h0), (l1, h1), (l2, h2) = _valid(ow, -pw, 1, width), _valid(ow, dw - pw, 1, width), \
                        _valid(ow, 2 * dw - pw, 1, width)
                    c_lo, c_hi = max(l0, l1, l2), min(h0, h1, h2)
                if c_hi > c_lo:
                    length = (c_hi - c_lo) * channels
                    dst = orow[c_lo * channels:c_hi * channels]
                    s0 = x0 + (c_lo - pw) * channels
                    a, b, c = xf[s0:s0 + length], xf[s0 + dw * channels:s0 + dw * channels + length], \
                        xf[s0 + 2 * dw * channels:s0 + 2 * dw * channels + length]
                    wa_, wb, wc = wtile[i, 0, c_lo * channels:c_hi * channels], \
                        wtile[i, 1, c_lo * channels:c_hi * channels], wtile[i, 2, c_lo * channels:c_hi * channels]
                    for t in range(length):
                        dst[t] += wa_[t] * a[t] + wb[t] * b[t] + wc[t] * c[t]
                for j in range(kw):
                    tlo, thi = _valid(ow, j * dw - pw, 1, width)
                    for part in range(2):  # the tap's pixels below the common span, then above it
                        lo, hi = (tlo, min(thi, c_lo)) if part == 0 else (max(tlo, c_hi), thi)
                        if c_hi <= c_lo:  # no common span: the tap's whole range, once
                            lo, hi = (tlo, thi) if part == 0 else (0, 0)
                        if hi <= lo:
                            continue
                        length = (hi - lo) * channels
                        dst = orow[lo * channels:hi * channels]
                        s0 = x0 + (lo + j * dw - pw) * channels
                        src, wv = xf[s0:s0 + length], wtile[i, j, lo * channels:hi * channels]
                        for t in range(length):
                            dst[t] += wv[t] * src[t]
            if has_residual:
                res = rf[o0:o0 + rowlen]
                for t in range(rowlen):
                    orow[t] += res[t]
            activate_row(orow, act, alpha, beta)




@_jit
def conv_image_channels_last(x, taps, xoff, woff, bias, residual, out, n0, n1, y0, y1, sh, sw, ph, pw, dh, dw, act,
                             alpha, beta):
    """A dense (one group) convolution of an image of few channels, (N, C, H, W) x as it lies
    (a network's first conv, reading RGB planes), into channels-last (N, oh, ow, M) out: images
    n0 .. n1, output rows y0 .. y1; (kh, C, kw, M) taps, residual (N, oh, ow, M) or (0, 0, 0, 0).

    ``xoff``, ``woff``: per tap (i, c, j) in that order, its input offset c * H * W + i * dh * W
    + j * dw and its weights' offset in ``taps``, so that the taps of the kernel rows inside the
    image are one run. The output pixels whose taps all lie inside the image's width go
    DW_PIXELS at a time through :func:`_image_tile32` (and its narrower kins), which keep the
    pixels' sums in registers over all C * kh * kw taps (each input value broadcast across the
    output channels) and store each once; the edge pixels tap by tap. Then the residual and the
    activation finish the row while it is in L1. (An im2col and a GEMM of K = 27 measured
    ~0.5 ms for MobileNet's 3 -> 16 channel stem at 224x224, then a relayout to channels-last.)"""
    n_img, channels, height, width = x.shape
    kh, kw, m = taps.shape[0], taps.shape[2], taps.shape[3]
    oh, ow = out.shape[1], out.shape[2]
    has_residual = residual.shape[0] != 0
    per_row = channels * kw
    span = (kw - 1) * dw
    step = 32 if m % 32 == 0 else 16 if m % 16 == 0 else 8 if m % 8 == 0 else 0
    if not (x.flags.c_contiguous and taps.flags.c_contiguous and bias.flags.c_contiguous and out.flags.c_contiguous):
        step = 0
    # the tiles' pixels t0 .. t1: those whose taps all lie inside the image's width, the last
    # tile moved left to end at t1 where their count is no multiple of DW_PIXELS (it computes
    # some pixels twice, alike)
    t0 = min((pw + sw - 1) // sw, ow)
    t1 = max(t0, min(ow, (width - 1 - span + pw) // sw + 1))
    if t1 - t0 < DW_PIXELS or step == 0:
        t1 = t0
    xa, wa, oa, ba = x.ctypes.data, taps.ctypes.data, out.ctypes.data, bias.ctypes.data
    xoa, woa = xoff.ctypes.data, woff.ctypes.data
    for n in range(n0, n1):
        for yo in range(y0, y1):
            top = yo * sh - ph
            i0 = max(0, (-top + dh - 1) // dh)
            i1 = min(kh, (height - 1 - top) // dh + 1)
            orow = out[n, yo]
            for xt in range(t0, t1, DW_PIXELS):
                xo = min(xt, t1 - DW_PIXELS)
                base = xa + ((n * channels * height + top) * width + xo * sw - pw) * 4
                for c0 in range(0, m, step):
                    args = (base, sw, xoa, wa + c0 * 4, woa, i0 * per_row, max(i0, i1) * per_row,
                            oa + (((n * oh + yo) * ow + xo) * m + c0) * 4, m, ba + c0 * 4)
                    if step == 32:
                        _image_tile32(*args)
                    elif step == 16:
                        _image_tile16(*args)
                    else:
                        _image_tile8(*args)
            for xo in range(ow):
                if t0 <= xo < t1:
                    continue
                for k in range(m):
                    orow[xo, k] = bias[k]
                for i in range(i0, i1):
                    iy = top + i * dh
                    for c in range(channels):
                        for j in range(kw):
                            ix = xo * sw - pw + j * dw
                            if ix < 0 or ix >= width:
                                continue
                            v, wr = x[n, c, iy, ix], taps[i, c, j]
                            for k in range(m):
                                orow[xo, k] += v * wr[k]
            _finish_row(orow, residual, n, yo, has_residual, act, alpha, beta)


# ------------------------------------------------------------------ convolution as packed GEMM
#
# out (M, positions) = W (M, K) @ B (K, positions) with K = C * taps, computed a tile of
# GEMM_MR output channels x GEMM_NR positions at a time by a register-blocked micro-kernel
# written in LLVM IR (:func:`_tile`): numba's own loops keep no accumulator tile in registers
# (a 4 x 32 tile in numba reached ~7 GFLOP/s). The weights are packed once into panels of
# GEMM_MR rows, k-major (:func:`polyhal_cpu.conv_kernels` keeps the packed copy of a plan's
# constants); B is packed a panel of GEMM_NR columns at a time from the rows of a source array
# (row k starts at ``rowoff[k]``): an image (1x1 convs), im2col columns, or a zero-padded image
# read at each tap's offset (stride-1 convs: no im2col). Each tile is finished (bias, residual,
# activation) while it is in L1, and only the output positions it covers are stored.

GEMM_MR, GEMM_NR = 8, 32
#: The residual row the tiles read for a conv without one (a global: numba freezes it into the
#: compiled code, read-only, so no call allocates it).
_ZERO_ROW = np.zeros(GEMM_NR, np.float32)


def _tile_codegen(strided: bool, bias_of: str | None, nv: int = GEMM_NR // 16):
    """The micro-kernel's IR: A packed (k-major panels of GEMM_MR rows) or, ``strided``, read
    where it lies (row r at a + r * ars floats, consecutive along k); with ``bias_of``, finished
    in registers before it is stored: + the bias (``"columns"``: GEMM_NR values at ``bias``, the
    same for every row; ``"rows"``: row r's value at bias + r), + row r of a residual at ``res``
    + r * ldr floats (ldr 0: one row for all), relu if ``relu``."""
    fused = bias_of is not None

    def codegen(context, builder, signature, args):
        from llvmlite import ir

        a, ars, b, rowoff, k, c, ldc = args[:7]
        bias, res, ldr, relu = args[7:] if fused else (None,) * 4
        i64, i32t, f32t = ir.IntType(64), ir.IntType(32), ir.FloatType()
        vec = ir.VectorType(f32t, 16)
        fptr, vptr, i8p = f32t.as_pointer(), vec.as_pointer(), ir.IntType(8).as_pointer()
        module = builder.module
        fma = module.globals.get("llvm.fma.v16f32") or ir.Function(module, ir.FunctionType(vec, [vec, vec, vec]),
                                                                   "llvm.fma.v16f32")
        prefetch = module.globals.get("llvm.prefetch") or ir.Function(
            module, ir.FunctionType(ir.VoidType(), [i8p, i32t, i32t, i32t]), "llvm.prefetch")
        pa, pb, pc = builder.inttoptr(a, fptr), builder.inttoptr(b, fptr), builder.inttoptr(c, fptr)
        offsets = builder.inttoptr(rowoff, i64.as_pointer())
        arows = [builder.gep(pa, [builder.mul(ir.Constant(i64, r), ars)]) for r in range(GEMM_MR)] if strided else None
        zero = ir.Constant(vec, None)
        undef = ir.Constant(vec, ir.Undefined)
        splat = ir.Constant(ir.VectorType(i32t, 16), [0] * 16)
        entry = builder.block
        loop = builder.append_basic_block("tile.loop")
        done = builder.append_basic_block("tile.done")
        builder.cbranch(builder.icmp_signed(">", k, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        kk = builder.phi(i64)
        kk.add_incoming(ir.Constant(i64, 0), entry)
        accs = []
        for _ in range(GEMM_MR * nv):
            acc = builder.phi(vec)
            acc.add_incoming(zero, entry)
            accs.append(acc)
        brow = builder.gep(pb, [builder.load(builder.gep(offsets, [kk]), align=8)])
        bv = [builder.load(builder.bitcast(builder.gep(brow, [ir.Constant(i64, 16 * v)]), vptr), align=4)
              for v in range(nv)]
        # B's rows may lie far apart (an image's planes): fetch the next tile's part of this row
        # ahead, which the hardware prefetcher, following a handful of streams, does not
        builder.call(prefetch, [builder.bitcast(builder.gep(brow, [ir.Constant(i64, GEMM_NR)]), i8p),
                                ir.Constant(i32t, 0), ir.Constant(i32t, 3), ir.Constant(i32t, 1)])
        arow = None if strided else builder.gep(pa, [builder.mul(kk, ir.Constant(i64, GEMM_MR))])
        new = []
        for r in range(GEMM_MR):
            where = builder.gep(arows[r], [kk]) if strided else builder.gep(arow, [ir.Constant(i64, r)])
            sv = builder.shuffle_vector(builder.insert_element(undef, builder.load(where, align=4),
                                                               ir.Constant(i32t, 0)), undef, splat)
            new += [builder.call(fma, [sv, bv[v], accs[r * nv + v]]) for v in range(nv)]
        nxt = builder.add(kk, ir.Constant(i64, 1))
        end = builder.block
        kk.add_incoming(nxt, end)
        for acc, value in zip(accs, new):
            acc.add_incoming(value, end)
        builder.cbranch(builder.icmp_signed("<", nxt, k), loop, done)
        builder.position_at_end(done)
        finals = []
        for value in new:  # the phis first: LLVM wants them at the top of the block
            final = builder.phi(vec)
            final.add_incoming(zero, entry)
            final.add_incoming(value, end)
            finals.append(final)
        if fused:
            pbias, pres = builder.inttoptr(bias, fptr), builder.inttoptr(res, fptr)
            if bias_of == "columns":
                bvec = [builder.load(builder.bitcast(builder.gep(pbias, [ir.Constant(i64, 16 * v)]), vptr), align=4)
                        for v in range(nv)]
            else:
                bvec = [builder.shuffle_vector(builder.insert_element(undef, builder.load(builder.gep(
                    pbias, [ir.Constant(i64, r)]), align=4), ir.Constant(i32t, 0)), undef, splat)
                    for r in range(GEMM_MR)]
            bits = ir.VectorType(ir.IntType(1), 16)
            clamp = builder.shuffle_vector(builder.insert_element(ir.Constant(bits, ir.Undefined), builder.icmp_signed(
                "!=", relu, ir.Constant(i64, 0)), ir.Constant(i32t, 0)), ir.Constant(bits, ir.Undefined), splat)
        for r in range(GEMM_MR):
            crow = builder.gep(pc, [builder.mul(ir.Constant(i64, r), ldc)])
            rrow = builder.gep(pres, [builder.mul(ir.Constant(i64, r), ldr)]) if fused else None
            for v in range(nv):
                value = finals[r * nv + v]
                if fused:
                    at = ir.Constant(i64, 16 * v)
                    value = builder.fadd(builder.fadd(value, bvec[v] if bias_of == "columns" else bvec[r]),
                                         builder.load(builder.bitcast(builder.gep(rrow, [at]), vptr), align=4))
                    # relu as the loops do it: a nan stays nan (an ordered compare is false for it)
                    negative = builder.and_(builder.fcmp_ordered("<", value, zero), clamp)
                    value = builder.select(negative, zero, value)
                builder.store(value, builder.bitcast(builder.gep(crow, [ir.Constant(i64, 16 * v)]), vptr), align=4)
        return context.get_dummy_value()
    return codegen


def _make_tile(strided: bool, bias_of: str | None, nv: int = GEMM_NR // 16):
    from numba import types
    from numba.extending import intrinsic

    if bias_of is not None:
        def typer(typingctx, a, ars, b, rowoff, k, c, ldc, bias, res, ldr, relu):
            return types.void(*[types.intp] * 11), _tile_codegen(strided, bias_of, nv)
    else:
        def typer(typingctx, a, ars, b, rowoff, k, c, ldc):
            return types.void(*[types.intp] * 7), _tile_codegen(strided, None)
    return intrinsic(typer)


#: ``_tile(a, ars, b, rowoff, k, c, ldc)`` (addresses; float32, int64 rowoff): the (GEMM_MR,
#: GEMM_NR) tile at c (rows ldc floats apart) = A (GEMM_MR, k) @ B (k, GEMM_NR), B's row r being
#: GEMM_NR values at b + rowoff[r] floats; A packed (k-major, GEMM_MR values per k; ``ars``
#: unused). ``_tile_fused(a, ars, b, rowoff, k, c, ldc, bias, res, ldr, relu)``: the same, the
#: tile finished before it is stored (a bias per row; see :func:`_tile_codegen`);
#: ``_tile_strided`` (same arguments): A's row r at a + r * ars floats, a bias per column.
#: The accumulators live in 2 * GEMM_MR vector registers across the k loop; each step loads
#: GEMM_NR values of B and broadcasts GEMM_MR of A. ``_tile_strided16``: ``_tile_strided`` of
#: (GEMM_MR, 16) tiles, for outputs of 16 * odd channels (16, 80, 112: no padding wasted).
_tile, _tile_fused, _tile_strided = _make_tile(False, None), _make_tile(False, "rows"), _make_tile(True, "columns")
_tile_strided16 = _make_tile(True, "columns", 1)





def _prefetch_codegen(context, builder, signature, args):
    from llvmlite import ir

    (addr,) = args
    i8p, i32t = ir.IntType(8).as_pointer(), ir.IntType(32)
    module = builder.module
    prefetch = module.globals.get("llvm.prefetch") or ir.Function(
        module, ir.FunctionType(ir.VoidType(), [i8p, i32t, i32t, i32t]), "llvm.prefetch")
    builder.call(prefetch, [builder.inttoptr(addr, i8p), ir.Constant(i32t, 0), ir.Constant(i32t, 3),
                            ir.Constant(i32t, 1)])
    return context.get_dummy_value()


def _make_prefetch():
    from numba import types
    from numba.extending import intrinsic

    def typer(typingctx, addr):
        return types.void(types.intp), _prefetch_codegen
    return intrinsic(typer)


#: ``_prefetch(address)``: fetch the line into cache ahead of its use (never faults).
_prefetch = _make_prefetch()

@_jit
def fill_slab(x, c, h, w, plane, slab, size, y0, rows, ph, pw, wide, pitch, scale, shift, act, alpha, beta):
    """Padded rows y0 .. y0 + rows of the float32 image at address ``x`` (c channels ``plane``
    floats apart, each h rows of w) with ``ph`` rows and ``pw`` columns of zeros before it (and
    zeros after it, to ``wide`` columns) into the slab at address ``slab``: channel ci's rows
    from ci * ``pitch`` floats, zeros from their end to the next channel's and from the last
    one's to ``size`` floats (the room the last taps of :func:`gemm_tiles` read past a plane's
    corner, and its last partial tile past the last row, for columns it does not store).

    Where ``scale`` (an address; 0: none) is given, each value is copied as ``act(v *
    scale[ci] + shift[ci])`` (a scale_shift_conv's prologue; the padding stays 0: the conv pads
    the normalised map): a ReLU or none in the same pass, another activation in a second pass
    over the row, in L1 (:func:`activate_row`)."""
    right = wide - pw - w
    zero = f32(0.0)
    for ci in range(c):
        base = slab + ci * pitch * 4
        a, b = f32(1.0), zero
        if scale != 0:
            a, b = _f32_array(scale, c)[ci], _f32_array(shift, c)[ci]
        for r in range(rows):
            row = base + r * wide * 4
            iy = y0 + r - ph
            if iy < 0 or iy >= h:
                _zero_bytes(row, wide * 4)
                continue
            if pw > 0:
                _zero_bytes(row, pw * 4)
            at = x + (ci * plane + iy * w) * 4
            if scale == 0:
                _copy_bytes(row + pw * 4, at, w * 4)
            else:
                scale_shift_row(_f32_array(at, w), _f32_array(row + pw * 4, w), a, b, act, alpha, beta)
            if right > 0:
                _zero_bytes(row + (pw + w) * 4, right * 4)
        if pitch > rows * wide:
            _zero_bytes(base + rows * wide * 4, (pitch - rows * wide) * 4)
    if size > c * pitch:
        _zero_bytes(slab + c * pitch * 4, (size - c * pitch) * 4)


@_jit
def gemm_tiles(wp, src, rowoff, packed_rows, ncols, wide, ow, out, bias, residual, bpack, cbuf, block, act, alpha,
               beta, first):
    """out (M, oh * ow) = act(W @ B + bias[m] (+ residual (M, oh * ow), or (0, 0) for none)).

    ``wp``: the weights packed (panels, K, GEMM_MR), zero rows past M. B's row k is ``src``
    (flat) from ``rowoff[k]``; its columns 0 .. ncols are read (``packed_rows``: k * GEMM_NR for
    each k, the rows of ``bpack``; both made once, when the kernel is prepared). Column j is
    output position (i // wide, i % wide), i = j + ``first``, stored only if i % wide < ow (a
    padded image read flat has wide - ow columns of junk per row; a plain matrix has wide = ow =
    ncols, and then its whole tiles are finished in registers and stored straight into the
    output). ``positions`` (out's second extent) is only the output's row stride: a block of B's
    columns from within a plane (``first`` its first one's place in its row) is stored through
    an ``out`` that starts at its first row. The tiles read B where it
    lies, but for a last panel narrower than GEMM_NR where ``src`` ends before its last row's
    GEMM_NR columns: that one is copied into ``bpack`` (K * GEMM_NR) with zeros past the columns.

    Columns go by blocks of ``block`` (a multiple of GEMM_NR). Each tile column of the block is
    computed down all M rows (its part of B, K x GEMM_NR, read once from memory and then from
    cache) into ``cbuf`` (panels * GEMM_MR * block); then the block's tiles are finished (bias,
    residual, activation) into the output an output channel at a time, left to right, so that
    the output is written along its rows (stores down a column of tiles touched M rows' lines
    at once: 3-5x slower on a 56x56 plane), and an activation other than relu runs once over
    each row's span. Splitting K into L2-sized steps, as BLAS does, measured no faster on
    ResNet's and DenseNet's 3x3 convs (K = 576 to 4608)."""
    m, positions = out.shape
    kdim = rowoff.size
    panels = wp.shape[0]
    has_residual = residual.shape[0] != 0
    of = out.reshape(-1)
    rf = residual.reshape(-1)
    nr, mr = GEMM_NR, GEMM_MR
    tile_size = mr * nr
    wa, ba, ca, sa = wp.ctypes.data, bpack.ctypes.data, cbuf.ctypes.data, src.ctypes.data
    ra, pra = rowoff.ctypes.data, packed_rows.ctypes.data
    oa, bsa, rsa, za = out.ctypes.data, bias.ctypes.data, residual.ctypes.data, _ZERO_ROW.ctypes.data
    relu = 1 if act == 1 else 0
    zero = f32(0.0)
    full = ncols // nr * nr
    # a plain matrix (no junk columns): whole tiles go straight into the output, finished in
    # registers; the rest through cbuf and the loop below
    direct_panels = m // mr if wide == ow else 0
    # tiles left of ``reads`` read B where it lies: a last partial one too where ``src`` has
    # room for its whole width past every row's start (its columns past ncols are not stored);
    # else it is copied into bpack first (~20 us for K = 1152 where the copy was a float loop)
    reads = full
    if full < ncols:
        reach = 0
        for k in range(kdim):
            reach = max(reach, rowoff[k])
        if reach + full + nr <= src.size:
            reads = full + nr
        else:
            for k in range(kdim):
                _copy_bytes(ba + k * nr * 4, sa + (rowoff[k] + full) * 4, (ncols - full) * 4)
                _zero_bytes(ba + (k * nr + ncols - full) * 4, (nr - ncols + full) * 4)
    for jb in range(0, ncols, block):
        bw = min(block, ncols - jb)
        tiles = (bw + nr - 1) // nr
        # a tile column down all M rows (its part of B read once from memory, then from cache);
        # with direct stores a panel of rows left to right instead (the output written along its
        # rows: stores down a column of tiles touched M rows' lines at once, ~1.5x slower)
        outer, inner = (panels, tiles) if direct_panels else (tiles, panels)
        for u in range(outer):
            for v in range(inner):
                p, q = (u, v) if direct_panels else (v, u)
                j0 = jb + q * nr
                c = ca + (q * panels + p) * tile_size * 4
                if j0 < full and p < direct_panels:
                    o0 = p * mr * positions + first + j0
                    if has_residual:  # the next tile's residual, fetched while this one computes
                        for r in range(mr):
                            _prefetch(rsa + (o0 + r * positions + nr) * 4)
                            _prefetch(rsa + (o0 + r * positions + nr + 16) * 4)
                    _tile_fused(wa + p * kdim * mr * 4, 0, sa + j0 * 4, ra, kdim, oa + o0 * 4, positions,
                                bsa + p * mr * 4, rsa + o0 * 4 if has_residual else za,
                                positions if has_residual else 0, relu)
                elif j0 < reads:
                    _tile(wa + p * kdim * mr * 4, 0, sa + j0 * 4, ra, kdim, c, nr)
                else:
                    _tile(wa + p * kdim * mr * 4, 0, ba, pra, kdim, c, nr)
        # the block's first output position and the one past its last (positions grow with j)
        i0, i1 = first + jb, first + jb + bw
        y0, y1 = i0 // wide, i1 // wide
        pos_lo = y0 * ow + min(i0 - y0 * wide, ow)
        pos_hi = y1 * ow + min(i1 - y1 * wide, ow)
        for p in range(panels):
            for r in range(min(mr, m - p * mr)):
                mo = p * mr + r
                b = bias[mo]
                for q in range(tiles):
                    j0 = jb + q * nr
                    if j0 < full and p < direct_panels:
                        continue  # stored finished
                    t0 = (q * panels + p) * tile_size + r * nr
                    end = min(j0 + nr, ncols)
                    # the tile row's columns as runs of output positions, one per output row
                    j = j0
                    while j < end:
                        yo = (j + first) // wide
                        xo = j + first - yo * wide
                        run_length = min(end - j, wide - xo)
                        if xo < ow:
                            n = min(run_length, ow - xo)
                            o0 = mo * positions + yo * ow + xo
                            dst, acc = of[o0:o0 + n], cbuf[t0 + j - j0:t0 + j - j0 + n]
                            if has_residual:
                                res = rf[o0:o0 + n]
                                for t in range(n):
                                    dst[t] = acc[t] + b + res[t]
                            else:
                                for t in range(n):
                                    dst[t] = acc[t] + b
                            if act == 1:  # relu in line
                                for t in range(n):
                                    v = dst[t]
                                    dst[t] = v if not v < zero else zero
                        j += run_length
                if act > 1:  # the others over the row's span at once: a call per run cost ~2x
                    activate_row(of[mo * positions + pos_lo:mo * positions + pos_hi], act, alpha, beta)


@_jit
def _finish_rows(cbuf, of, rf, has_residual, relu, first, rows, m, j0, width, nr):
    """Output pixels first .. first + rows, channels j0 .. j0 + width, from the (GEMM_MR, nr)
    tile in ``cbuf`` (bias added): + residual, relu."""
    zero = f32(0.0)
    for r in range(rows):
        o0 = (first + r) * m + j0
        dst, acc = of[o0:o0 + width], cbuf[r * nr:r * nr + width]
        if has_residual:
            res = rf[o0:o0 + width]
            for t in range(width):
                dst[t] = acc[t] + res[t]
        else:
            for t in range(width):
                dst[t] = acc[t]
        if relu:
            for t in range(width):
                v = dst[t]
                dst[t] = v if not v < zero else zero


@_jit
def gemm_channels_last(x, wt, rowoff, out, bias, residual, cbuf, apad, block, act, alpha, beta):
    """out (pixels, M) = act(x (pixels, C) @ W^T + bias (+ residual (pixels, M), or (0, 0))): a
    1x1 convolution on channels-last storage by the micro-kernel, A being x's rows where they lie.

    ``wt``: the weights transposed, (C, M rounded up to GEMM_NR, or to 16 where that wastes
    less: the tiles are then (GEMM_MR, 16)), ``rowoff`` its rows' offsets (k * its width, int64,
    made once when the kernel is prepared), and ``bias`` (M rounded up alike), zero past M.
    Pixels go by blocks of ``block`` (a multiple of GEMM_MR; the block's rows of x
    and of the output stay in L2): for each GEMM_NR output channels, the block's pixels GEMM_MR
    at a time, each tile stored into the output with its bias, residual and relu added in
    registers (one pass over the output, as it is written); another activation then runs once
    over the block's output. A tile that would reach past the output -- the last channels when M
    is no multiple of GEMM_NR, the last pixels when fewer than GEMM_MR (their rows copied into
    ``apad``, GEMM_MR * C, zeros after) -- goes to ``cbuf`` (GEMM_MR * GEMM_NR) and is finished
    from there."""
    pixels, cdim = x.shape
    m = out.shape[1]
    mpad = wt.shape[1]
    # (GEMM_MR, 16) tiles where M is padded to 16 * an odd number only
    mr, nr = GEMM_MR, GEMM_NR if mpad % GEMM_NR == 0 else 16
    has_residual = residual.shape[0] != 0
    xf, of, rf = x.reshape(-1), out.reshape(-1), residual.reshape(-1)
    xa, wa, oa, ca, pa, ra = x.ctypes.data, wt.ctypes.data, out.ctypes.data, cbuf.ctypes.data, apad.ctypes.data, \
        rowoff.ctypes.data
    ba, rsa, za = bias.ctypes.data, residual.ctypes.data, _ZERO_ROW.ctypes.data
    relu = 1 if act == 1 else 0
    zero = f32(0.0)
    full, mfull = pixels // mr * mr, m // nr * nr
    if full < pixels:
        for r in range(mr):
            dst = apad[r * cdim:(r + 1) * cdim]
            if full + r < pixels:
                src = xf[(full + r) * cdim:(full + r + 1) * cdim]
                for t in range(cdim):
                    dst[t] = src[t]
            else:
                for t in range(cdim):
                    dst[t] = zero
    for pb in range(0, pixels, block):
        bp = min(block, pixels - pb)
        for j0 in range(0, mpad, nr):
            for q in range(pb, pb + bp, mr):
                a = xa + q * cdim * 4 if q < full else pa
                direct = q < full and j0 < mfull
                c, ldc = (oa + (q * m + j0) * 4, m) if direct else (ca, nr)
                res, ldr = (rsa + (q * m + j0) * 4, m) if direct and has_residual else (za, 0)
                if nr == 16:
                    _tile_strided16(a, cdim, wa + j0 * 4, ra, cdim, c, ldc, ba + j0 * 4, res, ldr, relu if direct else 0)
                else:
                    _tile_strided(a, cdim, wa + j0 * 4, ra, cdim, c, ldc, ba + j0 * 4, res, ldr, relu if direct else 0)
                if not direct:
                    _finish_rows(cbuf, of, rf, has_residual, relu, q, min(mr, pixels - q), m, j0, min(nr, m - j0), nr)
        if act > 1:
            activate_row(of[pb * m:(pb + bp) * m], act, alpha, beta)
