"""What the ONNX importer and its converters share: element types and the value kinds of the
importer's environment.

The converters (:mod:`polyhal.frontends.onnx.converters`) are called by the importer
(:mod:`polyhal.frontends.onnx.importer`) and never import it; what both need lives here.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from polyhal.frontends.onnx.errors import OnnxInputError, OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.proto import elem_type_of, np_dtype_of, pb
from polyhal.ir.program import Value
from polyhal.ir.types import SUPPORTED_DTYPES


def np_dtype(elem_type: int, what: str) -> np.dtype:
    """The numpy dtype of ONNX element type ``elem_type``; OnnxUnsupportedError naming
    ``what`` for those polyhal lacks (string, complex). bfloat16, float8, float4 and
    int4/uint4/int2/uint2 are ml_dtypes' numpy types, the IR's storage types."""
    try:
        name = pb.TensorProto.DataType.Name(elem_type)
    except ValueError:
        raise OnnxModelError(f"{what} has element type {elem_type}, which is not an ONNX type") from None
    if elem_type == pb.TensorProto.UNDEFINED:
        raise OnnxModelError(f"{what} has no element type")
    try:
        dt = np.dtype(np_dtype_of(elem_type))
    except Exception:  # noqa: BLE001  (onnx raises several types for unmapped ones)
        dt = None
    if dt is None or dt not in SUPPORTED_DTYPES:
        supported = ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
        raise OnnxUnsupportedError(f"{what} has element type {name}, which polyhal does not support "
                                   f"(supported: {supported})")
    return dt


def onnx_elem_type(dtype: np.dtype) -> int:
    """The ONNX element type of numpy ``dtype``."""
    return elem_type_of(dtype)


class Dynamic:
    """A value whose dim ``axis`` (default the first) is known only at run time: ``padded`` (the
    value padded to a static bound) and ``count`` (an int64 scalar, the real length). Only a
    model output may be one; the plan returns both and :meth:`OnnxProgram.execute` cuts (a staged
    model ends a segment there, so later ops see the cut value)."""

    def __init__(self, padded: Value, count: Value, what: str, axis: int = 0) -> None:
        self.padded, self.count, self.what, self.axis = padded, count, what, axis


#: ONNX's string element type, and the numpy dtype polyhal's front end holds strings in (arrays
#: of Python ``str``; device buffers cannot hold them, see :class:`HostValue`).
STRING = pb.TensorProto.STRING
STRING_DTYPE = np.dtype(object)


def value_dtype(elem_type: int, what: str) -> np.dtype:
    """As :func:`np_dtype`, but strings are :data:`STRING_DTYPE` (values the front end keeps on
    the host) instead of unsupported."""
    return STRING_DTYPE if elem_type == STRING else np_dtype(elem_type, what)


def is_strings(x: Any) -> bool:
    """Whether ``x`` (an array, a :class:`HostValue`, anything else) holds strings."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and np.dtype(dtype).kind in "OUS"


def as_strings(x: Any, what: str) -> np.ndarray:
    """``x`` as an array of Python ``str`` (dtype object): from numpy ``str_``/``bytes_``
    arrays (bytes decode as UTF-8), object arrays of str/bytes, or lists. OnnxInputError
    naming ``what`` for anything else (numbers are not silently turned into text) and for
    bytes that are not UTF-8."""
    arr = np.asarray(x, dtype=object if isinstance(x, (list, tuple)) else None)
    if arr.dtype.kind not in "OUS":
        raise OnnxInputError(f"{what} holds strings, got an array of {arr.dtype}; give a numpy array of str "
                             "(e.g. np.array(['a', 'b']))")
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, item in enumerate(arr.reshape(-1)):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError as exc:
                index = tuple(int(k) for k in np.unravel_index(i, arr.shape)) if arr.ndim else ()
                raise OnnxInputError(f"{what}: element {list(index)} ({item[:32]!r}) is not UTF-8 ({exc.reason} at "
                                     f"byte {exc.start}); ONNX strings are UTF-8: decode the bytes with their own "
                                     "encoding and pass str") from None
        elif not isinstance(item, str):
            raise OnnxInputError(f"{what} holds strings, got an element of type {type(item).__name__} "
                                 f"({item!r}); give a numpy array of str")
        flat[i] = item
    return out


class HostValue:
    """A value the front end computes on the host, around the device plan: a string tensor (dtype
    object, elements Python ``str``), or numbers made from strings (``Equal`` of strings, a
    LabelEncoder from string keys).

    Device buffers hold fixed-size numbers, so polyhal keeps strings out of the plan: a string
    graph input is a HostValue leaf (``name``); a string op is a HostValue whose ``compute``
    takes its ``args`` (arrays known at import, program values, other HostValues) evaluated.
    When every arg is known at import the front end computes it then, and no HostValue is
    made. ``shape`` is None when it depends on the data (StringSplit, StringNormalizer's
    stopwords). At run time :meth:`OnnxProgram.execute` evaluates, before the plan, the
    HostValues that feed it (numbers entering the plan as extra inputs) and, after it, those
    that are model outputs. ``after_plan`` marks a HostValue that reads a result the plan
    computes: it can be an output, never a plan input (the host runs before and after the one
    plan, not between its ops).
    """

    def __init__(self, compute, args, dtype, shape, what: str, *, after_plan: bool = False,
                 name: str | None = None) -> None:
        self.compute, self.args = compute, tuple(args)
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.shape = None if shape is None else tuple(int(d) for d in shape)
        self.what, self.name = what, name
        self.after_plan = after_plan or any(getattr(a, "after_plan", False) for a in self.args)

    @property
    def reason(self) -> str:
        return f"it is {self.what}, which polyhal computes on the host"

    def evaluate(self, known: Mapping[Any, np.ndarray], memo: dict[int, Any]) -> Any:
        """This value, from ``known`` (graph input name or program value id -> array);
        ``memo`` (id -> result) makes a value shared by several consumers compute once."""
        found = memo.get(id(self))
        if found is not None:
            return found[1]
        if self.compute is None:
            result = known[self.name]
        else:
            args = [a.evaluate(known, memo) if isinstance(a, HostValue) else known[a.id] if isinstance(a, Value)
                    else a for a in self.args]
            result = self.compute(*args)
        memo[id(self)] = (self, result)  # the value kept alive, so its id is not reused
        return result

    def reads(self) -> tuple[list[str], list[Value]]:
        """The graph inputs (string leaves, by name) and program values (inputs or results of
        the plan) this value is computed from, each once."""
        names: dict[str, None] = {}
        values: dict[int, Value] = {}
        stack: list[HostValue] = [self]
        done: set[int] = set()
        while stack:
            v = stack.pop()
            if id(v) in done:
                continue
            done.add(id(v))
            if v.name is not None:
                names[v.name] = None
            for a in v.args:
                if isinstance(a, Value):
                    values.setdefault(a.id, a)
                elif isinstance(a, HostValue):
                    stack.append(a)
        return list(names), list(values.values())


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


__all__ = ["STRING", "STRING_DTYPE", "Dynamic", "HostOutput", "HostValue", "as_strings", "is_strings",
           "np_dtype", "onnx_elem_type", "value_dtype"]
