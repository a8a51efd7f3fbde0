"""Fused CPU loops compiled to native code by numba (LLVM), for kernels that numpy can only do
pass by pass.

numpy runs one loop per ufunc call over the whole operand: a tanh-GELU is seven passes over its
data, a layer norm a dozen (several of them broadcasts, which numpy iterates one short row at a
time), a softmax five. These loops make one pass per element or per row instead, with the row
in registers or L1, vectorised by LLVM -- the code IREE's llvm-cpu backend or onnxruntime's MLAS
produce ahead of time. Loops: tanh- and erf-GELU, relu, layer norm, last-axis softmax, and the pieces of
attention and linear that numpy broadcasts slowly (exp2 with row sums, row scaling, bias rows).
Measured on a 2-core VM (AVX-512, in a transformer block's plan): layer norm of 256 x 128
51 -> 11 µs, GELU of 256 x 512 131 -> 62 µs, relu of 256 x 256 15 -> 8 µs; the block's plan
1.38 -> 1.11 ms.

**exp2.** LLVM vectorises a loop only if every call in it has a vector form, and numba links no
vector math library, so ``exp2`` is computed in line: 2^t = 2^n * 2^f with n the nearest
integer and f in [-1/2, 1/2], 2^f by Cephes' degree-6 polynomial (within 2 ulp in float32),
2^n by building the float's exponent bits. t is clamped to [-127, 128] first: below, 2^t is 0
(results under 2^-126 flush to zero, where numpy would spend 10-300x longer on subnormals);
at 128 the exponent field is all ones, which is inf, so overflow still gives inf.

**When.** float32 only (float64 keeps numpy's loops, float16 runs as float32), numba importable
and ``POLYHAL_CPU_NATIVE`` not ``0``; operands are made C-contiguous first (a copy only for a
strided one). The loops release the GIL. They are compiled once per machine ahead of time
into an extension module (:mod:`polyhal_cpu.native_aot`), so a process that runs them loads
no compiler (numba in process costs ~120 MB); where that module cannot be had, each loop is
JIT compiled in process on its first use (~0.2-0.6 s) and cached on disk beside its source (or
in numba's user-wide cache directory where that is read-only).

**Tiers.** Building that module takes ~1-4 minutes on 2 cores, which a first ``polyhal run``
must not wait for (issue 30: first output within 10 s on a fresh machine). So, as a JIT runs a
method interpreted while it compiles it, a process that finds no module starts its build in a
background process (niced; ``POLYHAL_CPU_AOT_WAIT=1`` builds it in the foreground instead) and
runs without the loops: :func:`available` is False, and every kernel takes the path it takes
where numba is missing -- numpy, BLAS, oneDNN primitives. Later processes load the module at
start. A process keeps its tier for its life: scratch is declared and kernels are built in
separate calls of a compile, and a conv's scratch differs with the loops, so a process that took
them up between the two would hand compiled code a buffer sized for the other tier.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from polyhal_cpu.queue_layout import G_FIELDS, Q_SIZE
from polyhal_cpu.rational_erf import ERF_P, ERF_Q
from polyhal_cpu.settings import CPUSettings

__all__ = ["ERF_P", "ERF_Q", "add_rows", "available", "channels_last_block", "col2im", "conv_image_channels_last",
           "depthwise", "depthwise_channels_last", "depthwise_flat_rows", "epilogue", "epilogue_channels_last",
           "column_table", "depthwise_offsets", "exp2_shifted_rows", "gelu_erf", "gelu_tanh", "gemm_block",
           "gemm_channels_last", "gemm_tiles",
           "gemm_tiles_bytes", "im2col", "im2col_work", "layer_norm", "matvec_channels_last", "pack_gemm_weights",
           "pad_channels", "pool2d", "pool2d_work", "relu", "scale_rows", "softmax_rows"]

_F32 = np.dtype(np.float32)

_loops: dict[str, Callable] | None = None
#: Output width from which a horizontally strided im2col splits the planes into column phases
#: first (``im2col_phases``; below it, measured 256x28x28 3x3 stride 2: 387 -> 436 us).
PHASE_MIN_WIDTH = 28


def available(dtype=_F32) -> bool:
    """Whether the compiled loops serve ``dtype`` here (numba importable, float32, not disabled
    by ``POLYHAL_CPU_NATIVE=0``)."""
    if np.dtype(dtype) != _F32 or not CPUSettings.from_env().native:
        return False
    return bool(_compiled())


#: The residual passed for none (empty: nothing reads it), made once rather than per call.
_NONE2, _NONE4 = np.zeros((0, 0), np.float32), np.zeros((0, 0, 0, 0), np.float32)


#: The ahead-of-time module's build this process found under way in the background (None:
#: none): this process runs without the loops (see "Tiers" in the module docstring).
_pending = None


def _compiled() -> dict[str, Callable]:
    global _loops
    if _loops is None:
        try:
            _loops = _build()
        except ImportError:
            _loops = {}
    return _loops


def _build() -> dict[str, Callable]:
    global _pending
    from polyhal_cpu.native_aot import Pending, load

    loops = load(_jit_loop)
    if isinstance(loops, Pending):
        _pending = loops
        return {}
    return loops or _jit_loops()


_jit: dict[str, Callable] | None = None


def _jit_loop(name: str) -> Callable:
    """The JIT (numba) loop ``name``, for what the ahead-of-time module does not serve."""
    global _jit
    if _jit is None:
        _jit = _jit_loops()
    return _jit[name]


def _jit_loops() -> dict[str, Callable]:
    from polyhal_cpu.threads import budget, configure_numba

    configure_numba()  # numba's pool size follows the thread budget
    from polyhal_cpu import native_loops  # imports numba

    loops = {name: getattr(native_loops, name) for name in native_loops.__all__}
    _warm(loops)
    budget().refresh()  # numba's compiler loads scipy's BLAS, with a pool of its own: limit it too
    return loops


def _warm(loops: dict[str, Callable]) -> None:
    """Compile (or load from the disk cache) every loop for the operand types kernels pass, now,
    while a plan is being prepared, rather than inside its first run. numba types an array by
    dtype, rank, layout and writability, so the weights a plan binds read-only (a layer norm's
    scale and bias, a linear's bias) get their own signatures."""
    v, m = np.zeros(4, np.float32), np.zeros((2, 4), np.float32)
    ro = v.copy()
    ro.flags.writeable = False
    one = np.ones(2, np.float32)
    loops["gelu_tanh"](v, v.copy())
    loops["gelu_erf"](v, v.copy(), ERF_P, ERF_Q)
    loops["relu"](v, v.copy())
    loops["softmax_rows"](m, m.copy())
    for row in (v, ro):
        loops["layer_norm"](m, row, row, np.float32(1e-5), m.copy())
        loops["add_rows"](m.copy(), row)
    loops["exp2_shifted_rows"](m.copy(), np.float32(0.0), one.copy())
    loops["scale_rows"](m.copy(), one)
    ro_m = m.copy()
    ro_m.flags.writeable = False
    # Convolutions: weights and biases are read-only constants; images may be either.
    img, none4 = np.zeros((1, 2, 3, 3), np.float32), np.zeros((0, 0, 0, 0), np.float32)
    w = np.zeros((2, 1, 1, 1), np.float32)
    w.flags.writeable = False
    ro_img = img.copy()
    ro_img.flags.writeable = False
    for x in (img, ro_img):
        loops["im2col"](x, 0, np.zeros((2, 9), np.float32), 1, 1, 1, 1, 0, 0, 1, 1, 3, 3)
        loops["im2col_phases"](x, 0, np.zeros((2, 4), np.float32), v.copy(), 1, 1, 2, 2, 0, 0, 1, 1, 2, 2)
        loops["pool2d"](x[0], img[0].copy(), m[:1, :1].copy(), v.copy(), column_table(3, 1, 1, 0, 1, 3), 1, 1, 1, 1, 0,
                        0, 1, 1, True)
        for residual in (none4, img):
            loops["depthwise"](x, w, column_table(3, 1, 1, 0, 1, 3), ro, residual, img.copy(), 1, 1, 0, 0, 1, 1, 1,
                               *_F32_PAIR)
    for residual in (m[:0, :0], m):
        loops["epilogue"](m.copy(), ro[:2], residual, 1, *_F32_PAIR)
    loops["col2im"](m, np.zeros((2, 1, 2), np.float32), 1, 1, 1, 1, 0, 0, 1, 1, 1, 4)
    packed = np.zeros((1, 2, GEMM_MR), np.float32)  # packed weights: a copy the kernel keeps, writable
    for src in (m.reshape(-1), ro_m.reshape(-1)):
        for residual in (m[:0, :0], m):
            loops["gemm_tiles"](packed, src, np.arange(2), np.arange(2) * GEMM_NR, 4, 4, 4,
                                np.zeros((1, 4), np.float32), ro[:1], residual[:1], np.zeros(2 * GEMM_NR, np.float32),
                                np.zeros(GEMM_MR * GEMM_NR, np.float32), GEMM_NR, 1, *_F32_PAIR, 0)
    wide = np.zeros((2, GEMM_NR), np.float32)  # a channels-last 1x1 conv: 2 pixels, 4 -> GEMM_NR channels
    ro_bias = wide[0].copy()
    ro_bias.flags.writeable = False
    for x in (m, ro_m):  # images of either kind
        for residual in (m[:0, :0], wide):
            loops["gemm_channels_last"](x, np.zeros((4, GEMM_NR), np.float32), np.arange(4) * GEMM_NR, wide.copy(),
                                        ro_bias, residual, np.zeros(GEMM_MR * GEMM_NR, np.float32),
                                        np.zeros(GEMM_MR * 4, np.float32), GEMM_MR, 1, *_F32_PAIR)
    nhwc = np.zeros((1, 3, 3, 2), np.float32)
    for x in (nhwc, ro_img.reshape(1, 3, 3, 2)):
        for residual in (none4, nhwc):
            loops["depthwise_channels_last"](x, np.zeros((1, 1, 2), np.float32), depthwise_offsets(1, 1, 1, 1, 3, 2),
                                             ro[:2], residual, nhwc.copy(), 1, 1, 0, 0, 1, 1, 1, *_F32_PAIR)
    for residual in (m[:0, :0], m):
        loops["epilogue_channels_last"](m.copy(), ro, residual, 1, *_F32_PAIR)
    # Tiled taps and bias, kept by the kernel for a plan's read-only weights, are read-only; the
    # map is a plan's intermediate (every signature warmed costs ~1 MB of resident code).
    tiles = np.zeros((1, 1, 6), np.float32)  # (kh, kw, ow * C) for the 1x1 conv of a 3x3x2 map
    tiles.flags.writeable = False
    for residual in (none4, nhwc):
        loops["depthwise_flat_rows"](nhwc, tiles, tiles[0, 0], residual, nhwc.copy(), 0, 0, 1, 1, 1, *_F32_PAIR)
    for residual in (m[:0, :0], wide):  # a squeeze-excite 1x1 conv of one pixel: 4 -> GEMM_NR channels
        loops["matvec_channels_last"](m[:1], np.zeros((4, GEMM_NR), np.float32), ro_bias, residual[:1], wide[:1].copy(),
                                      1, *_F32_PAIR)
    # A network's first conv: the image as given (either kind), into a channels-last map.
    image_taps = np.zeros((1, 2, 1, 8), np.float32)  # (kh, C, kw, M): a plan's constant relaid, writable
    offsets = np.zeros(2, np.int64)
    for x in (img, ro_img):
        for residual in (none4, np.zeros((1, 3, 3, 8), np.float32)):
            loops["conv_image_channels_last"](x, image_taps, offsets, offsets, ro_bias[:8], residual,
                                              np.zeros((1, 3, 3, 8), np.float32), 0, 1, 0, 3, 1, 1, 0, 0, 1, 1, 1,
                                              *_F32_PAIR)
    loops["spin_wait"](np.zeros(2, np.int64), -1, 0, 0, 0, 1, 0)
    queue = np.zeros(Q_SIZE, np.int64)  # an empty GEMM run (no pieces): the queue's loops' types
    loops["take_gemms"](queue, 0)
    loops["gemm_pieces"](np.zeros((0, G_FIELDS), np.int64))
    loops["drive_gemms"](queue, 0, 1)
    loops["serve_gemms"](np.zeros(2, np.int64), queue, -1, 0, 0, 0, 1, 0)


_F32_PAIR = (np.float32(0.0), np.float32(0.0))


def gelu_tanh(x: np.ndarray, out: np.ndarray) -> None:
    """tanh-approximated GELU of contiguous float32 ``x`` into ``out`` (1-D views)."""
    _compiled()["gelu_tanh"](x, out)


def gelu_erf(x: np.ndarray, out: np.ndarray) -> None:
    """Exact (erf) GELU of contiguous float32 ``x`` into ``out`` (1-D views); max abs error
    ~1e-7 * (1 + |x|)."""
    _compiled()["gelu_erf"](x, out, ERF_P, ERF_Q)


def relu(x: np.ndarray, out: np.ndarray) -> None:
    """max(x, 0) of contiguous float32 ``x`` into ``out`` (1-D views); nan stays nan."""
    _compiled()["relu"](x, out)


def softmax_rows(x: np.ndarray, out: np.ndarray) -> None:
    """Softmax of each row of (rows, cols) ``x`` into ``out``."""
    _compiled()["softmax_rows"](x, out)


def layer_norm(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float, out: np.ndarray) -> None:
    """Layer norm of the rows of (rows, cols) ``x`` into ``out`` with (cols,) scale and bias."""
    _compiled()["layer_norm"](x, scale, bias, np.float32(eps), out)


def exp2_shifted_rows(s: np.ndarray, shift: float, sums: np.ndarray) -> None:
    """(rows, cols) ``s`` to 2^(s - shift) in place, each row's sum into ``sums``."""
    _compiled()["exp2_shifted_rows"](s, np.float32(shift), sums)


def scale_rows(x: np.ndarray, factors: np.ndarray) -> None:
    """Divide row r of (rows, cols) ``x`` by ``factors[r]``, in place."""
    _compiled()["scale_rows"](x, factors)


def add_rows(x: np.ndarray, row: np.ndarray) -> None:
    """Add (cols,) ``row`` to every row of (rows, cols) ``x``, in place."""
    _compiled()["add_rows"](x, row)


def activation_code(activation: str) -> int:
    """The loops' code for ``activation`` (its index in :data:`polyhal.ops.nn.ACTIVATIONS`)."""
    from polyhal.ops.nn import ACTIVATIONS

    return list(ACTIVATIONS).index(activation)


def epilogue(y: np.ndarray, bias: np.ndarray, residual: np.ndarray | None, act: int, alpha: float,
             beta: float) -> None:
    """In place over (rows, cols) ``y`` (rows: (image, channel) pairs): activation ``act`` of
    y + bias[channel] (+ residual, (rows, cols))."""
    none = _NONE2 if residual is None else residual
    _compiled()["epilogue"](y, bias, none, act, np.float32(alpha), np.float32(beta))


def _split_phases(k: tuple, s: tuple, out: tuple) -> bool:
    """Whether :func:`im2col` splits the planes into column phases first (see PHASE_MIN_WIDTH)."""
    return s[1] > 1 and k[1] > 1 and out[1] >= PHASE_MIN_WIDTH


def im2col_work(images: int, size: tuple, k: tuple, s: tuple, out: tuple) -> int:
    """Floats of the ``work`` scratch :func:`im2col` needs for ``images`` images of spatial
    ``size`` (H, W): one channel's planes split into column phases (0 where it splits none)."""
    return images * pool2d_work(size, s) if _split_phases(k, s, out) else 0


def im2col(x: np.ndarray, first: int, cols: np.ndarray, work: np.ndarray, k: tuple, s: tuple, p: tuple, d: tuple,
           out: tuple) -> None:
    """Images ``first`` .. ``first + nb`` of C-contiguous (N, C, H, W) ``x`` into (C * kh * kw,
    nb * oh * ow) ``cols`` (nb from its width) for a 2-D convolution with kernel ``k``, strides
    ``s``, begin pads ``p``, dilations ``d`` and output size ``out``; ``work``: float32 scratch of
    :func:`im2col_work` floats at least (the kernel allocates nothing)."""
    loops = _compiled()
    if not _split_phases(k, s, out):
        loops["im2col"](x, first, cols, k[0], k[1], s[0], s[1], p[0], p[1], d[0], d[1], out[0], out[1])
        return
    _work(work, im2col_work(cols.shape[1] // (out[0] * out[1]), x.shape[2:], k, s, out))
    loops["im2col_phases"](x, first, cols, work, k[0], k[1], s[0], s[1], p[0], p[1], d[0], d[1], out[0], out[1])


def _work(work: np.ndarray, floats: int) -> None:
    """A compiled loop writes its scratch without bounds checks: check it is large enough."""
    if work.dtype != _F32 or work.ndim != 1 or not work.flags.c_contiguous or work.size < floats:
        raise ValueError(f"a C-contiguous float32 vector of {floats} elements at least is needed as scratch here, "
                         f"got one of shape {work.shape} and dtype {work.dtype}")


def _contiguous(*arrays: np.ndarray) -> None:
    """The GEMM loops address their operands' memory directly: C-contiguous ones only."""
    for a in arrays:
        if not a.flags.c_contiguous:
            raise ValueError(f"a C-contiguous array is needed here, got one of shape {a.shape} and strides {a.strides}")


#: Rows of weights and columns of B per tile of :func:`gemm_tiles` (its micro-kernel's registers).
GEMM_MR, GEMM_NR = 8, 32
#: Bytes of the tiles of one column block of :func:`gemm_tiles` (M x block columns, accumulated
#: over K in L2); the larger, the fewer times the weights are read.
GEMM_BLOCK_BYTES = 256 << 10


def pack_gemm_weights(w: np.ndarray) -> np.ndarray:
    """(M, K) weights as :func:`gemm_tiles` reads them: (ceil(M / GEMM_MR), K, GEMM_MR), each
    panel of GEMM_MR rows k-major, zero rows past M."""
    m, k = w.shape
    panels = -(-m // GEMM_MR)
    packed = np.zeros((panels * GEMM_MR, k), np.float32)
    packed[:m] = w
    return np.ascontiguousarray(packed.reshape(panels, GEMM_MR, k).transpose(0, 2, 1))


def gemm_block(m: int, ncols: int) -> int:
    """Columns per block of :func:`gemm_tiles` for M = ``m`` (see GEMM_BLOCK_BYTES)."""
    fit = max(1, GEMM_BLOCK_BYTES // (-(-m // GEMM_MR) * GEMM_MR * 4 * GEMM_NR))
    return min(fit, -(-ncols // GEMM_NR)) * GEMM_NR


def gemm_tiles_bytes(m: int, k: int, block: int) -> int:
    """Bytes of :func:`gemm_tiles`'s scratch: a packed panel of B (K x GEMM_NR) and the
    tiles of a column block."""
    return (k * GEMM_NR + -(-m // GEMM_MR) * GEMM_MR * block) * 4


def gemm_tiles(wp: np.ndarray, src: np.ndarray, rowoff: np.ndarray, packed_rows: np.ndarray, ncols: int, wide: int,
               ow: int, out: np.ndarray, bias: np.ndarray, residual: np.ndarray | None, bpack: np.ndarray,
               cbuf: np.ndarray, block: int, act: int, alpha: float, beta: float, first: int = 0) -> None:
    """(M, positions) ``out`` = activation ``act`` of packed weights ``wp`` @ B + bias[m] (+
    residual), B's row k being flat ``src`` from ``rowoff[k]`` (int64), columns 0 .. ncols
    (``packed_rows``: k * GEMM_NR for each k, int64, made once with ``rowoff``),
    column j the output position (i // wide, i % wide), i = j + ``first``, if i % wide < ow
    (else not stored; ``out``'s second extent its row stride);
    ``bpack`` (K * GEMM_NR) and ``cbuf`` (M rounded up to GEMM_MR, times ``block``) are
    scratch, ``block`` comes from :func:`gemm_block`. See :func:`polyhal_cpu.native_loops.gemm_tiles`."""
    none = _NONE2 if residual is None else residual
    _contiguous(wp, src, rowoff, packed_rows, out, bias, none, bpack, cbuf)
    _compiled()["gemm_tiles"](wp, src, rowoff, packed_rows, ncols, wide, ow, out, bias, none, bpack, cbuf, block, act,
                              np.float32(alpha), np.float32(beta), first)


#: Bytes of the pixels' rows (input and tiles) one block of :func:`gemm_channels_last` spans.
GEMM_ROWS_BLOCK_BYTES = 256 << 10


def pad_channels(a: np.ndarray, multiple: int = GEMM_NR) -> np.ndarray:
    """``a`` with its last axis zero-padded to a multiple of ``multiple`` (GEMM_NR, or 16 for
    (GEMM_MR, 16) tiles; weights (C, M) and bias (M,) as :func:`gemm_channels_last` reads them)."""
    m = a.shape[-1]
    padded = np.zeros(a.shape[:-1] + (-(-m // multiple) * multiple,), np.float32)
    padded[..., :m] = a
    return padded


def channels_last_block(c: int, m: int, pixels: int) -> int:
    """Pixels per block of :func:`gemm_channels_last` (see GEMM_ROWS_BLOCK_BYTES): the pixels'
    tiles in blocks of near-equal size, as many as the budget needs, rounded (a block may hold
    up to 1.5 times the budget): each block reads all the weights again, and a last block of a
    tile or two (a 7x7 map's 49 pixels in blocks of 48 and 1) read them for little work."""
    tiles = -(-pixels // GEMM_MR)
    fit = max(1, GEMM_ROWS_BLOCK_BYTES // ((c + m) * 4 * GEMM_MR))
    blocks = max(1, round(tiles / fit))
    return -(-tiles // blocks) * GEMM_MR


def gemm_channels_last(x: np.ndarray, wt: np.ndarray, rowoff: np.ndarray, out: np.ndarray, bias: np.ndarray,
                       residual: np.ndarray | None, cbuf: np.ndarray, apad: np.ndarray, block: int, act: int,
                       alpha: float, beta: float) -> None:
    """(pixels, M) ``out`` = activation ``act`` of (pixels, C) ``x`` @ the weights + bias (+
    residual), ``wt`` the (C, M) transposed weights and ``bias`` through :func:`pad_channels`, ``rowoff``
    the int64 offsets of wt's rows (k * its width, made once),
    ``block`` from :func:`channels_last_block`; ``cbuf`` (GEMM_MR x GEMM_NR) and ``apad``
    (GEMM_MR x C) are scratch.
    See :func:`polyhal_cpu.native_loops.gemm_channels_last`."""
    none = _NONE2 if residual is None else residual
    _contiguous(x, wt, rowoff, out, bias, none, cbuf, apad)
    _compiled()["gemm_channels_last"](x, wt, rowoff, out, bias, none, cbuf, apad, block, act, np.float32(alpha),
                                      np.float32(beta))


def depthwise(x: np.ndarray, w: np.ndarray, columns: np.ndarray, bias: np.ndarray, residual: np.ndarray | None,
              out: np.ndarray, s: tuple, p: tuple, d: tuple, act: int, alpha: float, beta: float) -> None:
    """2-D depthwise convolution of (N, C, H, W) ``x`` by (M, 1, kh, kw) ``w`` into ``out``, with
    bias, optional residual and activation ``act`` applied as each output row is finished; ``columns``: the
    kernel columns' :func:`column_table`."""
    none = _NONE4 if residual is None else residual
    _compiled()["depthwise"](x, w, columns, bias, none, out, s[0], s[1], p[0], p[1], d[0], d[1], act,
                             np.float32(alpha), np.float32(beta))


def depthwise_flat_rows(x: np.ndarray, wtile: np.ndarray, btile: np.ndarray, residual: np.ndarray | None,
                        out: np.ndarray, p: tuple, d: tuple, act: int, alpha: float, beta: float) -> None:
    """:func:`depthwise_channels_last` at stride 1 with the (kh, kw, C) taps and the bias tiled
    along an output row: (kh, kw, ow * C) ``wtile`` and (ow * C,) ``btile``."""
    none = _NONE4 if residual is None else residual
    _compiled()["depthwise_flat_rows"](x, wtile, btile, none, out, p[0], p[1], d[0], d[1], act,
                                       np.float32(alpha), np.float32(beta))


def col2im(cols: np.ndarray, out: np.ndarray, k: tuple, s: tuple, p: tuple, d: tuple, size: tuple) -> None:
    """Add (M * kh * kw, h * w) ``cols`` into (M, OH, OW) ``out``: a transposed 2-D convolution's
    scatter for an input of ``size`` (h, w)."""
    _compiled()["col2im"](cols, out, k[0], k[1], s[0], s[1], p[0], p[1], d[0], d[1], size[0], size[1])


def column_table(ow: int, kw: int, sw: int, pw: int, dw: int, width: int) -> np.ndarray:
    """(4, kw) int64, made once when a kernel is prepared (the loops allocate nothing, and integer
    divisions are slow in them): for each kernel column j over an input ``width`` wide, the
    output range [lo, hi) whose input column (o * sw + j * dw - pw) lies in the image (rows 0,
    1), and (q, r) with j * dw - pw = q * sw + r, 0 <= r < sw: its column phase (rows 2, 3)."""
    start = np.arange(kw, dtype=np.int64) * dw - pw
    lo = np.where(start >= 0, 0, (-start + sw - 1) // sw)
    hi = np.where(start >= width, 0, np.minimum(ow, (width - 1 - start) // sw + 1))
    q = start // sw
    return np.stack([lo, np.maximum(lo, hi), q, start - q * sw])


def depthwise_offsets(kh: int, kw: int, dh: int, dw: int, width: int, channels: int) -> np.ndarray:
    """(2, kh * kw) int64, made once when a kernel is prepared: per tap (i, j) of
    :func:`depthwise_channels_last` over an input ``width`` pixels wide, its input's offset (row
    0) and its weights' (row 1), in floats."""
    i, j = np.divmod(np.arange(kh * kw, dtype=np.int64), kw)
    return np.stack([(i * dh * width + j * dw) * channels, (i * kw + j) * channels])


def pool2d_work(size: tuple, s: tuple) -> int:
    """Floats of the ``work`` scratch :func:`pool2d` needs for planes of ``size`` (H, W) at
    strides ``s``: one plane split into its column phases (0 at a horizontal stride of 1)."""
    return s[1] * size[0] * -(-size[1] // s[1]) if s[1] > 1 else 0


def pool2d(x: np.ndarray, out: np.ndarray, inv: np.ndarray, work: np.ndarray, columns: np.ndarray, k: tuple, s: tuple,
           p: tuple, d: tuple, is_max: bool) -> None:
    """Max or average 2-D pooling of (R, H, W) ``x`` into (R, oh, ow) ``out``; averages are
    window sums times ``inv`` (oh, ow); ``work``: float32 scratch of :func:`pool2d_work` floats
    at least, ``columns`` the kernel columns' :func:`column_table` (the kernel allocates nothing)."""
    _work(work, pool2d_work(x.shape[1:], s))
    _compiled()["pool2d"](x, out, inv, work, columns, k[0], k[1], s[0], s[1], p[0], p[1], d[0], d[1], is_max)


def epilogue_channels_last(y: np.ndarray, bias: np.ndarray, residual: np.ndarray | None, act: int, alpha: float,
                           beta: float) -> None:
    """In place over (pixels, C) ``y``: activation ``act`` of y + bias (+ residual)."""
    none = _NONE2 if residual is None else residual
    _compiled()["epilogue_channels_last"](y, bias, none, act, np.float32(alpha), np.float32(beta))


def depthwise_channels_last(x: np.ndarray, taps: np.ndarray, offsets: np.ndarray, bias: np.ndarray,
                            residual: np.ndarray | None, out: np.ndarray, s: tuple, p: tuple, d: tuple, act: int,
                            alpha: float, beta: float) -> None:
    """2-D depthwise convolution of (N, H, W, C) ``x`` by (kh, kw, C) ``taps`` into (N, oh, ow, C)
    ``out``, with bias, optional residual and activation ``act``; ``offsets``: the taps'
    :func:`depthwise_offsets`."""
    none = _NONE4 if residual is None else residual
    _compiled()["depthwise_channels_last"](x, taps, offsets, bias, none, out, s[0], s[1], p[0], p[1], d[0], d[1], act,
                                           np.float32(alpha), np.float32(beta))


def conv_image_channels_last(x: np.ndarray, taps: np.ndarray, xoff: np.ndarray, woff: np.ndarray, bias: np.ndarray,
                             residual: np.ndarray | None, out: np.ndarray, ns: tuple, ys: tuple, s: tuple, p: tuple,
                             d: tuple, act: int, alpha: float, beta: float) -> None:
    """Images ``ns`` (first, last + 1), output rows ``ys`` of a dense 2-D convolution of (N, C, H,
    W) ``x`` by (kh, C, kw, M) ``taps`` into channels-last (N, oh, ow, M) ``out``, with bias,
    optional residual and activation ``act``; ``xoff``/``woff``: the taps' offsets (see
    :func:`polyhal_cpu.native_loops.conv_image_channels_last`)."""
    none = _NONE4 if residual is None else residual
    _compiled()["conv_image_channels_last"](x, taps, xoff, woff, bias, none, out, ns[0], ns[1], ys[0], ys[1], s[0],
                                            s[1], p[0], p[1], d[0], d[1], act, np.float32(alpha), np.float32(beta))


def matvec_channels_last(x: np.ndarray, wt: np.ndarray, bias: np.ndarray, residual: np.ndarray | None,
                         out: np.ndarray, act: int, alpha: float, beta: float) -> None:
    """(pixels, M) ``out`` = activation ``act`` of (pixels, C) ``x`` @ (C, M) ``wt`` + bias (+
    residual), for a few pixels (see :func:`polyhal_cpu.native_loops.matvec_channels_last`)."""
    none = _NONE2 if residual is None else residual
    _compiled()["matvec_channels_last"](x, wt, bias, none, out, act, np.float32(alpha), np.float32(beta))


def gemm_queue() -> dict[str, Callable] | None:
    """The compiled GEMM queue's loops (``serve_gemms``, ``take_gemms``, ``drive_gemms`` and
    ``gemm_pieces``; see :mod:`polyhal_cpu.native_loops`), or None where the compiled loops are off."""
    if not available():
        return None
    loops = _compiled()
    return {name: loops[name] for name in ("serve_gemms", "take_gemms", "drive_gemms", "gemm_pieces")}


def spin_wait() -> Callable[[np.ndarray, int, int, int, int, int, int], None] | None:
    """The compiled ``spin_wait(flags, post, value, index, target, rounds, linger)`` of
    :mod:`polyhal_cpu.native_loops` (``flags`` a C-contiguous int64 vector; the GIL released),
    or None where the compiled loops are off (then :mod:`polyhal_cpu.parallel` never spins)."""
    return _compiled()["spin_wait"] if available() else None


if __name__ == "__main__":  # the child process of native_aot that compiles the ahead-of-time module
    import sys
    from pathlib import Path

    from polyhal_cpu.native_aot import build

    if sys.argv[1:2] != ["build"] or len(sys.argv) != 4:
        raise SystemExit("usage: python -m polyhal_cpu.native build BUILD_FOLDER MODULE_NAME")
    build(Path(sys.argv[2]), sys.argv[3], _warm)
