"""HIP failures as polyhal errors, through one helper: :func:`check`.

Every call into ROCm goes through the runtime facade (:mod:`polyhal_hip.runtime`), which hands
the ``hipError_t`` status to :func:`check`. A non-zero status becomes a :class:`HipError` (or a
subclass) whose message names the call, what polyhal was doing, the status's name and number,
and what to do next, e.g.::

    hipMalloc(4096 bytes) on hip:0 failed: hipErrorInvalidDevice (101): the device ordinal is
    not valid; check HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES and `polyhal devices`

Out of memory (``hipErrorOutOfMemory``) becomes :class:`HipOutOfMemory`, a builtin
``MemoryError`` (so the core's allocator turns it into :class:`polyhal.OutOfMemoryError` with
the device's usage). A runtime library that lacks a function the bindings call (a ROCm runtime
older than the bindings) is :class:`HipSymbolNotFound`; a missing runtime library is
:class:`HipRuntimeMissing`; a kernel that does not compile is :class:`HipCompileError` with the
compiler's log.
"""

from __future__ import annotations

from polyhal.errors import KernelNotFoundError, PluginError, PolyhalError

#: hipError_t names (the values are the same in ROCm 5.x and 6.x for every code listed here).
ERROR_NAMES: dict[int, str] = {
    0: "hipSuccess", 1: "hipErrorInvalidValue", 2: "hipErrorOutOfMemory", 3: "hipErrorNotInitialized",
    4: "hipErrorDeinitialized", 9: "hipErrorInvalidConfiguration", 17: "hipErrorInvalidDevicePointer",
    21: "hipErrorInvalidMemcpyDirection", 35: "hipErrorInsufficientDriver", 98: "hipErrorInvalidDeviceFunction",
    100: "hipErrorNoDevice", 101: "hipErrorInvalidDevice", 200: "hipErrorInvalidImage",
    201: "hipErrorInvalidContext", 209: "hipErrorNoBinaryForGpu", 218: "hipErrorInvalidKernelFile",
    300: "hipErrorInvalidSource", 301: "hipErrorFileNotFound", 302: "hipErrorSharedObjectSymbolNotFound",
    400: "hipErrorInvalidHandle", 500: "hipErrorNotFound", 600: "hipErrorNotReady", 700: "hipErrorIllegalAddress",
    701: "hipErrorLaunchOutOfResources", 702: "hipErrorLaunchTimeOut", 712: "hipErrorHostMemoryAlreadyRegistered",
    713: "hipErrorHostMemoryNotRegistered", 719: "hipErrorLaunchFailure", 801: "hipErrorNotSupported",
    999: "hipErrorUnknown",
}

#: What a user can do about a status (shown after the status name).
_ADVICE: dict[int, str] = {
    1: "an argument was rejected; this is a polyhal-hip bug unless you passed a raw pointer or stream",
    2: "free buffers (Buffer.release) or use a smaller problem",
    3: "the HIP runtime could not initialise; check that the amdgpu kernel driver is loaded (/dev/kfd)",
    35: "the amdgpu driver is older than the ROCm runtime; update the driver or use an older ROCm",
    98: "the kernel is not in the loaded code object; it was compiled for another architecture or name",
    100: "no AMD GPU is visible: check `rocminfo`, /dev/kfd permissions (video/render groups), "
         "HIP_VISIBLE_DEVICES and ROCR_VISIBLE_DEVICES",
    101: "the device ordinal is not valid (no GPU, or HIP_VISIBLE_DEVICES hides it); see `polyhal devices`",
    200: "the code object is not valid for this GPU; clear the kernel cache (POLYHAL_HIP_CACHE_DIR)",
    209: "the code object has no code for this GPU's architecture",
    700: "a kernel read or wrote outside its buffers; the stream is unusable, restart the process",
    701: "the launch asks for more registers or shared memory than the GPU has; use a smaller block",
    712: "this host memory is already registered with HIP",
    713: "this host memory is not registered with HIP",
    801: "the device or runtime does not support this (e.g. stream-ordered pools, managed memory)",
}

OUT_OF_MEMORY = 2
NO_DEVICE = 100
INVALID_DEVICE = 101


def error_name(status: int) -> str:
    """``'hipErrorNoDevice'`` for 100; ``'hipError<n>'`` for codes this table does not know."""
    return ERROR_NAMES.get(int(status), f"hipError{int(status)}")


class HipError(PolyhalError, RuntimeError):
    """A HIP runtime call failed. ``status`` is the ``hipError_t`` value (None when the call never
    reached the runtime), ``call`` the HIP function's name."""

    def __init__(self, message: str, *, status: int | None = None, call: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.call = call

    @property
    def status_name(self) -> str:
        return error_name(self.status) if self.status is not None else ""


class HipOutOfMemory(HipError, MemoryError):
    """``hipErrorOutOfMemory``: a builtin MemoryError, so allocators report it as out of memory."""


class HipNoDevice(HipError):
    """``hipErrorNoDevice`` / ``hipErrorInvalidDevice``: no such GPU."""


class HipUnavailable(HipError, PluginError):
    """The HIP runtime cannot be used at all (bindings or library missing, version mismatch)."""


class HipRuntimeMissing(HipUnavailable):
    """The ROCm runtime library (``libamdhip64.so``) or its bindings could not be loaded."""


class HipSymbolNotFound(HipUnavailable):
    """The runtime library lacks a function the bindings call: the runtime is older (or newer)
    than the bindings were made for. ``symbol`` is the missing function."""

    def __init__(self, message: str, *, symbol: str, call: str = "") -> None:
        super().__init__(message, call=call or symbol)
        self.symbol = symbol


class HipVersionMismatch(HipUnavailable):
    """The bindings were made for another major ROCm version than the runtime library's."""


class HipCompileError(KernelNotFoundError):
    """hiprtc could not compile a kernel; ``log`` is the compiler's log. To the core, a kernel that
    cannot be built is a kernel the device does not have."""

    def __init__(self, message: str, *, log: str = "", arch: str = "") -> None:
        super().__init__(message)
        self.log = log
        self.arch = arch


def check(status: int, call: str, what: str = "") -> None:
    """Raise the :class:`HipError` for a non-zero ``hipError_t`` ``status`` of ``call``.

    ``what`` says what polyhal was doing (``"allocating 4096 bytes on hip:0"``); it leads the
    message. The one place where HIP statuses become exceptions: the runtime facade calls it
    after every HIP call, and so does the fake runtime of the tests.
    """
    status = int(status)
    if status == 0:
        return
    name = error_name(status)
    advice = _ADVICE.get(status, "")
    head = f"{what}: " if what else ""
    message = f"{head}{call} failed: {name} ({status})" + (f": {advice}" if advice else "")
    cls = HipError
    if status == OUT_OF_MEMORY:
        cls = HipOutOfMemory
    elif status in (NO_DEVICE, INVALID_DEVICE):
        cls = HipNoDevice
    raise cls(message, status=status, call=call)
