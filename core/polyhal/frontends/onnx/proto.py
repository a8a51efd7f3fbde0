"""ONNX's protobuf messages, and the few conversions that importing a model of the common element
types needs, without ``import onnx`` until something else is asked for.

``import onnx`` imports ml_dtypes (``onnx._mapping`` builds its type table from ml_dtypes' types
at import), whose extension registers some 38,000 ufunc promoters with numpy (ml_dtypes 0.7),
each after a linear scan of the ufunc's loops for a duplicate: 0.5 s of CPU on the 2-core VM
(ml_dtypes 0.6 took 0.01 s), half of what a later ``polyhal run`` of the README's model took in
all (issue 30). The model itself needs none of it: the messages are protobuf's, the usual
initializers are raw little-endian bytes and the attributes plain fields. So this module gives

- :data:`pb`: the module of ONNX's messages (``ModelProto``, ``TensorProto``, ...). Where onnx
  is already imported it is ``onnx.onnx_ml_pb2``; else onnx's generated ``onnx_ml_pb2.py`` is
  executed alone, under a private module name. With protobuf's upb runtime (protobuf 4.21 on)
  the message classes are made once per descriptor and the descriptor pool takes the same file
  once, so a later ``import onnx`` finds the very same classes (``onnx.ModelProto is
  pb.ModelProto``; tests/test_onnx_proto.py holds it to that). With another runtime, or an onnx
  whose files are laid out otherwise, ``onnx`` is imported as before;
- :func:`np_dtype_of`, :func:`elem_type_of`, :func:`elem_type_name`, :func:`to_array`,
  :func:`attribute_value`, :func:`tensor_value_info`: onnx's ``helper``/``numpy_helper`` answers for the common cases,
  computed here; every other case (bfloat16, float8, 4- and 2-bit types, external data, a
  big-endian host) is handed to onnx's own functions;
- :func:`onnx_package`: ``onnx`` itself, imported on first use (the checker, shape inference,
  op schemas and everything else).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Sequence

import numpy as np

__all__ = ["attribute_value", "elem_type_name", "elem_type_of", "np_dtype_of", "onnx_package", "pb", "tensor_value_info",
           "to_array"]

#: The private name under which onnx's message module runs when onnx itself is not imported.
_PRIVATE_NAME = "polyhal.frontends.onnx._onnx_ml_pb2"


def onnx_package() -> ModuleType:
    """The ``onnx`` package (imported on first use: it costs ml_dtypes' import, see above)."""
    import onnx

    return onnx


def _messages() -> ModuleType:
    """ONNX's message module: onnx's own where onnx is imported or where running its file alone
    would not give the same classes (see the module docstring)."""
    if "onnx" not in sys.modules:
        try:
            from google.protobuf.internal import api_implementation

            spec = importlib.util.find_spec("onnx")  # finds the package without running it
            if api_implementation.Type() == "upb" and spec is not None and spec.submodule_search_locations:
                path = os.path.join(list(spec.submodule_search_locations)[0], "onnx_ml_pb2.py")
                alone = importlib.util.spec_from_file_location(_PRIVATE_NAME, path)
                if alone is not None and alone.loader is not None and os.path.isfile(path):
                    module = importlib.util.module_from_spec(alone)
                    alone.loader.exec_module(module)
                    return module
        except (ImportError, OSError, AttributeError, ValueError):
            pass  # onnx as before: its own import says what is wrong
    import onnx.onnx_ml_pb2

    return onnx.onnx_ml_pb2


pb = _messages()

_T = pb.TensorProto
#: ONNX element types whose numpy dtype is numpy's own, as onnx's ``tensor_dtype_to_np_dtype`` maps them.
_NUMPY_TYPES: dict[int, np.dtype] = {
    _T.FLOAT: np.dtype(np.float32), _T.UINT8: np.dtype(np.uint8), _T.INT8: np.dtype(np.int8),
    _T.UINT16: np.dtype(np.uint16), _T.INT16: np.dtype(np.int16), _T.INT32: np.dtype(np.int32),
    _T.INT64: np.dtype(np.int64), _T.STRING: np.dtype(object), _T.BOOL: np.dtype(np.bool_),
    _T.FLOAT16: np.dtype(np.float16), _T.DOUBLE: np.dtype(np.float64), _T.UINT32: np.dtype(np.uint32),
    _T.UINT64: np.dtype(np.uint64), _T.COMPLEX64: np.dtype(np.complex64), _T.COMPLEX128: np.dtype(np.complex128),
}
_ELEM_TYPES = {dtype: elem for elem, dtype in _NUMPY_TYPES.items() if elem != _T.STRING}
#: Element types whose data a typed field holds as that very numpy type (no conversion).
_TYPED_FIELDS = {_T.FLOAT: "float_data", _T.DOUBLE: "double_data", _T.INT32: "int32_data", _T.INT64: "int64_data"}
_LITTLE = sys.byteorder == "little"


def np_dtype_of(elem_type: int) -> np.dtype:
    """``onnx.helper.tensor_dtype_to_np_dtype(elem_type)``."""
    found = _NUMPY_TYPES.get(elem_type)
    return found if found is not None else onnx_package().helper.tensor_dtype_to_np_dtype(elem_type)


def elem_type_of(dtype: Any) -> int:
    """``onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))``."""
    dtype = np.dtype(dtype)
    found = _ELEM_TYPES.get(dtype)
    return found if found is not None else onnx_package().helper.np_dtype_to_tensor_dtype(dtype)


def elem_type_name(elem_type: int) -> str:
    """``onnx.helper.tensor_dtype_to_string(elem_type)`` (``"TensorProto.FLOAT"``)."""
    if elem_type in _NUMPY_TYPES:
        return f"TensorProto.{_T.DataType.Name(elem_type)}"
    return onnx_package().helper.tensor_dtype_to_string(elem_type)


def to_array(tensor: Any) -> np.ndarray:
    """``onnx.numpy_helper.to_array(tensor)``: a tensor of numpy's own types holding its data in
    ``raw_data`` (a little-endian host) or in its typed field is read here, any other by onnx."""
    elem = tensor.data_type
    dtype = _NUMPY_TYPES.get(elem)
    if (dtype is None or elem == _T.STRING or tensor.HasField("segment")
            or (tensor.HasField("data_location") and tensor.data_location == _T.EXTERNAL)):
        return onnx_package().numpy_helper.to_array(tensor)
    if tensor.HasField("raw_data"):
        if not _LITTLE:
            return onnx_package().numpy_helper.to_array(tensor)
        return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(tensor.dims)
    field = _TYPED_FIELDS.get(elem)
    if field is None:
        return onnx_package().numpy_helper.to_array(tensor)
    return np.asarray(getattr(tensor, field), dtype=dtype).reshape(tensor.dims)


_A = pb.AttributeProto
#: How onnx's ``helper.get_attribute_value`` reads each attribute type: (field, as a list).
_ATTRIBUTE_FIELDS = {
    _A.FLOAT: ("f", False), _A.INT: ("i", False), _A.STRING: ("s", False), _A.TENSOR: ("t", False),
    _A.SPARSE_TENSOR: ("sparse_tensor", False), _A.GRAPH: ("g", False), _A.TYPE_PROTO: ("tp", False),
    _A.FLOATS: ("floats", True), _A.INTS: ("ints", True), _A.STRINGS: ("strings", True),
    _A.TENSORS: ("tensors", True), _A.SPARSE_TENSORS: ("sparse_tensors", True), _A.GRAPHS: ("graphs", True),
    _A.TYPE_PROTOS: ("type_protos", True),
}


def attribute_value(attr: Any) -> Any:
    """``onnx.helper.get_attribute_value(attr)`` (a reference attribute, or an unknown type, is
    handed to it, and it raises as it does)."""
    how = _ATTRIBUTE_FIELDS.get(attr.type)
    if attr.ref_attr_name or (how is None and attr.type != _A.UNDEFINED):
        return onnx_package().helper.get_attribute_value(attr)
    if how is None:
        return None
    field, repeated = how
    value = getattr(attr, field)
    return list(value) if repeated else value


def tensor_value_info(name: str, elem_type: int, shape: Sequence[int | str | None] | None) -> Any:
    """``onnx.helper.make_tensor_value_info(name, elem_type, shape)``: a ``ValueInfoProto`` of a
    tensor (a dim: an int size, a str symbol, None unknown; ``shape`` None: unknown rank)."""
    info = pb.ValueInfoProto()
    info.name = name
    tensor = info.type.tensor_type
    tensor.elem_type = elem_type
    if shape is not None:
        tensor.shape.SetInParent()  # an empty shape is a shape (rank 0), not an unknown one
        for d in shape:
            dim = tensor.shape.dim.add()
            if isinstance(d, str):
                dim.dim_param = d
            elif d is not None:
                dim.dim_value = int(d)
    return info
