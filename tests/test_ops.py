"""Tests of the core op set: type inference (incl. errors), references, samples, attrs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from polyhal.errors import DTypeError, ProgramError, ShapeError
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, REQUIRED, OpDef, canonical_attrs, get_op, infer_types, resolve_attrs

OP_NAMES = sorted(OPS)

EXPECTED_OPS = {
    "add", "sub", "mul", "div", "pow", "maximum", "minimum",
    "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
    "neg", "abs", "exp", "log", "sqrt", "tanh", "relu", "sigmoid", "erf", "gelu",
    "matmul", "gemm", "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "argmax",
    "softmax", "layer_norm", "transpose", "reshape", "concat", "slice", "gather", "cast", "where",
    "sort", "argsort", "topk",
}


def T(*shape, dtype="float32") -> TensorType:
    return TensorType(shape, dtype)


def infer1(name, *types, **attrs) -> TensorType:
    (out,) = infer_types(name, types, attrs)
    return out


# ----------------------------------------------------------------------------------- registry

def test_op_set_is_complete():
    # The core op set; families added since (ONNX's wider set, detection, data tiling) are
    # tested by their own tests and by the per-op tests below.
    assert EXPECTED_OPS <= set(OPS)


@pytest.mark.parametrize("name", OP_NAMES)
def test_opdef_fields(name):
    op = get_op(name)
    assert isinstance(op, OpDef) and op.name == name
    assert op.doc, f"{name} has no doc"
    rtol, atol = op.tolerance
    assert rtol >= 0 and atol >= 0
    hash(op)  # frozen and hashable


@pytest.mark.parametrize("name", OP_NAMES)
@pytest.mark.parametrize("seed", range(4))
def test_sample_infer_and_reference_agree(name, seed):
    """Samples are valid, small and zero-free; the reference returns what inference promises."""
    op = OPS[name]
    inputs, attrs = op.sample(np.random.default_rng(seed))
    assert isinstance(attrs, dict)
    for x in inputs:
        assert isinstance(x, np.ndarray) and x.size <= 64 * 64
        if x.dtype.kind == "f":
            assert not np.any(x == 0)
    out_types = op.infer(tuple(TensorType(x.shape, x.dtype) for x in inputs), attrs)
    outs = op.reference(*inputs, **attrs)
    assert isinstance(outs, tuple) and len(outs) == len(out_types)
    for t, y in zip(out_types, outs):
        assert isinstance(y, np.ndarray)
        assert (y.shape, y.dtype) == (t.shape, t.dtype)
    if op.num_inputs is not None:
        assert len(inputs) == op.num_inputs


def test_samples_differ_between_seeds():
    a, _ = OPS["add"].sample(np.random.default_rng(0))
    b, _ = OPS["add"].sample(np.random.default_rng(1))
    assert not all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def test_unknown_op_lists_known_ops():
    with pytest.raises(ProgramError, match=r"unknown op 'matmull'.*did you mean 'matmul'.*known ops: abs, "):
        get_op("matmull")
    with pytest.raises(ProgramError, match="unknown op 'nope'"):
        infer_types("nope", [T(2)], {})


@pytest.mark.parametrize("name, n, msg", [
    ("add", 1, "add: expects 2 inputs, got 1"),
    ("add", 3, "add: expects 2 inputs, got 3"),
    ("exp", 2, "exp: expects 1 input, got 2"),
    ("gemm", 4, "gemm: expects 2 or 3 inputs, got 4"),
    ("concat", 0, "concat: expects 1 or more inputs, got 0"),
    ("layer_norm", 1, "layer_norm: expects 3 inputs, got 1"),
])
def test_arity(name, n, msg):
    attrs = {"axis": 0} if name == "concat" else {}
    with pytest.raises(ProgramError, match=msg):
        infer_types(name, [T(2, 2)] * n, attrs)


def test_num_inputs():
    assert OPS["add"].num_inputs == 2 and OPS["where"].num_inputs == 3
    assert OPS["concat"].num_inputs is None and OPS["gemm"].num_inputs is None


def test_non_tensor_type_input():
    with pytest.raises(ProgramError, match="input 1 is tuple"):
        infer_types("add", [T(2), (2,)], {})


def test_attribute_checking():
    with pytest.raises(ProgramError, match=r"softmax: unknown attribute 'axes'; known attributes: axis"):
        infer_types("softmax", [T(2, 3)], {"axes": 1})
    with pytest.raises(ProgramError, match=r"topk: missing required attribute 'k'"):
        infer_types("topk", [T(5)], {})
    with pytest.raises(ProgramError, match="add: unknown attribute 'axis'; known attributes: none"):
        infer_types("add", [T(2), T(2)], {"axis": 0})
    with pytest.raises(ProgramError, match="softmax: attribute 'axis' must be an integer"):
        infer_types("softmax", [T(2, 3)], {"axis": 1.0})
    with pytest.raises(ProgramError, match="attribute 'keepdims' must be a bool"):
        infer_types("reduce_sum", [T(2, 3)], {"keepdims": "yes"})


def test_defaults_and_resolve_attrs():
    assert dict(OPS["softmax"].defaults) == {"axis": -1}
    assert dict(OPS["layer_norm"].defaults) == {"axis": -1, "epsilon": 1e-5}
    assert dict(OPS["gemm"].defaults) == {"alpha": 1.0, "beta": 1.0, "trans_a": False, "trans_b": False,
                                          "precision": "fp32"}  # a contraction (OpDef.contraction)
    assert dict(OPS["topk"].defaults) == {"k": REQUIRED, "axis": -1, "largest": True, "sorted": True}
    assert dict(OPS["reduce_sum"].defaults) == {"axes": None, "keepdims": False}
    assert resolve_attrs("sort", {"axis": 0}) == {"axis": 0, "descending": False}
    with pytest.raises(ProgramError, match="cast: missing required attribute 'dtype'"):
        resolve_attrs("cast", {})


def test_canonical_attrs():
    key = canonical_attrs({"perm": [1, 0], "dtype": np.dtype("float32"), "k": np.int64(3),
                           "nested": [[1, 2], (3,)], "sub": {"b": 1, "a": [2]}, "t": np.float16})
    assert key == (("dtype", "float32"), ("k", 3), ("nested", ((1, 2), (3,))), ("perm", (1, 0)),
                   ("sub", (("a", (2,)), ("b", 1))), ("t", "float16"))
    hash(key)
    assert canonical_attrs({"b": 1, "a": [1]}) == canonical_attrs({"a": (1,), "b": 1})
    assert canonical_attrs({}) == canonical_attrs(None) == ()
    assert canonical_attrs({"dtype": "float32"}) == canonical_attrs({"dtype": np.float32})
    assert isinstance(canonical_attrs({"x": np.array([1, 2])})[0][1], tuple)


# -------------------------------------------------------------------------------- elementwise

@pytest.mark.parametrize("a, b, out", [
    ((3, 4), (3, 4), (3, 4)), ((3, 4), (4,), (3, 4)), ((3, 1), (1, 4), (3, 4)),
    ((), (2, 3), (2, 3)), ((2, 1, 5), (4, 1), (2, 4, 5)), ((0, 3), (1, 3), (0, 3)),
])
def test_binary_broadcast(a, b, out):
    assert infer1("add", T(*a), T(*b)) == T(*out)
    assert infer1("less", T(*a), T(*b)) == T(*out, dtype=bool)


def test_binary_errors():
    with pytest.raises(ShapeError, match=r"^add: shapes \(3,4\) and \(5,\) do not broadcast$"):
        infer1("add", T(3, 4), T(5))
    with pytest.raises(DTypeError, match=r"mul: .*operand 0 float32, operand 1 int32.*insert a 'cast'"):
        infer1("mul", T(2), T(2, dtype="int32"))
    with pytest.raises(DTypeError, match="div: operand 0 has element type int32, expected a float type"):
        infer1("div", T(2, dtype="int32"), T(2, dtype="int32"))
    with pytest.raises(DTypeError, match="add: operand 0 has element type bool"):
        infer1("add", T(2, dtype=bool), T(2, dtype=bool))
    with pytest.raises(DTypeError, match="cast"):
        infer1("equal", T(2, dtype="int64"), T(2, dtype="int32"))


def test_binary_dtypes():
    assert infer1("add", T(2, dtype="int8"), T(2, dtype="int8")).dtype == np.int8
    assert infer1("maximum", T(2, dtype=bool), T(2, dtype=bool)).dtype == bool
    assert infer1("equal", T(2, dtype="uint16"), T(2, dtype="uint16")).dtype == bool
    assert infer1("pow", T(2, dtype="float16"), T(2, dtype="float16")).dtype == np.float16


def test_unary():
    assert infer1("exp", T(2, 3, dtype="float64")) == T(2, 3, dtype="float64")
    assert infer1("neg", T(dtype="int32")) == T(dtype="int32")
    assert infer1("relu", T(4, dtype="int8")).dtype == np.int8
    with pytest.raises(DTypeError, match="exp: operand 0 has element type int32, expected a float type"):
        infer1("exp", T(2, dtype="int32"))
    with pytest.raises(DTypeError, match="neg: .*uint8"):
        infer1("neg", T(2, dtype="uint8"))
    with pytest.raises(DTypeError, match="abs: .*bool"):
        infer1("abs", T(2, dtype=bool))


def test_gelu_attr():
    assert infer1("gelu", T(3), approximate="tanh") == T(3)
    with pytest.raises(ProgramError, match="gelu: attribute 'approximate' must be one of"):
        infer1("gelu", T(3), approximate="fast")


def test_where():
    assert infer1("where", T(3, 1, dtype=bool), T(4), T(1, 4)) == T(3, 4)
    with pytest.raises(DTypeError, match="where: condition \\(operand 0\\) has element type float32"):
        infer1("where", T(3), T(3), T(3))
    with pytest.raises(DTypeError, match="operand 1 float32, operand 2 float64"):
        infer1("where", T(3, dtype=bool), T(3), T(3, dtype="float64"))
    with pytest.raises(ShapeError, match=r"where: shapes \(2,\), \(3,\) and \(3,\) do not broadcast"):
        infer1("where", T(2, dtype=bool), T(3), T(3))


def test_cast():
    assert infer1("cast", T(2, 3), dtype="int8") == T(2, 3, dtype="int8")
    assert infer1("cast", T(2), dtype=np.float16).dtype == np.float16
    with pytest.raises(DTypeError, match="cast: element type complex64 is not supported"):
        infer1("cast", T(2), dtype="complex64")


# -------------------------------------------------------------------------------------- linalg

@pytest.mark.parametrize("a, b, out", [
    ((3, 4), (4, 5), (3, 5)), ((4,), (4, 5), (5,)), ((3, 4), (4,), (3,)), ((4,), (4,), ()),
    ((2, 3, 4), (4, 5), (2, 3, 5)), ((2, 1, 3, 4), (5, 4, 6), (2, 5, 3, 6)), ((3, 0), (0, 2), (3, 2)),
])
def test_matmul_shapes(a, b, out):
    assert infer1("matmul", T(*a), T(*b)) == T(*out)


def test_matmul_errors():
    with pytest.raises(ShapeError, match=r"matmul: inner dimensions do not match: operand 0 has shape "
                                         r"\(3,4\) \(K=4\) but operand 1 has shape \(5,6\) \(K=5\)"):
        infer1("matmul", T(3, 4), T(5, 6))
    with pytest.raises(ShapeError, match="matmul: operand 1 is 0-d"):
        infer1("matmul", T(3), T())
    with pytest.raises(ShapeError, match=r"matmul: batch dimensions \(2,\) .* and \(3,\) .* do not broadcast"):
        infer1("matmul", T(2, 3, 4), T(3, 4, 5))
    with pytest.raises(DTypeError, match="matmul: operand 0 has element type bool"):
        infer1("matmul", T(2, 2, dtype=bool), T(2, 2, dtype=bool))


def test_gemm():
    assert infer1("gemm", T(3, 4), T(4, 5)) == T(3, 5)
    assert infer1("gemm", T(4, 3), T(5, 4), T(5), trans_a=True, trans_b=1) == T(3, 5)
    assert infer_types("gemm", [T(3, 4), T(4, 5), T(3, 1)], {"beta": 0.5}) == (T(3, 5),)
    with pytest.raises(ShapeError, match=r"gemm: inner dimensions do not match: A\^T is \(3,4\) but B is \(5,5\)"):
        infer1("gemm", T(4, 3), T(5, 5), trans_a=True)
    with pytest.raises(ShapeError, match=r"gemm: C has shape \(3,\), which does not broadcast to .*\(3,5\)"):
        infer1("gemm", T(3, 4), T(4, 5), T(3))
    with pytest.raises(ShapeError, match="gemm: operand 0 has shape \\(2,3,4\\); gemm needs 2-D"):
        infer1("gemm", T(2, 3, 4), T(4, 5))
    with pytest.raises(DTypeError, match="gemm: operand 0 has element type int32"):
        infer1("gemm", T(3, 4, dtype="int32"), T(4, 5, dtype="int32"))
    with pytest.raises(ProgramError, match="attribute 'alpha' must be a number"):
        infer1("gemm", T(3, 4), T(4, 5), alpha="2")


# ---------------------------------------------------------------------------------- reductions

@pytest.mark.parametrize("axes, keepdims, out", [
    (None, False, ()), (None, True, (1, 1, 1)), (1, False, (2, 4)), (-1, True, (2, 3, 1)),
    ([0, 2], False, (3,)), ((2, -3), True, (1, 3, 1)), ([], False, (2, 3, 4)),
])
def test_reduction_shapes(axes, keepdims, out):
    for name in ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min"):
        assert infer1(name, T(2, 3, 4), axes=axes, keepdims=keepdims) == T(*out)


def test_reduction_errors_and_types():
    with pytest.raises(ShapeError, match=r"reduce_sum: axes 3 is out of range for rank 3 \(valid: -3..2\)"):
        infer1("reduce_sum", T(2, 3, 4), axes=[3])
    with pytest.raises(ShapeError, match="reduce_max: axes \\[1, -2\\] repeats an axis"):
        infer1("reduce_max", T(2, 3, 4), axes=[1, -2])
    with pytest.raises(ShapeError, match=r"reduce_max: cannot reduce over empty axis 0 of shape \(0,3\)"):
        infer1("reduce_max", T(0, 3), axes=0)
    with pytest.raises(ShapeError, match="reduce_mean: cannot reduce over empty axis"):
        infer1("reduce_mean", T(0, 3))
    assert infer1("reduce_sum", T(0, 3), axes=0) == T(3)  # a sum of nothing is 0
    assert infer1("reduce_sum", T(dtype="int8")) == T(dtype="int8")
    assert infer1("reduce_max", T(3, dtype=bool)).dtype == bool
    with pytest.raises(DTypeError, match="reduce_mean: operand 0 has element type int32"):
        infer1("reduce_mean", T(3, dtype="int32"))


def test_argmax():
    assert infer1("argmax", T(2, 3)) == T(3, dtype="int64")
    assert infer1("argmax", T(2, 3, dtype="int8"), axis=-1, keepdims=True) == T(2, 1, dtype="int64")
    with pytest.raises(ShapeError, match="argmax: axis 2 is out of range for rank 2"):
        infer1("argmax", T(2, 3), axis=2)
    with pytest.raises(ShapeError, match=r"argmax: axis 0 is out of range for rank 0 \(a 0-d operand has no axes\)"):
        infer1("argmax", T())
    with pytest.raises(ShapeError, match="argmax: cannot reduce over empty axis 1"):
        infer1("argmax", T(2, 0), axis=1)


def test_softmax_and_layer_norm():
    assert infer1("softmax", T(2, 3), axis=0) == T(2, 3)
    with pytest.raises(ShapeError, match="softmax: axis -3 is out of range for rank 2"):
        infer1("softmax", T(2, 3), axis=-3)
    with pytest.raises(DTypeError, match="softmax: .*int32"):
        infer1("softmax", T(2, dtype="int32"))
    assert infer1("layer_norm", T(2, 3, 4), T(3, 4), T(3, 4), axis=1) == T(2, 3, 4)
    with pytest.raises(ShapeError, match=r"layer_norm: operand 1 \(scale\) has shape \(3,4\), expected "
                                         r"x.shape\[2:\] = \(4,\)"):
        infer1("layer_norm", T(2, 3, 4), T(3, 4), T(4))
    with pytest.raises(ShapeError, match=r"layer_norm: operand 2 \(bias\) has shape \(3,\)"):
        infer1("layer_norm", T(2, 4), T(4), T(3))
    with pytest.raises(DTypeError, match="layer_norm: .*operand 2 float64"):
        infer1("layer_norm", T(2, 4), T(4), T(4, dtype="float64"))
    with pytest.raises(ProgramError, match="layer_norm: attribute 'epsilon' must be >= 0"):
        infer1("layer_norm", T(2, 4), T(4), T(4), epsilon=-1.0)


# -------------------------------------------------------------------------------------- shapes

def test_transpose():
    assert infer1("transpose", T(2, 3, 4)) == T(4, 3, 2)
    assert infer1("transpose", T(2, 3, 4), perm=[1, 2, 0]) == T(3, 4, 2)
    assert infer1("transpose", T()) == T()
    with pytest.raises(ShapeError, match=r"transpose: perm \[0, 0, 1\] is not a permutation of 0..2"):
        infer1("transpose", T(2, 3, 4), perm=[0, 0, 1])
    with pytest.raises(ShapeError, match="not a permutation"):
        infer1("transpose", T(2, 3), perm=[0, 1, 2])


def test_reshape():
    assert infer1("reshape", T(2, 3, 4), shape=[6, -1]) == T(6, 4)
    assert infer1("reshape", T(2, 3), shape=(3, 2)) == T(3, 2)
    assert infer1("reshape", T(), shape=[1, 1]) == T(1, 1)
    assert infer1("reshape", T(0, 3), shape=[3, 0]) == T(3, 0)  # 0 is an ordinary dim
    with pytest.raises(ShapeError, match=r"reshape: cannot reshape \(2,3\) \(6 elements\) to \(4,2\) \(8 elements\)"):
        infer1("reshape", T(2, 3), shape=[4, 2])
    with pytest.raises(ShapeError, match=r"reshape: cannot reshape \(2,3\) \(6 elements\) to \[4, -1\]"):
        infer1("reshape", T(2, 3), shape=[4, -1])
    with pytest.raises(ShapeError, match="at most one -1"):
        infer1("reshape", T(2, 3), shape=[-1, -1])
    with pytest.raises(ShapeError, match="reshape: cannot reshape"):
        infer1("reshape", T(0, 3), shape=[0, -1])  # -1 is ambiguous
    with pytest.raises(ProgramError, match="missing required attribute 'shape'"):
        infer1("reshape", T(2))


def test_concat():
    assert infer_types("concat", [T(2, 3), T(4, 3)], {"axis": 0}) == (T(6, 3),)
    assert infer_types("concat", [T(2, 3), T(2, 1), T(2, 0)], {"axis": -1}) == (T(2, 4),)
    assert infer_types("concat", [T(5)], {"axis": 0}) == (T(5),)
    with pytest.raises(ShapeError, match=r"concat: operand 1 has shape \(3,3\) but operand 0 has shape "
                                         r"\(2,3\); they may differ only in axis 1"):
        infer_types("concat", [T(2, 3), T(3, 3)], {"axis": 1})
    with pytest.raises(ShapeError, match="concat: operand 1 has shape"):
        infer_types("concat", [T(2, 3), T(2, 3, 1)], {"axis": 0})
    with pytest.raises(DTypeError, match="concat: .*insert a 'cast'"):
        infer_types("concat", [T(2), T(2, dtype="int32")], {"axis": 0})
    with pytest.raises(ShapeError, match="concat: operand 0 is 0-d"):
        infer_types("concat", [T(), T()], {"axis": 0})


@pytest.mark.parametrize("attrs, expected_index", [
    ({"starts": [1], "ends": [3]}, (slice(1, 3), slice(None))),
    ({"starts": [-3], "ends": [2**63 - 1], "axes": [1]}, (slice(None), slice(2, 5))),
    ({"starts": [0, 1], "ends": [-1, 1000], "axes": [0, 1], "steps": [2, 2]}, (slice(0, 3, 2), slice(1, 5, 2))),
    # negative step: start clamps to dim-1, end -1 means "past the first element"
    ({"starts": [100], "ends": [-100], "axes": [0], "steps": [-1]}, (slice(3, None, -1), slice(None))),
    ({"starts": [-1], "ends": [0], "axes": [-1], "steps": [-2]}, (slice(None), slice(4, 0, -2))),
    # ONNX clamps a too-negative start to 0 for negative steps (Python's x[-10::-1] is empty)
    ({"starts": [-10], "ends": [-2**63], "axes": [0], "steps": [-1]}, (slice(0, None, -1), slice(None))),
    ({"starts": [3], "ends": [1]}, (slice(3, 1), slice(None))),  # empty
])
def test_slice_semantics(attrs, expected_index):
    x = np.arange(20, dtype=np.float32).reshape(4, 5)
    expected = x[expected_index]
    assert infer1("slice", T(4, 5), **attrs) == T(*expected.shape)
    (got,) = OPS["slice"].reference(x, **attrs)
    np.testing.assert_array_equal(got, expected)


def test_slice_errors():
    with pytest.raises(ProgramError, match="slice: steps must be nonzero"):
        infer1("slice", T(4), starts=[0], ends=[2], steps=[0])
    with pytest.raises(ProgramError, match="slice: 'starts', 'ends', 'axes' and 'steps' must have equal lengths"):
        infer1("slice", T(4, 4), starts=[0, 1], ends=[2])
    with pytest.raises(ShapeError, match="slice: axes entry 2 is out of range for rank 2"):
        infer1("slice", T(4, 4), starts=[0], ends=[2], axes=[2])
    with pytest.raises(ShapeError, match="slice: axes \\[1, -1\\] repeats an axis"):
        infer1("slice", T(4, 4), starts=[0, 0], ends=[2, 2], axes=[1, -1])
    with pytest.raises(ShapeError, match="slice: 'starts' has 3 entries but the operand has rank 2"):
        infer1("slice", T(4, 4), starts=[0, 0, 0], ends=[1, 1, 1])
    assert infer1("slice", T(0, 3), starts=[0], ends=[5], steps=[-1]) == T(0, 3)


def test_gather():
    assert infer1("gather", T(5, 6), T(2, 3, dtype="int64")) == T(2, 3, 6)
    assert infer1("gather", T(5, 6, 7), T(dtype="int32"), axis=1) == T(5, 7)
    assert infer1("gather", T(5, 6), T(4, dtype="int32"), axis=-1) == T(5, 4)
    with pytest.raises(DTypeError, match="gather: indices \\(operand 1\\) has element type float32, "
                                         "expected int32 or int64"):
        infer1("gather", T(5), T(2))
    with pytest.raises(ShapeError, match="gather: axis 2 is out of range"):
        infer1("gather", T(5, 6), T(2, dtype="int64"), axis=2)
    with pytest.raises(ShapeError, match="gather: data \\(operand 0\\) is 0-d"):
        infer1("gather", T(), T(2, dtype="int64"))


# ------------------------------------------------------------------------------------- sorting

def test_sorting_types():
    assert infer1("sort", T(3, 4, dtype="int16"), axis=0) == T(3, 4, dtype="int16")
    assert infer1("argsort", T(3, 4), descending=True) == T(3, 4, dtype="int64")
    assert infer_types("topk", [T(3, 8)], {"k": 2}) == (T(3, 2), T(3, 2, dtype="int64"))
    assert infer_types("topk", [T(3, 8)], {"k": 0, "axis": 0}) == (T(0, 8), T(0, 8, dtype="int64"))
    with pytest.raises(ProgramError, match=r"topk: k=9 is out of range for axis 1 of size 8 \(0..8\)"):
        infer_types("topk", [T(3, 8)], {"k": 9})
    with pytest.raises(ShapeError, match="sort: operand 0 is 0-d"):
        infer1("sort", T())
    with pytest.raises(ShapeError, match="argsort: axis 1 is out of range"):
        infer1("argsort", T(3), axis=1)


NAN = np.nan


@pytest.mark.parametrize("values, descending, order", [
    ([3, 1, 2, 1, 3], False, [1, 3, 2, 0, 4]),
    ([3, 1, 2, 1, 3], True, [0, 4, 2, 1, 3]),   # ties keep input order when descending too
    ([NAN, 1, NAN, -1], False, [3, 1, 0, 2]),  # nan last ascending, in input order
    ([NAN, 1, NAN, -1], True, [0, 2, 1, 3]),   # nan first descending, in input order
    ([0.0, -0.0, 0.0], True, [0, 1, 2]),       # -0.0 == 0.0: a tie
])
def test_reference_sort_order(values, descending, order):
    x = np.array(values, dtype=np.float32)
    (idx,) = OPS["argsort"].reference(x, descending=descending)
    np.testing.assert_array_equal(idx, order)
    (vals,) = OPS["sort"].reference(x, descending=descending)
    np.testing.assert_array_equal(vals, x[order])


def test_reference_topk():
    x = np.array([[1, 5, 5, NAN, 2], [4, 4, 4, 4, 4]], dtype=np.float32)
    vals, idx = OPS["topk"].reference(x, k=3)
    np.testing.assert_array_equal(idx, [[3, 1, 2], [0, 1, 2]])
    np.testing.assert_array_equal(vals, [[NAN, 5, 5], [4, 4, 4]])
    vals, idx = OPS["topk"].reference(x, k=2, largest=False)
    np.testing.assert_array_equal(idx, [[0, 4], [0, 1]])
    _, idx = OPS["topk"].reference(x, k=3, sorted=False)
    np.testing.assert_array_equal(idx, [[1, 2, 3], [0, 1, 2]])  # index order
    vals, idx = OPS["topk"].reference(x.T, k=1, axis=0)
    np.testing.assert_array_equal(idx, [[3, 0]])


# --------------------------------------------------------------------------------- references

def test_reference_spot_values():
    """A few hand-computed values, so the oracle itself is checked."""
    x = np.array([-1.0, 0.5, 2.0], dtype=np.float32)
    np.testing.assert_allclose(OPS["erf"].reference(x)[0], [math.erf(v) for v in x], rtol=1e-7)
    np.testing.assert_allclose(OPS["sigmoid"].reference(np.array([0.0, -1000.0], np.float32))[0], [0.5, 0.0])
    gelu_exact = [0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.tolist()]
    np.testing.assert_allclose(OPS["gelu"].reference(x)[0], gelu_exact, rtol=1e-6)
    np.testing.assert_allclose(OPS["gelu"].reference(x, approximate="tanh")[0], gelu_exact, rtol=2e-3)
    (y,) = OPS["softmax"].reference(np.array([[1.0, 1.0], [0.0, math.log(3)]], np.float32))
    np.testing.assert_allclose(y, [[0.5, 0.5], [0.25, 0.75]], rtol=1e-6)
    (y,) = OPS["layer_norm"].reference(np.array([[1.0, 3.0]], np.float32), np.array([2.0, 2.0], np.float32),
                                       np.array([1.0, 0.0], np.float32), epsilon=0.0)
    np.testing.assert_allclose(y, [[-1.0, 2.0]], rtol=1e-6)
    (y,) = OPS["gemm"].reference(np.eye(2, dtype=np.float32), np.full((2, 2), 2, np.float32),
                                 np.ones(2, np.float32), alpha=0.5, beta=3.0)
    np.testing.assert_allclose(y, [[4.0, 4.0], [4.0, 4.0]])
    (y,) = OPS["reduce_sum"].reference(np.array([100, 100], np.int8))
    assert y.dtype == np.int8 and y == np.int8(-56)  # wraps like the operand type
    (y,) = OPS["gather"].reference(np.arange(5.0), np.array([[-1, 0]], np.int32))
    np.testing.assert_array_equal(y, [[4.0, 0.0]])
    (y,) = OPS["cast"].reference(np.array([1.7, -1.7], np.float32), dtype="int32")
    np.testing.assert_array_equal(y, [1, -1])
