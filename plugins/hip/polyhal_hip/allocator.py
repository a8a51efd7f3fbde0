"""HIPAllocator: IREE's HIP buffer types, each buffer freed according to its kind.

Heaps (:func:`heaps_for`), in the order the core prefers them:

=====================================================  ===============  =====================================
memory type                                            kind             HIP
=====================================================  ===============  =====================================
``DEVICE_LOCAL``                                       DEVICE / ASYNC   ``hipMalloc`` / ``hipFree``; or, with
                                                                        ``POLYHAL_HIP_POOL=async`` on a device
                                                                        with memory pools, ``hipMallocFromPoolAsync``
                                                                        on the device's default pool /
                                                                        ``hipFreeAsync`` on its stream
``DEVICE_LOCAL | HOST_VISIBLE | HOST_COHERENT``        MANAGED          ``hipMallocManaged`` + prefetch to the GPU
                                                                        / ``hipFree`` -- only on devices with
                                                                        concurrent managed access
``HOST_LOCAL | DEVICE_VISIBLE`` (coherent)             HOST             ``hipHostMalloc(Mapped|Portable|Coherent)``
                                                                        / ``hipHostFree``
``HOST_VISIBLE | HOST_CACHED | DEVICE_VISIBLE``        HOST             ``hipHostMalloc(Mapped|Portable|NonCoherent)``
                                                                        / ``hipHostFree``
=====================================================  ===============  =====================================

Besides the heaps: :meth:`HIPAllocator.import_host` registers existing host memory
(``hipHostRegister``; kind HOST_REGISTERED, freed by ``hipHostUnregister``, the memory itself
stays its owner's), and DLPack imports are kind EXTERNAL (never freed by polyhal; the
producer's deleter runs when the buffer is released).

Memory types map onto kinds as IREE's HIP driver maps them: a device-local request is device
memory; device-local *and* host-visible is managed memory where the device has concurrent
managed access -- elsewhere (no such heap) it falls back to coherent pinned host memory, as
IREE does (``HOST_LOCAL | DEVICE_VISIBLE``: the buffer says what it is, fewer bits than asked,
the one exception to the core's "never fewer" rule, documented in the README); host-visible
requests get pinned host memory, ``HOST_CACHED`` the non-coherent kind. Any kind can also be
named per allocation: ``allocate(n, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC)``.

No caching pool of its own: a DEVICE buffer is one ``hipMalloc`` / ``hipFree`` (as in IREE's HIP
driver; the free-by-kind accounting counts them), and ASYNC buffers come from HIP's
stream-ordered pool, which caches in the driver and orders reuse on the stream. Where caching
on the host side is wanted, it is the core's :class:`~polyhal.hal.adaptors.CachingPoolAdaptor`,
stacked over this allocator (``POLYHAL_ALLOCATOR=pool`` or the ``wrap_allocator`` hook).

An ASYNC buffer is freed exactly once: by :meth:`HIPAllocator.dealloca` (stream-ordered, like
IREE's ``queue_dealloca``) or by its release, whichever comes first; the other does nothing.
A free that HIP refuses never raises out of a release (the core's contract); it is recorded in
``allocator.free_failures`` and warned about.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.errors import IncompatibleBufferError
from polyhal.hal.buffer import Buffer
from polyhal.hal.flags import BufferKind, BufferUsage, MemoryType
from polyhal.hal.records import Heap

from polyhal_gpu.memory import (ALIGNMENT, DEVICE_USAGE, HOST_USAGE, MANAGED_MEMORY, PINNED_MEMORY,
                                          GPUAllocator, host_memory_bytes)
from polyhal_hip import runtime as hip
from polyhal_hip.errors import HipError

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the HIP device; its module imports this one
    from polyhal_hip.runtime import DeviceProperties

__all__ = ["ALIGNMENT", "DEVICE_USAGE", "HOST_USAGE", "MANAGED_MEMORY", "PINNED_MEMORY", "PINNED_NONCOHERENT_MEMORY",
           "PINNED_FLAGS", "HIPAllocator", "HipMemory", "heaps_for"]

PINNED_NONCOHERENT_MEMORY = MemoryType.HOST_VISIBLE | MemoryType.HOST_CACHED | MemoryType.DEVICE_VISIBLE
_DEVICE_HOST_VISIBLE = MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE

PINNED_FLAGS = hip.HOST_MALLOC_MAPPED | hip.HOST_MALLOC_PORTABLE


def heaps_for(props: "DeviceProperties", pool: str) -> tuple[Heap, ...]:
    """The heaps of a device (see the module docstring)."""
    total = int(props.total_memory) or 1 << 30
    kind = BufferKind.ASYNC if pool == "async" and props.memory_pools else BufferKind.DEVICE
    heaps = [Heap(MemoryType.DEVICE_LOCAL, DEVICE_USAGE, total, kind, ALIGNMENT)]
    if props.managed_memory and props.concurrent_managed_access:
        heaps.append(Heap(MANAGED_MEMORY, HOST_USAGE, total, BufferKind.MANAGED, ALIGNMENT))
    if props.can_map_host_memory:
        host = host_memory_bytes()
        heaps.append(Heap(PINNED_MEMORY, HOST_USAGE, host, BufferKind.HOST, ALIGNMENT))
        heaps.append(Heap(PINNED_NONCOHERENT_MEMORY, HOST_USAGE, host, BufferKind.HOST, ALIGNMENT))
    return tuple(heaps)


class HipMemory:
    """The native handle of a HIP buffer.

    ``ptr`` is the device address, ``host_ptr`` the host address (0 for device-only memory),
    ``kind`` how the memory was obtained (for imports: what HIP says it is), ``owner`` what keeps
    foreign memory alive (a registered numpy array, a DLPack import), ``freed`` whether it went
    back to HIP already (stream-ordered frees), ``coherent`` for pinned host memory.
    """

    __slots__ = ("ptr", "host_ptr", "nbytes", "kind", "owner", "device_id", "freed", "coherent", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, kind: BufferKind, device_id: int, *, host_ptr: int = 0,
                 owner: Any = None, coherent: bool = True) -> None:
        self.ptr, self.nbytes, self.kind, self.device_id = int(ptr), int(nbytes), kind, device_id
        self.host_ptr, self.owner, self.freed, self.coherent = int(host_ptr), owner, False, coherent

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return f"<HipMemory {self.kind.value} {self.nbytes} B at {self.ptr:#x} on hip:{self.device_id}{state}>"


class HIPAllocator(GPUAllocator):
    """Allocations of every HIP buffer type for one :class:`~polyhal_hip.device.HIPDevice`;
    ``allocate(..., kind=BufferKind.ASYNC)`` (or DEVICE) names the HIP buffer type of a
    device-local buffer (:class:`~polyhal_gpu.memory.GPUAllocator`)."""

    async_pool_limit = "memory_pools"
    no_async_pool = ("{device} reports no stream-ordered memory pools (hipDeviceAttributeMemoryPoolsSupported "
                     "is 0); allocate kind=DEVICE")
    other_kinds_from = "the memory type or from import_host"

    def __init__(self, device: "Device", heaps: tuple[Heap, ...]) -> None:
        super().__init__(device, heaps)
        self.device: "Device" = device
        self.runtime = device.runtime
        self._pool: Any = None
        #: (kind, address, error) of frees HIP refused (a release never raises).
        self.free_failures: list[tuple[BufferKind, int, HipError]] = []
        #: Counts of HIP free calls by kind (tests check that nothing is freed twice).
        self.frees: dict[BufferKind, int] = {}

    # -- public ------------------------------------------------------------------------------------

    def _select_heap(self, memory_type: MemoryType, usage: BufferUsage) -> Heap | None:
        # (the core memoizes select_heap per memory type and usage; this is what it memoizes)
        heap = super()._select_heap(memory_type, usage)
        if heap is None and MemoryType(memory_type) & _DEVICE_HOST_VISIBLE == _DEVICE_HOST_VISIBLE:
            # IREE's HIP driver: without concurrent managed access, device-local host-visible
            # requests are served by coherent pinned host memory.
            if not self.device.spec.limits.get("concurrent_managed_access", False):
                fallback = [h for h in self.heaps if h.memory_type == PINNED_MEMORY
                            and (h.allowed_usage & usage) == (usage & ~BufferUsage.MAPPING_OPTIONAL)]
                return fallback[0] if fallback else None
        return heap

    def dealloca(self, buffer: Buffer) -> None:
        """Free ``buffer`` now, ordered on the device's stream for ASYNC buffers
        (``hipFreeAsync``, IREE's ``queue_dealloca``); its later release frees nothing."""
        native: HipMemory = buffer.native
        if buffer.released or native.freed:
            return
        if native.kind is BufferKind.ASYNC and buffer.kind is not BufferKind.EXTERNAL:
            self._hip_free(native)
        buffer.release()

    def import_host(self, host: Any, nbytes: int | None = None) -> Buffer:
        """Register existing host memory with HIP (``hipHostRegister``): a numpy array (kept alive)
        or an address with ``nbytes``. Kind HOST_REGISTERED; its release unregisters it."""
        if isinstance(host, np.ndarray):
            if not host.flags.c_contiguous:
                raise IncompatibleBufferError("import_host needs a C-contiguous array (np.ascontiguousarray)")
            ptr, size, owner = host.ctypes.data, host.nbytes, host
        else:
            if nbytes is None:
                raise IncompatibleBufferError("import_host(address) needs nbytes")
            ptr, size, owner = int(host), int(nbytes), None
        if size <= 0:
            raise IncompatibleBufferError(f"cannot register {size} bytes of host memory")
        rt = self.runtime
        with self.device.activate():
            rt.host_register(ptr, size, hip.HOST_REGISTER_MAPPED | hip.HOST_REGISTER_PORTABLE)
            try:
                dptr = rt.host_get_device_pointer(ptr)
            except HipError:
                rt.host_unregister(ptr)
                raise
        heap = next(h for h in self.heaps if h.kind is BufferKind.HOST) if any(
            h.kind is BufferKind.HOST for h in self.heaps) else self.heaps[0]
        native = HipMemory(dptr, size, BufferKind.HOST_REGISTERED, self.device.ordinal, host_ptr=ptr, owner=owner)
        self._account(heap, size)
        return Buffer(self, heap, size, native, memory_type=PINNED_MEMORY, kind=BufferKind.HOST_REGISTERED)

    def trim(self) -> None:
        """Give the stream-ordered pool's unused memory back to the device."""
        if self._pool is not None:
            self.device.synchronize()
            try:
                self.runtime.mem_pool_trim_to(self._pool, 0)
            except HipError:
                pass

    # -- backend interface -------------------------------------------------------------------------

    def _allocate(self, heap: Heap, nbytes: int) -> HipMemory:
        kind = self.requested_kind(heap)
        rt, dev = self.runtime, self.device
        with dev.activate():
            if kind is BufferKind.DEVICE:
                return HipMemory(rt.malloc(nbytes), nbytes, kind, dev.ordinal)
            if kind is BufferKind.ASYNC:
                if self._pool is None:
                    self._pool = rt.default_mem_pool(dev.ordinal)
                return HipMemory(rt.malloc_from_pool_async(nbytes, self._pool, dev.stream), nbytes, kind, dev.ordinal)
            if kind is BufferKind.MANAGED:
                ptr = rt.malloc_managed(nbytes, hip.MEM_ATTACH_GLOBAL)
                try:
                    rt.mem_prefetch_async(ptr, nbytes, dev.ordinal, dev.stream)
                except HipError:
                    pass  # advice only
                return HipMemory(ptr, nbytes, kind, dev.ordinal, host_ptr=ptr)
            if kind is BufferKind.HOST:
                coherent = bool(heap.memory_type & MemoryType.HOST_COHERENT)
                flags = PINNED_FLAGS | (hip.HOST_MALLOC_COHERENT if coherent else hip.HOST_MALLOC_NON_COHERENT)
                host_ptr = rt.host_malloc(nbytes, flags)
                try:
                    dptr = rt.host_get_device_pointer(host_ptr)
                except HipError:
                    rt.host_free(host_ptr)
                    raise
                return HipMemory(dptr, nbytes, kind, dev.ordinal, host_ptr=host_ptr, coherent=coherent)
        raise IncompatibleBufferError(f"{dev.name} cannot allocate buffers of kind {kind.value}")

    def _hip_free(self, native: HipMemory) -> None:
        """The one HIP free of ``native``, by kind; never twice."""
        if native.freed or native.kind is BufferKind.EXTERNAL:
            return
        native.freed = True
        rt, kind = self.runtime, native.kind
        self.frees[kind] = self.frees.get(kind, 0) + 1
        with self.device.activate():
            if kind in (BufferKind.DEVICE, BufferKind.MANAGED):
                rt.free(native.ptr)
            elif kind is BufferKind.ASYNC:
                rt.free_async(native.ptr, self.device.stream)
            elif kind is BufferKind.HOST:
                rt.host_free(native.host_ptr)
            elif kind is BufferKind.HOST_REGISTERED:
                rt.host_unregister(native.host_ptr)
                native.owner = None

    def _free(self, heap: Heap, native: HipMemory) -> None:
        try:
            self._hip_free(native)
        except HipError as exc:
            self.free_failures.append((native.kind, native.ptr, exc))
            warnings.warn(f"{self.device.name}: freeing {native!r} failed: {exc}", RuntimeWarning, stacklevel=2)
