"""String ops: StringConcat, StringSplit, StringNormalizer, RegexFullMatch, LabelEncoder with
string keys or values, and the string forms of Cast, CastLike, Equal and Identity.

Device buffers hold numbers, so polyhal computes strings on the host, around the device plan
(see :class:`~polyhal.frontends.onnx.types.HostValue`): a string tensor is a numpy array of
Python ``str`` (dtype object). Each converter here gives ``ctx.host`` a numpy function of its
operands; it runs at import when they are known, else when the program runs. Numbers made from
strings (Equal, RegexFullMatch, a LabelEncoder to numbers, Cast from string) enter the plan as
inputs the host computes; strings made from the plan's numbers (Cast to string, a LabelEncoder
to strings) are made after the plan, so they can be model outputs or feed other string ops.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import Decline, converter
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.types import STRING, STRING_DTYPE, HostValue, is_strings, np_dtype

ML = "ai.onnx.ml"


def _strings(a: Any) -> np.ndarray:
    """``a`` (a result of numpy on strings; a scalar for 0-d) as an array of dtype object."""
    out = np.empty(np.shape(a), dtype=object)
    out[...] = a
    return out


def _map(fn, x: np.ndarray, otype: Any) -> np.ndarray:
    """``fn`` applied to every element of ``x`` (any shape, empty included), results of ``otype``."""
    out = np.empty(x.shape, dtype=otype)
    flat = out.reshape(-1)
    for i, item in enumerate(x.reshape(-1)):
        flat[i] = fn(item)
    return out


def _string_input(ctx: NodeContext, i: int) -> Any:
    """Input ``i``, which ONNX declares a string tensor."""
    x = ctx.host_input(i)
    if not is_strings(x):
        raise OnnxModelError(f"{ctx.op_type}'s input {i} must hold strings, got {getattr(x, 'dtype', x)}")
    return x


def _broadcast_shape(ctx: NodeContext, *xs: Any) -> tuple | None:
    shapes = [getattr(x, "shape", None) for x in xs]
    if any(s is None for s in shapes):
        return None
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise OnnxModelError(f"{ctx.op_type}: shapes {' and '.join(map(str, shapes))} do not broadcast") from None


# ------------------------------------------------------------------------------- string ops

@converter("StringConcat")
def _string_concat(ctx: NodeContext) -> list:
    x, y = _string_input(ctx, 0), _string_input(ctx, 1)
    return [ctx.host(lambda a, b: _strings(np.add(a, b)), x, y, dtype=STRING_DTYPE,
                     shape=_broadcast_shape(ctx, x, y))]


@converter("RegexFullMatch")
def _regex_full_match(ctx: NodeContext) -> list:
    x = _string_input(ctx, 0)
    pattern = ctx.attr("pattern")
    try:  # ONNX specifies RE2 syntax; Python's re accepts the RE2 patterns models use
        regex = re.compile(pattern)
    except re.error as exc:
        raise OnnxModelError(f"RegexFullMatch pattern {pattern!r} is not a valid regular expression: {exc}") from None
    return [ctx.host(lambda a: _map(lambda s: regex.fullmatch(s) is not None, a, np.bool_), x,
                     dtype=np.bool_, shape=x.shape)]


@converter("StringSplit")
def _string_split(ctx: NodeContext) -> list:
    x = _string_input(ctx, 0)
    delimiter = ctx.attr("delimiter", "") or None  # none or empty: runs of whitespace separate
    maxsplit = int(ctx.attr("maxsplit", -1))
    if maxsplit < -1:
        raise OnnxModelError(f"StringSplit maxsplit must be >= 0 (or absent), got {maxsplit}")

    def split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = _map(lambda s: s.split(delimiter, maxsplit), a, object)
        counts = _map(len, parts, np.int64)
        width = int(counts.max(initial=0))
        out = np.full((*a.shape, width), "", dtype=object)
        for index in np.ndindex(a.shape):
            out[index][: counts[index]] = parts[index]
        return out, counts

    both = ctx.host(split, x, dtype=None, shape=None)
    # The substrings' last dim is the longest split: known only from the data; the counts' shape is x's.
    return [ctx.host(lambda p: p[0], both, dtype=STRING_DTYPE, shape=None, what=f"the substrings of {ctx.label}"),
            ctx.host(lambda p: p[1], both, dtype=np.int64, shape=x.shape, what=f"the counts of {ctx.label}")]


@converter("StringNormalizer")
def _string_normalizer(ctx: NodeContext) -> list:
    x = _string_input(ctx, 0)
    if len(x.shape) not in (1, 2) or (len(x.shape) == 2 and x.shape[0] != 1):
        raise OnnxModelError(f"StringNormalizer takes shape [C] or [1, C], got {list(x.shape)}")
    action = ctx.attr("case_change_action", "NONE")
    change = {"LOWER": str.lower, "UPPER": str.upper, "NONE": None}.get(action, False)
    if change is False:
        raise OnnxModelError(f"StringNormalizer case_change_action must be LOWER, UPPER or NONE, got {action!r}")
    sensitive = bool(ctx.attr("is_case_sensitive", 0))
    stopwords = list(ctx.attr("stopwords", []))
    stops = set(stopwords) if sensitive else {w.lower() for w in stopwords}

    def normalize(a: np.ndarray) -> np.ndarray:
        words = [w for w in a.reshape(-1) if (w if sensitive else w.lower()) not in stops]
        words = [change(w) for w in words] if change else words
        out = _strings(words or [""])  # every word a stopword: one empty string, as ONNX says
        return out.reshape(1, -1) if a.ndim == 2 else out

    # Stopwords make the length depend on the data; without them it is x's.
    return [ctx.host(normalize, x, dtype=STRING_DTYPE, shape=None if stops else x.shape)]


# ------------------------------------------------------------- string forms of numeric ops

@converter("Identity", strings=True)
def _identity_strings(ctx: NodeContext) -> list:
    x = ctx.raw_input(0)
    if not (is_strings(x) or isinstance(x, HostValue)):
        raise Decline("not a host value")
    return [x]


@converter("Equal", strings=True)
def _equal_strings(ctx: NodeContext) -> list:
    x, y = ctx.host_input(0), ctx.host_input(1)
    if not (is_strings(x) or is_strings(y)):
        raise Decline("numbers")
    if not (is_strings(x) and is_strings(y)):
        raise OnnxModelError("Equal compares strings only with strings")
    return [ctx.host(lambda a, b: np.asarray(np.equal(a, b), dtype=np.bool_), x, y, dtype=np.bool_,
                     shape=_broadcast_shape(ctx, x, y))]


@converter("Cast", strings=True)
def _cast_strings(ctx: NodeContext) -> list:
    return [_cast(ctx, ctx.host_input(0), int(ctx.attr("to")))]


@converter("CastLike", strings=True)
def _cast_like_strings(ctx: NodeContext) -> list:
    like = ctx.host_input(1)
    to = STRING if is_strings(like) else onnx.helper.np_dtype_to_tensor_dtype(ctx.dtype(like))
    return [_cast(ctx, ctx.host_input(0), to)]


def _cast(ctx: NodeContext, x: Any, to: int) -> Any:
    """Cast ``x`` to ONNX type ``to`` where either side is a string (Decline otherwise)."""
    if to != STRING and not is_strings(x):
        raise Decline("numbers")
    if to == STRING:
        if is_strings(x):
            return x
        # numpy's shortest round-trip text for floats ("0.1", "inf", "nan"), digits for integers
        return ctx.host(lambda a: _strings(np.asarray(a).astype(np.str_)), x, dtype=STRING_DTYPE, shape=ctx.shape(x))
    dtype = np_dtype(to, f"{ctx.op_type}'s target type")

    def parse(a: np.ndarray) -> np.ndarray:
        if dtype.kind == "b":  # ONNX reads "0"/"1" and the words true/false
            return _map(lambda s: s.strip().lower() not in ("", "0", "false"), a, np.bool_)
        try:
            return a.astype(np.str_).astype(dtype)
        except ValueError as exc:
            raise ValueError(f"a string does not read as {dtype}: {exc}") from None

    return ctx.host(parse, x, dtype=dtype, shape=x.shape)


@converter("LabelEncoder", domain=ML, strings=True)
def _label_encoder_strings(ctx: NodeContext) -> list:
    keys, values = _attr_tensor(ctx, "keys"), _attr_tensor(ctx, "values")
    if keys is None or values is None:
        raise OnnxModelError("LabelEncoder needs keys and values (keys_*/values_* attributes)")
    if not (is_strings(keys) or is_strings(values)):
        raise Decline("numeric keys and values")
    if len(keys) != len(values):
        raise OnnxModelError(f"LabelEncoder has {len(keys)} keys but {len(values)} values; give one value per key")
    default = _default(ctx, values)
    x = ctx.host_input(0)
    if is_strings(x) != is_strings(keys):
        raise OnnxModelError(f"LabelEncoder input is {'strings' if is_strings(x) else ctx.dtype(x)} but its keys "
                             f"are {'strings' if is_strings(keys) else keys.dtype}")
    table = dict(zip(keys.tolist(), values.tolist()))
    if is_strings(values):
        return [ctx.host(lambda a: _map(lambda k: table.get(k, default), np.asarray(a), object), x,
                         dtype=STRING_DTYPE, shape=ctx.shape(x) if not is_strings(x) else x.shape)]
    return [ctx.host(lambda a: _map(lambda k: table.get(k, default), a, values.dtype), x, dtype=values.dtype,
                     shape=x.shape)]


def _attr_tensor(ctx: NodeContext, kind: str) -> np.ndarray | None:
    """LabelEncoder's ``keys`` or ``values`` from whichever of its attributes is set."""
    for suffix, dtype in (("strings", STRING_DTYPE), ("int64s", np.int64), ("floats", np.float32), ("tensor", None)):
        name = f"{kind}_{suffix}"
        if ctx.has_attr(name):
            value = ctx.attr(name)
            return np.asarray(value, dtype=dtype).reshape(-1) if dtype is not None else np.asarray(value).reshape(-1)
    return None


def _default(ctx: NodeContext, values: np.ndarray) -> Any:
    """LabelEncoder's value for a key it lacks (ONNX's defaults: "_Unused", -1, -0.0)."""
    if ctx.has_attr("default_tensor"):
        tensor = np.asarray(ctx.attr("default_tensor")).reshape(-1)
        if tensor.size != 1:
            raise OnnxModelError(f"LabelEncoder default_tensor must hold one value, got {tensor.size}")
        return tensor[0].item() if hasattr(tensor[0], "item") else tensor[0]
    if is_strings(values):
        return ctx.attr("default_string", "_Unused")
    if values.dtype.kind == "i":
        return int(ctx.attr("default_int64", -1))
    if values.dtype.kind == "f":
        return float(ctx.attr("default_float", -0.0))
    raise OnnxUnsupportedError(f"LabelEncoder values of {values.dtype} are not supported")


# ------------------------------------------------------------------------------------ TF-IDF

@converter("TfIdfVectorizer")
def _tfidf_vectorizer(ctx: NodeContext) -> list:
    x = ctx.host_input(0)
    if ctx.has_attr("pool_strings"):
        if not is_strings(x):
            raise OnnxModelError("TfIdfVectorizer with pool_strings takes string input")
        # String tokens become ids on the host (their index in the pool's vocabulary; -1 for a
        # token the pool lacks, which no n-gram matches), and the device counts n-grams of ids.
        words = list(ctx.attr("pool_strings"))
        vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
        pool = [vocab[w] for w in words]
        x = ctx.host(lambda a: _map(lambda s: vocab.get(s, -1), a, np.int64), x, dtype=np.int64, shape=x.shape,
                     what=f"the token ids of {ctx.label}")
    elif ctx.has_attr("pool_int64s"):
        if is_strings(x):
            raise OnnxModelError("TfIdfVectorizer with pool_int64s takes int32 or int64 input, got strings")
        pool = [int(v) for v in ctx.attr("pool_int64s")]
    else:
        raise OnnxModelError("TfIdfVectorizer needs pool_int64s or pool_strings")
    if isinstance(x, HostValue):
        x = ctx.importer.host_feed(x)
    return [ctx.op("tfidf_vectorizer", x,
                   pool=pool, ngram_counts=[int(v) for v in ctx.attr("ngram_counts")],
                   ngram_indexes=[int(v) for v in ctx.attr("ngram_indexes")],
                   weights=[float(v) for v in ctx.attr("weights", [])],
                   min_gram=int(ctx.attr("min_gram_length")), max_gram=int(ctx.attr("max_gram_length")),
                   max_skip=int(ctx.attr("max_skip_count")), mode=ctx.attr("mode"))]
