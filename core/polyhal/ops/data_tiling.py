"""Data-tiling ops: ``pack``, ``unpack`` (IREE's ``linalg.pack`` / ``linalg.unpack``) and
``mmt4d`` (IREE's ``linalg.mmt4d``: a matmul on packed operands).

They are what :mod:`polyhal.passes.materialize_encoding` turns encodings into on a device whose
resolver returns a :class:`~polyhal.ir.encoding.PackedLayout`: ``pack`` where a dense value
enters the packed layout, ``unpack`` where it leaves it, ``mmt4d`` for a matmul whose operands
and result are all packed. Programs do not usually spell them; they are ordinary ops, so every
backend's kernels for them are checked against these references by the conformance suite.
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import ShapeError
from polyhal.ir.encoding import check_pack_attrs, pack_array, packed_shape, unpack_array
from polyhal.ir.types import TensorType
from polyhal.ops._base import (
    ANY, NUMERIC, check_dtype, check_same_dtype, define, float_attr, fmt_shape, int_list_attr, narrow,
    nonzero, pick, wide,
)

_PRODUCT_TOLERANCE = (1e-4, 1e-5)


def _tiling(rank: int, inner_dims_pos, inner_tiles, outer_dims_perm):
    pos = int_list_attr(inner_dims_pos, "inner_dims_pos")
    tiles = int_list_attr(inner_tiles, "inner_tiles")
    perm = None if outer_dims_perm is None else int_list_attr(outer_dims_perm, "outer_dims_perm")
    return pos, tiles, perm


def _packed(shape, pos, tiles, perm) -> tuple[int, ...]:
    return packed_shape(tuple(shape), pos, tiles, perm)


# ----------------------------------------------------------------------------------------- pack

def _infer_pack(x: TensorType, *, inner_dims_pos, inner_tiles, outer_dims_perm, padding_value):
    check_dtype(x, ANY)
    float_attr(padding_value, "padding_value")
    pos, tiles, perm = _tiling(x.rank, inner_dims_pos, inner_tiles, outer_dims_perm)
    check_pack_attrs(x.shape, pos, tiles, perm)
    return (TensorType(_packed(x.shape, pos, tiles, perm), x.dtype),)


def _ref_pack(x, *, inner_dims_pos, inner_tiles, outer_dims_perm=None, padding_value=0.0):
    x = np.asarray(x)
    return (pack_array(x, *_tiling(x.ndim, inner_dims_pos, inner_tiles, outer_dims_perm), padding_value),)


def _random_tiling(rng: np.random.Generator, rank: int):
    dims = [d for d in range(rank) if rng.random() < 0.7] or [rank - 1]
    pos = [int(p) for p in rng.permutation(dims)]
    tiles = [int(t) for t in rng.integers(1, 9, size=len(pos))]
    perm = None if rng.random() < 0.5 else [int(p) for p in rng.permutation(rank)]
    return pos, tiles, perm


def _sample_pack(rng: np.random.Generator):
    shape = tuple(int(d) for d in rng.integers(1, 21, size=int(rng.integers(1, 4))))
    pos, tiles, perm = _random_tiling(rng, len(shape))
    attrs = {"inner_dims_pos": pos, "inner_tiles": tiles, "outer_dims_perm": perm,
             "padding_value": float(pick(rng, [0.0, 0.0, -1.5]))}
    return [nonzero(rng, shape)], attrs


define("pack", infer=_infer_pack, reference=_ref_pack, sample=_sample_pack, arity=1,
       tolerance=(0.0, 0.0), doc="""
    IREE's linalg.pack: dims inner_dims_pos of the operand are cut into tiles of inner_tiles
    (the last tile of a dim that the tile does not divide is filled with padding_value). The
    result has the outer dims (a tiled dim d becomes ceil(d / tile)), permuted by
    outer_dims_perm (None: in order), followed by one dim per tile, in inner_dims_pos order.
""")


# --------------------------------------------------------------------------------------- unpack

def _infer_unpack(x: TensorType, *, inner_dims_pos, inner_tiles, outer_dims_perm, dest_shape):
    check_dtype(x, ANY)
    dest = int_list_attr(dest_shape, "dest_shape")
    if any(d < 0 for d in dest):
        raise ShapeError(f"dest_shape {list(dest)} has a negative dimension")
    pos, tiles, perm = _tiling(len(dest), inner_dims_pos, inner_tiles, outer_dims_perm)
    check_pack_attrs(dest, pos, tiles, perm)
    want = _packed(dest, pos, tiles, perm)
    if x.shape != want:
        raise ShapeError(f"operand has shape {fmt_shape(x.shape)}, but packing {fmt_shape(dest)} with these "
                         f"tiles gives {fmt_shape(want)}")
    return (TensorType(dest, x.dtype),)


def _ref_unpack(x, *, inner_dims_pos, inner_tiles, outer_dims_perm=None, dest_shape):
    dest = tuple(int_list_attr(dest_shape, "dest_shape"))
    return (unpack_array(x, *_tiling(len(dest), inner_dims_pos, inner_tiles, outer_dims_perm), dest),)


def _sample_unpack(rng: np.random.Generator):
    dest = tuple(int(d) for d in rng.integers(1, 21, size=int(rng.integers(1, 4))))
    pos, tiles, perm = _random_tiling(rng, len(dest))
    attrs = {"inner_dims_pos": pos, "inner_tiles": tiles, "outer_dims_perm": perm, "dest_shape": list(dest)}
    return [nonzero(rng, _packed(dest, tuple(pos), tuple(tiles), perm))], attrs


define("unpack", infer=_infer_unpack, reference=_ref_unpack, sample=_sample_unpack, arity=1,
       tolerance=(0.0, 0.0), doc="""
    IREE's linalg.unpack, the inverse of pack: the dense tensor of dest_shape whose pack (with
    the same inner_dims_pos, inner_tiles and outer_dims_perm) is the operand. Padding is dropped.
""")


# ---------------------------------------------------------------------------------------- mmt4d

def _infer_mmt4d(lhs: TensorType, rhs: TensorType):
    dtype = check_same_dtype(lhs, rhs)
    check_dtype(lhs, NUMERIC)
    for i, t in enumerate((lhs, rhs)):
        if t.rank != 4:
            raise ShapeError(f"operand {i} has shape {fmt_shape(t.shape)}; mmt4d takes 4-D packed operands "
                             "(M1,K1,M0,K0) and (N1,K1,N0,K0)")
    (m1, k1, m0, k0), (n1, k1b, n0, k0b) = lhs.shape, rhs.shape
    if (k1, k0) != (k1b, k0b):
        raise ShapeError(f"reduction tiles do not match: operand 0 (M1,K1,M0,K0)={fmt_shape(lhs.shape)} and "
                         f"operand 1 (N1,K1,N0,K0)={fmt_shape(rhs.shape)} need equal K1 and K0")
    return (TensorType((m1, n1, m0, n0), dtype),)


def _ref_mmt4d(lhs, rhs):
    return (narrow(np.einsum("mkac,nkbc->mnab", wide(lhs), wide(rhs)), lhs.dtype),)


def _sample_mmt4d(rng: np.random.Generator):
    m1, n1, k1 = (int(d) for d in rng.integers(1, 5, size=3))
    m0, n0, k0 = (int(d) for d in rng.integers(1, 9, size=3))
    return [nonzero(rng, (m1, k1, m0, k0)), nonzero(rng, (n1, k1, n0, k0))], {}


define("mmt4d", infer=_infer_mmt4d, reference=_ref_mmt4d, sample=_sample_mmt4d, arity=2,
       tolerance=_PRODUCT_TOLERANCE, doc="""
    IREE's linalg.mmt4d: a matmul on packed operands. lhs (M1,K1,M0,K0) and rhs (N1,K1,N0,K0)
    (the RHS tiles transposed) give (M1,N1,M0,N0) with
    out[m1,n1,m0,n0] = sum over k1, k0 of lhs[m1,k1,m0,k0] * rhs[n1,k1,n0,k0].
""")
