"""What the ONNX importer and its converters share: element types and the value kinds of the
importer's environment.

The converters (:mod:`polyhal.frontends.onnx.converters`) are called by the importer
(:mod:`polyhal.frontends.onnx.importer`) and never import it; what both need lives here.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.ir.program import Value
from polyhal.ir.types import SUPPORTED_DTYPES


def np_dtype(elem_type: int, what: str) -> np.dtype:
    """The numpy dtype of ONNX element type ``elem_type``; OnnxUnsupportedError naming
    ``what`` for those polyhal lacks (string, bfloat16, float8, int4, complex, ...)."""
    try:
        name = onnx.TensorProto.DataType.Name(elem_type)
    except ValueError:
        raise OnnxModelError(f"{what} has element type {elem_type}, which is not an ONNX type") from None
    if elem_type == onnx.TensorProto.UNDEFINED:
        raise OnnxModelError(f"{what} has no element type")
    try:
        dt = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:  # noqa: BLE001  (onnx raises several types for unmapped ones)
        dt = None
    if dt is None or dt not in SUPPORTED_DTYPES or name in ("BFLOAT16",) or name.startswith(("FLOAT8", "FLOAT4")):
        supported = ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
        raise OnnxUnsupportedError(f"{what} has element type {name}, which polyhal does not support "
                                   f"(supported: {supported})")
    return dt


def onnx_elem_type(dtype: np.dtype) -> int:
    """The ONNX element type of numpy ``dtype``."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


class Dynamic:
    """A value whose first dim is known only at run time: ``padded`` (the value padded to a
    static bound) and ``count`` (an int64 scalar, the real length). Only a model output may be
    one; the plan returns both and :meth:`OnnxProgram.execute` cuts."""

    def __init__(self, padded: Value, count: Value, what: str) -> None:
        self.padded, self.count, self.what = padded, count, what


class HostOutput:
    """A model output that the plan computes as a tensor (``value``) and the front end turns
    into what ONNX declares, on the host, with ``finish``: string class labels from their
    indices, a sequence of maps from a probability matrix (ZipMap). polyhal has no string,
    sequence or map values, so only a model output may be one; :meth:`OnnxProgram.execute`
    applies ``finish``."""

    def __init__(self, value: Value | np.ndarray, finish, what: str) -> None:
        self.value, self.finish, self.what = value, finish, what

    @property
    def reason(self) -> str:
        return (f"it is {self.what}, which polyhal makes on the host after the run, so it can only be a "
                "model output")


__all__ = ["Dynamic", "HostOutput", "np_dtype", "onnx_elem_type"]
