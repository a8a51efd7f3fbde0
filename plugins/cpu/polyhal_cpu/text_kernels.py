"""CPU kernels of the text ops (:mod:`polyhal.ops.text`).

``tfidf_vectorizer`` matches n-grams by key, vectorised: the pool's n-grams of each size are
sorted once, when the kernel is built, as fixed-size byte keys; a run gathers every candidate
n-gram of a (size, skip) pair at once (``[N, positions, n]``), looks all of them up with one
``searchsorted`` and counts the hits with one ``bincount``. No Python loop runs per token.
"""

from __future__ import annotations

import numpy as np

from polyhal.ops.text import pool_ngrams, weigh
from polyhal_cpu.table import TABLE, Kernel, Types

__all__: list[str] = []


def _keys(grams: np.ndarray) -> np.ndarray:
    """One fixed-size byte key per row of int64 ``grams`` ``[m, n]`` (equal rows, equal keys)."""
    grams = np.ascontiguousarray(grams, np.int64)
    return grams.view(np.dtype((np.void, 8 * grams.shape[1]))).reshape(-1)


@TABLE.register("tfidf_vectorizer")
def _tfidf_vectorizer(device, op: str, attrs: dict, ins: Types, outs: Types, scratch) -> Kernel:
    tables = []
    for n, (grams, cols) in pool_ngrams(attrs["pool"], attrs["ngram_counts"], attrs["ngram_indexes"],
                                        int(attrs["min_gram"]), int(attrs["max_gram"])).items():
        keys = _keys(grams)
        order = np.argsort(keys, kind="stable")
        # a repeated n-gram counts in the column of its last occurrence (as onnxruntime's pool)
        keys, cols = keys[order], cols[order]
        last = np.append(keys[1:] != keys[:-1], True)
        tables.append((n, keys[last], cols[last]))
    width = outs[0].shape[-1]
    max_skip, mode, weights = int(attrs["max_skip"]), attrs["mode"], attrs["weights"]

    def kernel(x, out):
        rows = np.asarray(x, np.int64).reshape(-1, x.shape[-1] if x.ndim else 1)
        length = rows.shape[1]
        counts = np.zeros(rows.shape[0] * width, np.int64)
        for n, keys, cols in tables:
            for skip in range(max_skip + 1 if n > 1 else 1):  # unigrams count once
                last = length - (n - 1) * (skip + 1)
                if last <= 0 or not len(keys):
                    continue
                span = np.arange(last)[:, None] + np.arange(n) * (skip + 1)  # [positions, n]
                found = _keys(rows[:, span].reshape(-1, n))
                at = np.minimum(np.searchsorted(keys, found), len(keys) - 1)
                hit = keys[at] == found
                row = np.repeat(np.arange(rows.shape[0]), last)
                counts += np.bincount(row[hit] * width + cols[at[hit]], minlength=counts.size)
        np.copyto(out, weigh(counts.reshape(-1, width), weights, mode).reshape(out.shape))
    return kernel
