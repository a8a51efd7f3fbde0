"""Views in the bufferize pass: reshapes, transposes, slices and gathers of one constant index of
intermediates share their operand's buffer and run no kernel, where every consumer accepts the
view (``Device.accepts_view``; row-major views from offset 0 everywhere)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal_cpu.device import CPUDevice


def _heads_program(seq=8, heads=2, dh=4):
    """x -> exp -> reshape to heads -> transpose -> matmul with its own transpose -> reshape."""
    b = polyhal.ProgramBuilder("heads")
    x = b.input("x", (seq, heads * dh))
    e = b.exp(x)
    h = b.reshape(e, shape=[seq, heads, dh])
    t = b.transpose(h, perm=[1, 0, 2])  # (heads, seq, dh): a strided view of e
    kt = b.transpose(h, perm=[1, 2, 0])  # (heads, dh, seq)
    s = b.matmul(t, kt)  # (heads, seq, seq)
    back = b.transpose(b.matmul(s, t), perm=[1, 0, 2])  # (seq, heads, dh), strided
    b.output(b.reshape(back, shape=[seq, heads * dh]))  # a program output: always a copy
    return b.build()


def _expected(x, heads=2, dh=4):
    h = np.exp(x.astype(np.float64)).reshape(len(x), heads, dh)
    t = h.transpose(1, 0, 2)
    s = t @ h.transpose(1, 2, 0)
    return (s @ t).transpose(1, 0, 2).reshape(len(x), heads * dh)


def test_reshapes_and_transposes_of_intermediates_are_views_on_the_cpu():
    plan = polyhal.compile(_heads_program(), "cpu:0")
    bp = plan.buffer_plan
    ops = {w.value.name: w for w in bp.views}
    assert set(ops) == {"reshape", "transpose", "transpose1", "transpose2"}
    assert ops["reshape"].strides is None and ops["transpose"].strides == (4, 8, 1)
    assert all(w.source.name == "exp" for n, w in ops.items() if n != "transpose2")
    # No kernel runs for them: exp, two matmuls and the final reshape (a program output).
    assert plan.dispatch_count == 4 and len(plan._steps) == 4
    # The views alias exp's buffer, whose lifetime now covers the views' uses.
    exp = next(b for b in bp.buffers if b.name == "%exp")
    assert exp.last >= max(w.op_index for w in bp.views if w.source.name == "exp")
    x = np.random.default_rng(0).uniform(-1, 1, (8, 8)).astype(np.float32)
    np.testing.assert_allclose(plan(x).numpy(), _expected(x), rtol=1e-5)
    assert "view %transpose of %exp's buffer" in plan.explain()


def test_buffers_sharing_memory_are_never_live_together_with_views():
    plan = polyhal.compile(_heads_program(), "cpu:0")
    by = {b.name: b for b in plan.buffer_plan.buffers}
    for a in by.values():
        for o in by.values():
            if a is not o and a.overlaps(o):
                lo, hi = sorted((a, o), key=lambda q: q.offset)
                assert lo.offset + lo.nbytes <= hi.offset


def test_transposes_stay_copies_without_strided_views(monkeypatch):
    monkeypatch.setattr(CPUDevice, "strided_views", False)
    plan = polyhal.compile(_heads_program(), "cpu:0")
    views = {w.value.name for w in plan.buffer_plan.views}
    assert views == {"reshape"}  # the row-major reshape only
    x = np.random.default_rng(1).uniform(-1, 1, (8, 8)).astype(np.float32)
    np.testing.assert_allclose(plan(x).numpy(), _expected(x), rtol=1e-5)


def test_inputs_outputs_and_reshapes_of_strided_views_are_copied():
    b = polyhal.ProgramBuilder("edges")
    x = b.input("x", (4, 6))
    r = b.reshape(x, shape=[6, 4])  # of a program input: copied
    t = b.transpose(b.neg(r))  # a view
    tr = b.reshape(t, shape=[24])  # of a strided view: copied
    out = b.reshape(b.exp(tr), shape=[4, 6])  # a program output: copied
    b.output(out, b.relu(tr))
    plan = polyhal.compile(b.build(), "cpu:0")
    assert {w.value.name for w in plan.buffer_plan.views} == {"transpose"}
    xs = np.arange(24, dtype=np.float32).reshape(4, 6) / 10
    got_out, got_relu = plan(xs)
    flat = (-xs.reshape(6, 4)).T.reshape(24)
    np.testing.assert_allclose(got_out.numpy(), np.exp(flat).reshape(4, 6), rtol=1e-6)
    np.testing.assert_allclose(got_relu.numpy(), np.maximum(flat, 0))
    assert got_out.is_contiguous and got_relu.is_contiguous


def test_a_transpose_that_moves_only_unit_dims_is_a_row_major_view(monkeypatch):
    monkeypatch.setattr(CPUDevice, "strided_views", False)
    b = polyhal.ProgramBuilder("unit")
    x = b.input("x", (3, 1, 5))
    t = b.transpose(b.neg(x), perm=[1, 0, 2])  # (1, 3, 5): the same bytes in the same order
    b.output(b.exp(b.reshape(t, shape=[15])))
    plan = polyhal.compile(b.build(), "cpu:0")
    views = {w.value.name: w.strides for w in plan.buffer_plan.views}
    assert views == {"transpose": None, "reshape": None}
    xs = np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 1, 5)
    np.testing.assert_allclose(plan(xs).numpy(), np.exp(-xs.reshape(15)), rtol=1e-6)


def test_views_on_a_device_without_host_memory():
    names = [s.name for s in polyhal.devices() if s.backend == "opencl"]
    if not names:
        pytest.skip("no OpenCL device")
    plan = polyhal.compile(_heads_program(), names[0])
    views = {w.value.name for w in plan.buffer_plan.views}
    assert views == {"reshape"}  # OpenCL kernels take row-major operands: transposes copy
    x = np.random.default_rng(2).uniform(-1, 1, (8, 8)).astype(np.float32)
    np.testing.assert_allclose(plan(x).numpy(), _expected(x), rtol=1e-4)


def test_views_on_one_device_feed_transfers_to_another():
    names = [s.name for s in polyhal.devices() if s.backend == "opencl"]
    if not names:
        pytest.skip("no OpenCL device")
    from polyhal.ops import OPS

    b = polyhal.ProgramBuilder("het")
    x, y = b.input("x", (2, 8, 12)), b.input("y", (2, 8, 12))
    e = b.exp(b.add(x, y))
    r = b.reshape(e, shape=[2, 8, 12])  # a view of e on the OpenCL device
    k = b.reshape(b.reshape(b.mul(b.neg(x), x), shape=[2, 12, 8]), shape=[2, 8, 12])  # views at another offset
    b.output(b.add(b.attention(r, k, r), x))  # attention has a CPU kernel only: the views are copied over
    plan = polyhal.compile(b.build(), [names[0], "cpu:0"])
    assert len(plan.buffer_plan.views) == 3 and plan.placement.transfers >= 2
    rng = np.random.default_rng(0)
    xs, ys = (rng.uniform(-1, 1, (2, 8, 12)).astype(np.float32) for _ in range(2))
    e_ = np.exp(xs + ys)
    want = OPS["attention"].reference(e_, -xs * xs, e_)[0] + xs
    np.testing.assert_allclose(plan(xs, ys).numpy(), want, rtol=1e-4, atol=1e-5)


def _windows_program(n=2, hw=8, c=4, win=4):
    """Swin's window partition as its export writes it: a pad by zero (the map is a multiple of
    the window), reshape and transpose into windows, an op per window, the way back, then a slice
    that crops nothing."""
    b = polyhal.ProgramBuilder("windows")
    x = b.input("x", (n, hw, hw, c))
    h = b.exp(x)
    p = b.pad(h, pads=[0] * 8, value=0.0)
    k = hw // win
    w = b.reshape(p, shape=[n, k, win, k, win, c])
    w = b.reshape(b.transpose(w, perm=[0, 1, 3, 2, 4, 5]), shape=[n * k * k, win * win, c])
    w = b.reshape(b.tanh(w), shape=[n, k, k, win, win, c])
    back = b.reshape(b.transpose(w, perm=[0, 1, 3, 2, 4, 5]), shape=[n, hw, hw, c])
    crop = b.slice(back, starts=[0, 0], ends=[hw, 2 ** 62], axes=[1, 2])
    b.output(b.add(crop, h))
    return b.build()


@pytest.mark.parametrize("strided", [True, False])
def test_a_pad_by_zero_and_a_slice_that_keeps_everything_are_views(monkeypatch, strided):
    monkeypatch.setattr(CPUDevice, "strided_views", strided)
    plan = polyhal.compile(_windows_program(), "cpu:0")
    bp = plan.buffer_plan
    assert {"pad", "slice"} <= {w.op for w in bp.views}
    assert not {"%pad", "%slice"} & {b.name for b in bp.buffers}  # no bytes of their own
    assert not {"pad", "slice"} & {op.name for op in plan._step_ops}  # and no kernel
    x = np.random.default_rng(3).uniform(-1, 1, (2, 8, 8, 4)).astype(np.float32)
    np.testing.assert_allclose(plan(x).numpy(), np.tanh(np.exp(x)) + np.exp(x), rtol=1e-6)


def test_a_pad_by_zero_adds_nothing_to_the_arena():
    b = polyhal.ProgramBuilder("pad0")
    x = b.input("x", (16, 16))
    e = b.exp(x)
    b.output(b.add(b.pad(e, pads=[0, 0, 0, 0], value=0.0), e))  # a copy would be live beside e
    plan = polyhal.compile(b.build(), "cpu:0")
    assert plan.buffer_plan.peak_bytes == 16 * 16 * 4
    xs = np.linspace(-1, 1, 256, dtype=np.float32).reshape(16, 16)
    np.testing.assert_allclose(plan(xs).numpy(), 2 * np.exp(xs), rtol=1e-6)


def test_a_pad_or_slice_that_moves_elements_is_still_a_copy():
    b = polyhal.ProgramBuilder("moves")
    x = b.input("x", (4, 6))
    e = b.exp(x)
    shifted = b.pad(e, pads=[1, 0, -1, 0], value=0.0)  # the same size, rows moved down by one
    flipped = b.slice(e, starts=[-1], ends=[-2 ** 62], axes=[0], steps=[-1])  # the same size, reversed
    b.output(b.add(shifted, flipped))
    plan = polyhal.compile(b.build(), "cpu:0")
    assert not plan.buffer_plan.views
    xs = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    ex = np.exp(xs)
    want = np.concatenate([np.zeros((1, 6), np.float32), ex[:-1]]) + ex[::-1]
    np.testing.assert_allclose(plan(xs).numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("strided", [True, False])
def test_the_split_of_q_k_and_v_is_three_views_at_offsets(monkeypatch, strided):
    monkeypatch.setattr(CPUDevice, "strided_views", strided)
    b = polyhal.ProgramBuilder("qkv")
    x = b.input("x", (3, 4, 64))
    qkv = b.exp(x)
    q, k, v = (b.gather(qkv, b.constant(np.int64(i)), axis=0) for i in (0, 1, -1))
    b.output(b.add(b.mul(q, k), v))
    plan = polyhal.compile(b.build(), "cpu:0")
    views = {w.value.name: w for w in plan.buffer_plan.views}
    assert sorted((w.offset, w.strides) for w in views.values()) == [(0, None), (256, None), (512, None)]
    assert plan.buffer_plan.peak_bytes == (3 + 1) * 4 * 64 * 4  # exp's result and q * k: no copies of q, k, v
    assert "offset 256" in plan.explain()
    xs = np.random.default_rng(4).uniform(-1, 1, (3, 4, 64)).astype(np.float32)
    e = np.exp(xs)
    np.testing.assert_allclose(plan(xs).numpy(), e[0] * e[1] + e[2], rtol=1e-6)


@pytest.mark.parametrize("strided", [True, False])
def test_slices_are_views_where_their_layout_allows(monkeypatch, strided):
    monkeypatch.setattr(CPUDevice, "strided_views", strided)
    b = polyhal.ProgramBuilder("slices")
    x = b.input("x", (8, 64))
    e = b.exp(x)
    rows = b.slice(e, starts=[2], ends=[4], axes=[0])  # row-major, 512 B in: a view on every device
    odd = b.slice(e, starts=[1], ends=[3], axes=[0])  # 256 B in: aligned as intermediates are
    cols = b.slice(e, starts=[1], ends=[64], axes=[1], steps=[2])  # every other column: strided
    shifted = b.slice(e, starts=[0, 1], ends=[2, 65], axes=[0, 1])  # rows cut short: strided
    back = b.slice(e, starts=[3], ends=[-100], axes=[0], steps=[-1])  # a negative step: a copy
    b.output(b.add(rows, odd), b.neg(cols), b.neg(shifted), b.neg(back))
    plan = polyhal.compile(b.build(), "cpu:0")
    views = {w.value.name: (w.offset, w.strides) for w in plan.buffer_plan.views}
    # Strided blocks are copies even on the CPU (their consumers would copy them again).
    assert views == {"slice": (128, None), "slice1": (64, None)}
    xs = np.random.default_rng(5).uniform(-1, 1, (8, 64)).astype(np.float32)
    ex = np.exp(xs)
    got = [t.numpy() for t in plan(xs)]
    for g, w in zip(got, [ex[2:4] + ex[1:3], -ex[:, 1:64:2], -ex[:2, 1:], -ex[3::-1]]):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def _slices_and_gathers_program():
    """qkv -> reshape (3, heads, seq, dh) -> gather q, k, v of one index -> slices of them."""
    b = polyhal.ProgramBuilder("pick")
    x = b.input("x", (12, 8))
    qkv = b.reshape(b.exp(x), shape=[3, 2, 4, 4])  # row-major view
    q = b.gather(qkv, b.constant(np.array(0, np.int64)), axis=0)  # (2, 4, 4) at offset 0
    k = b.gather(qkv, b.constant(np.array(-2, np.int64)), axis=0)  # index 1, from the end
    v = b.gather(qkv, b.constant(np.array([2], np.int64)), axis=0)  # (1, 2, 4, 4): keeps the axis
    cols = b.slice(q, starts=[1], ends=[4], axes=[2], steps=[2])  # (2, 4, 2): strided
    b.output(b.add(k, q), b.neg(v), b.mul(cols, cols))
    return b.build()


def _pick_expected(x):
    qkv = np.exp(x.astype(np.float64)).reshape(3, 2, 4, 4)
    q, k, v = qkv[0], qkv[1], qkv[2:3]
    cols = q[:, :, 1:4:2]
    return k + q, -v, cols * cols


def test_slices_and_gathers_of_one_index_are_views_at_an_offset():
    plan = polyhal.compile(_slices_and_gathers_program(), "cpu:0")
    views = {w.value.name: w for w in plan.buffer_plan.views}
    # the strided slice is a copy on the CPU (its loops would copy it again per run); the
    # row-major blocks are views at any offset there
    assert set(views) == {"reshape", "gather", "gather1", "gather2"}
    assert (views["gather1"].offset, views["gather1"].strides) == (32, None)
    assert views["gather2"].offset == 64 and "slice" in {op.name for op in plan._step_ops}
    assert "offset 64" in plan.explain()
    x = np.random.default_rng(3).uniform(-1, 1, (12, 8)).astype(np.float32)
    for got, want in zip(plan(x), _pick_expected(x)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_views_are_made_only_where_every_consumer_accepts_them(monkeypatch):
    """A device whose kernels take views for some ops only: neg and mul accept them, add does not."""
    asked = []

    def accepts_view(self, op, attrs, in_types, out_types, index, strides, offset):
        asked.append(op)
        return op in ("neg", "mul")

    monkeypatch.setattr(CPUDevice, "strided_views", False)
    monkeypatch.setattr(CPUDevice, "accepts_view", accepts_view)
    plan = polyhal.compile(_slices_and_gathers_program(), "cpu:0")
    views = {w.value.name for w in plan.buffer_plan.views}
    # q (offset 0, row-major) is plain; k is read by add, which refuses it at offset 32; v and the
    # slice are read by neg and mul only.
    assert views == {"reshape", "gather", "gather2", "slice"}
    assert "add" in asked
    x = np.random.default_rng(4).uniform(-1, 1, (12, 8)).astype(np.float32)
    for got, want in zip(plan(x), _pick_expected(x)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_a_refused_view_makes_views_of_it_views_of_its_copy(monkeypatch):
    """transpose -> reshape (no copy needed) -> exp, where only the reshape kernel takes views."""
    monkeypatch.setattr(CPUDevice, "strided_views", False)
    monkeypatch.setattr(CPUDevice, "accepts_view",
                        lambda self, op, attrs, ins, outs, index, strides, offset: op == "reshape")
    b = polyhal.ProgramBuilder("chain")
    x = b.input("x", (4, 3, 5))
    t = b.transpose(b.neg(x), perm=[1, 0, 2])  # (3, 4, 5), strided
    r = b.reshape(t, shape=[3, 2, 2, 5])  # splits the 4: no copy needed, still strided
    b.output(b.exp(r))
    plan = polyhal.compile(b.build(), "cpu:0")
    # exp refuses the strided reshape; the refused reshape is a kernel that reads the transpose,
    # which the reshape kernel accepts: the transpose stays a view, the reshape copies.
    assert {w.value.name for w in plan.buffer_plan.views} == {"transpose"}
    xs = np.linspace(-1, 1, 60, dtype=np.float32).reshape(4, 3, 5)
    np.testing.assert_allclose(plan(xs).numpy(), np.exp(-xs.transpose(1, 0, 2).reshape(3, 2, 2, 5)), rtol=1e-6)


def test_reshaped_strides_match_numpy():
    from polyhal.dlpack import reshaped_strides

    a = np.arange(120.0).reshape(2, 3, 4, 5)
    cases = [(a.transpose(1, 0, 2, 3), (3, 2, 20)), (a.transpose(1, 0, 2, 3), (6, 20)),
             (a[:, :, ::2], (6, 2, 5)), (a[:, :, ::2], (2, 3, 10)), (a.transpose(0, 1, 3, 2), (6, 5, 4)),
             (a.transpose(0, 1, 3, 2), (6, 20)), (a[:, 1], (1, 2, 1, 20, 1))]
    for view, shape in cases:
        got = reshaped_strides(view.shape, tuple(s // 8 for s in view.strides), shape)
        try:
            v = view.view()
            v.shape = shape  # numpy's no-copy reshape, or AttributeError
            want = tuple(s // 8 for s in v.strides)
        except AttributeError:
            want = None
        if want is None or got is None:
            assert got == want, (view.shape, view.strides, shape)
        else:  # strides of dims of size 1 are free
            assert all(g == w for g, w, d in zip(got, want, shape) if d != 1), (shape, got, want)
