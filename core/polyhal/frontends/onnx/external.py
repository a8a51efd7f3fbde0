"""External tensor data: the bytes of a tensor kept in a file beside the model, read from the
model's folder and from nowhere else.

ONNX lets any tensor (an initializer at any depth, a ``Constant``'s value, a sparse tensor's
values and indices, a tensor attribute inside a function) say ``data_location: EXTERNAL`` and
name a file, an offset and a length. A model is data from wherever it came from, so
:func:`load_external_data` is the one place that follows those names, with these rules:

* the file is named relative to the model's folder: no absolute path, no ``..`` component,
  no NUL byte; a symbolic link is followed only while it stays inside the folder;
* offset and length lie within the file, and the bytes are exactly what the tensor's type and
  dims need (so a lying tensor cannot make the import read a large file it does not use);
* a model with no folder (read from bytes or given as a ModelProto) with external data is
  refused, never resolved against the process's working directory.

onnx's own loader (``onnx.external_data_helper``) does the opening and the reading: it accepts
only the keys the spec defines, non-negative offsets and lengths, opens the file beneath the
folder without following any link, refuses what is not a regular file and checks offset and
length against the file's size. What this module adds is what onnx does not do: its walk skips
sparse tensors, its checker lets ``sub/../file`` through and refuses every link (even one to a
file beside the model), it does not compare the length with the tensor's dims, and given no
folder it resolves names against the working directory.
"""

from __future__ import annotations

import math
import os
import re
from typing import Iterator

import numpy as np

from polyhal.frontends.onnx.errors import OnnxModelError, first_line
from polyhal.frontends.onnx.proto import np_dtype_of, onnx_package, pb, to_array

__all__ = ["load_external_data", "tensor_array"]

_ATTR = pb.AttributeProto
#: Attribute types that hold tensors, or graphs that may.
_HOLDS_TENSORS = frozenset({_ATTR.TENSOR, _ATTR.TENSORS, _ATTR.SPARSE_TENSOR, _ATTR.SPARSE_TENSORS, _ATTR.GRAPH,
                            _ATTR.GRAPHS})
#: Bits per element of the types ONNX packs several to a byte.
_SUB_BYTE_BITS = {getattr(pb.TensorProto, name): bits for name, bits in [
    ("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2)] if hasattr(pb.TensorProto, name)}


def load_external_data(model: pb.ModelProto, folder: str | None, source: str) -> int:
    """Read into ``model`` the data of every tensor that keeps it in an external file, from
    ``folder`` (the folder of the model's file; None for a model that has none), with the rules
    of the module doc; afterwards no tensor of ``model`` points at a file. Returns how many
    tensors were read (0: the model's own bytes are the whole model).

    Raises:
        OnnxModelError: a file outside the folder, missing, too short or of the wrong size, or
            external data in a model with no folder (nothing of ``model`` is changed then).
    """
    read = 0
    for where, tensor in _tensors(model):
        if tensor.data_location != pb.TensorProto.EXTERNAL:
            continue
        what = f"{source}: {where}"
        if folder is None:
            raise OnnxModelError(f"{what} keeps its data in an external file ({_location(tensor)!r}), and a model "
                                 "given as bytes, a file object or a ModelProto has no folder to find it in; load the "
                                 "model from its path (polyhal.onnx.load('folder/model.onnx'), polyhal run PATH)")
        _read(tensor, folder, what)
        read += 1
    return read


def tensor_array(tensor: pb.TensorProto, what: str) -> np.ndarray:
    """``numpy_helper.to_array`` of a tensor that holds its data; a tensor still pointing at an
    external file is refused, since to_array would look for it in the working directory."""
    if tensor.data_location == pb.TensorProto.EXTERNAL:
        raise OnnxModelError(f"{what} keeps its data in an external file ({_location(tensor)!r}); load the "
                             "model from its path so that the file is read from the model's folder")
    return to_array(tensor)


def _tensors(model: pb.ModelProto) -> Iterator[tuple[str, pb.TensorProto]]:
    """(where, tensor) for every TensorProto of ``model``, at every depth: initializers and
    sparse initializers of the graph and of every subgraph, and tensor attributes of every node
    (graphs, functions and training graphs alike). A stack, not recursion: nesting is data.
    Attributes are taken by their type, as everything that reads them does (a tensor set on an
    attribute of another type is never read); labels are made only for what is yielded."""
    stack: list[tuple[str, pb.GraphProto | pb.FunctionProto]] = [("", model.graph)]
    stack += [(f"function {f.name!r} > ", f) for f in model.functions]
    stack += [(f"training graph {g.name!r} > ", g) for t in model.training_info for g in (t.initialization, t.algorithm)]
    while stack:
        where, graph = stack.pop()
        if isinstance(graph, pb.GraphProto):
            for t in graph.initializer:
                yield f"{where}initializer {t.name!r}", t
            for s in graph.sparse_initializer:
                yield from _sparse(f"{where}sparse initializer {s.values.name!r}", s)
        for node in graph.node:
            for a in node.attribute:
                if a.type not in _HOLDS_TENSORS:
                    continue
                label = f"{where}{node.op_type} node {node.name or (node.output[0] if node.output else '')!r}"
                here = f"{label} attribute {a.name!r}"
                if a.type == _ATTR.TENSOR:
                    yield here, a.t
                elif a.type == _ATTR.TENSORS:
                    yield from ((here, t) for t in a.tensors)
                elif a.type == _ATTR.SPARSE_TENSOR:
                    yield from _sparse(here, a.sparse_tensor)
                elif a.type == _ATTR.SPARSE_TENSORS:
                    for s in a.sparse_tensors:
                        yield from _sparse(here, s)
                elif a.type == _ATTR.GRAPH:
                    stack.append((f"{label} > {a.name} > ", a.g))
                else:
                    stack.extend((f"{label} > {a.name}[{i}] > ", g) for i, g in enumerate(a.graphs))


def _sparse(where: str, sparse: pb.SparseTensorProto) -> Iterator[tuple[str, pb.TensorProto]]:
    yield f"{where} (values)", sparse.values
    yield f"{where} (indices)", sparse.indices


def _location(tensor: pb.TensorProto) -> str:
    return next((e.value for e in reversed(tensor.external_data) if e.key == "location"), "")  # onnx: the last


def _read(tensor: pb.TensorProto, folder: str, what: str) -> None:
    try:
        info = onnx_package().external_data_helper.ExternalDataInfo(tensor)  # onnx: spec keys only, offset and length non-negative integers
    except ValueError as exc:
        raise OnnxModelError(f"{what} has malformed external data: {exc}") from None
    folder = os.path.realpath(folder)
    relative = _inside(folder, info.location, what)
    path = os.path.join(folder, relative)
    need = _nbytes(tensor, what)
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise OnnxModelError(f"{what}: cannot read its external data {info.location!r}: {exc.strerror}") from None
    offset = info.offset or 0
    length = size - offset if info.length is None else info.length
    if offset < 0 or length < 0 or offset + length > size:
        raise OnnxModelError(f"{what} keeps its data at offset {offset}, length {length} of {info.location!r}, "
                             f"outside that file ({size} bytes); the file is truncated, or not this model's")
    if length != need:
        raise OnnxModelError(f"{what} needs {need} bytes for its type and dims {list(tensor.dims)}, but its "
                             f"external data in {info.location!r} holds {length}; the file is not this model's")
    # onnx reads the link-free path: onnx 1.23 opens it beneath the folder following no link (so
    # a link swapped in since the checks above is refused) and checks offset and length again.
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = relative
    onnx = onnx_package()
    try:
        onnx.external_data_helper.load_external_data_for_tensor(tensor, folder)
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:
        raise OnnxModelError(f"{what}: cannot read its external data: {first_line(exc)}") from None
    if len(tensor.raw_data) != need:  # the file changed under us
        raise OnnxModelError(f"{what}: {info.location!r} changed while it was read; load the model again")
    tensor.data_location = pb.TensorProto.DEFAULT
    del tensor.external_data[:]


def _inside(folder: str, location: str, what: str) -> str:
    """``location`` as a path relative to ``folder`` with no link in it, checked to name a
    regular file inside ``folder`` (links are resolved, and must stay inside)."""
    refused = ("names no file" if not location else
               "contains a NUL byte" if "\0" in location else
               "is an absolute path" if os.path.isabs(location) or re.match(r"[A-Za-z]:|[/\\]", location) else
               "has a '..' component" if ".." in re.split(r"[/\\]", location) else None)
    if refused:
        raise OnnxModelError(f"{what} keeps its data in {location!r}, which {refused}; external data must be a "
                             "file inside the model's folder, named relative to it (no name that points outside)")
    try:
        target = os.path.realpath(os.path.join(folder, location), strict=True)
    except OSError as exc:  # missing, a dangling link, a loop of links, a name too long
        raise OnnxModelError(f"{what} keeps its data in {location!r}, which cannot be opened in the model's folder "
                             f"({folder}): {exc.strerror}; copy the model's data files beside it") from None
    if os.path.commonpath([folder, target]) != folder:
        raise OnnxModelError(f"{what} keeps its data in {location!r}, a symbolic link that points outside the "
                             f"model's folder ({folder}); external data must be a file inside that folder")
    if not os.path.isfile(target):
        raise OnnxModelError(f"{what} keeps its data in {location!r}, which is not a regular file; external data "
                             "must be a file inside the model's folder")
    return os.path.relpath(target, folder)


def _nbytes(tensor: pb.TensorProto, what: str) -> int:
    """The bytes a tensor's type and dims take as raw data."""
    if tensor.data_type == pb.TensorProto.STRING:
        raise OnnxModelError(f"{what} is a string tensor with external data; ONNX keeps strings in the model")
    try:
        itemsize = np_dtype_of(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        raise OnnxModelError(f"{what} has element type {tensor.data_type}, which ONNX does not define") from None
    if any(d < 0 for d in tensor.dims):
        raise OnnxModelError(f"{what} declares negative dims {list(tensor.dims)}")
    count = math.prod(tensor.dims)
    bits = _SUB_BYTE_BITS.get(tensor.data_type)
    return count * itemsize if bits is None else (count * bits + 7) // 8

