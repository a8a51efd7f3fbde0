"""OpenCL status codes become polyhal errors that name the status."""

from __future__ import annotations

import pyopencl as cl
import pytest

import polyhal
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
