"""The loops of :mod:`polyhal_cpu.native`, compiled by numba on first call (and cached on disk).

Importing this module imports numba; :mod:`polyhal_cpu.native` does so only when a kernel asks
for a loop. Every loop takes float32 C-contiguous arrays and releases the GIL.
"""

from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from polyhal_cpu.rational_erf import ERF_P, ERF_Q

__all__ = ["add_rows", "col2im", "depthwise", "depthwise_channels_last", "depthwise_flat_rows", "epilogue",
           "epilogue_channels_last", "exp2_shifted_rows", "gelu_erf", "gelu_tanh", "im2col", "im2col_phases",
           "layer_norm", "pool2d", "relu", "scale_rows", "scale_shift_rows", "softmax_rows", "spin_wait"]

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
def scale_shift_rows(x, scale, shift, out, act, alpha, beta):
    """(rows, cols) x into out, rows being (image, channel) pairs of ``scale``'s channels:
    out = act(x * scale[channel] + shift[channel]), a row at a time (the activation's pass finds
    it in L1)."""
    rows, cols = x.shape
    channels = scale.size
    for r in range(rows):
        a, b = scale[r % channels], shift[r % channels]
        src, dst = x[r], out[r]
        for t in range(cols):
            dst[t] = src[t] * a + b
        activate_row(dst, act, alpha, beta)


@_jit
def _valid(o_count, start, stride, size):
    """The output range [lo, hi) whose input index start + o * stride lies in [0, size)."""
    lo = 0 if start >= 0 else (-start + stride - 1) // stride
    hi = 0 if start >= size else min(o_count, (size - 1 - start) // stride + 1)
    return lo, max(lo, hi)


@_jit
def _valid_columns(ow, kw, sw, pw, dw, width):
    """For each kernel column j, the output range [lo, hi) whose input column lies in the
    image (:func:`_valid`), once per call: integer divisions are slow in the loops."""
    los, his = np.empty(kw, np.int64), np.empty(kw, np.int64)
    for j in range(kw):
        los[j], his[j] = _valid(ow, j * dw - pw, sw, width)
    return los, his


@_jit
def _phase_taps(kw, sw, pw, dw):
    """For each kernel column j, (q, r) with j * dw - pw = q * sw + r, 0 <= r < sw: tap j reads
    input column (xo + q) * sw + r, i.e. column xo + q of column phase r (:func:`_split_phases`)."""
    qs, rs = np.empty(kw, np.int64), np.empty(kw, np.int64)
    for j in range(kw):
        off = j * dw - pw
        q = off // sw
        qs[j], rs[j] = q, off - q * sw
    return qs, rs


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
    los, his = _valid_columns(ow, kw, sw, pw, dw, width)
    for c in range(channels):
        for i in range(kh):
            for j in range(kw):
                r0 = ((c * kh + i) * kw + j) * ncols
                lo, hi = los[j], his[j]
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
def im2col_phases(x, n0, cols, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow):
    """:func:`im2col` with a horizontal stride (sw > 1): each channel's planes are first split
    into column phases (:func:`_split_phases`), so that every row of the columns is a contiguous
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
    los, his = _valid_columns(ow, kw, sw, pw, dw, width)
    qs, rs = _phase_taps(kw, sw, pw, dw)
    pwidth = (width + sw - 1) // sw
    span = sw * height * pwidth  # one image's phases of one channel
    phases = np.empty(nb * span, np.float32)
    for c in range(channels):
        for b in range(nb):
            xplane = ((n0 + b) * channels + c) * height * width
            _split_phases(xf[xplane:xplane + height * width], height, width, sw, phases[b * span:(b + 1) * span])
        for i in range(kh):
            for j in range(kw):
                r0 = ((c * kh + i) * kw + j) * ncols
                lo, hi = los[j], his[j]
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
                        s0 = ((b * sw + rs[j]) * height + iy) * pwidth + lo + qs[j]
                        src, dst = phases[s0:s0 + hi - lo], row[lo:hi]
                        for t in range(hi - lo):
                            dst[t] = src[t]


@_jit
def depthwise(x, w, bias, residual, out, sh, sw, ph, pw, dh, dw, act, alpha, beta):
    """Depthwise convolution with its epilogue: (N, C, H, W) x, (M, 1, kh, kw) w with M a
    multiple of C, (N, M, oh, ow) out; residual (N, M, oh, ow) or (0, 0, 0, 0). Each output row
    is accumulated tap by tap while it stays in L1, then finished (bias, residual, activation).
    Flat offsets, not row views: a view costs reference counting per row."""
    n_img, channels, height, width = x.shape
    m_out, _, kh, kw = w.shape
    oh, ow = out.shape[2], out.shape[3]
    mult = m_out // channels
    has_residual = residual.shape[0] != 0
    xf, of, wf = x.reshape(-1), out.reshape(-1), w.reshape(-1)
    rf = residual.reshape(-1)
    los, his = _valid_columns(ow, kw, sw, pw, dw, width)
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
def pool2d(x, out, inv, kh, kw, sh, sw, ph, pw, dh, dw, is_max):
    """Max (is_max) or average pooling of (R, H, W) x into (R, oh, ow) out; taps in the
    padding are skipped; average multiplies the window's sum by inv (oh, ow). Each output row
    is accumulated tap by tap over the output positions the tap reaches (flat offsets and views
    indexed by the loop counter, as in ``depthwise``, so that LLVM vectorises the row: an element
    at a time, ResNet's first pool took ~10x onnxruntime's time). With a horizontal stride, each
    plane is first split into its ``sw`` column phases (phase r holds columns r, r + sw, ...), so
    that a tap reads a contiguous run of one phase rather than every sw-th element (a strided
    read is not vectorised: ResNet's 3x3 stride-2 pool went 1018 -> 525 us single-threaded)."""
    rows, height, width = x.shape
    oh, ow = out.shape[1], out.shape[2]
    xf, of, vf = x.reshape(-1), out.reshape(-1), inv.reshape(-1)
    los, his = _valid_columns(ow, kw, sw, pw, dw, width)
    start = f32(-np.inf) if is_max else f32(0.0)
    pwidth = (width + sw - 1) // sw  # a phase's length
    phases = np.empty(sw * height * pwidth if sw > 1 else 0, np.float32)
    qs, rs = _phase_taps(kw, sw, pw, dw)
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


@_jit
def depthwise_channels_last(x, taps, bias, residual, out, sh, sw, ph, pw, dh, dw, act, alpha, beta):
    """Depthwise convolution of (N, H, W, C) x with (kh, kw, C) taps into (N, oh, ow, C) out,
    residual (N, oh, ow, C) or (0, 0, 0, 0), vectorised across the channels whatever the stride.
    Output row by output row: the row (ow, C) starts as the bias, each kernel row adds its taps
    (:func:`_kernel_row`; the loop is bound by loads and stores: one expression per 3- or 5-wide
    kernel row measured 1.2-1.6x faster than tap by tap on MobileNet's shapes, and with many
    channels four pixels at a time, sharing their input columns, up to 1.5x more; 7-wide rows
    four pixels at a time only), then the residual and the activation finish it while it is in L1."""
    n_img, height, width, channels = x.shape
    kh, kw = taps.shape[0], taps.shape[1]
    oh, ow = out.shape[1], out.shape[2]
    has_residual = residual.shape[0] != 0
    span = (kw - 1) * dw
    quad = sw == 1 and dw == 1 and (kw == 3 or kw == 5 or kw == 7) and channels >= QUAD_CHANNELS
    # with quad: the first and last output columns whose taps all lie inside the image
    first, last = max(pw, 0), min(ow, width - kw + 1 + pw)
    for n in range(n_img):
        for yo in range(oh):
            orow = out[n, yo]
            for xo in range(ow):
                for c in range(channels):
                    orow[xo, c] = bias[c]
            for i in range(kh):
                iy = yo * sh - ph + i * dh
                if iy < 0 or iy >= height:
                    continue
                xr, wr = x[n, iy], taps[i]
                if not quad:  # _kernel_row's body in line: called per pixel it measured ~1.5x slower
                    for xo in range(ow):
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
                xo = first
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
            if has_residual:
                rrow = residual[n, yo]
                for xo in range(ow):
                    for c in range(channels):
                        orow[xo, c] += rrow[xo, c]
            activate_row(orow.reshape(-1), act, alpha, beta)


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
    los, his = _valid_columns(ow, kw, 1, pw, dw, width)
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
                for j in range(kw):
                    lo, hi = los[j], his[j]
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
