"""Reading a model file's large initializers straight into arrays, past protobuf.

Parsing a model file into an ``onnx.ModelProto`` holds its weights in protobuf's arena (freed
only with the whole message), and the importer's arrays are a second copy: a transformer's
import peaked at twice its weights (DistilBERT: 568 MB against onnxruntime's 406). So
:func:`read_split` walks the file's protobuf wire format itself (ModelProto.graph ->
GraphProto.initializer -> TensorProto.raw_data), parses a copy of the model without the large
``raw_data`` fields (small: the graph's structure), and reads each of those fields from the file
into an array of its own, which the program then holds as its constant. The file is read through
a read-only mapping for its structure only (the weight bytes are read with ``readinto``, so they
are never mapped into this process twice).

Only top-level initializers of plain numeric types (what ``raw_data`` stores as little-endian
elements) are taken; anything else stays in the ModelProto as before. A file whose wire
format this reader does not follow (a repeated graph field, an unknown wire type) is left to
protobuf's parser, which reports what is wrong with it; so is one with more than
:data:`MAX_FIELDS` fields to walk, since a walk in Python costs ~0.5 us a field where protobuf's
compiled parser decides in microseconds: 64 MiB of two-byte fields took 15 s to walk before
protobuf rejected the file in 0.04 s. Real models have fewer (a node, an initializer or a
value_info is one graph field: a transformer of 50k nodes has ~10^5); one that has more is read
whole, holding its weights twice while it loads.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from polyhal.frontends.onnx.proto import pb

# Field numbers of onnx.proto3.
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_RAW_DATA, _TENSOR_DATA_LOCATION = 2, 8, 9, 14
_LENGTH_DELIMITED = 2

#: The most fields (of the model, its graph and its initializers together) the reader walks
#: before leaving the file to protobuf's parser: a quarter of a second of walking at most.
MAX_FIELDS = 1 << 18

#: Element types whose raw_data is the array's little-endian bytes.
_PLAIN = {getattr(pb.TensorProto, t): np.dtype(d) if np.little_endian else np.dtype(d).newbyteorder("<")
          for t, d in [
    ("FLOAT", np.float32), ("DOUBLE", np.float64), ("FLOAT16", np.float16), ("INT8", np.int8),
    ("INT16", np.int16), ("INT32", np.int32), ("INT64", np.int64), ("UINT8", np.uint8),
    ("UINT16", np.uint16), ("UINT32", np.uint32), ("UINT64", np.uint64), ("BOOL", np.bool_)]}


class WireFormatError(ValueError):
    """The file's wire format is not what this reader follows (protobuf's parser then decides)."""


def read_split(f: BinaryIO, larger_than: int) -> tuple[bytes, dict[str, np.ndarray]] | None:
    """The serialized model of file ``f`` without the ``raw_data`` of its top-level
    initializers of more than ``larger_than`` bytes, and those initializers' data as flat
    read-only arrays of their element type, by name; None when there are none to take or the
    file is not read this way (the caller parses it whole)."""
    try:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            stripped, spans = _split(buf, larger_than)
    except (OSError, ValueError, IndexError):  # empty, unmappable, or not followed: parse it whole
        return None
    if not spans:
        return None
    arrays = {}
    for name, (dtype, start, size) in spans.items():
        arr = np.empty(size // dtype.itemsize, dtype)
        f.seek(start)
        if f.readinto(memoryview(arr).cast("B")) != size:
            return None
        arr.flags.writeable = False
        arrays[name] = arr
    return stripped, arrays


def _split(buf, larger_than: int) -> tuple[bytes, dict[str, tuple[np.dtype, int, int]]]:
    out, spans, graphs = bytearray(), {}, 0
    budget = [MAX_FIELDS]  # fields left to walk, shared by every level
    for number, wire, start, value, end in _fields(buf, 0, len(buf), budget):
        if number != _MODEL_GRAPH or wire != _LENGTH_DELIMITED:
            out += buf[start:end]
            continue
        graphs += 1
        if graphs > 1:
            raise WireFormatError("the graph field occurs twice (protobuf merges them)")
        graph = bytearray()
        for g_number, g_wire, g_start, g_value, g_end in _fields(buf, value, end, budget):
            taken = None
            if g_number == _GRAPH_INITIALIZER and g_wire == _LENGTH_DELIMITED:
                taken = _take_raw_data(buf, g_value, g_end, larger_than, budget)
            if taken is None:
                graph += buf[g_start:g_end]
                continue
            tensor, name, span = taken
            if name in spans:
                raise WireFormatError(f"initializer {name!r} occurs twice")
            spans[name] = span
            graph += _key(_GRAPH_INITIALIZER) + _varint_bytes(len(tensor)) + tensor
        out += _key(_MODEL_GRAPH) + _varint_bytes(len(graph)) + graph
    return bytes(out), spans


def _take_raw_data(buf, start: int, end: int, larger_than: int, budget: list[int]):
    """``(tensor bytes without raw_data, name, (dtype, offset, size))`` for a TensorProto at
    ``buf[start:end]`` whose raw_data is large and plain; None to keep the tensor whole."""
    name = data_type = raw = None
    external = False
    kept = bytearray()
    for number, wire, f_start, value, f_end in _fields(buf, start, end, budget):
        if number == _TENSOR_RAW_DATA and wire == _LENGTH_DELIMITED:
            if raw is not None:
                return None  # repeated: protobuf keeps the last; leave it to protobuf
            raw = (value, f_end - value)
            continue
        if number == _TENSOR_NAME and wire == _LENGTH_DELIMITED:
            name = bytes(buf[value:f_end]).decode("utf-8")
        elif number == _TENSOR_DATA_TYPE and wire == 0:
            data_type = _varint(buf, value)[0]
        elif number == _TENSOR_DATA_LOCATION and wire == 0:
            external = _varint(buf, value)[0] == pb.TensorProto.EXTERNAL
        kept += buf[f_start:f_end]
    dtype = _PLAIN.get(data_type)
    if raw is None or raw[1] <= larger_than or external or dtype is None or not name or raw[1] % dtype.itemsize:
        return None
    return bytes(kept), name, (dtype, raw[0], raw[1])


def _fields(buf, pos: int, end: int, budget: list[int]) -> Iterator[tuple[int, int, int, int, int]]:
    """``(field number, wire type, field start, value start, field end)`` of each field in
    ``buf[pos:end]``, each one taken from ``budget[0]``: WireFormatError when it runs out."""
    while pos < end:
        budget[0] -= 1
        if budget[0] < 0:
            raise WireFormatError(f"more than {MAX_FIELDS} fields to walk")
        start = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = pos, _varint(buf, pos)[1]
        elif wire == 1:
            value, pos = pos, pos + 8
        elif wire == _LENGTH_DELIMITED:
            size, value = _varint(buf, pos)
            pos = value + size
        elif wire == 5:
            value, pos = pos, pos + 4
        else:
            raise WireFormatError(f"wire type {wire} at byte {start}")
        if pos > end:
            raise WireFormatError(f"a field at byte {start} runs past its message")
        yield number, wire, start, value, pos


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireFormatError(f"a varint at byte {pos} runs over 10 bytes")


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(number: int) -> bytes:
    return _varint_bytes(number << 3 | _LENGTH_DELIMITED)
