"""Tensor encodings and the layouts they resolve to (IREE's ``#iree_encoding.encoding`` and its
``SerializableAttr`` / ``LayoutResolverAttr`` interfaces).

An **encoding** is a device-independent hint attached to a tensor type: "this value is the LHS
of a 256x512x1024 float32 matmul". It says nothing about memory. A program carries encodings
from the data-tiling pass (:mod:`polyhal.passes.data_tiling`) or from ``builder.encode``.

A **layout** is what one device's resolver (the ``resolve_encoding`` hook) makes of an encoding
for one tensor type: the concrete arrangement of the bytes. :class:`IdentityLayout` is the
dense row-major layout (what a backend without data tiling uses for every encoding);
:class:`PackedLayout` is a tiled layout (IREE's ``MaterializeEncodingInfo``: inner tiles, their
positions, the order of the outer dims), the one the CPU backend uses for matmul operands.

The :class:`Layout` interface is what :mod:`polyhal.passes.materialize_encoding` asks:
``is_identity_layout()``, ``is_same_layout(other)``, the storage size in bytes, and the pack /
unpack dispatches that move a value between the dense layout and this one.

Encodings and layouts are immutable and hashable (frozen dataclasses), so they can key caches
and live inside :class:`~polyhal.ir.types.TensorType`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from polyhal.errors import DTypeError, ProgramError, ShapeError
from polyhal.ir.types import COMPUTE_DTYPES, TensorType, as_dtype

__all__ = [
    "Encoding", "MatmulEncoding", "FeatureMapEncoding", "CONV_CHAINS", "CONV_ROLES", "LHS", "RHS", "RESULT", "ROLE_NAMES", "Layout",
    "IdentityLayout", "PackedLayout", "pack_split", "ChannelBlockedLayout", "CHANNEL_BLOCKED_ELEMENTWISE", "packed_shape",
    "dense_type",
]

# ------------------------------------------------------------------------------------------------
# Encodings
# ------------------------------------------------------------------------------------------------

#: Operand roles of a contraction (IREE's ``operand_index``: 0 LHS, 1 RHS, 2 RESULT).
LHS, RHS, RESULT = 0, 1, 2
ROLE_NAMES = ("LHS", "RHS", "RESULT")


class Encoding(ABC):
    """Base class of encoding attributes. Subclasses are frozen dataclasses (immutable, hashable).

    A resolver that does not know an encoding class returns ``None`` for it, and the value falls
    back to the identity layout on that device (explain says so).
    """

    @abstractmethod
    def check_type(self, tensor_type: TensorType) -> None:
        """Raise DTypeError / ShapeError unless this encoding can describe ``tensor_type``."""

    def describe(self) -> str:
        """Short text for explain and printed programs."""
        return str(self)


#: Element types a matmul encoding can describe: numbers (a bool matmul is not a contraction
#: any backend tiles).
_MATMUL_ELEMENT_TYPES = frozenset(d for d in COMPUTE_DTYPES if d.kind in "iuf")


@dataclass(frozen=True)
class MatmulEncoding(Encoding):
    """The encoding of one operand (or the result) of a 2-D matmul ``C[M,N] = A[M,K] @ B[K,N]``.

    IREE's ``#iree_encoding.encoding<operand_index, op_type = matmul, element_types,
    iteration_sizes>``.

    Attributes:
        operand_index: :data:`LHS` (0), :data:`RHS` (1) or :data:`RESULT` (2).
        element_types: numpy names of the LHS, RHS and result element types.
        iteration_sizes: the op's ``(M, N, K)``: shape hints a resolver may use to choose tiles
            (``None`` for a size that is not known).
        op_type: ``"matmul"``.
    """

    operand_index: int
    element_types: tuple[str, str, str]
    iteration_sizes: tuple[int | None, int | None, int | None]
    op_type: str = "matmul"

    def __post_init__(self) -> None:
        if self.operand_index not in (LHS, RHS, RESULT) or isinstance(self.operand_index, bool):
            raise ProgramError(f"matmul encoding: operand_index must be 0 (LHS), 1 (RHS) or 2 (RESULT), "
                               f"got {self.operand_index!r}")
        types = tuple(self.element_types)
        if len(types) != 3:
            raise ProgramError(f"matmul encoding: element_types needs 3 types (LHS, RHS, RESULT), got {types!r}")
        names = []
        for t in types:
            try:
                dt = as_dtype(t)
            except DTypeError as exc:
                raise DTypeError(f"matmul encoding cannot describe element type {t!r}: {exc}") from None
            if dt not in _MATMUL_ELEMENT_TYPES:
                raise DTypeError(
                    f"matmul encoding cannot describe element type {dt}; it describes "
                    f"{', '.join(sorted(map(str, _MATMUL_ELEMENT_TYPES)))} (insert a 'cast' first)")
            names.append(str(dt))
        object.__setattr__(self, "element_types", tuple(names))
        sizes = tuple(self.iteration_sizes)
        if len(sizes) != 3 or not all(s is None or (isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                                                     and s >= 0) for s in sizes):
            raise ProgramError(f"matmul encoding: iteration_sizes must be (M, N, K), each a size >= 0 or "
                               f"None, got {self.iteration_sizes!r}")
        object.__setattr__(self, "iteration_sizes", tuple(None if s is None else int(s) for s in sizes))
        if self.op_type != "matmul":
            raise ProgramError(f"matmul encoding: op_type must be 'matmul', got {self.op_type!r}")

    @classmethod
    def for_matmul(cls, a: TensorType, b: TensorType, c: TensorType) -> tuple["MatmulEncoding", ...]:
        """The LHS, RHS and RESULT encodings of ``c = a @ b`` (2-D operands)."""
        (m, k), (_, n) = a.shape, b.shape
        types = (str(a.dtype), str(b.dtype), str(c.dtype))
        return tuple(cls(role, types, (m, n, k)) for role in (LHS, RHS, RESULT))

    @property
    def role(self) -> str:
        """``"LHS"``, ``"RHS"`` or ``"RESULT"``."""
        return ROLE_NAMES[self.operand_index]

    def check_type(self, tensor_type: TensorType) -> None:
        want = self.element_types[self.operand_index]
        if str(tensor_type.dtype) != want:
            raise DTypeError(f"a {self.describe()} tensor has element type {want}, not {tensor_type.dtype}")
        if tensor_type.rank != 2:
            raise ShapeError(f"a {self.describe()} tensor is 2-D, got shape {tensor_type.shape}")
        m, n, k = self.iteration_sizes
        expect = ((m, k), (k, n), (m, n))[self.operand_index]
        for got, hint in zip(tensor_type.shape, expect):
            if hint is not None and got != hint:
                raise ShapeError(f"a {self.describe()} tensor has shape "
                                 f"{tuple('?' if h is None else h for h in expect)}, got {tensor_type.shape}")

    def describe(self) -> str:
        m, n, k = ("?" if s is None else s for s in self.iteration_sizes)
        return f"matmul.{self.role}<{'x'.join(self.element_types)}, MxNxK={m}x{n}x{k}>"

    def __str__(self) -> str:
        return f"#encoding<{self.describe()}>"


#: What a :class:`FeatureMapEncoding`'s chain is made of: "depthwise" (it has a depthwise conv:
#: MobileNet's and EfficientNet's blocks) or "dense" (ordinary convs only: ResNet's).
CONV_CHAINS = ("depthwise", "dense")
#: The conv operands a :class:`FeatureMapEncoding` describes: a feature map (input, residual or
#: result) or a filter (the weights, (M, C/group, kh, kw)).
CONV_ROLES = ("map", "filter")


@dataclass(frozen=True)
class FeatureMapEncoding(Encoding):
    """A float (N, C, H, W) activation flowing through a chain of convolutions: the input,
    residual or result of a conv. A device may store it channel-blocked
    (:class:`ChannelBlockedLayout`), as onnxruntime's NCHWc transformer does; chained convs then
    hand the blocked form to each other and only the chain's edges pay a relayout.

    ``chain`` says what the chain is made of (:data:`CONV_CHAINS`), so that each device's
    resolver can keep the layout only where it pays on that device (the CPU blocks depthwise
    chains; cuDNN's channels-last engines serve dense chains too). ``role`` is ``"filter"`` for
    a conv's weights (M, C/group, kh, kw), which a channels-last device stores (M, 1, kh, kw,
    C/group), converted once at compile time."""

    op_type: str = "conv"
    chain: str = "depthwise"
    role: str = "map"

    def __post_init__(self) -> None:
        if self.chain not in CONV_CHAINS:
            raise ProgramError(f"feature-map encoding: chain must be one of {CONV_CHAINS}, got {self.chain!r}")
        if self.role not in CONV_ROLES:
            raise ProgramError(f"feature-map encoding: role must be one of {CONV_ROLES}, got {self.role!r}")

    def check_type(self, tensor_type: TensorType) -> None:
        if tensor_type.rank != 4 or tensor_type.dtype.kind != "f":
            raise ShapeError(f"a {self.describe()} tensor is a float (N, C, H, W), got {tensor_type}")

    def describe(self) -> str:
        what = "conv.filter" if self.role == "filter" else "conv.feature_map"
        return what if self.chain == "depthwise" else f"{what}<{self.chain}>"

    def __str__(self) -> str:
        return f"#encoding<{self.describe()}>"


def dense_type(t: TensorType) -> TensorType:
    """``t`` without its encoding."""
    return t if t.encoding is None else TensorType(t.shape, t.dtype)


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------

class Layout(ABC):
    """A concrete memory layout of one tensor type on one device (what a resolver returns).

    ``tensor_type`` is the logical (dense, unencoded) type the layout was resolved for.
    Materialization only ever asks the questions below, so a backend may return its own
    subclass; it then also provides kernels for the ops its ``pack_op``/``unpack_op`` name.
    """

    tensor_type: TensorType

    @abstractmethod
    def is_identity_layout(self) -> bool:
        """True when the bytes are the dense row-major layout (IREE's ``isIdentityLayout``):
        encode ops to or from it cost nothing on this device."""

    @abstractmethod
    def is_same_layout(self, other: "Layout") -> bool:
        """True when a value in this layout can be used as is where ``other`` is expected
        (IREE's ``isSameLayout``): the encode op between them folds. Must be symmetric."""

    @property
    def storage_type(self) -> TensorType:
        """The dense type of the memory holding a value in this layout (what kernels see)."""
        return dense_type(self.tensor_type)

    def storage_size_in_bytes(self) -> int:
        """Bytes of storage (IREE's ``calculateStorageSizeInBytes``); padding included."""
        return self.storage_type.nbytes

    def pack_op(self) -> tuple[str, Mapping[str, Any]] | None:
        """``(op name, attrs)`` of the dispatch that turns a dense value into this layout, or
        None for the identity layout."""
        return None

    def unpack_op(self) -> tuple[str, Mapping[str, Any]] | None:
        """``(op name, attrs)`` of the dispatch that turns a value in this layout back into the
        dense layout, or None for the identity layout."""
        return None

    def pack(self, array: np.ndarray) -> np.ndarray:
        """The storage of dense ``array`` in this layout (numpy, for tests and users)."""
        return np.array(array, dtype=self.tensor_type.dtype)

    def unpack(self, storage: np.ndarray) -> np.ndarray:
        """The dense array held by ``storage`` (numpy, for tests and users)."""
        return np.array(storage, dtype=self.tensor_type.dtype)

    def materialize_dispatch(self, op: str, attrs: Mapping[str, Any], in_layouts: tuple["Layout", ...],
                             out_layouts: tuple["Layout", ...]) -> tuple[str, Mapping[str, Any]] | None:
        """An op computing ``op`` directly on the storage of these layouts (IREE's
        MaterializeEncoding patterns, e.g. matmul on packed operands -> ``mmt4d``), or None
        when materialization must unpack the operands and pack the results around ``op``.

        Asked of the first non-identity layout among the results, then among the operands.
        """
        return None

    def describe(self) -> str:
        """Short text for explain."""
        return "identity" if self.is_identity_layout() else type(self).__name__


@dataclass(frozen=True)
class IdentityLayout(Layout):
    """The dense row-major layout: what the identity resolver returns for every encoding."""

    tensor_type: TensorType

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensor_type", dense_type(self.tensor_type))

    def is_identity_layout(self) -> bool:
        return True

    def is_same_layout(self, other: Layout) -> bool:
        # Every identity layout of the same logical type is the same bytes.
        return isinstance(other, Layout) and other.is_identity_layout() and \
            other.tensor_type.shape == self.tensor_type.shape and other.tensor_type.dtype == self.tensor_type.dtype

    def describe(self) -> str:
        return "identity"


def packed_shape(shape: tuple[int, ...], inner_dims_pos: tuple[int, ...], inner_tiles: tuple[int, ...],
                 outer_dims_perm: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Shape of ``pack`` (IREE's ``linalg.pack``) of a tensor of ``shape``: the outer dims (a tiled
    dim ``d`` becomes ``ceil(d / tile)``), permuted by ``outer_dims_perm``, then the tiles."""
    outer = list(shape)
    for pos, tile in zip(inner_dims_pos, inner_tiles):
        outer[pos] = -(-shape[pos] // tile)
    perm = outer_dims_perm or tuple(range(len(shape)))
    return tuple(outer[p] for p in perm) + tuple(inner_tiles)


def check_pack_attrs(shape: Sequence[int], inner_dims_pos: Sequence[int], inner_tiles: Sequence[int],
                     outer_dims_perm: Sequence[int] | None) -> None:
    """Raise unless the tiling attributes fit a tensor of ``shape`` (of ``pack`` and :class:`PackedLayout`)."""
    rank = len(shape)
    if len(inner_dims_pos) != len(inner_tiles):
        raise ProgramError(f"inner_dims_pos {list(inner_dims_pos)} and inner_tiles {list(inner_tiles)} "
                           "must have the same length")
    if len(set(inner_dims_pos)) != len(inner_dims_pos) or not all(0 <= p < rank for p in inner_dims_pos):
        raise ShapeError(f"inner_dims_pos {list(inner_dims_pos)} must be distinct dims of a rank-{rank} "
                         f"tensor (0..{rank - 1})")
    if not all(t >= 1 for t in inner_tiles):
        raise ShapeError(f"inner_tiles {list(inner_tiles)} must be >= 1")
    if outer_dims_perm is not None and sorted(outer_dims_perm) != list(range(rank)):
        raise ShapeError(f"outer_dims_perm {list(outer_dims_perm)} is not a permutation of 0..{rank - 1}")


def pack_split(shape: tuple[int, ...], inner_dims_pos: tuple[int, ...], inner_tiles: tuple[int, ...],
               outer_dims_perm: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(split, order)`` such that packing an array ``x`` of ``shape`` is
    ``x.reshape(split).transpose(order)`` (one strided copy, no index map), or None when some
    tile does not divide its dim (the pack pads). Unpacking is the inverse transpose."""
    if any(shape[p] % t for p, t in zip(inner_dims_pos, inner_tiles)):
        return None
    split, outer_axis, inner_axis = [], {}, {}
    for d, size in enumerate(shape):
        if d in inner_dims_pos:
            tile = inner_tiles[inner_dims_pos.index(d)]
            outer_axis[d], inner_axis[d] = len(split), len(split) + 1
            split += [size // tile, tile]
        else:
            outer_axis[d] = len(split)
            split.append(size)
    perm = outer_dims_perm or tuple(range(len(shape)))
    return tuple(split), tuple(outer_axis[d] for d in perm) + tuple(inner_axis[d] for d in inner_dims_pos)


def pack_array(x: np.ndarray, inner_dims_pos: tuple[int, ...], inner_tiles: tuple[int, ...],
               outer_dims_perm: tuple[int, ...] | None = None, padding_value: float = 0.0) -> np.ndarray:
    """``pack`` (IREE's ``linalg.pack``) of array ``x``, computed with numpy: the reference of the
    ``pack`` op and what :meth:`PackedLayout.pack` does to constants."""
    # A gather: each packed element reads the source element it stands for, or the padding.
    x = np.asarray(x)
    pos, tiles, rank = inner_dims_pos, inner_tiles, x.ndim
    perm = outer_dims_perm or tuple(range(rank))
    out_shape = packed_shape(x.shape, pos, tiles, perm)
    idx = np.indices(out_shape, sparse=True)
    valid = np.ones(out_shape, bool)
    src = []
    for d in range(rank):
        i = idx[perm.index(d)]
        if d in pos:
            k = pos.index(d)
            i = i * tiles[k] + idx[rank + k]
        valid = valid & (i < x.shape[d])
        src.append(np.minimum(i, max(x.shape[d] - 1, 0)))
    gathered = x[tuple(src)] if x.size else np.zeros(out_shape, x.dtype)
    return np.where(valid, gathered, np.asarray(padding_value).astype(x.dtype)).astype(x.dtype)


def unpack_array(x: np.ndarray, inner_dims_pos: tuple[int, ...], inner_tiles: tuple[int, ...],
                 outer_dims_perm: tuple[int, ...] | None, dest_shape: tuple[int, ...]) -> np.ndarray:
    """``unpack`` (IREE's ``linalg.unpack``) of array ``x`` into ``dest_shape``, computed with
    numpy: the inverse of :func:`pack_array` (padding is dropped)."""
    # A gather the other way: each dense element reads its tile slot.
    x = np.asarray(x)
    pos, tiles, rank = inner_dims_pos, inner_tiles, len(dest_shape)
    perm = outer_dims_perm or tuple(range(rank))
    idx = np.indices(dest_shape, sparse=True)
    where: list = [None] * (rank + len(pos))
    for d in range(rank):
        j = perm.index(d)
        if d in pos:
            k = pos.index(d)
            where[j], where[rank + k] = idx[d] // tiles[k], idx[d] % tiles[k]
        else:
            where[j] = idx[d]
    return np.array(x[tuple(where)], dtype=x.dtype).reshape(dest_shape)


@dataclass(frozen=True)
class PackedLayout(Layout):
    """A tiled layout (IREE's ``MaterializeEncodingInfo``): dims ``inner_dims_pos`` are cut into
    tiles of ``inner_tiles`` (the last one padded with ``padding_value``), the outer dims are
    ordered by ``outer_dims_perm``, and each tile is stored contiguously after them.

    A matmul ``C = A @ B`` in the mmt4d arrangement: A ``(M,K)`` packs to ``(M1,K1,M0,K0)``
    (``inner_dims_pos=(0,1)``), B ``(K,N)`` to ``(N1,K1,N0,K0)`` (``inner_dims_pos=(1,0)``,
    ``outer_dims_perm=(1,0)``: transposed tiles), C ``(M,N)`` to ``(M1,N1,M0,N0)``. When the
    tiles of C are those of the next matmul's A, C is used as is: no unpack and no pack between
    consecutive matmuls.

    ``resolver`` names who chose the tiles (for explain); it takes no part in comparisons.
    """

    tensor_type: TensorType
    inner_dims_pos: tuple[int, ...]
    inner_tiles: tuple[int, ...]
    outer_dims_perm: tuple[int, ...] | None = None
    padding_value: float = 0.0
    resolver: str = ""

    def __post_init__(self) -> None:
        t = dense_type(self.tensor_type)
        object.__setattr__(self, "tensor_type", t)
        object.__setattr__(self, "inner_dims_pos", tuple(int(p) for p in self.inner_dims_pos))
        object.__setattr__(self, "inner_tiles", tuple(int(s) for s in self.inner_tiles))
        perm = None if self.outer_dims_perm is None else tuple(int(p) for p in self.outer_dims_perm)
        if perm == tuple(range(t.rank)):
            perm = None  # one spelling for the identity permutation, so equal layouts compare equal
        object.__setattr__(self, "outer_dims_perm", perm)
        check_pack_attrs(t.shape, self.inner_dims_pos, self.inner_tiles, self.outer_dims_perm)

    def _key(self) -> tuple:
        return (self.tensor_type.shape, self.tensor_type.dtype, self.inner_dims_pos, self.inner_tiles,
                self.outer_dims_perm, self.padding_value)

    def is_identity_layout(self) -> bool:
        return not self.inner_tiles and self.outer_dims_perm is None

    def is_same_layout(self, other: Layout) -> bool:
        if self.is_identity_layout():
            return isinstance(other, Layout) and other.is_identity_layout() and \
                other.tensor_type.shape == self.tensor_type.shape and other.tensor_type.dtype == self.tensor_type.dtype
        return isinstance(other, PackedLayout) and self._key() == other._key()

    @property
    def storage_type(self) -> TensorType:
        t = self.tensor_type
        return TensorType(packed_shape(t.shape, self.inner_dims_pos, self.inner_tiles, self.outer_dims_perm), t.dtype)

    def _attrs(self) -> dict[str, Any]:
        return {"inner_dims_pos": self.inner_dims_pos, "inner_tiles": self.inner_tiles,
                "outer_dims_perm": self.outer_dims_perm, "padding_value": self.padding_value}

    def pack_op(self):
        return None if self.is_identity_layout() else ("pack", self._attrs())

    def unpack_op(self):
        if self.is_identity_layout():
            return None
        attrs = self._attrs()
        del attrs["padding_value"]
        return ("unpack", {**attrs, "dest_shape": self.tensor_type.shape})

    def pack(self, array: np.ndarray) -> np.ndarray:
        return pack_array(np.asarray(array, self.tensor_type.dtype), self.inner_dims_pos, self.inner_tiles,
                          self.outer_dims_perm, self.padding_value)

    def unpack(self, storage: np.ndarray) -> np.ndarray:
        return unpack_array(np.asarray(storage, self.tensor_type.dtype), self.inner_dims_pos, self.inner_tiles,
                            self.outer_dims_perm, self.tensor_type.shape)

    def materialize_dispatch(self, op, attrs, in_layouts, out_layouts):
        # matmul on packed LHS (M1,K1,M0,K0), RHS (N1,K1,N0,K0) into RESULT (M1,N1,M0,N0) is
        # mmt4d; any other combination is left to unpack/pack around the op.
        if op != "matmul" or len(in_layouts) != 2 or len(out_layouts) != 1:
            return None
        lhs, rhs, res = (*in_layouts, *out_layouts)
        if not all(isinstance(x, PackedLayout) and x.padding_value == 0 for x in (lhs, rhs, res)):
            return None
        if not (lhs.tensor_type.rank == rhs.tensor_type.rank == 2 and
                (lhs.inner_dims_pos, lhs.outer_dims_perm) == ((0, 1), None) and
                (rhs.inner_dims_pos, rhs.outer_dims_perm) == ((1, 0), (1, 0)) and
                (res.inner_dims_pos, res.outer_dims_perm) == ((0, 1), None)):
            return None
        (m1, k1, m0, k0), (n1, k1b, n0, k0b) = lhs.storage_type.shape, rhs.storage_type.shape
        if (k1, k0) != (k1b, k0b) or res.storage_type.shape != (m1, n1, m0, n0):
            return None
        return ("mmt4d", {})

    def describe(self) -> str:
        if self.is_identity_layout():
            return "identity"
        tiles = "x".join(map(str, self.inner_tiles))
        who = f"{self.resolver} " if self.resolver else ""
        return f"{who}packed<tiles {tiles} on dims {list(self.inner_dims_pos)}" + \
            (f", outer {list(self.outer_dims_perm)}" if self.outer_dims_perm else "") + \
            f" -> {'x'.join(map(str, self.storage_type.shape))}>"


#: Elementwise ops that run on channel-blocked storage as they are (operands and result in the
#: same one-block layout, or scalars): what squeeze-excite blocks and unfused activations use.
CHANNEL_BLOCKED_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "maximum", "minimum", "relu", "sigmoid", "tanh", "neg", "abs", "exp",
})


@dataclass(frozen=True)
class ChannelBlockedLayout(PackedLayout):
    """NCHWc: a (N, C, H, W) feature map with its channels cut into blocks of ``c``, stored
    (N, C/c, H, W, c) -- a :class:`PackedLayout` with ``inner_dims_pos=(1,)``.

    With one block of all channels (storage (N, 1, H, W, C): the channels of each pixel
    contiguous), ops whose feature maps are all blocked run on the storage: convs as
    ``conv_op`` (the resolving backend's own op for a conv on this storage, defined with
    :data:`polyhal.ops.nn.CHANNEL_BLOCKED_CONV`; None: convs run dense between an unpack and a
    pack), the :data:`CHANNEL_BLOCKED_ELEMENTWISE` ops as themselves (a (N, C, 1, 1) map is
    stored (N, 1, 1, 1, C), so broadcasting over pixels still lines up), and a global average
    pool (``reduce_mean`` over dims 2 and 3, kept) over the storage's dims 2 and 3. Other ops
    run dense between an unpack and a pack.
    """

    #: The op a conv between maps of this layout lowers to (the resolving backend's own), or None.
    conv_op: str | None = None

    @property
    def one_block(self) -> bool:
        """Whether the channels form one block (the storage is channels-last)."""
        return self.inner_tiles == (self.tensor_type.shape[1],) and self.padding_value == 0

    def materialize_dispatch(self, op, attrs, in_layouts, out_layouts):
        if len(out_layouts) != 1:
            return None

        def blocked(layouts) -> bool:
            return all(isinstance(x, ChannelBlockedLayout) and x.one_block for x in layouts)

        if op in ("conv", "fused_conv"):
            # a chain's first conv may read its image as it lies (polyhal.passes.data_tiling's stems)
            image = in_layouts[0].is_identity_layout() and in_layouts[0].tensor_type.rank == 4
            maps = [out_layouts[0], *in_layouts[3:]] + ([] if image else [in_layouts[0]])
            if self.conv_op is None or not blocked(maps) \
                    or not all(x.is_identity_layout() for x in in_layouts[1:3]):
                return None
            return self.conv_on_storage(attrs)
        if op in CHANNEL_BLOCKED_ELEMENTWISE:
            maps = [x for x in (*in_layouts, *out_layouts) if x.tensor_type.rank > 0]
            return (op, dict(attrs)) if blocked(maps) and all(x.tensor_type.rank == 4 for x in maps) else None
        if op == "reduce_mean" and blocked([*in_layouts, *out_layouts]) \
                and sorted(attrs.get("axes") or ()) == [2, 3] and attrs.get("keepdims", True):
            return ("reduce_mean", {**dict(attrs), "axes": (2, 3), "keepdims": True})
        return None

    def conv_on_storage(self, attrs) -> tuple[str, dict]:
        """``(conv_op, attributes)`` of a ``conv`` or ``fused_conv`` with ``attrs`` on this storage."""
        return (self.conv_op, {"activation": "none", "alpha": 0.0, "beta": 0.0, **dict(attrs)})

    def describe(self) -> str:
        t = self.tensor_type
        block = self.inner_tiles[0]
        who = f"{self.resolver} " if self.resolver else ""
        return f"{who}channel-blocked<NCHW{block}c -> {'x'.join(map(str, self.storage_type.shape))}>" \
            if t.rank == 4 else super().describe()
