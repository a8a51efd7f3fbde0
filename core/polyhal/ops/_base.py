"""The op registry and the helpers every op family shares.

An op is defined once, here in the core, by an :class:`OpDef`: its type inference (which validates
operands and attributes), a plain numpy reference implementation (the conformance oracle) and a
sampler of random inputs. Backends implement kernels for the ops separately.

The attributes an op accepts, and their defaults, are read from the keyword-only parameters of its
reference function, so the reference, the inference and :func:`resolve_attrs` cannot disagree on
them. A keyword-only parameter without a default is a required attribute.
"""

from __future__ import annotations

import difflib
import inspect
import math
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polyhal.errors import DTypeError, PolyhalError, ProgramError, ShapeError
from polyhal.ir.types import COMPUTE_DTYPES, SymbolicDim, SymbolicDimError, TensorType, hinted

__all__ = [
    "CONTRACTION_PRECISIONS", "OpDef", "OPS", "REQUIRED", "core_ops", "get_op", "infer_types", "canonical_attrs", "resolve_attrs",
]

#: (rtol, atol) used to compare float32 results against the reference unless an op says otherwise.
DEFAULT_TOLERANCE = (1e-5, 1e-6)

#: Marker in :attr:`OpDef.defaults` for an attribute the caller must give.
REQUIRED: Any = inspect.Parameter.empty


@dataclass(frozen=True)
class OpDef:
    """Everything the core knows about one op, shared by every backend.

    Attributes:
        name: the op's name in programs.
        num_inputs: number of operands, or ``None`` when it varies (``concat`` takes one or more,
            ``gemm`` two or three); ``infer`` checks the count in every case.
        infer: ``infer(input_types, attrs) -> output_types``; validates operand types and
            attributes and raises :class:`~polyhal.errors.ShapeError`,
            :class:`~polyhal.errors.DTypeError` or :class:`~polyhal.errors.ProgramError` with a
            message that starts with the op name and says what was expected.
        reference: ``reference(*inputs, **attrs) -> outputs``: plain numpy, computed in float64
            for float inputs and cast to the inferred output dtype. The conformance oracle.
        sample: ``sample(rng) -> (inputs, attrs)``: fresh random inputs (no zeros, float32 unless
            the op needs otherwise, at most 64x64) and attributes that exercise broadcasting
            and axes where the op has them.
        tolerance: ``(rtol, atol)`` for comparing float32 results with the reference.
        doc: one paragraph on the semantics.
        defaults: attribute name -> default value (:data:`REQUIRED` when there is none).
        fused: a fused form that only fusion passes create, for devices with a kernel of its
            own: a kernel table's fallback does not serve it (it would run on the host what the
            unfused ops ran as device kernels).
        contraction: a product that accumulates over a reduction dim (matmul, conv, attention,
            ...). Such an op takes the ``precision`` attribute (:data:`CONTRACTION_PRECISIONS`,
            default ``"fp32"``), which says how a device may compute its float32 products:
            ``"fp32"`` in float32, ``"tf32"`` on TF32 tensor cores (10-bit mantissa inputs,
            float32 accumulation) where the device has them. As XLA's ``precision_config`` on dot
            and convolution: the compile's precision option sets it
            (:mod:`polyhal.passes.precision`); the reference ignores it.
        backend: None for an op of the core set, which every backend may serve; else the
            backend whose own op this is (``"mydev"`` for ``mydev.add_relu``): defined by
            that backend's kernel table (:meth:`polyhal.hal.kernels.KernelTable.define`), named
            ``"<backend>.<name>"``, created only by that backend's fusion passes or layouts.
    """

    name: str
    num_inputs: int | None
    infer: Callable[[tuple[TensorType, ...], Mapping[str, Any]], tuple[TensorType, ...]]
    reference: Callable[..., tuple[np.ndarray, ...]]
    sample: Callable[[np.random.Generator], tuple[list[np.ndarray], dict]]
    tolerance: tuple[float, float] = DEFAULT_TOLERANCE
    doc: str = ""
    # compare=False keeps OpDef hashable (a mapping is not) and equality about the functions.
    defaults: Mapping[str, Any] = field(default_factory=dict, compare=False)
    fused: bool = False
    contraction: bool = False
    backend: str | None = None


#: The values of a contraction's ``precision`` attribute (see :attr:`OpDef.contraction`).
CONTRACTION_PRECISIONS = ("fp32", "tf32")

#: Every defined op, by name: the core op set, and the ops backends define for themselves
#: (``OpDef.backend``; :func:`core_ops` leaves those out).
OPS: dict[str, OpDef] = {}


def core_ops() -> dict[str, OpDef]:
    """The core op set: the ops of :data:`OPS` that are no backend's own (what every backend
    could serve, and what a kernel table's fallback serves)."""
    return {n: d for n, d in OPS.items() if d.backend is None}


def get_op(name: str) -> OpDef:
    """The :class:`OpDef` called ``name``; an unknown name raises ProgramError listing known ops."""
    try:
        return OPS[name]
    except (KeyError, TypeError):
        pass
    close = difflib.get_close_matches(str(name), OPS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ProgramError(f"unknown op {name!r}; {hint}known ops: {', '.join(sorted(OPS))}")


def infer_types(name: str, input_types: Sequence[TensorType], attrs: Mapping[str, Any] | None = None
                ) -> tuple[TensorType, ...]:
    """Check the operand count, operand types and attributes of op ``name``; return output types.

    Operands may have symbolic dims (:class:`~polyhal.ir.types.SymbolicDim`). The op's inference
    then runs on them as they are: dims it passes through, equal symbols, broadcasting against 1
    or a size, matmul, reductions and a reshape's -1 keep their names. Where it would need a
    symbol's size (arithmetic, a comparison it cannot decide), it is run again with every
    symbolic dim at its sample size (``hint``) to check operands and attributes and learn the
    results' rank, and each result dim becomes a *derived* dim, re-inferred from the concrete
    sizes when the program is specialized. An error in that probe is the op's error for every
    size of the symbols.
    """
    op = get_op(name)
    input_types = tuple(input_types)
    attrs = attrs or {}
    if all(not isinstance(t, TensorType) or t.is_static for t in input_types):
        return op.infer(input_types, attrs)
    try:
        return op.infer(input_types, attrs)
    except SymbolicDimError:
        pass
    probe = tuple(TensorType(hinted(t.shape), t.dtype, t.encoding) for t in input_types)
    try:
        results = op.infer(probe, attrs)
    except PolyhalError as exc:
        sizes = dict.fromkeys(f"{d}={d.hint}" for t in input_types for d in t.shape if isinstance(d, SymbolicDim))
        raise type(exc)(f"{exc} (inferred with the symbolic dims at sample sizes {', '.join(sizes)}: the op must "
                        "hold for every size they take; where it holds for one size only, give that size "
                        "instead of a symbol)") from None
    return tuple(TensorType(tuple(SymbolicDim.fresh(d) for d in t.shape), t.dtype, t.encoding) for t in results)


def resolve_attrs(name: str, attrs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``attrs`` with op ``name``'s defaults filled in; unknown or missing attributes raise
    ProgramError. Values are returned as given (inference validates them)."""
    op = get_op(name)
    try:
        return _resolve(op.defaults, attrs or {})
    except ProgramError as exc:
        raise ProgramError(f"{name}: {exc}") from None


def canonical_attrs(attrs: Mapping[str, Any] | None) -> tuple:
    """A hashable, order-independent form of ``attrs`` for cache keys.

    Returns a tuple of ``(name, value)`` pairs sorted by name, where lists and tuples become
    tuples (recursively), numpy dtypes and scalar types become their names, numpy scalars and
    arrays become Python values, and nested mappings are canonicalised the same way.
    """
    return tuple(sorted((str(k), _canonical_value(v)) for k, v in (attrs or {}).items()))


def _canonical_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return canonical_attrs(value)
    if isinstance(value, (list, tuple)):
        return tuple(_canonical_value(v) for v in value)
    if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        return str(np.dtype(value))
    if isinstance(value, np.ndarray):
        return _canonical_value(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    return value


# --------------------------------------------------------------------------------- defining ops


def define(
    name: str,
    *,
    infer: Callable[..., tuple[TensorType, ...]],
    reference: Callable[..., tuple[np.ndarray, ...]],
    sample: Callable[[np.random.Generator], tuple[list[np.ndarray], dict]],
    arity: int | tuple[int, int | None],
    tolerance: tuple[float, float] = DEFAULT_TOLERANCE,
    doc: str = "",
    fused: bool = False,
    contraction: bool = False,
    backend: str | None = None,
) -> OpDef:
    """Build the :class:`OpDef` for ``name`` and register it in :data:`OPS`.

    ``infer`` is written as ``infer(*input_types, **attrs)`` with every attribute filled in; the
    wrapper stored in the OpDef checks the operand count (``arity`` is a count or an inclusive
    ``(min, max)`` range, ``max=None`` for unbounded), fills in defaults, rejects unknown
    attributes and prefixes the op name to every error it raises. ``reference``'s keyword-only
    parameters declare the attributes. A ``contraction`` also takes ``precision`` (see
    :attr:`OpDef.contraction`), which its infer and reference never see. ``backend``: see
    :attr:`OpDef.backend` (backends define their ops through their kernel table, which checks
    the name). A name defined twice is a ProgramError.
    """
    lo, hi = (arity, arity) if isinstance(arity, int) else arity
    declared = {
        p.name: p.default
        for p in inspect.signature(reference).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    if contraction:
        declared["precision"] = "fp32"
        reference = _without_precision(reference)
    defaults = types.MappingProxyType(declared)

    def checked_infer(input_types: Sequence[TensorType], attrs: Mapping[str, Any] | None = None
                      ) -> tuple[TensorType, ...]:
        try:
            n = len(input_types)
            if n < lo or (hi is not None and n > hi):
                want = (f"{lo}" if lo == hi else f"{lo} or more" if hi is None
                        else f"{lo} or {hi}" if hi == lo + 1 else f"{lo} to {hi}")
                raise ProgramError(f"expects {want} input{'s' * (want != '1')}, got {n}")
            for i, t in enumerate(input_types):
                if not isinstance(t, TensorType):
                    raise ProgramError(f"input {i} is {type(t).__name__}, not a TensorType")
            resolved = _resolve(defaults, attrs or {})
            if contraction:
                precision = resolved.pop("precision")
                if precision not in CONTRACTION_PRECISIONS:
                    raise ProgramError(f"precision must be one of {', '.join(CONTRACTION_PRECISIONS)}, got "
                                       f"{precision!r}")
            return tuple(infer(*input_types, **resolved))
        except PolyhalError as exc:
            if str(exc).startswith(f"{name}: "):
                raise
            raise type(exc)(f"{name}: {exc}") from None

    checked_infer.__doc__ = f"Infer the output types of {name!r}."
    op = OpDef(name, lo if lo == hi else None, checked_infer, reference, sample, tolerance,
               inspect.cleandoc(doc), defaults, fused, contraction, backend)
    if name in OPS:
        raise ProgramError(f"op {name!r} is defined twice")
    OPS[name] = op
    return op


def _without_precision(reference: Callable[..., Any]) -> Callable[..., Any]:
    """``reference`` taking (and ignoring) a contraction's ``precision``: the reference computes
    in float64 whatever the device may do."""
    def ref(*inputs: Any, precision: str = "fp32", **attrs: Any) -> Any:
        return reference(*inputs, **attrs)
    ref.__name__, ref.__qualname__, ref.__doc__ = reference.__name__, reference.__qualname__, reference.__doc__
    ref.__module__ = reference.__module__
    return ref


def _resolve(defaults: Mapping[str, Any], attrs: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(attrs) - set(defaults))
    if unknown:
        known = ", ".join(defaults) or "none"
        raise ProgramError(f"unknown attribute{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}"
                           f"; known attributes: {known}")
    resolved = {**defaults, **attrs}
    missing = [k for k, v in resolved.items() if v is REQUIRED]
    if missing:
        raise ProgramError(f"missing required attribute{'s' * (len(missing) > 1)} "
                           f"{', '.join(map(repr, missing))}")
    return resolved


# ---------------------------------------------------------------------- element type families

FLOAT = frozenset(np.dtype(n) for n in ("float16", "float32", "float64"))
SIGNED_INT = frozenset(np.dtype(n) for n in ("int8", "int16", "int32", "int64"))
UNSIGNED_INT = frozenset(np.dtype(n) for n in ("uint8", "uint16", "uint32", "uint64"))
#: Every supported type but bool: what arithmetic accepts.
NUMERIC = FLOAT | SIGNED_INT | UNSIGNED_INT
#: Types with a negation: floats and signed integers.
SIGNED = FLOAT | SIGNED_INT
#: Every compute type. The storage types (bfloat16, float8, int4, ...) take part in arithmetic
#: only after a 'cast' to one of these.
ANY = frozenset(COMPUTE_DTYPES)
INDEX = frozenset(np.dtype(n) for n in ("int32", "int64"))


def _listed(types: frozenset) -> str:
    return ", ".join(sorted(map(str, types)))


#: How messages describe the families (others are listed type by type).
_FAMILY_NAMES = {
    FLOAT: f"a float type ({_listed(FLOAT)})",
    NUMERIC: "a numeric (non-bool) type",
    SIGNED: f"a float or signed integer type ({_listed(SIGNED)})",
    INDEX: "int32 or int64",
}


def check_dtype(t: TensorType, allowed: frozenset, operand: str | int = 0) -> None:
    """Raise DTypeError unless ``t``'s element type is in ``allowed``."""
    if t.dtype not in allowed:
        want = _FAMILY_NAMES.get(allowed) or _listed(allowed)
        hint = "; insert a 'cast'" if allowed != INDEX else ""
        raise DTypeError(f"{_operand(operand)} has element type {t.dtype}, expected {want}{hint}")


def check_same_dtype(*ts: TensorType, first: int = 0) -> np.dtype:
    """Raise DTypeError unless all ``ts`` (operands ``first``, ``first + 1``, ...) share one
    element type; return it."""
    dts = [t.dtype for t in ts]
    if len(set(dts)) > 1:
        listed = ", ".join(f"{_operand(i)} {d}" for i, d in enumerate(dts, first))
        raise DTypeError(f"operands must have the same element type, got {listed}; insert a "
                         f"'cast' op to convert one of them")
    return dts[0]


def _operand(operand: str | int) -> str:
    return f"operand {operand}" if isinstance(operand, int) else operand


# ------------------------------------------------------------------------------ shapes, axes

def fmt_shape(shape: Sequence[int]) -> str:
    """``(3,4)``, ``(5,)``, ``()``: compact shape text for messages."""
    shape = tuple(shape)
    return f"({shape[0]},)" if len(shape) == 1 else "(" + ",".join(map(str, shape)) + ")"


def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy broadcasting of ``shapes``; ShapeError naming them when they do not broadcast.

    Symbolic dims broadcast too: a symbol against 1 or itself stays the symbol, against a size
    ``n`` other than 1 gives ``n`` (the symbol must be 1 or ``n``, which specialization checks);
    two different symbols give a derived dim (either may be 1).
    """
    shapes = [tuple(s) for s in shapes]
    try:
        if all(not isinstance(d, SymbolicDim) for s in shapes for d in s):
            return tuple(np.broadcast_shapes(*shapes))
        return tuple(_broadcast_dim([s[i] for s in shapes if len(s) >= -i])
                     for i in range(-max(map(len, shapes)), 0))
    except ValueError:
        listed = [fmt_shape(s) for s in shapes]
        text = " and ".join(listed) if len(listed) == 2 else ", ".join(listed[:-1]) + " and " + listed[-1]
        raise ShapeError(f"shapes {text} do not broadcast") from None


def _broadcast_dim(dims: list) -> Any:
    """One axis of :func:`broadcast` with symbolic dims (ValueError where sizes conflict)."""
    result: Any = 1
    for d in dims:
        if isinstance(d, SymbolicDim):
            if isinstance(result, SymbolicDim):
                if result.name != d.name:  # either may be 1: a derived dim (its sample size: the larger)
                    result = SymbolicDim.fresh(max(result.hint, d.hint))
            elif result == 1:
                result = d
            # else a size n != 1 stays: the symbol must be 1 or n
        elif d != 1:
            if isinstance(result, SymbolicDim) or result == 1:
                result = d
            elif result != d:
                raise ValueError(f"{result} and {d}")
    return result


def int_attr(value: Any, name: str) -> int:
    """``value`` as an int; ProgramError for bools, floats and other non-integers."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ProgramError(f"attribute {name!r} must be an integer, got {value!r}")
    return int(value)


def int_list_attr(value: Any, name: str) -> tuple[int, ...]:
    """``value`` (an int or a sequence of ints) as a tuple of ints."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return (int(value),)
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise ProgramError(f"attribute {name!r} must be a list of integers, got {value!r}")
    return tuple(int_attr(v, name) for v in value)


def bool_attr(value: Any, name: str) -> bool:
    """``value`` as a bool; 0 and 1 are accepted too (ONNX encodes flags as ints)."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise ProgramError(f"attribute {name!r} must be a bool, got {value!r}")


def float_attr(value: Any, name: str) -> float:
    """``value`` as a float (ints accepted)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ProgramError(f"attribute {name!r} must be a number, got {value!r}")
    return float(value)


def normalize_axis(axis: Any, rank: int, name: str = "axis") -> int:
    """``axis`` in ``[-rank, rank)`` made non-negative; ShapeError when out of range."""
    axis = int_attr(axis, name)
    if not -rank <= axis < rank:
        valid = f"valid: {-rank}..{rank - 1}" if rank else "a 0-d operand has no axes"
        raise ShapeError(f"{name} {axis} is out of range for rank {rank} ({valid})")
    return axis % rank


def normalize_axes(axes: Any, rank: int, name: str = "axes") -> tuple[int, ...]:
    """``axes`` (None = all, an int, or a list) as a sorted tuple of distinct non-negative axes."""
    if axes is None:
        return tuple(range(rank))
    norm = [normalize_axis(a, rank, name) for a in int_list_attr(axes, name)]
    if len(set(norm)) != len(norm):
        raise ShapeError(f"{name} {list(int_list_attr(axes, name))} repeats an axis")
    return tuple(sorted(norm))


# ------------------------------------------------------------------------- reference helpers

def wide(x: np.ndarray) -> np.ndarray:
    """``x`` in float64 when it is a float array (references compute in float64), else as is."""
    x = np.asarray(x)
    return x.astype(np.float64) if x.dtype.kind == "f" else x


def narrow(result: Any, dtype: np.dtype) -> np.ndarray:
    """A reference result as an array of the inferred output ``dtype``."""
    return np.asarray(result).astype(dtype)


# ------------------------------------------------------------------------------ sample helpers

def nonzero(rng: np.random.Generator, shape: Sequence[int], lo: float = 0.5, hi: float = 2.0,
            *, positive: bool = False, dtype: Any = np.float32) -> np.ndarray:
    """Random values with magnitude in ``[lo, hi]`` and random sign (never zero)."""
    mag = rng.uniform(lo, hi, size=tuple(shape))
    if not positive:
        mag *= rng.choice([-1.0, 1.0], size=tuple(shape))
    return np.asarray(mag, dtype=dtype)


def with_ties(rng: np.random.Generator, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """Random values from a small set (+-1, +-2, +-3), so equal elements are common."""
    return rng.choice(np.array([-3, -2, -1, 1, 2, 3], dtype=dtype), size=tuple(shape))


def pick(rng: np.random.Generator, options: Sequence[Any]) -> Any:
    """One of ``options``, chosen uniformly (works for options that are tuples)."""
    return options[int(rng.integers(len(options)))]


def random_shape(rng: np.random.Generator, min_rank: int = 1, max_rank: int = 4,
                 max_dim: int = 6) -> tuple[int, ...]:
    """A random shape with ``min_rank..max_rank`` dims of size ``1..max_dim``."""
    rank = int(rng.integers(min_rank, max_rank + 1))
    return tuple(int(d) for d in rng.integers(1, max_dim + 1, size=rank))


def prod(shape: Sequence[int]) -> int:
    """Number of elements of ``shape``."""
    return math.prod(shape)
