"""Logical ops on bool tensors and bitwise ops on integers (numpy broadcasting)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from polyhal.errors import ProgramError
from polyhal.ir.types import TensorType
from polyhal.ops._base import (
    SIGNED_INT, UNSIGNED_INT, broadcast, check_dtype, check_same_dtype, define, pick,
)

BOOL = frozenset([np.dtype(bool)])
INTEGER = SIGNED_INT | UNSIGNED_INT

_PAIRS = [((4, 5), (4, 5)), ((2, 3, 4), (4,)), ((3, 1, 5), (1, 4, 5)), ((6,), ()), ((), (2, 3)), ((64, 64), (64, 1))]
_SHAPES = [(4, 5), (3, 4, 5), (64,), (), (2, 3, 1, 4)]


def _bools(rng: np.random.Generator, shape) -> np.ndarray:
    return np.asarray(rng.random(shape) < 0.5)


def _ints(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


#: name: (numpy function, accepted types, doc)
_BINARY: dict[str, tuple[Callable, frozenset, str]] = {
    "logical_and": (np.logical_and, BOOL, "x and y."),
    "logical_or": (np.logical_or, BOOL, "x or y."),
    "logical_xor": (np.logical_xor, BOOL, "x xor y."),
    "bitwise_and": (np.bitwise_and, INTEGER, "x & y, bit by bit."),
    "bitwise_or": (np.bitwise_or, INTEGER, "x | y, bit by bit."),
    "bitwise_xor": (np.bitwise_xor, INTEGER, "x ^ y, bit by bit."),
}


def _define_binary(name: str, fn: Callable, allowed: frozenset, doc: str) -> None:
    def infer(x: TensorType, y: TensorType):
        dtype = check_same_dtype(x, y)
        check_dtype(x, allowed)
        return (TensorType(broadcast(x.shape, y.shape), dtype),)

    def reference(x, y):
        return (np.asarray(fn(x, y)).astype(x.dtype),)

    def sample(rng: np.random.Generator):
        sx, sy = pick(rng, _PAIRS)
        if allowed is BOOL:
            return [_bools(rng, sx), _bools(rng, sy)], {}
        dt = pick(rng, sorted(INTEGER, key=str))
        return [_ints(rng, sx, dt), _ints(rng, sy, dt)], {}

    kinds = "bool operands" if allowed is BOOL else "integer operands"
    define(name, infer=infer, reference=reference, sample=sample, arity=2, tolerance=(0.0, 0.0),
           doc=f"{doc} Takes {kinds} of one type; they broadcast.")


for _name, (_fn, _allowed, _doc) in _BINARY.items():
    _define_binary(_name, _fn, _allowed, _doc)


def _define_not(name: str, allowed: frozenset, doc: str) -> None:
    def infer(x: TensorType):
        check_dtype(x, allowed)
        return (TensorType(x.shape, x.dtype),)

    def reference(x):
        return (np.asarray(np.logical_not(x) if allowed is BOOL else np.invert(x)).astype(x.dtype),)

    def sample(rng: np.random.Generator):
        shape = pick(rng, _SHAPES)
        if allowed is BOOL:
            return [_bools(rng, shape)], {}
        return [_ints(rng, shape, pick(rng, sorted(INTEGER, key=str)))], {}

    define(name, infer=infer, reference=reference, sample=sample, arity=1, tolerance=(0.0, 0.0), doc=doc)


_define_not("logical_not", BOOL, "not x, for bool x.")
_define_not("bitwise_not", INTEGER, "~x, every bit flipped, for integer x.")


# ------------------------------------------------------------------------------------ bit_shift

def _infer_bit_shift(x: TensorType, y: TensorType, *, direction):
    dtype = check_same_dtype(x, y)
    check_dtype(x, INTEGER)
    if direction not in ("left", "right"):
        raise ProgramError(f"attribute 'direction' must be 'left' or 'right', got {direction!r}")
    return (TensorType(broadcast(x.shape, y.shape), dtype),)


def shift(x: np.ndarray, y: np.ndarray, direction: str) -> np.ndarray:
    """The op's definition in numpy (shared by nothing at run time; kernels write their own)."""
    bits = x.dtype.itemsize * 8
    x, y = np.broadcast_arrays(x, y)
    outside = (y < 0) | (y >= bits)
    safe = np.where(outside, 0, y)
    if direction == "left":
        unsigned = np.dtype(f"u{x.dtype.itemsize}")
        shifted = np.left_shift(x.astype(unsigned), safe.astype(unsigned)).astype(x.dtype)
        fill = np.zeros((), x.dtype)
    else:
        shifted = np.right_shift(x, safe.astype(x.dtype))
        fill = np.where(x < 0, -1, 0).astype(x.dtype) if x.dtype.kind == "i" else np.zeros((), x.dtype)
    return np.where(outside, fill, shifted).astype(x.dtype)


def _ref_bit_shift(x, y, *, direction):
    return (shift(np.asarray(x), np.asarray(y), direction),)


def _sample_bit_shift(rng: np.random.Generator):
    sx, sy = pick(rng, _PAIRS)
    dt = np.dtype(pick(rng, sorted(INTEGER, key=str)))
    bits = dt.itemsize * 8
    lo = -2 if dt.kind == "i" else 0
    return [_ints(rng, sx, dt), rng.integers(lo, bits + 2, size=sy).astype(dt)], \
        {"direction": pick(rng, ["left", "right"])}


define("bit_shift", infer=_infer_bit_shift, reference=_ref_bit_shift, sample=_sample_bit_shift, arity=2,
       tolerance=(0.0, 0.0), doc="""
    x << y (direction="left") or x >> y ("right"), integers of one type, as ONNX BitShift: the
    right shift of a signed x is arithmetic; a left shift drops the bits shifted past the top
    (two's complement wrap); a shift by a negative amount or by the bit width or more gives what
    the sign fill alone gives (-1 for a right shift of a negative x, else 0).
""")
