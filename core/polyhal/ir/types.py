"""Types of values in a program: tensor types and affinities."""

from __future__ import annotations

import itertools
import math
import sys
import zlib
from collections.abc import Iterator, Set
from dataclasses import dataclass
from typing import Any, Iterable, Union

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


class SymbolicDimError(ShapeError):
    """A question about a symbolic dim that only its size can answer (its arithmetic, its order,
    or whether it equals a number or another symbol): raised while inferring types over symbolic
    dims, where it means "not expressible here", so that the op's result dims become derived
    dims (see :func:`polyhal.ops.infer_types`). Specialize the program to ask it of sizes."""


_derived_ids = itertools.count(1)


class SymbolicDim:
    """A dim whose size is known only when a program is called: a *named* dim (``"batch"``),
    bound from the inputs' shapes, or a *derived* dim, an op's result dim that the core cannot
    write in terms of named dims (``?``: re-inferred when the program is specialized).

    Two symbolic dims are the same dim when they have the same name; everything else about a
    size (arithmetic, order, equality with a number or another symbol) raises
    :class:`SymbolicDimError`, so that an op's type inference never guesses a size. ``hint`` is a
    sample size, the same for every use of the dim, with which inference probes an op whose
    result it cannot express (it never decides a plan's shapes).
    """

    __slots__ = ("name", "derived", "hint")

    def __init__(self, name: str, *, derived: bool = False, hint: int | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ShapeError(f"a symbolic dim needs a non-empty name, got {name!r}")
        self.name = name
        self.derived = derived
        # Sample sizes of named dims are distinct primes above any common size, so that probing an
        # op with them neither hits a special case (1, a power of two) nor joins two symbols.
        self.hint = hint if hint is not None else _PROBE_SIZES[zlib.crc32(name.encode()) % len(_PROBE_SIZES)]

    @classmethod
    def fresh(cls, hint: int) -> "SymbolicDim":
        """A new derived dim (its sample size ``hint``)."""
        return cls(f"?{next(_derived_ids)}", derived=True, hint=hint)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SymbolicDim):
            if other.name == self.name:
                return True
        elif not isinstance(other, (int, np.integer)):
            return NotImplemented
        raise SymbolicDimError(f"whether dim {self} equals {other} depends on the sizes bound when the program "
                               "is called")

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self.name)

    def _unknown(self, *_: Any) -> Any:
        raise SymbolicDimError(f"dim {self} is symbolic: its size is known only when the program is specialized "
                               "to the inputs' shapes")

    __lt__ = __le__ = __gt__ = __ge__ = _unknown
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _unknown
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __truediv__ = __rtruediv__ = __neg__ = _unknown
    __int__ = __index__ = __float__ = _unknown

    def __repr__(self) -> str:
        return "?" if self.derived else self.name

    __str__ = __repr__

    def __reduce__(self) -> Any:
        return (_symbolic_dim, (self.name, self.derived, self.hint))


def _symbolic_dim(name: str, derived: bool, hint: int) -> SymbolicDim:
    return SymbolicDim(name, derived=derived, hint=hint)


_PROBE_SIZES = (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049, 1051, 1061, 1063, 1069, 1087, 1091, 1093, 1097)

#: One dim of a shape: a size, or a :class:`SymbolicDim`.
Dim = Union[int, SymbolicDim]


def as_shape(shape: Any) -> tuple[Dim, ...]:
    """Normalise ``shape`` to a tuple of dims: non-negative ints, and symbolic dims (a name
    such as ``"batch"`` or a :class:`SymbolicDim`)."""
    if isinstance(shape, (int, np.integer, str, SymbolicDim)):
        shape = (shape,)
    try:
        dims = tuple(d if isinstance(d, SymbolicDim) else SymbolicDim(d) if isinstance(d, str) else int(d)
                     for d in shape)
    except TypeError as exc:
        raise ShapeError(f"shape {shape!r} is not a sequence of ints (or names of symbolic dims)") from exc
    if any(type(d) is int and d < 0 for d in dims):
        raise ShapeError(f"shape {dims} has a negative dimension")
    return dims


def is_static(shape: tuple[Dim, ...]) -> bool:
    """True when every dim of ``shape`` is a size (no :class:`SymbolicDim`)."""
    return not any(isinstance(d, SymbolicDim) for d in shape)


def hinted(shape: tuple[Dim, ...]) -> tuple[int, ...]:
    """``shape`` with each symbolic dim replaced by its sample size (see :class:`SymbolicDim`)."""
    return tuple(d.hint if isinstance(d, SymbolicDim) else d for d in shape)


@dataclass(frozen=True)
class TensorType:
    """The static type of a tensor value: shape, element type and an optional encoding.

    The encoding (an immutable, hashable attribute, see the encodings issue) says how the
    logical tensor is laid out in memory; ``None`` means the dense row-major layout. A dim may be
    symbolic (:class:`SymbolicDim`): such a type has no size until its program is specialized.
    """

    shape: tuple[Dim, ...]
    dtype: np.dtype
    encoding: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", as_shape(self.shape))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        """True when every dim is a size (no symbolic dim)."""
        return is_static(self.shape)

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
