"""Text ops over token ids: ``tfidf_vectorizer`` (what ONNX's TfIdfVectorizer computes on
integer tokens; string tokens are mapped to ids on the host first, as polyhal keeps strings there).

**Semantics.** ``x`` is int32/int64 ``[C]`` or ``[N, C]`` (one row of tokens per sample). The
pool lists n-grams of token ids grouped by size, as ONNX lays it out: ``ngram_counts[i]`` is
where the n-grams of size ``i + 1`` start in ``pool``; the k-th n-gram of the pool (counting
across groups) lands in output column ``ngram_indexes[k]``. A row counts, for every skip
``s`` in ``0..max_skip``, every start position and every size ``n`` in
``min_gram..max_gram``, the n-gram ``x[p], x[p + s + 1], ..., x[p + (n - 1)(s + 1)]`` when the
pool holds it; unigrams count once, not once per skip. ``mode``: ``TF`` gives the counts,
``IDF`` ``weights[col]`` where a count is nonzero (1 without weights), ``TFIDF``
``weights[col] * count`` (the count without weights). The result is float32 ``[width]`` or
``[N, width]``, ``width = max(ngram_indexes) + 1``.
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import DTypeError, ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops._base import define, int_attr, int_list_attr

__all__ = ["TFIDF_MODES", "count_ngrams", "pool_ngrams"]

#: The weighting modes of ``tfidf_vectorizer``.
TFIDF_MODES = ("TF", "IDF", "TFIDF")


def pool_ngrams(pool, ngram_counts, ngram_indexes, min_gram: int, max_gram: int) -> dict[int, tuple]:
    """Size n -> (n-grams ``[P, n]`` int64, their output columns ``[P]``) for the pool's sizes
    within ``min_gram..max_gram``; ProgramError for a pool that does not split into its groups."""
    pool = np.asarray(pool, np.int64)
    starts = list(ngram_counts) + [len(pool)]
    out, k = {}, 0
    for i in range(len(ngram_counts)):
        n, items = i + 1, starts[i + 1] - starts[i]
        if items < 0 or items % n:
            raise ProgramError(f"pool group of {n}-grams spans {items} ids (ngram_counts {list(ngram_counts)}), "
                               f"not a multiple of {n}")
        count = items // n
        if count and min_gram <= n <= max_gram:
            cols = np.asarray(ngram_indexes[k: k + count], np.int64)
            if len(cols) != count:
                raise ProgramError(f"ngram_indexes has {len(ngram_indexes)} entries, fewer than the pool's n-grams")
            out[n] = (pool[starts[i]: starts[i + 1]].reshape(count, n), cols)
        k += count
    return out


def _check(x: TensorType, attrs: dict) -> int:
    if x.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise DTypeError(f"x has element type {x.dtype}, expected int32 or int64 token ids")
    if x.rank > 2:
        raise ShapeError(f"x must be [C] or [N, C], got shape {x.shape}")
    lo, hi, skip = (int_attr(attrs[k], k) for k in ("min_gram", "max_gram", "max_skip"))
    if not 1 <= lo <= hi or skip < 0:
        raise ProgramError(f"need 1 <= min_gram <= max_gram and max_skip >= 0, got {lo}, {hi}, {skip}")
    if attrs["mode"] not in TFIDF_MODES:
        raise ProgramError(f"mode must be one of {', '.join(TFIDF_MODES)}, got {attrs['mode']!r}")
    indexes = int_list_attr(attrs["ngram_indexes"], "ngram_indexes")
    if not indexes or min(indexes) < 0:
        raise ProgramError("ngram_indexes must be non-empty and >= 0")
    width = max(indexes) + 1
    weights = attrs["weights"]
    if weights and len(weights) < width:
        raise ProgramError(f"weights has {len(weights)} entries, fewer than the {width} output columns")
    return width


def _infer(x: TensorType, *, pool, ngram_counts, ngram_indexes, weights, min_gram, max_gram, max_skip, mode):
    width = _check(x, dict(ngram_indexes=ngram_indexes, weights=weights, min_gram=min_gram, max_gram=max_gram,
                           max_skip=max_skip, mode=mode))
    return (TensorType((width,) if x.rank < 2 else (x.shape[0], width), np.float32),)


def weigh(counts: np.ndarray, weights, mode: str) -> np.ndarray:
    """The float32 output from the n-gram ``counts`` ``[N, width]`` (see the module's semantics)."""
    w = np.asarray(weights, np.float32)[: counts.shape[-1]] if len(weights) else None
    if mode == "TF":
        return counts.astype(np.float32)
    if mode == "IDF":
        return np.where(counts > 0, w if w is not None else np.float32(1), np.float32(0)).astype(np.float32)
    return (counts * w if w is not None else counts).astype(np.float32)


def _reference(x, *, pool, ngram_counts, ngram_indexes, weights, min_gram, max_gram, max_skip, mode):
    x = np.asarray(x)
    rows = x.reshape(1, -1) if x.ndim < 2 else x
    counts = count_ngrams(rows.astype(np.int64), pool_ngrams(pool, ngram_counts, ngram_indexes, min_gram, max_gram),
                          max_skip, max(ngram_indexes) + 1)
    out = weigh(counts, weights, mode)
    return (out.reshape(-1) if x.ndim < 2 else out,)


def count_ngrams(rows: np.ndarray, grams: dict[int, tuple], max_skip: int, width: int) -> np.ndarray:
    """The n-gram counts ``[N, width]`` (int64) of token-id ``rows`` ``[N, C]`` for the pool's
    ``grams`` (:func:`pool_ngrams`), vectorised over rows and positions: every window of each
    size and skip is encoded as one integer (mixed radix over the ids present) and looked up in
    the pool's sorted codes."""
    n_rows, length = rows.shape
    counts = np.zeros((n_rows, width), np.int64)
    if not grams or not length:
        return counts
    # Codes over the ids that occur in the pool; any other id (and a padding id) is 0, which no
    # pool n-gram holds, so windows containing one match nothing.
    ids = np.unique(np.concatenate([g.reshape(-1) for g, _ in grams.values()]))
    base = len(ids) + 1
    digits = np.searchsorted(ids, rows).clip(0, len(ids) - 1)
    digits = np.where(ids[digits] == rows, digits + 1, 0)
    for n, (table, cols) in grams.items():
        if base ** n >= 2 ** 62:
            raise ProgramError(f"{n}-grams over {base - 1} distinct ids do not fit a 64-bit code")
        pool_codes = np.zeros(len(table), np.int64)
        for k in range(n):
            pool_codes = pool_codes * base + np.searchsorted(ids, table[:, k]) + 1
        order = np.argsort(pool_codes, kind="stable")
        sorted_codes, sorted_cols = pool_codes[order], cols[order]
        for skip in range(max_skip + 1 if n > 1 else 1):  # unigrams count once
            span = (n - 1) * (skip + 1)
            if span >= length:
                continue
            starts = length - span
            codes = np.zeros((n_rows, starts), np.int64)
            for k in range(n):
                codes = codes * base + digits[:, k * (skip + 1): k * (skip + 1) + starts]
            # the last of equal pool n-grams, as a table built from the pool in order keeps it
            at = (np.searchsorted(sorted_codes, codes, side="right") - 1).clip(0, None)
            hit = sorted_codes[at] == codes
            row_index = np.broadcast_to(np.arange(n_rows)[:, None], codes.shape)
            np.add.at(counts, (row_index[hit], sorted_cols[at[hit]]), 1)
    return counts


def _sample(rng: np.random.Generator):
    x = rng.integers(0, 5, size=(3, 9)).astype(np.int32)
    # 3 unigrams, 2 bigrams, 2 trigrams over ids 0..4, so that random rows hit them
    attrs = {"pool": [2, 3, 1, 0, 1, 3, 4, 2, 0, 4, 1, 2, 3], "ngram_counts": [0, 3, 7],
             "ngram_indexes": [5, 0, 1, 2, 3, 4, 6], "weights": [1.5, 2.0, 0.5, 1.0, 3.0, 0.25, 2.5],
             "min_gram": 1, "max_gram": 3, "max_skip": 2, "mode": "TFIDF"}
    return [x], attrs


define("tfidf_vectorizer", infer=_infer, reference=_reference, sample=_sample, arity=1,
       doc="""Weighted n-gram counts of token ids (ONNX TfIdfVectorizer on integers; see polyhal.ops.text).""")
