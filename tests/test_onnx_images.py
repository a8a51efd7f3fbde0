"""ImageDecoder: images decoded on the host with Pillow (the optional 'images' extra) match onnx's
reference evaluator; constant images fold and feed device ops; undecodable bytes and a missing
Pillow are clear errors."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
Image = pytest.importorskip("PIL.Image", reason="Pillow (polyhal[images]) is in requirements-test.txt")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import polyhal.onnx as ponnx  # noqa: E402
from polyhal.frontends.onnx import OnnxInputError, OnnxUnsupportedError  # noqa: E402

U8 = TensorProto.UINT8


def _encoded(mode: str, fmt: str, size=(7, 5)) -> np.ndarray:
    rng = np.random.default_rng(len(mode) + len(fmt))
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    img = Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels, mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return np.frombuffer(buf.getvalue(), np.uint8).copy()


def _decoder(pixel_format: str, encoded_input: bool = True, init=None, extra=()) -> onnx.ModelProto:
    nodes = [helper.make_node("ImageDecoder", ["encoded"], ["image"], pixel_format=pixel_format), *extra]
    inputs = [helper.make_tensor_value_info("encoded", U8, [None])] if encoded_input else []
    last = extra[-1].output[0] if extra else "image"
    outputs = [helper.make_tensor_value_info(last, TensorProto.FLOAT if extra else U8,
                                             [] if last == "total" else [None, None, None])]
    graph = helper.make_graph(nodes, "decode", inputs, outputs, [] if init is None else [init])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("pixel_format", ["RGB", "BGR", "Grayscale"])
@pytest.mark.parametrize("mode, fmt", [("RGB", "PNG"), ("RGB", "JPEG"), ("L", "PNG"), ("RGB", "BMP")])
def test_decoded_pixels_match_onnx_reference(pixel_format, mode, fmt):
    model = _decoder(pixel_format)
    encoded = _encoded(mode, fmt)
    got = ponnx.load(model).run({"encoded": encoded})["image"]
    if mode == "L" and pixel_format != "Grayscale":
        # ONNX defines three channels; onnx's reference returns Pillow's one-channel array as is.
        gray = np.asarray(Image.open(io.BytesIO(encoded.tobytes())))
        want = np.repeat(gray[:, :, None], 3, axis=2)
    else:
        want = ReferenceEvaluator(model).run(None, {"encoded": encoded})[0]
    assert got.dtype == np.uint8 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_an_image_with_alpha_decodes_to_three_channels():
    encoded = _encoded("RGBA", "PNG")
    got = ponnx.load(_decoder("RGB")).run({"encoded": encoded})["image"]
    rgba = np.asarray(Image.open(io.BytesIO(encoded.tobytes())))
    np.testing.assert_array_equal(got, rgba[:, :, :3])


def test_a_constant_image_is_decoded_at_import_and_feeds_device_ops():
    encoded = _encoded("RGB", "PNG")
    extra = (helper.make_node("Cast", ["image"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["f"], ["total"], keepdims=0))
    model = _decoder("RGB", encoded_input=False, init=numpy_helper.from_array(encoded, "encoded"), extra=extra)
    got = ponnx.load(model).run({})["total"]
    pixels = np.asarray(Image.open(io.BytesIO(encoded.tobytes())).convert("RGB"))
    assert float(got) == float(pixels.astype(np.float64).sum())


def test_an_input_image_cannot_feed_device_ops():
    extra = (helper.make_node("Cast", ["image"], ["f"], to=TensorProto.FLOAT),)
    with pytest.raises(OnnxUnsupportedError, match="shape that depends on the data"):
        ponnx.load(_decoder("RGB", extra=extra)).run({"encoded": _encoded("RGB", "PNG")})


def test_bytes_that_are_no_image_are_a_clear_error():
    with pytest.raises(OnnxInputError, match="not an image Pillow can decode"):
        ponnx.load(_decoder("RGB")).run({"encoded": np.arange(40, dtype=np.uint8)})


def test_without_pillow_the_op_is_refused_naming_the_extra(monkeypatch):
    # From this checkout (polyhal installed editable), the hint is the checkout's install command.
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    encoded = _encoded("RGB", "PNG")
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(OnnxUnsupportedError, match=r"pip install -e '\.\[images\]'"):
        ponnx.load(_decoder("RGB")).run({"encoded": encoded})
