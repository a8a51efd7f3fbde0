"""Kernels beyond the conformance samples: plans against numpy, the global sort path, large
lanes and tiles, element types, empty tensors and what a prepared kernel may not do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import polyhal
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, infer_types
from polyhal_opencl import kernels


def _types(*arrays):
    return tuple(TensorType(a.shape, a.dtype) for a in arrays)


def _check(run_prepared, dev, op, inputs, traits=None, **attrs):
    """Prepare ``op`` (with ``traits`` if given), run it and compare with the reference."""
    in_types = _types(*inputs)
    out_types = infer_types(op, in_types, attrs)
    fn = kernels.prepare(dev, op, attrs, in_types, out_types, traits=traits)
    got = run_prepared(fn, inputs, out_types)
    want = OPS[op].reference(*inputs, **attrs)
    rtol, atol = OPS[op].tolerance
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{op} {attrs}")
    return fn


def test_plan_matches_numpy(dev, rng):
    b = polyhal.ProgramBuilder("block")
    x, w = b.input("x", (24, 32)), b.input("w", (32, 48))
    gamma, beta = b.input("gamma", (48,)), b.input("beta", (48,))
    h = b.gelu(b.matmul(x, w), approximate="tanh")
    b.output(b.softmax(b.layer_norm(h, gamma, beta), axis=-1), b.argmax(h, axis=1))
    plan = polyhal.compile(b.build(), dev.name)
    feeds = [rng.standard_normal(s).astype(np.float32) for s in ((24, 32), (32, 48), (48,), (48,))]
    probs, best = plan(*feeds)
    assert probs.device is dev
    (hh,) = OPS["gelu"].reference(*OPS["matmul"].reference(feeds[0], feeds[1]), approximate="tanh")
    (ln,) = OPS["layer_norm"].reference(hh, feeds[2], feeds[3])
    np.testing.assert_allclose(probs.numpy(), OPS["softmax"].reference(ln)[0], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(best.numpy(), np.argmax(hh, axis=1))


#: Rows of 100 with local sorts of 8: tile sorts, then four global merge passes.
SMALL_LOCAL = {"max_local_sort": 8}


@pytest.mark.parametrize("op, attrs", [
    ("sort", {"axis": 1, "descending": False}),
    ("argsort", {"axis": 0, "descending": True}),
    ("topk", {"k": 21, "axis": -1, "largest": False, "sorted": False}),  # a second, by-index pass
])
def test_global_sort_path(dev, rng, run_prepared, op, attrs):
    traits = dataclasses.replace(dev.traits, **SMALL_LOCAL)
    x = rng.choice(np.array([-2, -1, 0, 1, 2, np.nan], np.float32), size=(100, 3) if attrs["axis"] == 0 else (3, 100))
    fn = _check(run_prepared, dev, op, [x], traits=traits, **attrs)
    assert any(s.kernel == "merge_pass" for s in fn.recipe.steps) and fn.recipe.scratch


def test_rows_that_fit_sort_in_local_memory_without_scratch(dev):
    t = TensorType((5, 300), "float32")
    recipe = kernels.generate("argsort", {"axis": 1}, (t,), (TensorType((5, 300), "int64"),), dev.traits)
    assert [s.kernel for s in recipe.steps] == ["sort_rows"] and not recipe.scratch


def test_long_lanes_and_big_tiles(dev, rng, run_prepared):
    x = rng.standard_normal((3, 5000)).astype(np.float32)
    _check(run_prepared, dev, "reduce_sum", [x], axes=[1])  # one work-group per lane of 5000
    ties = rng.choice(np.array([1, 2, 3], np.int32), size=(2, 3000))
    _check(run_prepared, dev, "argmax", [ties], axis=1)  # the first 3 of many: lowest index wins
    a, b = rng.standard_normal((2, 1, 37, 45)).astype(np.float32), rng.standard_normal((3, 45, 29)).astype(np.float32)
    _check(run_prepared, dev, "matmul", [a, b])  # batch broadcast, one output per work-item
    a, b = rng.standard_normal((70, 33)).astype(np.float32), rng.standard_normal((33, 131)).astype(np.float32)
    _check(run_prepared, dev, "matmul", [a, b])  # 4x4 register tiles, ragged edges


def test_integer_arithmetic_wraps_like_numpy(dev, run_prepared):
    x = np.array([127, -128, 100, 5], np.int8)
    _check(run_prepared, dev, "add", [x, np.ones(4, np.int8)])
    big = np.array([[2**40, 3], [7, 2**33]], np.int64)
    _check(run_prepared, dev, "matmul", [big, big])


def test_half_is_computed_in_float(dev, rng, run_prepared):
    x = rng.standard_normal((4, 9)).astype(np.float16)
    in_types = _types(x)
    fn = kernels.prepare(dev, "exp", {}, in_types, in_types)
    (got,) = run_prepared(fn, [x], in_types)
    np.testing.assert_allclose(got, OPS["exp"].reference(x)[0], rtol=1e-3)


def test_gather_out_of_range_gives_zero(dev, run_prepared):
    data = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    idx = np.array([2, -1, 3, -4], np.int64)
    in_types = _types(data, idx)
    out_types = infer_types("gather", in_types, {"axis": 1})
    fn = kernels.prepare(dev, "gather", {"axis": 1}, in_types, out_types)
    (got,) = run_prepared(fn, [data, idx], out_types)
    np.testing.assert_array_equal(got, [[3, 3, 0, 0], [6, 6, 0, 0]])


def test_float64_needs_fp64_but_data_movement_does_not(dev, rng, run_prepared):
    no_fp64 = dataclasses.replace(dev.traits, fp64=False)
    t = TensorType((4,), "float64")
    with pytest.raises(polyhal.KernelNotFoundError, match="cl_khr_fp64"):
        kernels.generate("exp", {}, (t,), (t,), no_fp64)
    x = rng.standard_normal((3, 4))
    _check(run_prepared, dev, "transpose", [x], traits=no_fp64, perm=[1, 0])
    assert "double" not in kernels.generate("transpose", {"perm": [1, 0]}, _types(x),
                                            _types(x.T), no_fp64).source


def test_empty_results_launch_nothing(dev, run_prepared):
    x = np.ones((4, 5), np.float32)
    fn = _check(run_prepared, dev, "slice", [x], starts=[3], ends=[1], axes=[1])
    assert fn.recipe.steps == []
    fn = _check(run_prepared, dev, "topk", [x], k=0, axis=1)
    assert fn.recipe.steps == []


def test_prepared_kernels_do_not_allocate(dev, rng):
    # The global sort path of test_global_sort_path (the same program, from the cache).
    x = rng.standard_normal((3, 100)).astype(np.float32)
    traits = dataclasses.replace(dev.traits, **SMALL_LOCAL)
    in_types = _types(x)
    fn = kernels.prepare(dev, "sort", {"axis": 1, "descending": False}, in_types, in_types, traits=traits)
    src, out = polyhal.asarray(x, device=dev), polyhal.empty(x.shape, "float32", dev)
    live = dev.allocator.statistics.live_count
    for _ in range(3):
        fn(src.native, out.native)
    assert dev.allocator.statistics.live_count == live  # scratch was made once, when prepared
    np.testing.assert_array_equal(out.numpy(), np.sort(x, axis=1))
