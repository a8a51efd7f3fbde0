"""Strided views copied into dense results a row at a time (GPU, but for the row planning)."""

from __future__ import annotations

import numpy as np
import pytest

from polyhal_cuda.copies import rows_of


def test_rows_merge_outer_dims_and_contiguous_rows():
    f = 4
    # (B, S, E) -> (S, B, E): rows of E at two outer strides
    assert rows_of((197, 16, 768), (768 * f, 197 * 768 * f, f), f) == (
        768 * f, (1, 1, 197, 16), (0, 0, 768 * f, 197 * 768 * f))
    # a dense array is one row
    assert rows_of((4, 5, 6), (120, 24, 4), f) == (480, (1, 1, 1, 1), (0, 0, 0, 0))
    assert rows_of((4, 5), (4, 16), f) is None  # the last axis moved: cupy's copy
    assert rows_of((2,) * 6, (128, 64, 32, 16, 8, 4), f) == (256, (1, 1, 1, 1), (0, 0, 0, 0))
    assert rows_of((2,) * 6, (1 << 20, 1 << 17, 1 << 14, 1 << 11, 1 << 8, 4), f) is None  # five outer dims


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8])
def test_views_copy_as_cupy_copies_them(cuda, cp, rng, dtype):
    from polyhal_cuda import copies

    copy = copies.prepare(cuda)
    base = cp.asarray((rng.standard_normal((6, 9, 10, 12)) * 50).astype(dtype))
    views = [base.transpose(1, 0, 2, 3), base.transpose(2, 0, 1, 3)[:, 1:5, :, 3:11], base[:, :, 1:7, 1:],
             base.transpose(0, 2, 1, 3)[::2], base[1, 2], base.transpose(3, 1, 2, 0), base[:, 3, 4]]
    for x in views:
        out = cp.full(x.shape, 7, dtype)
        copy(x, out)
        np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(x), err_msg=f"strides {x.strides}")
