"""Program builder, compile and plans on the CPU device."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal


def test_builder_checks_shapes_and_dtypes():
    b = polyhal.ProgramBuilder("bad")
    x, y = b.input("x", (3, 4)), b.input("y", (5,))
    with pytest.raises(polyhal.ShapeError, match="broadcast"):
        b.add(x, y)
    z = b.input("z", (3, 4), "int32")
    with pytest.raises(polyhal.DTypeError, match="cast"):
        b.add(x, z)
    with pytest.raises(polyhal.ShapeError):
        b.matmul(x, x)
    with pytest.raises(polyhal.ProgramError, match="unknown op"):
        b.op("frobnicate", x)
    with pytest.raises(polyhal.ProgramError, match="already has a value"):
        b.input("x", (1,))
    with pytest.raises(polyhal.ProgramError, match="no outputs"):
        b.build()


def test_values_of_another_program_are_rejected():
    a, b = polyhal.ProgramBuilder("a"), polyhal.ProgramBuilder("b")
    x = a.input("x", (2,))
    with pytest.raises(polyhal.ProgramError, match="another program"):
        b.neg(x)
    with pytest.raises(polyhal.ProgramError, match="not a value"):
        b.neg(np.ones(2))


def test_program_prints_as_ir():
    b = polyhal.ProgramBuilder("p")
    x = b.input("x", (2, 3))
    b.output(b.transpose(x, perm=(1, 0)))
    text = str(b.build())
    assert "program @p" in text and "dispatch.transpose" in text and "tensor<3x2xfloat32>" in text


def test_multi_output_and_out_argument():
    rng = np.random.default_rng()
    b = polyhal.ProgramBuilder("topk")
    x = b.input("x", (4, 10))
    vals, idx = b.topk(x, k=3)
    b.output(vals, idx)
    plan = polyhal.compile(b.build(), "cpu:0")
    xs = rng.standard_normal((4, 10)).astype(np.float32)
    v, i = plan(xs)
    np.testing.assert_array_equal(np.take_along_axis(xs, i.numpy(), -1), v.numpy())
    out_v, out_i = polyhal.empty((4, 3), "float32", "cpu:0"), polyhal.empty((4, 3), "int64", "cpu:0")
    res = plan(xs, out=(out_v, out_i))
    assert res[0] is out_v and np.array_equal(out_i.numpy(), i.numpy())
    with pytest.raises(polyhal.ShapeError, match="out="):
        plan(xs, out=(polyhal.empty((4, 4), "float32", "cpu:0"), out_i))


def test_plan_reuses_intermediates_and_balances_accounting():
    dev = polyhal.get_device("cpu:0")
    before = dev.allocator.statistics.live_bytes
    b = polyhal.ProgramBuilder("mlp")
    x, w = b.input("x", (8, 32)), b.input("w", (32, 32))
    b.output(b.softmax(b.relu(b.matmul(x, w))))
    plan = polyhal.compile(b.build(), "cpu:0")
    assert len(plan.intermediates) == 2
    rng = np.random.default_rng()
    xs, ws = rng.standard_normal((8, 32), np.float32), rng.standard_normal((32, 32), np.float32)
    r1 = plan(xs, ws).numpy().copy()
    r2 = plan(x=xs, w=ws).numpy()
    np.testing.assert_array_equal(r1, r2)
    e = np.exp(np.maximum(xs @ ws, 0) - np.maximum(xs @ ws, 0).max(-1, keepdims=True))
    np.testing.assert_allclose(r1, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    del plan, r2
    assert dev.allocator.statistics.live_bytes == before


def test_run_numpy_returns_fresh_arrays_and_checks_inputs():
    import gc
    import weakref

    b = polyhal.ProgramBuilder("two")
    x, w = b.input("x", (4, 8)), b.input("w", (8, 3))
    y = b.matmul(x, w)
    b.output(b.relu(y), y)
    plan = polyhal.compile(b.build(), "cpu:0")
    rng = np.random.default_rng(3)
    xs, ws = rng.standard_normal((4, 8), np.float32), rng.standard_normal((8, 3), np.float32)
    r, p = plan.run_numpy(xs, ws)
    assert type(r) is np.ndarray and r.flags.c_contiguous and r.flags.writeable
    np.testing.assert_allclose(p, xs @ ws, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(r, np.maximum(p, 0))
    r2, _ = plan.run_numpy(w=ws, x=xs)  # by name, as calling the plan
    assert r2 is not r and not np.shares_memory(r, r2)  # fresh arrays: the caller owns each run's
    np.testing.assert_array_equal(r2, r)
    (t, _) = plan(xs, ws)
    np.testing.assert_array_equal(t.numpy(), r)
    # The same input errors as calling the plan, and the caller's inputs are not kept alive.
    with pytest.raises(polyhal.ProgramError, match="missing inputs"):
        plan.run_numpy(xs)
    with pytest.raises(polyhal.ProgramError, match="no input 'z'"):
        plan.run_numpy(xs, ws, z=xs)
    with pytest.raises(polyhal.DTypeError):
        plan.run_numpy(xs.astype(np.float64), ws)
    held = rng.standard_normal((4, 8), np.float32)
    ref = weakref.ref(held)
    plan.run_numpy(held, ws)
    del held
    gc.collect()
    assert ref() is None


def test_run_numpy_copies_outputs_that_are_not_in_host_memory():
    b = polyhal.ProgramBuilder("neg")
    x = b.input("x", (6,))
    b.output(b.neg(x))
    plan = polyhal.compile(b.build(), "cpu:0")
    plan._host_outputs = None  # as for outputs on a device: through tensors, then to the host
    xs = np.arange(6, dtype=np.float32)
    (y,) = plan.run_numpy(xs)
    assert type(y) is np.ndarray
    np.testing.assert_array_equal(y, -xs)


def test_inputs_on_device_are_not_copied():
    b = polyhal.ProgramBuilder("id")
    x = b.input("x", (16,))
    b.output(b.relu(x))
    plan = polyhal.compile(b.build(), "cpu:0")
    t = polyhal.asarray(np.arange(-8, 8, dtype=np.float32), device="cpu:0")
    assert np.array_equal(plan(t).numpy(), np.maximum(np.arange(-8, 8), 0))


def test_eager_ops_cache_plans():
    from polyhal import eager

    a = polyhal.asarray(np.arange(6, dtype=np.float32).reshape(2, 3), device="cpu:0")
    r = eager.add(a, a)
    assert np.array_equal(r.numpy(), 2 * np.arange(6).reshape(2, 3))
    n = len(eager._cache)
    eager.add(a, a)
    assert len(eager._cache) == n
    assert np.array_equal(polyhal.run_op("reduce_sum", a, axes=(1,)).numpy(), [3, 12])


def test_running_a_plan_calls_no_hook():
    reg = polyhal.default_registry()
    b = polyhal.ProgramBuilder("nohooks")
    x = b.input("x", (32,))
    b.output(b.exp(b.neg(x)))
    plan = polyhal.compile(b.build(), "cpu:0")
    from polyhal.policy import selector_for

    sel = selector_for(reg)
    lookups = (sel.hits, sel.misses)
    calls = []
    undo = reg.pm.add_hookcall_monitoring(lambda name, impls, kw: calls.append(name), lambda *a: None)
    try:
        for _ in range(10):
            plan(np.ones(32, np.float32))
    finally:
        undo()
    assert calls == [] and (sel.hits, sel.misses) == lookups  # no hook, not even a memo lookup


def test_outputs_that_alias_inputs_or_each_other_are_copies():
    b = polyhal.ProgramBuilder("alias")
    x = b.input("x", (5,))
    r = b.relu(x)
    b.output(r, x, r)
    plan = polyhal.compile(b.build(), "cpu:0")
    xs = np.random.default_rng().standard_normal(5).astype(np.float32)
    r1, x1, r2 = plan(xs)
    assert np.array_equal(x1.numpy(), xs)
    assert np.array_equal(r1.numpy(), np.maximum(xs, 0)) and np.array_equal(r2.numpy(), r1.numpy())
    assert r1.buffer is not r2.buffer
