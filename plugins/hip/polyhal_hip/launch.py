"""Kernel arguments: packed into the kernarg buffer that ``hipModuleLaunchKernel`` takes.

AMDGPU kernels read their arguments from one buffer where each argument sits at an offset
aligned to its natural alignment (pointers and 64-bit scalars: 8 bytes; structs: their largest
member). :func:`pack` builds that buffer from Python values, so the launch does not depend on
how a particular version of the bindings marshals arguments:

* an object with a ``ptr`` attribute (:class:`~polyhal_hip.array.HipArray`, a buffer handle)
  is passed as its device address (8 bytes); ``None`` as a null pointer;
* a numpy scalar (``np.int64(n)``, ``np.float32(x)``, ``np.uint64(address)``) as its bytes;
* :class:`Raw` as given bytes with a given alignment (a struct passed by value).

Plain Python ints and floats are refused: their C type would be a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np


@dataclass(frozen=True)
class Raw:
    """Bytes passed by value (a C struct), aligned to ``align``."""

    data: bytes
    align: int = 8


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def pack(args: Iterable[Any]) -> bytes:
    """The kernarg buffer of ``args`` (see the module docstring)."""
    out = bytearray()
    for i, arg in enumerate(args):
        if arg is None:
            data, align = bytes(8), 8
        elif hasattr(arg, "ptr") and not isinstance(arg, np.generic):
            data, align = int(arg.ptr).to_bytes(8, "little"), 8
        elif isinstance(arg, np.generic):
            data, align = arg.tobytes(), arg.dtype.itemsize
        elif isinstance(arg, Raw):
            data, align = arg.data, arg.align
        else:
            raise TypeError(f"kernel argument {i} is a {type(arg).__name__} ({arg!r}); pass a numpy scalar "
                            "(np.int64, np.float32, np.uint64 for an address), an array, None or launch.Raw")
        out += bytes(_align(len(out), align) - len(out))
        out += data
    return bytes(out)


def dims_struct(rows: Iterable[Iterable[int]], max_dims: int = 8) -> Raw:
    """A struct of ``len(rows)`` arrays of ``max_dims`` ``long long`` (shapes, strides), as the
    kernels' ``Dims`` structs declare them; rows shorter than ``max_dims`` are zero-padded."""
    buf = bytearray()
    for row in rows:
        values = list(row)
        if len(values) > max_dims:
            raise ValueError(f"{len(values)} dimensions; polyhal-hip kernels take at most {max_dims}")
        buf += np.array(values + [0] * (max_dims - len(values)), dtype=np.int64).tobytes()
    return Raw(bytes(buf), 8)
