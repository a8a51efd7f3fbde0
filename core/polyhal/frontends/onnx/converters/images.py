"""ImageDecoder: an encoded image (a uint8 tensor of a file's bytes: JPEG, PNG, BMP, TIFF, WebP,
JPEG 2000, PNM, whatever the codec library reads) to an ``[H, W, C]`` uint8 tensor.

Decoding is host work, like the string ops (:class:`~polyhal.frontends.onnx.types.HostValue`):
when the bytes are known at import (an initializer) the image is decoded then and is an
ordinary constant; when they are a graph input, the image is decoded before the plan runs, and
its shape comes from the data, so it can be a model output but cannot feed device ops (polyhal
plans have static shapes). The codec is Pillow, which onnx's reference evaluator uses too,
installed with polyhal's optional extra ``polyhal[images]``; without it the op is refused with
:class:`~polyhal.frontends.onnx.errors.OnnxUnsupportedError` saying what to install.
"""

from __future__ import annotations

import io

import numpy as np

from polyhal.distribution import install_hint
from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.errors import OnnxInputError, OnnxModelError, OnnxUnsupportedError

#: ImageDecoder's pixel formats and the Pillow mode each decodes to.
PIXEL_FORMATS = {"RGB": "RGB", "BGR": "RGB", "Grayscale": "L"}


def decode_image(encoded: np.ndarray, pixel_format: str = "RGB") -> np.ndarray:
    """The pixels of the image whose file bytes ``encoded`` holds, uint8 ``[H, W, 3]`` (RGB or
    BGR; an image with alpha or a palette is converted, as ONNX defines three channels) or
    ``[H, W, 1]`` (Grayscale). OnnxInputError when the bytes are no image Pillow can read."""
    from PIL import Image  # the optional extra, checked when the model is imported

    try:
        with Image.open(io.BytesIO(np.ascontiguousarray(encoded, np.uint8).tobytes())) as img:
            pixels = np.asarray(img.convert(PIXEL_FORMATS[pixel_format]))
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise OnnxInputError(f"ImageDecoder: the {encoded.size} input bytes are not an image Pillow can decode "
                             f"({type(exc).__name__}: {exc})") from None
    if pixel_format == "Grayscale":
        pixels = pixels[:, :, None]
    elif pixel_format == "BGR":
        pixels = pixels[:, :, ::-1]
    return np.ascontiguousarray(pixels)


@converter("ImageDecoder")
def _image_decoder(ctx: NodeContext) -> list:
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        raise OnnxUnsupportedError("ImageDecoder decodes images with Pillow, polyhal's optional 'images' extra, "
                                   f"which is not installed: {install_hint('polyhal', 'images')} (or decode the images "
                                   "before the model and feed the pixel arrays)") from None
    pixel_format = ctx.attr("pixel_format", "RGB")
    if pixel_format not in PIXEL_FORMATS:
        raise OnnxModelError(f"ImageDecoder's pixel_format is {pixel_format!r}; ONNX defines "
                             f"{', '.join(PIXEL_FORMATS)}")
    encoded = ctx.input(0)
    if ctx.dtype(encoded) != np.uint8 or ctx.rank(encoded) != 1:
        raise OnnxModelError(f"ImageDecoder's input is {ctx.type(encoded)}; ONNX's is the file's bytes, a 1-D uint8 "
                             "tensor")
    return [ctx.host(decode_image, encoded, pixel_format, dtype=np.uint8, shape=None,
                     what=f"the image {ctx.label} decodes")]
