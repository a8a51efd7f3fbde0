"""Data-tiling kernels (mirrors :mod:`polyhal.ops.data_tiling`): pack and unpack are gathers
with per-dim tile arithmetic (on raw bits, any element type); mmt4d is the einsum
``mkac,nkbc->mnab``."""

from __future__ import annotations

from typing import Any, Mapping

from polyhal_opencl.codegen import (
    Arg, DeviceTraits, Recipe, bits_ctype, bits_literal, coord_kernel, dense_strides, linear_launch,
)
from polyhal_opencl.ops.indexing import einsum_recipe


def _tiling(rank: int, attrs: Mapping[str, Any]) -> tuple[list[int], list[int], list[int]]:
    pos = [int(p) for p in attrs["inner_dims_pos"]]
    tiles = [int(t) for t in attrs["inner_tiles"]]
    perm = attrs["outer_dims_perm"]
    return pos, tiles, list(range(rank)) if perm is None else [int(p) for p in perm]


def pack(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Packed element (outer coords permuted, then tile coords) reads source element
    ``outer * tile + inner`` of each tiled dim, or the padding value past the source's end."""
    x, y = in_types[0], out_types[0]
    rank = x.rank
    pos, tiles, perm = _tiling(rank, attrs)
    xs = dense_strides(x.shape)
    t = bits_ctype(x.dtype)

    def body(idx: str) -> str:
        lines = [f"  {idx} src = 0;\n  int inside = 1;\n"]
        for d in range(rank):
            j = perm.index(d)
            if d in pos:
                k = pos.index(d)
                lines.append(f"  {{ const {idx} i = c{j} * {tiles[k]} + c{rank + k}; inside &= i < {x.shape[d]};"
                             f" src += i * {xs[d]}; }}\n")
            else:
                lines.append(f"  src += c{j} * {xs[d]};\n")
        lines.append(f"  y[gid] = inside ? x[src] : {bits_literal(attrs['padding_value'], x.dtype)};")
        return "".join(lines)

    src = coord_kernel("pack", y.shape, [("x", t.store, True), ("y", t.store, False)], body, extent=x.size)
    return Recipe(src, linear_launch("pack", y.size, [Arg(0), Arg(1)], traits))


def unpack(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Dense element i of a tiled dim reads outer slot i / tile and tile slot i % tile."""
    x, y = in_types[0], out_types[0]
    rank = y.rank
    pos, tiles, perm = _tiling(rank, attrs)
    ps = dense_strides(x.shape)
    t = bits_ctype(x.dtype)

    def body(idx: str) -> str:
        terms = []
        for d in range(rank):
            j = perm.index(d)
            if d in pos:
                k = pos.index(d)
                terms.append(f"(c{d} / {tiles[k]}) * {ps[j]} + (c{d} % {tiles[k]}) * {ps[rank + k]}")
            else:
                terms.append(f"c{d} * {ps[j]}")
        return f"  y[gid] = x[{' + '.join(terms) or '0'}];"

    src = coord_kernel("unpack", y.shape, [("x", t.store, True), ("y", t.store, False)], body, extent=x.size)
    return Recipe(src, linear_launch("unpack", y.size, [Arg(0), Arg(1)], traits))


def mmt4d(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """out[m1, n1, m0, n0] = sum over k1, k0 of lhs[m1, k1, m0, k0] * rhs[n1, k1, n0, k0]."""
    return einsum_recipe("mmt4d", "mkac,nkbc->mnab", in_types, out_types[0], traits)


GENERATORS = {"pack": pack, "unpack": unpack, "mmt4d": mmt4d}
