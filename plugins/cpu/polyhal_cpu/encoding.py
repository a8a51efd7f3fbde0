"""Data tiling on the CPU: the encoding resolver (IREE's ``#iree_cpu.cpu_encoding_resolver``)
and the ``pack`` / ``unpack`` / ``mmt4d`` kernels its layouts materialize into.

Layouts. A float32/float64 matmul operand is tiled in the mmt4d arrangement
(:class:`~polyhal.ir.encoding.PackedLayout`): LHS ``(M,K) -> (M1,K1,M0,K0)``, RHS
``(K,N) -> (N1,K1,N0,K0)`` (transposed tiles), RESULT ``(M,N) -> (M1,N1,M0,N0)``. Each dim's
tile depends only on that dim's size (:func:`tile_size`), so the tiles of a matmul's result are
those of the next matmul's LHS: a chain of matmuls is packed once at its inputs, unpacked once
at its output, and its links hand packed data to each other.

Which devices tile, and how big the tiles are, is per device: ``DeviceSpec.capabilities`` has
``"data-tiling"`` and ``limits["data_tile"]`` is the tile bound (see :mod:`polyhal_cpu.plugin`,
``POLYHAL_CPU_DATA_TILING`` and ``POLYHAL_CPU_DATA_TILE``). A CPU device without the
capability resolves every encoding to the identity layout, so its encode ops all fold.

Kernels. numpy has no register-tile micro-kernel, so ``mmt4d`` does what is fastest with BLAS:
when the reduction is one tile (``K1 == 1``) it is one batched ``np.matmul`` straight over the
tiles, with no copy; otherwise it either makes one batched matmul per reduction tile and sums
them, or gathers the tiles into two row-major panels, makes one BLAS call and scatters the
result into tiles (three linear copies next to an O(MNK) product). Which of the two wins
depends on the machine, so large shapes time both once when first prepared. ``pack`` of an RHS transposes inside tiles; numpy's transposing copies are not cache
blocked, so large tiles are copied in 128x128 blocks.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Callable

import numpy as np

from polyhal.hookspecs import hookimpl
from polyhal.ir.encoding import (
    LHS, RESULT, RHS, ChannelBlockedLayout, FeatureMapEncoding, IdentityLayout, MatmulEncoding, PackedLayout,
)
from polyhal_cpu import native, onednn
from polyhal_cpu.ops import BLOCKED_CONV
from polyhal_cpu.settings import DEFAULT_TILE
from polyhal_cpu.table import TABLE, float16_via_float32

#: Tiles are multiples of this (when a dim needs several tiles), for aligned SIMD rows.
TILE_QUANTUM = 8
#: Element types the CPU tiles: the BLAS types. Others resolve to the identity layout.
TILED_TYPES = frozenset({np.dtype(np.float32), np.dtype(np.float64)})


def tile_size(dim: int, bound: int) -> int:
    """The tile of a dim of size ``dim``: the whole dim when it fits in ``bound``, else the
    smallest multiple of TILE_QUANTUM that covers ``dim`` in ``ceil(dim / bound)`` tiles (so
    padding stays under one quantum per tile). A function of ``dim`` alone, so that a matmul
    result and the next matmul's LHS agree."""
    if dim <= bound:
        return max(dim, 1)
    tiles = math.ceil(dim / bound)
    return min(bound, TILE_QUANTUM * math.ceil(math.ceil(dim / tiles) / TILE_QUANTUM))


@hookimpl
def resolve_encoding(device, encoding, tensor_type):
    """Packed mmt4d layouts for float32/float64 matmul operands and channel-blocked layouts
    (NCHWc, one block of all channels) for float32 feature maps of conv chains on CPU devices with
    ``"data-tiling"`` (depthwise chains where the compiled loops or oneDNN run their convs, other
    chains where oneDNN does); the identity layout for other
    matmul and feature-map encodings on CPU devices; ``None`` (defer) for other backends and
    for encodings this resolver does not know."""
    if device.backend != "cpu":
        return None
    if isinstance(encoding, FeatureMapEncoding):
        # One block of all channels: BLAS wants a pointwise conv's contraction (the channels)
        # contiguous, and the depthwise loop vectorises across the block either way.
        # Chains of ordinary convs stay NCHW: as GEMMs they run as fast, and a blocked layout
        # would only add relayouts.
        # With oneDNN, chains of ordinary convs are kept channels-last too: its convs take nhwc
        # as they lie (brgconv on AVX2 and AVX-512 chooses it for layout "any"), so the chain's
        # links fold and only its edges pay a reorder. Filters stay dense: the primitive reorders
        # constant weights into its own layout once. Depthwise chains likewise where the
        # compiled loops are not loaded (the library tier): oneDNN runs their convs on nhwc, where
        # on NCHW each conv paid a reorder in and out (EfficientNet-B0 on the library tier, AVX-512
        # VM: b1 31.5 -> 14.1 ms a run, b8 214 -> 94 ms; docs/cpu-onednn.md, "What retiring costs").
        library = encoding.role == "map" and tensor_type.dtype == np.float32 and onednn.usable() and (
            encoding.chain == "dense" or encoding.chain == "depthwise")
        if "data-tiling" not in device.capabilities or not (library or (
                encoding.chain == "depthwise" and native.available(tensor_type.dtype))):
            return IdentityLayout(tensor_type)
        return ChannelBlockedLayout(tensor_type, (1,), (tensor_type.shape[1],), resolver="cpu", conv_op=BLOCKED_CONV)
    if not isinstance(encoding, MatmulEncoding):
        return None
    if "data-tiling" not in device.capabilities or tensor_type.dtype not in TILED_TYPES:
        return IdentityLayout(tensor_type)
    bound = int(device.limits.get("data_tile", DEFAULT_TILE))
    rows, cols = tensor_type.shape
    if encoding.operand_index == RHS:  # (K, N) -> (N1, K1, N0, K0): tiles of B^T
        return PackedLayout(tensor_type, (1, 0), (tile_size(cols, bound), tile_size(rows, bound)),
                            outer_dims_perm=(1, 0), resolver="cpu")
    # LHS (M, K) -> (M1, K1, M0, K0); RESULT (M, N) -> (M1, N1, M0, N0): the same arrangement,
    # which is what lets a result feed the next matmul as its LHS.
    assert encoding.operand_index in (LHS, RESULT)
    return PackedLayout(tensor_type, (0, 1), (tile_size(rows, bound), tile_size(cols, bound)), resolver="cpu")


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------

def _tiling(shape: tuple[int, ...], attrs: dict):
    """(padded shape, split shape, transpose order from split to packed) for pack/unpack."""
    pos = tuple(int(p) for p in attrs["inner_dims_pos"])
    tiles = tuple(int(t) for t in attrs["inner_tiles"])
    rank = len(shape)
    perm = tuple(range(rank)) if attrs["outer_dims_perm"] is None else tuple(int(p) for p in attrs["outer_dims_perm"])
    padded, split, outer_axis, inner_axis = [], [], {}, {}
    for d, size in enumerate(shape):
        if d in pos:
            tile = tiles[pos.index(d)]
            outer = -(-size // tile)
            padded.append(outer * tile)
            outer_axis[d], inner_axis[d] = len(split), len(split) + 1
            split += [outer, tile]
        else:
            padded.append(size)
            outer_axis[d] = len(split)
            split.append(size)
    order = tuple(outer_axis[d] for d in perm) + tuple(inner_axis[d] for d in pos)
    return tuple(padded), tuple(split), order


@TABLE.register("pack")
def _pack(device, op: str, attrs: dict, ins: tuple, outs: tuple, scratch) -> Callable[..., None]:
    shape, dtype = ins[0].shape, ins[0].dtype
    padded, split, order = _tiling(shape, attrs)
    copyto = np.copyto
    if padded == shape and _transposing(split, order, outs[0].shape):
        def blocked(x, out):
            _blocked_copy(out, x.reshape(split).transpose(order))
        return blocked
    if padded == shape:
        def kernel(x, out):
            copyto(out, x.reshape(split).transpose(order))  # one strided copy
        return kernel
    fill = np.asarray(attrs["padding_value"]).astype(dtype)
    inside = tuple(slice(0, s) for s in shape)
    copy = _blocked_copy if _transposing(split, order, outs[0].shape) else copyto

    def padded_kernel(x, out):
        # The last tile of a dim is partial: pad in a scratch array, then one strided copy.
        buf = np.empty(padded, dtype)
        buf[...] = fill
        buf[inside] = x
        copy(out, buf.reshape(split).transpose(order))
    return padded_kernel


#: Block edge of transposing copies, and the tile edge from which they are blocked.
_BLOCK, _BLOCKED_FROM = 128, 256


def _transposing(split: tuple[int, ...], order: tuple[int, ...], packed: tuple[int, ...]) -> bool:
    """Whether the pack reads its innermost dim with a stride (transposes inside tiles) and its
    tiles are big enough for cache blocking to pay."""
    return order[-1] != len(split) - 1 and len(packed) >= 2 and min(packed[-2:]) >= _BLOCKED_FROM


def _blocked_copy(out: np.ndarray, view: np.ndarray) -> None:
    """``out[...] = view`` in blocks of the last two dims that stay in cache."""
    if out.ndim < 2 or min(out.shape[-2:]) < _BLOCKED_FROM:
        np.copyto(out, view)
        return
    rows, cols = out.shape[-2:]
    for i in range(0, rows, _BLOCK):
        for j in range(0, cols, _BLOCK):
            np.copyto(out[..., i:i + _BLOCK, j:j + _BLOCK], view[..., i:i + _BLOCK, j:j + _BLOCK])


@TABLE.register("unpack")
def _unpack(device, op: str, attrs: dict, ins: tuple, outs: tuple, scratch) -> Callable[..., None]:
    shape = outs[0].shape
    padded, split, order = _tiling(shape, attrs)
    inverse = tuple(int(i) for i in np.argsort(order))
    copyto = np.copyto
    if padded == shape:
        def kernel(x, out):
            copyto(out.reshape(split), x.transpose(inverse))  # out is contiguous: a view
        return kernel
    inside = tuple(slice(0, s) for s in shape)

    def padded_kernel(x, out):
        copyto(out, x.transpose(inverse).reshape(padded)[inside])
    return padded_kernel


def _batched(lhs, rhs, out):
    """K1 == 1: out[i, j] = lhs[i, 0] @ rhs[j, 0]^T for every tile pair, one batched BLAS loop
    over the tiles as they lie (rhs tiles transposed by strides, not copied)."""
    np.matmul(lhs[:, None, 0], rhs[None, :, 0].swapaxes(-1, -2), out=out)


def _accumulated(lhs, rhs, out):
    """One batched matmul per reduction tile, summed: no gather copies, K1 extra passes over out."""
    np.matmul(lhs[:, None, 0], rhs[None, :, 0].swapaxes(-1, -2), out=out)
    part = np.empty_like(out)
    for k in range(1, lhs.shape[1]):
        np.matmul(lhs[:, None, k], rhs[None, :, k].swapaxes(-1, -2), out=part)
        np.add(out, part, out=out)


def _gathered(lhs, rhs, out):
    """Gather the tiles into row panels and make one BLAS call (what a native mmt4d micro-kernel
    does in registers, numpy does best in one sgemm), then scatter the result into tiles."""
    (m1, k1, m0, k0), (n1, _, n0, _) = lhs.shape, rhs.shape
    a = lhs.transpose(0, 2, 1, 3).reshape(m1 * m0, k1 * k0)
    b = rhs.transpose(0, 2, 1, 3).reshape(n1 * n0, k1 * k0)
    np.copyto(out, np.matmul(a, b.T).reshape(m1, m0, n1, n0).transpose(0, 2, 1, 3))


#: Products (M*N*K) from which mmt4d times its two strategies once per shape instead of guessing.
_TUNE_FROM = 1 << 24


@functools.lru_cache(maxsize=256)
def _strategy(lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dtype: np.dtype) -> Callable[..., None]:
    """The mmt4d strategy for these shapes. Which of gathering and accumulating is faster depends
    on the machine (how BLAS scales over cores against single-threaded copies), so large shapes
    are timed once, on scratch data, when first prepared; small ones follow the tile size."""
    (m1, k1, m0, k0), (n1, _, n0, _) = lhs_shape, rhs_shape
    if k1 == 1:
        return _batched
    if m1 * m0 * n1 * n0 * k1 * k0 < _TUNE_FROM:
        return _accumulated if min(m0, n0, k0) >= _BLOCKED_FROM else _gathered
    rng = np.random.default_rng(0)
    lhs, rhs = rng.random(lhs_shape).astype(dtype), rng.random(rhs_shape).astype(dtype)
    out = np.empty((m1, n1, m0, n0), dtype)
    best, best_time = _gathered, math.inf
    for candidate in (_gathered, _accumulated):
        candidate(lhs, rhs, out)  # warm up (BLAS threads, page faults)
        elapsed = math.inf
        for _ in range(2):
            start = time.perf_counter()
            candidate(lhs, rhs, out)
            elapsed = min(elapsed, time.perf_counter() - start)
        if elapsed < best_time:
            best, best_time = candidate, elapsed
    return best


@TABLE.register("mmt4d")
@float16_via_float32
def _mmt4d(device, op: str, attrs: dict, ins: tuple, outs: tuple, scratch) -> Callable[..., None]:
    return _strategy(ins[0].shape, ins[1].shape, ins[0].dtype)
