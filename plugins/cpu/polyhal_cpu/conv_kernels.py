"""CPU kernels of the convolution family: ``conv`` and ``fused_conv`` (and the CPU's own
``cpu.scale_shift_conv``, a conv reading its input through a per-channel scale, shift and
activation: see :func:`_scale_shift_conv`; and ``cpu.blocked_conv``, on channel-blocked maps),
``conv_transpose``, and max/average pooling.

One dispatch per op, whatever its groups. A convolution takes one of five paths, chosen in
``prepare`` from shapes and attributes:

* **tiles** (2-D float32, one group, where the compiled loops run; not for 3-channel stems nor
  for 1x1 convs whose positions leave a tile mostly empty): ``out[n] = W @ B`` by a
  register-tiled GEMM micro-kernel (8 output channels x 32 positions in 16 AVX-512 registers,
  LLVM IR through numba; :func:`polyhal_cpu.native.gemm_tiles`), B's rows read where they lie:
  the image for a 1x1 conv, else a zero-padded copy split into the stride's phases, read at
  each tap's offset (no im2col; for one image at stride 1, each piece fills its own slab of
  that plane, :func:`_slabs`, through a ``scale_shift_conv``'s prologue where there is one,
  as does a 1x1 conv's piece with one, a slab of its block of the image's columns). Each tile
  is finished (bias, residual, activation) as it is stored (see :func:`_tiles`);
* **pointwise** (1x1, stride 1, no padding, one group): the convolution is a GEMM as the
  tensors lie, ``out[n] (M, HW) = w (M, C) @ x[n] (C, HW)``: OpenBLAS's sgemm, no copy, in
  pieces of the compiled queue where it runs (:func:`_pointwise_queued`); with a
  ``scale_shift_conv``'s prologue, each piece normalises its own columns of the input first
  (:func:`_pointwise_prologue`);
* **depthwise** (groups == input channels, one input channel per group; 2-D, float32, numba):
  a compiled loop accumulating each output row tap by tap while it stays in L1, and finishing
  it (bias, residual, activation) before moving on (:func:`polyhal_cpu.native.depthwise`). A
  GEMM per channel would be ~C BLAS calls of a 1 x k^2 matrix each;
* **shifted GEMMs** (stride 1, one group, planes from 28x28 up, without the compiled loops): no
  columns; the image is padded once and each tap is one GEMM of its weights with a shifted view
  of the padded image, accumulated by BLAS (see :func:`_shifted`);
* **im2col + GEMM** (everything else): the columns (C * k..., output positions) are written
  into the kernel's declared scratch (``columns``: planned by bufferization, never allocated in
  a run), then one ``np.matmul`` over the groups, ``(group, M/group, C/group * k) @ (group,
  C/group * k, positions)``, writes the output. Small planes (14x14, 7x7) stack the columns of
  several images side by side into one GEMM (:data:`GEMM_POSITIONS`), whose product (declared
  scratch ``product``) is then copied into the images' outputs; large ones take one image per GEMM.

After the GEMM paths, one pass over the output applies the epilogue (bias, the residual of
``fused_conv``, its activation): a compiled loop for float32 (:func:`polyhal_cpu.native.epilogue`),
numpy's ufuncs in place otherwise. Columns are built by a compiled loop for 2-D float32
(padding never materialised), else tap by tap with numpy (one strided copy per tap). 1-D
convolutions run as 2-D ones of unit height.

Measured on a 2-core VM with one BLAS thread (``python -m bench cnn_models``): a ResNet-18 went
from 2.2x onnxruntime's time to ~1.1x, a MobileNetV3-style network from 13x to ~1.5x in NCHW and
~0.8-1.05x with its depthwise chains channel-blocked (``cpu.blocked_conv`` below). The tiles path
then took the real models (``bench/models``) from 1.41x to 1.32x onnxruntime's time for
ResNet-50 and 1.34x to 1.14x for DenseNet-121 at batch 1, 1.32x to 1.27x and 1.51x to 1.32x at
batch 8 (one thread each side, CPU time of alternating runs in one process).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import numpy as np

from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchDecl, ScratchRequest
from polyhal.ir.types import TensorType
from polyhal_cpu import blas, native, onednn_kernels, onednn_normalization, parallel
from polyhal_cpu import queue_layout as layout
from polyhal_cpu.ops import BLOCKED_CONV, SCALE_SHIFT_CONV
from polyhal_cpu.scratch import array as scratch_array
from polyhal_cpu.scratch import standalone
from polyhal_cpu.table import TABLE, Kernel, Types, float16_via_float32, frozen, numpy_activation

_F32 = np.dtype(np.float32)
#: Output positions one GEMM of the im2col path aims for. A 14x14 or 7x7 plane alone leaves
#: OpenBLAS's sgemm with a few panels of work per call, so the planes of several images are
#: stacked into one GEMM (measured on a 2-core VM: a batch of 8 through DenseNet's 3x3 convs at
#: 14x14, 128 -> 32 channels, went from 8x onnxruntime's time to ~2x).
GEMM_POSITIONS = 2048
#: Largest im2col columns stacking images may grow to (one image's columns may be larger).
COLUMNS_BYTES = 16 << 20
#: Output positions from which a stride-1 convolution skips im2col (the shifted path): on a
#: 56x56 plane the columns are 9x the input, written and read again, for a GEMM whose M (output
#: channels: 32 in DenseNet) is small. Measured on a 2-core VM against im2col (batch 8, 3x3):
#: 56x56 128 -> 32 channels 39 -> 19 ms, 64 -> 64 27 -> 17 ms; 28x28 128 -> 32 6.9 -> 5.3 ms,
#: 128 -> 128 13.5 -> 12.3 ms; at 14x14 the nine short GEMMs lose (12.4 -> 13.4 ms).
SHIFTED_POSITIONS = 28 * 28
#: Whether 2-D float32 convolutions of one group take the compiled register-tiled GEMM
#: (:func:`_tiles`) where the compiled loops are available.
TILES = True
#: Multiply-adds per output value (C * taps) below which the tiles path is not taken: over the
#: 3 channels of an image (EfficientNet's and MobileNet's 3x3 stems, K = 27) each tile has too
#: little to compute for its own cost (measured 0.60 ms against im2col + OpenBLAS's 0.48 ms);
#: ResNet's 7x7 stem (K = 147) gains.
TILES_MIN_K = 64
#: Whether batch-1 stride-1 convs of the tiles path run as pieces that each fill their own slab
#: of the padded image (:func:`_slabs`) where the compiled queue runs.
#:
#: Such a conv is cut into one piece per thread (parallel.queue_parts): into blocks of B's
#: columns (output rows times the padded width), cut at whole tiles so that the pieces compute
#: no more tiles than the whole GEMM (cut at output rows, each block's partial last tile cost
#: ~20 us a piece at 28x28), and into blocks of whole panels of output channels where there are
#: fewer tiles than pieces, or first where the weights pass SLAB_WEIGHTS_BYTES (each piece
#: streams its panels' weights down each tile column: from L3 for each where they pass L2).
#: A piece cut by panels fills all of the padded image; by columns, its rows. Measured on the
#: 2-core VM (AVX-512), two threads while the other core was free (best of alternating runs;
#: old: cut by panels, the plane filled by the caller in Python), 3x3 pad 1 batch 1, in us:
#:
#: ==================  ====  ===================  ===================
#: conv                old   by columns, 2 / 4    by panels, 2 / 4
#: ==================  ====  ===================  ===================
#: 128 -> 32, 56x56    1356  **1164** / 1185        1150 / 1233
#: 128 -> 32, 28x28     435   **323** / 332          318 / 341
#: 128 -> 32, 14x14     114   **106** / 108           97 / 110
#: 128 -> 32, 7x7        56    **38** / 43 (2x2)      39 / 47
#: 64 -> 64, 56x56     1261  **1144** / 1205        1157 / 1183
#: 128 -> 128, 28x28   1255  1228 / 1229           **1165** / 1191
#: 256 -> 256, 14x14   1224  1361 / 1359           **1192** / 1214
#: 512 -> 512, 7x7     1418  1371 / 1379           **1365** / 1397
#: ==================  ====  ===================  ===================
#:
#: Alone, DenseNet's 128 -> 32 convs did as well or a little better by panels, but in the
#: whole model (its image just written by the op before, its caches shared with the model's
#: other data) by columns won: DenseNet-121 b1 39.5-40.4 ms against 40.3-41.0 ms by panels,
#: 64.5 against 70-71 ms while the other core was busy elsewhere. Two pieces a thread balanced
#: worse on a quiet VM (they helped only while the other core was busy: 128 -> 32 56x56 alone
#: 2.5 against 3.4 ms).
SLABS = True
#: Bytes of weights (M x C x taps floats) above which a slab-cut conv is cut by panels first.
SLAB_WEIGHTS_BYTES = 512 << 10
#: Output positions from which a batch-1 1x1 conv of the tiles path without a prologue is cut
#: by blocks of B's columns (each piece reading its columns of the image where they lie)
#: rather than by output-channel panels. (With a prologue it always is: its pieces fill their
#: slabs through it, :func:`_slabs`.) Measured on the 2-core VM, two threads, run_gemms us, by
#: panels / by columns (best of three alternating runs): 56x56 64 -> 256 497 / 498, 256 -> 64
#: 492 / 483, 64 -> 64 128 / 128, 256 -> 128 973 / 965; 28x28 (24.5 tiles: by columns one piece
#: has a tile more) 128 -> 512 491 / 512, 512 -> 128 478 / 490, 128 -> 128 126 / 134.
POINTWISE_BY_COLUMNS_FROM = 56 * 56

#: A compiled epilogue's pieces hold this many times parallel.MIN_ELEMENTS outputs at least: a
#: pass costs ~0.12-0.35 ns an element (relu to silu, 2-core VM), ~100 us for a 256 x 56 x 56
#: output, so that only the largest are worth a hand-off. (Per element, single-threaded: a 3x3
#: depthwise conv ~1.8 ns NCHW and ~0.8 ns channel-blocked, a 3x3 max pool ~3 ns, im2col
#: ~0.2-0.6 ns; their pieces' factors follow, a depthwise conv's scaled by its taps.)
EPILOGUE_FACTOR = 16


class _Conv:
    """A convolution's geometry from its operand types and attributes (2-D for 1-D ones)."""

    def __init__(self, attrs: dict, x: TensorType, w: TensorType, out: TensorType, prologue: bool = False) -> None:
        #: whether the conv reads its input through a scale_shift_conv's prologue
        self.prologue = prologue
        self.n = n = x.rank - 2
        s = [int(v) for v in (attrs.get("strides") or [1] * n)]
        p = [int(v) for v in (attrs.get("pads") or [0] * (2 * n))]
        d = [int(v) for v in (attrs.get("dilations") or [1] * n)]
        self.s, self.pb, self.pe, self.d = s, p[:n], p[n:], d
        self.group = int(attrs["group"])
        self.batch, self.c = x.shape[:2]
        self.m, self.cg = w.shape[:2]
        self.mg = self.m // self.group
        self.k, self.in_sp, self.out_sp = list(w.shape[2:]), list(x.shape[2:]), list(out.shape[2:])
        self.taps, self.positions = math.prod(self.k), math.prod(self.out_sp)
        self.dtype = _F32 if x.dtype == np.float16 else x.dtype
        if n == 1:  # as 2-D, height 1
            self.s, self.pb, self.pe, self.d = [1] + s, [0] + self.pb, [0] + self.pe, [1] + d
            self.k, self.in_sp, self.out_sp = [1] + self.k, [1] + self.in_sp, [1] + self.out_sp
        native2d = len(self.k) == 2 and native.available(self.dtype)
        # The padded image's geometry for the shifted path: its width, and its plane's length
        # with the room the last taps read past the bottom-right corner.
        self.wide = self.in_sp[-1] + self.pb[-1] + self.pe[-1]
        self.plane = (self.in_sp[0] + self.pb[0] + self.pe[0]) * self.wide + (self.k[-1] - 1) * self.d[-1]
        pointwise = all(k == 1 for k in self.k) and all(v == 1 for v in self.s) and not any(p)
        # A 1x1 conv takes the tiles where its positions fill whole tiles but for at most an
        # eighth (14x14 and 7x7 planes pad to 224 and 64: OpenBLAS did better there).
        waste = -(-self.positions // native.GEMM_NR) * native.GEMM_NR - self.positions
        if pointwise and self.group == 1 and native2d and waste * 8 <= self.positions and TILES:
            self.path = "tiles"
            #: the image's planes the tiles path reads (None: the image itself, for a 1x1 conv)
            self.phases = None
            # at batch 1 on the queue, by blocks of B's columns where a prologue is applied as
            # each piece fills its slab, or where that beat panels (see POINTWISE_BY_COLUMNS_FROM)
            by_columns = prologue or self.positions >= POINTWISE_BY_COLUMNS_FROM
            self.tiles_slabs = self._slab_pieces(self.positions) if by_columns else None
            self.tiles_pieces = [] if self.tiles_slabs else self._tile_pieces(self.positions)
        elif pointwise and self.group == 1:
            self.path = "pointwise"
        elif native2d and self.group == 1 and self.taps > 1 and self.c * self.taps >= TILES_MIN_K and TILES:
            self.path = "tiles"
            self.phases = _Phases(self)
            #: the pieces of a batch-1 stride-1 conv on the compiled queue (None: not cut so)
            self.tiles_slabs = self._slab_pieces(self.out_sp[0] * self.phases.width)
            self.tiles_images = 1
            self.tiles_pieces = [] if self.tiles_slabs else self._tile_pieces(self.out_sp[0] * self.phases.width)
        elif native2d and self.group == self.c and self.cg == 1:
            self.path = "depthwise"
        elif (len(self.k) == 2 and self.group == 1 and self.s == [1, 1] and self.positions >= SHIFTED_POSITIONS
              and blas.gemm(self.dtype) is not None):
            self.path = "shifted"
        else:
            self.path = "gemm"
        self.native_columns = native2d
        one = self.c * self.taps * self.positions * self.dtype.itemsize
        stack = max(1, min(self.batch, GEMM_POSITIONS // max(self.positions, 1), COLUMNS_BYTES // max(one, 1)))
        #: Images whose columns go into one GEMM (the compiled im2col only; see GEMM_POSITIONS).
        self.stack = -(-self.batch // -(-self.batch // stack)) if native2d and self.path == "gemm" else 1
        #: Blocks of channels whose columns are built at once (one image per GEMM, compiled im2col).
        self.column_blocks = [cs for _, cs in parallel.grid(1, self.c, self.taps * self.positions, factor=4)]

    def _tile_pieces(self, ncols: int) -> list[tuple[int, int, int]]:
        """The tiles path's pieces of one image's GEMM (M, ``ncols``) @ (C * taps): blocks of
        whole panels of output channels (GEMM_MR rows), as (first row, last row + 1, columns
        per block of :func:`polyhal_cpu.native.gemm_tiles`), as many as the product is worth
        threads (:func:`polyhal_cpu.parallel.gemm_pieces`; one where it is not cut). Each piece
        reads all of B (the image's planes, filled once per image, shared) and packs its own
        panel of B and accumulates its own tiles (its own part of the ``product`` scratch).

        Where a batch's GEMMs are worth as many pieces as blocks of its images as cut by
        channels (at batch 8, and DenseNet's 14x14 and 7x7 convs, too small to cut one image's),
        the pieces are blocks of whole images instead (``tiles_images`` of them), each with its
        own planes and scratch: B read once, one hand-off per conv rather than per image
        (measured at batch 8 on ResNet's 56x56 3x3 convs: 2-10% less CPU time than cut by
        channels, the same elsewhere)."""
        b_size = None if self.phases is None else self.c * len(self.phases.used) * self.phases.length
        if self.batch == 1 and native.gemm_queue() is not None:  # on the compiled queue: cut finer
            parts = parallel.queue_parts(self.m * ncols * self.c * self.taps / parallel.GEMM_MACS_PER_US)
        else:
            parts = parallel.gemm_pieces(self.m, ncols, self.c * self.taps, b_size=b_size)
        bounds = parallel.blocks(-(-self.m // native.GEMM_MR), parts)
        #: blocks of images run as pieces of their own (1: images one after another)
        self.tiles_images = 1
        if self.batch > 1:
            images = len(parallel.blocks(self.batch, parallel.gemm_pieces(
                self.m, ncols, self.c * self.taps, batch=self.batch, b_size=b_size)))
            if images > 1 and images >= len(bounds):
                self.tiles_images, bounds = images, [(0, -(-self.m // native.GEMM_MR))]
        rows = [(p0 * native.GEMM_MR, min(self.m, p1 * native.GEMM_MR)) for p0, p1 in bounds]
        return [(lo, hi, native.gemm_block(hi - lo, ncols)) for lo, hi in rows]

    def _slab_pieces(self, ncols: int) -> list[tuple[int, int, int, int, int]] | None:
        """A batch-1 stride-1 conv's pieces on the compiled queue (:func:`_slabs`), as (first
        column of B, last + 1, first output channel, last + 1, columns per block of
        :func:`polyhal_cpu.native.gemm_tiles`); None where it is not run so (a batch, a stride,
        the queue off): B's columns (output rows times the padded width) in blocks of whole
        tiles (GEMM_NR columns, the last partial), so that the pieces compute no more tiles than
        the whole, and output channels in blocks of whole panels (see SLABS). ``ncols``: B's
        columns (a 1x1 conv's: the positions)."""
        if self.batch != 1 or self.s != [1, 1] or native.gemm_queue() is None or not SLABS:
            return None
        panels, tiles = -(-self.m // native.GEMM_MR), -(-ncols // native.GEMM_NR)
        parts = parallel.queue_parts(self.m * ncols * self.c * self.taps / parallel.GEMM_MACS_PER_US)
        # panels first only where the weights a piece streams per tile column pass L2 (see SLABS)
        by_panels = max(1, min(panels, parts, -(-self.m * self.c * self.taps * 4 // SLAB_WEIGHTS_BYTES)))
        by_columns = max(1, min(tiles, parts // by_panels))
        by_panels = max(1, min(panels, parts // by_columns))
        pieces = []
        for t0, t1 in parallel.blocks(tiles, by_columns):
            j0, j1 = t0 * native.GEMM_NR, min(ncols, t1 * native.GEMM_NR)
            for p0, p1 in parallel.blocks(panels, by_panels):
                m0, m1 = p0 * native.GEMM_MR, min(self.m, p1 * native.GEMM_MR)
                pieces.append((j0, j1, m0, m1, native.gemm_block(m1 - m0, j1 - j0)))
        return pieces

    @property
    def fills_slabs(self) -> bool:
        """Whether the pieces (``tiles_slabs``) fill slabs: of the padded image, or of a 1x1
        conv's columns through its prologue (else they read a 1x1 conv's image where it lies)."""
        return self.path == "tiles" and bool(self.tiles_slabs) and (self.phases is not None or self.prologue)

    @property
    def fill(self) -> str:
        """The conv's path, or "slabs" where its pieces fill slabs (:data:`PROLOGUE_FILLS`)."""
        return "slabs" if self.fills_slabs else self.path

    def slab_rows(self, j0: int, j1: int) -> tuple[int, int]:
        """The padded rows B's columns j0 .. j1 read: (the first, how many); a 1x1 conv's piece
        reads its columns as one row."""
        if self.phases is None:
            return 0, 1
        wide = self.phases.width
        return j0 // wide, (j1 - 1) // wide - j0 // wide + 1 + (self.k[0] - 1) * self.d[0]

    @property
    def slab_pitch(self) -> int:
        """Floats between a slab's channels (:func:`_slabs`): the padded rows the tallest piece
        reads, and the room its last taps read past them; a 1x1 conv's widest block of columns
        (a piece's fills and computes a block at a time), to whole 64-byte lines."""
        if self.phases is None:
            return -(-max(block for *_, block in self.tiles_slabs) // 16) * 16
        rows = max(self.slab_rows(j0, j1)[1] for j0, j1, *_ in self.tiles_slabs)
        return rows * self.phases.width + (self.k[1] - 1) * self.d[1]

    @property
    def slab_size(self) -> int:
        """Floats of a slab: its channels, and room for a last partial tile's whole width past
        the last row (read where it lies, not copied: see :func:`polyhal_cpu.native.gemm_tiles`)."""
        return self.c * self.slab_pitch + native.GEMM_NR

    @property
    def columns_bytes(self) -> int:
        """Bytes of the im2col columns of ``stack`` images; on the shifted path, of the weights
        tap by tap and one padded image; on the tiles path, of one padded image's phase planes
        (0 for the paths without columns), one for each block of images run as a piece."""
        if self.path == "tiles":
            if self.fills_slabs:
                return len(self.tiles_slabs) * self.slab_size * self.dtype.itemsize
            if self.phases is None:
                return 0
            return self.tiles_images * self.c * len(self.phases.used) * self.phases.length * self.dtype.itemsize
        if self.path == "shifted":
            return (self.taps * self.m * self.c + self.c * self.plane) * self.dtype.itemsize
        return self.c * self.taps * self.positions * self.stack * self.dtype.itemsize if self.path == "gemm" else 0

    @property
    def phases_bytes(self) -> int:
        """Bytes of the column phases the compiled im2col splits a strided image's planes into
        (:func:`polyhal_cpu.native.im2col_work`): one image's part for each image of a stack, or
        for each block of channels built at once (pieces running together never share a part)."""
        if self.path != "gemm" or not self.native_columns:
            return 0
        parts = self.stack if self.stack > 1 else len(self.column_blocks)
        return parts * native.im2col_work(1, self.in_sp, self.k, self.s, self.out_sp) * self.dtype.itemsize

    @property
    def product_bytes(self) -> int:
        """Bytes of a stacked GEMM's product, (M, stack, positions), before it is laid out as
        (stack, M, positions) in the output; on the shifted path, of one image's output over the
        padded width; on the tiles path, of a packed panel of B and a block of tiles for each
        piece the GEMM is cut into, or each block of images run as a piece (0 otherwise)."""
        if self.path == "tiles" and self.tiles_slabs:
            return sum(native.gemm_tiles_bytes(m1 - m0, self.c * self.taps, block)
                       for _, _, m0, m1, block in self.tiles_slabs)
        if self.path == "tiles":
            return self.tiles_images * sum(native.gemm_tiles_bytes(hi - lo, self.c * self.taps, block)
                                           for lo, hi, block in self.tiles_pieces)
        if self.path == "shifted":
            return self.m * self.out_sp[0] * self.wide * self.dtype.itemsize
        return self.m * self.stack * self.positions * self.dtype.itemsize if self.stack > 1 else 0

    def as2d(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """An (N, C, spatial...) shape as the 2-D kernels see it."""
        return shape[:2] + (1,) + shape[2:] if self.n == 1 else shape


def _geometry(problem) -> _Conv:
    """The conv of a ``conv``, ``fused_conv`` or ``scale_shift_conv`` problem (the last's
    with its prologue: :func:`_scale_shift_conv`)."""
    if problem.op == SCALE_SHIFT_CONV:
        attrs, ins = _without_prologue(problem.attrs, problem.in_types)
        return _Conv(attrs, ins[0], ins[1], problem.out_types[0], prologue=True)
    x, w = problem.in_types[:2]
    return _Conv(problem.attrs, x, w, problem.out_types[0])


def _columns_bytes(problem, _workgroup_size: int) -> int:
    return _geometry(problem).columns_bytes


def _product_bytes(problem, _workgroup_size: int) -> int:
    return _geometry(problem).product_bytes


def _phases_bytes(problem, _workgroup_size: int) -> int:
    return _geometry(problem).phases_bytes


def _numpy_columns(g: _Conv):
    """im2col by numpy, tap by tap: ``fill(x_image, cols)`` with cols (C, taps, positions)."""
    n = len(g.k)
    plan = []  # per tap: (tap index, output slices, input slices), or (tap, None, None) if empty
    for t, tap in enumerate(np.ndindex(*g.k)):
        outs, ins = [], []
        for i in range(n):
            start = tap[i] * g.d[i] - g.pb[i]  # input index of output position 0
            lo = 0 if start >= 0 else -(-(-start) // g.s[i])
            hi = min(g.out_sp[i], (g.in_sp[i] - 1 - start) // g.s[i] + 1) if start < g.in_sp[i] else 0
            if hi <= lo:
                outs = None
                break
            outs.append(slice(lo, hi))
            ins.append(slice(start + lo * g.s[i], start + (hi - 1) * g.s[i] + 1, g.s[i]))
        plan.append((t, None if outs is None else tuple(outs), None if outs is None else tuple(ins)))
    full = all(o is not None and all(sl.stop - sl.start == size for sl, size in zip(o, g.out_sp))
               for _, o, _ in plan)

    def fill(x, cols):
        view = cols.reshape((g.c, g.taps) + tuple(g.out_sp))
        if not full:
            view.fill(0)
        for t, o, i in plan:
            if o is not None:
                np.copyto(view[(slice(None), t) + o], x[(slice(None),) + i])
    return fill


_CONV_SCRATCH = (
    ScratchDecl("columns", shared=True, per_launch=_columns_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="im2col columns of one or a few images (C * taps x images * output positions); "
                        "on the shifted path the weights tap by tap and one zero-padded image; on the "
                        "tiles path at batch 1 each piece's slab of the padded image (or of its columns)"),
    ScratchDecl("product", shared=True, per_launch=_product_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="the GEMM product before it is copied into the output: of stacked images "
                        "(M, images, positions), or of the shifted path (M, rows * padded width)"),
    ScratchDecl("phases", shared=True, per_launch=_phases_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="a horizontally strided image's planes split into column phases by im2col, "
                        "one part per piece building columns at once"))


def _own_scratch(decls, op: str, attrs: dict, ins: Types, outs: Types) -> tuple[ScratchRequest, ...]:
    """The scratch of this module's own kernel of an instance, from its declarations ``decls``."""
    problem, kernel = Problem(op, attrs, tuple(ins), tuple(outs)), KernelInfo(f"cpu_{op}", op, 1, 1, "cpu")
    return tuple(d.request(problem, kernel) for d in decls)


def _onednn_runs(device, decls, own_builder, op: str, attrs: dict, ins: Types, outs: Types) -> bool:
    """Whether oneDNN runs this conv instance: it serves it and was not measured slower than the
    own kernel ``own_builder`` (whose scratch ``decls`` declare) when the plan was compiled
    (:func:`polyhal_cpu.onednn_kernels.conv_chosen`)."""
    def own() -> Kernel:
        return own_builder(device, op, attrs, ins, outs, standalone(device, _own_scratch(decls, op, attrs, ins, outs)))
    return onednn_kernels.conv_chosen(op, attrs, ins, outs, own)


def _conv_scratch(device, op: str, attrs: dict, ins: Types, outs: Types) -> tuple[ScratchRequest, ...]:
    """A conv's scratch: the oneDNN primitive's where it runs the instance, else this module's."""
    if _onednn_runs(device, _CONV_SCRATCH, _own_conv, op, attrs, ins, outs):
        return onednn_kernels.conv_scratch(op, attrs, ins, outs)
    return _own_scratch(_CONV_SCRATCH, op, attrs, ins, outs)


@TABLE.register("conv", "fused_conv", scratch=_conv_scratch)
def _conv(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """A oneDNN primitive where it runs the instance (:mod:`polyhal_cpu.onednn_kernels`: the
    library serves it and, if small, measured faster), else this module's paths (the module
    docstring)."""
    if _onednn_runs(device, _CONV_SCRATCH, _own_conv, op, attrs, ins, outs):
        return onednn_kernels.conv(op, attrs, ins, outs, scratch)
    return _own_conv(device, op, attrs, ins, outs, scratch)


@float16_via_float32
def _own_conv(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    g = _Conv(attrs, ins[0], ins[1], outs[0])
    fused = op == "fused_conv"
    activation = attrs["activation"] if fused else "none"
    alpha, beta = (float(attrs["alpha"]), float(attrs["beta"])) if fused else (0.0, 0.0)
    has_bias, has_residual = len(ins) >= 3, len(ins) == 4
    fast = native.available(g.dtype)
    act_code = native.activation_code(activation) if fast else 0
    act_numpy = None if fast else numpy_activation(device, activation, alpha, beta, outs[0])
    shape2d = g.as2d(outs[0].shape)
    rows, length = g.batch * g.m, g.positions
    rows3 = (g.batch, g.m, length)
    zero_bias = np.zeros(g.m, g.dtype)
    matmul, contiguous, run = np.matmul, np.ascontiguousarray, parallel.run
    has_epilogue = has_bias or has_residual or activation != "none"
    epilogue_grid = parallel.grid(g.batch, g.m, length, factor=EPILOGUE_FACTOR)

    def finish_part(o3, b, r3, ns, cs):
        """The compiled epilogue over images ``ns``, channels ``cs`` of the (N, M, positions) output."""
        native.epilogue(o3[ns, cs].reshape(-1, length), b[cs], None if r3 is None else r3[ns, cs].reshape(-1, length),
                        act_code, alpha, beta)

    def epilogue_tasks(out, b, r):
        """The epilogue as pieces for :func:`polyhal_cpu.parallel.run` (none for a bare conv)."""
        if not has_epilogue:
            return []
        if not fast:
            return [partial(finish, out, b, r)]
        r3 = None if r is None else contiguous(r).reshape(rows3)
        return [partial(finish_part, out.reshape(rows3), b, r3, ns, cs) for ns, cs in epilogue_grid]

    def finish(out, b, r):
        """The epilogue, one pass over the (N * M, positions) output (none for a bare conv, as
        DenseNet's 3x3 and transition convs are)."""
        if not has_bias and r is None and activation == "none":
            return
        if fast:
            native.epilogue(out.reshape(rows, length), b, None if r is None else contiguous(r).reshape(rows, length),
                            act_code, alpha, beta)
            return
        if has_bias:
            out += b.reshape((g.m,) + (1,) * g.n)
        if r is not None:
            out += r
        if act_numpy is not None:
            act_numpy(out)

    if g.path == "depthwise":
        mult = g.m // g.c  # output channels per input channel
        # pieces: images, or channel blocks of one image (each a C-contiguous block of x and out)
        pieces = [(ns, cs, cs if cs.start is None else slice(cs.start * mult, cs.stop * mult))
                  for ns, cs in parallel.grid(g.batch, g.c, mult * length, factor=9 / g.taps)]
        column_ranges = native.column_table(g.out_sp[1], g.k[1], g.s[1], g.pb[1], g.d[1], g.in_sp[1])

        def kernel(x, w, *rest):
            out = rest[-1]
            b = rest[0] if has_bias else zero_bias
            r = contiguous(rest[1]).reshape(shape2d) if has_residual else None
            x4, w4, o4 = contiguous(x).reshape(g.as2d(x.shape)), contiguous(w).reshape(g.as2d(w.shape)), \
                out.reshape(shape2d)
            run([partial(native.depthwise, x4[ns, cs], w4[ms], column_ranges, b[ms], None if r is None else r[ns, ms],
                         o4[ns, ms], g.s, g.pb, g.d, act_code, alpha, beta) for ns, cs, ms in pieces])
        return kernel

    # A GEMM is cut along its longer side (each piece packs all of the other operand: the
    # shorter). Cut into blocks of output channels, each piece finishes its channels (the
    # epilogue) while they are in cache; cut into blocks of positions, the epilogue is a pass
    # of its own after the GEMM.
    fuse = fast and g.group == 1

    if g.path == "pointwise":
        queued = _pointwise_queued(g, has_bias, has_residual, zero_bias, act_code, alpha, beta) if fuse else None
        if queued is not None:
            return queued
        split = parallel.GemmSplit(g.m, length, g.c)
        by_rows = fuse and split.axis == 0

        def pointwise_rows(w2, xn, o3, b, r3, n, lo, hi):
            matmul(w2[lo:hi], xn, out=o3[n, lo:hi])
            if has_epilogue:
                finish_part(o3, b, r3, slice(n, n + 1), slice(lo, hi))

        def kernel(x, w, *rest):
            out = rest[-1]
            b, r = rest[0] if has_bias else zero_bias, rest[1] if has_residual else None
            w2, x3, o3 = w.reshape(g.m, g.c), x.reshape(g.batch, g.c, length), out.reshape(rows3)
            if by_rows:
                r3 = None if r is None else contiguous(r).reshape(rows3)
                run([partial(pointwise_rows, w2, x3[n], o3, b, r3, n, lo, hi)
                     for n in range(g.batch) for lo, hi in split.bounds])
                return
            run([t for n in range(g.batch) for t in split.tasks(w2, x3[n], o3[n])])
            run(epilogue_tasks(out, b, r))
        return kernel

    if g.path == "tiles":
        return _tiles(g, scratch, has_bias, has_residual, zero_bias, act_code, alpha, beta)
    k2 = g.cg * g.taps
    if g.path == "shifted":
        return _shifted(g, scratch, epilogue_tasks, has_bias, has_residual, zero_bias)
    if g.native_columns and g.stack > 1:
        return _stacked(g, scratch, finish_part, has_bias, has_residual, has_epilogue, zero_bias)
    if g.native_columns:
        flat = scratch_array(scratch, "columns", g.dtype, (g.group, k2, length))
        # an image's columns are built in blocks of channels (each with its own part of the
        # phases scratch), its GEMM cut into rows or columns
        column_blocks = g.column_blocks
        parts = len(column_blocks)
        work = scratch_array(scratch, "phases", g.dtype, (parts, g.phases_bytes // g.dtype.itemsize // parts))
        split = parallel.GemmSplit(g.mg, length, k2, batch=g.group)
        by_rows = fuse and split.axis == 0

        def columns(x4, n, part, cs):
            cols2 = flat.reshape(g.c * g.taps, length)
            if cs.start is not None:
                x4, cols2 = x4[:, cs], cols2[cs.start * g.taps:cs.stop * g.taps]
            native.im2col(x4[n:n + 1], 0, cols2, work[part], g.k, g.s, g.pb, g.d, g.out_sp)

        def descspiece(w3, o3, b, r3, n, lo, hi):
            """Output channels lo..hi of image n: their GEMM, then their epilogue."""
            matmul(w3[0, lo:hi], flat[0], out=o3[n, lo:hi])
            if has_epilogue:
                finish_part(o3, b, r3, slice(n, n + 1), slice(lo, hi))

        def kernel(x, w, *rest):
            out = rest[-1]
            b, r = rest[0] if has_bias else zero_bias, rest[1] if has_residual else None
            x4 = contiguous(x).reshape(g.as2d(x.shape))
            w3 = w.reshape(g.group, g.mg, k2)
            o3 = out.reshape(rows3)
            r3 = None if r is None else contiguous(r).reshape(rows3)
            for n in range(g.batch):
                run([partial(columns, x4, n, i, cs) for i, cs in enumerate(column_blocks)])
                if by_rows:
                    run([partial(descspiece, w3, o3, b, r3, n, lo, hi) for lo, hi in split.bounds])
                else:
                    run(split.tasks(w3, flat, o3[n].reshape(g.group, g.mg, length)))
            if not by_rows:
                run(epilogue_tasks(out, b, r))
        return kernel

    cols = scratch_array(scratch, "columns", g.dtype, (g.group, k2, length))
    numpy_fill = _numpy_columns(g)

    def kernel(x, w, *rest):
        out = rest[-1]
        x4 = contiguous(x).reshape(g.as2d(x.shape))
        w3 = w.reshape(g.group, g.mg, k2)
        o4 = out.reshape(g.batch, g.group, g.mg, length)
        for n in range(g.batch):
            numpy_fill(x4[n], cols)
            matmul(w3, cols, out=o4[n])
        finish(out, rest[0] if has_bias else zero_bias, rest[1] if has_residual else None)
    return kernel


def _pointwise_queued(g: _Conv, has_bias: bool, has_residual: bool, zero_bias: np.ndarray, act: int, alpha: float,
                      beta: float) -> Kernel | None:
    """The pointwise path on the compiled GEMM queue (:func:`polyhal_cpu.parallel.run_gemms`):
    each image's ``out[n] (M, HW) = w (M, C) @ x[n] (C, HW)`` cut into blocks of output
    channels, each an sgemm into the output that starts from the bias (broadcast along the
    row) and ends with the residual and activation over its rows while they are in cache; the
    images' pieces go in one table. None where the queue is off. (Through
    :func:`polyhal_cpu.parallel.run`, each piece paid a Python hand-off of ~80 us: DenseNet's
    1x1 convs over 14x14 and 7x7 planes took 244 and 156 us at batch 1, where their sgemm
    takes ~150 and ~60.)

    Cut by blocks of positions instead (as :func:`_pointwise_prologue` is, where they
    outnumber the channels), it lost alone on the 2-core VM (batch 1, two threads, median us,
    by channels / by positions): 14x14 C -> 128 for C = 256, 512, 768, 1024: 91 / 93, 159 / 165,
    227 / 233, 303 / 305 (a second run, the other core busier: 162 / 159, 174 / 193, 243 / 259,
    326 / 346); 7x7 (positions cut 32 + 17) 512 -> 128 56 / 65, 1024 -> 128 106 / 124;
    ResNet-50's 1x1s (M >= positions: cut by channels either way under that rule) 1024 -> 256
    at 14x14 1095 / 1091, 256 -> 1024 558 / 606, 2048 -> 512 at 7x7 632 / 853, 512 -> 2048
    1242 / 1337. Without a prologue the pieces read the input where it lies (nothing written
    first that the other core must fetch), so it stays cut by channels."""
    if parallel.gemm_fn() is None:
        return None
    length, f = g.positions, np.zeros  # arrays of the operands' shapes: the table is made here, once
    image = (g.m * length, g.c * length)  # an image's floats of the output, of the input
    table = parallel.GemmSplit(g.m, length, g.c, axis=0, queued=True).piece_table(
        f((g.m, g.c), _F32), f((g.c, length), _F32), f((g.m, length), _F32), 1.0, 1.0, f((g.m, 1), _F32),
        f((g.m, length), _F32) if has_residual else None, act, alpha, beta, batch=g.batch,
        steps=(0, image[1] * 4, image[0] * 4, 0, image[0] * 4))
    if table is None:
        return None

    def kernel(x, w, *rest):
        # (the arrays as the plan passes them: the same on every run, so the table is kept)
        c = np.ascontiguousarray
        parallel.run_gemms(table(c(w, _F32), c(x, _F32), rest[-1], c(rest[0] if has_bias else zero_bias, _F32),
                                 c(rest[1], _F32) if has_residual else None))
    return kernel


class _Phases:
    """The zero-padded image of the tiles path, split into the stride's phases: phase (a, b)
    holds padded rows a, a + sh, ... and columns b, b + sw, ... (a plane of ``rows`` x
    ``width``, stored in ``length`` floats: the room the last taps read past its corner). Tap
    (i, j) of output position (yo, xo) reads padded (yo sh + i dh, xo sw + j dw), which is phase
    (i dh mod sh, j dw mod sw) at (yo + i dh // sh, xo + j dw // sw): so in every phase plane,
    read flat, a tap is a fixed offset from output position yo * width + xo, and a strided
    convolution is a stride-1 one over the phase planes (only the phases some tap reads are
    kept). At stride 1 there is one phase, the padded image itself."""

    def __init__(self, g: _Conv) -> None:
        (sh, sw), (dh, dw) = g.s, g.d
        hp, wp = g.in_sp[0] + g.pb[0] + g.pe[0], g.in_sp[1] + g.pb[1] + g.pe[1]
        self.rows, self.width = -(-hp // sh), -(-wp // sw)
        taps = [(i * dh % sh, i * dh // sh, j * dw % sw, j * dw // sw) for i in range(g.k[0]) for j in range(g.k[1])]
        #: the phases (a, b) some tap reads, in order
        self.used = sorted({(a, b) for a, _, b, _ in taps})
        self.length = self.rows * self.width + max(dx for *_, dx in taps)
        index = {ab: n for n, ab in enumerate(self.used)}
        #: per tap: its phase's index in ``used`` and its offset in that plane
        self.taps = [(index[a, b], dy * self.width + dx) for a, dy, b, dx in taps]
        #: per used phase: (its rows, its columns) in the plane and (rows, columns) of the image
        #: they hold, as slices
        self.fills = []
        for a, b in self.used:
            ys = self._span(a, sh, g.pb[0], g.in_sp[0], self.rows)
            xs = self._span(b, sw, g.pb[1], g.in_sp[1], self.width)
            if ys is not None and xs is not None:
                self.fills.append((index[a, b], ys[0], xs[0], ys[1], xs[1]))

    @staticmethod
    def _span(phase: int, stride: int, pad: int, size: int, count: int):
        """The plane's slice of a phase that lies on the image, and the image's strided slice
        it holds (None if none does)."""
        lo = max(0, -(-(pad - phase) // stride))
        hi = min(count, (size - 1 + pad - phase) // stride + 1)
        if hi <= lo:
            return None
        first = phase + lo * stride - pad
        return slice(lo, hi), slice(first, first + (hi - lo - 1) * stride + 1, stride)


def _tiles(g: _Conv, scratch, has_bias: bool, has_residual: bool, zero_bias: np.ndarray, act: int, alpha: float,
           beta: float) -> Kernel:
    """A 2-D convolution of one group by the compiled register-tiled GEMM
    (:func:`polyhal_cpu.native.gemm_tiles`), one image at a time: ``out[n] (M, positions) = W
    (M, C * taps) @ B``, each tile finished (bias, residual, activation) as it is stored. A 1x1
    conv's B is the image itself, (C, positions). Otherwise, as on the shifted path, the image is
    copied into a zero-padded plane (split into the stride's phases, :class:`_Phases`) and B's
    row (c, tap) is that plane read flat from the tap's offset: no im2col, and one GEMM instead
    of a product per tap; the plane width's extra columns are simply not stored. The weights are
    packed once (a plan's constants; weights that may change are packed per call).

    In parallel (:mod:`polyhal_cpu.parallel`), an image's GEMM is cut into blocks of whole
    panels of output channels (``g.tiles_pieces``), which share the image's planes (filled by
    the calling thread, ~2% of the GEMM's time) and each pack and accumulate in their own part
    of the ``product`` scratch. Cut by channels, each piece reads all of B; cutting by columns
    would share B's reads but needs the output's row stride apart from its width, which the
    compiled loop does not take. In a batch, blocks of whole images are the pieces instead
    (``g.tiles_images``; see :meth:`_Conv._tile_pieces`), each with its own planes and
    scratch. Measured on the 2-core VM while its other core was free: ResNet-50's and
    DenseNet's 3x3 convs at b1 2.3-2.5 -> 1.4-1.5 ms on two threads. A stride-1 conv of one
    image on the compiled queue goes by :func:`_slabs` instead: each piece fills the part of
    the padded plane it reads itself.

    Measured single-threaded on a 2-core VM (AVX-512) against the paths it replaces: ResNet-50's
    3x3 convs 2.8-3.4 -> 2.3-3.0 ms, DenseNet's 128 -> 32 channel 3x3 convs at 56x56, 28x28 and
    14x14 3.0 -> 2.3, 0.93 -> 0.63 and 0.32 -> 0.16 ms; the 7x7 stride-2 stem 3.8 -> 3.0 ms and
    3x3 stride-2 convs 2.9 -> 2.5 ms (im2col + OpenBLAS before); 1x1 convs over 56x56 and 28x28
    planes within noise of OpenBLAS each, a few percent faster over whole models. Strided 1x1
    convs keep im2col + OpenBLAS (5-10% faster there)."""
    if g.tiles_slabs:
        return _slabs(g, scratch, has_bias, has_residual, zero_bias, act, alpha, beta)
    kdim, positions = g.c * g.taps, g.positions
    ph = g.phases
    packed = _Relaid(lambda w: native.pack_gemm_weights(w.reshape(g.m, kdim)))
    copies = g.tiles_images  # blocks of images run at once, each with its own planes and scratch
    work = scratch_array(scratch, "product", _F32, (copies, g.product_bytes // 4 // copies))
    # per piece of an image's GEMM: its rows of the output (whole panels of the packed
    # weights), and its own packed panel of B (bpack) and tiles (cbuf), consecutive parts of
    # the product scratch (of each copy's part)
    pieces, start = [], 0
    for lo, hi, block in g.tiles_pieces:
        end = start + native.gemm_tiles_bytes(hi - lo, kdim, block) // 4
        part = work[:, start:end]
        pieces.append((slice(lo, hi), slice(lo // native.GEMM_MR, -(-hi // native.GEMM_MR)),
                       part[:, :kdim * native.GEMM_NR], part[:, kdim * native.GEMM_NR:], block))
        start = end
    if ph is None:  # a 1x1 conv: B is the image, (C, positions)
        rowoff, ncols, wide, ow = np.arange(g.c, dtype=np.int64) * positions, positions, positions, positions
        bufs, fills, borders = [None] * copies, [[]] * copies, [[]] * copies
    else:
        (oh, ow), wide = g.out_sp, ph.width
        nphases = len(ph.used)
        bufs = list(scratch_array(scratch, "columns", _F32, (copies, g.c * nphases * ph.length)))
        fills, borders = zip(*(_phase_views(ph, g.c, buf) for buf in bufs))
        rowoff = np.array([(c * nphases + n) * ph.length + off for c in range(g.c) for n, off in ph.taps], np.int64)
        ncols = oh * wide
    packed_rows = np.arange(kdim, dtype=np.int64) * native.GEMM_NR  # bpack's rows

    def image(x4, wp, o3, b, r3, n, copy):
        """Image n through planes and scratch ``copy``: its planes filled, its GEMM's pieces."""
        for dst, src in fills[copy]:  # what lies on the image, overwritten per image
            np.copyto(dst, x4[n][src])
        src = x4[n].reshape(-1) if bufs[copy] is None else bufs[copy]
        return [partial(native.gemm_tiles, wp[ps], src, rowoff, packed_rows, ncols, wide, ow, o3[n, ms], b[ms],
                        None if r3 is None else r3[n, ms], bpack[copy], cbuf[copy], block, act, alpha, beta)
                for ms, ps, bpack, cbuf, block in pieces]

    def images(x4, wp, o3, b, r3, n0, n1, copy):
        """Images n0 .. n1 one after another, a piece of their own (whole GEMMs)."""
        for view in borders[copy]:
            view.fill(0)
        for n in range(n0, n1):
            for task in image(x4, wp, o3, b, r3, n, copy):
                task()

    groups = parallel.blocks(g.batch, copies)
    table = _tiles_table(g, pieces, rowoff, packed_rows, ncols, wide, ow, act, alpha, beta) if copies == 1 else None

    def kernel(x, w, *rest):
        out = rest[-1]
        wp = packed(w)
        b = rest[0] if has_bias else zero_bias
        xc = np.ascontiguousarray(x)
        x4 = xc.reshape(g.as2d(x.shape))
        o3 = out.reshape(g.batch, g.m, positions)
        r3 = np.ascontiguousarray(rest[1]).reshape(g.batch, g.m, positions) if has_residual else None
        if copies > 1:
            parallel.run([partial(images, x4, wp, o3, b, r3, n0, n1, i) for i, (n0, n1) in enumerate(groups)])
            return
        for view in borders[0]:
            view.fill(0)
        for n in range(g.batch):  # image by image, its GEMM's pieces sharing its planes
            if table is None:
                parallel.run(image(x4, wp, o3, b, r3, n, 0))
                continue
            for dst, src in fills[0]:
                np.copyto(dst, x4[n][src])
            if g.batch == 1:  # the arrays as the plan passes them (the same on every run: the table is kept)
                src, res, dst = xc, None if r3 is None else rest[1], out
            else:
                src, res, dst = x4[n], None if r3 is None else r3[n], o3[n]
            parallel.run_gemms(table(src if bufs[0] is None else bufs[0], wp, np.ascontiguousarray(b, _F32),
                                     None if res is None else np.ascontiguousarray(res), dst))
    return kernel


def _tiles_table(g: _Conv, pieces: list, rowoff: np.ndarray, packed_rows: np.ndarray, ncols: int, wide: int,
                 ow: int, act: int, alpha: float, beta: float) -> parallel.PieceTable | None:
    """The tiles path's pieces of one image's GEMM as descriptors of the compiled GEMM queue
    (queue_layout's KIND_TILES; operands B's source, packed weights, bias, residual, output),
    or None where the queue is off: a piece then goes through :func:`polyhal_cpu.parallel.run`,
    ~80 us a hand-off on a 2-core VM, as long as many a batch-1 conv's half."""
    if native.gemm_queue() is None:
        return None
    kdim, positions = g.c * g.taps, g.positions
    size = g.columns_bytes // 4 if g.phases is not None else g.c * positions
    descs = np.zeros((len(pieces), layout.G_FIELDS), np.int64)
    descs[:, layout.G_KIND], descs[:, layout.V_N], descs[:, layout.V_C] = layout.KIND_TILES, positions, kdim
    descs[:, layout.V_N0], descs[:, layout.V_ROWS], descs[:, layout.V_N1] = size, rowoff.ctypes.data, \
        packed_rows.ctypes.data
    descs[:, layout.V_H], descs[:, layout.V_WIDTH], descs[:, layout.V_OW] = ncols, wide, ow
    for i, (ms, ps, bpack, cbuf, block) in enumerate(pieces):
        descs[i, [layout.V_M, layout.V_OH, layout.V_A, layout.V_B, layout.V_BLOCK]] = (
            ms.stop - ms.start, ps.stop - ps.start, bpack[0].ctypes.data, cbuf[0].ctypes.data, block)
    _activation_fields(descs, act, alpha, beta)
    rows = [ms.start * positions * 4 for ms, *_ in pieces]
    return parallel.PieceTable(descs, [(layout.V_X, 0, [0] * len(pieces)),
                                       (layout.V_W, 1, [ps.start * kdim * native.GEMM_MR * 4 for _, ps, *_ in pieces]),
                                       (layout.V_BIAS, 2, [ms.start * 4 for ms, *_ in pieces]),
                                       (layout.V_RES, 3, rows), (layout.V_OUT, 4, rows)], keep=(rowoff, packed_rows))


def _slabs(g: _Conv, scratch, has_bias: bool, has_residual: bool, zero_bias: np.ndarray, act: int, alpha: float,
           beta: float, pre: tuple[int, float, float] | None = None) -> Kernel:
    """A batch-1 stride-1 conv of the tiles path as pieces of the compiled queue
    (queue_layout's KIND_TILES_SLAB; ``g.tiles_slabs``, see SLABS), each a block of B's
    columns (output rows times the padded width, cut at whole tiles) and of output channels: it
    fills its own slab of the zero-padded image (the padded rows its columns' taps read; every
    slab with the same channel pitch, so that one table of B's row offsets serves all) from
    the image as it lies, in compiled code, then runs :func:`polyhal_cpu.native.gemm_tiles`
    over it into its part of the output (the output's row stride, the positions, apart from
    the block's columns). Filling the whole padded image on the calling thread before the
    pieces start (:func:`_tiles` otherwise) cost a 128 -> 32 channel 28x28 conv 96 of its 445
    us on two threads (the image last touched by the other core); here each piece fills what
    it reads, in parallel, into its own slab (in cache for its GEMM), at the cost of the halo
    rows filled twice.

    A 1x1 conv's piece is a block of the image's columns (C x its columns): with a prologue
    (``pre``: a scale_shift_conv's pre-activation code, alpha, beta; the kernel then takes
    ``(x, scale, shift, w, b[, residual], out)``) it fills its slab with them normalised, as a
    padded image's pieces do theirs (:func:`polyhal_cpu.native.fill_slab`); without, it reads
    them where they lie (KIND_TILES at the block's first column). Measured on the 2-core VM,
    two threads while the other core was free (before: a scale_shift's pieces into a normalised
    copy, then the conv's pieces cut by panels), BN + ReLU + 1x1 conv, whole model in us: 160 ->
    128 at 56x56 760-800 -> 650-730, 320 -> 128 at 28x28 380-395 -> 355-380; with the other
    core busy 1320 -> 1250 and 647 -> 634 (one thread: the fill costs about what the scale_shift
    did); DenseNet-121 b1 36.2 -> 34.0 ms (medians of 12-15 alternating rounds in one process,
    twice), of which per profile its dense blocks 1 and 2's 1x1 convs 4.3 -> 3.6 and 4.7 -> 4.0
    ms and their 3x3 convs 8.2 -> 7.0 and 5.2 -> 4.2 ms: cut by columns as the 1x1 conv now is,
    each core reads the part of the map it wrote (by panels, each core wrote every position)."""
    kdim, positions = g.c * g.taps, g.positions
    pieces, fills = g.tiles_slabs, g.fills_slabs
    packed = _Relaid(lambda w: native.pack_gemm_weights(w.reshape(g.m, kdim)))
    work = scratch_array(scratch, "product", _F32, (g.product_bytes // 4,))
    pitch = g.slab_pitch if fills else positions
    slabs = scratch_array(scratch, "columns", _F32, (len(pieces), g.slab_size)) if fills else None
    taps = g.phases.taps if g.phases is not None else [(0, 0)]
    rowoff = np.array([c * pitch + off for c in range(g.c) for _, off in taps], np.int64)
    packed_rows = np.arange(kdim, dtype=np.int64) * native.GEMM_NR  # bpack's rows
    descs = np.zeros((len(pieces), layout.G_FIELDS), np.int64)
    for field, value in ((layout.G_KIND, layout.KIND_TILES_SLAB if fills else layout.KIND_TILES),
                         (layout.V_N, positions), (layout.V_C, kdim), (layout.V_ROWS, rowoff.ctypes.data),
                         (layout.V_N1, packed_rows.ctypes.data), (layout.V_KH, g.c), (layout.V_DW, pitch)):
        descs[:, field] = value
    if g.phases is not None:  # the padded image's geometry (a 1x1 conv's pieces' own, below)
        for field, value in ((layout.V_WIDTH, g.phases.width), (layout.V_OW, g.out_sp[1]),
                             (layout.V_SH, g.in_sp[0]), (layout.V_SW, g.in_sp[1]),
                             (layout.V_PLANE, g.in_sp[0] * g.in_sp[1]), (layout.V_PH, g.pb[0]),
                             (layout.V_PW, g.pb[1])):
            descs[:, field] = value
    if pre is not None:
        descs[:, layout.V_PRE_ACT] = pre[0]
        descs[:, layout.V_PRE_ALPHA], descs[:, layout.V_PRE_BETA] = (parallel.float_bits(v) for v in pre[1:])
    start, inputs, outputs = 0, [], []
    for i, (j0, j1, m0, m1, block) in enumerate(pieces):
        end = start + native.gemm_tiles_bytes(m1 - m0, kdim, block) // 4
        bpack, cbuf = work[start:start + kdim * native.GEMM_NR], work[start + kdim * native.GEMM_NR:end]
        start = end
        y0, count = g.slab_rows(j0, j1)
        descs[i, [layout.V_M, layout.V_OH, layout.V_H, layout.V_A, layout.V_B, layout.V_BLOCK]] = (
            m1 - m0, -(-(m1 - m0) // native.GEMM_MR), j1 - j0, bpack.ctypes.data, cbuf.ctypes.data, block)
        if fills:
            descs[i, [layout.V_N0, layout.V_DH, layout.V_Y0, layout.V_Y1]] = (
                g.slab_size, slabs[i].ctypes.data, y0, count)
        if g.phases is None:  # a plain matrix of the block's columns (from its first one), one row
            descs[i, [layout.V_WIDTH, layout.V_OW, layout.V_SH, layout.V_SW, layout.V_PLANE]] = (
                j1 - j0, j1 - j0, 1, j1 - j0, positions)
            if not fills:
                descs[i, layout.V_N0] = g.c * positions - j0  # B read in place: the image from its column
            inputs.append(j0 * 4)
            outputs.append((m0 * positions + j0) * 4)
        else:
            descs[i, layout.V_KW] = j0 - y0 * g.phases.width  # its first column's place in its slab's first row
            inputs.append(0)
            outputs.append((m0 * positions + y0 * g.out_sp[1]) * 4)  # its output from its first row
    _activation_fields(descs, act, alpha, beta)
    table = parallel.PieceTable(descs, [(layout.V_X, 0, inputs),
                                        (layout.V_W, 1, [m0 * kdim * 4 for _, _, m0, *_ in pieces]),
                                        (layout.V_BIAS, 2, [m0 * 4 for _, _, m0, *_ in pieces]),
                                        (layout.V_RES, 3, outputs), (layout.V_SCALE, 4, [0] * len(pieces)),
                                        (layout.V_SHIFT, 5, [0] * len(pieces)), (layout.V_OUT, 6, outputs)],
                                keep=(rowoff, packed_rows, work) + ((slabs,) if fills else ()))

    def run(x, w, b, r, out, scale=None, shift=None):
        # the operands held here: the pieces read them through raw addresses (weights that may
        # change are packed per call)
        _run_table(table, x, packed(w), zero_bias if b is None else b, r, scale, shift, out)

    if pre is not None:
        def prologue_kernel(x, scale, shift, w, b, *rest):
            run(x, w, b, rest[0] if has_residual else None, rest[-1], scale, shift)
        return prologue_kernel

    def kernel(x, w, *rest):
        run(x, w, rest[0] if has_bias else None, rest[1] if has_residual else None, rest[-1])
    return kernel


def _phase_views(ph: _Phases, c: int, buf: np.ndarray) -> tuple[list, list]:
    """Views of ``buf`` holding an image's phase planes: (plane view, the image's slices) to
    fill per image, and what no image value lands on (zeroed per call: the scratch is shared
    with other kernels): the padding around each phase's image part, the room past the planes'
    ends, and whole phases that lie in the padding."""
    nphases, wide = len(ph.used), ph.width
    flat = buf.reshape(c, nphases, ph.length)
    planes = flat[:, :, :ph.rows * wide].reshape(c, nphases, ph.rows, wide)
    fills = [(planes[:, n, ys, xs], (slice(None), ys_in, xs_in)) for n, ys, xs, ys_in, xs_in in ph.fills]
    borders = [flat[:, :, ph.rows * wide:]]
    filled = {n: (ys, xs) for n, ys, xs, _, _ in ph.fills}
    for n in range(nphases):
        if n not in filled:
            borders.append(planes[:, n])
            continue
        ys, xs = filled[n]
        borders += [planes[:, n, :ys.start], planes[:, n, ys.stop:], planes[:, n, ys, :xs.start],
                    planes[:, n, ys, xs.stop:]]
    return fills, [v for v in borders if v.size]


def _stacked(g: _Conv, scratch, finish_part, has_bias: bool, has_residual: bool, has_epilogue: bool,
             zero_bias: np.ndarray) -> Kernel:
    """im2col + GEMM with the columns of ``g.stack`` images side by side in one GEMM (small
    planes; see :data:`GEMM_POSITIONS`). In parallel, a stack is cut into sub-stacks of images,
    each a piece of its own: its columns, GEMM, copy into the images' outputs and epilogue,
    through its own part of the columns and product scratch (the images' columns interleave in a
    stack's, so building them in parallel needs each piece to own whole images)."""
    k2, length, stack = g.cg * g.taps, g.positions, g.stack
    flat = scratch_array(scratch, "columns", g.dtype, (g.group * k2 * stack * length,))
    product = scratch_array(scratch, "product", g.dtype, (g.m * stack * length,))
    work = scratch_array(scratch, "phases", g.dtype, (stack, g.phases_bytes // g.dtype.itemsize // stack))  # per image
    rows3 = (g.batch, g.m, length)
    subs = {nb: parallel.blocks(nb, parallel.gemm_pieces(g.mg, nb * length, k2, batch=g.group))
            for nb in {stack, g.batch % stack or stack}}
    contiguous, everything = np.ascontiguousarray, slice(None)

    def piece(x4, w3, o3, b, r3, n0, i0, i1):
        """Images n0 + i0 .. n0 + i1 of a stack starting at image n0."""
        nb, first = i1 - i0, n0 + i0
        cols = flat[g.group * k2 * i0 * length:g.group * k2 * i1 * length].reshape(g.group, k2, nb * length)
        native.im2col(x4, first, cols.reshape(g.c * g.taps, nb * length), work[i0:i1].reshape(-1), g.k, g.s, g.pb,
                      g.d, g.out_sp)
        prod = product[g.m * i0 * length:g.m * i1 * length].reshape(g.group, g.mg, nb * length)
        np.matmul(w3, cols, out=prod)
        np.copyto(o3[first:first + nb], prod.reshape(g.m, nb, length).transpose(1, 0, 2))
        if has_epilogue:
            for n in range(first, first + nb):
                finish_part(o3, b, r3, slice(n, n + 1), everything)

    def kernel(x, w, *rest):
        b, r = rest[0] if has_bias else zero_bias, rest[1] if has_residual else None
        x4 = contiguous(x).reshape(g.as2d(x.shape))
        w3 = w.reshape(g.group, g.mg, k2)
        o3 = rest[-1].reshape(rows3)
        r3 = None if r is None else contiguous(r).reshape(rows3)
        for n0 in range(0, g.batch, stack):
            nb = min(stack, g.batch - n0)
            parallel.run([partial(piece, x4, w3, o3, b, r3, n0, i0, i1) for i0, i1 in subs[nb]])
    return kernel


def _shifted(g: _Conv, scratch, epilogue_tasks, has_bias: bool, has_residual: bool, zero_bias: np.ndarray) -> Kernel:
    """A stride-1 2-D convolution without im2col. The image is copied once into a zero-padded
    plane of width ``wide``; read flat, output position (y, x) of that width sits at y * wide
    + x, and tap (i, j) reads the plane at that offset plus i * dh * wide + j * dw. So each
    tap is one GEMM of its (M, C) weights with a strided view of the padded planes (C rows, one
    row per channel), accumulated (BLAS's beta) into an (M, oh * wide) product whose last
    ``wide - ow`` columns of each row are discarded when it is copied into the output. The
    pieces run in parallel are blocks of output rows (columns of the product, all taps each)."""
    gemm = blas.gemm(g.dtype)
    (oh, ow), (kh, kw), wide, plane, taps = g.out_sp, g.k, g.wide, g.plane, g.taps
    hp = g.in_sp[0] + g.pb[0] + g.pe[0]
    buf = scratch_array(scratch, "columns", g.dtype, (taps * g.m * g.c + g.c * plane,))
    wt = buf[:taps * g.m * g.c].reshape(taps, g.m, g.c)
    padded = buf[taps * g.m * g.c:].reshape(g.c, plane)
    inner = padded[:, :hp * wide].reshape(g.c, hp, wide)[:, g.pb[0]:g.pb[0] + g.in_sp[0],
                                                          g.pb[1]:g.pb[1] + g.in_sp[1]]
    product = scratch_array(scratch, "product", g.dtype, (g.m, oh * wide))
    offsets = [i * g.d[0] * wide + j * g.d[1] for i in range(kh) for j in range(kw)]
    split = parallel.GemmSplit(g.m, oh, g.c * taps * wide, axis=1, align=1)  # blocks of output rows
    run = parallel.run

    def descspiece(o4, n, y0, y1):
        lo, hi = y0 * wide, y1 * wide
        for t, off in enumerate(offsets):
            gemm(wt[t], padded[:, off + lo:off + hi], product[:, lo:hi], 1.0, 1.0 if t else 0.0)
        np.copyto(o4[n, :, y0:y1], product[:, lo:hi].reshape(g.m, y1 - y0, wide)[:, :, :ow])

    def kernel(x, w, *rest):
        out = rest[-1]
        np.copyto(wt, w.reshape(g.m, g.c, taps).transpose(2, 0, 1))
        o4 = out.reshape(g.batch, g.m, oh, ow)
        x4 = x.reshape(g.as2d(x.shape))
        padded.fill(0)  # the borders; the interior is overwritten per image
        for n in range(g.batch):
            np.copyto(inner, x4[n])
            run([partial(descspiece, o4, n, y0, y1) for y0, y1 in split.bounds])
        run(epilogue_tasks(out, rest[0] if has_bias else zero_bias, rest[1] if has_residual else None))
    return kernel


# -------------------------------------------------------------------------------- blocked_conv
#
# Convolutions on channel-blocked storage (NCHWc with one block: (N, 1, H, W, C), each pixel's
# channels contiguous; polyhal.ir.encoding.ChannelBlockedLayout). Depthwise: a compiled loop
# vectorised across the channels, which stays fast where NCHW rows are short (7x7 and 14x14
# planes, stride 2: measured 2-4x faster than the NCHW loop on MobileNet's depthwise convs).
# Pointwise: one GEMM as the pixels lie, (pixels, C) @ w^T (C, M) (read-only weights transposed
# once, see _Relaid): register tiles with the epilogue fused where M pads to whole tiles of 32
# or 16 channels, else OpenBLAS and a per-channel epilogue; over fewer pixels than a tile has
# rows (squeeze-excite convs of a 1x1 map), a matrix-vector loop reading each weight once. A
# chain's stem reads its (N, C, H, W) image as it lies (_image_conv). Anything else converts to
# NCHW and back around the NCHW kernel (a resolver only blocks chains of these kinds).

#: Channels below which a stride-1 channel-blocked depthwise conv runs on flat output rows
#: (:func:`polyhal_cpu.native.depthwise_flat_rows`); from 32 on, vectorising across the
#: channels alone is as fast or faster (measured 56x56x72: 220 us against 244 us flat).
FLAT_CHANNELS = 32


class _Relaid:
    """Weights in the arrangement a kernel wants (``arrange(w)``, a view), made C-contiguous.
    A plan's weights are read-only constants: they are relaid once, at the first call, and the
    copy kept while the kernel is given the same array. Weights that may change (writable, or
    views of writable memory) are relaid per call, into ``into`` if given (declared scratch),
    else left as the strided view."""

    def __init__(self, arrange: Callable[[np.ndarray], np.ndarray]) -> None:
        self.arrange = arrange
        # (weights, their copy) in one attribute, so that a kernel called from two threads never
        # pairs one thread's weights with the other's copy
        self.kept: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, w: np.ndarray, into: np.ndarray | None = None) -> np.ndarray:
        kept = self.kept
        if kept is not None and kept[0] is w:
            return kept[1]
        view = self.arrange(w)
        if frozen(w):
            copy = np.ascontiguousarray(view)
            self.kept = (w, copy)
            return copy
        if into is None:
            return view
        np.copyto(into, view)
        return into


def _taps_bytes(problem, _workgroup_size: int) -> int:
    w = problem.in_types[1]
    return w.shape[0] * math.prod(w.shape[2:]) * 4


def _blocked_pointwise(x_t: TensorType, w_t: TensorType, attrs: dict) -> bool:
    """Whether a blocked conv is a 1x1 one run as a GEMM as the pixels lie."""
    return (tuple(w_t.shape[2:]) == (1, 1) and list(attrs["strides"]) == [1, 1] and not any(attrs["pads"])
            and int(attrs["group"]) == 1)


def _channel_multiple(m: int) -> int | None:
    """What a blocked 1x1 conv's M output channels are padded to for the tiles (GEMM_NR, or 16
    for tiles of 16 channels), or None where padding would waste more than a quarter.

    Output channels are computed GEMM_NR (or 16) at a time, pixels GEMM_MR at a time. Where
    padding M up wastes more (24 channels: as fast as OpenBLAS either way), or there are fewer
    pixels than a tile has rows (the squeeze-excite convs of a 1x1 map, a matrix-vector
    product), OpenBLAS's sgemm and an epilogue pass run it. Tiles of 16 channels serve the
    projections to 16 * odd channels, which GEMM_NR-wide tiles padded by 16 (measured
    single-threaded, MobileNetV3's: 16 channels at 112x112 135-179 -> 73 us, 80 at 14x14
    75-93 -> 62-79 us, 112 at 14x14 303-340 -> 273 us; 40 at 28x28 5% faster, in 3 tiles of 16)."""
    for multiple in (native.GEMM_NR, 16):
        if (-(-m // multiple) * multiple - m) * 4 <= m:
            return multiple
    return None


def _pointwise_tiles(attrs: dict, x_t: TensorType, w_t: TensorType) -> tuple[int, int, int, list] | None:
    """(pixels, C, M, pieces) of a blocked 1x1 conv that takes the compiled tiles, else None;
    the pieces are blocks of whole tiles' rows of pixels, (first, last + 1, pixels per block of
    :func:`polyhal_cpu.native.gemm_channels_last`), as many as the product is worth threads."""
    n, _, h, wd, c = x_t.shape
    m, pixels = w_t.shape[0], n * h * wd
    if not (TILES and _channel_multiple(m) and pixels >= native.GEMM_MR and x_t.dtype == _F32
            and native.available(_F32) and _blocked_pointwise(x_t, w_t, attrs)):
        return None
    # Blocks of pixels, each reading all the weights, as many as the product's time is worth
    # on the compiled queue, thin ones included (few input or output channels: MobileNet's and
    # EfficientNet's expansions and projections). Handed out by parallel.run those took as
    # long cut in two at batch 1 (EfficientNet's 16 -> 96 at 112x112 0.75 -> 0.75-0.89 ms); on
    # the queue MobileNetV3's 16 -> 64 at 112x112 took 374 -> 193 us, 80 -> 200 at 14x14 90 ->
    # 52-60 us (2-core VM; with the other core busy the pieces run one after another on the
    # calling thread).
    bounds = parallel.blocks(pixels, parallel.queue_parts(pixels * m * c / parallel.GEMM_MACS_PER_US), native.GEMM_MR)
    return pixels, c, m, [(lo, hi, native.channels_last_block(c, m, hi - lo)) for lo, hi in bounds]


def _descsbytes(problem, _workgroup_size: int) -> int:
    """A tile's worth of output and of input rows (``rows``) for each piece of a blocked 1x1 conv."""
    tiles = None if problem.in_types[0].rank == 4 else _pointwise_tiles(problem.attrs, *problem.in_types[:2])
    if tiles is None:
        return 0
    _, c, _, pieces = tiles
    return len(pieces) * native.GEMM_MR * (native.GEMM_NR + c) * 4


_BLOCKED_SCRATCH = (
    ScratchDecl("taps", shared=True, per_launch=_taps_bytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="a depthwise conv's weights as (kh, kw, C) channel vectors"),
    ScratchDecl("rows", shared=True, per_launch=_descsbytes, spaces=(MemorySpace.GLOBAL,), alignment=64,
                purpose="a 1x1 conv's last pixels padded to a tile, and a tile reaching past the output"))


def _blocked_scratch(device, op: str, attrs: dict, ins: Types, outs: Types) -> tuple[ScratchRequest, ...]:
    """A blocked conv's scratch: the oneDNN primitive's where it runs the instance, else this module's."""
    if _onednn_runs(device, _BLOCKED_SCRATCH, _own_blocked_conv, op, attrs, ins, outs):
        return onednn_kernels.conv_scratch(op, attrs, ins, outs)
    return _own_scratch(_BLOCKED_SCRATCH, op, attrs, ins, outs)


@TABLE.register(BLOCKED_CONV, scratch=_blocked_scratch)
def _blocked_conv(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """A oneDNN primitive on the channels-last maps where it runs the instance (as for ``conv``),
    else this module's own loops."""
    if _onednn_runs(device, _BLOCKED_SCRATCH, _own_blocked_conv, op, attrs, ins, outs):
        return onednn_kernels.conv(op, attrs, ins, outs, scratch)
    return _own_blocked_conv(device, op, attrs, ins, outs, scratch)


def _own_blocked_conv(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    x_t, w_t = ins[0], ins[1]
    if x_t.rank == 4:  # a chain's first conv, reading the image as it lies
        return _image_conv(attrs, ins, outs) or _relaid_conv(device, attrs, ins, outs)
    n, _, h, wd, c = x_t.shape
    m, cg, kh, kw = w_t.shape
    _, _, oh, ow, _ = outs[0].shape
    s = [int(v) for v in attrs["strides"]]
    p = [int(v) for v in attrs["pads"]]
    d = [int(v) for v in attrs["dilations"]]
    group = int(attrs["group"])
    activation, alpha, beta = attrs["activation"], float(attrs["alpha"]), float(attrs["beta"])
    has_bias, has_residual = len(ins) >= 3, len(ins) == 4
    fast = x_t.dtype == _F32 and native.available(_F32)
    zero_bias = np.zeros(m, x_t.dtype)
    zero_bias.flags.writeable = False  # a constant: what is relaid from it may be kept
    pointwise = _blocked_pointwise(x_t, w_t, attrs)
    if fast and group == c and cg == 1 and m == c:
        act = native.activation_code(activation)
        taps = scratch_array(scratch, "taps", _F32, (kh, kw, c))
        flat = s == [1, 1] and c < FLAT_CHANNELS
        if flat:  # taps and bias tiled along an output row (see native.depthwise_flat_rows)
            arranged = _Relaid(lambda w: np.tile(w.reshape(c, kh, kw).transpose(1, 2, 0), (1, 1, ow)))
            tiled_bias = _Relaid(lambda b: np.tile(b, ow))
        else:
            arranged, tiled_bias = _Relaid(lambda w: w.reshape(c, kh, kw).transpose(1, 2, 0)), None
        # pieces on the compiled queue: images, or blocks of output rows of one image, each
        # reading the input from its first output row's top tap on (unpadded above)
        parts = parallel.queue_parts(n * oh * ow * c * kh * kw / parallel.DEPTHWISE_TAPS_PER_US)
        rows = np.zeros((len(parallel.cuts(n, oh, parts)), layout.G_FIELDS), np.int64)
        x_at, out_at = [], []
        for i, (n0, n1, y0, y1) in enumerate(parallel.cuts(n, oh, parts)):
            top = y0 * s[0] - p[0]
            x_at.append((n0 * h + max(top, 0)) * wd * c * 4)
            out_at.append((n0 * oh + y0) * ow * c * 4)
            rows[i, [layout.V_N, layout.V_H, layout.V_OH, layout.V_PH]] = (n1 - n0, h - max(top, 0), y1 - y0,
                                                                          max(-top, 0))
        rows[:, layout.G_KIND] = layout.KIND_DEPTHWISE_FLAT if flat else layout.KIND_DEPTHWISE
        rows[:, layout.V_WIDTH], rows[:, layout.V_C], rows[:, layout.V_OW] = wd, c, ow
        rows[:, layout.V_M] = ow * c if flat else c
        rows[:, layout.V_KH], rows[:, layout.V_KW], rows[:, layout.V_SH], rows[:, layout.V_SW] = kh, kw, *s
        rows[:, layout.V_PW], rows[:, layout.V_DH], rows[:, layout.V_DW] = p[1], *d
        offsets = native.depthwise_offsets(kh, kw, d[0], d[1], wd, c)  # the taps' (flat rows: unused)
        rows[:, layout.V_A] = offsets.ctypes.data
        _activation_fields(rows, act, alpha, beta)
        table = parallel.PieceTable(rows, [(layout.V_X, 0, x_at), (layout.V_W, 1, [0] * len(rows)),
                                           (layout.V_BIAS, 2, [0] * len(rows)), (layout.V_RES, 3, out_at),
                                           (layout.V_OUT, 4, out_at)], keep=(offsets,))

        def depthwise(x, w, *rest):
            if flat:
                wt, b = arranged(w), tiled_bias(rest[0] if has_bias else zero_bias)
            else:
                wt, b = arranged(w, taps), rest[0] if has_bias else zero_bias
            _run_table(table, x, wt, b, rest[1] if has_residual else None, rest[-1])
        return depthwise
    tiles = _pointwise_tiles(attrs, x_t, w_t)
    if tiles is not None:
        pixels, _, _, pieces = tiles
        act = native.activation_code(activation)
        each = native.GEMM_MR * (native.GEMM_NR + c)
        rows = scratch_array(scratch, "rows", _F32, (len(pieces), each))
        # per piece: its pixels, and its own tile (cbuf) and padded input rows (apad)
        parts = [(slice(lo, hi), rows[i, :native.GEMM_MR * native.GEMM_NR], rows[i, native.GEMM_MR * native.GEMM_NR:],
                  block) for i, (lo, hi, block) in enumerate(pieces)]
        multiple = _channel_multiple(m)
        packed = _Relaid(lambda w: native.pad_channels(w.reshape(m, c).T, multiple))
        padded_bias = _Relaid(partial(native.pad_channels, multiple=multiple))

        descs = np.zeros((len(parts), layout.G_FIELDS), np.int64)
        descs[:, layout.G_KIND], descs[:, layout.V_C], descs[:, layout.V_M], descs[:, layout.V_OW] = \
            layout.KIND_POINTWISE, c, -(-m // multiple) * multiple, m
        rowoff = np.arange(c, dtype=np.int64) * descs[0, layout.V_M]  # the padded weights' rows
        descs[:, layout.V_ROWS] = rowoff.ctypes.data
        for i, (ps, cbuf, apad, block) in enumerate(parts):
            descs[i, [layout.V_N, layout.V_A, layout.V_B, layout.V_BLOCK]] = (ps.stop - ps.start, cbuf.ctypes.data,
                                                                              apad.ctypes.data, block)
        _activation_fields(descs, act, alpha, beta)
        at = [lo * 4 for lo, _, _ in pieces]
        table = parallel.PieceTable(descs, [(layout.V_X, 0, [a * c for a in at]), (layout.V_W, 1, [0] * len(at)),
                                            (layout.V_BIAS, 2, [0] * len(at)), (layout.V_RES, 3, [a * m for a in at]),
                                            (layout.V_OUT, 4, [a * m for a in at])], keep=(rows, rowoff))

        def pointwise_tiles(x, w, *rest):
            _run_table(table, x, packed(w), padded_bias(rest[0] if has_bias else zero_bias),
                       rest[1] if has_residual else None, rest[-1])
        return pointwise_tiles
    if fast and pointwise:
        act = native.activation_code(activation)
        pixels = n * h * wd

        # OpenBLAS multiplies by a contiguous (C, M) ~10% faster than by the transposed view of
        # (M, C) (measured single-threaded on MobileNet's 1x1 convs).
        transposed = _Relaid(lambda w: w.reshape(m, c).T)
        if pixels < native.GEMM_MR:  # squeeze-excite convs over a 1x1 map: the weights read once
            def matvec(x, w, *rest):
                r = np.ascontiguousarray(rest[1]).reshape(pixels, m) if has_residual else None
                native.matvec_channels_last(np.ascontiguousarray(x).reshape(pixels, c), transposed(w),
                                            rest[0] if has_bias else zero_bias, r, rest[-1].reshape(pixels, m), act,
                                            alpha, beta)
            return matvec

        # blocks of pixels, each finished as it is made: on the compiled GEMM queue (bias,
        # residual and activation in its epilogue) where BLAS can be called from it
        split = parallel.GemmSplit(pixels, m, c, axis=0, queued=True)

        def piece(x2, wt, b, r, out, lo, hi):
            np.matmul(x2[lo:hi], wt, out=out[lo:hi])
            native.epilogue_channels_last(out[lo:hi], b, None if r is None else r[lo:hi], act, alpha, beta)

        def gemm(x, w, *rest):
            out, x2, wt = rest[-1].reshape(pixels, m), x.reshape(pixels, c), transposed(w)
            r = np.ascontiguousarray(rest[1]).reshape(pixels, m) if has_residual else None
            b = rest[0] if has_bias else zero_bias
            table = split.table(x2, wt, out, 1.0, 1.0, b, r, act, alpha, beta)
            if table is not None:
                parallel.run_gemms(table)
                return
            parallel.run([partial(piece, x2, wt, b, r, out, lo, hi) for lo, hi in split.bounds])
        return gemm
    return _relaid_conv(device, attrs, ins, outs)


def _activation_fields(rows: np.ndarray, act: int, alpha: float, beta: float) -> None:
    """Set a convolution's pieces' activation fields (queue_layout's V_ACT, V_ALPHA, V_BETA)."""
    rows[:, layout.V_ACT] = act
    rows[:, layout.V_ALPHA], rows[:, layout.V_BETA] = parallel.float_bits(alpha), parallel.float_bits(beta)


def _run_table(table: parallel.PieceTable, *operands: np.ndarray | None) -> None:
    """Run a convolution's pieces (:class:`polyhal_cpu.parallel.PieceTable` of (input, weights,
    bias, residual, output) and any others) on the compiled queue. Its loops address the arrays'
    memory directly: each is made C-contiguous float32 (the output computed aside and copied
    where it is not)."""
    ins, out = [None if a is None else np.ascontiguousarray(a, _F32) for a in operands[:-1]], operands[-1]
    dst = out if out.flags.c_contiguous and out.dtype == _F32 else np.empty(out.shape, _F32)
    parallel.run_gemms(table(*ins, dst))
    if dst is not out:
        np.copyto(out, dst)


def _relaid_conv(device, attrs: dict, ins: Types, outs: Types) -> Kernel:
    """Any other blocked conv: the NCHW kernel between relayouts (of the input, unless it is an
    image as it lies, and of the residual and the result)."""
    x_t, w_t = ins[0], ins[1]
    has_bias, has_residual = len(ins) >= 3, len(ins) == 4
    n, _, oh, ow, m = outs[0].shape
    dense = (x_t if x_t.rank == 4 else _unblocked(x_t)), TensorType((n, m, oh, ow), x_t.dtype)
    dense_ins = (dense[0], w_t, TensorType((m,), x_t.dtype)) + ((dense[1],) if has_residual else ())
    inner = TABLE.prepare(device, "fused_conv", {k: attrs[k] for k in attrs}, dense_ins, (dense[1],))
    zero_bias = np.zeros(m, x_t.dtype)
    unblock = lambda a: np.ascontiguousarray(a[:, 0].transpose(0, 3, 1, 2))  # noqa: E731

    def relayout(x, w, *rest):
        y = np.empty(dense[1].shape, x_t.dtype)
        extra = (unblock(rest[1]),) if has_residual else ()
        inner(x if x_t.rank == 4 else unblock(x), w, rest[0] if has_bias else zero_bias, *extra, y)
        np.copyto(rest[-1][:, 0], y.transpose(0, 2, 3, 1))
    return relayout


def _unblocked(t: TensorType) -> TensorType:
    """The (N, C, H, W) type of a (N, 1, H, W, C) channel-blocked storage type."""
    n, _, h, w, c = t.shape
    return TensorType((n, c, h, w), t.dtype)


def _image_conv(attrs: dict, ins: Types, outs: Types) -> Kernel | None:
    """A chain's first conv reading the image as it lies, (N, C, H, W), into a channels-last map
    (see :func:`polyhal_cpu.native.conv_image_channels_last`): no relayout of the image and none
    of the result. None where the compiled loops do not serve (float32, one group)."""
    x_t, w_t = ins[0], ins[1]
    n, c, h, wd = x_t.shape
    m, _, kh, kw = w_t.shape
    _, _, oh, ow, _ = outs[0].shape
    s, p, d = ([int(v) for v in attrs[k]] for k in ("strides", "pads", "dilations"))
    activation, alpha, beta = attrs["activation"], float(attrs["alpha"]), float(attrs["beta"])
    has_bias, has_residual = len(ins) >= 3, len(ins) == 4
    zero_bias = np.zeros(m, x_t.dtype)
    zero_bias.flags.writeable = False
    if not (x_t.dtype == _F32 and native.available(_F32) and int(attrs["group"]) == 1):
        return None
    act = native.activation_code(activation)
    taps = _Relaid(lambda w: w.transpose(2, 1, 3, 0))  # (kh, C, kw, M)
    # per tap (i, c, j): its input offset and its weights' offset (kernel rows outermost)
    order = [(i, ch, j) for i in range(kh) for ch in range(c) for j in range(kw)]
    xoff = np.array([ch * h * wd + i * d[0] * wd + j * d[1] for i, ch, j in order], np.int64)
    woff = np.array([((i * c + ch) * kw + j) * m for i, ch, j in order], np.int64)
    # pieces on the compiled queue: blocks of images, or of output rows of one image
    pieces = parallel.cuts(n, oh, parallel.queue_parts(n * oh * ow * m * c * kh * kw / parallel.GEMM_MACS_PER_US))
    descs = np.zeros((len(pieces), layout.G_FIELDS), np.int64)
    descs[:, [layout.V_N0, layout.V_N1, layout.V_Y0, layout.V_Y1]] = pieces
    descs[:, layout.G_KIND], descs[:, layout.V_A], descs[:, layout.V_B] = layout.KIND_IMAGE_CONV, xoff.ctypes.data, \
        woff.ctypes.data
    for field, value in zip((layout.V_N, layout.V_C, layout.V_H, layout.V_WIDTH, layout.V_KH, layout.V_KW, layout.V_M,
                             layout.V_OH, layout.V_OW, layout.V_SH, layout.V_SW, layout.V_PH, layout.V_PW, layout.V_DH,
                             layout.V_DW), (n, c, h, wd, kh, kw, m, oh, ow, *s, *p[:2], *d)):
        descs[:, field] = value
    _activation_fields(descs, act, alpha, beta)
    table = parallel.PieceTable(descs, [(field, x, [0] * len(pieces)) for x, field in enumerate(
        (layout.V_X, layout.V_W, layout.V_BIAS, layout.V_RES, layout.V_OUT))], keep=(xoff, woff))

    def image_conv(x, w, *rest):
        _run_table(table, x, taps(w), rest[0] if has_bias else zero_bias, rest[1] if has_residual else None, rest[-1])
    return image_conv


# ---------------------------------------------------------------------------- scale_shift_conv

#: Conv paths (:attr:`_Conv.fill`: the path, or "slabs" where the pieces fill their own slabs)
#: that apply a ``scale_shift_conv``'s prologue themselves, as they fill their own input: path
#: -> builder of the whole op ``(device, op, attrs, ins, outs, scratch) -> Kernel``, given the
#: scale_shift_conv's own attributes and operand types and the scratch its conv declares (the
#: conv's scratch, evaluated for the conv with its prologue: :func:`_geometry`). It must not
#: decline. Every other path reads a normalised copy of the input, written into scratch first
#: (:func:`_scale_shift_conv`).
PROLOGUE_FILLS: dict[str, Callable[..., Kernel]] = {}
#: Bytes of the ``normalised`` scratch a path of :data:`PROLOGUE_FILLS` declares all the same
#: (its pieces' own normalised input, or room to fall back to the generic prologue): path ->
#: ``fn(g, x_type)``. A path of PROLOGUE_FILLS not here declares none.
PROLOGUE_SCRATCH: dict[str, Callable[[_Conv, TensorType], int]] = {}


def _without_prologue(attrs: dict, ins: Types) -> tuple[dict, Types]:
    """The ``fused_conv`` a ``scale_shift_conv`` is without its prologue: its attributes and
    operand types (x, w, b[, residual])."""
    return {k: v for k, v in attrs.items() if not k.startswith("pre_")}, (ins[0], *ins[3:])


def _prologue_scratch(device, op: str, attrs: dict, ins: Types, outs: Types) -> tuple[ScratchRequest, ...]:
    """The scratch of a ``scale_shift_conv``: its conv's, as that ``fused_conv`` declares it, and
    the normalised input unless the conv's path applies the prologue itself."""
    conv_attrs, conv_ins = _without_prologue(attrs, ins)
    problem = Problem(op, attrs, tuple(ins), tuple(outs))
    info = KernelInfo(f"{TABLE.backend}_{op}", op, backend=TABLE.backend)
    g = _geometry(problem)
    if g.fill in PROLOGUE_FILLS and g.fill not in PROLOGUE_SCRATCH:
        return tuple(d.request(problem, info) for d in _CONV_SCRATCH)
    requests = TABLE.scratch(device, "fused_conv", conv_attrs, conv_ins, outs)
    size = PROLOGUE_SCRATCH[g.fill](g, ins[0]) if g.fill in PROLOGUE_SCRATCH else ins[0].size * g.dtype.itemsize
    normalised = ScratchDecl("normalised", shared=True, per_launch=size,
                             spaces=(MemorySpace.GLOBAL,), alignment=64,
                             purpose="the input normalised by the prologue (x * scale + shift, activation), "
                                     "which the conv then reads")
    return (*requests, normalised.request(problem, info))


@TABLE.register(SCALE_SHIFT_CONV, scratch=_prologue_scratch)
@float16_via_float32
def _scale_shift_conv(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """A conv whose path takes the prologue in its input fill (:data:`PROLOGUE_FILLS`) does so;
    otherwise the prologue is ``scale_shift``'s kernel writing the normalised input into the
    declared scratch, then the ``fused_conv`` kernel reads it: what the two ops did, minus a
    dispatch. (scale_shift's kernel through the table, so that its pieces run as it runs them.)"""
    conv_attrs, conv_ins = _without_prologue(attrs, ins)
    g = _Conv(conv_attrs, conv_ins[0], conv_ins[1], outs[0], prologue=True)
    fill = PROLOGUE_FILLS.get(g.fill)
    if fill is not None:
        return fill(device, op, attrs, ins, outs, scratch)
    return _normalised_then_conv(device, attrs, ins, outs, scratch)


def _normalised_then_conv(device, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """The generic ``scale_shift_conv``: scale_shift's kernel into the ``normalised`` scratch,
    then the ``fused_conv`` kernel reading it."""
    conv_attrs, conv_ins = _without_prologue(attrs, ins)
    x_type = ins[0]
    normalise = TABLE.prepare(device, "scale_shift", {"activation": attrs["pre_activation"],
                                                      "alpha": attrs["pre_alpha"], "beta": attrs["pre_beta"]},
                              ins[:3], (x_type,))
    conv = TABLE.prepare(device, "fused_conv", conv_attrs, conv_ins, outs, scratch)
    normalised = scratch_array(scratch, "normalised", x_type.dtype, x_type.shape)

    def kernel(x, scale, shift, w, b, *rest):
        normalise(x, scale, shift, normalised)
        conv(normalised, w, b, *rest)
    return kernel


#: Positions a piece of a 1x1 conv on the pointwise path holds at least where it is cut by B's
#: columns (blocks of positions); a plane with fewer per piece is cut by output channels, each
#: piece then normalising all of the input. DenseNet's 7x7 ones (49 positions, 128 channels)
#: so: alone, 768 -> 128 83 us by channels against 95 by columns (32 + 17), two threads on
#: the 2-core VM; in the whole model block 4's 1x1 convs 1.57-1.63 ms against 1.71.
POINTWISE_MIN_COLUMNS = 64
#: Pieces per thread a ``scale_shift_conv`` on the pointwise path is cut into: two a thread
#: balanced no better and packed each operand more (640 -> 128 at 14x14 alone 223 against 210
#: us; DenseNet's block 3 1x1 convs 11% slower in the whole model, the VM busy).
PROLOGUE_PIECES_PER_THREAD = 1


def _pointwise_pieces(g: _Conv, per_thread: int = 1) -> list[tuple[int, int, int, int]]:
    """One image's pieces of a 1x1 conv on the pointwise path, on the compiled queue: (first
    position, last + 1, first output channel, last + 1), as many as its estimated time is worth
    (pieces of GEMM_QUEUE_PIECE_US at least), ``per_thread`` a thread at most; by blocks of
    positions where each holds POINTWISE_MIN_COLUMNS, else by blocks of output channels; both
    cut at whole register blocks (GEMM_ALIGN)."""
    us = g.m * g.positions * g.c / parallel.GEMM_MACS_PER_US
    parts = 1 if parallel.queue_parts(us) < 2 else max(1, min(parallel.threads() * per_thread,
                                                              int(us // parallel.GEMM_QUEUE_PIECE_US)))
    if parts > 1 and g.positions >= g.m and g.positions // parts >= POINTWISE_MIN_COLUMNS:
        return [(c0, c1, 0, g.m) for c0, c1 in parallel.blocks(g.positions, parts, parallel.GEMM_ALIGN)]
    return [(0, g.positions, m0, m1) for m0, m1 in parallel.blocks(g.m, parts, parallel.GEMM_ALIGN)]


def _prologue_part(g: _Conv, c0: int, c1: int) -> int:
    """Floats of a prologue piece's normalised columns (all input channels of positions c0 ..
    c1), rounded to whole cache lines so that pieces on different cores share none."""
    return -(-g.c * (c1 - c0) // 16) * 16


def _pointwise_prologue_bytes(g: _Conv, x_type: TensorType) -> int:
    """The ``normalised`` scratch of :func:`_pointwise_prologue`: each image's pieces' own
    normalised columns, and at least the whole input (the generic prologue's, where it falls
    back to it)."""
    parts = sum(_prologue_part(g, c0, c1) for c0, c1, _, _ in _pointwise_pieces(g, PROLOGUE_PIECES_PER_THREAD))
    return max(g.batch * parts, x_type.size) * g.dtype.itemsize


def _pointwise_prologue(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """A ``scale_shift_conv`` on the pointwise path (1x1 convs over 14x14 and 7x7 planes, as
    DenseNet's) as pieces of the compiled queue (queue_layout's KIND_PROLOGUE_GEMM): each a
    block of positions (or, on planes too small to cut so, of output channels;
    :func:`_pointwise_pieces`) that first normalises its columns of all the input's channels
    into its own part of the ``normalised`` scratch (K x columns, contiguous), then computes its
    block of the output by sgemm from the bias, and adds the residual and the activation. Cut by
    positions, each core reads only its part of the input -- the part the op before wrote there,
    when that was cut alike -- and normalises it just before its GEMM reads it. (The generic
    prologue normalised the whole input in one piece before the conv's pieces, cut by output
    channels, each read all of it: the scale_shift took 14 us on one thread but 59 us on two, its
    input last read by the other core.) Falls back to the generic prologue where the queue is off.

    Measured on the 2-core VM (AVX-512), batch 1, two threads while the other core was free,
    generic prologue -> these pieces: BN + ReLU + 1x1 conv 640 -> 128 at 14x14 272-294 us
    (scale_shift 67-72, the GEMM 182-198) -> 209-212 us, 768 -> 128 at 7x7 117-122 -> 85-92 us;
    DenseNet-121 b1 34.1-35.7 against 36.0-37.6 ms (block 3's 1x1 convs 6.4-6.6 -> 5.3-5.4 ms,
    block 4's 2.3 -> 1.6 ms; onnxruntime ~30.5-31); one thread (the VM busy) block 3 ~7% and
    block 4 ~10% faster."""
    conv_attrs, conv_ins = _without_prologue(attrs, ins)
    g = _Conv(conv_attrs, conv_ins[0], conv_ins[1], outs[0])
    fn = parallel.gemm_fn()
    if fn is None or not native.available(g.dtype):
        return _normalised_then_conv(device, attrs, ins, outs, scratch)
    pieces = _pointwise_pieces(g, PROLOGUE_PIECES_PER_THREAD)
    c, m, positions = g.c, g.m, g.positions
    work = scratch_array(scratch, "normalised", _F32, (_pointwise_prologue_bytes(g, ins[0]) // 4,))
    rows = len(pieces) * g.batch
    descs = np.zeros((rows, layout.G_FIELDS), np.int64)
    one = parallel.float_bits(1.0)
    pre = native.activation_code(attrs["pre_activation"])
    for field, value in ((layout.G_KIND, layout.KIND_PROLOGUE_GEMM), (layout.G_FN, fn[0]), (layout.G_WIDE, fn[1]),
                         (layout.G_GEMV, fn[2]), (layout.G_TA, blas.NO_TRANS), (layout.G_TB, blas.NO_TRANS),
                         (layout.G_K, c), (layout.G_LDA, c), (layout.G_LDC, positions), (layout.G_ALPHA, one),
                         (layout.G_BETA, one), (layout.G_BIAS_ROW, 1), (layout.G_BIAS_COL, 0),
                         (layout.G_LDR, positions), (layout.G_ACT, native.activation_code(attrs["activation"])),
                         (layout.G_ACT_ALPHA, parallel.float_bits(float(attrs["alpha"]))),
                         (layout.G_ACT_BETA, parallel.float_bits(float(attrs["beta"]))), (layout.P_LDX, positions),
                         (layout.P_ACT, pre), (layout.P_ALPHA, parallel.float_bits(float(attrs["pre_alpha"]))),
                         (layout.P_BETA, parallel.float_bits(float(attrs["pre_beta"])))):
        descs[:, field] = value
    start, x_at, w_at, b_at, out_at = 0, [], [], [], []
    for n in range(g.batch):
        for i, (c0, c1, m0, m1) in enumerate(pieces):
            row = n * len(pieces) + i
            descs[row, [layout.G_M, layout.G_N, layout.G_LDB, layout.G_B]] = (m1 - m0, c1 - c0, c1 - c0,
                                                                             work[start:].ctypes.data)
            start += _prologue_part(g, c0, c1)
            x_at.append((n * c * positions + c0) * 4)
            w_at.append(m0 * c * 4)
            b_at.append(m0 * 4)
            out_at.append(((n * m + m0) * positions + c0) * 4)
    whole = [0] * rows
    table = parallel.PieceTable(descs, [(layout.P_X, 0, x_at), (layout.P_SCALE, 1, whole),
                                        (layout.P_SHIFT, 2, whole), (layout.G_A, 3, w_at), (layout.G_BIAS, 4, b_at),
                                        (layout.G_RES, 5, out_at), (layout.G_C, 6, out_at)], keep=(work,))

    def kernel(x, scale, shift, w, b, *rest):
        _run_table(table, x, scale, shift, w, b, rest[0] if len(rest) == 2 else None, rest[-1])
    return kernel


PROLOGUE_FILLS["pointwise"] = _pointwise_prologue
PROLOGUE_SCRATCH["pointwise"] = _pointwise_prologue_bytes


def _slabs_with_prologue(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """A ``scale_shift_conv`` whose conv's pieces fill their own slabs (:func:`_slabs`): each
    applies the prologue to what it copies (queue_layout's KIND_TILES_SLAB), so that no
    normalised copy of the input is written nor read."""
    conv_attrs, conv_ins = _without_prologue(attrs, ins)
    g = _Conv(conv_attrs, conv_ins[0], conv_ins[1], outs[0], prologue=True)
    act = native.activation_code(attrs["activation"])
    pre = (native.activation_code(attrs["pre_activation"]), float(attrs["pre_alpha"]), float(attrs["pre_beta"]))
    return _slabs(g, scratch, True, len(conv_ins) == 4, np.zeros(g.m, g.dtype), act, float(attrs["alpha"]),
                  float(attrs["beta"]), pre)


PROLOGUE_FILLS["slabs"] = _slabs_with_prologue


# ------------------------------------------------------------------------------ conv_transpose

def _transpose_geometry(attrs: dict, x: TensorType, w: TensorType):
    n = x.rank - 2
    s = [int(v) for v in (attrs.get("strides") or [1] * n)]
    p = [int(v) for v in (attrs.get("pads") or [0] * (2 * n))]
    d = [int(v) for v in (attrs.get("dilations") or [1] * n)]
    return n, s, p, d, int(attrs["group"])


def _transpose_columns_bytes(problem, _workgroup_size: int) -> int:
    x, w = problem.in_types[:2]
    item = max(x.dtype.itemsize, 4)  # float16 runs as float32
    return w.shape[1] * int(problem.attrs["group"]) * math.prod(w.shape[2:]) * math.prod(x.shape[2:]) * item


@TABLE.register("conv_transpose", scratch=[
    ScratchDecl("columns", shared=True, per_launch=_transpose_columns_bytes, spaces=(MemorySpace.GLOBAL,),
                alignment=64, purpose="one image's columns (M * taps x input positions) before col2im")])
@float16_via_float32
def _conv_transpose(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    """Per image: one GEMM over the groups, ``(group, M/group * taps, C/group) @ (group,
    C/group, positions)``, into declared scratch, then col2im adds each column into the output
    (a compiled loop for 2-D float32, numpy tap by tap otherwise)."""
    x_type, w_type = ins[0], ins[1]
    n, s, p, d, group = _transpose_geometry(attrs, x_type, w_type)
    c, mg = w_type.shape[0], w_type.shape[1]
    cg, m = c // group, mg * group
    k, in_sp, out_sp = list(w_type.shape[2:]), list(x_type.shape[2:]), list(outs[0].shape[2:])
    taps, positions = math.prod(k), math.prod(in_sp)
    dtype = _F32 if x_type.dtype == np.float16 else x_type.dtype
    has_bias = len(ins) == 3
    batch = x_type.shape[0]
    cols = scratch_array(scratch, "columns", dtype, (group, mg * taps, positions))
    native2d = n == 2 and native.available(dtype)
    # numpy's scatter: per tap, the output window (strided) its input positions land on, cropped.
    scatter = []
    for t, tap in enumerate(np.ndindex(*k)):
        o_sl, i_sl = [], []
        for i in range(n):
            start = tap[i] * d[i] - p[i]  # output index of input position 0
            lo = 0 if start >= 0 else -(-(-start) // s[i])
            hi = min(in_sp[i], (out_sp[i] - 1 - start) // s[i] + 1) if start < out_sp[i] else 0
            if hi <= lo:
                break
            i_sl.append(slice(lo, hi))
            o_sl.append(slice(start + lo * s[i], start + (hi - 1) * s[i] + 1, s[i]))
        else:
            scatter.append((t, tuple(o_sl), tuple(i_sl)))
    matmul = np.matmul

    def kernel(x, w, *rest):
        out = rest[-1]
        out.fill(0)
        wt = w.reshape(group, cg, mg * taps).transpose(0, 2, 1)  # (group, mg * taps, cg)
        for img in range(batch):
            matmul(wt, x[img].reshape(group, cg, positions), out=cols)
            if native2d:
                native.col2im(cols.reshape(m * taps, positions), out[img], k, s, p[:n], d, in_sp)
            else:
                view = cols.reshape((m, taps) + tuple(in_sp))
                for t, o_sl, i_sl in scatter:
                    out[img][(slice(None),) + o_sl] += view[(slice(None), t) + i_sl]
        if has_bias:
            out += rest[0].reshape((m,) + (1,) * n)
    return kernel


# ------------------------------------------------------------------------------------ pooling

def _pool_geometry(attrs: dict, x_type, out_type):
    """Padding (with the extra end padding ceil_mode needs) and the strided slice of each tap."""
    n = x_type.rank - 2
    s = [int(v) for v in (attrs.get("strides") or [1] * n)]
    p = [int(v) for v in (attrs.get("pads") or [0] * (2 * n))]
    d = [int(v) for v in (attrs.get("dilations") or [1] * n)]
    k = [int(v) for v in attrs["kernel_shape"]]
    out_spatial = out_type.shape[2:]
    widths = [(0, 0), (0, 0)]
    for i in range(n):
        need = (out_spatial[i] - 1) * s[i] + (k[i] - 1) * d[i] + 1
        have = x_type.shape[2 + i] + p[i] + p[i + n]
        widths.append((p[i], p[i + n] + max(need - have, 0)))
    taps = []
    for tap in np.ndindex(*k):
        taps.append((slice(None), slice(None)) + tuple(
            slice(tap[i] * d[i], tap[i] * d[i] + (out_spatial[i] - 1) * s[i] + 1, s[i]) for i in range(n)))
    return n, s, p, d, k, widths, taps


#: Input elements a compiled 2-D pool reads per microsecond single-threaded, to estimate its
#: time for the queue's cut (2-core AVX-512 VM: a 2x2 stride-2 average over 256x56x56 ~85 us,
#: a 3x3 stride-2 max over 64x112x112 ~180 us; the general loop ~2-3x slower).
POOL_INPUTS_PER_US = 5_000


def _pool_pieces(x_type, out_type) -> list[tuple[int, int]]:
    """A compiled pool's pieces: blocks of (image, channel) planes, as many as its estimated
    time is worth on the compiled queue (:func:`polyhal_cpu.parallel.queue_parts`), else (the
    queue off: :func:`polyhal_cpu.parallel.run`) as :func:`polyhal_cpu.parallel.grid` cuts."""
    planes = x_type.shape[0] * x_type.shape[1]
    if native.gemm_queue() is not None:
        return parallel.blocks(planes, parallel.queue_parts(x_type.size / POOL_INPUTS_PER_US))
    return [(ns.start or 0, planes if ns.stop is None else ns.stop)
            for ns, _ in parallel.grid(planes, 1, math.prod(out_type.shape[2:]))]


def _pool_phases_bytes(problem, _workgroup_size: int) -> int:
    """One plane split into column phases (:func:`polyhal_cpu.native.pool2d_work`) per piece of
    a compiled 2-D pool."""
    (x_type,), (out_type,) = problem.in_types[:1], problem.out_types
    if problem.op == "lp_pool" or x_type.rank != 4 or x_type.dtype != _F32 or not native.available(_F32):
        return 0
    s = [int(v) for v in (problem.attrs.get("strides") or [1, 1])]
    return len(_pool_pieces(x_type, out_type)) * native.pool2d_work(x_type.shape[2:], s) * 4


def _pairs_bytes(problem, _workgroup_size: int) -> int:
    """The row pairs' maxima of an integer 2x2 stride-2 max pool (see :func:`_max_pool`)."""
    if problem.op != "max_pool" or not _integer_pairs(problem.attrs, problem.in_types[0]):
        return 0
    (out_type,) = problem.out_types
    return out_type.size * 2 * out_type.dtype.itemsize


def _integer_pairs(attrs: dict, x_type) -> bool:
    """A 2x2 stride-2 max pool without padding or dilation over an integer 2-D map."""
    return (x_type.rank == 4 and x_type.dtype.kind in "iu" and list(attrs["kernel_shape"]) == [2, 2]
            and list(attrs.get("strides") or [1, 1]) == [2, 2] and list(attrs.get("dilations") or [1, 1]) == [1, 1]
            and not any(attrs.get("pads") or ()))


#: The compiled pools' scratch: each piece splits its planes into column phases in its own part.
_POOL_SCRATCH = [ScratchDecl("phases", shared=True, per_launch=_pool_phases_bytes, spaces=(MemorySpace.GLOBAL,),
                             alignment=64, purpose="a plane split into column phases, one per piece of the pool"),
                 ScratchDecl("pairs", shared=True, per_launch=_pairs_bytes, spaces=(MemorySpace.GLOBAL,),
                             alignment=64, purpose="the maxima of row pairs, before those of column pairs")]


def _native_pool(x_type, out_type, n, s, p, d, k, inv, scratch):
    """The compiled 2-D pooling loop for float32 (None elsewhere): ``fn(x, out)``, its pieces
    (blocks of planes) on the compiled queue (queue_layout's KIND_POOL) where it is on; handed
    out by :func:`polyhal_cpu.parallel.run` (~80 us a hand-off on a 2-core VM, as long as a
    batch-1 pool's half) where it is off."""
    if n != 2 or x_type.dtype != _F32 or not native.available(_F32):
        return None
    rows = x_type.shape[0] * x_type.shape[1]
    (h, w), (oh, ow) = x_type.shape[2:], out_type.shape[2:]
    x3, o3 = (rows, h, w), (rows, oh, ow)
    is_max = inv is None
    inv = np.zeros((1, 1), _F32) if inv is None else np.ascontiguousarray(inv.reshape(oh, ow), _F32)
    pieces = _pool_pieces(x_type, out_type)
    size = native.pool2d_work((h, w), s)
    work = scratch_array(scratch, "phases", _F32, (len(pieces), size))
    columns = native.column_table(ow, k[1], s[1], p[1], d[1], w)
    if native.gemm_queue() is None:
        def kernel(x, out):
            xs, os_ = np.ascontiguousarray(x).reshape(x3), out.reshape(o3)
            parallel.run([partial(native.pool2d, xs[lo:hi], os_[lo:hi], inv, work[i], columns, k, s, p[:2], d, is_max)
                          for i, (lo, hi) in enumerate(pieces)])
        return kernel
    descs = np.zeros((len(pieces), layout.G_FIELDS), np.int64)
    descs[:, layout.G_KIND], descs[:, layout.V_ACT] = layout.KIND_POOL, int(is_max)
    descs[:, [layout.V_H, layout.V_WIDTH, layout.V_OH, layout.V_OW]] = h, w, oh, ow
    descs[:, [layout.V_KH, layout.V_KW, layout.V_SH, layout.V_SW]] = *k, *s
    descs[:, [layout.V_PH, layout.V_PW, layout.V_DH, layout.V_DW]] = *p[:2], *d
    descs[:, [layout.V_A, layout.V_M, layout.V_ROWS, layout.V_N0]] = inv.ctypes.data, inv.size, columns.ctypes.data, size
    for i, (lo, hi) in enumerate(pieces):
        descs[i, [layout.V_N, layout.V_B]] = hi - lo, work[i].ctypes.data
    table = parallel.PieceTable(descs, [(layout.V_X, 0, [lo * h * w * 4 for lo, _ in pieces]),
                                        (layout.V_OUT, 1, [lo * oh * ow * 4 for lo, _ in pieces])],
                                keep=(inv, columns, work))

    def queued(x, out):
        _run_table(table, x, out)
    return queued


def _pool_scratch(device, op: str, attrs: dict, ins: Types, outs: Types) -> tuple[ScratchRequest, ...]:
    """A pool's scratch: the oneDNN primitive's where it runs the instance (without the compiled
    loops), else the compiled loop's."""
    if op != "lp_pool":
        requests = onednn_normalization.scratch(op, attrs, ins, outs)
        if requests is not None:
            return requests
    return _own_scratch(_POOL_SCRATCH, op, attrs, ins, outs)


@TABLE.register("max_pool", scratch=_pool_scratch)
def _max_pool(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    primitive = onednn_normalization.pool(op, attrs, ins, outs, scratch)  # without the compiled loops
    if primitive is not None:
        return primitive
    x_type = ins[0]
    n, s, p, d, k, widths, taps = _pool_geometry(attrs, x_type, outs[0])
    fast = _native_pool(x_type, outs[0], n, s, p, d, k, None, scratch)
    if fast is not None:
        return fast
    dt = x_type.dtype
    low = -np.inf if dt.kind == "f" else np.iinfo(dt).min  # padding never wins
    padded = any(w != (0, 0) for w in widths)
    maximum, copyto, pad = np.maximum, np.copyto, np.pad
    if not padded and _integer_pairs(attrs, x_type):
        # An int8 map (a QDQ model's, between dequantize and quantize): pairs of rows, then pairs
        # of columns, two passes (the taps' four took 51 us for 8 x 16 x 8 x 8 int8, these 7 us)
        (oh, ow) = outs[0].shape[2:]
        half = scratch_array(scratch, "pairs", dt, outs[0].shape[:3] + (2 * ow,))

        def pairs(x, out):
            maximum(x[:, :, 0:2 * oh:2, :2 * ow], x[:, :, 1:2 * oh:2, :2 * ow], out=half)
            maximum(half[..., 0::2], half[..., 1::2], out=out)
        return pairs

    def kernel(x, out):
        xp = pad(x, widths, constant_values=low) if padded else x
        copyto(out, xp[taps[0]])
        for t in taps[1:]:
            maximum(out, xp[t], out=out)
    return kernel


@TABLE.register("avg_pool", "lp_pool", scratch=_pool_scratch)
@float16_via_float32
def _avg_lp_pool(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    primitive = onednn_normalization.pool(op, attrs, ins, outs, scratch) if op == "avg_pool" else None
    if primitive is not None:
        return primitive
    x_type = ins[0]
    n, s, p, d, k, widths, taps = _pool_geometry(attrs, x_type, outs[0])
    dtype = outs[0].dtype
    if op == "avg_pool":
        # The divisor per output position: taps that land on the input (or, with
        # count_include_pad, on the explicit padding too), by pooling a mask the same way.
        mask_shape = (1, 1) + tuple(d_ + b + e for d_, (b, e) in zip(x_type.shape[2:], widths[2:]))
        mask = np.zeros(mask_shape, np.float64)
        if attrs["count_include_pad"]:
            inner = tuple(slice(0, x_type.shape[2 + i] + p[i] + p[i + n]) for i in range(n))
        else:
            inner = tuple(slice(p[i], p[i] + x_type.shape[2 + i]) for i in range(n))
        mask[(0, 0) + inner] = 1.0
        count = sum(mask[t] for t in taps)
        inv = (1.0 / np.maximum(count, 1.0)).astype(dtype)
        fast = _native_pool(x_type, outs[0], n, s, p, d, k, inv, scratch)
        if fast is not None:
            return fast

        def kernel(x, out):
            xp = np.pad(x, widths)
            np.copyto(out, xp[taps[0]])
            for t in taps[1:]:
                np.add(out, xp[t], out=out)
            np.multiply(out, inv, out=out)
        return kernel

    power = int(attrs["p"])
    root = np.asarray(1.0 / power, dtype)

    def kernel(x, out):
        xp = np.abs(np.pad(x, widths))
        if power != 1:
            np.power(xp, power, out=xp)
        np.copyto(out, xp[taps[0]])
        for t in taps[1:]:
            np.add(out, xp[t], out=out)
        if power != 1:
            np.power(out, root, out=out)
    return kernel
