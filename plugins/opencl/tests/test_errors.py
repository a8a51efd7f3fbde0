"""OpenCL status codes become polyhal errors that name the status."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pytest

import polyhal
from polyhal.errors import ArithmeticDomainError
from polyhal_opencl.errors import OpenCLError, check, status_name, translate


def _cl_error(kind, code: int, routine: str = "clEnqueueNDRangeKernel"):
    return kind(cl._cl._ErrorRecord(msg="driver says no", code=code, routine=routine))


@pytest.mark.parametrize("code, expected, name", [
    (-4, polyhal.OutOfMemoryError, "CL_MEM_OBJECT_ALLOCATION_FAILURE"),
    (-5, polyhal.OutOfMemoryError, "CL_OUT_OF_RESOURCES"),
    (-6, polyhal.OutOfMemoryError, "CL_OUT_OF_HOST_MEMORY"),
    (-61, polyhal.IncompatibleBufferError, "CL_INVALID_BUFFER_SIZE"),
    (-12, polyhal.MappingError, "CL_MAP_FAILURE"),
    (-30, OpenCLError, "CL_INVALID_VALUE"),
])
def test_status_codes_translate(code, expected, name):
    err = translate(_cl_error(cl.RuntimeError, code), "doing work on opencl:0")
    assert type(err) is expected
    assert name in str(err) and "doing work on opencl:0" in str(err) and "clEnqueueNDRangeKernel" in str(err)
    assert isinstance(err, polyhal.PolyhalError)


def test_out_of_memory_inside_the_allocator_is_a_builtin_memory_error():
    # The core's Allocator.allocate turns MemoryError into OutOfMemoryError with its statistics.
    err = translate(_cl_error(cl.MemoryError, -4, "clCreateBuffer"), "allocating", builtin_memory_error=True)
    assert type(err) is MemoryError and "CL_MEM_OBJECT_ALLOCATION_FAILURE" in str(err)


def test_opencl_error_carries_the_status():
    err = translate(_cl_error(cl.LogicError, -30), "setting up")
    assert (err.code, err.status, err.routine) == (-30, "CL_INVALID_VALUE", "clEnqueueNDRangeKernel")


def test_check_chains_and_passes_other_errors_through():
    with pytest.raises(polyhal.OutOfMemoryError) as info:
        with check("running add on opencl:0"):
            raise _cl_error(cl.MemoryError, -4)
    assert isinstance(info.value.__cause__, cl.Error)
    with pytest.raises(KeyError):
        with check("anything"):
            raise KeyError("not OpenCL")


def test_unknown_status_has_a_name():
    assert status_name(-9999) == "CL_STATUS_-9999"


@pytest.mark.parametrize("shape", [(5,), (3, 4)], ids=["contiguous", "broadcast"])
def test_integer_division_by_zero_raises_through_the_kernels_error_flag(dev, shape):
    """ONNX's integer Div is a float division and a strict cast: nan/inf set the kernel's error
    flag, the step after the launch raises what the CPU raises, and the next call starts clean."""
    from onnx import TensorProto, helper

    import polyhal.onnx as ponnx

    b_shape = shape if len(shape) == 1 else (1, shape[1])  # broadcast: the strided kernel
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Div", ["a", "b"], ["y"])], "div",
        [helper.make_tensor_value_info("a", TensorProto.INT64, list(shape)),
         helper.make_tensor_value_info("b", TensorProto.INT64, list(b_shape))],
        [helper.make_tensor_value_info("y", TensorProto.INT64, list(shape))]),
        opset_imports=[helper.make_opsetid("", 17)])
    plan = ponnx.load(model).compile(dev.name)
    a = np.arange(-7, -7 + int(np.prod(shape)), dtype=np.int64).reshape(shape)
    ones = np.full(b_shape, 2, np.int64)
    np.testing.assert_array_equal(np.asarray(plan(a=a, b=ones)), np.trunc(a / 2).astype(np.int64))
    zero = ones.copy()
    zero.reshape(-1)[-1] = 0
    with pytest.raises(ArithmeticDomainError, match=f"division by zero.*on {dev.name}"):
        plan(a=a, b=zero)
    np.testing.assert_array_equal(np.asarray(plan(a=a, b=ones)), np.trunc(a / 2).astype(np.int64))


def test_a_storage_type_reaches_only_the_ops_that_convert_and_move_it(dev):
    """Moves (transpose, pad with a nonzero constant, gather, where) run on the bits and give
    exactly numpy's result; an op that compares or computes with the values is refused, saying
    what to do."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((3, 4)).astype(bf16)
    cond = rng.random((4, 3)) < 0.5
    b = polyhal.ProgramBuilder("bf16")
    x, c = b.input("x", (3, 4), bf16), b.input("c", (4, 3), np.bool_)
    t = b.op("transpose", x)
    p = b.op("pad", x, pads=[1, 0, 0, 2], value=1.5)
    g = b.op("gather", x, b.constant(np.array([2, 0], np.int64)), axis=0)
    w = b.op("where", c, t, b.constant(np.full((4, 3), -2.0, bf16)))
    b.output(t, p, g, w)
    got = [r.numpy() for r in polyhal.compile(b.build(), dev.name)(xs, cond)]
    want = [xs.T, np.pad(xs, ((1, 0), (0, 2)), constant_values=bf16(1.5)), xs[[2, 0]],
            np.where(cond, xs.T, bf16(-2.0))]
    for g_, w_ in zip(got, want):
        assert g_.dtype == bf16
        np.testing.assert_array_equal(g_.view(np.uint16), w_.view(np.uint16))
    b = polyhal.ProgramBuilder("bf16 sort")
    x = b.input("x", (2, 3), bf16)
    b.output(b.sort(x, axis=1))  # compares values: not a move
    with pytest.raises(polyhal.KernelNotFoundError,
                       match=r"sort.? on bfloat16 .*cast to float32 first"):
        polyhal.compile(b.build(), dev.name)
