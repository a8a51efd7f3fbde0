"""FakeHipRuntime -- a stand-in, not ROCm.

An in-process implementation of polyhal-hip's runtime facade (:class:`polyhal_hip.runtime.Runtime`)
for testing what needs an AMD GPU on machines without one: allocation of every buffer kind,
free-by-kind, stream-ordered frees, exports, stream ordering and launch marshalling. It is not
a simulator of a GPU: "device memory" is host memory (so copies and DLPack exports can be
checked byte for byte), launches are recorded, never executed.

What it checks like HIP would, and reports through the same :func:`polyhal_hip.errors.check`:
freeing an address twice or with the wrong call (``hipErrorInvalidValue``), copying from or to
freed memory (``hipErrorInvalidValue``), loading something that is not an AMDGPU code object
(``hipErrorInvalidImage``), asking a module for a kernel it does not contain
(``hipErrorNotFound``), unregistering memory that is not registered.

Error injection: ``fake.inject("hipMalloc", 2)`` makes the next ``hipMalloc`` fail with
``hipErrorOutOfMemory``; ``fake.missing.add("hipMallocFromPoolAsync")`` makes a call fail as a
runtime without that symbol does. ``fake.calls`` lists every call made, by HIP name.

Kernels are compiled for real by ``compiler`` (the real hiprtc, when the bindings are
installed) so that loading and kernel lookup see real code objects.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from polyhal_hip.compiler import is_code_object
from polyhal_hip.errors import HipSymbolNotFound, HipVersionMismatch, check
from polyhal_hip.runtime import CompileResult, DeviceProperties, Runtime, version_tuple

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, NO_DEVICE, INVALID_DEVICE = 0, 1, 2, 100, 101
INVALID_IMAGE, NOT_FOUND, NOT_REGISTERED = 200, 500, 713


def gpu(ordinal: int = 0, **overrides: Any) -> DeviceProperties:
    """Properties of a made-up MI210-like GPU (gfx90a, wave64)."""
    base = dict(ordinal=ordinal, name="Fake AMD Instinct (stand-in)", arch="gfx90a:sramecc+:xnack-",
                total_memory=64 << 30, multiprocessors=104, warp_size=64, max_threads_per_block=1024,
                shared_mem_per_block=65536, l2_cache_bytes=8 << 20, managed_memory=True,
                concurrent_managed_access=True, can_map_host_memory=True, memory_pools=True,
                pci_bus_id=f"0000:{ordinal + 3:02x}:00")
    base.update(overrides)
    return DeviceProperties(**base)


@dataclass
class Block:
    """One allocation of the fake: its memory, kind and state."""

    addr: int
    nbytes: int
    kind: str            # "device", "async", "managed", "host", "registered"
    device: int
    storage: Any = None  # the ctypes buffer (None for registered memory: the caller owns it)
    freed: bool = False
    flags: int = 0


@dataclass
class Launch:
    function: str
    grid: tuple
    block: tuple
    shared_bytes: int
    stream: int
    args: bytes


@dataclass
class FakeHandle:
    kind: str
    id: int
    data: Any = None


@dataclass
class FakeHipRuntime(Runtime):
    """A stand-in for the ROCm runtime (see the module docstring)."""

    devices: list[DeviceProperties] = field(default_factory=lambda: [gpu(0)])
    version: int = 60241133            # ROCm 6.2
    bindings: tuple[int, int] = (6, 2)
    compiler: Any = None               # a real runtime to compile with, or None
    missing: set[str] = field(default_factory=set)
    no_device: bool = False
    peer: bool = True                  # whether its GPUs can access each other (hipDeviceCanAccessPeer)
    slow_events: bool = False          # events stay "not ready" until synchronized

    description = "FakeHipRuntime -- a stand-in, not ROCm"
    is_fake = True

    def __post_init__(self) -> None:
        self.calls: list[str] = []
        self.launches: list[Launch] = []
        self.blocks: dict[int, Block] = {}
        self.injected: dict[str, list[int]] = {}
        self.waits: list[tuple[int, int]] = []        # (stream handle, event id)
        self.event_syncs = 0
        self.peers_enabled: list[tuple[int, int]] = []  # (device, peer) of hipDeviceEnablePeerAccess
        self.synchronized: set = set()                    # ids of events synchronized
        self.current = 0
        self._ids = itertools.count(0x1000)
        self.pool = FakeHandle("pool", next(self._ids))

    # -- machinery -----------------------------------------------------------------------------------

    def inject(self, call: str, status: int, times: int = 1) -> None:
        """Make the next ``times`` calls of HIP function ``call`` fail with ``status``."""
        self.injected.setdefault(call, []).extend([status] * times)

    def _enter(self, call: str, what: str = "") -> None:
        self.calls.append(call)
        if call in self.missing:
            have = ".".join(map(str, version_tuple(self.version)[:2]))
            raise HipSymbolNotFound(f"{call}: the ROCm runtime library (version {have}) has no symbol {call} "
                                    "(FakeHipRuntime: made missing by the test)", symbol=call, call=call)
        pending = self.injected.get(call)
        if pending:
            check(pending.pop(0), call, what)

    def _device_ok(self, call: str) -> None:
        if self.no_device or not self.devices:
            check(INVALID_DEVICE, call)

    def _new(self, nbytes: int, kind: str, flags: int = 0) -> int:
        storage = ctypes.create_string_buffer(max(nbytes, 1) + 256)
        addr = -ctypes.addressof(storage) % 256 + ctypes.addressof(storage)
        self.blocks[addr] = Block(addr, nbytes, kind, self.current, storage, flags=flags)
        return addr

    def _find(self, ptr: int) -> Block | None:
        for b in self.blocks.values():
            if b.addr <= ptr < b.addr + max(b.nbytes, 1):
                return b
        return None

    def _free_block(self, call: str, ptr: int, kinds: tuple[str, ...]) -> Block:
        b = self.blocks.get(int(ptr))
        if b is None or b.freed or b.kind not in kinds:
            check(INVALID_VALUE, call, f"freeing {int(ptr):#x} (FakeHipRuntime: not a live {'/'.join(kinds)} "
                                       "allocation: a double free or the wrong free call)")
        b.freed = True
        return b

    def live(self, kind: str | None = None) -> list[Block]:
        return [b for b in self.blocks.values() if not b.freed and (kind is None or b.kind == kind)]

    # -- versions and devices ------------------------------------------------------------------------

    def runtime_version(self) -> int:
        self._enter("hipRuntimeGetVersion")
        return self.version

    def driver_version(self) -> int:
        self._enter("hipDriverGetVersion")
        return self.version

    def bindings_version(self) -> tuple[int, int]:
        return self.bindings

    def match(self) -> None:
        if version_tuple(self.version)[0] != self.bindings[0]:
            raise HipVersionMismatch(f"bindings for ROCm {self.bindings[0]}.{self.bindings[1]}, runtime "
                                     f"{'.'.join(map(str, version_tuple(self.version)[:2]))} (FakeHipRuntime)")

    def device_count(self) -> int:
        self._enter("hipGetDeviceCount")
        if self.no_device or not self.devices:
            check(NO_DEVICE, "hipGetDeviceCount", "counting AMD GPUs")
        return len(self.devices)

    def device_properties(self, ordinal: int) -> DeviceProperties:
        self._enter("hipGetDeviceProperties")
        if not 0 <= ordinal < len(self.devices):
            check(INVALID_DEVICE, "hipGetDeviceProperties")
        return self.devices[ordinal]

    def set_device(self, ordinal: int) -> None:
        self._enter("hipSetDevice")
        if not 0 <= ordinal < len(self.devices):
            check(INVALID_DEVICE, "hipSetDevice")
        self.current = ordinal

    def get_device(self) -> int:
        self._enter("hipGetDevice")
        return self.current

    def mem_get_info(self) -> tuple[int, int]:
        self._enter("hipMemGetInfo")
        total = self.devices[self.current].total_memory
        used = sum(b.nbytes for b in self.live() if b.kind in ("device", "async", "managed"))
        return total - used, total

    # -- memory ----------------------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        self._enter("hipMalloc", f"allocating {nbytes} bytes of device memory")
        self._device_ok("hipMalloc")
        return self._new(nbytes, "device")

    def free(self, ptr: int) -> None:
        self._enter("hipFree")
        self._free_block("hipFree", ptr, ("device", "managed"))

    def malloc_async(self, nbytes: int, stream: Any) -> int:
        self._enter("hipMallocAsync")
        return self._new(nbytes, "async")

    def malloc_from_pool_async(self, nbytes: int, pool: Any, stream: Any) -> int:
        self._enter("hipMallocFromPoolAsync", f"allocating {nbytes} bytes from a stream-ordered pool")
        if pool is not self.pool:
            check(INVALID_VALUE, "hipMallocFromPoolAsync")
        return self._new(nbytes, "async")

    def free_async(self, ptr: int, stream: Any) -> None:
        self._enter("hipFreeAsync")
        self._free_block("hipFreeAsync", ptr, ("async",))

    def default_mem_pool(self, ordinal: int) -> Any:
        self._enter("hipDeviceGetDefaultMemPool")
        if not self.devices[ordinal].memory_pools:
            check(801, "hipDeviceGetDefaultMemPool")
        return self.pool

    def mem_pool_trim_to(self, pool: Any, keep: int) -> None:
        self._enter("hipMemPoolTrimTo")

    def host_malloc(self, nbytes: int, flags: int) -> int:
        self._enter("hipHostMalloc", f"allocating {nbytes} bytes of pinned host memory")
        if flags < 0 or flags > 0xFFFFFFFF:
            raise OverflowError(f"hipHostMalloc flags {flags} do not fit an unsigned int (mask them to 32 bits)")
        return self._new(nbytes, "host", flags)

    def host_free(self, ptr: int) -> None:
        self._enter("hipHostFree")
        self._free_block("hipHostFree", ptr, ("host",))

    def host_get_device_pointer(self, ptr: int) -> int:
        self._enter("hipHostGetDevicePointer")
        b = self._find(ptr)
        if b is None or b.freed or b.kind not in ("host", "registered"):
            check(INVALID_VALUE, "hipHostGetDevicePointer")
        return int(ptr)  # unified addressing: the same address

    def host_register(self, ptr: int, nbytes: int, flags: int) -> None:
        self._enter("hipHostRegister", f"registering {nbytes} bytes of host memory")
        old = self.blocks.get(int(ptr))
        if old is not None and not old.freed:
            check(712, "hipHostRegister")
        self.blocks[int(ptr)] = Block(int(ptr), nbytes, "registered", self.current, None, flags=flags)

    def host_unregister(self, ptr: int) -> None:
        self._enter("hipHostUnregister")
        b = self.blocks.get(int(ptr))
        if b is None or b.freed or b.kind != "registered":
            check(NOT_REGISTERED, "hipHostUnregister")
        b.freed = True

    def malloc_managed(self, nbytes: int, flags: int = 1) -> int:
        self._enter("hipMallocManaged", f"allocating {nbytes} bytes of managed memory")
        self._device_ok("hipMallocManaged")
        return self._new(nbytes, "managed", flags)

    def mem_prefetch_async(self, ptr: int, nbytes: int, ordinal: int, stream: Any) -> None:
        self._enter("hipMemPrefetchAsync")

    def pointer_kind(self, ptr: int) -> tuple[str, int]:
        self._enter("hipPointerGetAttributes")
        b = self._find(ptr)
        if b is None or b.freed:
            return "unregistered", -1
        return {"device": "device", "async": "device", "managed": "managed"}.get(b.kind, "host"), b.device

    # -- copies --------------------------------------------------------------------------------------

    def _live_range(self, call: str, ptr: int, nbytes: int) -> None:
        b = self._find(ptr)
        if b is not None and b.freed:
            check(INVALID_VALUE, call, f"FakeHipRuntime: {int(ptr):#x} is freed memory")
        if b is not None and ptr + nbytes > b.addr + b.nbytes:
            check(INVALID_VALUE, call, f"FakeHipRuntime: {nbytes} bytes at {int(ptr):#x} run past the allocation")

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
        self._enter("hipMemcpyAsync", f"copying {nbytes} bytes")
        self._live_range("hipMemcpyAsync", dst, nbytes)
        self._live_range("hipMemcpyAsync", src, nbytes)
        ctypes.memmove(int(dst), int(src), int(nbytes))

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        self._enter("hipMemsetAsync")
        self._live_range("hipMemsetAsync", int(ptr), nbytes)
        ctypes.memset(int(ptr), value, int(nbytes))

    # -- streams and events ------------------------------------------------------------------------------

    def stream_create(self, flags: int = 0) -> Any:
        self._enter("hipStreamCreateWithFlags")
        self._device_ok("hipStreamCreateWithFlags")
        return FakeHandle("stream", next(self._ids))

    def stream_destroy(self, stream: Any) -> None:
        self._enter("hipStreamDestroy")

    def stream_synchronize(self, stream: Any) -> None:
        self._enter("hipStreamSynchronize")

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._enter("hipStreamWaitEvent")
        self.waits.append((self.handle(stream), event.id))

    def event_create(self, flags: int = 2) -> Any:
        self._enter("hipEventCreateWithFlags")
        return FakeHandle("event", next(self._ids))

    def event_record(self, event: Any, stream: Any) -> None:
        self._enter("hipEventRecord")

    def event_synchronize(self, event: Any) -> None:
        self._enter("hipEventSynchronize")
        self.event_syncs += 1
        self.synchronized.add(getattr(event, "id", None))

    def event_query(self, event: Any) -> bool:
        self._enter("hipEventQuery")
        # The stand-in does every copy at once; with ``slow_events`` an event reports "not ready"
        # (hipErrorNotReady) until it is synchronized, as a busy GPU's would.
        return not self.slow_events or event.id in self.synchronized

    def event_destroy(self, event: Any) -> None:
        self._enter("hipEventDestroy")

    # -- peers -----------------------------------------------------------------------------------------

    def device_can_access_peer(self, ordinal: int, peer: int) -> bool:
        self._enter("hipDeviceCanAccessPeer")
        return self.peer and ordinal != peer and max(ordinal, peer) < len(self.devices)

    def device_enable_peer_access(self, peer: int) -> None:
        self._enter("hipDeviceEnablePeerAccess")
        self.peers_enabled.append((self.current, peer))

    def memcpy_peer_async(self, dst: int, dst_ordinal: int, src: int, src_ordinal: int, nbytes: int,
                          stream: Any) -> None:
        self._enter("hipMemcpyPeerAsync", f"copying {nbytes} bytes from hip:{src_ordinal} to hip:{dst_ordinal}")
        self._live_range("hipMemcpyPeerAsync", dst, nbytes)
        self._live_range("hipMemcpyPeerAsync", src, nbytes)
        ctypes.memmove(int(dst), int(src), int(nbytes))

    def handle(self, obj: Any) -> int:
        if obj is None:
            return 0
        return obj.id if isinstance(obj, FakeHandle) else int(obj)

    # -- code ------------------------------------------------------------------------------------------

    def module_load_data(self, image: bytes) -> Any:
        self._enter("hipModuleLoadData", "loading a code object")
        if not is_code_object(bytes(image)):
            check(INVALID_IMAGE, "hipModuleLoadData", "loading a code object (FakeHipRuntime: not an AMDGPU ELF)")
        return FakeHandle("module", next(self._ids), bytes(image))

    def module_get_function(self, module: Any, name: str) -> Any:
        self._enter("hipModuleGetFunction", f"finding kernel {name}")
        if name.encode() + b"\0" not in module.data:
            check(NOT_FOUND, "hipModuleGetFunction", f"finding kernel {name}")
        return FakeHandle("function", next(self._ids), name)

    def module_unload(self, module: Any) -> None:
        self._enter("hipModuleUnload")

    def launch(self, function: Any, grid: Sequence[int], block: Sequence[int], shared_bytes: int, stream: Any,
               args: bytes) -> None:
        self._enter("hipModuleLaunchKernel")
        if any(int(g) < 1 for g in grid) or any(int(b) < 1 for b in block) or _prod(block) > 1024:
            check(9, "hipModuleLaunchKernel")  # hipErrorInvalidConfiguration
        self.launches.append(Launch(function.data, tuple(grid), tuple(block), shared_bytes, self.handle(stream),
                                    bytes(args)))

    def compile(self, source: str, name: str, options: Sequence[str], expressions: Sequence[str] = ()) -> CompileResult:
        self._enter("hiprtcCompileProgram")
        if self.compiler is None:
            raise RuntimeError("FakeHipRuntime has no compiler (install hip-python and libamdhip64-dev)")
        return self.compiler.compile(source, name, options, expressions)

    def compiler_version(self) -> tuple[int, int]:
        return self.compiler.compiler_version() if self.compiler is not None else (0, 0)


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out
