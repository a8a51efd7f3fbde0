"""Views on CUDA: transposes, slices and gathers of one index that feed kernels taking strided
operands (cupy's elementwise kernels, cuBLAS through its op flags and strides, attention) run no
copy; the others keep it (GPU)."""

from __future__ import annotations

import numpy as np

import polyhal
from polyhal.ir.types import TensorType
from polyhal.ops import OPS


def _heads(seq=7, batch=2, heads=3, d=4):
    """A ViT-style block: qkv projection, heads picked by transpose + gather, attention, heads
    put back by transpose + reshape, the output projection."""
    e = heads * d
    rng = np.random.default_rng(0)
    w, bias = rng.standard_normal((e, 3 * e)).astype(np.float32) / 4, rng.standard_normal(3 * e).astype(np.float32)
    w2 = rng.standard_normal((e, e)).astype(np.float32) / 4
    b = polyhal.ProgramBuilder("heads")
    x = b.input("x", (seq, batch, e))
    qkv = b.reshape(b.linear(x, b.constant(w), b.constant(bias)), shape=[seq, batch, 3, heads, d])
    t = b.transpose(qkv, perm=[2, 1, 3, 0, 4])  # (3, batch, heads, seq, d)
    q, k, v = (b.gather(t, b.constant(np.array(i, np.int64)), axis=0) for i in range(3))
    o = b.attention(b.mul(q, b.constant(np.float32(0.5))), k, v, scale=1.0)
    back = b.reshape(b.transpose(o, perm=[2, 0, 1, 3]), shape=[seq * batch, e])
    b.output(b.gemm(back, b.constant(w2), trans_b=True))

    def expected(xs):
        p = (xs.astype(np.float64) @ w + bias).reshape(seq, batch, 3, heads, d).transpose(2, 1, 3, 0, 4)
        att = OPS["attention"].reference(p[0] * 0.5, p[1], p[2], scale=1.0)[0]
        return att.transpose(2, 0, 1, 3).reshape(seq * batch, e) @ w2.T
    return b.build(), expected, (seq, batch, e)


def test_heads_of_a_projection_are_views_read_by_mul_and_attention(cuda, rng):
    program, expected, shape = _heads()
    plan = polyhal.compile(program, cuda.name)
    views = {w.value.name: w for w in plan.buffer_plan.views}
    # the transpose and the three gathers run no kernel; the transpose back is read by a reshape
    # that needs a copy (its dims do not merge), which reads the strided view.
    assert {"transpose", "gather", "gather1", "gather2", "transpose1"} <= set(views)
    assert views["gather2"].offset == 2 * 12 and views["gather"].strides is not None
    xs = rng.standard_normal(shape).astype(np.float32)
    for _ in range(3):  # eager, then the captured graph replayed
        np.testing.assert_allclose(plan(xs).numpy(), expected(xs), rtol=1e-4, atol=1e-4,
                                   err_msg=f"seed {rng.seed_value}")


def test_cublas_takes_transposed_and_sliced_operands(cuda, rng):
    b = polyhal.ProgramBuilder("gemms")
    x, y = b.input("x", (4, 6, 5)), b.input("y", (9, 8))
    ex = b.exp(x)
    yt = b.transpose(ex, perm=[0, 2, 1])  # (4, 5, 6): columns contiguous
    mm = b.matmul(ex, yt)  # (4, 6, 6)
    cols = b.slice(b.neg(y), starts=[2], ends=[7], axes=[1])  # (9, 5): rows at stride 8
    g = b.gemm(b.transpose(cols), cols)  # (5, 5): a's columns contiguous
    g2 = b.gemm(cols, cols, trans_a=True)  # the same product through the op's own flag
    lin = b.linear(cols, b.constant(np.ones((5, 3), np.float32)), b.constant(np.arange(3, dtype=np.float32)))
    b.output(mm, g, g2, lin)
    plan = polyhal.compile(b.build(), cuda.name)
    views = {w.value.name: w.strides for w in plan.buffer_plan.views}
    assert views.keys() == {"transpose", "slice", "transpose1"}, plan.explain()
    xs, ys = rng.standard_normal((4, 6, 5)).astype(np.float32), rng.standard_normal((9, 8)).astype(np.float32)
    e = np.exp(xs.astype(np.float64))
    c = -ys[:, 2:7].astype(np.float64)
    for _ in range(3):
        got = plan(xs, ys)
        np.testing.assert_allclose(got[0].numpy(), e @ e.transpose(0, 2, 1), rtol=1e-5)
        np.testing.assert_allclose(got[1].numpy(), c.T @ c, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[2].numpy(), c.T @ c, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[3].numpy(), c @ np.ones((5, 3)) + np.arange(3), rtol=1e-5, atol=1e-5)


def test_row_wise_kernels_get_dense_operands(cuda, rng):
    b = polyhal.ProgramBuilder("rows")
    x = b.input("x", (3, 8, 5))
    t = b.transpose(b.exp(x), perm=[0, 2, 1])  # NCHW -> NHWC style: the rows are strided
    b.output(b.softmax(t, axis=-1), b.neg(t))
    plan = polyhal.compile(b.build(), cuda.name)
    assert not plan.buffer_plan.views  # softmax reads rows by pointer: the transpose copies
    xs = rng.standard_normal((3, 8, 5)).astype(np.float32)
    e = np.exp(xs.astype(np.float64)).transpose(0, 2, 1)
    got = plan(xs)
    np.testing.assert_allclose(got[0].numpy(), np.exp(e) / np.exp(e).sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(got[1].numpy(), -e, rtol=1e-6)


def test_accepts_view_answers_per_op_and_operand(cuda):
    f = TensorType((2, 6, 5), np.float32)
    assert cuda.accepts_view("add", {}, (f, f), (f,), 0, (30, 1, 6), 3)
    assert not cuda.accepts_view("softmax", {"axis": -1}, (f,), (f,), 0, (30, 1, 6), 0)
    m = TensorType((2, 5, 6), np.float32)
    assert cuda.accepts_view("matmul", {}, (m, m), (TensorType((2, 5, 5), np.float32),), 1, (30, 1, 5), 0)
    # batch dims that do not sit at one stride, or neither rows nor columns contiguous: no
    b4 = TensorType((2, 3, 5, 6), np.float32)
    assert not cuda.accepts_view("matmul", {}, (b4, b4), (b4,), 0, (6, 60, 12, 1), 0)
    assert not cuda.accepts_view("matmul", {}, (m, m), (m,), 0, (30, 12, 2), 0)
