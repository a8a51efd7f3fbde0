"""conv and fused_conv through cuDNN (polyhal_cuda.cudnn) against float64 references: groups,
depthwise, stride / dilation / asymmetric pads, 1-d and 3-d, every epilogue activation with and
without a residual; the fallback when cuDNN is off; what the plugin advertises (GPU for most).
Then the backend's own conv (im2col into declared scratch + cuBLAS, used without cuDNN) and its
pooling kernels (``cu/window.cu``): every conv case, chunked columns, float16/64, a plan that
replays as a CUDA graph with cuDNN off, and the pools per element type."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, resolve_attrs

from polyhal_cuda import cudnn, nn, plugin
from polyhal_cuda.kernels import KERNEL_NAMES

# (x shape, w shape, attrs): the shapes the CNNs of the suite have, and the corners.
CASES = {
    "3x3": ((2, 8, 12, 12), (16, 8, 3, 3), dict(pads=[1, 1, 1, 1])),
    "1x1": ((2, 16, 7, 7), (8, 16, 1, 1), dict()),
    "stride2_asym_pads": ((1, 4, 11, 9), (6, 4, 3, 3), dict(strides=[2, 2], pads=[0, 1, 2, 1])),
    "dilation2": ((1, 4, 13, 13), (4, 4, 3, 3), dict(dilations=[2, 2], pads=[2, 2, 2, 2])),
    "groups2": ((2, 8, 9, 9), (6, 4, 3, 3), dict(group=2, pads=[1, 1, 1, 1])),
    "depthwise": ((2, 12, 10, 10), (12, 1, 5, 5), dict(group=12, pads=[2, 2, 2, 2], strides=[2, 2])),
    "depthwise_dilated_asym": ((1, 6, 9, 11), (6, 1, 3, 3), dict(group=6, pads=[1, 0, 2, 1], dilations=[2, 1])),
    "nonsquare_kernel": ((1, 3, 8, 10), (5, 3, 2, 4), dict(pads=[0, 1, 1, 2])),
    "conv1d": ((2, 4, 20), (6, 4, 5), dict(pads=[2, 1], strides=[2])),
    "conv3d": ((1, 3, 6, 7, 5), (4, 3, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1])),
}
ACTS = {"none": (0.0, 0.0), "relu": (0.0, 0.0), "clip": (-0.5, 1.5), "sigmoid": (0.0, 0.0), "silu": (0.0, 0.0),
        "gelu": (0.0, 0.0), "gelu_tanh": (0.0, 0.0), "hard_sigmoid": (0.2, 0.5), "hard_swish": (1 / 6, 0.5)}


def _attrs(x, w, extra):
    n = len(x) - 2
    return {"strides": [1] * n, "pads": [0] * 2 * n, "dilations": [1] * n, "group": 1, **extra}


def _run(cuda, op, inputs, attrs):
    import cupy as cp

    in_types = tuple(TensorType(a.shape, a.dtype) for a in inputs)
    out_types = OPS[op].infer(in_types, attrs)
    fn = cuda.prepare(op, attrs, in_types, out_types)
    with cuda.activate():
        dev = [cp.asarray(a) for a in inputs]
        out = cp.full(out_types[0].shape, np.nan, out_types[0].dtype)
    fn(*dev, out)
    cuda.synchronize()
    return cp.asnumpy(out), getattr(getattr(fn, "inner", fn), "kernel_name", "")  # the device wraps kernels


def _reference(op, inputs, attrs):
    return OPS[op].reference(*[a.astype(np.float64) for a in inputs], **attrs)[0]


def _rel_error(got, want):
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("bias", [False, True])
def test_conv_against_float64(cuda, rng, case, bias):
    xs, ws, extra = CASES[case]
    attrs = _attrs(xs, ws, extra)
    inputs = [rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)]
    if bias:
        inputs.append(rng.standard_normal(ws[0], dtype=np.float32))
    got, name = _run(cuda, "conv", inputs, attrs)
    want = _reference("conv", inputs, attrs)
    # fp32 means fp32: TF32 would be ~1e-3 here (10 mantissa bits)
    assert _rel_error(got, want) < 2e-6, (case, name, _rel_error(got, want), rng.seed_value)
    if case.startswith("depthwise"):
        assert name.startswith("depthwise conv"), name  # the backend's own kernel, cuDNN or not
    elif cudnn.usable():
        assert name.startswith("cuDNN conv"), name


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("case", ["3x3", "depthwise", "depthwise_dilated_asym", "stride2_asym_pads"])
def test_fused_conv_against_float64(cuda, rng, act, residual, case):
    xs, ws, extra = CASES[case]
    alpha, beta = ACTS[act]
    attrs = {**_attrs(xs, ws, extra), "activation": act, "alpha": alpha, "beta": beta}
    inputs = [rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32),
              rng.standard_normal(ws[0], dtype=np.float32)]
    if residual:
        (out,) = OPS["conv"].infer(tuple(TensorType(a.shape, a.dtype) for a in inputs[:2]), _attrs(xs, ws, extra))
        inputs.append(rng.standard_normal(out.shape, dtype=np.float32))
    got, name = _run(cuda, "fused_conv", inputs, attrs)
    want = _reference("fused_conv", inputs, attrs)
    assert np.isfinite(got).all(), name
    assert _rel_error(got, want) < 5e-6, (act, residual, case, name, _rel_error(got, want), rng.seed_value)
    if case.startswith("depthwise"):
        assert name.startswith("depthwise conv") and "+bias" in name, name
    elif cudnn.usable():
        assert name.startswith("cuDNN conv+bias"), name


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_float_types(cuda, rng, dtype):
    xs, ws, extra = CASES["3x3"]
    attrs = {**_attrs(xs, ws, extra), "activation": "relu", "alpha": 0.0, "beta": 0.0}
    inputs = [rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype),
              rng.standard_normal(ws[0]).astype(dtype)]
    got, name = _run(cuda, "fused_conv", inputs, attrs)
    want = _reference("fused_conv", inputs, attrs)
    tol = 2e-3 if dtype == np.float16 else 1e-12
    assert _rel_error(got.astype(np.float64), want) < tol, (dtype, name, _rel_error(got.astype(np.float64), want))


def test_cudnn_off_falls_back_to_im2col(cuda, rng, monkeypatch):
    monkeypatch.setenv("POLYHAL_CUDA_CUDNN", "0")
    assert cudnn.status() == (None, "POLYHAL_CUDA_CUDNN=0 turned cuDNN off")
    xs, ws, extra = CASES["groups2"]
    attrs = {**_attrs(xs, ws, extra), "activation": "hard_swish", "alpha": 1 / 6, "beta": 0.5}
    inputs = [rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32),
              rng.standard_normal(ws[0], dtype=np.float32)]
    (out,) = OPS["conv"].infer(tuple(TensorType(a.shape, a.dtype) for a in inputs[:2]), _attrs(xs, ws, extra))
    inputs.append(rng.standard_normal(out.shape, dtype=np.float32))
    got, name = _run(cuda, "fused_conv", inputs, attrs)
    assert name.startswith("fused_conv (im2col"), name
    assert _rel_error(got, _reference("fused_conv", inputs, attrs)) < 5e-6


def test_plugin_advertises_fused_conv_only_with_cudnn():
    on_limits, on_names = plugin.conv_path(("cudnn 9.19.0", ""))
    off_limits, off_names = plugin.conv_path((None, "nvidia-cudnn-frontend is not installed"))
    assert "fused_conv" in on_names and "fused_conv" not in off_names
    assert on_names - off_names == {"fused_conv"} and "conv" in off_names
    assert on_limits["conv"].startswith("cudnn 9.19.0")
    assert off_limits["conv"] == "im2col + cuBLAS fallback: nvidia-cudnn-frontend is not installed"
    assert "fused_conv" in KERNEL_NAMES  # the table runs it either way (im2col + epilogue without cuDNN)


def test_devices_say_how_convs_run(cuda):
    version, why = cudnn.status()
    assert cuda.spec.limits["conv"] == plugin.conv_path((version, why))[0]["conv"]
    assert ("fused_conv" in polyhal.default_registry().kernel_names(cuda.spec.name)) == (version is not None)
    assert ("cudnn" in cuda.spec.capabilities) == (version is not None)


def test_compiled_resnet_block(cuda, rng, tmp_path):
    """Conv + BatchNormalization + Add + Relu from ONNX: one fused_conv on cuda with cuDNN (conv,
    add, relu without), the plan's result (replayed) equal to the float64 reference."""
    onnx = pytest.importorskip("onnx")
    import polyhal.onnx
    from onnx import TensorProto, helper, numpy_helper

    x = rng.standard_normal((2, 8, 14, 14), dtype=np.float32)
    w = (rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32)
    scale, shift = (1 + 0.1 * rng.standard_normal(8)).astype(np.float32), (0.1 * rng.standard_normal(8)).astype(np.float32)
    mean, var = (0.1 * rng.standard_normal(8)).astype(np.float32), (1 + 0.1 * np.abs(rng.standard_normal(8))).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (scale, "s"), (shift, "t"), (mean, "m"), (var, "v"))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "s", "t", "m", "v"], ["bn"]),
             helper.make_node("Add", ["bn", "x"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, x.shape)], inits)
    path = tmp_path / "block.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    program = polyhal.onnx.load(path)
    plan = program.compile(cuda.spec.name)
    ops = [op.name for op in plan.program.ops if op.kind == "dispatch"]
    assert ops == (["fused_conv"] if cudnn.usable() else ["conv", "add", "relu"]), ops
    x64 = x.astype(np.float64)
    conv = OPS["conv"].reference(x64, w.astype(np.float64), pads=[1, 1, 1, 1])[0]
    a = (scale / np.sqrt(var.astype(np.float64) + 1e-5))[:, None, None]
    want = np.maximum(conv * a + (shift - mean * a[:, 0, 0])[:, None, None] + x64, 0)
    for _ in range(3):  # the first run records the CUDA graph, later ones replay it
        (got,) = program.execute(plan, {"x": x}).values()
        assert _rel_error(np.asarray(got), want) < 5e-6


# ------------------------------------------------- the backend's own conv and pools (no cuDNN)

@pytest.fixture
def no_cudnn(monkeypatch):
    monkeypatch.setenv("POLYHAL_CUDA_CUDNN", "0")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("budget", [None, 1])
def test_im2col_conv_against_float64(cuda, rng, no_cudnn, monkeypatch, case, budget):
    if budget is not None:  # one image's columns at a time: the chunked path, with a tail chunk
        monkeypatch.setattr(nn, "COLUMNS_BUDGET", budget)
    xs, ws, extra = CASES[case]
    xs = (3,) + xs[1:]  # three images: chunks of 1 leave no tail; the default holds all three
    attrs = _attrs(xs, ws, extra)
    inputs = [rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32),
              rng.standard_normal(ws[0], dtype=np.float32)]
    got, name = _run(cuda, "conv", inputs, attrs)
    assert name.startswith("depthwise conv" if case.startswith("depthwise") else "conv (im2col into scratch"), name
    assert _rel_error(got, _reference("conv", inputs, attrs)) < 2e-6, (case, _rel_error(got, _reference("conv", inputs, attrs)))


def test_im2col_conv_tail_chunk(cuda, rng, no_cudnn, monkeypatch):
    xs, ws, extra = CASES["3x3"]
    xs = (5,) + xs[1:]
    per_image = xs[1] * 9 * 12 * 12 * 4
    monkeypatch.setattr(nn, "COLUMNS_BUDGET", 2 * per_image)  # chunks of 2, 2, 1
    assert nn.ConvShape(_attrs(xs, ws, extra), (TensorType(xs, np.float32), TensorType(ws, np.float32)),
                        (TensorType((5, 16, 12, 12), np.float32),)).chunk == 2
    inputs = [rng.standard_normal(xs, dtype=np.float32), rng.standard_normal(ws, dtype=np.float32)]
    got, _ = _run(cuda, "conv", inputs, _attrs(xs, ws, extra))
    assert _rel_error(got, _reference("conv", inputs, _attrs(xs, ws, extra))) < 2e-6


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_im2col_conv_other_float_types(cuda, rng, no_cudnn, dtype):
    xs, ws, extra = CASES["groups2"]
    attrs = _attrs(xs, ws, extra)
    inputs = [rng.standard_normal(xs).astype(dtype), rng.standard_normal(ws).astype(dtype)]
    got, name = _run(cuda, "conv", inputs, attrs)
    assert name.startswith("conv (im2col into scratch"), name
    tol = 2e-3 if dtype == np.float16 else 1e-12
    assert _rel_error(got.astype(np.float64), _reference("conv", inputs, attrs)) < tol


def test_cnn_plan_without_cudnn_replays_as_a_graph(cuda, rng, no_cudnn):
    """conv -> relu -> max_pool -> conv -> avg_pool: the columns are plan scratch, nothing
    allocates in a step, so the plan is captured and replayed."""
    b = polyhal.ProgramBuilder("cnn")
    x = b.input("x", (2, 4, 16, 16))
    w1, w2 = b.input("w1", (8, 4, 3, 3)), b.input("w2", (8, 2, 3, 3))
    c1 = b.op("conv", x, w1, pads=[1, 1, 1, 1])
    p1 = b.op("max_pool", b.relu(c1), kernel_shape=[2, 2], strides=[2, 2])
    c2 = b.op("conv", p1, w2, pads=[1, 1, 1, 1], group=4)
    b.output(b.op("avg_pool", c2, kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    plan = polyhal.compile(b.build(), cuda.name)
    for _ in range(4):
        xs = rng.standard_normal((2, 4, 16, 16), dtype=np.float32)
        a, c = rng.standard_normal((8, 4, 3, 3), dtype=np.float32), rng.standard_normal((8, 2, 3, 3), dtype=np.float32)
        want = xs.astype(np.float64)
        want = OPS["conv"].reference(want, a.astype(np.float64), **_attrs(want.shape, a.shape, dict(pads=[1, 1, 1, 1])))[0]
        want = OPS["max_pool"].reference(np.maximum(want, 0), **resolve_attrs("max_pool", dict(kernel_shape=[2, 2], strides=[2, 2])))[0]
        want = OPS["conv"].reference(want, c.astype(np.float64), **_attrs(want.shape, c.shape, dict(pads=[1, 1, 1, 1], group=4)))[0]
        want = OPS["avg_pool"].reference(want, **resolve_attrs("avg_pool", dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])))[0]
        got = plan(xs, a, c)
        assert _rel_error(got.numpy(), want) < 5e-6
    assert plan.replay.mode == "graph", plan.replay.reason


def _run_pool(cuda, op, x, attrs):
    import cupy as cp

    (out_t,) = OPS[op].infer((TensorType(x.shape, x.dtype),), attrs)
    fn = cuda.prepare(op, attrs, (TensorType(x.shape, x.dtype),), (out_t,))
    with cuda.activate():
        dx, out = cp.asarray(x), cp.zeros(out_t.shape, out_t.dtype)
    fn(dx, out)
    cuda.synchronize()
    return cp.asnumpy(out), getattr(getattr(fn, "inner", fn), "kernel_name", "")


POOLS = {
    "max_2x2_s2": ("max_pool", (2, 3, 9, 8), dict(kernel_shape=[2, 2], strides=[2, 2])),
    "max_3x3_pads_dil": ("max_pool", (1, 2, 10, 10), dict(kernel_shape=[3, 3], pads=[1, 2, 2, 1], dilations=[2, 1])),
    "avg_3x3_pads": ("avg_pool", (2, 3, 9, 9), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "avg_count_pad": ("avg_pool", (2, 3, 9, 9), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)),
    "avg_1d": ("avg_pool", (2, 3, 17), dict(kernel_shape=[4], strides=[3], pads=[1, 2])),
    "lp_p3": ("lp_pool", (1, 2, 8, 8), dict(kernel_shape=[3, 3], p=3)),
    "max_3d": ("max_pool", (1, 2, 5, 6, 7), dict(kernel_shape=[2, 3, 2], strides=[1, 2, 2])),
}


@pytest.mark.parametrize("case", sorted(POOLS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint8, np.float16])
def test_pools_against_reference(cuda, rng, case, dtype):
    op, shape, attrs = POOLS[case]
    if dtype in (np.int8, np.uint8) and op != "max_pool":
        pytest.skip("only MaxPool takes 8-bit integers")
    x = (rng.standard_normal(shape) * 50).astype(dtype) if np.dtype(dtype).kind != "f" else rng.standard_normal(shape).astype(dtype)
    if np.dtype(dtype).kind == "f" and op == "max_pool":
        x.flat[3] = np.nan  # nan propagates through a max
    attrs = resolve_attrs(op, attrs)
    got, name = _run_pool(cuda, op, x, attrs)
    want = OPS[op].reference(x.astype(np.float64) if op != "max_pool" else x, **attrs)[0]
    if dtype in (np.float32, np.float64, np.int8, np.uint8) and (op == "max_pool" or np.dtype(dtype).kind == "f"):
        assert "pool<" in name, name
    tol = 2e-3 if dtype == np.float16 else 1e-6
    np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol)


def test_the_fastest_plan_is_timed_and_chosen(cuda, monkeypatch):
    """cuDNN's candidates are timed at compile time (the chosen one stays fp32-exact: the tests
    above check the error); POLYHAL_CUDA_CUDNN_AUTOTUNE=0 keeps the heuristics' first plan."""
    if not cudnn.usable():
        pytest.skip("cuDNN is not usable here")
    xs, ws, extra = (1, 32, 28, 28), (32, 32, 3, 3), dict(pads=[1, 1, 1, 1])
    attrs = resolve_attrs("conv", _attrs(xs, ws, extra))
    ins = (TensorType(xs, np.float32), TensorType(ws, np.float32))
    outs = OPS["conv"].infer(ins, attrs)
    graph, _, _ = cudnn.plan(cuda, "conv", attrs, ins, outs)
    # (a 3x3 float32 conv has several fp32-exact engines: more than one is timed)
    assert graph is not None and len(graph.timings) >= 2 and all(ms > 0 for ms in graph.timings.values())
    monkeypatch.setenv("POLYHAL_CUDA_CUDNN_AUTOTUNE", "0")
    with cuda.activate():
        untuned = cudnn.CuDNNConv(cudnn._state(cuda), cudnn.Conv.of(attrs, ins, outs), False, False, "none", 0.0, 0.0)
    assert untuned.timings == {}
    assert not any(why.startswith("wrong result") for why in untuned.rejected.values())  # checked, not timed


def test_a_plan_beyond_the_memory_limit_names_its_arena_and_balances(cuda, rng, tmp_path):
    """Workspace and intermediates that do not fit: an OutOfMemoryError naming the plan and what
    its arena holds (a cuDNN workspace says so), nothing of the failed plan left allocated, and
    the same program compiles and runs once the memory is there."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    import polyhal.onnx
    from polyhal.hal.adaptors import LimitingAdaptor, set_device_allocator

    w1 = rng.standard_normal((32, 32, 3, 3), dtype=np.float32) * 0.1
    w2 = rng.standard_normal((32, 32, 3, 3), dtype=np.float32) * 0.1
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv_a"),
         helper.make_node("Relu", ["c1"], ["r"]),
         helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1], name="conv_b")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32, 56, 56])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32, 56, 56])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    path = tmp_path / "convs.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    program = polyhal.onnx.load(str(path))
    limit = LimitingAdaptor(cuda.allocator, limit=w1.nbytes + w2.nbytes + (64 << 10))  # weights fit, 3 MB of activations do not
    previous = set_device_allocator(cuda, limit)
    try:
        with pytest.raises(polyhal.OutOfMemoryError) as exc:
            program.compile(cuda.spec.name)
        msg = str(exc.value)
        assert "could not allocate its" in msg and "arena" in msg and cuda.spec.name in msg, msg
        assert "%c1" in msg or "%r" in msg or "workspace" in msg or "columns" in msg, msg
        del exc
        import gc
        gc.collect()
        assert limit.used_bytes == 0, limit.statistics
    finally:
        set_device_allocator(cuda, previous)
    plan = program.compile(cuda.spec.name)
    x = rng.standard_normal((8, 32, 56, 56), dtype=np.float32)
    want = OPS["conv"].reference(np.maximum(OPS["conv"].reference(
        x.astype(np.float64), w1.astype(np.float64), **_attrs(x.shape, w1.shape, dict(pads=[1, 1, 1, 1])))[0], 0),
        w2.astype(np.float64), **_attrs(x.shape, w2.shape, dict(pads=[1, 1, 1, 1])))[0]
    (got,) = program.execute(plan, {"x": x}).values()
    assert _rel_error(np.asarray(got), want) < 1e-5


# ------------------------------------------------------------ plans checked against a reference

@pytest.mark.parametrize("case", ["3x3", "groups2", "stride2_asym_pads", "dilation2", "conv3d"])
def test_sampled_mismatch_accepts_right_and_names_wrong_results(rng, case):
    """The check every chosen cuDNN plan passes (no GPU needed): a correct fused result passes,
    one wrong output among the samples, or a NaN, is named with its index."""
    xs, ws, extra = CASES[case]
    attrs = {**_attrs(xs, ws, extra), "activation": "silu", "alpha": 0.0, "beta": 0.0}
    x, w, b = (rng.standard_normal(s) for s in (xs, ws, (ws[0],)))
    (out,) = OPS["conv"].infer((TensorType(xs, np.float64), TensorType(ws, np.float64)), _attrs(xs, ws, extra))
    r = rng.standard_normal(out.shape)
    y = _reference("fused_conv", [x, w, b, r], attrs)
    conv = cudnn.Conv.of(attrs, (TensorType(xs, np.float64), TensorType(ws, np.float64)), (out,))
    if len(xs) == 3:
        pytest.skip("1-d convs are checked as 2-d ones of height 1")
    bias = b.reshape((1, -1) + (1,) * (len(xs) - 2))
    assert cudnn.sampled_mismatch(conv, x, w, bias, r, y, "silu", 0.0, 0.0, 1e-12) is None
    assert cudnn.sampled_mismatch(conv, x, w, bias, r, y, "none", 0.0, 0.0, 1e-12) is not None  # silu missing
    wrong = y.copy()
    wrong.reshape(-1)[-1] += 1.0  # the last output is always sampled
    why = cudnn.sampled_mismatch(conv, x, w, bias, r, wrong, "silu", 0.0, 0.0, 1e-12)
    assert why is not None and f"y{[d - 1 for d in wrong.shape]}" in why, why
    wrong = y.copy()
    wrong.reshape(-1)[0] = np.nan
    assert "1 of" in cudnn.sampled_mismatch(conv, x, w, bias, r, wrong, "silu", 0.0, 0.0, 1e-12)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("act, squeeze", [("silu", (1152, 48)), ("sigmoid", (48, 1152)), ("relu", (960, 240))])
def test_float16_squeeze_excitation_convs(cuda, rng, batch, act, squeeze):
    """Regression: the 1x1 convs of a squeeze-excitation block on 1x1 maps, float16 NCHW (what
    EfficientNet-B0's and MobileNetV3's SE blocks compile to under precision="fp16"). On an H200
    (cuDNN 9.19) the batch-16 graphs returned sigmoid outputs in the thousands -- the model's
    output became NaN; every chosen plan is now checked against a float64 reference."""
    c, m = squeeze
    xs, ws = (batch, c, 1, 1), (m, c, 1, 1)
    attrs = {**_attrs(xs, ws, {}), "activation": act, "alpha": 0.0, "beta": 0.0}
    inputs = [rng.standard_normal(xs).astype(np.float16), (rng.standard_normal(ws) / np.sqrt(c)).astype(np.float16),
              rng.standard_normal(m).astype(np.float16)]
    got, name = _run(cuda, "fused_conv", inputs, attrs)
    want = _reference("fused_conv", inputs, attrs)
    assert np.isfinite(got).all(), name
    assert _rel_error(got.astype(np.float64), want) < 4e-3, (name, _rel_error(got.astype(np.float64), want))
