"""The storage-only element types on GPU backends: how buffers hold them, and their conversions.

The IR's storage types (:data:`polyhal.ir.types.STORAGE_DTYPES`: bfloat16, float8 in five forms,
float4e2m1, int4/uint4/int2/uint2) live in device memory exactly as ml_dtypes keeps them on the
host: one element per byte (two for bfloat16), a sub-byte integer in the low bits of its byte.
Uploads, downloads and DLPack therefore move their bytes unchanged; a backend whose arrays have
no such dtypes (cupy) views them as the unsigned integers of the same width (:func:`bits_dtype`).

GPU kernel tables hold these types in :data:`STORAGE_OPS` only: ``cast`` converts (to and from
every element type, through float32 as ml_dtypes does), ``identity`` and ``bitcast`` move bits.
Arithmetic on them happens after a cast to a compute type, as the ONNX front end emits it.

The conversions are C, written once in ``c/storage_types.h`` for OpenCL C, CUDA and HIP alike
(:func:`source`); :func:`cast_expr` writes the C expression of one conversion, which the backends
put in their elementwise kernels.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import numpy as np

from polyhal.ir.types import STORAGE_DTYPES, DTypeSet, storage_bits

#: The conversion source, under ``polyhal_gpu/cu/``.
SOURCE = "storage_types.h"
#: The ops whose GPU kernels take storage-typed operands (see the module docstring).
STORAGE_OPS = frozenset({"cast", "identity", "bitcast"})
#: The sub-byte integer types: decoded to ``int``, encoded from ``int`` (wrapping).
#: (ml_dtypes' types all report numpy kind 'V'.) A DTypeSet: asking imports no ml_dtypes (0.5 s
#: with 0.7: see polyhal.frontends.onnx.proto) where none of its types can exist yet, as when a
#: backend lists its devices and kernels.
_INTEGER = DTypeSet(("int4", "uint4", "int2", "uint2"))
#: The sources wider than float32 (C type in ``c/storage_types.h``): rounded to float32 to odd,
#: so that encoding them rounds once, from their own value.
_WIDE = {np.dtype(np.float64): "double", np.dtype(np.int32): "int", np.dtype(np.uint32): "unsigned int",
         np.dtype(np.int64): "ph_long", np.dtype(np.uint64): "ph_ulong"}


@functools.lru_cache(maxsize=None)
def source() -> str:
    """The text of ``c/storage_types.h``: the ``ph_decode_<type>`` / ``ph_encode_<type>``
    functions of every storage type (``<type>`` is the numpy dtype's name)."""
    return (resources.files("polyhal_gpu") / "c" / SOURCE).read_text(encoding="utf-8")


def is_storage(dtype: Any) -> bool:
    """Whether ``dtype`` is one of the storage-only element types."""
    return np.dtype(dtype) in STORAGE_DTYPES


#: The unsigned integer type that holds a storage type's bits (``dtype`` itself otherwise).
bits_dtype = storage_bits


def cast_expr(src: Any, dst: Any, value: str) -> str:
    """The C expression converting ``value`` from ``src`` to ``dst`` as ml_dtypes' astype does,
    where at least one of them is a storage type. ``value`` is a storage source's raw bits, or
    a compute source's value (float for float16); the result is a storage destination's bits,
    or for a compute destination a value its store converts as C does (float to integer
    truncates; nonzero is true for bool). Every conversion between a storage type and another
    type goes through float32 (exact for all of them); a float64 or wide integer gets there
    rounded to odd, so that it rounds once, as ml_dtypes (0.7 on) rounds it. A real converted to
    a sub-byte integer truncates toward zero, and is 0 where that leaves the type's range (nan
    and inf too), as in ml_dtypes 0.7; integers wrap."""
    src, dst = np.dtype(src), np.dtype(dst)
    real = src.kind == "f"
    if src in STORAGE_DTYPES:
        real = src not in _INTEGER
        value = f"ph_decode_{src.name}({value})"
    if dst in STORAGE_DTYPES:
        if dst not in _INTEGER:
            if src in _WIDE:
                value = f"ph_round_to_odd(ph_rtz({value}), ({_WIDE[src]})ph_rtz({value}) != ({value}))"
            return f"ph_encode_{dst.name}((float)({value}))"
        if real:  # range checked before converting: C leaves (int) of nan and large values undefined
            import ml_dtypes  # (imported already: ``dst`` is one of its types)

            info = ml_dtypes.iinfo(dst)
            value = f"(({value}) > {info.min - 1}.0f && ({value}) < {info.max + 1}.0f ? (int)({value}) : 0)"
        return f"ph_encode_{dst.name}((int)({value}))"
    if dst.kind == "b":
        return f"(({value}) != 0)"
    return f"(float)({value})" if dst.kind == "f" else value
