"""The compiled loops allocate nothing inside a kernel call: a kernel's scratch is declared to
bufferization, and what depends on shapes alone is made when the kernel is prepared."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

# Runs in a process of its own: numba counts its runtime's allocations only when NUMBA_NRT_STATS
# is set before it is imported. (The loops' LLVM IR would say as much, but a loop loaded from
# numba's cache has none to inspect.) Calling a loop counts one allocation per array it is
# passed (the array's handle, made as numba unboxes it): each loop is wrapped to count those.
_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba.core.runtime import rtsys

    from polyhal.ir.types import TensorType
    from polyhal.ops import OPS
    from polyhal_cpu import conv_kernels, native
    from polyhal_cpu.kernels import prepare

    handles = [0]


    def counted(loop):
        def call(*args):
            handles[0] += sum(isinstance(a, np.ndarray) for a in args)
            return loop(*args)
        return call


    loops = native._compiled()
    for name in list(loops):
        loops[name] = counted(loops[name])

    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    block = lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)[:, None])  # channel-blocked


    def geometry(stride=1, pad=0, group=1, **fused):
        attrs = {"strides": [stride] * 2, "pads": [pad] * 4, "dilations": [1, 1], "group": group}
        return attrs | ({"activation": "relu", "alpha": 0.0, "beta": 0.0} | fused if fused else {})


    calls = []
    for name, xs, attrs in [
        # channel-blocked: depthwise (whole vectors of channels: the tiles; few: flat rows;
        # strided), then 1x1 convs (the compiled tiles), each with a residual
        ("cpu.blocked_conv", [block(f(1, 32, 9, 40)), f(32, 1, 3, 3), f(32), f(1, 1, 9, 40, 32)],
         geometry(pad=1, group=32, activation="relu")),
        ("cpu.blocked_conv", [block(f(1, 13, 9, 10)), f(13, 1, 3, 3), f(13), f(1, 1, 9, 10, 13)],
         geometry(pad=1, group=13, activation="relu")),
        ("cpu.blocked_conv", [block(f(1, 24, 13, 41)), f(24, 1, 5, 5), f(24)],
         geometry(stride=2, pad=2, group=24, activation="silu")),
        ("cpu.blocked_conv", [block(f(1, 24, 7, 9)), f(64, 24, 1, 1), f(64), f(1, 1, 7, 9, 64)],
         geometry(activation="relu")),
        ("cpu.blocked_conv", [block(f(2, 17, 5, 7)), f(40, 17, 1, 1), f(40)], geometry(activation="relu")),
        # dense convs by the compiled tiles (stride 1: shifted planes; stride 2: column phases)
        ("fused_conv", [f(5, 8, 9, 7), f(6, 8, 3, 3), f(6), f(5, 6, 9, 7)], geometry(pad=1, activation="relu")),
        ("conv", [f(3, 9, 11, 10), f(8, 9, 3, 3)], geometry(stride=2, pad=1)),
        # pools as pieces of the compiled queue: 3x3 stride-2 max, 2x2 stride-2 average (loops of
        # their own), and a general window
        ("max_pool", [f(1, 5, 13, 12)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
        ("avg_pool", [f(1, 6, 12, 10)], {"kernel_shape": [2, 2], "strides": [2, 2], "count_include_pad": 0}),
        ("avg_pool", [f(1, 6, 12, 10)], {"kernel_shape": [3, 3], "strides": [1, 2], "pads": [1, 1, 1, 1],
                                         "count_include_pad": 1}),
        # a norm and activation no conv took (pieces of the compiled queue; ReLU in the pass, or not)
        ("scale_shift", [f(2, 5, 7, 6), f(5), f(5)], {"activation": "relu", "alpha": 0.0, "beta": 0.0}),
        ("scale_shift", [f(1, 7, 4, 5), f(7), f(7)], {"activation": "silu", "alpha": 0.0, "beta": 0.0}),
        # batch 1, stride 1: a piece of the compiled queue filling its own slab of the padded image
        ("fused_conv", [f(1, 8, 9, 7), f(6, 8, 3, 3), f(6), f(1, 6, 9, 7)], geometry(pad=1, activation="relu")),
        # a 1x1 conv over a small plane with its input's prologue: pieces of the compiled queue
        # normalising their columns into their scratch, then BLAS's sgemm
        ("cpu.scale_shift_conv", [f(1, 12, 7, 7), f(12), f(12), f(20, 12, 1, 1), f(20), f(1, 20, 7, 7)],
         geometry(activation="relu") | {"pre_activation": "silu", "pre_alpha": 0.0, "pre_beta": 0.0}),
        # a 1x1 conv over a 56x56 plane: pieces reading their blocks of columns where they lie
        ("conv", [f(1, 8, 56, 56), f(16, 8, 1, 1)], geometry()),
        # a scale_shift_conv whose slab pieces apply the prologue as they fill (a ReLU in the
        # pass; a silu in a second pass over each row): a 3x3 conv's padded rows, a 1x1 conv's columns
        ("cpu.scale_shift_conv", [f(1, 8, 9, 7), f(8), f(8), f(6, 8, 3, 3), f(6), f(1, 6, 9, 7)],
         geometry(pad=1, activation="relu") | {"pre_activation": "relu", "pre_alpha": 0.0, "pre_beta": 0.0}),
        ("cpu.scale_shift_conv", [f(1, 8, 16, 16), f(8), f(8), f(16, 8, 1, 1), f(16)],
         geometry(activation="none") | {"pre_activation": "silu", "pre_alpha": 0.0, "pre_beta": 0.0}),
    ]:
        types = tuple(TensorType(x.shape, x.dtype) for x in xs)
        (out_type,) = OPS[name].infer(types, attrs)
        if name == "cpu.scale_shift_conv":
            conv_attrs, conv_types = conv_kernels._without_prologue(attrs, types)
            assert conv_kernels._Conv(conv_attrs, conv_types[0], conv_types[1], out_type,
                                      prologue=True).fill in ("slabs", "pointwise")
        elif name.endswith("conv") and name != "cpu.blocked_conv":
            g = conv_kernels._Conv(attrs, types[0], types[1], out_type)
            assert g.path == "tiles" and bool(g.tiles_slabs) == (xs[0].shape[0] == 1 and attrs["strides"] == [1, 1])
        out = np.empty(out_type.shape, np.float32)
        calls.append((prepare(name, attrs, types, (out_type,)), xs, out))
    # the NCHW loops: im2col (with column phases), pooling (strided), depthwise
    img, w = f(2, 6, 11, 40), f(6, 1, 3, 3)
    cols, work = np.empty((54, 2 * 6 * 20), np.float32), np.empty(2 * native.pool2d_work((11, 40), (2, 2)), np.float32)
    pool_out, dw_out = np.empty((12, 5, 19), np.float32), np.empty((2, 6, 6, 20), np.float32)
    columns = native.column_table(19, 3, 2, 0, 1, 40)
    calls += [
        (native.im2col, (img, 0, cols, work, (3, 3), (2, 2), (1, 1), (1, 1), (6, 20)), None),
        (native.pool2d, (img.reshape(12, 11, 40), pool_out, np.zeros((1, 1), np.float32), work, columns, (3, 3),
                         (2, 2), (0, 0), (1, 1), True), None),
        (native.depthwise, (img, w, native.column_table(20, 3, 2, 1, 1, 40), f(6), None, dw_out, (2, 2), (1, 1),
                            (1, 1), 1, 0.0, 0.0), None),
    ]

    def run():
        for fn, args, out in calls:
            fn(*args) if out is None else fn(*args, out)

    run()  # compiled or loaded, warmed
    before, handles[0] = rtsys.get_allocation_stats().alloc, 0
    for _ in range(3):
        run()
    assert handles[0] > 0
    print("allocations", rtsys.get_allocation_stats().alloc - before - handles[0])
""")


def test_compiled_loops_allocate_nothing_per_call():
    """Depthwise (tiles, flat rows, strided), 1x1 and dense convs (the compiled tiles; the
    channel-blocked ones as pieces of the compiled queue), scale_shift (pieces of the queue), a
    scale_shift_conv on the pointwise path (pieces of the queue with their prologue),
    im2col, pooling and the NCHW depthwise loop, run again once warm: numba's runtime counts no allocation but the arrays'
    handles. (One thread: every piece on the calling thread, whose loops are counted.)"""
    from polyhal_cpu import native

    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    # the JIT loops (no ahead-of-time module: its runtime is not the one numba counts)
    env = dict(os.environ, NUMBA_NRT_STATS="1", POLYHAL_CPU_THREADS="1", POLYHAL_CPU_CACHE_DIR="")
    result = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "allocations 0", result.stdout
