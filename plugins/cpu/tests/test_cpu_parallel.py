"""Kernels split across threads (polyhal_cpu.parallel) give the unsplit results."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal.ops.nn import ACTIVATIONS
from polyhal_cpu import nn_kernels, parallel, threads
from polyhal_cpu.kernels import prepare

def _reset_budget(monkeypatch):
    """The budget is made once per process: make it again from the patched environment, and
    again after the test from the real one."""
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)


CASES = [
    ("softmax", [(1, 4, 33, 16)], {"axis": -1}),
    ("softmax", [(6, 5, 7)], {"axis": 0}),  # the first axis is the softmax's: runs whole
    ("softmax", [(1, 1, 9, 8)], {"axis": 2}),
    ("layer_norm", [(1, 37, 16), (16,), (16,)], {"axis": -1}),
    ("layer_norm", [(5, 6, 7), (6, 7), (6, 7)], {"axis": 1}),
    ("gelu", [(3, 41)], {"approximate": "tanh"}),
    ("gelu", [(1, 129)], {}),
    ("sigmoid", [(7, 3, 5)], {}),
    ("erf", [(2, 50)], {}),
]


@pytest.mark.parametrize("n_threads", ["2", "3", "1"])
@pytest.mark.parametrize("name, shapes, attrs", CASES, ids=[c[0] for c in CASES])
def test_split_kernels_match_reference(monkeypatch, n_threads, name, shapes, attrs):
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    _reset_budget(monkeypatch)
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16, np.float64):
        xs = [rng.uniform(0.5, 2, s).astype(dtype) for s in shapes]
        in_types = tuple(TensorType(x.shape, x.dtype) for x in xs)
        out_types = OPS[name].infer(in_types, attrs)
        outs = [np.full(t.shape, np.nan, t.dtype) for t in out_types]
        prepare(name, attrs, in_types, out_types)(*xs, *outs)
        for got, want in zip(outs, OPS[name].reference(*xs, **attrs)):
            tol = 2e-3 if dtype == np.float16 else 1e-5
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ------------------------------------------------------------- GEMMs and loops cut into pieces

def _split_everything(monkeypatch, n_threads: str) -> None:
    """Cut every kernel as finely as it may be cut (the thresholds down to one element)."""
    from polyhal_cpu import kernels

    for name, value in (("MIN_ELEMENTS", 1), ("GEMM_PIECE_US", 1e-9), ("GEMM_ALIGN", 1), ("GEMM_MIN_INTENSITY", 0),
                        ("GEMM_QUEUE_PIECE_US", 1e-9)):
        monkeypatch.setattr(parallel, name, value)
    monkeypatch.setattr(kernels, "LAYER_NORM_PIECE", 1)
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    _reset_budget(monkeypatch)


def _geometry(stride=1, pad=0, group=1, **fused):
    attrs = {"strides": [stride] * 2, "pads": [pad] * 4, "dilations": [1, 1], "group": group}
    return attrs | ({"activation": "relu", "alpha": 0.0, "beta": 0.0} | fused if fused else {})


_CONV = {"activation": "hard_swish", "alpha": 1 / 6, "beta": 0.5}
SPLIT_CASES = [  # (op, input shapes, attrs): odd sizes, so that no piece is like another
    ("matmul", [(37, 19), (19, 53)], {}),
    ("matmul", [(3, 13, 19), (19, 7)], {}),  # collapsed to one (39, 19) @ (19, 7) GEMM
    ("gemm", [(19, 37), (53, 19), (53,)], {"alpha": 0.5, "beta": 2.0, "trans_a": 1, "trans_b": 1}),
    ("gemm", [(61, 5), (5, 7)], {"alpha": 1.0, "beta": 1.0, "trans_a": 0, "trans_b": 0}),
    ("linear", [(2, 21, 17), (17, 33), (33,)], {}),
    # results of 65536 elements and more take BLAS's accumulating GEMM (bias or C first)
    ("linear", [(301, 17), (17, 257), (257,)], {}),
    ("gemm", [(9, 263), (257, 9), (257,)], {"alpha": 0.5, "beta": 2.0, "trans_a": 1, "trans_b": 1}),
    ("fused_linear", [(21, 17), (17, 33), (33,), (21, 33)], {"activation": "gelu", "alpha": 0.0, "beta": 0.0}),
    # one row: matrix-vector products (sgemv on the GEMM queue), cut into blocks of columns
    ("linear", [(1, 37), (37, 53), (53,)], {}),
    ("fused_linear", [(1, 1, 40), (40, 70), (70,), (1, 1, 70)], _CONV),
    ("gemm", [(1, 37), (53, 37), (53,)], {"alpha": 0.5, "beta": 2.0, "trans_a": 0, "trans_b": 1}),
    ("gemm", [(37, 1), (37, 53)], {"alpha": 1.5, "beta": 1.0, "trans_a": 1, "trans_b": 0}),
    ("matmul", [(1, 1, 19), (19, 53)], {}),
    ("layer_norm", [(3, 7, 19), (19,), (19,)], {"axis": -1, "epsilon": 1e-5}),  # blocks of rows, queued
    ("layer_norm", [(5, 6, 7), (6, 7), (6, 7)], {"axis": 1, "epsilon": 1e-3}),
    # C broadcast along rows (a column) and a whole C
    ("gemm", [(61, 5), (5, 7), (61, 1)], {"alpha": 1.0, "beta": 0.5, "trans_a": 0, "trans_b": 0}),
    ("gemm", [(5, 61), (7, 5), (61, 7)], {"alpha": 2.0, "beta": -1.0, "trans_a": 1, "trans_b": 1}),
    ("conv", [(2, 5, 9, 9), (7, 5, 1, 1)], _geometry()),  # pointwise, column pieces
    ("fused_conv", [(3, 5, 9, 9), (70, 5, 1, 1), (70,), (3, 70, 9, 9)], _geometry(**_CONV)),  # column pieces
    ("fused_conv", [(2, 5, 5, 5), (70, 5, 1, 1), (70,), (2, 70, 5, 5)], _geometry(**_CONV)),  # row pieces
    ("fused_conv", [(1, 6, 31, 29), (70, 6, 3, 3), (70,)], _geometry(pad=1, **_CONV)),  # shifted, per output rows
    ("fused_conv", [(1, 7, 11, 13), (66, 7, 3, 3), (66,)], _geometry(stride=2, pad=1)),  # im2col, row pieces
    ("fused_conv", [(1, 3, 20, 21), (6, 3, 3, 3), (6,), (1, 6, 10, 11)],
     _geometry(stride=2, pad=1, **_CONV)),  # one image, column pieces
    ("conv", [(1, 6, 20, 21), (9, 2, 3, 3)], _geometry(stride=2, group=3)),  # one image, grouped
    ("fused_conv", [(5, 7, 6, 6), (66, 7, 3, 3), (66,), (5, 66, 3, 3)], _geometry(stride=2, pad=1)),  # stacked
    ("conv", [(5, 7, 6, 6), (9, 7, 3, 3)], _geometry(stride=2)),  # stacked images, column pieces
    # a conv's prologue (the normalised input in scratch, cut as scale_shift is), then the conv cut
    ("cpu.scale_shift_conv", [(1, 6, 13, 11), (6,), (6,), (37, 6, 3, 3), (37,), (1, 37, 13, 11)],
     _geometry(pad=1, **_CONV) | {"pre_activation": "relu", "pre_alpha": 0.0, "pre_beta": 0.0}),
    ("cpu.scale_shift_conv", [(2, 12, 7, 7), (12,), (12,), (29, 12, 1, 1), (29,)],
     _geometry(**_CONV) | {"pre_activation": "clip", "pre_alpha": -0.5, "pre_beta": 0.5}),
    ("conv", [(2, 6, 9, 9), (9, 2, 3, 3)], _geometry(stride=2, group=3)),  # grouped
    ("fused_conv", [(3, 11, 9, 10), (11, 1, 3, 3), (11,), (3, 11, 5, 5)], _geometry(stride=2, pad=1, group=11)),
    # channel-blocked (N, 1, H, W, C): depthwise on flat rows (few channels), vectorised across
    # many channels (stride 2, asymmetric pads), pointwise in blocks of pixels
    ("cpu.blocked_conv", [(1, 1, 9, 10, 13), (13, 1, 3, 3), (13,), (1, 1, 9, 10, 13)], _geometry(pad=1, group=13, **_CONV)),
    ("cpu.blocked_conv", [(2, 1, 11, 10, 40), (40, 1, 5, 5), (40,)],
     _geometry(stride=2, group=40, **_CONV) | {"pads": [2, 1, 2, 3]}),
    ("cpu.blocked_conv", [(2, 1, 6, 7, 20), (12, 20, 1, 1), (12,), (2, 1, 6, 7, 12)], _geometry(**_CONV)),
    # the depthwise tiles (8 pixels x a vector register of channels) in blocks of output rows,
    # a block's first rows reading the image from its own first row (top padding only above
    # the first block), kernel rows clipped at the bottom
    ("cpu.blocked_conv", [(1, 1, 9, 40, 32), (32, 1, 3, 3), (32,), (1, 1, 9, 40, 32)], _geometry(pad=1, group=32, **_CONV)),
    ("cpu.blocked_conv", [(1, 1, 13, 41, 24), (24, 1, 5, 5), (24,)], _geometry(stride=2, pad=2, group=24, **_CONV)),
    # the register-tiled GEMMs cut into blocks of panels of output channels (the last partial)
    # and of tiles' rows of pixels (the last partial), see TILE_CASES
    ("cpu.blocked_conv", [(1, 1, 7, 9, 24), (64, 24, 1, 1), (64,), (1, 1, 7, 9, 64)], _geometry(**_CONV)),
    ("attention", [(1, 5, 13, 8), (1, 5, 11, 8), (1, 5, 11, 6)], {"scale": None}),  # blocks of heads
    ("masked_attention", [(2, 3, 13, 8), (2, 3, 11, 8), (2, 3, 11, 6), (2, 1, 13, 11)], {"scale": 0.3}),
    ("max_pool", [(2, 3, 11, 9)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("avg_pool", [(1, 5, 9, 9)], {"kernel_shape": [2, 2], "strides": [1, 1], "pads": [0, 0, 0, 0]}),
    ("scale_shift", [(2, 5, 7, 6), (5,), (5,)], {"activation": "relu", "alpha": 0.0, "beta": 0.0}),
]


@pytest.mark.parametrize("n_threads", ["2", "3"])
@pytest.mark.parametrize("name, shapes, attrs", SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_split_gemms_and_loops_equal_the_whole(monkeypatch, n_threads, name, shapes, attrs):
    """Every GEMM and compiled loop cut into its finest pieces gives what the whole kernel
    (prepared with a budget of one thread, which cuts nothing) gives, and the reference."""
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    in_types = tuple(TensorType(x.shape, x.dtype) for x in xs)
    (out_type,) = OPS[name].infer(in_types, attrs)
    results = []
    for threads_, cut in (("1", False), (n_threads, True)):
        if cut:
            _split_everything(monkeypatch, threads_)
        else:
            monkeypatch.setenv("POLYHAL_CPU_THREADS", threads_)
            _reset_budget(monkeypatch)
        out = np.full(out_type.shape, np.nan, np.float32)
        prepare(name, attrs, in_types, (out_type,))(*xs, out)
        results.append(out)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
    (want,) = OPS[name].reference(*xs, **attrs)
    np.testing.assert_allclose(results[1], want, rtol=1e-4, atol=1e-4)


# Convolutions that take the tiles path (conv_kernels._tiles): M of whole panels and of a
# partial last one, stride-1 and strided (phase planes), 1x1 (B the image itself), batches.
TILE_CASES = [
    ("fused_conv", [(1, 8, 13, 11), (37, 8, 3, 3), (37,), (1, 37, 13, 11)], _geometry(pad=1, **_CONV)),
    # batches: blocks of images, but batches of 2 by 3 threads cut by channels; one panel of
    # output channels
    ("fused_conv", [(2, 3, 23, 20), (21, 3, 7, 7), (21,)], _geometry(stride=2, pad=3)),
    ("fused_conv", [(2, 9, 9, 8), (29, 9, 3, 3), (29,), (2, 29, 9, 8)], _geometry(pad=1, **_CONV)),
    ("conv", [(3, 10, 9, 7), (50, 10, 3, 3)], _geometry(stride=2)),
    ("fused_conv", [(2, 9, 8, 8), (29, 9, 1, 1), (29,), (2, 29, 8, 8)], _geometry(**_CONV)),
    ("fused_conv", [(5, 8, 9, 7), (6, 8, 3, 3), (6,), (5, 6, 9, 7)], _geometry(pad=1, **_CONV)),
    ("conv", [(3, 9, 11, 10), (8, 9, 3, 3)], _geometry(stride=2, pad=1)),
    ("conv", [(3, 70, 8, 8), (5, 70, 1, 1)], _geometry()),
    # batch 1 (the compiled queue's pieces): strided, and 1x1 with a residual (stride-1 ones cut
    # by their own slabs: the first case above)
    ("conv", [(1, 10, 9, 7), (50, 10, 3, 3)], _geometry(stride=2)),
    ("fused_conv", [(1, 9, 8, 8), (29, 9, 1, 1), (29,), (1, 29, 8, 8)], _geometry(**_CONV)),
]


def _tile_conv(monkeypatch, name, shapes, attrs, n_threads, gemm_tiles):
    """The conv cut as finely as it may be (budget ``n_threads``), its scratch filled with nan
    first (shared with other kernels, it holds anything), the compiled tiles called through
    ``gemm_tiles``: its output."""
    from polyhal import registry
    from polyhal_cpu import conv_kernels, native
    from polyhal_cpu.scratch import standalone

    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    _split_everything(monkeypatch, n_threads)
    monkeypatch.setattr(native, "gemm_tiles", gemm_tiles)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    types = tuple(TensorType(x.shape, x.dtype) for x in xs)
    (out_type,) = OPS[name].infer(types, attrs)
    geometry = conv_kernels._Conv(attrs, types[0], types[1], out_type)
    assert geometry.path == "tiles"
    # cut by channels, or (in a batch, where that gives as many pieces) into blocks of images
    by_channels, by_images = min(int(n_threads), -(-shapes[1][0] // native.GEMM_MR)), min(int(n_threads), shapes[0][0])
    images = by_images > 1 and by_images >= by_channels
    if geometry.tiles_slabs:  # batch 1, stride 1 on the compiled queue: blocks of B's columns (conv_kernels._slabs)
        assert min(2, int(n_threads)) <= len(geometry.tiles_slabs) <= int(n_threads) and geometry.tiles_images == 1
    else:
        assert (len(geometry.tiles_pieces), geometry.tiles_images) == ((1, by_images) if images else (by_channels, 1))
    requests = registry.default_registry().get_device("cpu:0").scratch(name, attrs, types, (out_type,))
    scratch = standalone(None, requests)
    for request in requests:
        scratch.buffer(request.name).view(np.uint8)[:] = 0xFF  # nan
    out = np.full(out_type.shape, np.nan, np.float32)
    prepare(name, attrs, types, (out_type,), scratch)(*xs, out)
    (want,) = OPS[name].reference(*xs, **attrs)
    return out, want, geometry


@pytest.mark.parametrize("n_threads", ["2", "3"])
@pytest.mark.parametrize("name, shapes, attrs", TILE_CASES, ids=[str(c[1][1]) for c in TILE_CASES])
def test_split_tiles_equal_the_whole(monkeypatch, n_threads, name, shapes, attrs):
    """A tiled conv cut into blocks of output channels (or of images) gives what the uncut one
    gives and the reference; each piece that may run beside another packs and accumulates in
    its own part of the scratch, reads its own planes, and writes its own part of the output."""
    from polyhal_cpu import native

    from polyhal_cpu import queue_layout as layout

    whole, want, _ = _tile_conv(monkeypatch, name, shapes, attrs, "1", native.gemm_tiles)
    calls, tables, run_gemms = [], [], parallel.run_gemms
    monkeypatch.setattr(parallel, "run_gemms", lambda table: (tables.append(table.copy()), run_gemms(table)))

    def recording(wp, src, rowoff, packed_rows, ncols, wide, ow, out, bias, residual, bpack, cbuf, *rest):
        calls.append((out, src, bpack, cbuf))
        original(wp, src, rowoff, packed_rows, ncols, wide, ow, out, bias, residual, bpack, cbuf, *rest)
    original = native.gemm_tiles
    cut, _, geometry = _tile_conv(monkeypatch, name, shapes, attrs, n_threads, recording)
    np.testing.assert_allclose(cut, whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cut, want, rtol=1e-4, atol=1e-4)
    if geometry.tiles_images == 1 and native.gemm_queue() is not None:  # image by image, on the compiled queue
        assert not calls and len(tables) == shapes[0][0]
        slabs = bool(geometry.tiles_slabs)  # batch 1, stride 1: each piece fills its own slab
        for table in tables:
            assert len(table) == len(geometry.tiles_slabs if slabs else geometry.tiles_pieces) > 1
            assert (table[:, layout.G_KIND] == (layout.KIND_TILES_SLAB if slabs else layout.KIND_TILES)).all()
            # own scratch (and slab), part of the output (rows, or columns from a place in a row), panels
            for fields in ([layout.V_A], [layout.V_B], [layout.V_DH] if slabs else [layout.V_W],
                           [layout.V_OUT, layout.V_KW, layout.V_W] if slabs else [layout.V_OUT]):
                assert len({tuple(row) for row in table[:, fields]}) == len(table)
        return
    assert len(calls) == shapes[0][0] * len(geometry.tiles_pieces)
    for i, (out_a, *_) in enumerate(calls):
        assert not any(np.shares_memory(out_a, out_b) for out_b, *_ in calls[i + 1:])
    scratch = {bpack.ctypes.data: (bpack, cbuf) for _, _, bpack, cbuf in calls}
    assert len(scratch) == len(geometry.tiles_pieces) * geometry.tiles_images > 1
    parts = list(scratch.values())
    for i, part_a in enumerate(parts):
        for part_b in parts[i + 1:]:
            assert not any(np.shares_memory(a, b) for a in part_a for b in part_b)
    if geometry.tiles_images > 1 and geometry.phases is not None:  # each block of images its own planes
        planes = {src.ctypes.data: src for _, src, _, _ in calls}
        assert len(planes) == geometry.tiles_images
        assert not any(np.shares_memory(a, b) for i, a in enumerate(planes.values())
                       for b in list(planes.values())[i + 1:])


@pytest.mark.parametrize("n_threads", ["2", "3"])
def test_split_blocked_pointwise_tiles_own_their_rows(monkeypatch, n_threads):
    """A channel-blocked 1x1 conv's tiles cut into blocks of pixels (the last partial: 7 x 9 =
    63 pixels) on nan-filled scratch give the uncut result and the reference, each block (a
    piece of the compiled queue) with its own part of the ``rows`` scratch and of the output."""
    from polyhal import registry
    from polyhal_cpu import conv_kernels, native
    from polyhal_cpu import queue_layout as layout
    from polyhal_cpu.scratch import standalone

    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    name, attrs = "cpu.blocked_conv", _geometry(**_CONV)
    shapes = [(1, 1, 7, 9, 24), (64, 24, 1, 1), (64,), (1, 1, 7, 9, 64)]
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    types = tuple(TensorType(x.shape, x.dtype) for x in xs)
    (out_type,) = OPS[name].infer(types, attrs)
    original, tables, results = parallel.run_gemms, [], []

    def recording(table):
        tables.append(table.copy())
        original(table)
    monkeypatch.setattr(parallel, "run_gemms", recording)
    for threads_ in ("1", n_threads):
        _split_everything(monkeypatch, threads_)
        assert len(conv_kernels._pointwise_tiles(attrs, *types[:2])[3]) == int(threads_)
        requests = registry.default_registry().get_device("cpu:0").scratch(name, attrs, types, (out_type,))
        scratch = standalone(None, requests)
        for request in requests:
            scratch.buffer(request.name).view(np.uint8)[:] = 0xFF  # nan
        out = np.full(out_type.shape, np.nan, np.float32)
        tables.clear()
        prepare(name, attrs, types, (out_type,), scratch)(*xs, out)
        results.append(out)
    (table,) = tables
    assert len(table) == int(n_threads) and (table[:, layout.G_KIND] == layout.KIND_POINTWISE).all()
    for field in (layout.V_A, layout.V_B, layout.V_OUT):  # each piece its own tile, rows and output
        assert len(set(table[:, field])) == len(table)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
    (want,) = OPS[name].reference(*xs, **attrs)
    np.testing.assert_allclose(results[1], want, rtol=1e-4, atol=1e-4)


CONV_QUEUE_CASES = [  # (input, weights, geometry): odd sizes, each conv kind of the compiled queue
    ((1, 3, 37, 45), (16, 3, 3, 3), _geometry(stride=2, pad=1, activation="hard_swish", alpha=1 / 6, beta=0.5)),
    ((2, 3, 13, 11), (24, 3, 3, 3), _geometry(stride=2, pad=1, activation="relu")),  # stem, blocks of images
    ((1, 40, 13, 11), (40, 1, 3, 3), _geometry(pad=1, group=40, activation="none")),  # depthwise, 8-channel tiles
    ((1, 72, 15, 17), (72, 1, 5, 5), _geometry(stride=2, pad=2, group=72, activation="silu")),
    ((3, 96, 7, 9), (96, 1, 3, 3), _geometry(pad=1, group=96, activation="relu")),  # blocks of images
    ((1, 24, 19, 11), (24, 1, 3, 3), _geometry(pad=1, group=24, activation="relu")),  # flat rows
    ((1, 24, 9, 7), (40, 24, 1, 1), _geometry(activation="none")),  # 1x1: 63 pixels, 16-channel tiles
    ((2, 17, 5, 7), (64, 17, 1, 1), _geometry(activation="hard_swish", alpha=1 / 6, beta=0.5)),
    ((1, 40, 9, 7), (24, 40, 1, 1), _geometry(activation="relu")),  # 1x1 by BLAS on the queue: 24 channels
]


@pytest.mark.parametrize("n_threads", ["1", "2", "3"])
@pytest.mark.parametrize("xs, ws, attrs", CONV_QUEUE_CASES)
def test_blocked_convs_cut_on_the_compiled_queue(monkeypatch, n_threads, xs, ws, attrs):
    """Channels-last convs cut into as many pieces of the compiled queue as there are threads
    (blocks of output rows, of images, of pixels), with and without a residual, give the uncut
    result and the reference."""
    from polyhal_cpu import native

    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    rng = np.random.default_rng(5)
    block = lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)[:, None])  # noqa: E731
    x = rng.standard_normal(xs).astype(np.float32)
    x = x if ws[2] == 3 and xs[1] == 3 else block(x)  # a stem reads its image as it lies
    w = rng.standard_normal(ws).astype(np.float32)
    w.flags.writeable = False
    original, pieces = parallel.run_gemms, []
    monkeypatch.setattr(parallel, "run_gemms", lambda table: (pieces.append(len(table)), original(table)))
    for residual in (False, True):
        ins = [x, w, rng.standard_normal(ws[0]).astype(np.float32)]
        (out_type,) = OPS["cpu.blocked_conv"].infer(tuple(TensorType(a.shape, a.dtype) for a in ins), attrs)
        if residual:
            ins.append(rng.standard_normal(out_type.shape).astype(np.float32))
        types = tuple(TensorType(a.shape, a.dtype) for a in ins)
        results = []
        for threads_ in ("1", n_threads):
            _split_everything(monkeypatch, threads_)
            out = np.full(out_type.shape, np.nan, np.float32)
            pieces.clear()
            prepare("cpu.blocked_conv", attrs, types, (out_type,))(*ins, out)
            assert len(pieces) == 1 and (pieces[0] >= int(threads_) if threads_ != "1" else pieces[0] == 1)
            results.append(out)
        np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)
        (want,) = OPS["cpu.blocked_conv"].reference(*ins, **attrs)
        np.testing.assert_allclose(results[1], want, rtol=1e-4, atol=1e-4, err_msg=f"residual {residual}")


SCALE_SHIFT_SHAPES = [  # odd sizes: pieces of rows that start mid-image, a channel wrapping inside a piece
    (3, 5, 7, 6),
    (1, 37, 4, 5),
    (2, 3, 17),  # rank 3
    (2, 3, 2, 3, 3),  # rank 5: an 18-element plane
    (2, 5, 3),  # rows too short for the compiled loop: numpy's broadcasting
]
_ACTIVATION_PARAMS = {"clip": (-0.5, 1.5), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}


@pytest.mark.parametrize("n_threads", ["1", "2", "3"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_scale_shift_on_the_compiled_queue(monkeypatch, n_threads, activation):
    """scale_shift cut into as many blocks of (image, channel) rows on the compiled queue as
    there are threads gives what numpy's path (the queue off) gives, and the reference, for
    every activation it takes."""
    from polyhal_cpu import native

    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    rng = np.random.default_rng(6)
    alpha, beta = _ACTIVATION_PARAMS.get(activation, (0.0, 0.0))
    attrs = {"activation": activation, "alpha": alpha, "beta": beta}
    original, pieces = parallel.run_gemms, []
    monkeypatch.setattr(parallel, "run_gemms", lambda table: (pieces.append(len(table)), original(table)))
    for shape in SCALE_SHIFT_SHAPES:
        c = shape[1]
        ins = [rng.standard_normal(shape).astype(np.float32), rng.uniform(-2, 2, c).astype(np.float32),
               rng.standard_normal(c).astype(np.float32)]
        for constant in ins[1:]:
            constant.flags.writeable = False  # a plan's constants
        types = tuple(TensorType(a.shape, a.dtype) for a in ins)
        (out_type,) = OPS["scale_shift"].infer(types, attrs)
        results = []
        for queued in (False, True):
            _split_everything(monkeypatch, n_threads)
            with monkeypatch.context() as m:
                if not queued:
                    m.setattr(native, "gemm_queue", lambda: None)
                kernel = prepare("scale_shift", attrs, types, (out_type,))
            out = np.full(out_type.shape, np.nan, np.float32)
            pieces.clear()
            kernel(*ins, out)
            short = math.prod(shape[2:]) < nn_kernels.SCALE_SHIFT_ROW
            assert pieces == ([] if short or not queued else [min(int(n_threads), shape[0] * c)])
            results.append(out)
        np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6, err_msg=str(shape))
        (want,) = OPS["scale_shift"].reference(*ins, **attrs)
        np.testing.assert_allclose(results[1], want, rtol=1e-4, atol=1e-5, err_msg=str(shape))


def test_gemm_split_shapes(monkeypatch):
    """Pieces cover the product once, along the longer side or the one asked for, aligned, and
    a product too small for two pieces, or bound by memory, is not cut."""
    monkeypatch.setenv("POLYHAL_CPU_THREADS", "2")
    _reset_budget(monkeypatch)
    split = parallel.GemmSplit(1000, 40, 512)
    assert split.axis == 0 and split.bounds[0][0] == 0 and split.bounds[-1][1] == 1000
    assert all(lo % parallel.GEMM_ALIGN == 0 for lo, _ in split.bounds)
    assert all(a[1] == b[0] for a, b in zip(split.bounds, split.bounds[1:]))
    assert parallel.GemmSplit(40, 1000, 512).axis == 1
    assert parallel.GemmSplit(40, 1000, 512, axis=0).axis == 0
    assert len(parallel.GemmSplit(8, 8, 8)) == 1
    assert len(parallel.GemmSplit(1, 4096, 4096)) == 1  # a matrix-vector product: bound by memory
    assert parallel.blocks(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert parallel.blocks(10, 4, align=4) == [(0, 4), (4, 8), (8, 10)]


def test_budget_of_one_thread_cuts_nothing(monkeypatch):
    monkeypatch.setenv("POLYHAL_CPU_THREADS", "1")
    _reset_budget(monkeypatch)
    assert len(parallel.GemmSplit(4096, 4096, 4096)) == 1
    assert parallel.grid(64, 64, 1 << 20) == [(slice(None), slice(None))]


def test_pieces_run_on_the_pool_and_never_nest(monkeypatch):
    """Pieces run on more than one thread; a piece that cuts its own work runs those pieces
    itself; a failing piece's error reaches the caller after every piece has run."""
    import threading
    import time

    monkeypatch.setenv("POLYHAL_CPU_THREADS", "2")
    _reset_budget(monkeypatch)
    threads.budget().active = 2
    seen, inner = set(), []

    def piece():
        seen.add(threading.get_ident())
        time.sleep(0.01)  # long enough for the pool thread to wake and take one
        here = threading.get_ident()
        parallel.run([lambda: inner.append(threading.get_ident() == here)] * 3)

    parallel.run([piece] * 4)
    assert len(seen) == 2 and inner == [True] * 12
    ran = []

    def bad():
        raise ValueError("piece failed")
    with pytest.raises(ValueError, match="piece failed"):
        parallel.run([bad, lambda: ran.append(1), lambda: ran.append(2)])
    assert sorted(ran) == [1, 2]


# ------------------------------------------------------------------ the pool's bounded spin

def _until(condition, seconds: float = 5.0) -> bool:
    import time

    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


def _spinning_pool():
    from polyhal_cpu import native

    if native.spin_wait() is None:
        pytest.skip("compiled loops off: the pool never spins")
    pool = parallel._Pool()
    pool.grow(1)
    assert _until(lambda: len(pool._sleeping) == 1)  # a new thread blocks: it left no run
    return pool


def test_spin_wait_sees_another_threads_store_and_is_bounded():
    """The compiled spin returns when another thread's store reaches the target, posts its
    value first, and gives up after its rounds."""
    import threading
    import time

    from polyhal_cpu import native

    spin = native.spin_wait()
    if spin is None:
        pytest.skip("compiled loops off")
    flags = np.zeros(16, np.int64)
    setter = threading.Timer(0.05, flags.__setitem__, (0, 3))
    setter.start()
    t = time.perf_counter()
    spin(flags, 8, 7, 0, 3, 1 << 40, 0)  # would spin for hours if it missed the store
    assert time.perf_counter() - t >= 0.04 and flags[8] == 7
    setter.join()
    rounds = int(0.05 / parallel._round_seconds(spin))
    t = time.perf_counter()
    spin(flags, -1, 0, 0, 4, rounds, 0)  # never reached: returns after its rounds
    assert 0.03 < time.perf_counter() - t < 2


def test_pool_thread_spins_for_the_bound_then_blocks(monkeypatch):
    """After a run a pool thread spins (is not blocked) and blocks once the bound has passed."""
    import threading
    import time

    monkeypatch.setenv("POLYHAL_CPU_THREADS", "2")
    _reset_budget(monkeypatch)
    threads.budget().active = 2
    pool = _spinning_pool()
    pool.rounds = int(0.4 / parallel._round_seconds(pool._spin))  # a 0.4 s bound
    ran = []

    def piece():
        ran.append(threading.get_ident())
        time.sleep(0.02)  # long enough for the woken thread to take the other piece
    parallel._run(pool, [piece, piece], 1)
    left = time.monotonic()
    assert len(set(ran)) == 2
    time.sleep(0.1)
    assert not pool._sleeping  # still spinning, within the bound
    assert _until(lambda: len(pool._sleeping) == 1)
    assert 0.25 < time.monotonic() - left < 5
    parallel._run(pool, [piece, piece], 1)  # a blocked thread is woken by the next run
    assert len(set(ran[2:])) == 2


def test_pool_thread_never_spins_while_cores_are_shared(monkeypatch):
    """With the budget cut to one thread (other processes hold the cores) a pool thread that
    leaves a run blocks at once, however long its bound."""
    import threading
    import time

    monkeypatch.setenv("POLYHAL_CPU_THREADS", "2")
    _reset_budget(monkeypatch)
    pool = _spinning_pool()
    pool.rounds = int(30 / parallel._round_seconds(pool._spin))  # a 30 s bound
    threads.budget().active = 1
    ran = []

    def piece():
        ran.append(threading.get_ident())
        time.sleep(0.02)
    parallel._run(pool, [piece, piece], 1)
    assert len(set(ran)) == 2  # it took part, woken from its lock
    assert _until(lambda: len(pool._sleeping) == 1, seconds=2)


def test_pool_thread_serves_gemm_runs_from_its_spin_and_its_lock(monkeypatch):
    """A GEMM run published on the pool's queue is computed by the pool thread alone (the
    caller takes no piece here): once woken from its lock, once from inside its spin."""
    monkeypatch.setenv("POLYHAL_CPU_THREADS", "2")
    _reset_budget(monkeypatch)
    threads.budget().active = 2
    pool = _spinning_pool()
    if pool.gemms is None or parallel.gemm_fn() is None:
        pytest.skip("no compiled GEMM queue here")
    from polyhal_cpu import native
    from polyhal_cpu import queue_layout as layout

    pool.rounds = int(5 / parallel._round_seconds(pool._spin))  # a 5 s bound
    rng = np.random.default_rng(3)
    a, b, bias = (rng.standard_normal(s).astype(np.float32) for s in ((37, 19), (19, 29), (29,)))
    split = parallel.GemmSplit(37, 29, 19, axis=0, align=1)
    split.bounds = parallel.blocks(37, 3)
    split._lo, split._hi = (np.array(e, np.int64) for e in zip(*split.bounds))
    for woken in ("from its lock", "from its spin"):
        out = np.full((37, 29), np.nan, np.float32)
        table = split.table(a, b, out, 1.0, 1.0, bias, None, native.activation_code("relu"))
        number = int(pool.flags[parallel._STARTED]) + 1
        parallel._publish(pool.queue, table, number)
        pool.start(None, number, 1)
        done = (number << layout.RUN_SHIFT) + 3
        assert _until(lambda: pool.queue[layout.Q_FINISHED] == done), woken
        np.testing.assert_allclose(out, np.maximum(a @ b + bias, 0), rtol=1e-5, atol=1e-5)
        assert not pool._sleeping  # it spins on after the run


def test_pool_thread_serves_conv_pieces_from_its_spin_and_its_lock(monkeypatch):
    """A channels-last conv's pieces (a 5x5 depthwise conv's blocks of output rows, its
    residual and activation) published on the pool's queue are computed by the pool thread
    alone, the GIL released: once woken from its lock, once from inside its spin."""
    from polyhal_cpu import queue_layout as layout

    _split_everything(monkeypatch, "3")
    threads.budget().active = 2
    pool = _spinning_pool()
    if pool.gemms is None:
        pytest.skip("no compiled queue here")
    pool.rounds = int(5 / parallel._round_seconds(pool._spin))  # a 5 s bound
    rng = np.random.default_rng(4)
    attrs = _geometry(stride=2, pad=2, group=48, activation="silu")
    block = lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)[:, None])  # noqa: E731
    ins = [block(rng.standard_normal((1, 48, 17, 13)).astype(np.float32)),
           rng.standard_normal((48, 1, 5, 5)).astype(np.float32), rng.standard_normal(48).astype(np.float32)]
    (out_type,) = OPS["cpu.blocked_conv"].infer(tuple(TensorType(a.shape, a.dtype) for a in ins), attrs)
    ins.append(rng.standard_normal(out_type.shape).astype(np.float32))
    kernel = prepare("cpu.blocked_conv", attrs, tuple(TensorType(a.shape, a.dtype) for a in ins), (out_type,))
    (want,) = OPS["cpu.blocked_conv"].reference(*ins, **attrs)
    for woken in ("from its lock", "from its spin"):
        tables, out = [], np.full(out_type.shape, np.nan, np.float32)
        monkeypatch.setattr(parallel, "run_gemms", tables.append)  # the kernel's pieces, not run
        kernel(*ins, out)
        (table,) = tables
        assert len(table) == 3 and (table[:, layout.G_KIND] == layout.KIND_DEPTHWISE).all()
        number = int(pool.flags[parallel._STARTED]) + 1
        parallel._publish(pool.queue, table, number)
        pool.start(None, number, 1)
        assert _until(lambda: pool.queue[layout.Q_FINISHED] == (number << layout.RUN_SHIFT) + 3), woken
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4, err_msg=woken)
        assert not pool._sleeping  # it spins on after the run


@pytest.mark.parametrize("n_threads", ["2", "3"])
def test_split_attention_whose_last_group_of_heads_is_short(monkeypatch, n_threads):
    """7 heads in groups of 4 (the last of three): each block of the short group gets a score
    block of its own length (Swin-T's 109 heads in groups of 83 failed on the broadcast)."""
    from polyhal_cpu import nn_kernels

    monkeypatch.setattr(nn_kernels, "_ATTENTION_GROUP", 4 * 13 * 11)
    _split_everything(monkeypatch, n_threads)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(s).astype(np.float32) for s in ((1, 7, 13, 8), (1, 7, 11, 8), (1, 7, 11, 6))]
    in_types = tuple(TensorType(x.shape, x.dtype) for x in xs)
    (out_type,) = OPS["attention"].infer(in_types, {"scale": None})
    out = np.full(out_type.shape, np.nan, np.float32)
    prepare("attention", {"scale": None}, in_types, (out_type,))(*xs, out)
    (want,) = OPS["attention"].reference(*xs, scale=None)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


PHASE_CASES = [  # strided planes split into column phases: im2col (a 3-channel stem, on the gemm path) and pools
    ("conv", [(1, 3, 61, 60), (8, 3, 3, 3)], _geometry(stride=2, pad=1)),  # blocks of channels of one image
    ("conv", [(2, 3, 61, 60), (8, 3, 3, 3)], _geometry(stride=2, pad=1)),  # a stack of images cut into images
    ("max_pool", [(2, 5, 17, 19)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                    "dilations": [1, 1], "ceil_mode": 0}),
    ("avg_pool", [(1, 6, 16, 16)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                    "dilations": [1, 1], "ceil_mode": 0, "count_include_pad": 0}),
    ("max_pool", [(1, 6, 16, 15)], {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [0, 0, 0, 0],
                                    "dilations": [1, 1], "ceil_mode": 1}),
]


@pytest.mark.parametrize("name, shapes, attrs", PHASE_CASES,
                         ids=["im2col", "im2col-stack", "max_pool", "avg_pool", "max_pool-2x2"])
def test_split_phases_are_declared_scratch(monkeypatch, name, shapes, attrs):
    """A compiled loop that splits strided planes into column phases allocates nothing: it works
    in its kernel's declared ``phases`` scratch (filled with nan first: shared with other
    kernels, it holds anything), each piece that may run beside another in a part of its own."""
    from polyhal import registry
    from polyhal_cpu import conv_kernels, native
    from polyhal_cpu.scratch import standalone

    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    _split_everything(monkeypatch, "2")
    loop = "im2col" if name == "conv" else "pool2d"
    original, works, tables, run_gemms = getattr(native, loop), [], [], parallel.run_gemms

    def recording(*args):
        works.append(args[3])
        original(*args)
    monkeypatch.setattr(native, loop, recording)
    monkeypatch.setattr(parallel, "run_gemms", lambda table: (tables.append(table.copy()), run_gemms(table)))
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    types = tuple(TensorType(x.shape, x.dtype) for x in xs)
    (out_type,) = OPS[name].infer(types, attrs)
    if name == "conv":
        assert conv_kernels._Conv(attrs, types[0], types[1], out_type).path == "gemm"
    requests = registry.default_registry().get_device("cpu:0").scratch(name, attrs, types, (out_type,))
    scratch = standalone(None, requests)
    for request in requests:
        scratch.buffer(request.name).view(np.uint8)[:] = 0xFF  # nan
    phases = scratch.buffer("phases").view(np.float32)
    out = np.full(out_type.shape, np.nan, np.float32)
    prepare(name, attrs, types, (out_type,), scratch)(*xs, out)
    (want,) = OPS[name].reference(*xs, **attrs)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    if name != "conv" and native.gemm_queue() is not None:  # the pool's pieces on the compiled queue
        from polyhal_cpu import queue_layout as layout

        assert not works and len(tables) == 1 and len(tables[0]) > 1
        base = phases.ctypes.data
        works = [phases[(d[layout.V_B] - base) // 4:][:d[layout.V_N0]] for d in tables[0]]
        assert all(0 <= d[layout.V_B] - base <= phases.nbytes - 4 * d[layout.V_N0] for d in tables[0])
    assert len(works) > 1 and all(np.shares_memory(work, phases) for work in works)
    assert not np.isnan(phases).all()
    for i, a in enumerate(works):  # every piece of one run may run beside every other
        assert not any(np.shares_memory(a, b) for b in works[i + 1:])


def test_piece_table_fills_addresses_and_keeps_a_plans_table():
    """A PieceTable's rows get each operand's address plus the piece's offset (an absent
    operand's field stays 0); the same arrays again give the same table, another array (a
    caller's temporary, or a weight changed) its own address."""
    rows = np.zeros((2, 4), np.int64)
    rows[:, 3] = 7  # a field the table does not fill
    table = parallel.PieceTable(rows, [(0, 0, [0, 40]), (1, 1, [0, 0]), (2, 2, [8, 16])])
    x, out = np.zeros(20, np.float32), np.zeros(20, np.float32)
    w = np.ones(3, np.float32)
    w.flags.writeable = False
    t = table(x, w, out)
    np.testing.assert_array_equal(t, [[x.ctypes.data, w.ctypes.data, out.ctypes.data + 8, 7],
                                      [x.ctypes.data + 40, w.ctypes.data, out.ctypes.data + 16, 7]])
    assert table(x, w, out) is t
    other = np.zeros(20, np.float32)
    t2 = table(other, w, None)
    assert t2 is not t and (t2[:, 0] == other.ctypes.data + np.array([0, 40])).all() and (t2[:, 2] == 0).all()
    w2 = w.copy()
    w2.flags.writeable = False
    assert (table(other, w2, None)[:, 1] == w2.ctypes.data).all()
