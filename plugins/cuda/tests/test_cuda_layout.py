"""Channels-last conv chains on CUDA (polyhal_cuda.layout): the resolver's choice and its
reasons, blocked_conv through cuDNN's NHWC engines (filters dense or channels-last), the NHWC
depthwise kernel, strided pack / unpack, and whole chains against onnxruntime with the encodes
between their links folded (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.records import DeviceSpec
from polyhal.ir.encoding import FeatureMapEncoding
from polyhal.ir.types import TensorType
from polyhal.ops import OPS

from polyhal_cuda import layout

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

RNG = np.random.default_rng(5)
F32 = np.dtype(np.float32)


def _spec(*caps):
    return DeviceSpec(name="cuda:9", backend="cuda", rank=1, factory=None, capabilities=frozenset(caps))


def test_resolver_choice_and_reasons(monkeypatch):
    t = TensorType((2, 8, 5, 5), F32, FeatureMapEncoding(chain="dense"))
    kept = layout.resolve_encoding(_spec("cudnn"), t.encoding, t)  # auto: fp32 measured faster in NCHW
    assert kept.is_identity_layout() and "measured" in kept.describe()
    half = TensorType((2, 8, 5, 5), np.float16, FeatureMapEncoding(chain="dense"))
    assert not layout.resolve_encoding(_spec("cudnn"), half.encoding, half).is_identity_layout()  # fp16: NHWC
    half = TensorType((2, 8, 5, 5), np.float16, FeatureMapEncoding())
    assert layout.resolve_encoding(_spec("cudnn"), half.encoding, half).is_identity_layout()  # depthwise: NCHW
    monkeypatch.setenv("POLYHAL_CUDA_LAYOUT", "nhwc")
    got = layout.resolve_encoding(_spec("cudnn"), t.encoding, t)
    assert isinstance(got, layout.ChannelsLastLayout) and got.storage_type.shape == (2, 1, 5, 5, 8)
    assert "cuda NHWC -> 2x1x5x5x8" in got.describe()
    # the same bytes whichever chain the map is in: links between chains fold
    assert got.is_same_layout(layout.resolve_encoding(_spec("cudnn"), FeatureMapEncoding(), t))
    kept = layout.resolve_encoding(_spec(), t.encoding, t)
    assert kept.is_identity_layout() and "without cuDNN" in kept.describe()  # even when forced
    monkeypatch.setenv("POLYHAL_CUDA_LAYOUT", "nchw")
    kept = layout.resolve_encoding(_spec("cudnn"), t.encoding, t)
    assert kept.is_identity_layout() and "POLYHAL_CUDA_LAYOUT=nchw" in kept.describe()
    monkeypatch.setenv("POLYHAL_CUDA_LAYOUT", "sideways")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_CUDA_LAYOUT"):
        layout.resolve_encoding(_spec("cudnn"), t.encoding, t)
    assert layout.resolve_encoding(_spec("cudnn"), object(), t) is None
    assert layout.resolve_encoding(DeviceSpec(name="cpu:0", backend="cpu", rank=0, factory=None),
                                   t.encoding, t) is None


def _block(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)[:, None])


@pytest.mark.parametrize("case", ["3x3", "1x1_residual", "stride2_groups", "depthwise"])
@pytest.mark.parametrize("filter_last", [False, True])
def test_blocked_conv_matches_the_reference(cuda, case, filter_last):
    import cupy as cp

    n, c, m, k, group, strides, res = {"3x3": (2, 8, 16, 3, 1, 1, False), "1x1_residual": (2, 16, 16, 1, 1, 1, True),
                                       "stride2_groups": (1, 8, 12, 3, 2, 2, False),
                                       "depthwise": (2, 12, 12, 3, 12, 1, True)}[case]
    x = RNG.standard_normal((n, c, 9, 9)).astype(F32)
    w = (0.3 * RNG.standard_normal((m, c // group, k, k))).astype(F32)
    b = RNG.standard_normal(m).astype(F32)
    attrs = {"strides": [strides] * 2, "pads": [k // 2] * 4, "dilations": [1, 1], "group": group,
             "activation": "relu", "alpha": 0.0, "beta": 0.0, "precision": "fp32"}
    oh = (9 + 2 * (k // 2) - k) // strides + 1
    ins = [_block(x), _block(w) if filter_last else w, b]
    if res:
        ins.append(_block(RNG.standard_normal((n, m, oh, oh)).astype(F32)))
    in_types = tuple(TensorType(a.shape, a.dtype) for a in ins)
    (out_t,) = OPS["cuda.blocked_conv"].infer(in_types, attrs)
    fn = cuda.prepare("cuda.blocked_conv", attrs, in_types, (out_t,))
    with cuda.activate():
        dev = [cp.asarray(a) for a in ins]
        out = cp.full(out_t.shape, np.nan, F32)
    fn(*dev, out)
    cuda.synchronize()
    (want,) = OPS["cuda.blocked_conv"].reference(*[a.astype(np.float64) for a in ins], **attrs)
    got = cp.asnumpy(out)
    assert np.abs(got - want).max() <= 1e-5 * max(np.abs(want).max(), 1), case
    name = getattr(getattr(fn, "inner", fn), "kernel_name", "")
    assert ("NHWC" in name), name


def test_strided_pack_and_unpack(cuda):
    import cupy as cp

    x = RNG.standard_normal((2, 6, 4, 5)).astype(F32)
    attrs = {"inner_dims_pos": (1,), "inner_tiles": (6,), "outer_dims_perm": None, "padding_value": 0.0}
    (pt,) = OPS["pack"].infer((TensorType(x.shape, F32),), attrs)
    pack = cuda.prepare("pack", attrs, (TensorType(x.shape, F32),), (pt,))
    uattrs = {"inner_dims_pos": (1,), "inner_tiles": (6,), "outer_dims_perm": None, "dest_shape": x.shape}
    unpack = cuda.prepare("unpack", uattrs, (pt,), (TensorType(x.shape, F32),))
    assert "strided copy" in getattr(getattr(pack, "inner", pack), "kernel_name", "")
    with cuda.activate():
        dx = cp.asarray(x)
        packed = cp.empty(pt.shape, F32)
        back = cp.empty(x.shape, F32)
    pack(dx, packed)
    unpack(packed, back)
    cuda.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(packed), _block(x))
    np.testing.assert_array_equal(cp.asnumpy(back), x)


class _Graph:
    def __init__(self) -> None:
        self.nodes, self.inits, self.n = [], [], 0

    def const(self, arr) -> str:
        self.n += 1
        self.inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), f"c{self.n}"))
        return f"c{self.n}"

    def node(self, op, *inputs, **attrs) -> str:
        self.n += 1
        self.nodes.append(helper.make_node(op, list(inputs), [f"v{self.n}"], **attrs))
        return f"v{self.n}"

    def conv(self, x, cin, cout, k=3, group=1, stride=1) -> str:
        w = self.const(0.3 * RNG.standard_normal((cout, cin // group, k, k)))
        return self.node("Conv", x, w, self.const(0.1 * RNG.standard_normal(cout)), pads=[k // 2] * 4, group=group,
                         strides=[stride] * 2)

    def save(self, tmp_path, y, shape, rank=4):
        graph = helper.make_graph(self.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["a", "b", "c", "d"][:rank])], self.inits)
        path = tmp_path / "m.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
        return path


def _resnet_block(tmp_path):
    """Stem conv, a residual block, a strided conv, global average pool, flatten."""
    g = _Graph()
    h = g.node("Relu", g.conv("x", 3, 16))
    r = g.node("Relu", g.conv(h, 16, 16))
    h = g.node("Relu", g.node("Add", g.conv(r, 16, 16), h))
    h = g.node("Relu", g.conv(h, 16, 32, stride=2))
    return g.save(tmp_path, g.node("Flatten", g.node("GlobalAveragePool", h)), (2, 3, 12, 12), rank=2)


def _mobile_block(tmp_path):
    """Expansion, depthwise, squeeze-excite gate, projection, residual."""
    g = _Graph()
    h = g.node("Relu", g.conv("x", 8, 16, k=1))
    h = g.node("Relu", g.conv(h, 16, 16, k=3, group=16))
    s = g.node("Sigmoid", g.conv(g.node("Relu", g.conv(g.node("GlobalAveragePool", h), 16, 4, k=1)), 4, 16, k=1))
    y = g.node("Add", g.conv(g.node("Mul", h, s), 16, 8, k=1), "x")
    return g.save(tmp_path, y, (2, 8, 10, 10))


@pytest.mark.parametrize("build", [_resnet_block, _mobile_block])
def test_chains_stay_nhwc_and_match_onnxruntime(cuda, tmp_path, monkeypatch, build):
    ort = pytest.importorskip("onnxruntime")
    import polyhal.onnx

    path = build(tmp_path)
    shape = tuple(d.dim_value for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim)
    feeds = {"x": RNG.standard_normal(shape).astype(F32)}
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    plans = {}
    for choice in ("nhwc", "nchw"):
        monkeypatch.setenv("POLYHAL_CUDA_LAYOUT", choice)
        program = polyhal.onnx.load(path)
        plans[choice] = plan = program.compile(cuda.name)
        (got,) = program.execute(plan, feeds).values()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    ops = [op.name for op in plans["nhwc"].program.ops if op.kind == "dispatch"]
    assert "cuda.blocked_conv" in ops and "fused_conv" not in ops[1:], ops
    report = plans["nhwc"].placement.encodings
    # a relayout only at the chain's edges: into it, and out of it before the Flatten / output
    assert report.encode_dispatches <= 3 and report.folded >= len(report.encodes) - 3, plans["nhwc"].explain()
    assert "cuda NHWC" in plans["nhwc"].explain()
    nchw_ops = [op.name for op in plans["nchw"].program.ops if op.kind == "dispatch"]
    assert "cuda.blocked_conv" not in nchw_ops and plans["nchw"].placement.encodings.encode_dispatches == 0
    assert "POLYHAL_CUDA_LAYOUT=nchw" in plans["nchw"].explain()
