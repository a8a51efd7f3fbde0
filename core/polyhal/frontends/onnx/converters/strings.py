"""String ops: StringConcat, StringSplit, StringNormalizer, RegexFullMatch, LabelEncoder with
string keys or values, OneHotEncoder over string categories, and the string forms of Cast,
CastLike, Equal, Identity and the ops that move data (Reshape, Flatten, Squeeze, Unsqueeze,
Transpose, Concat, Gather): what scikit-learn pipelines over string columns need.

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

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import Decline, converter
from polyhal.frontends.onnx.converters.tensor import _axes
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.proto import elem_type_of
from polyhal.frontends.onnx.types import STRING, STRING_DTYPE, HostValue, is_strings, np_dtype
from polyhal.ops import OPS

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
    to = STRING if is_strings(like) else elem_type_of(ctx.dtype(like))
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


# ------------------------------------------------------ moving strings: the shape ops' string forms

def _host_form(ctx: NodeContext, fn, *args: Any) -> list:
    """``fn`` (numpy) of ``args`` on the host, giving strings; its result shape is what ``fn``
    gives on placeholders of the operands' shapes (None when one depends on the data)."""
    def placeholder(a: Any) -> Any:
        if _holds_strings(a):
            return None if a.shape is None else np.empty(a.shape, object)
        return a if isinstance(a, np.ndarray) else np.zeros(ctx.shape(a), np.int64)

    probes = [placeholder(a) for a in args]
    shape = None if any(p is None for p in probes) else np.shape(fn(*probes))
    return [ctx.host(lambda *a: _strings(fn(*a)), *args, dtype=STRING_DTYPE, shape=shape)]


def _holds_strings(a: Any) -> bool:
    """Whether ``a`` is a string tensor: an array of them, or one the host makes."""
    return is_strings(a) or isinstance(a, HostValue) and a.dtype == STRING_DTYPE


def _strings_or_decline(ctx: NodeContext, i: int) -> Any:
    x = ctx.host_input(i)
    if not _holds_strings(x):
        raise Decline("numbers")
    return x


@converter("Reshape", strings=True)
def _reshape_strings(ctx: NodeContext) -> list:
    x = _strings_or_decline(ctx, 0)
    target = [int(d) for d in np.asarray(ctx.const(1, "the new shape")).reshape(-1)]
    allowzero = int(ctx.attr("allowzero", 0))

    def fn(a):
        dims = [a.shape[i] if d == 0 and not allowzero and i < a.ndim else d for i, d in enumerate(target)]
        return a.reshape(dims)
    return _host_form(ctx, fn, x)


@converter("Flatten", strings=True)
def _flatten_strings(ctx: NodeContext) -> list:
    x = _strings_or_decline(ctx, 0)
    axis = int(ctx.attr("axis", 1))
    return _host_form(ctx, lambda a: a.reshape(int(np.prod(a.shape[:axis + a.ndim if axis < 0 else axis])),
                                               int(np.prod(a.shape[axis + a.ndim if axis < 0 else axis:]))), x)


@converter("Squeeze", "Unsqueeze", strings=True)
def _squeeze_strings(ctx: NodeContext) -> list:
    x = _strings_or_decline(ctx, 0)
    axes = _axes(ctx, 13)
    if ctx.op_type == "Squeeze":
        return _host_form(ctx, lambda a: np.squeeze(a, axis=None if axes is None else tuple(axes)), x)
    if axes is None:
        raise OnnxModelError("Unsqueeze needs axes")
    return _host_form(ctx, lambda a: np.expand_dims(a, tuple(axes)), x)


@converter("Transpose", strings=True)
def _transpose_strings(ctx: NodeContext) -> list:
    x = _strings_or_decline(ctx, 0)
    perm = ctx.attr("perm", None)
    return _host_form(ctx, lambda a: np.transpose(a, None if perm is None else [int(p) for p in perm]), x)


@converter("Concat", strings=True)
def _concat_strings(ctx: NodeContext) -> list:
    xs = [ctx.host_input(i) for i in range(ctx.num_inputs) if ctx.has(i)]
    if not any(map(_holds_strings, xs)):
        raise Decline("numbers")
    axis = int(ctx.attr("axis"))
    return _host_form(ctx, lambda *a: np.concatenate(a, axis=axis), *xs)


@converter("Gather", strings=True)
def _gather_strings(ctx: NodeContext) -> list:
    x = _strings_or_decline(ctx, 0)
    axis = int(ctx.attr("axis", 0))
    return _host_form(ctx, lambda a, i: np.take(a, np.asarray(i, np.int64), axis=axis), x, ctx.host_input(1))


# ------------------------------------------------------------------------------ OneHotEncoder

@converter("OneHotEncoder", domain=ML, strings=True)
def _one_hot_encoder_strings(ctx: NodeContext) -> list:
    if not ctx.has_attr("cats_strings"):
        raise Decline("integer categories")
    x = ctx.host_input(0)
    if not _holds_strings(x):
        raise OnnxModelError("OneHotEncoder with cats_strings takes string input")
    cats = list(ctx.attr("cats_strings"))
    # The strings become category numbers on the host (-1: not a category, an all-zero row, as
    # for integer categories), and the device makes the one-hot rows from numbers. One sorted
    # search for the whole array (the first of repeated categories, as a table would keep it).
    order = np.argsort(np.array(cats, dtype=np.str_), kind="stable")
    keys = np.array(cats, dtype=np.str_)[order]

    def numbers(a: np.ndarray) -> np.ndarray:
        a = a.astype(np.str_)
        at = np.searchsorted(keys, a).clip(0, max(len(keys) - 1, 0))
        return np.where(keys[at] == a, order[at], -1).astype(np.int64) if len(keys) else np.full(a.shape, -1)

    ids = ctx.host(numbers, x, dtype=np.int64, shape=x.shape, what=f"the category numbers of {ctx.label}")
    if isinstance(ids, HostValue):
        ids = ctx.importer.host_feed(ids)
    hot = ctx.op("equal", ctx.op("reshape", ids, shape=[*ctx.shape(ids), 1]), np.arange(len(cats), dtype=np.int64))
    return [ctx.op("cast", hot, dtype=np.dtype(np.float32))]


# ------------------------------------------------------------------- com.microsoft Tokenizer

@converter("Tokenizer", domain="com.microsoft")
def _tokenizer(ctx: NodeContext) -> list:
    """onnxruntime's Tokenizer (what skl2onnx writes for a TfidfVectorizer): each string of a
    [C] or [N, C] input becomes its tokens along a new last axis, padded with ``pad_value`` to
    the longest (``mark``: framed by "\\x02" and "\\x03", the padding after the frame). Tokens are the matches of
    ``tokenexp`` of at least ``mincharnum`` characters, or the text between ``separators``
    (earlier ones first; one empty separator: every character a token)."""
    x = _string_input(ctx, 0)
    mark, pad = bool(ctx.attr("mark")), ctx.attr("pad_value")
    mincharnum = int(ctx.attr("mincharnum"))
    tokenexp, separators = ctx.attr("tokenexp", None), list(ctx.attr("separators", []) or [])
    if x.shape is not None and len(x.shape) not in (1, 2):
        raise OnnxModelError(f"Tokenizer takes shape [C] or [N, C], got {list(x.shape)}")
    try:
        if tokenexp:
            regex = re.compile(tokenexp)

            def tokens(text: str) -> list[str]:
                return [m.group(0) for m in regex.finditer(text) if m.group(0) and len(m.group(0)) >= mincharnum]
        elif separators == [""]:
            def tokens(text: str) -> list[str]:
                return list(text)
        elif separators and all(separators):
            regex = re.compile("|".join(map(re.escape, separators)))

            def tokens(text: str) -> list[str]:
                # onnxruntime keeps the text after the last separator whatever its length
                *parts, last = regex.split(text)
                return [p for p in parts if p and len(p) >= mincharnum] + ([last] if last else [])
        else:
            raise OnnxModelError("Tokenizer needs tokenexp, or separators with no empty one (or just one empty "
                                 "separator for characters)")
    except re.error as exc:
        raise OnnxModelError(f"Tokenizer tokenexp {tokenexp!r} is not a valid regular expression: {exc}") from None

    def tokenize(a: np.ndarray) -> np.ndarray:
        rows = [tokens(t) for t in a.reshape(-1)]
        width = max(map(len, rows), default=0)
        out = np.full((a.size, width + 2 * mark if width else 0), pad, dtype=object)
        for row, toks in zip(out, rows):
            row[mark:mark + len(toks)] = toks
            if width and mark:  # the end mark right after the tokens, then the padding
                row[0], row[len(toks) + 1] = "\x02", "\x03"
        return out.reshape(*a.shape, out.shape[-1])

    return [ctx.host(tokenize, x, dtype=STRING_DTYPE, shape=None)]


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
    attrs = dict(pool=pool, ngram_counts=[int(v) for v in ctx.attr("ngram_counts")],
                 ngram_indexes=[int(v) for v in ctx.attr("ngram_indexes")],
                 weights=[float(v) for v in ctx.attr("weights", [])],
                 min_gram=int(ctx.attr("min_gram_length")), max_gram=int(ctx.attr("max_gram_length")),
                 max_skip=int(ctx.attr("max_skip_count")), mode=ctx.attr("mode"))
    if isinstance(x, HostValue) and x.shape is None:
        # Tokens of a Tokenizer or StringSplit: how many per row only the data says, so no
        # static plan can take them; the counting runs on the host too (the op's numpy form),
        # and its [N, columns] result, of static shape, enters the plan.
        if x.after_plan:
            raise OnnxUnsupportedError(f"{x.what} is computed from the device plan's results and has a shape only "
                                       "the data decides; polyhal runs host work before and after the plan")
        width = max(attrs["ngram_indexes"]) + 1
        rows = _rows_of(ctx, x)
        reference = OPS["tfidf_vectorizer"].reference
        return [ctx.host(lambda a: reference(a, **attrs)[0], x, dtype=np.float32,
                         shape=(width,) if rows is None else (rows, width), what=f"the n-gram counts of {ctx.label}")]
    if isinstance(x, HostValue):
        x = ctx.importer.host_feed(x)
    return [ctx.op("tfidf_vectorizer", x, **attrs)]


def _rows_of(ctx: NodeContext, x: HostValue) -> int | None:
    """How many rows of tokens ``x`` (whose last dim only the data decides) holds: the length of
    the 1-D strings it was split from (None for one 0-d string: tokens [T], counts [columns])."""
    source = x  # down the values it is made from (token ids, tokens) to the strings split
    while isinstance(source, HostValue) and source.shape is None:
        source = next((a for a in source.args if isinstance(a, HostValue) or is_strings(a)), None)
    shape = getattr(source, "shape", None)
    if shape is None or len(shape) > 1:
        raise OnnxUnsupportedError(f"TfIdfVectorizer of {x.what}: it takes tokens [T] or [N, T] of strings [N] "
                                   f"(got tokens of strings of shape {shape if shape is not None else 'unknown'})")
    return shape[0] if shape else None
