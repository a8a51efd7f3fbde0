"""The CPU's convolution family (polyhal_cpu.conv_kernels) against onnxruntime: each path
(pointwise GEMM, depthwise loop, im2col + grouped GEMM, numpy columns), with and without the
compiled loops, through compiled plans (so the columns are the plan's declared scratch)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
import polyhal.onnx
from polyhal.errors import ProgramError, ShapeError
from polyhal.ops import OPS
from polyhal.ir.types import TensorType
from polyhal_cpu import blas as polyhal_cpu_blas
from polyhal_cpu import conv_kernels, native, parallel, threads
from polyhal_cpu.kernels import prepare
from polyhal_cpu.scratch import standalone

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

RNG = np.random.default_rng(7)


def _f(*shape) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _model(node, inputs: dict[str, np.ndarray], inits: dict[str, np.ndarray]):
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape) for k, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [f"d{i}" for i in range(len(inputs["x"].shape))])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _against_onnxruntime(node, inputs: dict, inits: dict, tmp_path, rtol=1e-4, atol=1e-4) -> None:
    model = _model(node, inputs, inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, inputs)
    program = polyhal.onnx.load(path)
    plan = program.compile("cpu:0")
    (got,) = program.execute(plan, inputs).values()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


#: (x shape, w shape, attrs): every path and attribute the kernel distinguishes.
CONVS = [
    ((1, 8, 9, 9), (16, 8, 1, 1), {}),                                                  # pointwise GEMM
    ((2, 8, 9, 9), (16, 8, 1, 1), {"strides": [2, 2]}),                                 # 1x1 strided: im2col
    ((2, 4, 9, 8), (6, 4, 3, 3), {"strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]}),
    ((1, 6, 7, 7), (6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1]}),                   # depthwise
    ((2, 4, 11, 10), (8, 1, 5, 5), {"group": 4, "strides": [2, 2], "pads": [2, 1, 2, 3], "dilations": [1, 2]}),
    ((1, 6, 8, 8), (4, 3, 3, 3), {"group": 2, "pads": [0, 1, 1, 0]}),                   # grouped GEMM
    ((2, 3, 13), (4, 3, 3), {"strides": [2], "pads": [1, 2], "dilations": [2]}),        # 1-D
    ((2, 4, 13), (4, 1, 3), {"group": 4, "pads": [1, 1]}),                              # 1-D depthwise
    ((1, 2, 5, 4, 4), (4, 2, 2, 3, 1), {"strides": [1, 2, 1], "pads": [1, 0, 0, 1, 1, 0]}),  # 3-D
    ((1, 3, 4, 4), (2, 3, 4, 4), {}),                                                   # kernel = input
    ((1, 3, 61, 60), (4, 3, 7, 7), {"strides": [2, 2], "pads": [3, 2, 3, 3]}),          # column phases
    ((3, 2, 5, 90), (3, 2, 3, 3), {"strides": [1, 3], "pads": [1, 1, 1, 1], "dilations": [1, 2]}),  # stacked
]


@pytest.mark.parametrize("native_loops", ["1", "0"])
@pytest.mark.parametrize("case", range(len(CONVS)))
@pytest.mark.parametrize("bias", [True, False])
def test_conv_matches_onnxruntime(case, native_loops, bias, tmp_path, monkeypatch):
    """Every path, with a bias and without (a bare conv skips the epilogue's pass)."""
    monkeypatch.setenv("POLYHAL_CPU_NATIVE", native_loops)
    xs, ws, attrs = CONVS[case]
    inits = {"w": _f(*ws), "b": _f(ws[0])} if bias else {"w": _f(*ws)}
    node = helper.make_node("Conv", ["x", *inits], ["y"], **attrs)
    _against_onnxruntime(node, {"x": _f(*xs)}, inits, tmp_path)


@pytest.mark.parametrize("xs, ws, attrs", [
    ((5, 4, 9, 9), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((5, 6, 11, 10), (4, 3, 3, 3), {"group": 2, "strides": [2, 1], "pads": [1, 0, 2, 1], "dilations": [1, 2]}),
])
def test_stacked_images_match_onnxruntime(xs, ws, attrs, tmp_path, monkeypatch):
    """Several images' columns in one GEMM, grouped too, the last GEMM taking fewer images
    (2 + 2 + 1 images of 81 positions; 3 + 2 of 42)."""
    monkeypatch.setattr(conv_kernels, "GEMM_POSITIONS", 2 * 81)
    monkeypatch.setattr(conv_kernels, "TILES", False)  # stride 1 would take the tiles path
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)
    _against_onnxruntime(node, {"x": _f(*xs)}, {"w": _f(*ws), "b": _f(ws[0])}, tmp_path)


@pytest.mark.parametrize("xs, ws, attrs", [
    ((2, 4, 9, 8), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 3, 10, 11), (5, 3, 3, 2), {"pads": [2, 0, 1, 3], "dilations": [2, 3]}),
    ((2, 3, 29), (4, 3, 3), {"pads": [1, 2], "dilations": [2]}),  # 1-D
    ((1, 4, 9, 9), (2, 4, 5, 5), {}),  # no padding
])
def test_shifted_path_matches_onnxruntime(xs, ws, attrs, tmp_path, monkeypatch):
    """Stride-1 convolutions as one accumulating GEMM per tap over a padded image (taken here
    from 16 output positions up, so that small shapes take it; the tiles path, which serves them
    where the compiled loops run, turned off)."""
    monkeypatch.setattr(conv_kernels, "SHIFTED_POSITIONS", 16)
    monkeypatch.setattr(conv_kernels, "TILES", False)
    out = TensorType(xs[:1] + ws[:1] + tuple(
        xs[2 + i] + attrs.get("pads", [0] * 4)[i] + attrs.get("pads", [0] * 4)[i + len(ws) - 2]
        - (ws[2 + i] - 1) * attrs.get("dilations", [1] * 2)[i] for i in range(len(ws) - 2)), np.float32)
    geometry = conv_kernels._Conv({"group": 1} | attrs, TensorType(xs, np.float32), TensorType(ws, np.float32), out)
    if polyhal_cpu_blas.gemm(np.float32) is not None:
        assert geometry.path == "shifted"
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)
    _against_onnxruntime(node, {"x": _f(*xs)}, {"w": _f(*ws), "b": _f(ws[0])}, tmp_path)


def _tiles_instance(xs, ws, attrs, fused):
    """A tiles-path case: (op, attrs, operands, their types, the output type) of a conv of an
    image ``xs`` by read-only weights ``ws`` (a plan's constant: the packed copy is kept and
    reused), bare (``fused`` "none"), with a bias and hard_swish ("bias"), or with a bias, a
    residual and relu ("residual")."""
    n = len(ws) - 2
    attrs = {"strides": [1] * n, "pads": [0] * (2 * n), "dilations": [1] * n, "group": 1} | attrs
    x, w = _f(*xs), _f(*ws)
    w.flags.writeable = False
    ins = [x, w] if fused == "none" else [x, w, _f(ws[0])]
    op = "conv" if fused == "none" else "fused_conv"
    if op == "fused_conv":
        attrs |= {"activation": "relu" if fused == "residual" else "hard_swish", "alpha": 1 / 6, "beta": 0.5}
    (out_type,) = OPS[op].infer(tuple(TensorType(a.shape, a.dtype) for a in ins), attrs)
    if fused == "residual":
        ins.append(_f(*out_type.shape))
    return op, attrs, ins, tuple(TensorType(a.shape, a.dtype) for a in ins), out_type


@pytest.mark.parametrize("xs, ws, attrs", [
    ((2, 4, 9, 8), (6, 4, 3, 3), {"pads": [1, 1, 1, 1]}),  # M below one panel of weights
    ((1, 5, 10, 11), (13, 5, 3, 2), {"pads": [2, 0, 1, 3], "dilations": [2, 3]}),  # 2 panels, the last partial
    ((2, 3, 29), (9, 3, 3), {"pads": [1, 2], "dilations": [2]}),  # 1-D
    ((1, 4, 9, 9), (16, 4, 5, 5), {}),  # no padding
    ((1, 3, 40, 37), (8, 3, 3, 3), {"pads": [1, 1, 1, 1]}),  # several column blocks (see below)
    ((1, 2, 1, 1), (3, 2, 3, 3), {"pads": [1, 1, 1, 1]}),  # one output position
    ((2, 3, 23, 20), (10, 3, 7, 7), {"strides": [2, 2], "pads": [3, 3, 3, 3]}),  # stride 2: four phases
    ((1, 4, 13, 17), (9, 4, 3, 3), {"strides": [2, 3], "pads": [1, 0, 2, 1]}),  # 2 x 3 phases, uneven
    ((1, 4, 15, 16), (8, 4, 3, 2), {"strides": [3, 2], "pads": [0, 1, 1, 0], "dilations": [2, 3]}),
    ((1, 3, 12, 13), (5, 3, 1, 2), {"strides": [2, 2]}),  # not every phase read
    ((2, 3, 30), (4, 3, 5), {"strides": [3], "pads": [2, 1]}),  # 1-D, strided
    ((2, 5, 8, 8), (13, 5, 1, 1), {}),  # 1x1: whole tiles stored finished, the last panel's 5 rows not
    ((1, 7, 9, 30), (16, 7, 1, 1), {}),  # 1x1: 270 positions, 8 whole tiles and a partial one
    ((2, 3, 64), (9, 3, 1), {}),  # 1x1, 1-D
])
@pytest.mark.parametrize("fused", ["none", "bias", "residual"])
def test_tiles_path_matches_reference(xs, ws, attrs, fused, monkeypatch):
    """Convolutions by the register-tiled GEMM over a padded image's phase planes (strides,
    dilations, asymmetric pads; phases that no tap reads left out): weights of a panel
    and a half, columns of a partial tile and of several blocks (the block budget shrunk to two
    tiles' worth), the padded width's junk columns skipped, each tile finished with its bias,
    residual and activation (in registers where a 1x1 conv's tile is stored straight into the
    output), against the reference."""
    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    monkeypatch.setattr(native, "GEMM_BLOCK_BYTES", 2 * 32 * 4 * 8 * -(-ws[0] // 8))
    monkeypatch.setattr(conv_kernels, "TILES_MIN_K", 1)  # small shapes take it too
    op, attrs, ins, types, out_type = _tiles_instance(xs, ws, attrs, fused)
    geometry = conv_kernels._Conv(attrs, types[0], types[1], out_type)
    assert geometry.path == "tiles"
    requests = polyhal.registry.default_registry().get_device("cpu:0").scratch(op, attrs, types, (out_type,))
    scratch = standalone(None, requests)
    kernel = prepare(op, attrs, types, (out_type,), scratch)
    for _ in range(2):  # again with other images: the kept weights serve, the padding is zeroed again
        for request in requests:  # scratch shared with other kernels holds anything
            scratch.buffer(request.name).view(np.uint8)[:] = 0xFF  # nan
        ins[0] = _f(*xs)
        out = np.full(out_type.shape, np.nan, np.float32)
        kernel(*ins, out)
        (want,) = OPS[op].reference(*ins, **attrs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("xs, ws, attrs", [
    ((1, 5, 13, 11), (13, 5, 3, 3), {"pads": [1, 2, 0, 1]}),  # asymmetric pads; 2 panels, the last partial
    ((1, 4, 10, 37), (9, 4, 3, 2), {"pads": [2, 0, 1, 3], "dilations": [2, 3]}),  # blocks starting mid-row
    ((1, 6, 9, 9), (16, 6, 5, 5), {"pads": [2, 2, 2, 2]}),
    ((1, 5, 13, 11), (16, 5, 3, 1), {"pads": [1, 0, 2, 0]}),  # no junk columns: whole tiles stored in registers
    ((1, 3, 7, 7), (24, 3, 3, 3), {"pads": [1, 1, 1, 1]}),  # two tiles: cut by panels too
    ((1, 3, 29), (9, 3, 3), {"pads": [1, 2], "dilations": [2]}),  # 1-D
    ((1, 2, 1, 1), (3, 2, 3, 3), {"pads": [1, 1, 1, 1]}),  # one output position
])
@pytest.mark.parametrize("fused", ["none", "bias", "residual"])
@pytest.mark.parametrize("n_threads", ["2", "3"])
@pytest.mark.parametrize("per_thread", [1, 4])
@pytest.mark.parametrize("weights_bytes", [1 << 30, 1], ids=["columns", "panels"])
def test_slab_pieces_match_the_whole(xs, ws, attrs, fused, n_threads, per_thread, weights_bytes, monkeypatch,
                                     check_on_poisoned_scratch):
    """A batch-1 stride-1 conv on the compiled queue cut into pieces that each fill their own
    slab of the padded image (blocks of B's columns cut at whole tiles, from the middle of a
    padded row, and of output channels; several column blocks per piece, the block budget
    shrunk), on nan-filled scratch and output, with bias, residual and an activation finished
    per tile: what one piece (one thread) gives, and the reference."""
    from polyhal_cpu import queue_layout as layout

    if not native.available(np.float32) or native.gemm_queue() is None:
        pytest.skip("the compiled queue is not available here")
    monkeypatch.setattr(native, "GEMM_BLOCK_BYTES", 2 * 32 * 4 * 8 * -(-ws[0] // 8))
    monkeypatch.setattr(conv_kernels, "TILES_MIN_K", 1)
    monkeypatch.setattr(parallel, "GEMM_QUEUE_PIECE_US", 1e-9)  # small convs cut too
    monkeypatch.setattr(parallel, "QUEUE_PIECES_PER_THREAD", per_thread)
    monkeypatch.setattr(conv_kernels, "SLAB_WEIGHTS_BYTES", weights_bytes)  # cut by columns or panels first
    op, attrs, ins, types, out_type = _tiles_instance(xs, ws, attrs, fused)
    tables, run_gemms = [], parallel.run_gemms
    monkeypatch.setattr(parallel, "run_gemms", lambda table: (tables.append(table.copy()), run_gemms(table)))
    results = []
    for budget in ("1", n_threads):
        monkeypatch.setenv("POLYHAL_CPU_THREADS", budget)
        threads.reset()
        monkeypatch.setattr(threads, "_budget", None)
        geometry = conv_kernels._Conv(attrs, types[0], types[1], out_type)
        assert geometry.path == "tiles" and geometry.tiles_slabs
        # the pieces: blocks of whole tiles and whole panels, covering the GEMM once
        ncols = geometry.out_sp[0] * geometry.phases.width
        covered = np.zeros((-(-ws[0] // native.GEMM_MR), -(-ncols // native.GEMM_NR)), int)
        for j0, j1, m0, m1, _ in geometry.tiles_slabs:
            assert j0 % native.GEMM_NR == m0 % native.GEMM_MR == 0 and (j1 % native.GEMM_NR == 0 or j1 == ncols)
            covered[m0 // native.GEMM_MR:-(-m1 // native.GEMM_MR), j0 // native.GEMM_NR:-(-j1 // native.GEMM_NR)] += 1
        assert (covered == 1).all()
        parts = 1 if budget == "1" else int(budget) * per_thread
        assert len(geometry.tiles_slabs) <= parts and (len(geometry.tiles_slabs) > 1) == (parts > 1 < covered.size)
        requests = polyhal.registry.default_registry().get_device("cpu:0").scratch(op, attrs, types, (out_type,))
        scratch = standalone(None, requests)
        kernel = prepare(op, attrs, types, (out_type,), scratch)
        # again with another image: every slab filled again, its padding too
        results.append(check_on_poisoned_scratch(kernel, scratch, requests, op, attrs, ins, lambda: _f(*xs), out_type))
        table = tables[-1]
        assert len(table) == len(geometry.tiles_slabs) and (table[:, layout.G_KIND] == layout.KIND_TILES_SLAB).all()
        for fields in ([layout.V_A], [layout.V_B], [layout.V_DH], [layout.V_OUT, layout.V_KW, layout.V_W]):
            assert len({tuple(row) for row in table[:, fields]}) == len(table)  # own scratch, own part
    whole = OPS[op].reference(*ins, **attrs)[0]
    np.testing.assert_allclose(results[1], whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("xs, ws", [((1, 8, 16, 16), (16, 8, 1, 1)), ((1, 7, 9, 23), (20, 7, 1, 1))],
                         ids=["whole-tiles", "partial-tile"])
@pytest.mark.parametrize("fused", ["none", "residual"])
@pytest.mark.parametrize("n_threads", ["1", "2", "3"])
def test_pointwise_pieces_by_columns_read_the_image_in_place(xs, ws, fused, n_threads, monkeypatch):
    """A batch-1 1x1 conv on the compiled queue cut by blocks of the image's columns (see
    POINTWISE_BY_COLUMNS_FROM): KIND_TILES pieces reading their columns where they lie (no slab, no
    columns scratch), each into its own columns of the output, blocks of two tiles at a time;
    the reference on 1, 2 and 3 threads."""
    from polyhal_cpu import queue_layout as layout

    if not native.available(np.float32) or native.gemm_queue() is None:
        pytest.skip("the compiled queue is not available here")
    monkeypatch.setattr(native, "GEMM_BLOCK_BYTES", 2 * 32 * 4 * 8 * -(-ws[0] // 8))
    monkeypatch.setattr(conv_kernels, "TILES_MIN_K", 1)
    monkeypatch.setattr(conv_kernels, "POINTWISE_BY_COLUMNS_FROM", 1)
    monkeypatch.setattr(parallel, "GEMM_QUEUE_PIECE_US", 1e-9)
    monkeypatch.setattr(parallel, "QUEUE_PIECES_PER_THREAD", 1)
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    attrs = {"strides": [1, 1], "pads": [0] * 4, "dilations": [1, 1], "group": 1}
    ins, op = [_f(*xs), _f(*ws)], "conv"
    if fused == "residual":
        ins.append(_f(ws[0]))
        attrs |= {"activation": "relu", "alpha": 0.0, "beta": 0.0}
        op = "fused_conv"
    (out_type,) = OPS[op].infer(tuple(TensorType(a.shape, a.dtype) for a in ins), attrs)
    if fused == "residual":
        ins.append(_f(*out_type.shape))
    types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    g = conv_kernels._Conv(attrs, types[0], types[1], out_type)
    assert g.path == "tiles" and g.phases is None and len(g.tiles_slabs) == int(n_threads) and not g.fills_slabs
    assert g.columns_bytes == 0
    tables, run_gemms = [], parallel.run_gemms
    monkeypatch.setattr(parallel, "run_gemms", lambda table: (tables.append(table.copy()), run_gemms(table)))
    requests = polyhal.registry.default_registry().get_device("cpu:0").scratch(op, attrs, types, (out_type,))
    scratch = standalone(None, requests)
    kernel = prepare(op, attrs, types, (out_type,), scratch)
    for request in requests:
        scratch.buffer(request.name).view(np.uint8)[:] = 0xFF  # nan
    out = np.full(out_type.shape, np.nan, np.float32)
    kernel(*ins, out)
    (want,) = OPS[op].reference(*ins, **attrs)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    table = tables[-1]
    assert (table[:, layout.G_KIND] == layout.KIND_TILES).all() and len({*table[:, layout.V_X]}) == len(table)


def test_conv_columns_are_the_plans_scratch(monkeypatch):
    """The im2col path declares its columns (and, stacking images, the GEMM's product), the
    tiles path its padded image, packed panel of B and tile; a plan binds them (bufferize lists
    them)."""
    monkeypatch.setattr(conv_kernels, "TILES", False)
    b = polyhal.ProgramBuilder("c")
    x = b.input("x", (1, 4, 9, 9))
    b.output(b.conv(x, b.constant(_f(8, 4, 3, 3)), strides=[1, 1], pads=[1, 1, 1, 1], dilations=[1, 1], group=1))
    plan = polyhal.compile(b.build(), "cpu:0")
    assert "columns" in plan.explain()
    req = polyhal.registry.default_registry().get_device("cpu:0").scratch(
        "conv", dict(plan.program.ops[0].attrs), (TensorType((1, 4, 9, 9), np.float32),
                                                  TensorType((8, 4, 3, 3), np.float32)),
        (TensorType((1, 8, 9, 9), np.float32),))
    assert [r.bytes_per_launch for r in req] == [4 * 9 * 81 * 4, 0, 0]
    if native.available(np.float32):  # four images' columns into one GEMM
        req = polyhal.registry.default_registry().get_device("cpu:0").scratch(
            "conv", dict(plan.program.ops[0].attrs), (TensorType((4, 4, 9, 9), np.float32),
                                                      TensorType((8, 4, 3, 3), np.float32)),
            (TensorType((4, 8, 9, 9), np.float32),))
        assert [r.bytes_per_launch for r in req] == [4 * 4 * 9 * 81 * 4, 8 * 4 * 81 * 4, 0]
        monkeypatch.setattr(conv_kernels, "TILES", True)
        monkeypatch.setattr(conv_kernels, "TILES_MIN_K", 1)
        req = polyhal.registry.default_registry().get_device("cpu:0").scratch(
            "conv", dict(plan.program.ops[0].attrs), (TensorType((4, 4, 9, 9), np.float32),
                                                      TensorType((8, 4, 3, 3), np.float32)),
            (TensorType((4, 8, 9, 9), np.float32),))
        plane = 11 * 11 + 2  # the padded image, and the room the last taps read past its corner
        block = 4 * 32  # columns: 9 rows over the padded width of 11 in 4 tiles, in one block
        assert [r.bytes_per_launch for r in req] == [4 * plane * 4, (4 * 9 * 32 + 8 * block) * 4, 0]


@pytest.mark.parametrize("native_loops", ["1", "0"])
@pytest.mark.parametrize("activation", ["none", "relu", "clip", "hard_sigmoid", "hard_swish", "sigmoid", "silu",
                                        "gelu", "gelu_tanh"])
@pytest.mark.parametrize("shapes", [((2, 4, 7, 7), (8, 4, 3, 3), 1), ((1, 6, 7, 7), (6, 1, 3, 3), 6),
                                    ((1, 8, 5, 5), (4, 8, 1, 1), 1)])
def test_fused_conv_kernel(shapes, activation, native_loops, monkeypatch):
    """Every activation on every path, with and without a residual, against the reference
    (the 3x3 one on the shifted path with the compiled loops, through im2col without)."""
    monkeypatch.setenv("POLYHAL_CPU_NATIVE", native_loops)
    monkeypatch.setattr(conv_kernels, "SHIFTED_POSITIONS", 16 if native_loops == "1" else 1 << 30)
    xs, ws, group = shapes
    alpha, beta = {"clip": (-0.5, 0.7), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}.get(activation, (0, 0))
    attrs = {"strides": [1, 1], "pads": [1, 1, 1, 1] if ws[2] == 3 else [0] * 4, "dilations": [1, 1],
             "group": group, "activation": activation, "alpha": alpha, "beta": beta}
    x, w, bias = _f(*xs), _f(*ws), _f(ws[0])
    for ins in ([x, w, bias], [x, w, bias, _f(xs[0], ws[0], *xs[2:])]):
        types = tuple(TensorType(a.shape, a.dtype) for a in ins)
        (out_type,) = OPS["fused_conv"].infer(types, attrs)
        out = np.empty(out_type.shape, np.float32)
        prepare("fused_conv", attrs, types, (out_type,))(*ins, out)
        (want,) = OPS["fused_conv"].reference(*ins, **attrs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5, err_msg=f"{activation} {len(ins)} inputs")


@pytest.mark.parametrize("shapes", [
    ((1, 13, 9, 8), (13, 1, 3, 3), {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1]}),
    # flat rows: a 3-wide kernel row's taps in one pass (dilated, asymmetric pads), and an image
    # so narrow that no pixel is reached by all three
    ((1, 12, 9, 11), (12, 1, 3, 3), {"strides": [1, 1], "pads": [2, 1, 2, 3], "dilations": [2, 2]}),
    ((2, 8, 5, 2), (8, 1, 3, 3), {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1]}),
    ((2, 24, 11, 10), (24, 1, 5, 5), {"strides": [2, 2], "pads": [2, 1, 2, 3], "dilations": [1, 1]}),
    ((1, 16, 12, 12), (16, 1, 3, 3), {"strides": [1, 2], "pads": [0, 1, 2, 0], "dilations": [2, 2]}),
    ((1, 8, 9, 9), (8, 1, 7, 7), {"strides": [1, 1], "pads": [3, 3, 3, 3], "dilations": [1, 1]}),
    ((1, 5, 4, 3), (5, 1, 5, 5), {"strides": [1, 1], "pads": [2, 2, 2, 2], "dilations": [1, 1]}),
    ((1, 96, 11, 13), (96, 1, 3, 3), {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1]}),  # 4 pixels
    ((2, 100, 9, 10), (100, 1, 5, 5), {"strides": [1, 1], "pads": [2, 1, 2, 3], "dilations": [1, 1]}),
    ((1, 96, 10, 14), (96, 1, 7, 7), {"strides": [1, 1], "pads": [3, 3, 3, 3], "dilations": [1, 1]}),
    ((2, 20, 6, 7), (12, 20, 1, 1), {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1]}),
    # squeeze-excite convs over a 1x1 map: fewer pixels than a tile's rows
    ((1, 40, 1, 1), (24, 40, 1, 1), {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1]}),
    ((3, 20, 1, 2), (37, 20, 1, 1), {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1]}),
    # depthwise tiles of 8 pixels x 8 or 16 channels, kernel rows clipped at the top and bottom
    ((1, 24, 9, 40), (24, 1, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 2]}),
    ((2, 32, 7, 30), (32, 1, 5, 5), {"strides": [1, 1], "pads": [2, 2, 2, 2], "dilations": [1, 1]}),
])
@pytest.mark.parametrize("activation", ["none", "relu", "hard_swish", "silu"])
def test_blocked_conv_kernel(shapes, activation):
    """The channel-blocked kernels (depthwise with every kernel width the loop special-cases,
    edges, strides, dilations and asymmetric pads; pointwise with writable weights and with
    read-only ones, whose transpose the kernel keeps) with and without a residual, against the
    reference."""
    xs, ws, geometry = shapes
    group = xs[1] if ws[1] == 1 and ws[0] == xs[1] else 1
    alpha, beta = {"hard_swish": (1 / 6, 0.5)}.get(activation, (0, 0))
    attrs = {**geometry, "group": group, "activation": activation, "alpha": alpha, "beta": beta}
    block = lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)[:, None])  # noqa: E731
    w, bias = _f(*ws), _f(ws[0])
    (plain,) = OPS["conv"].infer((TensorType(xs, np.float32), TensorType(ws, np.float32)), geometry | {"group": group})
    frozen = w.copy()
    frozen.flags.writeable = False  # as a plan's constants: kernels may keep a relayout of them
    x = block(_f(*xs))
    for ins in ([x, w, bias], [x, frozen, bias, block(_f(*plain.shape))]):
        types = tuple(TensorType(a.shape, a.dtype) for a in ins)
        (out_type,) = OPS["cpu.blocked_conv"].infer(types, attrs)
        kernel = prepare("cpu.blocked_conv", attrs, types, (out_type,))
        for _ in range(2):  # the second call with other inputs: nothing of the first is reused wrongly
            ins[0] = block(_f(*xs))
            out = np.empty(out_type.shape, np.float32)
            kernel(*ins, out)
            (want,) = OPS["cpu.blocked_conv"].reference(*ins, **attrs)
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5, err_msg=f"{activation} {len(ins)} inputs")


def _check_blocked_conv(x, w, attrs, atol):
    """``blocked_conv`` of ``x`` by ``w`` (with a bias), without and with a residual, against
    the reference."""
    for residual in (False, True):
        ins = [x, w, _f(w.shape[0])]
        (out_type,) = OPS["cpu.blocked_conv"].infer(tuple(TensorType(a.shape, a.dtype) for a in ins), attrs)
        if residual:
            ins.append(_f(*out_type.shape))
        kernel = prepare("cpu.blocked_conv", attrs, tuple(TensorType(a.shape, a.dtype) for a in ins), (out_type,))
        out = np.full(out_type.shape, np.nan, np.float32)
        kernel(*ins, out)
        (want,) = OPS["cpu.blocked_conv"].reference(*ins, **attrs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=atol, err_msg=f"residual {residual}")


@pytest.mark.parametrize("n_threads", ["1", "2", "3"])
@pytest.mark.parametrize("xs, ws, geometry", [
    ((1, 3, 37, 45), (16, 3, 3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [1, 1]}),  # a stem
    ((2, 3, 21, 30), (32, 3, 3, 3), {"strides": [2, 2], "pads": [0, 1, 1, 0], "dilations": [1, 1]}),
    ((1, 4, 13, 27), (24, 4, 5, 5), {"strides": [1, 1], "pads": [2, 2, 2, 2], "dilations": [1, 2]}),   # 8 lanes
    ((2, 1, 11, 12), (5, 1, 3, 3), {"strides": [1, 2], "pads": [1, 0, 1, 2], "dilations": [1, 1]}),    # no tiles
    ((1, 3, 9, 9), (16, 3, 7, 7), {"strides": [1, 1], "pads": [3, 3, 3, 3], "dilations": [1, 1]}),     # edges only
])
@pytest.mark.parametrize("activation", ["none", "hard_swish", "silu"])
def test_blocked_conv_of_an_image(n_threads, xs, ws, geometry, activation, monkeypatch):
    """A chain's first conv reading its (N, C, H, W) image as it lies into a channels-last map
    (tiles of 8 pixels x 32, 16 or 8 channels, the last tile of a row moved left, edge pixels
    tap by tap, kernel rows clipped at the top and bottom), with and without a residual, cut into
    as many pieces as it may be, against the reference."""
    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    alpha, beta = {"hard_swish": (1 / 6, 0.5)}.get(activation, (0, 0))
    attrs = {**geometry, "group": 1, "activation": activation, "alpha": alpha, "beta": beta}
    w = _f(*ws)
    w.flags.writeable = False
    _check_blocked_conv(_f(*xs), w, attrs, atol=2e-5)


@pytest.mark.parametrize("n_threads", ["1", "2", "3"])
@pytest.mark.parametrize("xs, m", [((1, 96, 14, 14), 128), ((3, 40, 7, 7), 52), ((2, 17, 6, 9), 5)])
@pytest.mark.parametrize("activation", ["none", "relu", "silu"])
def test_pointwise_conv_on_the_gemm_queue(n_threads, xs, m, activation, monkeypatch):
    """A 1x1 conv whose planes leave tiles mostly empty (14x14, 7x7) takes the pointwise path:
    its images' sgemms cut into blocks of output channels on the compiled queue, each starting
    from the bias and ending with the residual and activation, as many pieces as it may be cut
    into; the result is the reference's."""
    if not native.available(np.float32) or parallel.gemm_fn() is None:
        pytest.skip("the compiled GEMM queue is not available here")
    monkeypatch.setattr(parallel, "GEMM_QUEUE_PIECE_US", 0.01)
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    attrs = {"strides": [1, 1], "pads": [0] * 4, "dilations": [1, 1], "group": 1, "activation": activation,
             "alpha": 0.0, "beta": 0.0}
    x, w, bias = _f(*xs), _f(m, xs[1], 1, 1), _f(m)
    w.flags.writeable = False
    for ins in ([x, w, bias], [x, w, bias, _f(xs[0], m, *xs[2:])]):
        types = tuple(TensorType(a.shape, a.dtype) for a in ins)
        assert conv_kernels._Conv(attrs, types[0], types[1], TensorType((xs[0], m) + xs[2:], np.float32)).path \
            == "pointwise"
        (out_type,) = OPS["fused_conv"].infer(types, attrs)
        out = np.full(out_type.shape, np.nan, np.float32)
        prepare("fused_conv", attrs, types, (out_type,))(*ins, out)
        (want,) = OPS["fused_conv"].reference(*ins, **attrs)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5, err_msg=f"{activation} {len(ins)} inputs")


@pytest.mark.parametrize("xs, m", [((1, 24, 5, 7), 200), ((2, 40, 4, 4), 64), ((1, 3, 3, 3), 32),
                                   # tiles of 16 channels: whole ones, and a last partial one (40 = 2 x 16 + 8)
                                   ((1, 24, 5, 7), 16), ((2, 13, 3, 5), 80), ((1, 9, 7, 7), 40), ((1, 17, 4, 3), 112)])
@pytest.mark.parametrize("activation", ["none", "relu", "silu"])
def test_blocked_pointwise_tiles(xs, m, activation, monkeypatch):
    """Channel-blocked 1x1 convs by the micro-kernel: output channels of whole tiles and of a
    last partial one (200 = 6 x 32 + 8; tiles of 32 channels or 16), pixels of whole tiles and of a last partial one
    (35 = 4 x 8 + 3, 9 = 8 + 1), several blocks of pixels (the block budget shrunk to one tile's
    rows), with and without a residual, against the reference."""
    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    monkeypatch.setattr(native, "GEMM_ROWS_BLOCK_BYTES", 8 * (xs[1] + m) * 4)
    attrs = {"strides": [1, 1], "pads": [0, 0, 0, 0], "dilations": [1, 1], "group": 1, "activation": activation,
             "alpha": 0.0, "beta": 0.0}
    block = lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)[:, None])  # noqa: E731
    w = _f(m, xs[1], 1, 1)
    w.flags.writeable = False
    x_t, w_t = TensorType((xs[0], 1, *xs[2:], xs[1]), np.float32), TensorType(w.shape, np.float32)
    assert conv_kernels._pointwise_tiles(attrs, x_t, w_t) is not None
    _check_blocked_conv(block(_f(*xs)), w, attrs, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 1, 37, 29, 24), (3, 1, 5, 7, 13), (2, 1, 1, 1, 960)])
def test_global_average_pool_of_a_blocked_map(shape):
    """reduce_mean over the pixels of channel-blocked storage (a squeeze-excite block's pool),
    as a matrix-vector product per image, against numpy's mean in float64."""
    x = _f(*shape)
    attrs = {"axes": [2, 3], "keepdims": True}
    (out_type,) = OPS["reduce_mean"].infer((TensorType(shape, np.float32),), attrs)
    out = np.full(out_type.shape, np.nan, np.float32)
    prepare("reduce_mean", attrs, (TensorType(shape, np.float32),), (out_type,))(x, out)
    np.testing.assert_allclose(out, x.astype(np.float64).mean(axis=(2, 3), keepdims=True), rtol=1e-5, atol=1e-6)


def test_native_loops_serve_float32():
    assert native.available(np.float32) in (True, False)  # no numba: the numpy paths ran above


@pytest.mark.parametrize("attrs", [
    {"strides": [2, 1], "pads": [1, 0, 0, 1], "dilations": [1, 2], "output_padding": [1, 0]},
    {"strides": [2, 2], "group": 2},
    {"strides": [3, 1], "pads": [1, 2, 0, 0]},
])
def test_conv_transpose_matches_onnxruntime(attrs, tmp_path):
    group = attrs.get("group", 1)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)
    _against_onnxruntime(node, {"x": _f(2, 4, 5, 6)}, {"w": _f(4, 3, 3, 3), "b": _f(3 * group)}, tmp_path)


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [0, 1, 1, 0], "ceil_mode": 1},
    {"kernel_shape": [2, 2], "dilations": [2, 1]},
    {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1},
])
@pytest.mark.parametrize("shape", [(2, 3, 9, 8), (3, 4, 37, 45)])
def test_pools_match_onnxruntime(op, attrs, shape, tmp_path):
    if op == "AveragePool" and "dilations" in attrs:
        attrs = {k: v for k, v in attrs.items() if k != "dilations"}  # onnxruntime's AveragePool has none
    if op == "MaxPool" and "count_include_pad" in attrs:
        attrs = {k: v for k, v in attrs.items() if k != "count_include_pad"}
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    _against_onnxruntime(node, {"x": _f(*shape)}, {}, tmp_path)


@pytest.mark.parametrize("strides", [[1, 1], [2, 2]])
def test_max_pool_keeps_nan(strides):
    """A window holding a nan pools to nan wherever the nan lies in it (the compiled row loop
    compares whole rows at once); -inf inputs are ordinary values."""
    x = _f(1, 2, 8, 9)
    x[0, 0, 3, 4], x[0, 1, 0, 0], x[0, 1, 5] = np.nan, np.nan, -np.inf
    attrs = {"kernel_shape": [3, 3], "strides": strides, "pads": [1, 1, 1, 1], "dilations": [1, 1],
             "ceil_mode": 0}
    (out_type,) = OPS["max_pool"].infer((TensorType(x.shape, x.dtype),), attrs)
    out = np.empty(out_type.shape, np.float32)
    prepare("max_pool", attrs, (TensorType(x.shape, x.dtype),), (out_type,))(x, out)
    (want,) = OPS["max_pool"].reference(x, **attrs)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    assert np.isnan(out).any()
    np.testing.assert_allclose(out[~np.isnan(out)], want[~np.isnan(want)])


POOL_CASES = [  # the 3x3 stride-2 max and 2x2 stride-2 max and average loops of their own, and the general one
    ("max_pool", (2, 5, 9, 11), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 0}),
    ("max_pool", (1, 5, 9, 11), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("max_pool", (2, 3, 13, 11), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 0}),
    ("max_pool", (1, 4, 12, 13), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1}),
    ("max_pool", (1, 4, 10, 13), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 0, 0], "ceil_mode": 1}),
    ("max_pool", (1, 3, 9, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 1, 1, 0], "ceil_mode": 0}),
    ("max_pool", (1, 3, 2, 3), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 0}),
    ("max_pool", (1, 5, 11, 12), {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [2, 2], "ceil_mode": 1}),
    ("avg_pool", (2, 5, 9, 11), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 0, "count_include_pad": 0}),
    ("avg_pool", (1, 5, 9, 11), {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1, "count_include_pad": 0}),
    ("avg_pool", (1, 4, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 0, 0], "ceil_mode": 0,
                                "count_include_pad": 1}),
    ("avg_pool", (1, 3, 7, 9), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "ceil_mode": 0,
                                "count_include_pad": 1}),
    ("avg_pool", (1, 3, 13, 10), {"kernel_shape": [3, 2], "strides": [2, 3], "dilations": [2, 1], "ceil_mode": 0,
                                  "count_include_pad": 0}),
]


@pytest.mark.parametrize("n_threads", ["1", "2", "3"])
@pytest.mark.parametrize("op, shape, attrs", POOL_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(POOL_CASES)])
def test_pools_on_the_queue_and_off_it(monkeypatch, n_threads, op, shape, attrs):
    """A compiled 2-D pool cut into as many blocks of planes as it may be gives the reference
    (nan windows pool to nan), on the compiled queue and, with the queue off, handed out by
    parallel.run, the same values either way."""
    if not native.available(np.float32):
        pytest.skip("the compiled loops are not available here")
    monkeypatch.setattr(parallel, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(parallel, "GEMM_QUEUE_PIECE_US", 1e-9)
    monkeypatch.setenv("POLYHAL_CPU_THREADS", n_threads)
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    attrs = {"pads": [0, 0, 0, 0], "dilations": [1, 1]} | attrs
    x = _f(*shape)
    if op == "max_pool":
        x.reshape(-1)[::17] = np.nan
    types = (TensorType(x.shape, x.dtype),)
    (out_type,) = OPS[op].infer(types, attrs)
    (want,) = OPS[op].reference(x, **attrs)
    outs, tables, run_gemms, on = [], [], parallel.run_gemms, native.gemm_queue() is not None
    monkeypatch.setattr(parallel, "run_gemms", lambda table: (tables.append(table.copy()), run_gemms(table)))
    for queued in (True, False):
        if not queued:
            monkeypatch.setattr(native, "gemm_queue", lambda: None)
        out = np.full(out_type.shape, 7.0, np.float32)
        prepare(op, attrs, types, (out_type,))(x, out)
        outs.append(out)
    if on:  # one run on the queue: a piece a thread (a plane each at most)
        from polyhal_cpu import queue_layout as layout

        assert len(tables) == 1 and (tables[0][:, layout.G_KIND] == layout.KIND_POOL).all()
        assert len(tables[0]) == min(int(n_threads), shape[0] * shape[1])
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(np.isnan(outs[0]), np.isnan(want))
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-6)


def test_global_average_pool_matches_onnxruntime(tmp_path):
    _against_onnxruntime(helper.make_node("GlobalAveragePool", ["x"], ["y"]), {"x": _f(2, 5, 7, 7)}, {}, tmp_path)


@pytest.mark.parametrize("op", ["conv", "fused_conv", "conv_transpose", "max_pool"])
def test_zero_size_batch(op):
    attrs = {"strides": [1, 1], "pads": [1, 1, 1, 1], "dilations": [1, 1], "group": 1}
    ins = [np.zeros((0, 4, 6, 6), np.float32), _f(4, 4, 3, 3), _f(4)]
    if op == "fused_conv":
        attrs["activation"] = "relu"
    if op == "conv_transpose":
        attrs["output_padding"] = [0, 0]
    if op == "max_pool":
        attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
        ins = ins[:1]
    b = polyhal.ProgramBuilder("z")
    x = b.input("x", ins[0].shape)
    b.output(b.op(op, x, *[b.constant(a) for a in ins[1:]], **attrs))
    (y,) = polyhal.compile(b.build(), "cpu:0").run_numpy(ins[0])
    assert y.shape[0] == 0 and y.shape[1] == 4


@pytest.mark.parametrize("ws, attrs, error, words", [
    ((8, 3, 3, 3), {"group": 2}, ShapeError, "group=2"),                    # groups do not divide C
    ((8, 4, 9, 9), {}, ShapeError, "padded input"),                         # kernel larger than input
    ((8, 4, 3, 3), {"pads": [1, 1]}, polyhal.onnx.OnnxModelError, "pads"),  # pads of the wrong length
])
def test_bad_conv_attributes_name_the_node(ws, attrs, error, words, tmp_path):
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="the_conv", **attrs)
    model = _model(node, {"x": _f(1, 4, 6, 6)}, {"w": _f(*ws)})
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    with pytest.raises(error) as info:
        polyhal.onnx.load(path, validate=False)
    assert "node the_conv (Conv)" in str(info.value) and words in str(info.value)


def test_bad_conv_attributes_in_a_builder():
    b = polyhal.ProgramBuilder("bad")
    x = b.input("x", (1, 4, 6, 6))
    with pytest.raises(ShapeError, match="conv: .*group=3"):
        b.conv(x, b.constant(_f(6, 2, 3, 3)), strides=[1, 1], pads=[0] * 4, dilations=[1, 1], group=3)
    with pytest.raises(ProgramError, match="conv: attribute 'pads' needs 4 entries"):
        b.conv(x, b.constant(_f(6, 4, 3, 3)), strides=[1, 1], pads=[1, 1], dilations=[1, 1], group=1)
    with pytest.raises(ShapeError, match="fused_conv: the residual"):
        b.fused_conv(x, b.constant(_f(6, 4, 3, 3)), b.constant(_f(6)), b.input("r", (1, 6, 6, 6)),
                     strides=[1, 1], pads=[0] * 4, dilations=[1, 1], group=1)
