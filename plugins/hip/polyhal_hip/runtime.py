"""The one place polyhal-hip calls ROCm: a small facade over AMD's Python bindings.

Everything else in the plugin talks to a :class:`Runtime` -- plain ints for device and host
addresses, opaque handles for streams, events, pools, modules and functions, and exceptions
(:mod:`polyhal_hip.errors`) instead of status codes -- so it does not care which bindings are
installed:

* ``hip-python`` (``from hip import hip, hiprtc``; versions 6.x, made for ROCm 6.x), or
* its successor ``rocm.bindings`` (``from rocm.bindings import hip, hiprtc``; untested here).

The bindings are imported lazily, on the first call of :func:`get_runtime`, never at plugin
import, so ``pip install polyhal-hip`` works on machines without ROCm. Tests replace the
runtime with a stand-in (:func:`set_runtime`; ``plugins/hip/tests/fake_runtime.py``).

Versions. HIP keeps its ABI within a major version only (ROCm 6 changed ``hipDeviceProp_t``,
``hipPointerAttribute_t`` and the ``hipMemoryType`` values), so :meth:`HipPythonRuntime.match`
accepts bindings whose major version is the runtime library's; otherwise devices are not
registered and ``polyhal devices`` says which versions met. Calls that need a symbol the
library lacks raise :class:`~polyhal_hip.errors.HipSymbolNotFound` naming it.

Two traps of old runtimes handled here: ROCm 5.x has no ``libhiprtc.so`` (hiprtc lives inside
``libamdhip64.so``), so the bindings' hiprtc module is pointed at the runtime library; and
hip-python exposes ``hipHostMallocNonCoherent`` (``0x80000000``) as a negative int, which
:func:`flag` masks to 32 bits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from polyhal.distribution import install_hint
from polyhal_hip.errors import (
    HipCompileError, HipError, HipRuntimeMissing, HipSymbolNotFound, HipVersionMismatch, check,
)

__all__ = [
    "CompileResult", "DeviceProperties", "HipPythonRuntime", "Runtime", "flag", "get_runtime",
    "load_bindings", "reset_runtime", "set_runtime", "version_tuple",
]

# hipHostMalloc flags (hip_runtime_api.h; the same in ROCm 5 and 6)
HOST_MALLOC_PORTABLE = 0x1
HOST_MALLOC_MAPPED = 0x2
HOST_MALLOC_WRITE_COMBINED = 0x4
HOST_MALLOC_COHERENT = 0x40000000
HOST_MALLOC_NON_COHERENT = 0x80000000
# hipHostRegister flags
HOST_REGISTER_PORTABLE = 0x1
HOST_REGISTER_MAPPED = 0x2
# hipMallocManaged flag
MEM_ATTACH_GLOBAL = 0x1
# hipMemcpyKind
MEMCPY_HOST_TO_HOST, MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_DEVICE_TO_DEVICE, MEMCPY_DEFAULT = 0, 1, 2, 3, 4
# hipError_t values the facade treats as answers, not failures
NOT_READY, PEER_ACCESS_ALREADY_ENABLED = 600, 704
# hipStreamCreateWithFlags / hipEventCreateWithFlags
STREAM_DEFAULT, STREAM_NON_BLOCKING = 0, 1
EVENT_DISABLE_TIMING = 0x2
# hipModuleLaunchKernel's "extra" markers
LAUNCH_PARAM_BUFFER_POINTER, LAUNCH_PARAM_BUFFER_SIZE, LAUNCH_PARAM_END = 1, 2, 3


def flag(value: Any) -> int:
    """A HIP flag as the unsigned 32-bit int the C API takes (hip-python gives
    ``hipHostMallocNonCoherent`` as ``-2147483648``)."""
    return int(value) & 0xFFFFFFFF


def version_tuple(hip_version: int) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a ``HIP_VERSION`` number (``50221153`` -> ``(5, 2, 21153)``)."""
    v = int(hip_version)
    return (v // 10_000_000, (v // 100_000) % 100, v % 100_000)


@dataclass(frozen=True)
class DeviceProperties:
    """What enumeration needs to know about one GPU (a subset of ``hipDeviceProp_t`` plus
    attributes), as plain Python values."""

    ordinal: int
    name: str
    arch: str                       # gcnArchName, e.g. "gfx90a:sramecc+:xnack-"
    total_memory: int
    multiprocessors: int = 1
    warp_size: int = 64
    max_threads_per_block: int = 1024
    shared_mem_per_block: int = 65536
    l2_cache_bytes: int = 0
    clock_khz: int = 0
    memory_clock_khz: int = 0
    memory_bus_width: int = 0
    managed_memory: bool = False
    concurrent_managed_access: bool = False
    can_map_host_memory: bool = True
    integrated: bool = False
    memory_pools: bool = False      # hipDeviceAttributeMemoryPoolsSupported
    pci_bus_id: str = ""

    @property
    def base_arch(self) -> str:
        """The architecture without target features: ``"gfx90a"``."""
        return self.arch.split(":", 1)[0]


@dataclass
class CompileResult:
    """A compiled code object: ``code`` (an AMDGPU ELF or offload bundle), the lowered (mangled)
    name of every name expression, and the compiler's log (warnings)."""

    code: bytes
    lowered: dict[str, str] = field(default_factory=dict)
    log: str = ""


class Runtime:
    """The facade's interface: every HIP call polyhal-hip makes. Methods raise
    :class:`~polyhal_hip.errors.HipError` subclasses, never return a status."""

    #: Shown by ``polyhal devices`` and the selftest report.
    description = "abstract HIP runtime"
    #: True for the stand-in of the tests (devices say so in their description).
    is_fake = False

    # versions and devices
    def runtime_version(self) -> int: raise NotImplementedError
    def driver_version(self) -> int: raise NotImplementedError
    def bindings_version(self) -> tuple[int, int]: raise NotImplementedError
    def match(self) -> None:
        """Raise HipVersionMismatch when bindings and runtime library cannot work together."""
    def device_count(self) -> int: raise NotImplementedError
    def device_properties(self, ordinal: int) -> DeviceProperties: raise NotImplementedError
    def set_device(self, ordinal: int) -> None: raise NotImplementedError
    def get_device(self) -> int: raise NotImplementedError
    def mem_get_info(self) -> tuple[int, int]: raise NotImplementedError
    # memory
    def malloc(self, nbytes: int) -> int: raise NotImplementedError
    def free(self, ptr: int) -> None: raise NotImplementedError
    def malloc_async(self, nbytes: int, stream: Any) -> int: raise NotImplementedError
    def malloc_from_pool_async(self, nbytes: int, pool: Any, stream: Any) -> int: raise NotImplementedError
    def free_async(self, ptr: int, stream: Any) -> None: raise NotImplementedError
    def default_mem_pool(self, ordinal: int) -> Any: raise NotImplementedError
    def mem_pool_trim_to(self, pool: Any, keep: int) -> None: raise NotImplementedError
    def host_malloc(self, nbytes: int, flags: int) -> int: raise NotImplementedError
    def host_free(self, ptr: int) -> None: raise NotImplementedError
    def host_get_device_pointer(self, ptr: int) -> int: raise NotImplementedError
    def host_register(self, ptr: int, nbytes: int, flags: int) -> None: raise NotImplementedError
    def host_unregister(self, ptr: int) -> None: raise NotImplementedError
    def malloc_managed(self, nbytes: int, flags: int = MEM_ATTACH_GLOBAL) -> int: raise NotImplementedError
    def mem_prefetch_async(self, ptr: int, nbytes: int, ordinal: int, stream: Any) -> None: raise NotImplementedError
    def pointer_kind(self, ptr: int) -> tuple[str, int]:
        """``(kind, device)``: kind is "device", "host", "managed" or "unregistered"."""
        raise NotImplementedError
    # copies
    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None: raise NotImplementedError
    def memset_async(self, ptr: int, value: int, nbytes: int, stream: Any) -> None: raise NotImplementedError
    # streams and events
    def stream_create(self, flags: int = STREAM_DEFAULT) -> Any: raise NotImplementedError
    def stream_destroy(self, stream: Any) -> None: raise NotImplementedError
    def stream_synchronize(self, stream: Any) -> None: raise NotImplementedError
    def stream_wait_event(self, stream: Any, event: Any) -> None: raise NotImplementedError
    def event_create(self, flags: int = EVENT_DISABLE_TIMING) -> Any: raise NotImplementedError
    def event_record(self, event: Any, stream: Any) -> None: raise NotImplementedError
    def event_synchronize(self, event: Any) -> None: raise NotImplementedError
    def event_query(self, event: Any) -> bool:
        """Whether the work before the event has completed (hipEventQuery: hipSuccess, or
        hipErrorNotReady for False); other statuses raise."""
        raise NotImplementedError
    def event_destroy(self, event: Any) -> None: raise NotImplementedError
    # peers (two GPUs of one host)
    def device_can_access_peer(self, ordinal: int, peer: int) -> bool: raise NotImplementedError
    def device_enable_peer_access(self, peer: int) -> None:
        """Let the current device read ``peer``'s memory (hipErrorPeerAccessAlreadyEnabled is no error)."""
        raise NotImplementedError
    def memcpy_peer_async(self, dst: int, dst_ordinal: int, src: int, src_ordinal: int, nbytes: int,
                          stream: Any) -> None: raise NotImplementedError
    def handle(self, obj: Any) -> int:
        """The address of an opaque handle (a stream's ``hipStream_t``), as an int."""
        raise NotImplementedError
    # code
    def module_load_data(self, image: bytes) -> Any: raise NotImplementedError
    def module_get_function(self, module: Any, name: str) -> Any: raise NotImplementedError
    def module_unload(self, module: Any) -> None: raise NotImplementedError
    def launch(self, function: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
               stream: Any, args: bytes) -> None:
        """Launch with the kernel arguments packed into ``args`` (:mod:`polyhal_hip.launch`)."""
        raise NotImplementedError
    def compile(self, source: str, name: str, options: Sequence[str],
                expressions: Sequence[str] = ()) -> CompileResult:
        """hiprtc: compile ``source``; raise :class:`~polyhal_hip.errors.HipCompileError` with the log."""
        raise NotImplementedError
    def compiler_version(self) -> tuple[int, int]: raise NotImplementedError


def load_bindings() -> tuple[Any, Any, str]:
    """``(hip module, hiprtc module, which)`` of the installed bindings; raises
    :class:`~polyhal_hip.errors.HipRuntimeMissing` (with how to install them) when there are none."""
    errors = []
    try:
        from hip import hip, hiprtc  # hip-python
        return hip, hiprtc, "hip-python"
    except ImportError as exc:
        errors.append(f"hip-python: {exc}")
    try:
        from rocm.bindings import hip, hiprtc  # type: ignore[no-redef]  # the successor
        return hip, hiprtc, "rocm.bindings"
    except ImportError as exc:
        errors.append(f"rocm.bindings: {exc}")
    raise HipRuntimeMissing(
        "no Python bindings for HIP are installed (" + "; ".join(errors) + "); install AMD's hip-python "
        f"matching your ROCm major version: {install_hint('polyhal-hip', 'rocm6')} (hip-python 6.x for ROCm 6.x)")


def _bindings_version(which: str, hip_mod: Any) -> tuple[int, int]:
    import importlib
    import importlib.metadata

    if which == "hip-python":
        pkg = importlib.import_module("hip")
        rocm = getattr(pkg, "ROCM_VERSION_TUPLE", None) or getattr(pkg, "HIP_VERSION_TUPLE", None)
        if rocm:
            return int(rocm[0]), int(rocm[1])
        dist = "hip-python"
    else:
        dist = "rocm-bindings-hip"
    parts = importlib.metadata.version(dist).split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


class HipPythonRuntime(Runtime):
    """The real runtime: AMD's bindings over ``libamdhip64.so``."""

    def __init__(self) -> None:
        self._hip, self._rtc, self.which = load_bindings()
        self._rtc_ready = False
        self._rtc_lock = threading.Lock()
        self.description = f"ROCm HIP runtime through {self.which}"

    # -- calling ---------------------------------------------------------------------------------

    def call(self, name: str, *args: Any, what: str = "") -> Any:
        """Call HIP function ``name``; return its outputs (one value, a tuple, or None) and raise
        the mapped error for a non-success status (:func:`polyhal_hip.errors.check`)."""
        fn = getattr(self._hip, name, None)
        if fn is None:
            raise HipSymbolNotFound(f"the {self.which} bindings have no function {name}; upgrade them",
                                    symbol=name)
        try:
            out = fn(*args)
        except RuntimeError as exc:
            raise self._loader_error(exc, name) from exc
        status, rest = out[0], out[1:]
        check(int(status), name, what)
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else rest

    def _loader_error(self, exc: RuntimeError, name: str) -> Exception:
        text = str(exc)
        if "dlsym" in text:
            try:
                have = ".".join(map(str, version_tuple(self.runtime_version())[:2]))
            except Exception:  # noqa: BLE001
                have = "unknown"
            found = re.search(r"dlsym '(?:b')?([A-Za-z_][A-Za-z0-9_]*)", text)
            symbol = found.group(1) if found else name
            return HipSymbolNotFound(
                f"{name}: the ROCm runtime library (version {have}) has no symbol {symbol}, which the "
                f"{self.which} bindings (made for ROCm {'.'.join(map(str, self.bindings_version()))}) call; the "
                "runtime is older than the bindings: install bindings for your ROCm version, or upgrade ROCm",
                symbol=symbol, call=name)
        if "dlopen" in text:
            return HipRuntimeMissing(
                f"{name}: the ROCm runtime library could not be loaded ({text}); install ROCm "
                "(Debian/Ubuntu: apt-get install libamdhip64-dev) or add its lib directory to LD_LIBRARY_PATH")
        return HipError(f"{name}: {text}", call=name)

    # -- versions and devices ----------------------------------------------------------------------

    def runtime_version(self) -> int:
        return int(self.call("hipRuntimeGetVersion"))

    def driver_version(self) -> int:
        return int(self.call("hipDriverGetVersion"))

    def bindings_version(self) -> tuple[int, int]:
        return _bindings_version(self.which, self._hip)

    def match(self) -> None:
        """Raise :class:`~polyhal_hip.errors.HipVersionMismatch` unless bindings and runtime
        library share the major version (HIP's ABI changes between majors)."""
        have = version_tuple(self.runtime_version())
        want = self.bindings_version()
        if have[0] != want[0]:
            raise HipVersionMismatch(
                f"the {self.which} bindings were made for ROCm {want[0]}.{want[1]}, but the ROCm runtime "
                f"library is version {have[0]}.{have[1]} ({have[2]}); HIP's ABI differs between major "
                f"versions, so no device is used. Install bindings for ROCm {have[0]}.x, or ROCm {want[0]}.x")

    def device_count(self) -> int:
        return int(self.call("hipGetDeviceCount", what="counting AMD GPUs"))

    def _attribute(self, attr_name: str, ordinal: int, default: int = 0) -> int:
        attr = getattr(self._hip.hipDeviceAttribute_t, attr_name, None)
        if attr is None:
            return default
        try:
            return int(self.call("hipDeviceGetAttribute", attr, ordinal))
        except HipError:
            return default

    def device_properties(self, ordinal: int) -> DeviceProperties:
        props = self._hip.hipDeviceProp_t()
        self.call("hipGetDeviceProperties", props, ordinal, what=f"reading the properties of GPU {ordinal}")

        def get(name: str, default: Any = 0) -> Any:
            try:
                value = getattr(props, name)
            except Exception:  # noqa: BLE001 - a field these bindings do not have
                return default
            if isinstance(value, (bytes, bytearray)):
                return value.split(b"\0", 1)[0].decode(errors="replace")
            if not isinstance(value, (int, float, str)):
                try:
                    return bytes(value).split(b"\0", 1)[0].decode(errors="replace")
                except Exception:  # noqa: BLE001
                    return str(value)
            return value

        return DeviceProperties(
            ordinal=ordinal, name=str(get("name", "")).strip(), arch=str(get("gcnArchName", "")).strip(),
            total_memory=int(get("totalGlobalMem")), multiprocessors=int(get("multiProcessorCount", 1)),
            warp_size=int(get("warpSize", 64)), max_threads_per_block=int(get("maxThreadsPerBlock", 1024)),
            shared_mem_per_block=int(get("sharedMemPerBlock", 65536)), l2_cache_bytes=int(get("l2CacheSize")),
            clock_khz=int(get("clockRate")), memory_clock_khz=int(get("memoryClockRate")),
            memory_bus_width=int(get("memoryBusWidth")), managed_memory=bool(get("managedMemory")),
            concurrent_managed_access=bool(get("concurrentManagedAccess")),
            can_map_host_memory=bool(get("canMapHostMemory", 1)), integrated=bool(get("integrated")),
            memory_pools=bool(self._attribute("hipDeviceAttributeMemoryPoolsSupported", ordinal)),
            pci_bus_id=f"{int(get('pciDomainID')):04x}:{int(get('pciBusID')):02x}:{int(get('pciDeviceID')):02x}",
        )

    def set_device(self, ordinal: int) -> None:
        self.call("hipSetDevice", ordinal)

    def get_device(self) -> int:
        return int(self.call("hipGetDevice"))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self.call("hipMemGetInfo")
        return int(free), int(total)

    # -- memory ------------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        return int(self.call("hipMalloc", nbytes, what=f"allocating {nbytes} bytes of device memory"))

    def free(self, ptr: int) -> None:
        self.call("hipFree", ptr)

    def malloc_async(self, nbytes: int, stream: Any) -> int:
        return int(self.call("hipMallocAsync", nbytes, stream, what=f"allocating {nbytes} bytes stream-ordered"))

    def malloc_from_pool_async(self, nbytes: int, pool: Any, stream: Any) -> int:
        return int(self.call("hipMallocFromPoolAsync", nbytes, pool, stream,
                             what=f"allocating {nbytes} bytes from a stream-ordered pool"))

    def free_async(self, ptr: int, stream: Any) -> None:
        self.call("hipFreeAsync", ptr, stream)

    def default_mem_pool(self, ordinal: int) -> Any:
        return self.call("hipDeviceGetDefaultMemPool", ordinal)

    def mem_pool_trim_to(self, pool: Any, keep: int) -> None:
        self.call("hipMemPoolTrimTo", pool, keep)

    def host_malloc(self, nbytes: int, flags: int) -> int:
        return int(self.call("hipHostMalloc", nbytes, flag(flags), what=f"allocating {nbytes} bytes of pinned host memory"))

    def host_free(self, ptr: int) -> None:
        self.call("hipHostFree", ptr)

    def host_get_device_pointer(self, ptr: int) -> int:
        return int(self.call("hipHostGetDevicePointer", ptr, 0))

    def host_register(self, ptr: int, nbytes: int, flags: int) -> None:
        self.call("hipHostRegister", ptr, nbytes, flag(flags), what=f"registering {nbytes} bytes of host memory")

    def host_unregister(self, ptr: int) -> None:
        self.call("hipHostUnregister", ptr)

    def malloc_managed(self, nbytes: int, flags: int = MEM_ATTACH_GLOBAL) -> int:
        return int(self.call("hipMallocManaged", nbytes, flag(flags), what=f"allocating {nbytes} bytes of managed memory"))

    def mem_prefetch_async(self, ptr: int, nbytes: int, ordinal: int, stream: Any) -> None:
        self.call("hipMemPrefetchAsync", ptr, nbytes, ordinal, stream)

    def pointer_kind(self, ptr: int) -> tuple[str, int]:
        attrs = self._hip.hipPointerAttribute_t()
        try:
            self.call("hipPointerGetAttributes", attrs, ptr)
        except HipError:
            return "unregistered", -1
        names = {int(m): m.name for m in self._hip.hipMemoryType}
        raw = getattr(attrs, "type", None)
        if raw is None:
            raw = getattr(attrs, "memoryType", 0)
        name = names.get(int(raw), "")
        if getattr(attrs, "isManaged", 0) or name.endswith("Managed"):
            kind = "managed"
        elif name.endswith("Device"):
            kind = "device"
        elif name.endswith("Host"):
            kind = "host"
        else:
            kind = "unregistered"
        return kind, int(getattr(attrs, "device", -1))

    # -- copies ------------------------------------------------------------------------------------

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
        self.call("hipMemcpyAsync", dst, src, nbytes, self._hip.hipMemcpyKind(kind), stream,
                  what=f"copying {nbytes} bytes")

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        self.call("hipMemsetAsync", ptr, value, nbytes, stream)

    # -- streams and events ------------------------------------------------------------------------

    def stream_create(self, flags: int = STREAM_DEFAULT) -> Any:
        return self.call("hipStreamCreateWithFlags", flags, what="creating a stream")

    def stream_destroy(self, stream: Any) -> None:
        self.call("hipStreamDestroy", stream)

    def stream_synchronize(self, stream: Any) -> None:
        self.call("hipStreamSynchronize", stream, what="waiting for a stream")

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.call("hipStreamWaitEvent", stream, event, 0)

    def event_create(self, flags: int = EVENT_DISABLE_TIMING) -> Any:
        return self.call("hipEventCreateWithFlags", flags)

    def event_record(self, event: Any, stream: Any) -> None:
        self.call("hipEventRecord", event, stream)

    def event_synchronize(self, event: Any) -> None:
        self.call("hipEventSynchronize", event)

    def event_query(self, event: Any) -> bool:
        status = int(self._hip.hipEventQuery(event)[0])
        if status == NOT_READY:
            return False
        check(status, "hipEventQuery")
        return True

    def event_destroy(self, event: Any) -> None:
        self.call("hipEventDestroy", event)

    # -- peers -------------------------------------------------------------------------------------

    def device_can_access_peer(self, ordinal: int, peer: int) -> bool:
        return bool(self.call("hipDeviceCanAccessPeer", ordinal, peer))

    def device_enable_peer_access(self, peer: int) -> None:
        status = int(self._hip.hipDeviceEnablePeerAccess(peer, 0)[0])
        if status != PEER_ACCESS_ALREADY_ENABLED:
            check(status, "hipDeviceEnablePeerAccess", f"enabling access to hip:{peer}")

    def memcpy_peer_async(self, dst: int, dst_ordinal: int, src: int, src_ordinal: int, nbytes: int,
                          stream: Any) -> None:
        self.call("hipMemcpyPeerAsync", dst, dst_ordinal, src, src_ordinal, nbytes, stream,
                  what=f"copying {nbytes} bytes from hip:{src_ordinal} to hip:{dst_ordinal}")

    def handle(self, obj: Any) -> int:
        return 0 if obj is None else int(obj)

    # -- code --------------------------------------------------------------------------------------

    def module_load_data(self, image: bytes) -> Any:
        return self.call("hipModuleLoadData", bytes(image), what="loading a code object")

    def module_get_function(self, module: Any, name: str) -> Any:
        return self.call("hipModuleGetFunction", module, name.encode(), what=f"finding kernel {name}")

    def module_unload(self, module: Any) -> None:
        self.call("hipModuleUnload", module)

    def launch(self, function: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int,
               stream: Any, args: bytes) -> None:
        buf = ctypes.create_string_buffer(bytes(args), max(len(args), 1))
        size = ctypes.c_size_t(len(args))
        extra = (ctypes.c_void_p * 5)(LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buf), LAUNCH_PARAM_BUFFER_SIZE,
                                      ctypes.addressof(size), LAUNCH_PARAM_END)
        g = (tuple(grid) + (1, 1))[:3]
        b = (tuple(block) + (1, 1))[:3]
        self.call("hipModuleLaunchKernel", function, *g, *b, shared_bytes, stream, None, ctypes.addressof(extra))

    # -- hiprtc ------------------------------------------------------------------------------------

    def _prepare_hiprtc(self) -> None:
        """Make the bindings' hiprtc loadable. ROCm 5.x ships no libhiprtc.so: its hiprtc is
        inside libamdhip64.so, so point hip-python's loader (``hip.chiprtc.DLL``) there."""
        with self._rtc_lock:
            if self._rtc_ready:
                return
            try:
                self._rtc.hiprtcVersion()
                self._rtc_ready = True
                return
            except RuntimeError as exc:
                if "dlopen" not in str(exc):
                    raise
                first = exc
            soname = ctypes.util.find_library("amdhip64") or "libamdhip64.so"
            try:
                lib = ctypes.CDLL(soname)
                lib.hiprtcCreateProgram  # noqa: B018 - present only where hiprtc is bundled
            except (OSError, AttributeError) as exc:
                raise HipRuntimeMissing(
                    f"hiprtc (the HIP runtime compiler) cannot be loaded: {first}; and {soname} does not "
                    f"contain it ({exc}). Install ROCm's hiprtc (apt-get install libamdhip64-dev; ROCm 6+: "
                    "hip-runtime-amd / libhiprtc)") from exc
            try:
                import importlib

                chiprtc = importlib.import_module(f"{self._rtc.__name__.rsplit('.', 1)[0]}.chiprtc")
                chiprtc.DLL = soname.encode()
            except Exception as exc:  # noqa: BLE001
                raise HipRuntimeMissing(
                    f"hiprtc is inside {soname} (ROCm 5.x), but the {self.which} bindings cannot be pointed at it "
                    f"({exc}); put a libhiprtc.so link to {soname} in a private directory on LD_LIBRARY_PATH") from exc
            self._rtc.hiprtcVersion()
            self._rtc_ready = True

    def compiler_version(self) -> tuple[int, int]:
        self._prepare_hiprtc()
        _status, major, minor = self._rtc.hiprtcVersion()
        return int(major), int(minor)

    def _rtc_call(self, name: str, *args: Any) -> Any:
        try:
            out = getattr(self._rtc, name)(*args)
        except RuntimeError as exc:
            raise self._loader_error(exc, name) from exc
        return out

    def compile(self, source: str, name: str, options: Sequence[str],
                expressions: Sequence[str] = ()) -> CompileResult:
        self._prepare_hiprtc()
        rtc = self._rtc
        status, prog = self._rtc_call("hiprtcCreateProgram", source.encode(), name.encode(), 0, [], [])
        if int(status):
            raise HipCompileError(f"hiprtcCreateProgram failed for {name}: status {int(status)}")
        try:
            for e in expressions:
                (status,) = self._rtc_call("hiprtcAddNameExpression", prog, e.encode())
                if int(status):
                    raise HipCompileError(f"hiprtcAddNameExpression({e!r}) failed for {name}: status {int(status)}")
            opts = [o.encode() for o in options]
            (status,) = self._rtc_call("hiprtcCompileProgram", prog, len(opts), opts)
            _s, size = self._rtc_call("hiprtcGetProgramLogSize", prog)
            log_buf = bytearray(max(int(size), 1))
            self._rtc_call("hiprtcGetProgramLog", prog, log_buf)
            log = bytes(log_buf).split(b"\0", 1)[0].decode(errors="replace").strip()
            if int(status):
                arch = next((o.split("=", 1)[1] for o in options if o.startswith("--offload-arch=")), "")
                raise HipCompileError(
                    f"hiprtc could not compile {name} for {arch or 'the default architecture'} "
                    f"(status {int(status)}: {_rtc_error(rtc, status)}); compiler log:\n{log}", log=log, arch=arch)
            lowered = {}
            for e in expressions:
                _s, low = self._rtc_call("hiprtcGetLoweredName", prog, e.encode())
                lowered[e] = low.decode() if isinstance(low, (bytes, bytearray)) else str(low)
            _s, size = self._rtc_call("hiprtcGetCodeSize", prog)
            code = bytearray(int(size))
            self._rtc_call("hiprtcGetCode", prog, code)
            return CompileResult(bytes(code), lowered, log)
        finally:
            # hiprtcDestroyProgram takes a hiprtcProgram*: hip-python wants a reference to the handle
            self._rtc_call("hiprtcDestroyProgram", prog.createRef() if hasattr(prog, "createRef") else prog)


def _rtc_error(rtc: Any, status: Any) -> str:
    try:
        out = rtc.hiprtcGetErrorString(status)
        out = out[-1] if isinstance(out, tuple) else out
        return out.decode() if isinstance(out, (bytes, bytearray)) else str(out)
    except Exception:  # noqa: BLE001
        return "hiprtc error"


_runtime: Runtime | None = None
_lock = threading.Lock()
#: Called after :func:`set_runtime` replaced the runtime (the plugin drops its cached enumeration).
_on_replace: list = []


def get_runtime() -> Runtime:
    """The process-wide runtime (the real one on first use, unless a test set another); raises
    :class:`~polyhal_hip.errors.HipRuntimeMissing` when the bindings are missing."""
    global _runtime
    if _runtime is None:
        with _lock:
            if _runtime is None:
                _runtime = HipPythonRuntime()
    return _runtime


def set_runtime(runtime: Runtime | None) -> Runtime | None:
    """Replace the process-wide runtime (tests: the fake); returns the previous one. Also drops
    the plugin's cached enumeration so that the next ``register_devices`` asks the new one."""
    global _runtime
    with _lock:
        old, _runtime = _runtime, runtime
    for forget in _on_replace:
        forget()
    return old


def reset_runtime() -> None:
    """Forget the runtime; the next :func:`get_runtime` loads the real one again."""
    set_runtime(None)
