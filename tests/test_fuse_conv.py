"""polyhal.passes.fuse_conv: BatchNormalization folded into constant conv weights, and conv
epilogues (residual add, activation as the ONNX front end emits them) fused into fused_conv
where the chosen device has its kernel -- results checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
import polyhal.onnx
from polyhal.passes.fuse_conv import fold_conv_affine, fuse_conv_epilogue, fuse_scale_shift
from polyhal.passes.fusion import always
from polyhal_cpu.fusions import fuse_conv_prologue

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


@pytest.fixture(autouse=True)
def _cpu_own_kernels(monkeypatch):
    """These check the fusions as the CPU's own kernels see them: with oneDNN (polyhal_cpu.onednn)
    the CPU claims no conv prologue and keeps chains of ordinary convs channels-last, which
    plugins/cpu/tests/test_cpu_onednn.py checks."""
    monkeypatch.setenv("POLYHAL_CPU_ONEDNN", "0")

RNG = np.random.default_rng(3)
X = RNG.standard_normal((1, 4, 8, 8)).astype(np.float32)


def _f(*shape, scale=1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


class _Graph:
    def __init__(self) -> None:
        self.nodes, self.inits, self.n = [], [], 0

    def const(self, arr) -> str:
        self.n += 1
        name = f"c{self.n}"
        self.inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def node(self, op, *inputs, **attrs) -> str:
        self.n += 1
        out = f"v{self.n}"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=out, **attrs))
        return out

    def conv_bn(self, x, cin=4, cout=4, group=1, weights=None, k=3) -> str:
        w = weights or self.const(_f(cout, cin // group, k, k, scale=0.3))
        y = self.node("Conv", x, w, pads=[k // 2] * 4, group=group)
        stats = [1 + 0.1 * _f(cout), 0.1 * _f(cout), 0.1 * _f(cout), 1 + 0.1 * np.abs(_f(cout))]
        return self.node("BatchNormalization", y, *[self.const(s) for s in stats])

    def save(self, tmp_path, y, extra_inputs=(), opset=17, x_shape=X.shape):
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in extra_inputs]
        graph = helper.make_graph(self.nodes, "g", inputs, [helper.make_tensor_value_info(y, TensorProto.FLOAT,
                                                                                             ["a", "b", "c", "d"])],
                                  self.inits)
        path = tmp_path / "m.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), str(path))
        return path


def _compile_and_compare(path, feeds, device="cpu:0", **options):
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    program = polyhal.onnx.load(path)
    plan = program.compile(device, **options)
    (got,) = program.execute(plan, feeds).values()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    return plan


def _ops(plan) -> list[str]:
    return [op.name for op in plan.program.ops if op.kind == "dispatch"]


#: ONNX op -> (the fused activation, its attributes).
ACTIVATIONS = {
    "Relu": ("relu", {}), "Sigmoid": ("sigmoid", {}), "HardSwish": ("hard_swish", {}),
    "HardSigmoid": ("hard_sigmoid", {"alpha": 0.3, "beta": 0.4}), "Gelu": ("gelu", {}),
}


@pytest.mark.parametrize("onnx_op", [*ACTIVATIONS, "Clip", "Relu6", "SiLU"])
@pytest.mark.parametrize("residual", [False, True])
def test_conv_bn_activation_fuses_to_one_op(onnx_op, residual, tmp_path):
    g = _Graph()
    y = g.conv_bn("x")
    if residual:
        y = g.node("Add", y, "x")
    if onnx_op == "Clip":
        y = g.node("Clip", y, g.const(-0.5), g.const(0.75))
        want = "clip"
    elif onnx_op == "Relu6":
        y = g.node("Clip", y, g.const(0.0), g.const(6.0))
        want = "clip"
    elif onnx_op == "SiLU":
        y = g.node("Mul", y, g.node("Sigmoid", y))
        want = "silu"
    else:
        want, attrs = ACTIVATIONS[onnx_op]
        y = g.node(onnx_op, y, **attrs)
        if onnx_op == "HardSigmoid" and not residual:
            want = "clip"  # its scaling and shift are per-channel constants: they fold into the conv
    plan = _compile_and_compare(g.save(tmp_path, y, opset=20 if onnx_op == "Gelu" else 17), {"x": X})
    assert _ops(plan) == ["fused_conv"], plan.program
    (op,) = plan.program.ops
    assert op.attr_dict["activation"] == want and len(op.inputs) == 3 + residual
    kinds = [f.kind for f in plan.placement.fusions]
    assert kinds == ["batch_norm", "epilogue"]
    assert "fused batch_norm: conv + mul + add" in plan.explain()


def test_resnet_block_fuses_both_convs(tmp_path):
    g = _Graph()
    h = g.node("Relu", g.conv_bn("x"))
    y = g.node("Relu", g.node("Add", g.conv_bn(h), "x"))
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["fused_conv", "fused_conv"]
    assert [op.attr_dict["activation"] for op in plan.program.ops] == ["relu", "relu"]
    assert len(plan.program.ops[1].inputs) == 4  # the residual


def test_depthwise_bn_hardswish(tmp_path):
    g = _Graph()
    y = g.node("HardSwish", g.conv_bn("x", group=4))
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X}, data_tiling=False)
    assert _ops(plan) == ["fused_conv"]
    # By default the depthwise conv runs channel-blocked: a relayout at each edge of the graph.
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["pack", "cpu.blocked_conv", "unpack"]


def test_weights_from_an_input_do_not_fold(tmp_path):
    """BatchNormalization folds only into constant weights: its mul and add, and the ReLU after
    them, become one scale_shift instead."""
    g = _Graph()
    y = g.node("Relu", g.conv_bn("x", weights="w"))
    path = g.save(tmp_path, y, [("w", (4, 4, 3, 3))])
    plan = _compile_and_compare(path, {"x": X, "w": _f(4, 4, 3, 3, scale=0.3)})
    assert _ops(plan) == ["conv", "scale_shift"]
    assert [f.kind for f in plan.placement.fusions] == ["scale_shift"]


def test_hard_sigmoid_after_a_conv_with_input_weights(tmp_path):
    """Unfolded, HardSigmoid's mul, add and clamp are matched as one hard_sigmoid epilogue."""
    g = _Graph()
    y = g.node("HardSigmoid", g.node("Conv", "x", "w", pads=[1, 1, 1, 1]), alpha=0.3, beta=0.4)
    plan = _compile_and_compare(g.save(tmp_path, y, [("w", (4, 4, 3, 3))]), {"x": X, "w": _f(4, 4, 3, 3)})
    assert _ops(plan) == ["fused_conv"]
    assert plan.program.ops[0].attr_dict["activation"] == "hard_sigmoid"


def test_conv_result_read_twice_is_not_fused(tmp_path):
    g = _Graph()
    c = g.node("Conv", "x", g.const(_f(4, 4, 3, 3, scale=0.3)), pads=[1, 1, 1, 1])
    y = g.node("Add", g.node("Relu", c), c)
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["conv", "relu", "add"]


def test_gate_keeps_ops_unfused_and_passes_leave_their_input_alone(tmp_path):
    g = _Graph()
    y = g.node("Relu", g.conv_bn("x"))
    program = polyhal.onnx.load(g.save(tmp_path, y))
    before = [str(op) for op in program.ops]
    folded, changes = fold_conv_affine(program)
    assert [c.kind for c in changes] == ["batch_norm"] and [op.name for op in folded.ops] == ["conv", "relu"]
    # the replaced weights are gone from the constants, the folded ones are there
    assert {v.id for v, _ in folded.constants} == {v.id for v in folded.ops[0].inputs[1:]}
    same, none = fuse_conv_epilogue(folded, lambda fused, ops: False)
    assert same is folded and none == []
    fused, changes = fuse_conv_epilogue(folded)
    assert [op.name for op in fused.ops] == ["fused_conv"] and changes[0].kind == "epilogue"
    assert [str(op) for op in program.ops] == before


def _bn(g: _Graph, x: str, c: int = 8) -> str:
    stats = [1 + 0.1 * _f(c), 0.1 * _f(c), 0.1 * _f(c), 1 + 0.1 * np.abs(_f(c))]
    return g.node("BatchNormalization", x, *[g.const(s) for s in stats])


@pytest.mark.parametrize("activation", [None, "Relu", "Sigmoid", "HardSwish"])
def test_norm_after_a_concat_fuses_to_scale_shift(activation, tmp_path):
    """DenseNet's layer: BatchNormalization and ReLU of a concatenation (no conv to fold into)
    become one scale_shift, which the conv reading it takes as its prologue."""
    g = _Graph()
    y = _bn(g, g.node("Concat", "x", g.node("Relu", "x"), axis=1))
    if activation:
        y = g.node(activation, y)
    y = g.node("Conv", y, g.const(_f(4, 8, 1, 1, scale=0.3)))
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["relu", "concat", "cpu.scale_shift_conv"]
    op = plan.program.ops[2]
    assert op.attr_dict["pre_activation"] == {None: "none", "Relu": "relu", "Sigmoid": "sigmoid",
                                              "HardSwish": "hard_swish"}[activation]
    assert op.attr_dict["activation"] == "none"
    explained = plan.explain()
    assert "fused scale_shift: mul + add" in explained
    assert "fused prologue: scale_shift + conv -> cpu.scale_shift_conv" in explained
    assert "cpu-fuse-conv-prologue:" in explained  # the CPU's own pass, which it registers


def _normalised_convs(g: _Graph, x: str) -> str:
    """Norm and ReLU, a 1x1 conv added to its input; norm and ReLU of that, a padded 3x3 conv
    added to it, then a ReLU (no conv before a norm to fold it into)."""
    y = g.node("Add", g.node("Conv", g.node("Relu", _bn(g, x)), g.const(_f(8, 8, 1, 1, scale=0.3))), x)
    z = g.node("Conv", g.node("Relu", _bn(g, y)), g.const(_f(8, 8, 3, 3, scale=0.3)), g.const(_f(8)), pads=[1, 1, 1, 1])
    return g.node("Relu", g.node("Add", z, y))


def test_norm_before_convs_becomes_their_prologue(tmp_path):
    """Each norm and ReLU read by one conv only becomes that conv's prologue, the conv's
    epilogue (a residual add, an activation) kept; the 3x3 conv's zero padding pads the
    normalised map (onnxruntime checks)."""
    g = _Graph()
    y = _normalised_convs(g, _normalised_convs(g, g.node("Concat", "x", g.node("Relu", "x"), axis=1)))
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["relu", "concat"] + ["cpu.scale_shift_conv"] * 4
    ops = plan.program.ops[2:]
    assert [(op.attr_dict["pre_activation"], op.attr_dict["activation"]) for op in ops] == \
        [("relu", "none"), ("relu", "relu")] * 2
    assert [op.attr_dict["pads"] for op in ops] == [(0, 0, 0, 0), (1, 1, 1, 1)] * 2
    assert all(len(op.inputs) == 6 for op in ops)  # x, scale, shift, w, b (zeros for the 1x1), residual
    assert [f.kind for f in plan.placement.fusions].count("prologue") == 4
    # convs with a prologue are the CPU's own ops, outside the core's conv chains: no encodes
    report = plan.placement.encodings
    assert report.encodes == [] and report.encode_dispatches == 0


def test_norm_read_twice_or_before_a_pool_keeps_its_scale_shift(tmp_path):
    """A normalised map with a second reader is written for it anyway; DenseNet's transition
    (norm, ReLU, 1x1 conv, 2x2 average pool) moves its pool before the conv, and the norm
    feeding the pool stays a scale_shift."""
    g = _Graph()
    x = g.node("Concat", "x", g.node("Relu", "x"), axis=1)
    n = g.node("Relu", _bn(g, x))
    y = g.node("Add", g.node("Conv", n, g.const(_f(8, 8, 1, 1, scale=0.3))), n)
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["relu", "concat", "scale_shift", "fused_conv"]
    g = _Graph()
    x = g.node("Concat", "x", g.node("Relu", "x"), axis=1)
    y = g.node("Conv", g.node("Relu", _bn(g, x)), g.const(_f(4, 8, 1, 1, scale=0.3)))
    y = g.node("AveragePool", y, kernel_shape=[2, 2], strides=[2, 2])
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["relu", "concat", "scale_shift", "avg_pool", "conv"]
    assert "prologue" not in [f.kind for f in plan.placement.fusions]


def test_prologue_asks_the_gate_and_leaves_its_input_alone():
    """The pass asks ``fusible("cpu.scale_shift_conv", (scale_shift, conv))``; a no leaves the
    program as it was, and a conv reading the normalised map other than as its input (a
    residual) does not take it."""
    b = polyhal.ProgramBuilder()
    x = b.input("x", (1, 4, 6, 6))
    scale, shift = b.constant(_f(4)), b.constant(_f(4))
    n = b.op("scale_shift", x, scale, shift, activation="relu", alpha=0.0, beta=0.0)
    w, bias = b.constant(_f(4, 4, 3, 3)), b.constant(_f(4))
    y = b.op("conv", n, w, pads=[1, 1, 1, 1], group=1)  # no bias: the fused op gets zeros
    m = b.op("scale_shift", y, scale, shift, activation="none", alpha=0.0, beta=0.0)
    b.output(b.op("fused_conv", y, w, bias, m, pads=[1, 1, 1, 1], group=1, activation="relu", alpha=0.0, beta=0.0))
    program = b.build()
    before = [str(op) for op in program.ops]
    asked = []
    same, none = fuse_conv_prologue(program, lambda fused, ops: asked.append((fused, [o.name for o in ops])) or False)
    assert same is program and none == [] and asked == [("cpu.scale_shift_conv", ["scale_shift", "conv"])]
    fused, changes = fuse_conv_prologue(program, always)
    assert [op.name for op in fused.ops] == ["cpu.scale_shift_conv", "scale_shift", "fused_conv"]
    assert [c.kind for c in changes] == ["prologue"] and [str(op) for op in program.ops] == before
    attrs = fused.ops[0].attr_dict
    assert (attrs["pre_activation"], attrs["activation"], attrs["pads"]) == ("relu", "none", (1, 1, 1, 1))
    xs = _f(1, 4, 6, 6)
    want = polyhal.compile(program, "cpu:0", fuse=False).run_numpy(xs)[0]
    np.testing.assert_allclose(polyhal.compile(fused, "cpu:0", fuse=False).run_numpy(xs)[0], want, rtol=1e-4, atol=1e-4)


def test_scale_shift_needs_two_of_scale_shift_activation_and_leaves_its_input_alone(tmp_path):
    g = _Graph()
    y = g.node("Mul", g.node("Add", "x", g.const(_f(1, 4, 1, 1))), "x")  # an add alone, then a product
    program = polyhal.onnx.load(g.save(tmp_path, y))
    same, none = fuse_scale_shift(program)
    assert same is program and none == []
    g = _Graph()
    y = g.node("Relu", g.node("Mul", "x", g.const(_f(4, 1, 1))))  # a per-channel scale and ReLU
    program = polyhal.onnx.load(g.save(tmp_path, y))
    before = [str(op) for op in program.ops]
    assert fuse_scale_shift(program, lambda fused, ops: False)[0] is program  # the gate says no
    fused, changes = fuse_scale_shift(program)
    assert [op.name for op in fused.ops] == ["scale_shift"] and changes[0].kind == "scale_shift"
    assert [str(op) for op in program.ops] == before
    (want,) = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": X})
    plan = polyhal.compile(fused, "cpu:0")
    np.testing.assert_allclose(plan.run_numpy(X)[0], want, rtol=1e-5, atol=1e-6)


def test_device_without_the_fused_kernel_keeps_conv(tmp_path):
    """OpenCL has conv but no fused_conv: the gate leaves the epilogue unfused there."""
    names = {s.name for s in polyhal.registry.default_registry().device_specs()}
    if "opencl:0" not in names:
        pytest.skip("no OpenCL device here")
    g = _Graph()
    y = g.node("Relu", g.node("Add", g.conv_bn("x"), "x"))
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X}, device="opencl:0")
    assert _ops(plan) == ["conv", "add", "relu"]


def _save_2d(tmp_path, nodes, inits, x_shape, opset=17):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    path = tmp_path / "l.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8), str(path))
    return path


def test_matmul_bias_residual_relu_fuses_to_fused_linear(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["q"]),
             helper.make_node("Add", ["q", "x"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    path = _save_2d(tmp_path, nodes, {"w": _f(16, 16), "b": _f(16)}, (8, 16))
    plan = _compile_and_compare(path, {"x": _f(8, 16)})
    assert _ops(plan) == ["fused_linear"]
    assert [f.kind for f in plan.placement.fusions] == ["linear", "epilogue"]


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_gelu_fuses_to_fused_linear(trans_b, tmp_path):
    w = _f(12, 16) if trans_b else _f(16, 12)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["p"], transB=trans_b), helper.make_node("Gelu", ["p"], ["y"])]
    path = _save_2d(tmp_path, nodes, {"w": w, "b": _f(12)}, (8, 16), opset=20)
    plan = _compile_and_compare(path, {"x": _f(8, 16)})
    assert _ops(plan) == ["fused_linear"]
    assert plan.program.ops[0].attr_dict["activation"] == "gelu"


@pytest.mark.parametrize("rows", [8, 32])
def test_gemm_trans_b_weights_stay_a_view_of_the_programs_constant(rows, tmp_path):
    # Gemm(transB=1) becomes fused_linear on B's transpose: a view of the program's constant, not a
    # second copy of the weights (the program keeps B for a later compile). 8 rows run on the CPU's
    # own GEMM (BLAS's transpose flag), 32 on oneDNN's matmul where it serves them (its kept reorder).
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["p"], transB=1), helper.make_node("Relu", ["p"], ["y"])]
    path = _save_2d(tmp_path, nodes, {"w": _f(24, 16), "b": _f(24)}, (rows, 16))
    program = polyhal.onnx.load(path)
    plan = program.compile("cpu:0")
    (op,) = [op for op in plan.program.ops if op.kind == "dispatch"]
    assert op.name == "fused_linear"
    weights = dict((v.id, d) for v, d in plan.program.constants)[op.inputs[1].id]
    (original,) = [d for v, d in program.constants if d.shape == (24, 16)]
    assert weights.shape == (16, 24) and np.shares_memory(weights, original) and not weights.flags.writeable
    x = _f(rows, 16)
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for _ in range(2):  # the second run reads what the first kept
        (got,) = program.execute(plan, {"x": x}).values()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gemm_with_alpha_is_not_fused(tmp_path):
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["p"], alpha=0.5), helper.make_node("Relu", ["p"], ["y"])]
    plan = _compile_and_compare(_save_2d(tmp_path, nodes, {"w": _f(16, 12), "b": _f(12)}, (8, 16)), {"x": _f(8, 16)})
    assert _ops(plan) == ["gemm", "relu"]


# ------------------------------------------------------------------- channel-blocked layout

def _inverted_residual(tmp_path):
    """MobileNet's block: 1x1 expansion, 3x3 depthwise (stride 1), 1x1 projection, residual Add."""
    g = _Graph()
    h = g.node("Relu", g.conv_bn("x", 4, 8, k=1))
    h = g.node("HardSwish", g.conv_bn(h, 8, 8, group=8))
    y = g.node("Add", g.conv_bn(h, 8, 4, k=1), "x")
    return g.save(tmp_path, y)


def test_depthwise_chain_stays_channel_blocked_between_its_convs(tmp_path):
    plan = _compile_and_compare(_inverted_residual(tmp_path), {"x": X})
    assert _ops(plan) == ["pack", "cpu.blocked_conv", "cpu.blocked_conv", "cpu.blocked_conv", "unpack"]
    report = plan.placement.encodings
    assert report.encode_dispatches == 2  # the graph's two edges
    explained = plan.explain()
    assert "channel-blocked<NCHW8c" in explained and "a set/unset pair" in explained
    # profiles name the ONNX nodes of each blocked step
    nodes = [r["node"] for r in plan.profile(x=X).rows() if r["op"] == "cpu.blocked_conv"]
    assert len(nodes) == 3 and all("(Conv) + " in n for n in nodes), nodes


def test_a_stem_conv_reads_its_image_as_it_lies_into_the_chain(tmp_path):
    """A dense conv of an RGB image feeding a depthwise chain writes the chain's blocked layout
    itself: no pack of the image, none of its result."""
    g = _Graph()
    h = g.node("HardSwish", g.node("Conv", "x", g.const(_f(8, 3, 3, 3)), g.const(_f(8)), pads=[1] * 4, strides=[2, 2]))
    y = g.node("Add", g.conv_bn(g.node("Relu", g.conv_bn(h, 8, 8, group=8)), 8, 8, k=1), h)
    x = _f(2, 3, 17, 15)
    plan = _compile_and_compare(g.save(tmp_path, y, x_shape=x.shape), {"x": x})
    assert _ops(plan) == ["cpu.blocked_conv", "cpu.blocked_conv", "cpu.blocked_conv", "unpack"]


def test_chains_without_a_depthwise_conv_stay_nchw(tmp_path):
    g = _Graph()
    y = g.node("Relu", g.node("Add", g.conv_bn(g.node("Relu", g.conv_bn("x", k=1)), k=1), "x"))
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["fused_conv", "fused_conv"]
    # The chain is encoded (a channels-last device would keep it NHWC); the CPU keeps NCHW, so
    # every encode folds, its filters included.
    report = plan.placement.encodings
    assert report.encodes and report.folded == len(report.encodes) and report.encode_dispatches == 0
    explained = plan.explain()
    assert "conv.feature_map<dense>" in explained and "identity by 'cpu'" in explained


def test_a_lone_conv_is_not_encoded(tmp_path):
    """A chain of one ordinary conv would pay a relayout at both ends for what it gains."""
    g = _Graph()
    plan = _compile_and_compare(g.save(tmp_path, g.node("Relu", g.conv_bn("x"))), {"x": X})
    assert _ops(plan) == ["fused_conv"] and not plan.placement.encodings.encodes


def test_blocked_layout_off_or_unavailable_falls_back_to_nchw(tmp_path, monkeypatch):
    path = _inverted_residual(tmp_path)
    plan = _compile_and_compare(path, {"x": X}, data_tiling=False)
    assert _ops(plan) == ["fused_conv"] * 3
    monkeypatch.setenv("POLYHAL_CPU_NATIVE", "0")  # the blocked kernels need the compiled loops
    plan = _compile_and_compare(path, {"x": X})
    assert _ops(plan) == ["fused_conv"] * 3 and plan.placement.encodings.encode_dispatches == 0


def test_blocked_layout_on_a_device_without_it_is_explained(tmp_path):
    names = {s.name for s in polyhal.registry.default_registry().device_specs()}
    if "opencl:0" not in names:
        pytest.skip("no OpenCL device here")
    plan = _compile_and_compare(_inverted_residual(tmp_path), {"x": X}, device="opencl:0")
    assert "cpu.blocked_conv" not in _ops(plan) and "pack" not in _ops(plan)
    assert "identity layout" in plan.explain()


def test_squeeze_excite_block_stays_channel_blocked(tmp_path):
    """Global average pool, the gate's 1x1 convs and the gating Mul run on the blocked storage."""
    g = _Graph()
    h = g.node("Relu", g.conv_bn("x", 4, 4, group=4))
    s = g.node("GlobalAveragePool", h)
    s = g.node("Relu", g.node("Conv", s, g.const(_f(2, 4, 1, 1)), g.const(_f(2))))
    s = g.node("Sigmoid", g.node("Conv", s, g.const(_f(4, 2, 1, 1)), g.const(_f(4))))
    y = g.conv_bn(g.node("Mul", h, s), 4, 8, k=1)
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    ops = _ops(plan)
    assert ops.count("pack") == 1 and ops.count("unpack") == 1, ops
    assert ops.count("cpu.blocked_conv") == 4 and "reduce_mean" in ops and "mul" in ops


@pytest.mark.parametrize("bias", [False, True])
def test_transition_pools_before_its_pointwise_conv(bias, tmp_path):
    """DenseNet's transition: a 1x1 conv (with or without a bias) and a 2x2 average pool of its
    result become the pool, then the conv of the pooled map (a quarter of the products); a pool
    whose windows reach into padding, or of a 3x3 conv, keeps its place."""
    g = _Graph()
    w = [g.const(_f(6, 4, 1, 1, scale=0.3))] + ([g.const(_f(6))] if bias else [])
    y = g.node("AveragePool", g.node("Conv", "x", *w), kernel_shape=[2, 2], strides=[2, 2])
    plan = _compile_and_compare(g.save(tmp_path, y), {"x": X})
    assert _ops(plan) == ["avg_pool", "conv"]
    pool, conv = plan.program.ops
    assert pool.inputs[0].type.shape == (1, 4, 8, 8) and conv.inputs[0].type.shape == (1, 4, 4, 4)
    assert "fused pool_first: conv + avg_pool -> avg_pool, conv" in plan.explain()
    for k, pads in ((1, [1, 1, 1, 1]), (3, [0, 0, 0, 0])):
        g = _Graph()
        y = g.node("AveragePool", g.node("Conv", "x", g.const(_f(6, 4, k, k, scale=0.3)), pads=[k // 2] * 4),
                   kernel_shape=[2, 2], strides=[2, 2], pads=pads)
        assert _ops(_compile_and_compare(g.save(tmp_path, y), {"x": X})) == ["conv", "avg_pool"]
