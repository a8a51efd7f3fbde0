"""The CPU kernels against the ops' references, plus edge cases the random samples miss."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from polyhal.errors import DTypeError, KernelNotFoundError
from polyhal.ir.types import TensorType
from polyhal.ops import OPS
from polyhal_cpu.kernels import KERNEL_NAMES, erf, prepare

OP_NAMES = sorted(n for n, d in OPS.items() if d.backend in (None, "cpu"))  # core ops and the CPU's own
SEEDS = range(5)

#: (rtol, atol) for the float16 / float64 variants of the samples (float32 uses the op's own).
#: float16 results of kernel and reference are both rounded to half: allow ~2 half ulps.
DTYPE_TOLERANCE = {np.dtype(np.float16): (2e-3, 1e-3), np.dtype(np.float64): (1e-11, 1e-12)}


def ttype(x: np.ndarray) -> TensorType:
    return TensorType(x.shape, x.dtype)


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary, a
    view into a larger buffer, as a plan's allocator hands them out."""
    dtype = np.dtype(dtype)
    nbytes = max(1, math.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = -raw.ctypes.data % align
    return raw[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def run(name: str, inputs: list[np.ndarray], attrs: dict) -> tuple[np.ndarray, ...]:
    """Infer, prepare and run ``name`` into fresh aligned outputs."""
    in_types = tuple(ttype(x) for x in inputs)
    out_types = OPS[name].infer(in_types, attrs)
    outputs = tuple(aligned_empty(t.shape, t.dtype) for t in out_types)
    fn = prepare(name, attrs, in_types, out_types)
    fn(*inputs, *outputs)
    return outputs


def check(name: str, inputs: list[np.ndarray], attrs: dict, tolerance=None) -> None:
    outputs = run(name, inputs, attrs)
    expected = OPS[name].reference(*inputs, **attrs)
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        if got.dtype.kind == "f":
            rtol, atol = tolerance or OPS[name].tolerance
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"{name} {attrs}")
        else:
            np.testing.assert_array_equal(got, want, err_msg=f"{name} {attrs}")


def test_kernel_names_cover_the_op_set():
    # every core op, and the CPU's own ops (polyhal_cpu.ops); no other backend's
    assert KERNEL_NAMES == frozenset(n for n, d in OPS.items() if d.backend in (None, "cpu"))
    assert {"cpu.scale_shift_conv", "cpu.blocked_conv"} <= KERNEL_NAMES


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", OP_NAMES)
def test_matches_reference(name, seed):
    inputs, attrs = OPS[name].sample(np.random.default_rng(seed))
    check(name, inputs, attrs)


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["f16", "f64"])
@pytest.mark.parametrize("name", OP_NAMES)
def test_matches_reference_other_float_types(name, dtype):
    for seed in range(3):
        inputs, attrs = OPS[name].sample(np.random.default_rng(100 + seed))
        inputs = [x.astype(dtype) if x.dtype == np.float32 else x for x in inputs]
        try:
            OPS[name].infer(tuple(ttype(x) for x in inputs), attrs)
        except DTypeError:
            pytest.skip(f"{name} does not take {np.dtype(dtype)}")
        check(name, inputs, attrs, DTYPE_TOLERANCE[np.dtype(dtype)])


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint8", "uint64"])
def test_integer_elementwise_and_reductions(dtype):
    rng = np.random.default_rng(7)
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, size=(5, 6), dtype=dtype, endpoint=True)
    b = rng.integers(info.min, info.max, size=(6,), dtype=dtype, endpoint=True)
    for name in ("add", "sub", "mul", "maximum", "minimum", "less", "equal", "greater_equal"):
        check(name, [a, b], {})
    for name in ("abs", "relu") + (("neg",) if info.min < 0 else ()):
        check(name, [a], {})
    for attrs in ({}, {"axes": 1, "keepdims": True}, {"axes": [0]}):
        for name in ("reduce_sum", "reduce_max", "reduce_min"):
            check(name, [a], attrs)
    check("argmax", [a], {"axis": 1})
    check("matmul", [a[:, :5], a[:5]], {})
    for name in ("sort", "argsort"):
        check(name, [a], {"descending": True})


def test_bool_operands():
    rng = np.random.default_rng(3)
    a, b = rng.random((4, 5)) < 0.5, rng.random(5) < 0.5
    for name in ("maximum", "minimum", "equal", "not_equal", "less", "greater"):
        check(name, [a, b], {})
    check("reduce_max", [a], {"axes": 0})
    check("argmax", [a], {"axis": 1})
    check("sort", [a], {"descending": True})
    check("cast", [a], {"dtype": "float32"})
    check("where", [a, a, b], {})


@pytest.mark.parametrize("target", ["bool", "int8", "uint16", "int64", "float16", "float64"])
def test_cast_targets(target):
    x = np.array([[0.0, 1.9, -2.9], [100.5, -0.0, 3.0]], np.float32)
    if np.dtype(target).kind == "u":
        x = np.abs(x)
    check("cast", [x], {"dtype": target})


# ------------------------------------------------------------------------------------------ erf

@pytest.mark.parametrize("dtype, max_error", [(np.float32, 2e-7), (np.float64, 2e-15), (np.float16, 5e-4)])
def test_erf_accuracy_dense_grid(dtype, max_error):
    grid = np.concatenate([np.linspace(-7, 7, 200_001), np.geomspace(1e-30, 1, 2000),
                           -np.geomspace(1e-30, 1, 2000)]).astype(dtype)
    exact = np.array([math.erf(v) for v in grid.astype(np.float64).tolist()])
    got = erf(grid).astype(np.float64)
    assert np.abs(got - exact).max() < max_error
    # Relative accuracy near 0 matters too (gelu, and erf(x) ~ 1.128 x); skip float32 subnormals.
    normal = np.abs(grid) > np.finfo(dtype).tiny * 1e3
    assert np.max(np.abs(got - exact)[normal] / np.abs(exact[normal])) < 50 * np.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_erf_special_values(dtype):
    x = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 6e4, -9.0], dtype=dtype)
    (y,) = run("erf", [x], {})
    np.testing.assert_array_equal(y, np.array([1, -1, np.nan, 0, -0.0, 1, -1], dtype=dtype))
    assert np.signbit(y[4])


def test_erf_in_place():
    x = np.linspace(-5, 5, 1001)
    for dtype in (np.float32, np.float64):
        y = x.astype(dtype)
        np.testing.assert_array_equal(erf(y, y), erf(x.astype(dtype)))


def test_gelu_tail_accuracy():
    """Where 1 + erf cancels (x << 0) the float32 gelu still has a small absolute error."""
    x = -np.linspace(3, 6, 3001, dtype=np.float32)
    for approximate in ("none", "tanh"):
        (y,) = run("gelu", [x], {"approximate": approximate})
        (want,) = OPS["gelu"].reference(x, approximate=approximate)
        assert np.abs(y.astype(np.float64) - want).max() < 5e-7


# -------------------------------------------------------------------------------------- sorting

def test_sort_stability_and_nan_order():
    x = np.array([2, np.nan, 1, 2, -0.0, np.nan, 0.0, 1], dtype=np.float32)
    (asc,) = run("argsort", [x], {})
    np.testing.assert_array_equal(asc, [4, 6, 2, 7, 0, 3, 1, 5])
    (desc,) = run("argsort", [x], {"descending": True})
    np.testing.assert_array_equal(desc, [1, 5, 0, 3, 2, 7, 4, 6])
    (vals,) = run("sort", [x], {"descending": True})
    np.testing.assert_array_equal(vals, x[desc])
    assert not np.signbit(vals[-1]) and np.signbit(vals[-2])  # -0.0 (index 4) before 0.0 (index 6)
    (vals,) = run("sort", [x], {})
    np.testing.assert_array_equal(vals, x[asc])


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_ties_along_axes(axis, descending):
    x = np.random.default_rng(axis + 1 + 3 * descending).integers(0, 3, size=(6, 7)).astype(np.float32)
    x[2, 3] = x[4, 1] = np.nan
    for name in ("sort", "argsort"):
        check(name, [x], {"axis": axis, "descending": descending})


def test_topk_ties_nan_and_order():
    x = np.array([[1, 5, 5, np.nan, 2, 5], [4, 4, 4, 4, 4, 4]], dtype=np.float32)
    values, indices = run("topk", [x], {"k": 3})
    np.testing.assert_array_equal(indices, [[3, 1, 2], [0, 1, 2]])
    np.testing.assert_array_equal(values, [[np.nan, 5, 5], [4, 4, 4]])
    values, indices = run("topk", [x], {"k": 4, "largest": False})
    np.testing.assert_array_equal(indices, [[0, 4, 1, 2], [0, 1, 2, 3]])
    values, indices = run("topk", [x], {"k": 3, "sorted": False})
    np.testing.assert_array_equal(indices, [[1, 2, 3], [0, 1, 2]])
    for attrs in ({"k": 2, "axis": 0}, {"k": 6, "largest": False}, {"k": 1, "axis": 0, "largest": False}):
        check("topk", [x], attrs)


def test_sorting_integers_with_extremes():
    x = np.array([0, -128, 127, -128, 5, 127], dtype=np.int8)  # negation would overflow
    check("argsort", [x], {"descending": True})
    check("topk", [x], {"k": 3})
    u = np.array([0, 255, 3, 255, 0], dtype=np.uint8)
    check("argsort", [u], {"descending": True})
    check("topk", [u], {"k": 2, "largest": False})


# ------------------------------------------------------------------------------ empty and 0-d

EMPTY_CASES = [
    ("add", [np.ones((0, 3), np.float32), np.ones(3, np.float32)], {}),
    ("exp", [np.ones((2, 0), np.float32)], {}),
    ("gelu", [np.ones(0, np.float32)], {}),
    ("reduce_sum", [np.ones((0, 3), np.float32)], {"axes": 0}),  # -> zeros(3)
    ("reduce_sum", [np.ones((0, 3), np.float32)], {}),
    ("reduce_max", [np.ones((0, 3), np.float32)], {"axes": 1}),  # nothing to write
    ("argmax", [np.ones((0, 3), np.float32)], {"axis": 1}),
    ("softmax", [np.ones((0, 4), np.float32)], {}),
    ("layer_norm", [np.ones((0, 4), np.float32), np.ones(4, np.float32), np.ones(4, np.float32)], {}),
    ("matmul", [np.ones((3, 0), np.float32), np.ones((0, 4), np.float32)], {}),  # -> zeros(3, 4)
    ("gemm", [np.ones((3, 0), np.float32), np.ones((0, 4), np.float32), np.ones(4, np.float32)], {}),
    ("concat", [np.ones((2, 0), np.float32), np.ones((2, 3), np.float32)], {"axis": 1}),
    ("slice", [np.ones((4, 5), np.float32)], {"starts": [3], "ends": [1]}),
    ("gather", [np.ones((4, 5), np.float32), np.zeros((0,), np.int64)], {"axis": 1}),
    ("sort", [np.ones((3, 0), np.float32)], {}),
    ("argsort", [np.ones((0, 3), np.float32)], {"descending": True}),
    ("topk", [np.ones((3, 4), np.float32)], {"k": 0}),
    ("reshape", [np.ones((0, 3), np.float32)], {"shape": [3, 0]}),
    ("transpose", [np.ones((0, 3), np.float32)], {}),
    ("where", [np.ones((0,), bool), np.ones((0,), np.float32), np.ones((), np.float32)], {}),
    ("cast", [np.ones((0, 2), np.float32)], {"dtype": "int8"}),
]


@pytest.mark.parametrize("name, inputs, attrs", EMPTY_CASES, ids=[c[0] for c in EMPTY_CASES])
def test_empty_tensors(name, inputs, attrs):
    check(name, inputs, attrs)


ZERO_D_CASES = [
    (name, 2) for name in ("add", "sub", "mul", "div", "pow", "maximum", "less", "equal")
] + [
    (name, 1) for name in ("neg", "abs", "exp", "log", "sqrt", "tanh", "relu", "sigmoid", "erf",
                           "gelu", "reduce_sum", "reduce_mean", "reduce_max", "reduce_min")
]


@pytest.mark.parametrize("name, arity", ZERO_D_CASES, ids=[c[0] for c in ZERO_D_CASES])
def test_zero_d_tensors(name, arity):
    for dtype in (np.float32, np.float64):
        inputs = [np.array(1.5 + i, dtype=dtype) for i in range(arity)]
        check(name, inputs, {}, DTYPE_TOLERANCE.get(np.dtype(dtype)))
    if name.startswith("reduce"):
        check(name, [np.array(2.5, np.float32)], {"axes": [], "keepdims": True})
    if arity == 2:  # 0-d with a broadcast partner
        check(name, [np.array(2.0, np.float32), np.full((3, 2), 1.5, np.float32)], {})


# ---------------------------------------------------------------------------------- the contract

def test_unknown_op():
    with pytest.raises(KernelNotFoundError, match="cpu: no kernel for op 'fft'"):
        prepare("fft", {}, (TensorType((4,), "float32"),), (TensorType((4,), "float32"),))


def test_encoded_tensors_are_refused():
    t = TensorType((4,), "float32", encoding="tiled")
    with pytest.raises(KernelNotFoundError, match="dense row-major"):
        prepare("exp", {}, (t,), (TensorType((4,), "float32"),))


def test_defaults_filled_in_prepare():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = TensorType((2, 3), "float32")
    out = np.empty((2, 3), np.float32)
    prepare("softmax", {}, (t,), (t,))(x, out)
    np.testing.assert_allclose(out, OPS["softmax"].reference(x)[0], rtol=1e-6)


def test_writes_into_outputs_and_returns_nothing_useful():
    """The kernel fills the given output in place; the inputs are untouched."""
    rng = np.random.default_rng(0)
    for name in ("add", "softmax", "matmul", "layer_norm", "sort", "gelu", "gemm"):
        inputs, attrs = OPS[name].sample(rng)
        before = [x.copy() for x in inputs]
        in_types = tuple(ttype(x) for x in inputs)
        out_types = OPS[name].infer(in_types, attrs)
        outputs = [aligned_empty(t.shape, t.dtype) for t in out_types]
        for o in outputs:
            o.fill(np.nan if o.dtype.kind == "f" else 0)
        ids = [id(o) for o in outputs]
        prepare(name, attrs, in_types, out_types)(*inputs, *outputs)
        assert [id(o) for o in outputs] == ids
        for x, b in zip(inputs, before):
            np.testing.assert_array_equal(x, b)
        for o, want in zip(outputs, OPS[name].reference(*inputs, **attrs)):
            np.testing.assert_allclose(o, want, *OPS[name].tolerance)


def test_non_contiguous_inputs():
    base = np.random.default_rng(1).uniform(0.5, 2, (8, 10)).astype(np.float32)
    x = base[::2, 1::3]  # strided view
    for name, attrs in (("exp", {}), ("softmax", {"axis": 0}), ("layer_norm", {}), ("reshape", {"shape": [-1]}),
                        ("transpose", {}), ("sort", {"descending": True}), ("reduce_sum", {"axes": 1})):
        inputs = [x] if name != "layer_norm" else [x, base[0, :3], base[1, ::4]]
        check(name, inputs, attrs)
    check("matmul", [x, x.T], {})


def test_gather_out_of_range_raises():
    data, idx = np.ones((3, 4), np.float32), np.array([0, 3], np.int64)
    fn = prepare("gather", {}, (ttype(data), ttype(idx)), (TensorType((2, 4), "float32"),))
    with pytest.raises(IndexError):
        fn(data, idx, np.empty((2, 4), np.float32))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_of_one_index(axis):
    """A scalar index (a slice copied as one block) against the reference, negative indices,
    strided data and out of range included."""
    data = np.random.default_rng(2).standard_normal((3, 5, 4)).astype(np.float32).transpose(1, 0, 2)
    for i in (0, 2, -1, -3):
        idx = np.array(i, np.int64)
        (got,) = run("gather", [data, idx], {"axis": axis})
        np.testing.assert_array_equal(got, np.take(data, i, axis=axis))
    out_type = OPS["gather"].infer((ttype(data), ttype(idx)), {"axis": axis})[0]
    fn = prepare("gather", {"axis": axis}, (ttype(data), ttype(idx)), (out_type,))
    with pytest.raises(IndexError, match="out of bounds"):
        fn(data, np.array(data.shape[axis], np.int64), np.empty(out_type.shape, np.float32))


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_from_a_strided_table_copies_none_of_it(axis):
    """A lookup in a transposed table (a tied embedding read through its folded transpose)
    against the reference, negative indices and out of range included; numpy's take would first
    copy the whole table (tracemalloc sees what the kernel allocates)."""
    import tracemalloc

    table = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32).T  # (512, 64), strided
    idx = np.array([[1, -2, 7], [0, 5, -1]], np.int64)
    out_type = OPS["gather"].infer((ttype(table), ttype(idx)), {"axis": axis})[0]
    fn = prepare("gather", {"axis": axis}, (ttype(table), ttype(idx)), (out_type,))
    out = np.empty(out_type.shape, np.float32)
    tracemalloc.start()
    try:
        fn(table, idx, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(out, np.take(table, idx, axis=axis))
    assert peak < table.nbytes // 4
    with pytest.raises(IndexError):
        fn(table, np.array([[0, table.shape[axis], 0]] * 2, np.int64), out)


def test_large_matmul_uses_blas():
    """A 256x256 product is as accurate as float32 BLAS. Not bit-equal to numpy's ``a @ b``: the
    backend calls the BLAS with its own thread budget, and OpenBLAS's blocking (hence its rounding)
    follows the thread count and the CPU's kernel (seen on an AMD EPYC VM)."""
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((256, 256), np.float32), rng.standard_normal((256, 256), np.float32)
    (out,) = run("matmul", [a, b], {})
    exact = a.astype(np.float64) @ b.astype(np.float64)
    blas_error = np.abs((a @ b) - exact).max()
    assert out.dtype == np.float32 and np.abs(out - exact).max() <= 2 * blas_error


@pytest.mark.parametrize("keepdims", [False, True])
def test_short_last_axis_sum_by_blas_matches_numpy(keepdims):
    """reduce_sum over a short last axis of many rows (the BLAS matrix-vector path), contiguous
    and strided."""
    x = np.random.default_rng(0).standard_normal((64, 40, 10)).astype(np.float32)
    attrs = {"axes": [2], "keepdims": keepdims}
    out_shape = (64, 40, 1) if keepdims else (64, 40)
    kernel = prepare("reduce_sum", attrs, (TensorType(x.shape, x.dtype),), (TensorType(out_shape, x.dtype),))
    for arr in (x, np.concatenate([x, x], axis=2)[:, :, ::2]):
        out = np.empty(out_shape, np.float32)
        kernel(arr, out)
        np.testing.assert_allclose(out, arr.sum(axis=2, keepdims=keepdims), rtol=1e-5, atol=1e-5)


def test_the_lazily_imported_kernel_modules_register_what_the_table_lists():
    # A fresh interpreter: the CPU's table lists every op before its kernel module is imported
    # (polyhal_cpu.kernels.LAZY_MODULES), and importing them all adds none and leaves none out.
    code = """
import importlib, json, sys
from polyhal_cpu import kernels
listed = sorted(kernels.TABLE.kernel_names)
early = sorted(m for m in kernels.LAZY_MODULES if f"polyhal_cpu.{m}" in sys.modules)
for m in kernels.LAZY_MODULES:
    importlib.import_module(f"polyhal_cpu.{m}")
print(json.dumps({"same": listed == sorted(kernels.TABLE.kernel_names) == sorted(kernels.KERNEL_NAMES),
                  "left": sorted(kernels.TABLE.lazy), "early": early}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"same": True, "left": [], "early": []}
