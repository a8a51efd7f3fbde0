"""Symbolic dims in the core IR: type inference over them, binding a call's shapes, and a plan
specialized per binding in a bounded cache (polyhal.compile of a program with symbolic dims)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal import ProgramBuilder, ProgramError, ShapeError, TensorType
from polyhal.ir.types import SymbolicDim, SymbolicDimError
from polyhal.ops import infer_types
from polyhal.plan import PolymorphicPlan

RNG = np.random.default_rng(0)


def _mlp(cache_size=None):
    b = ProgramBuilder("mlp")
    x = b.input("x", ("batch", 32))
    w = RNG.standard_normal((32, 8)).astype(np.float32)
    bias = RNG.standard_normal(8).astype(np.float32)
    h = b.relu(b.add(b.matmul(x, b.constant(w, "w")), b.constant(bias, "bias")))
    b.output(b.softmax(h, axis=-1))
    ref = lambda a: _softmax(np.maximum(a @ w + bias, 0))  # noqa: E731
    return polyhal.compile(b.build(), "cpu:0", cache_size=cache_size), ref


def _softmax(a):
    e = np.exp(a - a.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _x(n, width=32):
    return RNG.standard_normal((n, width)).astype(np.float32)


# -- the IR ------------------------------------------------------------------------------------

def test_a_named_dim_is_one_dim_and_hides_its_size():
    t = TensorType(("batch", 256), "float32")
    assert not t.is_static and str(t) == "tensor<batchx256xfloat32>"
    assert t.shape[0] == SymbolicDim("batch")
    with pytest.raises(SymbolicDimError):
        t.shape[0] == 256  # noqa: B015 -- the comparison is what is tested
    with pytest.raises(SymbolicDimError):
        t.size
    with pytest.raises(SymbolicDimError):
        t.shape[0] == SymbolicDim("seq")  # noqa: B015


def test_inference_keeps_names_through_common_ops():
    b = ProgramBuilder()
    x = b.input("x", ("batch", "seq", 64))
    w = b.input("w", (64, 16))
    one = b.input("one", (1, "seq", 1))
    h = b.matmul(x, w)
    assert h.type.shape == (SymbolicDim("batch"), SymbolicDim("seq"), 16)
    assert b.mul(h, one).type.shape == h.type.shape  # broadcasting with 1
    assert b.add(h, b.input("row", (16,))).type.shape == h.type.shape
    assert b.reduce_sum(h, axes=[1], keepdims=False).type.shape == (SymbolicDim("batch"), 16)
    assert b.softmax(h, axis=1).type.shape == h.type.shape
    assert b.transpose(h, perm=[2, 0, 1]).type.shape == (16, SymbolicDim("batch"), SymbolicDim("seq"))
    flat = b.reshape(b.input("img", ("n", 4, 4)), shape=[-1, 16])
    assert flat.type.shape == (SymbolicDim("n"), 16)


def test_a_dim_the_core_cannot_express_is_derived_and_reinferred():
    b = ProgramBuilder("cat")
    x = b.input("x", ("n", 3))
    y = b.input("y", ("m", 3))
    cat = b.concat(x, y, axis=0)  # n + m
    assert cat.type.rank == 2 and all(isinstance(d, SymbolicDim) and d.derived for d in cat.type.shape)
    assert str(cat.type) == "tensor<?x?xfloat32>"
    b.output(b.reduce_sum(cat, axes=[1], keepdims=False))
    plan = polyhal.compile(b.build(), "cpu:0")
    a, c = _x(2, 3), _x(5, 3)
    got = plan(a, c).numpy()
    np.testing.assert_allclose(got, np.concatenate([a, c]).sum(axis=1), rtol=1e-5)
    assert plan.specialization(a, c).program.outputs[0].type.shape == (7,)


def test_an_op_that_fails_for_every_size_fails_at_build():
    b = ProgramBuilder()
    x = b.input("x", ("batch", 255))
    with pytest.raises(ShapeError, match="inner dimensions"):
        b.matmul(x, b.input("w", (256, 10)))
    with pytest.raises(ShapeError, match="sample sizes batch="):
        b.reshape(x, shape=[4, 255])  # holds for batch=4 only: say the size instead


# -- specialization in the core ---------------------------------------------------------------

def test_compile_gives_a_plan_per_binding():
    plan, ref = _mlp()
    assert isinstance(plan, PolymorphicPlan)
    for n in (1, 5, 5, 64, 1):
        x = _x(n)
        np.testing.assert_allclose(plan(x).numpy(), ref(x), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(plan.run_numpy(x=x)[0], ref(x), rtol=1e-4, atol=1e-6)
    assert plan.cache.misses == 3 and plan.cache.hits == 7
    assert [p.program.inputs[0].type.shape for p in plan.plans] == [(5, 32), (64, 32), (1, 32)]
    assert "a plan per binding of batch" in plan.explain() and "x[1, 32]" in plan.explain()


def test_an_evicted_binding_is_recompiled_and_counted():
    plan, ref = _mlp(cache_size=1)
    a, b = _x(2), _x(3)
    plan(a)
    plan(b)  # evicts batch=2
    np.testing.assert_allclose(plan(a).numpy(), ref(a), rtol=1e-4, atol=1e-6)
    assert plan.cache.stats() == {"capacity": 1, "size": 1, "hits": 0, "misses": 3, "evictions": 2}


def test_a_symbol_bound_to_two_sizes_is_a_shape_error_naming_both():
    b = ProgramBuilder("pair")
    x = b.input("x", ("batch", 4))
    y = b.input("y", ("batch", 4))
    b.output(b.add(x, y))
    plan = polyhal.compile(b.build(), "cpu:0")
    with pytest.raises(ShapeError, match=r"symbolic dim 'batch' has two sizes in one call: 2 \(input %x dim 0\) "
                                         r"and 3 \(input %y dim 0\)"):
        plan(_x(2, 4), _x(3, 4))
    with pytest.raises(ShapeError, match=r"input %x dim 1 is fixed at 4"):
        plan(_x(2, 5), _x(2, 4))
    with pytest.raises(ShapeError, match="expects rank 2"):
        plan(np.zeros(4, np.float32), _x(2, 4))
    assert plan.cache.misses == 0  # nothing was compiled for a bad binding


def test_a_binding_an_op_does_not_hold_for_says_which():
    b = ProgramBuilder("bcast")
    x = b.input("x", ("n",))
    b.output(b.add(x, b.input("y", (4,))))  # n must be 1 or 4
    plan = polyhal.compile(b.build(), "cpu:0")
    one = np.ones(1, np.float32)
    four = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(plan(one, four).numpy(), one + four)
    with pytest.raises(ShapeError, match=r"specialized to n=5: %add: add: shapes \(5,\) and \(4,\) do not broadcast"):
        plan(np.ones(5, np.float32), four)


def test_two_symbols_broadcast_per_binding():
    b = ProgramBuilder()
    x, y = b.input("x", ("a",)), b.input("y", ("b",))
    s = b.add(x, y)
    assert s.type.shape[0].derived
    b.output(s)
    plan = polyhal.compile(b.build(), "cpu:0")
    assert plan(np.ones(3, np.float32), np.ones(1, np.float32)).shape == (3,)
    assert plan(np.ones(3, np.float32), np.ones(3, np.float32)).shape == (3,)


def test_compile_takes_programs_only():
    with pytest.raises(ProgramError, match="takes a Program"):
        polyhal.compile(object(), "cpu:0")


def test_infer_types_over_symbols_directly():
    (out,) = infer_types("matmul", [TensorType(("b", 8), "float32"), TensorType((8, "k"), "float32")])
    assert out.shape == (SymbolicDim("b"), SymbolicDim("k"))
