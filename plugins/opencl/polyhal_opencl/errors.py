"""OpenCL status codes as polyhal errors.

Every pyopencl call that can fail goes through :func:`check` (a context manager) or
:func:`translate`, so a user sees a polyhal error that names the OpenCL status (``CL_...``), the
call that failed and what to do, never a bare ``pyopencl._cl.RuntimeError``.

Which polyhal error a status becomes:

=====================================================  =========================================
``CL_MEM_OBJECT_ALLOCATION_FAILURE``,                  :class:`polyhal.OutOfMemoryError` (and a
``CL_OUT_OF_RESOURCES``, ``CL_OUT_OF_HOST_MEMORY``      builtin ``MemoryError`` inside the
                                                       allocator, which the core turns into
                                                       ``OutOfMemoryError`` with its statistics)
``CL_INVALID_BUFFER_SIZE``                             :class:`polyhal.IncompatibleBufferError`
``CL_MAP_FAILURE``                                     :class:`polyhal.MappingError`
``CL_BUILD_PROGRAM_FAILURE`` (program builds)          :class:`CLBuildError` with the build log
anything else                                          :class:`OpenCLError`
=====================================================  =========================================
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import polyhal
from polyhal.errors import IncompatibleBufferError, MappingError, OutOfMemoryError, PolyhalError

# pyopencl is imported inside the functions that use it: without pyopencl the plugin still imports,
# lists no device and says why (plugin.enumerate_devices).

#: Status codes that mean "no memory" (device or host).
OUT_OF_MEMORY_CODES = frozenset({-4, -5, -6})  # MEM_OBJECT_ALLOCATION_FAILURE, OUT_OF_RESOURCES, OUT_OF_HOST_MEMORY
INVALID_BUFFER_SIZE = -61
MAP_FAILURE = -12
BUILD_PROGRAM_FAILURE = -11


class OpenCLError(PolyhalError, RuntimeError):
    """An OpenCL call failed with a status polyhal has no more specific error for.

    ``code`` is the status (negative int), ``status`` its name (``"CL_INVALID_VALUE"``) and
    ``routine`` the OpenCL function that returned it (``"clEnqueueNDRangeKernel"``).
    """

    def __init__(self, message: str, *, code: int = 0, status: str = "", routine: str = "") -> None:
        super().__init__(message)
        self.code, self.status, self.routine = code, status, routine


class CLBuildError(polyhal.KernelNotFoundError):
    """An OpenCL program failed to build: carries the compiler's full log, the options and the
    source, so that a kernel generator bug can be diagnosed from the exception alone.

    It derives from :class:`polyhal.KernelNotFoundError` because, to the core, a kernel that
    cannot be built is a kernel the device does not have.
    """

    def __init__(self, message: str, *, log: str, options: str, source: str, device: str) -> None:
        super().__init__(message)
        self.log, self.options, self.source, self.device = log, options, source, device


def status_name(code: int) -> str:
    """``-4`` -> ``"CL_MEM_OBJECT_ALLOCATION_FAILURE"`` (``"CL_STATUS_<code>"`` if unknown)."""
    import pyopencl as cl

    try:
        return "CL_" + cl.status_code.to_string(code)
    except Exception:  # noqa: BLE001 - an unknown (vendor) code has no name
        return f"CL_STATUS_{code}"


def translate(exc: BaseException, what: str, *, builtin_memory_error: bool = False) -> BaseException:
    """The polyhal error for pyopencl error ``exc`` raised while doing ``what`` (e.g.
    ``"allocating 4096 bytes on opencl:0"``). Anything that is not a pyopencl error is returned
    unchanged. With ``builtin_memory_error`` an out-of-memory status becomes a plain
    ``MemoryError`` (what :meth:`polyhal.Allocator._allocate` must raise)."""
    import pyopencl as cl

    if not isinstance(exc, cl.Error):
        return exc
    code = int(getattr(exc, "code", 0) or 0)
    routine = str(getattr(exc, "routine", "") or "")
    name = status_name(code)
    where = f" in {routine}" if routine else ""
    if code in OUT_OF_MEMORY_CODES:
        msg = f"{what}: {name}{where}; the OpenCL device ran out of memory or resources"
        return MemoryError(msg) if builtin_memory_error else OutOfMemoryError(
            msg + ". Free buffers (Buffer.release, CLAllocator.trim) or use a smaller problem")
    if code == INVALID_BUFFER_SIZE:
        return IncompatibleBufferError(
            f"{what}: {name}{where}; the size is 0 or above the device's CL_DEVICE_MAX_MEM_ALLOC_SIZE")
    if code == MAP_FAILURE:
        return MappingError(f"{what}: {name}{where}; the OpenCL driver could not map the buffer")
    return OpenCLError(f"{what}: {name}{where}: {exc}", code=code, status=name, routine=routine)


@contextlib.contextmanager
def check(what: str, *, builtin_memory_error: bool = False) -> Iterator[None]:
    """Run the block; a pyopencl error inside it is re-raised as a polyhal error (see module
    docstring), chained to the original. ``what`` says what was being done, for the message.

    Example::

        with check(f"reading {nbytes} bytes from {device.name}"):
            cl.enqueue_copy(queue, host, buffer)
    """
    try:
        yield
    except Exception as exc:
        new = translate(exc, what, builtin_memory_error=builtin_memory_error)
        if new is exc:
            raise
        raise new from exc
