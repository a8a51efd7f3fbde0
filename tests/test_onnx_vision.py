"""The vision/signal family of the ONNX front end (GridSample, RoiAlign, DeformConv, Col2Im,
MaxUnpool, MaxPool's Indices, STFT, MelWeightMatrix, Det, floored float Mod) against onnx's
reference evaluator, on random operands beyond the node tests' few cases; and the clear refusals."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from polyhal.frontends.onnx import OnnxUnsupportedError  # noqa: E402

_F = TensorProto.FLOAT


def _model(op: str, inputs: dict, n_out: int = 1, opset: int = 22, domain: str = "", outs=None, consts=(),
           **attrs) -> onnx.ModelProto:
    """A one-node model; inputs named in ``consts`` are initializers; outputs typed by ``outs``
    ([(elem type, shape)]), else float of any shape."""
    node = helper.make_node(op, list(inputs), [f"y{i}" for i in range(n_out)], domain=domain, **attrs)
    ins = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in inputs.items() if k not in consts]
    inits = [onnx.numpy_helper.from_array(inputs[k], k) for k in consts]
    outs = [helper.make_tensor_value_info(f"y{i}", *(outs[i] if outs else (_F, None)))
            for i in range(n_out)]
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(helper.make_graph([node], op, ins, outs, inits), opset_imports=imports)


def _check(op: str, inputs: dict, n_out: int = 1, rtol: float = 1e-4, atol: float = 1e-5, consts=(), **attrs) -> None:
    feeds = {k: v for k, v in inputs.items() if k not in consts}
    want = ReferenceEvaluator(_model(op, inputs, n_out, consts=consts, **attrs)).run(None, feeds)
    model = _model(op, inputs, n_out, outs=[(helper.np_dtype_to_tensor_dtype(w.dtype), w.shape) for w in want],
                   consts=consts, **attrs)
    got = ponnx.load(model).run(feeds)
    for k, w in enumerate(want):
        g = np.asarray(got[f"y{k}"])
        assert g.shape == w.shape, (op, attrs, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{op} {attrs}")


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample(mode, padding_mode, align_corners):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    grid = rng.uniform(-1.6, 1.6, (2, 3, 6, 2)).astype(np.float32)
    _check("GridSample", {"x": x, "grid": grid}, mode=mode, padding_mode=padding_mode, align_corners=align_corners)


def test_grid_sample_volumetric():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 2, 3, 4, 5)).astype(np.float32)
    grid = rng.uniform(-1.2, 1.2, (1, 2, 3, 2, 3)).astype(np.float32)
    _check("GridSample", {"x": x, "grid": grid}, mode="linear", padding_mode="border")


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align(mode, sampling_ratio):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8, 9)).astype(np.float32)
    a = rng.uniform(-2, 8, (5, 2))
    rois = np.concatenate([a, a + rng.uniform(0.5, 6, (5, 2))], 1).astype(np.float32)
    _check("RoiAlign", {"x": x, "rois": rois, "batch_indices": rng.integers(0, 2, 5).astype(np.int64)}, mode=mode,
           output_height=3, output_width=2, sampling_ratio=sampling_ratio, spatial_scale=0.75)


@pytest.mark.parametrize("group,offset_group", [(1, 1), (2, 2), (1, 3)])
def test_deform_conv(group, offset_group):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 5, 6)).astype(np.float32)
    w = rng.standard_normal((4, 6 // group, 2, 3)).astype(np.float32)
    oh, ow = 6, 2  # pads 1 / 0, strides 1 / 2: (5 + 2 - 2) + 1, (6 - 3) // 2 + 1
    offset = rng.uniform(-1.5, 1.5, (2, offset_group * 2 * 6, oh, ow)).astype(np.float32)
    mask = rng.uniform(0, 1, (2, offset_group * 6, oh, ow)).astype(np.float32)
    bias = rng.standard_normal(4).astype(np.float32)
    _check("DeformConv", {"x": x, "w": w, "offset": offset, "b": bias, "mask": mask}, group=group,
           offset_group=offset_group, pads=[1, 0, 1, 0], strides=[1, 2])


def test_col2im_3d_with_strides_pads_dilations():
    rng = np.random.default_rng(1)
    block, image = [2, 2, 1], [5, 4, 3]
    strides, dil, pads = [2, 1, 1], [1, 2, 1], [1, 0, 0, 0, 1, 0]
    grid = [(image[i] + pads[i] + pads[i + 3] - dil[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(3)]
    x = rng.standard_normal((2, 3 * 4, int(np.prod(grid)))).astype(np.float32)
    _check("Col2Im", {"x": x, "image_shape": np.array(image, np.int64), "block_shape": np.array(block, np.int64)},
           consts=("image_shape", "block_shape"), strides=strides, dilations=dil, pads=pads)


@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_indices_then_unpool(storage_order):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    attrs = dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 0], storage_order=storage_order)
    _check("MaxPool", {"x": x}, n_out=2, **attrs)
    if not storage_order:
        model = _model("MaxPool", {"x": x}, n_out=2, **attrs)
        y, idx = ReferenceEvaluator(model).run(None, {"x": x})
        _check("MaxUnpool", {"y": y, "i": idx}, kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 0])


def test_stft_windowed_and_mel():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 64, 1)).astype(np.float32)
    window = np.hanning(16).astype(np.float32)
    _check("STFT", {"x": x, "step": np.array(6, np.int64), "window": window}, rtol=1e-4, atol=1e-4, opset=17,
           consts=("step",))
    consts = {"bins": np.array(8, np.int64), "n": np.array(32, np.int64), "rate": np.array(8000, np.int64),
              "lo": np.array(100, np.float32), "hi": np.array(3500, np.float32)}
    _check("MelWeightMatrix", consts, opset=17, consts=tuple(consts))


def test_det_batched_and_singular():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 2, 4, 4)).astype(np.float32)
    x[0, 1, 3] = x[0, 1, 0]  # a singular matrix
    _check("Det", {"x": x}, rtol=1e-4, atol=1e-4)


def test_floored_float_mod_has_the_divisors_sign():
    a = np.array([5.5, -5.5, 5.5, -5.5, 0.0, -0.0, 3.0, np.inf, 1.0, -1.0], np.float32)
    b = np.array([2.0, 2.0, -2.0, -2.0, -3.0, 3.0, 0.0, 2.0, np.inf, np.inf], np.float32)
    model = _model("Mod", {"a": a, "b": b}, fmod=0, outs=[(_F, [10])])
    got = np.asarray(ponnx.load(model).run({"a": a, "b": b})["y0"])
    with np.errstate(invalid="ignore"):  # 3 mod 0 and inf mod 2 are nan
        want = np.mod(a.astype(np.float64), b).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got[:6]), np.signbit(want[:6]))


@pytest.mark.parametrize("op,domain,why", [("Adam", "ai.onnx.preview.training", "training-only"),
                                            ("Bernoulli", "", "random numbers")])
def test_clear_refusals(op, domain, why):
    if op == "Adam":
        inputs = {k: np.ones(3, np.float32) for k in ("r", "t", "x", "g", "v", "h")}
        inputs["r"], inputs["t"] = np.array(0.1, np.float32), np.array(1, np.int64)
        model = _model(op, inputs, n_out=3, opset=22, domain=domain, outs=[(_F, [3])] * 3)
    else:
        model = _model(op, {"p": np.full(4, 0.5, np.float32)}, outs=[(_F, [4])])
    with pytest.raises(OnnxUnsupportedError, match=why):
        ponnx.load(model)
