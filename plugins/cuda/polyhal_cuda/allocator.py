"""CUDAAllocator: every CUDA memory type, each buffer recording its :class:`~polyhal.BufferKind`.

Heaps (what :func:`heaps_for` registers), in the order the core prefers them:

``DEVICE_LOCAL`` — kind DEVICE or ASYNC (``POLYHAL_CUDA_POOL``, a policy choice)
    GPU memory. ``caching`` (default): a private ``cupy.cuda.MemoryPool`` — blocks are kept
    per stream after they are freed and reused by later allocations on the same stream, so
    reuse is ordered without events (cupy's own design). ``async``: CUDA's stream-ordered
    pool (``cudaMallocFromPoolAsync`` / ``cudaFreeAsync`` on the device's stream), buffers of
    kind ASYNC. Either kind can also be asked for per allocation:
    ``allocator.allocate(n, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC)``.
``DEVICE_LOCAL | HOST_VISIBLE | HOST_COHERENT`` — kind MANAGED
    ``cudaMallocManaged`` memory, mappable by the host (the mapping is the pointer itself).
    An allocation never asks CUDA for more managed memory than the device has free
    (``cudaMemGetInfo``, after trimming our pool): an over-subscribing managed allocation can
    hang the GPU rather than fail, so we refuse it with an out-of-memory error instead.
``HOST_LOCAL | DEVICE_VISIBLE`` — kind HOST
    Pinned host memory (``cudaHostAlloc``, portable and mapped): the host maps it, kernels
    read it over PCIe/NVLink at the same address (unified addressing).

Why cupy's pool and not the core's :class:`~polyhal.hal.adaptors.CachingPoolAdaptor`: cupy's
pool sub-allocates -- it splits large chunks into blocks and merges them again when they are
freed, best fit by size bin -- so one ``cudaMalloc`` serves many sizes and a freed 1 GiB block can
serve a 256 MiB request; the core's adaptor cannot split (a native handle is opaque to it) and
caches whole blocks per 512-byte size class, which holds more memory for the varied sizes of a
plan's buffers. cupy's pool also keeps its free lists per stream (reuse is ordered by the stream
without events) and allocates in compiled code. The core's adaptors still stack on top
(``POLYHAL_ALLOCATOR=pool,stats,...`` or the ``wrap_allocator`` hook) for limits, statistics or
logging.

Buffers imported through DLPack are kind EXTERNAL and are never freed by polyhal (see
:meth:`polyhal_cuda.device.CUDADevice.import_dlpack`).

Every native handle is a :class:`CUDAMemory`: the address, the size, the kind and the cupy
object that owns the memory; freeing drops that owner (the pool or CUDA takes it back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polyhal.errors import IncompatibleBufferError
from polyhal.hal.flags import BufferKind, MemoryType
from polyhal.hal.records import Heap

from polyhal_cuda.errors import OUT_OF_MEMORY_STATUS, check
from polyhal_gpu.memory import (ALIGNMENT, DEVICE_USAGE, HOST_USAGE, MANAGED_MEMORY, PINNED_MEMORY,
                                          GPUAllocator, host_memory_bytes)

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

__all__ = ["ALIGNMENT", "DEVICE_USAGE", "HOST_USAGE", "MANAGED_MEMORY", "MANAGED_RESERVE", "PINNED_MEMORY",
           "CUDAAllocator", "CUDAMemory", "heaps_for"]

#: Managed allocations leave at least this much device memory free (CUDA's own needs).
MANAGED_RESERVE = 256 << 20


def array_view(ptr: int, shape: tuple, dtype: Any, owner: Any, device_id: int) -> Any:
    """A ``cupy.ndarray`` of ``shape`` and ``dtype`` over device memory at ``ptr`` that ``owner``
    keeps alive (a kernel's scratch, for one): no allocation, no copy."""
    import cupy as cp
    import numpy as np

    nbytes = max(int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, nbytes, owner, device_id), 0))


def heaps_for(limits: dict, pool: str) -> tuple[Heap, ...]:
    """The heaps of a device with ``limits`` (see :func:`polyhal_cuda.plugin.limits`)."""
    total = int(limits["global_mem_bytes"]) or 1 << 30
    device_kind = BufferKind.ASYNC if pool == "async" else BufferKind.DEVICE
    heaps = [Heap(MemoryType.DEVICE_LOCAL, DEVICE_USAGE, total, device_kind, ALIGNMENT)]
    if limits.get("managed_memory", True):
        heaps.append(Heap(MANAGED_MEMORY, HOST_USAGE, total, BufferKind.MANAGED, ALIGNMENT))
    if limits.get("can_map_host_memory", True):
        heaps.append(Heap(PINNED_MEMORY, HOST_USAGE, host_memory_bytes(), BufferKind.HOST, ALIGNMENT))
    return tuple(heaps)


class CUDAMemory:
    """The native handle of a CUDA buffer: ``ptr`` (device address; for pinned memory also
    the host address), ``nbytes``, ``kind`` and ``owner`` (the cupy object holding the memory,
    or for imports the DLPack import keeping the producer's memory alive)."""

    __slots__ = ("ptr", "nbytes", "kind", "owner", "device_id", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, kind: BufferKind, owner: Any, device_id: int) -> None:
        self.ptr, self.nbytes, self.kind, self.owner, self.device_id = ptr, nbytes, kind, owner, device_id

    def __repr__(self) -> str:
        return f"<CUDAMemory {self.kind.value} {self.nbytes} B at {self.ptr:#x} on cuda:{self.device_id}>"


class CUDAAllocator(GPUAllocator):
    """Allocations of every memory type for one :class:`~polyhal_cuda.device.CUDADevice`;
    ``allocate(..., kind=BufferKind.ASYNC)`` (or DEVICE) picks the pool of a device-local buffer
    regardless of ``POLYHAL_CUDA_POOL`` (:class:`~polyhal_gpu.memory.GPUAllocator`)."""

    async_pool_limit = "async_pool_supported"
    no_async_pool = "{device} has no stream-ordered memory pool (CUDA 11.2+ on a supported platform); allocate " \
                    "kind=DEVICE instead"

    def __init__(self, device: "Device", heaps: tuple[Heap, ...]) -> None:
        import cupy

        super().__init__(device, heaps)
        self.device: "Device" = device
        #: cupy's caching pool, private to this allocator (cupy's own default pool is untouched).
        self.pool = cupy.cuda.MemoryPool()

    # -- public ------------------------------------------------------------------------------------

    def trim(self) -> None:
        """Give every cached block back to CUDA (caching pool and stream-ordered pool)."""
        from cupy.cuda import runtime

        dev = self.device
        with dev.activate():
            dev.stream.synchronize()
            self.pool.free_all_blocks()
            if dev.spec.limits.get("async_pool_supported", False):
                try:
                    runtime.memPoolTrimTo(runtime.deviceGetMemPool(dev.ordinal), 0)
                except Exception:  # noqa: BLE001 - trimming is best effort
                    pass

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the GPU, as CUDA reports them."""
        from cupy.cuda import runtime

        with self.device.activate():
            return runtime.memGetInfo()

    # -- backend interface ---------------------------------------------------------------------

    def _allocate(self, heap: Heap, nbytes: int) -> CUDAMemory:
        kind = self.requested_kind(heap)
        dev = self.device
        with dev.activate():
            try:
                if kind is BufferKind.DEVICE:
                    mp = self.pool.malloc(nbytes)
                    return CUDAMemory(mp.ptr, nbytes, kind, mp, dev.ordinal)
                if kind is BufferKind.ASYNC:
                    return self._async(nbytes)
                if kind is BufferKind.MANAGED:
                    return self._managed(nbytes)
                if kind is BufferKind.HOST:
                    return self._pinned(nbytes)
            except MemoryError as exc:
                raise MemoryError(f"{exc}; {self._gpu_free_text()}") from exc
        raise IncompatibleBufferError(f"{dev.name} cannot allocate buffers of kind {kind}")

    def _gpu_free_text(self) -> str:
        try:
            free, total = self.memory_info()
            return (f"the GPU has {free} of {total} bytes free; polyhal's pool holds "
                    f"{self.pool.total_bytes()} bytes ({self.pool.used_bytes()} in use)")
        except Exception:  # noqa: BLE001
            return "GPU memory information unavailable"

    def _async(self, nbytes: int) -> CUDAMemory:
        from cupy.cuda import memory

        with check(f"allocating {nbytes} bytes from the stream-ordered pool of {self.device.name}",
                   builtin_memory_error=True):
            mem = memory.MemoryAsync(nbytes, self.device.stream)
        return CUDAMemory(mem.ptr, nbytes, BufferKind.ASYNC, mem, self.device.ordinal)

    def _managed(self, nbytes: int) -> CUDAMemory:
        from cupy.cuda import memory, runtime

        free, _total = runtime.memGetInfo()
        if nbytes > free - MANAGED_RESERVE:
            self.pool.free_all_blocks()  # our cached blocks count as used: give them back first
            free, _total = runtime.memGetInfo()
        if nbytes > free - MANAGED_RESERVE:
            raise MemoryError(f"refused to ask CUDA for {nbytes} bytes of managed memory: only {free} bytes of "
                              f"device memory are free (less a {MANAGED_RESERVE >> 20} MiB reserve), and "
                              "over-subscribed managed memory can stall the GPU instead of failing")
        with check(f"allocating {nbytes} bytes of managed memory on {self.device.name}", builtin_memory_error=True):
            mem = memory.ManagedMemory(nbytes)
        return CUDAMemory(mem.ptr, nbytes, BufferKind.MANAGED, mem, self.device.ordinal)

    def _pinned(self, nbytes: int) -> CUDAMemory:
        from cupy.cuda import pinned_memory, runtime

        flags = runtime.hostAllocPortable | runtime.hostAllocMapped
        try:
            mem = pinned_memory.PinnedMemory(nbytes, flags)
        except runtime.CUDARuntimeError as exc:
            if exc.status == OUT_OF_MEMORY_STATUS:
                raise MemoryError(f"cudaHostAlloc of {nbytes} bytes of pinned host memory failed: {exc}") from exc
            raise
        return CUDAMemory(mem.ptr, nbytes, BufferKind.HOST, mem, self.device.ordinal)

    def _free(self, heap: Heap, native: CUDAMemory) -> None:
        # Dropping the owner returns the memory: the caching pool keeps the block for reuse on
        # the stream it was allocated on; MemoryAsync frees on its stream (stream-ordered);
        # managed and pinned memory go back to CUDA.
        native.owner = None
