"""CUDA failures as polyhal errors.

cupy raises its own exception types (``CUDARuntimeError``, ``CUDADriverError``, its
``OutOfMemoryError``, NVRTC's ``CompileException``, cuBLAS errors). :func:`check` turns them
into polyhal errors that say what polyhal was doing (which kernel, on which device, with which
launch shape), so that a user sees ``KernelLaunchError: launching radix_scatter<...> on cuda:0
(grid (4096, 1, 1), block (2048, 1, 1), 0 B shared): CUDA_ERROR_INVALID_VALUE`` instead of a
bare driver status. Out-of-memory statuses become ``MemoryError`` inside allocators (the core
then adds device, request and use) and :class:`polyhal.OutOfMemoryError` elsewhere.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from polyhal.errors import KernelNotFoundError, OutOfMemoryError, PolyhalError

#: cudaErrorMemoryAllocation (runtime) and CUDA_ERROR_OUT_OF_MEMORY (driver) are both 2.
OUT_OF_MEMORY_STATUS = 2


class CUDAError(PolyhalError, RuntimeError):
    """A CUDA runtime or driver call failed; ``status`` is the CUDA status code (or None)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KernelLaunchError(CUDAError):
    """A kernel could not be launched, or failed: the message names the kernel and its launch
    shape. ``kernel`` is the kernel's name."""

    def __init__(self, message: str, *, kernel: str, status: int | None = None) -> None:
        super().__init__(message, status=status)
        self.kernel = kernel


class KernelCompileError(KernelNotFoundError):
    """NVRTC could not compile a kernel: carries the compiler log. To the core, a kernel that
    cannot be built is a kernel the device does not have."""

    def __init__(self, message: str, *, log: str = "") -> None:
        super().__init__(message)
        self.log = log


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return int(status) if isinstance(status, int) else None


def is_cuda_error(exc: BaseException) -> bool:
    """True for the exception types cupy raises for CUDA, NVRTC and CUDA-library failures."""
    mod = type(exc).__module__ or ""
    return mod.startswith(("cupy", "cupy_backends")) or type(exc).__name__ in (
        "CUDARuntimeError", "CUDADriverError", "CompileException", "CUBLASError")


def translate(exc: BaseException, what: str, *, kernel: str | None = None,
              builtin_memory_error: bool = False) -> BaseException:
    """The polyhal error for cupy exception ``exc`` raised while doing ``what``; anything else
    (including polyhal's own errors) is returned unchanged."""
    if isinstance(exc, PolyhalError) or not (is_cuda_error(exc) or isinstance(exc, MemoryError)):
        return exc
    status = _status(exc)
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, MemoryError) or status == OUT_OF_MEMORY_STATUS:
        msg = f"{what}: {text}"
        if builtin_memory_error:
            return MemoryError(msg)
        return OutOfMemoryError(msg + ". Free buffers (Buffer.release) or use a smaller problem")
    if type(exc).__name__ == "CompileException":
        log = getattr(exc, "get_message", lambda: text)()
        return KernelCompileError(f"{what}: NVRTC failed to compile the kernel; this is a polyhal-cuda "
                                  f"bug, please report it with the log:\n{log}", log=log)
    if kernel is not None:
        return KernelLaunchError(f"{what}: {text}", kernel=kernel, status=status)
    return CUDAError(f"{what}: {text}", status=status)


@contextlib.contextmanager
def check(what: str, *, kernel: str | None = None, builtin_memory_error: bool = False) -> Iterator[None]:
    """Run the block; a CUDA failure inside it is re-raised as a polyhal error (chained).

    Example::

        with check(f"copying {n} bytes to {device.name}"):
            runtime.memcpyAsync(dst, src, n, kind, stream.ptr)
    """
    try:
        yield
    except Exception as exc:
        new = translate(exc, what, kernel=kernel, builtin_memory_error=builtin_memory_error)
        if new is exc:
            raise
        raise new from exc
