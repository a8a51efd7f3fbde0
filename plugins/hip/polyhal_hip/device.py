"""HIPDevice: one AMD GPU, its stream, allocator, kernels, transfers and DLPack.

Queue: one HIP stream per device, created blocking (``hipStreamDefault``), so that it orders
itself after work other libraries put on the null stream. Kernels, copies and stream-ordered
frees go on it; ``synchronize`` waits for it only. As a HAL queue (``queues``,
:class:`~polyhal_hip.queue.HIPQueue`) it signals timeline semaphores with HIP events.

DLPack, per buffer kind (``Tensor.__dlpack__`` in the core asks :meth:`dlpack_device`):

===================  ==============================  ==========================================
kind                 exported as                     also, on request (``dl_device=``)
===================  ==============================  ==========================================
DEVICE, ASYNC        ``(kDLROCM=10, ordinal)``       CPU by copy
MANAGED              ``(kDLROCM=10, ordinal)``       CPU ``(1, 0)`` without copy (host-visible)
HOST, HOST_REG.      CPU ``(1, 0)``                  ``(kDLROCMHost=11, n)``, ``(10, n)``
EXTERNAL             what HIP says the memory is     as above
===================  ==============================  ==========================================

Pinned host memory is exported as CPU memory by default because torch's ROCm build (and most
consumers) reject ``kDLROCMHost``; ``POLYHAL_HIP_HOST_DLPACK=rocm_host`` makes type 11 the
default instead. The ``stream`` argument follows the Array API's ROCm rules: ``None`` -- the
legacy default stream (for memory the host reads: the host waits for our stream); ``0`` -- the
default (null) stream; an int above 2 -- a ``hipStream_t`` address; ``-1`` -- no ordering;
``1`` and ``2`` (CUDA's legacy and per-thread default streams) are forbidden for ROCm and
refused. Ordering never blocks the host for device consumers: an event recorded on our
stream, waited for by the consumer's (``hipStreamWaitEvent``).
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from polyhal.errors import DLPackError, PolyhalError
from polyhal.hal.buffer import Buffer
from polyhal.hal.device import Device
from polyhal.hal.flags import BufferKind, MemoryAccess, MemoryType
from polyhal.hal.records import DeviceSpec

from polyhal_gpu.memory import import_extent
from polyhal_gpu.peer import PeerAccess
from polyhal_hip import launch as _launch
from polyhal_hip import runtime as hip
from polyhal_hip.allocator import MANAGED_MEMORY, PINNED_MEMORY, HIPAllocator, HipMemory
from polyhal_hip.array import HipArray
from polyhal_hip.errors import HipError
from polyhal_hip.queue import HIPQueue
from polyhal_hip.settings import HIPSettings

if TYPE_CHECKING:
    from polyhal.dlpack import ImportedTensor

DL_CPU, DL_ROCM, DL_ROCM_HOST = 1, 10, 11
_HOST_KINDS = (BufferKind.HOST, BufferKind.HOST_REGISTERED)
#: Peer-access tables per runtime (id -> (runtime, table)): a runtime's GPUs share one.
_PEERS: dict[int, tuple[Any, PeerAccess]] = {}
#: Streams the Array API forbids for ROCm (CUDA's legacy and per-thread default streams).
FORBIDDEN_STREAMS = (1, 2)


class KernelLaunchError(HipError):
    """A kernel launch failed: the message names the kernel and its launch shape."""

    def __init__(self, message: str, *, kernel: str, status: int | None = None) -> None:
        super().__init__(message, status=status, call="hipModuleLaunchKernel")
        self.kernel = kernel


def host_dlpack_type() -> int:
    """DLPack device type of pinned host memory: CPU (default) or kDLROCMHost
    (``POLYHAL_HIP_HOST_DLPACK=rocm_host``)."""
    return DL_ROCM_HOST if HIPSettings.from_env().host_dlpack == "rocm_host" else DL_CPU


class _Activation:
    """``with device.activate():`` makes the device current on this thread (and restores it)."""

    __slots__ = ("ordinal", "runtime", "_tls")

    def __init__(self, ordinal: int, runtime: Any) -> None:
        self.ordinal, self.runtime, self._tls = ordinal, runtime, threading.local()

    def __enter__(self) -> "_Activation":
        prev = self.runtime.get_device()
        if prev != self.ordinal:
            self.runtime.set_device(self.ordinal)
        self._tls.__dict__.setdefault("stack", []).append(prev)
        return self

    def __exit__(self, *exc: object) -> None:
        prev = self._tls.stack.pop()
        if prev != self.ordinal:
            self.runtime.set_device(prev)


class HIPDevice(Device):
    """An AMD GPU as a polyhal device, made by its spec's factory on first use.

    Public for tools and tests: ``runtime`` (the facade), ``stream``, ``allocator``
    (:class:`~polyhal_hip.allocator.HIPAllocator`), ``arch`` (the gcnArchName kernels are
    compiled for), ``compiler`` (hiprtc with its cache), ``launches`` (kernel launches so far).
    """

    dlpack_device_type = DL_ROCM
    host_copy_path = "hipMemcpyAsync"  # host <-> device transfers: one copy straight from/into the host array

    def __init__(self, spec: DeviceSpec, runtime: Any = None) -> None:
        from polyhal_hip import kernels
        from polyhal_hip.compiler import compiler_for

        super().__init__(spec)
        self.runtime = runtime or hip.get_runtime()
        self.kernels = kernels.TABLE
        self.arch = str(spec.limits.get("arch", "")) or "gfx90a"
        self._scope = _Activation(self.ordinal, self.runtime)
        with self.activate():
            self.stream = self.runtime.stream_create(hip.STREAM_DEFAULT)
            self._event = self.runtime.event_create(hip.EVENT_DISABLE_TIMING)
        self.native_allocator = self.allocator = HIPAllocator(self, spec.heaps)
        self.compiler = compiler_for(self.runtime)
        self._modules: dict[Any, Any] = {}
        self._functions: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.launches = 0

    def activate(self) -> _Activation:
        return self._scope

    @property
    def queues(self) -> tuple[HIPQueue, ...]:
        """One :class:`~polyhal_hip.queue.HIPQueue` on :attr:`stream` (signals are HIP events)."""
        queues = self.__dict__.get("_queues")
        if queues is None:
            queues = self.__dict__.setdefault("_queues", (HIPQueue(self),))
        return queues

    @property
    def peer_access(self) -> PeerAccess:
        """Peer access between the GPUs of this device's runtime (``hipDeviceCanAccessPeer``,
        enabled once per pair): one table per runtime, shared by its devices."""
        rt = self.runtime
        table = _PEERS.get(id(rt))
        if table is None or table[0] is not rt:
            def enable(dst: int, src: int) -> None:
                prev = rt.get_device()
                rt.set_device(dst)
                try:
                    rt.device_enable_peer_access(src)
                finally:
                    rt.set_device(prev)

            table = _PEERS[id(rt)] = (rt, PeerAccess(rt.device_can_access_peer, enable))
        return table[1]

    def close(self) -> None:
        """Finish queued work and give the pool's cached memory back."""
        self.synchronize()
        self.native_allocator.trim()

    # -- kernels -----------------------------------------------------------------------------------

    def prepare(self, op: str, attrs: Mapping[str, Any], in_types, out_types, scratch: Any = None
                ) -> Callable[..., None]:
        with self.activate():
            fn = super().prepare(op, attrs, in_types, out_types, scratch)
        scope = self._scope

        def run(*arrays: Any) -> None:
            with scope:
                fn(*arrays)

        run.inner = fn  # type: ignore[attr-defined]
        return run

    def function(self, text: str, name: str, expression: str, expressions: Sequence[str] = ()) -> Any:
        """The kernel ``expression`` of source ``text`` (compiled for this device's architecture,
        loaded once per device). ``expressions`` are the name expressions (template instances)
        of the module; a plain ``extern "C"`` kernel needs none."""
        exprs = tuple(expressions) or ((expression,) if "<" in expression else ())
        key = (text, exprs)
        fkey = (key, expression)
        fn = self._functions.get(fkey)
        if fn is not None:
            return fn
        with self._lock:
            module = self._modules.get(key)
            if module is None:
                result = self.compiler.compile(text, name, self.arch, exprs)
                with self.activate():
                    module = self._modules[key] = (self.runtime.module_load_data(result.code), result.lowered)
            handle, lowered = module
            with self.activate():
                fn = self._functions[fkey] = self.runtime.module_get_function(handle, lowered.get(expression, expression))
            return fn

    def launch(self, function: Any, name: str, grid: Sequence[int], block: Sequence[int], args: Sequence[Any],
               shared_bytes: int = 0) -> None:
        """Launch on this device's stream; failures name the kernel and the launch shape."""
        try:
            packed = _launch.pack(args)
            self.runtime.launch(function, tuple(grid), tuple(block), int(shared_bytes), self.stream, packed)
        except HipError as exc:
            raise KernelLaunchError(f"launching {name} on {self.name} (grid {tuple(grid)}, block {tuple(block)}, "
                                    f"{shared_bytes} B dynamic shared memory): {exc}", kernel=name,
                                    status=exc.status) from exc
        self.launches += 1

    def view(self, tensor) -> HipArray:
        native: HipMemory = tensor.buffer.native
        return HipArray(native.ptr + tensor.offset, tensor.shape, tensor.dtype, tensor.strides, native)

    def synchronize(self) -> None:
        self.runtime.stream_synchronize(self.stream)

    # -- data movement -----------------------------------------------------------------------------

    def _host_ptr(self, buffer: Buffer) -> int:
        native: HipMemory = buffer.native
        if buffer.released or native.freed:
            raise PolyhalError(f"{buffer!r} was released; its memory is gone")
        return native.host_ptr

    def _map(self, buffer: Buffer, offset: int, length: int, access: MemoryAccess) -> np.ndarray:
        base = self._host_ptr(buffer)
        self.synchronize()  # the host sees every write queued before
        if length == 0:
            return np.empty(0, np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(base + offset))

    def _check_live(self, buffer: Buffer) -> HipMemory:
        native: HipMemory = buffer.native
        if buffer.released or native.freed:
            raise PolyhalError(f"{buffer!r} was released; its memory is gone")
        return native

    def write(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        native = self._check_live(buffer)
        src = np.ascontiguousarray(host)
        if src.nbytes:
            with self.activate():
                self.runtime.memcpy_async(native.ptr + offset, src.ctypes.data, src.nbytes, hip.MEMCPY_DEFAULT,
                                          self.stream)
                self.synchronize()  # the source is pageable memory the caller may free

    def read(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        native = self._check_live(buffer)
        if host.nbytes:
            with self.activate():
                self.runtime.memcpy_async(host.ctypes.data, native.ptr + offset, host.nbytes, hip.MEMCPY_DEFAULT,
                                          self.stream)
                self.synchronize()

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        s, d = self._check_live(src), self._check_live(dst)
        if nbytes:
            with self.activate():
                self.runtime.memcpy_async(d.ptr + dst_offset, s.ptr + src_offset, nbytes, hip.MEMCPY_DEFAULT,
                                          self.stream)

    def download(self, native: HipArray, host: np.ndarray) -> None:
        with self.activate():
            if native.is_contiguous:
                if host.nbytes:
                    self.runtime.memcpy_async(host.ctypes.data, native.ptr, host.nbytes, hip.MEMCPY_DEFAULT, self.stream)
                    self.synchronize()
                return
            raw = np.empty(native.extent_bytes, np.uint8)  # strided: fetch the extent, gather on the host
            self.runtime.memcpy_async(raw.ctypes.data, native.ptr, raw.nbytes, hip.MEMCPY_DEFAULT, self.stream)
            self.synchronize()
            item = native.dtype.itemsize
            view = np.lib.stride_tricks.as_strided(raw.view(native.dtype), native.shape,
                                                   tuple(s * item for s in native.strides))
            np.copyto(host, view)

    def upload(self, host: np.ndarray, native: HipArray) -> None:
        if not native.is_contiguous:
            raise PolyhalError(f"cannot upload into a strided device array {native}")
        src = np.ascontiguousarray(host, dtype=native.dtype)
        if src.nbytes:
            with self.activate():
                self.runtime.memcpy_async(native.ptr, src.ctypes.data, src.nbytes, hip.MEMCPY_DEFAULT, self.stream)
                self.synchronize()

    # -- transfers between HIP GPUs (Device.can_copy) ------------------------------------------------

    def can_copy(self, src: Device, dst: Device) -> bool:
        """Host memory to and from this GPU (``hipMemcpyAsync``), and between two HIP GPUs of one
        runtime (peer copy where the topology allows, else staged through pinned host memory)."""
        return super().can_copy(src, dst) or (self in (src, dst) and isinstance(src, HIPDevice)
                                               and isinstance(dst, HIPDevice) and src.runtime is dst.runtime)

    def copy_path(self, src: Device, dst: Device) -> str:
        if src.is_host or dst.is_host:
            return super().copy_path(src, dst)
        return self.peer_access.path(src.ordinal, dst.ordinal)

    def transfer(self, src: Device, src_native: Any, dst: Device, dst_native: Any, nbytes: int,
                 queued: bool = False) -> None:
        """As CUDA's: GPU to GPU by ``hipMemcpyPeerAsync`` on the destination's stream where peer
        access is enabled (left queued with ``queued``), else staged through a pinned host buffer."""
        if src.is_host or dst.is_host:
            super().transfer(src, src_native, dst, dst_native, nbytes)
            return
        if not nbytes:
            return
        rt = self.runtime
        if src is dst or self.peer_access(src.ordinal, dst.ordinal):
            if not queued:
                src.synchronize()
            with dst.activate():
                rt.memcpy_peer_async(dst_native.ptr, dst.ordinal, src_native.ptr, src.ordinal, nbytes, dst.stream)
            if not queued:
                dst.synchronize()
            return
        with src.activate():
            staging = rt.host_malloc(nbytes, hip.HOST_MALLOC_PORTABLE)
        try:
            with src.activate():
                rt.memcpy_async(staging, src_native.ptr, nbytes, hip.MEMCPY_DEVICE_TO_HOST, src.stream)
                src.synchronize()
            with dst.activate():
                rt.memcpy_async(dst_native.ptr, staging, nbytes, hip.MEMCPY_HOST_TO_DEVICE, dst.stream)
                dst.synchronize()  # before the staging buffer goes back
        finally:
            rt.host_free(staging)

    # -- DLPack ------------------------------------------------------------------------------------

    def dlpack_device(self, buffer: Buffer) -> tuple[int, int]:
        native = buffer.native
        if buffer.released or native.freed:
            raise DLPackError(f"cannot export {buffer!r}: it was released (its memory went back to HIP); keep "
                              "the tensor alive while it is exported")
        if native.kind in _HOST_KINDS:
            t = host_dlpack_type()
            return (t, 0 if t == DL_CPU else self.ordinal)
        return (DL_ROCM, self.ordinal)

    def dlpack_alias(self, buffer: Buffer, dl_device: tuple[int, int]) -> bool:
        """Pinned host memory may also be exported as ROCm-host (11) or ROCm (10) memory of this
        GPU: the GPU reaches it at the same address (unified addressing)."""
        want = (int(dl_device[0]), int(dl_device[1]))
        return buffer.native.kind in _HOST_KINDS and want in ((DL_ROCM_HOST, self.ordinal), (DL_ROCM, self.ordinal))

    def buffer_address(self, buffer: Buffer) -> int:
        native = buffer.native
        if buffer.released or native.freed:
            raise DLPackError(f"cannot export {buffer!r}: it was released")
        return native.host_ptr if native.kind in _HOST_KINDS else native.ptr

    def dlpack_consumer_stream(self) -> int:
        return self.runtime.handle(self.stream)

    def _export_sync(self, buffer: Buffer, stream: Any) -> None:
        if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
            raise DLPackError(
                f"DLPack stream for ROCm memory must be an int (a hipStream_t address, 0 for the default stream, "
                f"-1 for no ordering) or None, got {type(stream).__name__} {stream!r}")
        if stream in FORBIDDEN_STREAMS:
            raise DLPackError(
                f"DLPack stream {stream} is forbidden for ROCm (the Array API reserves 1 and 2 for CUDA's legacy and "
                "per-thread default streams); pass None or 0 for the default stream, a hipStream_t address, or -1")
        if stream is not None and stream < -1:
            raise DLPackError(f"DLPack stream {stream} is not a stream; use None, 0, -1 or a hipStream_t address")
        if stream == -1:
            return
        rt = self.runtime
        with self.activate():
            rt.event_record(self._event, self.stream)
            if stream is None and (buffer.host_visible or buffer.native.kind in _HOST_KINDS):
                rt.event_synchronize(self._event)  # the consumer may be the host: wait for our stream only
                return
            target = 0 if stream is None else stream
            if target != rt.handle(self.stream):
                rt.stream_wait_event(target, self._event)

    def import_dlpack(self, imported: "ImportedTensor") -> Buffer:
        """Wrap memory described by a DLPack capsule as an EXTERNAL buffer (no copy).

        Accepted: ``(kDLROCM, n)`` memory of this GPU, ``(kDLROCMHost, *)`` pinned host memory,
        and CPU memory that HIP knows (pinned or registered: a polyhal-hip pinned buffer exported
        as CPU). What HIP says the pointer is decides the buffer's kind and memory type."""
        dev_type, dev_id = int(imported.device[0]), int(imported.device[1])
        if dev_type not in (DL_ROCM, DL_ROCM_HOST, DL_CPU):
            raise DLPackError(f"{self.name} cannot import DLPack device type {dev_type}")
        if dev_type == DL_ROCM and dev_id != self.ordinal:
            raise DLPackError(f"DLPack tensor lives on ROCm device {dev_id}, not on {self.name}; import it on "
                              f"hip:{dev_id} or copy it")
        extent = import_extent(imported, self.name)
        kind_name, _dev = ("unregistered", -1)
        if imported.data_ptr:
            with self.activate():
                kind_name, _dev = self.runtime.pointer_kind(imported.data_ptr)
        if kind_name == "unregistered" and imported.data_ptr:
            if dev_type == DL_ROCM:
                raise DLPackError(f"address {imported.data_ptr:#x} is not memory HIP knows, but the producer calls it "
                                  f"ROCm device memory; the producer's DLPack device is wrong")
            raise DLPackError(f"{self.name} cannot import host memory that HIP does not know (not pinned or "
                              "registered); import it on the CPU, or register it: "
                              "device.native_allocator.import_host(array)")
        kind = {"device": BufferKind.DEVICE, "managed": BufferKind.MANAGED}.get(kind_name, BufferKind.HOST)
        memory_type = {BufferKind.HOST: PINNED_MEMORY, BufferKind.MANAGED: MANAGED_MEMORY}.get(kind, MemoryType.DEVICE_LOCAL)
        host_ptr = imported.data_ptr if kind in (BufferKind.HOST, BufferKind.MANAGED) else 0
        heap = next((h for h in self.native_allocator.heaps if h.memory_type == memory_type),
                    self.native_allocator.heaps[0])
        native = HipMemory(imported.data_ptr, extent, kind, self.ordinal, host_ptr=host_ptr, owner=imported)
        return Buffer(self.native_allocator, heap, extent, native, memory_type=memory_type, kind=BufferKind.EXTERNAL,
                      on_release=lambda *_: imported.release())
