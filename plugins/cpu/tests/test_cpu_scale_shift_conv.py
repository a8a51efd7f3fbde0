"""The CPU's ``scale_shift_conv`` (polyhal_cpu.conv_kernels): a conv reading its input through a
per-channel scale, shift and activation, against the float64 reference on each conv path, with
and without the compiled loops, prepared alone and in a plan (its scratch planned there)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.scratch import MemorySpace
from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal_cpu import conv_kernels, native, parallel, threads
from polyhal_cpu import queue_layout as layout
from polyhal_cpu.kernels import prepare
from polyhal_cpu.scratch import standalone
from polyhal_cpu.table import TABLE

RNG = np.random.default_rng(11)

#: (x shape, w shape, conv attrs, the path the conv takes with the compiled loops)
CASES = [
    ((1, 8, 16, 16), (16, 8, 1, 1), {}, "tiles"),                                   # 1x1: slabs of columns
    ((2, 12, 7, 7), (20, 12, 1, 1), {}, "pointwise"),                               # 1x1 over a small plane
    ((1, 16, 9, 8), (12, 16, 3, 3), {"pads": [1, 1, 1, 1]}, "tiles"),               # 3x3, padded planes
    ((2, 9, 11, 10), (10, 9, 3, 3), {"strides": [2, 2], "pads": [0, 1, 2, 1]}, "tiles"),
    ((1, 6, 7, 7), (6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1]}, "depthwise"),
    ((1, 6, 8, 8), (4, 3, 3, 3), {"group": 2, "pads": [1, 0, 0, 1]}, "gemm"),       # grouped im2col
    ((2, 3, 13), (4, 3, 3), {"strides": [2], "pads": [1, 2]}, "gemm"),             # 1-D
]
#: (prologue activation, epilogue activation): the prologue's each, and an epilogue among them.
ACTIVATIONS = [("relu", "none"), ("none", "relu"), ("sigmoid", "silu"), ("clip", "hard_swish"),
               ("hard_swish", "clip"), ("gelu", "sigmoid"), ("silu", "gelu_tanh")]
_PARAMS = {"clip": (-0.5, 0.7), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}


def _f(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _instance(xs, ws, conv, pre, post, residual: bool):
    """Operands and attributes of one scale_shift_conv; shifts away from zero, so that a kernel
    padding the input before normalising it (reading act(shift) there, not 0) is caught."""
    n = len(xs) - 2
    attrs = {"strides": [1] * n, "pads": [0] * 2 * n, "dilations": [1] * n, "group": 1, **conv,
             "activation": post, "alpha": _PARAMS.get(post, (0, 0))[0], "beta": _PARAMS.get(post, (0, 0))[1],
             "pre_activation": pre, "pre_alpha": _PARAMS.get(pre, (0, 0))[0],
             "pre_beta": _PARAMS.get(pre, (0, 0))[1]}
    c = xs[1]
    ins = [_f(*xs), (1 + 0.2 * _f(c)), (0.5 + np.abs(_f(c))).astype(np.float32), _f(*ws) * 0.3, _f(ws[0])]
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    (out_type,) = OPS["cpu.scale_shift_conv"].infer(types, attrs)
    if residual:
        ins.append(_f(*out_type.shape))
    return ins, attrs, out_type


@pytest.mark.parametrize("native_loops", ["1", "0"])
@pytest.mark.parametrize("xs, ws, conv, path", CASES,
                         ids=[f"{c[3]}-{len(c[0]) - 2}d-{i}" for i, c in enumerate(CASES)])
def test_kernel_matches_reference(xs, ws, conv, path, native_loops, monkeypatch):
    monkeypatch.setenv("POLYHAL_CPU_NATIVE", native_loops)
    for i, (pre, post) in enumerate(ACTIVATIONS):
        ins, attrs, out_type = _instance(xs, ws, conv, pre, post, residual=i % 2 == 1)
        types = tuple(TensorType(a.shape, a.dtype) for a in ins)
        if native_loops == "1":
            conv_attrs, conv_types = conv_kernels._without_prologue(attrs, types)
            assert conv_kernels._Conv(conv_attrs, conv_types[0], conv_types[1], out_type).path == path
        out = np.full(out_type.shape, np.nan, np.float32)
        prepare("cpu.scale_shift_conv", attrs, types, (out_type,))(*ins, out)
        (want,) = OPS["cpu.scale_shift_conv"].reference(*ins, **attrs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=3e-5,
                                   err_msg=f"{pre} -> conv -> {post}, {len(ins)} inputs")


def test_in_a_plan_the_normalised_input_is_declared_scratch():
    """Compiled, the kernel writes the normalised map into the scratch bufferization planned
    (listed by explain), not into a value of the program, and runs again on the same buffers
    (a batch of two: no slabs to fill through the prologue)."""
    ins, attrs, _ = _instance((2, 16, 9, 8), (12, 16, 3, 3), {"pads": [1, 1, 1, 1]}, "relu", "relu", True)
    b = polyhal.ProgramBuilder("prologue")
    args = [b.input(f"x{i}", a.shape, a.dtype) for i, a in enumerate(ins)]
    b.output(b.op("cpu.scale_shift_conv", *args, **attrs))
    plan = polyhal.compile(b.build(), "cpu:0")
    assert "normalised" in plan.explain()
    (want,) = OPS["cpu.scale_shift_conv"].reference(*ins, **attrs)
    for _ in range(2):
        np.testing.assert_allclose(plan.run_numpy(*ins)[0], want, rtol=1e-4, atol=3e-5)


def test_a_path_that_fills_its_input_takes_the_prologue(monkeypatch):
    """The seam for conv paths that normalise as they fill their own input: a path named in
    PROLOGUE_FILLS builds the whole op, and no normalised copy is declared for it unless
    PROLOGUE_SCRATCH names the path too (then of the size it says)."""
    ins, attrs, out_type = _instance((2, 12, 7, 7), (20, 12, 1, 1), {}, "relu", "none", False)
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    built = []

    def fill(device, op, attrs_, ins_, outs_, scratch):
        built.append((op, ins_))
        return lambda *arrays: arrays[-1].fill(7.0)

    names = lambda: [r.name for r in TABLE.scratch(None, "cpu.scale_shift_conv", attrs, types, (out_type,))]  # noqa: E731
    assert "normalised" in names()
    monkeypatch.setitem(conv_kernels.PROLOGUE_FILLS, "pointwise", fill)
    monkeypatch.setitem(conv_kernels.PROLOGUE_SCRATCH, "pointwise", lambda g, x: 4 * x.size + 4)
    (request,) = [r for r in TABLE.scratch(None, "cpu.scale_shift_conv", attrs, types, (out_type,))
                  if r.name == "normalised"]
    assert request.nbytes(MemorySpace.GLOBAL) == 4 * types[0].size + 4
    monkeypatch.delitem(conv_kernels.PROLOGUE_SCRATCH, "pointwise")
    assert "normalised" not in names()
    out = np.empty(out_type.shape, np.float32)
    prepare("cpu.scale_shift_conv", attrs, types, (out_type,))(*ins, out)
    assert built == [("cpu.scale_shift_conv", types)] and (out == 7.0).all()


@pytest.mark.parametrize("n_threads", ["1", "2", "3"])
@pytest.mark.parametrize("xs, m, least, per_thread", [
    ((1, 40, 14, 14), 24, 16, 1),   # by blocks of positions (196 = 96 + 100; 65 + 65 + 66 cut at 16s)
    ((1, 40, 14, 14), 24, 16, 2),   # two pieces a thread
    ((1, 33, 7, 7), 40, 64, 1),     # too few positions a piece: by blocks of output channels
    ((1, 8, 6, 6), 48, 4, 1),       # fewer positions than output channels: by blocks of channels
    ((2, 17, 5, 9), 35, 8, 1),      # a batch; 45 positions: odd blocks of columns
    ((1, 9, 5, 7), 1, 2, 1),        # one output channel (BLAS's matrix-vector product), 35 columns
])
def test_pointwise_prologue_on_the_gemm_queue(n_threads, xs, m, least, per_thread, monkeypatch):
    """A scale_shift_conv on the pointwise path runs as pieces of the compiled queue that each
    normalise their own columns of the input (or all of them, cut by output channels) before
    their sgemm, with the bias, residual and activation: as many pieces as it may be cut into
    (cutting forced down to tiny pieces), every prologue activation, against the reference."""
    monkeypatch.setattr(parallel, "_fn", False)  # looked up again: not as a test without the loops left it
    if not native.available(np.float32) or parallel.gemm_fn() is None:
        pytest.skip("the compiled GEMM queue is not available here")
    monkeypatch.setattr(parallel, "GEMM_QUEUE_PIECE_US", 0.001)
    monkeypatch.setattr(conv_kernels, "POINTWISE_MIN_COLUMNS", least)
    monkeypatch.setattr(conv_kernels, "PROLOGUE_PIECES_PER_THREAD", per_thread)
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    for i, (pre, post) in enumerate(ACTIVATIONS):
        ins, attrs, out_type = _instance(xs, (m, xs[1], 1, 1), {}, pre, post, residual=i % 2 == 0)
        types = tuple(TensorType(a.shape, a.dtype) for a in ins)
        conv_attrs, conv_types = conv_kernels._without_prologue(attrs, types)
        g = conv_kernels._Conv(conv_attrs, conv_types[0], conv_types[1], out_type)
        assert g.path == "pointwise"
        pieces = conv_kernels._pointwise_pieces(g, per_thread)
        parts = int(n_threads) * per_thread
        if n_threads == "1":  # a budget of one thread cuts nothing
            assert len(pieces) == 1
        else:  # by blocks of positions where each holds ``least`` and outnumber the channels
            assert len(pieces) > 1
            assert all(m1 - m0 == m for *_, m0, m1 in pieces) == (g.positions // parts >= least and g.positions >= m)
        covered = np.zeros((m, g.positions), int)
        for c0, c1, m0, m1 in pieces:
            covered[m0:m1, c0:c1] += 1
        assert (covered == 1).all()
        out = np.full(out_type.shape, np.nan, np.float32)
        kernel = prepare("cpu.scale_shift_conv", attrs, types, (out_type,))
        for _ in range(2):
            kernel(*ins, out)
        (want,) = OPS["cpu.scale_shift_conv"].reference(*ins, **attrs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=3e-5,
                                   err_msg=f"{pre} -> conv -> {post}, {len(ins)} inputs")


#: (x shape, w shape, conv attrs): batch-1 stride-1 convs whose queue pieces fill their own slabs
SLAB_CASES = [
    ((1, 16, 9, 8), (12, 16, 3, 3), {"pads": [1, 1, 1, 1]}),           # the padded image's rows
    ((1, 5, 13, 11), (13, 5, 3, 3), {"pads": [1, 2, 0, 1]}),           # asymmetric pads, 2 panels
    ((1, 4, 10, 37), (9, 4, 3, 2), {"pads": [2, 0, 1, 3], "dilations": [2, 3]}),  # blocks from mid-row
    ((1, 8, 16, 16), (16, 8, 1, 1), {}),                                # 1x1: blocks of the image's columns
    ((1, 7, 9, 23), (20, 7, 1, 1), {}),                                 # 1x1, a last partial tile
]


@pytest.mark.parametrize("n_threads", ["1", "2", "3"])
@pytest.mark.parametrize("xs, ws, conv", SLAB_CASES, ids=[f"slab-{i}" for i in range(len(SLAB_CASES))])
def test_slab_pieces_apply_the_prologue_as_they_fill(xs, ws, conv, n_threads, monkeypatch,
                                                     check_on_poisoned_scratch):
    """At batch 1 on the compiled queue, each piece of the conv fills its slab through the
    prologue (queue_layout's KIND_TILES_SLAB with V_SCALE set): padding stays 0 (shifts away from
    zero catch a pad normalised), on nan-filled scratch and output, with and without residual,
    every pre-activation, a 1x1 conv's pieces a block of columns at a time; no normalised copy
    is declared; 1, 2 and 3 threads give the reference."""
    if not native.available(np.float32) or native.gemm_queue() is None:
        pytest.skip("the compiled queue is not available here")
    monkeypatch.setattr(parallel, "GEMM_QUEUE_PIECE_US", 1e-9)  # small convs cut too
    monkeypatch.setattr(parallel, "QUEUE_PIECES_PER_THREAD", 1)
    monkeypatch.setattr(conv_kernels, "TILES_MIN_K", 1)
    monkeypatch.setattr(native, "GEMM_BLOCK_BYTES", 2 * 32 * 4 * 8 * -(-ws[0] // 8))  # blocks of two tiles
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    tables, run_gemms = [], parallel.run_gemms
    monkeypatch.setattr(parallel, "run_gemms", lambda table: (tables.append(table.copy()), run_gemms(table)))
    for i, (pre, post) in enumerate(ACTIVATIONS + [("hard_sigmoid", "relu")]):
        ins, attrs, out_type = _instance(xs, ws, conv, pre, post, residual=i % 2 == 0)
        types = tuple(TensorType(a.shape, a.dtype) for a in ins)
        conv_attrs, conv_types = conv_kernels._without_prologue(attrs, types)
        g = conv_kernels._Conv(conv_attrs, conv_types[0], conv_types[1], out_type, prologue=True)
        assert g.fill == "slabs" and len(g.tiles_slabs) == int(n_threads)
        requests = TABLE.scratch(None, "cpu.scale_shift_conv", attrs, types, (out_type,))
        assert "normalised" not in [r.name for r in requests]
        scratch = standalone(None, requests)
        kernel = prepare("cpu.scale_shift_conv", attrs, types, (out_type,), scratch)
        # again with another image: every slab filled again, its padding too
        check_on_poisoned_scratch(kernel, scratch, requests, "cpu.scale_shift_conv", attrs, ins, lambda: _f(*xs), out_type,
                                  atol=3e-5, msg=f"{pre} -> conv -> {post}")
        table = tables[-1]
        assert (table[:, layout.G_KIND] == layout.KIND_TILES_SLAB).all() and (table[:, layout.V_SCALE] != 0).all()
        assert len({tuple(row) for row in table[:, [layout.V_DH]]}) == len(table)  # own slabs
