"""Types of values in a program: tensor types and affinities."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Set
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from polyhal.errors import DTypeError, ShapeError

#: Element types every op computes with on every device (numpy names). bool is one byte, as in
#: numpy and DLPack.
COMPUTE_DTYPES = frozenset(
    np.dtype(n)
    for n in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64",
    )
)

#: The low-precision storage types by name, as ml_dtypes defines them for numpy: bfloat16, the
#: float8 variants, float4 and the sub-byte integers.
STORAGE_DTYPE_NAMES = (
    "bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn", "int4", "uint4", "int2", "uint2",
)


class DTypeSet(Set):
    """A frozen set of numpy dtypes: ``base`` and ml_dtypes' types named ``names``, with ml_dtypes
    imported only when needed.

    ml_dtypes takes longer to import than numpy (its extension builds every type and its casts),
    and most programs never use a storage type, so ``import polyhal`` leaves it out. A dtype of
    ml_dtypes can only exist once ml_dtypes is imported (by polyhal, by the caller, by onnx), so
    membership answers from ``base`` alone until then; enumerating the set imports it.
    """

    def __init__(self, names: Iterable[str], base: frozenset[np.dtype] = frozenset()) -> None:
        self._names = tuple(names)
        self._base = base
        self._all: frozenset[np.dtype] | None = None

    def _load(self) -> frozenset[np.dtype]:
        if self._all is None:
            self._all = self._base | {storage_dtype(n) for n in self._names}
        return self._all

    def __contains__(self, dtype: object) -> bool:
        if dtype in self._base:
            return True
        return "ml_dtypes" in sys.modules and dtype in self._load()

    def __iter__(self) -> Iterator[np.dtype]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._base) + len(self._names)

    def __hash__(self) -> int:
        return hash(frozenset(self))  # as the frozenset it equals

    @classmethod
    def _from_iterable(cls, it: Iterable[np.dtype]) -> frozenset[np.dtype]:
        return frozenset(it)  # what | & - make of it: a plain frozenset

    def __repr__(self) -> str:
        return f"DTypeSet({sorted(map(str, self._base)) + list(self._names)})"


#: Low-precision storage types (:data:`STORAGE_DTYPE_NAMES`). A value of one is held one element
#: per byte (two for bfloat16), as ml_dtypes' arrays are; programs store, move and ``cast`` them,
#: and compute after a cast to a compute type (float32 holds every one of them exactly). The CPU
#: backend computes with them; the GPU backends convert (cast) and move them (their kernel tables
#: declare which ops take them: :class:`polyhal.hal.kernels.KernelTable`).
STORAGE_DTYPES = DTypeSet(STORAGE_DTYPE_NAMES)


def storage_dtype(name: str) -> np.dtype:
    """The storage type called ``name`` (one of :data:`STORAGE_DTYPE_NAMES`), importing ml_dtypes."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def storage_bits(dtype: Any) -> np.dtype:
    """The unsigned integer type holding a storage-only type's bits (uint8, or uint16 for
    bfloat16); ``dtype`` itself for any other type."""
    dt = np.dtype(dtype)
    return np.dtype(f"uint{8 * dt.itemsize}") if dt in STORAGE_DTYPES else dt


#: Element types a program may use: the compute types and the storage types.
SUPPORTED_DTYPES = DTypeSet(STORAGE_DTYPE_NAMES, COMPUTE_DTYPES)


def as_dtype(dtype: Any) -> np.dtype:
    """Normalise ``dtype`` (a numpy dtype, type or name) and check polyhal supports it."""
    if isinstance(dtype, str) and dtype in STORAGE_DTYPE_NAMES:
        return storage_dtype(dtype)  # numpy knows the name only once ml_dtypes is imported
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise DTypeError(f"{dtype!r} is not an element type; use a numpy dtype such as 'float32'") from exc
    if dt not in SUPPORTED_DTYPES:
        raise DTypeError(
            f"element type {dt} is not supported; supported: {sorted(str(d) for d in SUPPORTED_DTYPES)}"
        )
    return dt


def as_shape(shape: Any) -> tuple[int, ...]:
    """Normalise ``shape`` to a tuple of non-negative ints."""
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError as exc:
        raise ShapeError(f"shape {shape!r} is not a sequence of ints") from exc
    if any(d < 0 for d in dims):
        raise ShapeError(f"shape {dims} has a negative dimension")
    return dims


@dataclass(frozen=True)
class TensorType:
    """The static type of a tensor value: shape, element type and an optional encoding.

    The encoding (an immutable, hashable attribute, see the encodings issue) says how the
    logical tensor is laid out in memory; ``None`` means the dense row-major layout.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    encoding: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", as_shape(self.shape))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the dense row-major layout."""
        return self.size * self.dtype.itemsize

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        enc = f", {self.encoding}" if self.encoding is not None else ""
        return f"tensor<{dims}{'x' if dims else ''}{self.dtype}{enc}>"


@dataclass(frozen=True)
class Affinity:
    """Where an op or allocation may live: one device, or ``Optimal`` among several.

    ``devices`` are device names in the program's order of preference; ``queue_affinity`` is a
    bitmask of queues (-1: any queue). With several devices, the ``select_allocator`` policy
    decides (IREE's ``#hal.device.optimal<[...]>``).
    """

    devices: tuple[str, ...]
    queue_affinity: int = -1

    def __post_init__(self) -> None:
        if isinstance(self.devices, str):
            object.__setattr__(self, "devices", (self.devices,))
        if not self.devices:
            raise ValueError("an affinity needs at least one device name")

    def __str__(self) -> str:
        return self.devices[0] if len(self.devices) == 1 else f"Optimal({', '.join(self.devices)})"


def Optimal(*devices: str, queue_affinity: int = -1) -> Affinity:
    """``Optimal("cuda:0", "cpu:0")``: an affinity over several devices; the policy picks one."""
    return Affinity(tuple(devices), queue_affinity)
