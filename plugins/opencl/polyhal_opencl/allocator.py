"""CLAllocator: ``cl.Buffer`` memory in up to two heaps, behind a bounded caching pool.

Heaps, and what they mean:

``DEVICE_LOCAL`` (kind DEVICE)
    A plain ``cl.Buffer``: wherever the driver keeps device memory (VRAM on a discrete GPU; on
    a CPU device such as PoCL, ordinary host memory that only OpenCL addresses). Not mappable:
    the host reaches it with ``write``/``read`` (``enqueue_copy``).
``DEVICE_LOCAL | HOST_VISIBLE | HOST_COHERENT`` (kind HOST; plus HOST_CACHED on CPU devices)
    A ``cl.Buffer`` made with ``CL_MEM_ALLOC_HOST_PTR``: memory the driver allocates so that the
    host can map it, kept mapped for the buffer's whole life (see :meth:`CLAllocator.mapping`).
    Offered only on devices with host-unified memory (CPU devices, integrated GPUs), where that
    memory *is* the device's memory, so a kernel and a host view see the same bytes once the
    queue has finished: that is what makes a persistent mapping coherent. On a discrete GPU a
    persistent mapping of ALLOC_HOST_PTR memory may be a staging copy that kernels never see
    (the OpenCL spec leaves kernel access to a mapped buffer undefined), so there this heap is
    not offered rather than offered dishonestly; ``Tensor.numpy()`` copies instead.

Both heaps cap one allocation at ``CL_DEVICE_MAX_MEM_ALLOC_SIZE`` (the core refuses larger
requests with IncompatibleBufferError naming the limit).

The pool: freed buffers go to size-class free lists (four classes per power of two, so at most
25% slack) instead of back to the driver, because ``clCreateBuffer`` plus first-touch is far
slower than reuse and plans free and reallocate their outputs every run. Reuse is safe without
events because the device has one in-order queue: everything enqueued on a recycled buffer runs
after everything enqueued on it before. The pool is bounded (``POLYHAL_OPENCL_POOL_BYTES``,
default min(256 MiB, global memory / 8); 0 disables it); :meth:`CLAllocator.trim` really
releases every cached buffer, and an allocation that fails trims and retries once.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.hal.allocator import Allocator
from polyhal.hal.buffer import Buffer
from polyhal.hal.flags import BUFFER_USAGE, MAPPABLE_BUFFER_USAGE, BufferKind, BufferUsage, MemoryType
from polyhal.hal.records import Heap

from polyhal_opencl.errors import check
from polyhal_opencl.settings import OpenCLSettings

# pyopencl is imported inside the functions that use it: without pyopencl the plugin still imports,
# lists no device and says why (plugin.enumerate_devices).

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the OpenCL device; its module imports this one

#: Smallest pooled size class; smaller requests are rounded up to it.
MIN_CLASS = 256
#: Cached buffers kept per size class at most.
MAX_PER_CLASS = 32

#: Buffers (not images: kernels take buffers), any sharing, no mapping.
DEVICE_USAGE = BUFFER_USAGE
HOST_USAGE = MAPPABLE_BUFFER_USAGE


def is_unified(cl_device: Any) -> bool:
    """True when the device's memory is the host's (CPU devices, integrated GPUs)."""
    import pyopencl as cl

    if cl_device.type & cl.device_type.CPU:
        return True
    try:
        return bool(cl_device.host_unified_memory)  # deprecated in OpenCL 2.0, still answered
    except Exception:  # noqa: BLE001
        return False


def heaps_for(cl_device: Any) -> tuple[Heap, ...]:
    """The heaps a device honestly serves (see the module docstring); device queries only."""
    import pyopencl as cl

    max_alloc = int(cl_device.max_mem_alloc_size)
    align = max(int(cl_device.mem_base_addr_align) // 8, 64)  # reported in bits
    heaps = [Heap(MemoryType.DEVICE_LOCAL, DEVICE_USAGE, max_alloc, BufferKind.DEVICE, align)]
    if is_unified(cl_device):
        host = MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE | MemoryType.HOST_COHERENT
        if cl_device.type & cl.device_type.CPU:
            host |= MemoryType.HOST_CACHED  # CPU caches sit in front of it, as for any host memory
        heaps.append(Heap(host, HOST_USAGE, max_alloc, BufferKind.HOST, align))
    return tuple(heaps)


def size_class(nbytes: int, limit: int) -> int:
    """The pooled size for a request: the next of 1, 1.25, 1.5, 1.75 times a power of two (at
    least :data:`MIN_CLASS`), never above ``limit`` (the heap's largest allocation)."""
    if nbytes <= MIN_CLASS:
        return min(MIN_CLASS, limit)
    top = 1 << (nbytes - 1).bit_length()  # next power of two >= nbytes
    step = top // 8  # classes between top/2 and top are top/2 + k*step
    size = -(-nbytes // step) * step
    return min(max(size, nbytes), limit)


class BufferPool:
    """Free lists of ``cl.Buffer`` per (heap, size class), bounded in total bytes."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.cached_bytes = 0
        self.hits = self.misses = 0
        self._free: dict[tuple[int, int], list[Any]] = defaultdict(list)
        self._lock = threading.Lock()

    def take(self, key: tuple[int, int]) -> Any | None:
        """A cached buffer for ``(memory type, size class)``, or None."""
        with self._lock:
            bucket = self._free.get(key)
            if bucket:
                self.hits += 1
                self.cached_bytes -= key[1]
                return bucket.pop()
            self.misses += 1
            return None

    def give(self, key: tuple[int, int], native: Any) -> bool:
        """Cache ``native``; False when the pool is full (the caller releases it)."""
        with self._lock:
            bucket = self._free[key]
            if self.cached_bytes + key[1] > self.limit_bytes or len(bucket) >= MAX_PER_CLASS:
                return False
            bucket.append(native)
            self.cached_bytes += key[1]
            return True

    def drain(self) -> list[Any]:
        """Empty the pool; returns the buffers for the caller to release."""
        with self._lock:
            out = [b for bucket in self._free.values() for b in bucket]
            self._free.clear()
            self.cached_bytes = 0
            return out


def _pool_limit(cl_device: Any) -> int:
    limit = OpenCLSettings.from_env().pool_bytes
    if limit is not None:
        return limit
    return min(256 << 20, int(cl_device.global_mem_size) // 8)


class CLAllocator(Allocator):
    """``cl.Buffer`` allocations from the heaps of :func:`heaps_for`, through a :class:`BufferPool`.

    The native handle of every buffer is its ``cl.Buffer`` (possibly larger than asked: its
    size class). Host-visible buffers are mapped once, on first :meth:`mapping`, and stay mapped
    until the ``cl.Buffer`` is really released.
    """

    def __init__(self, device: "Device", heaps: tuple[Heap, ...]) -> None:
        super().__init__(device, heaps)
        self.context = device.context
        self.pool = BufferPool(_pool_limit(device.cl_device))
        self._maps: dict[int, np.ndarray] = {}  # cl_mem handle -> persistent uint8 mapping
        self._closed = False
        #: cl_mem handle -> the live Buffer using it (DLPack imports look our own memory up here).
        self.live: weakref.WeakValueDictionary[int, Buffer] = weakref.WeakValueDictionary()

    def allocate(self, nbytes: int, memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
                 usage: BufferUsage = BufferUsage.DEFAULT) -> Buffer:
        """As :meth:`polyhal.Allocator.allocate`; also records the buffer in :attr:`live`."""
        buffer = super().allocate(nbytes, memory_type, usage)
        self.live[buffer.native.int_ptr] = buffer
        return buffer

    # -- backend interface ---------------------------------------------------------------------

    def _allocate(self, heap: Heap, nbytes: int) -> Any:
        size = size_class(nbytes, heap.max_allocation_size)
        native = self.pool.take((int(heap.memory_type), size))
        if native is not None:
            return native
        try:
            return self._create(heap, size)
        except MemoryError:
            if not self.trim():  # nothing cached to give back: a real out-of-memory
                raise
            return self._create(heap, size)

    def _create(self, heap: Heap, size: int) -> Any:
        import pyopencl as cl

        flags = cl.mem_flags.READ_WRITE
        if heap.memory_type & MemoryType.HOST_VISIBLE:
            flags |= cl.mem_flags.ALLOC_HOST_PTR
        with check(f"allocating {size} bytes of {heap.memory_type.describe()} on {self.device.name}",
                   builtin_memory_error=True):
            return cl.Buffer(self.context, flags, size)

    def _free(self, heap: Heap, native: Any) -> None:
        if self._closed or not self.pool.give((int(heap.memory_type), native.size), native):
            self._really_release(native)

    # -- pool and mappings ----------------------------------------------------------------------

    def _really_release(self, native: Any) -> None:
        # Dropping our references (and the mapping's) releases the cl_mem at once, unless a
        # stale view still holds it: a pyopencl array or mapped numpy view of a released
        # tensor then keeps the memory alive instead of pointing at freed memory, which an
        # explicit cl.Buffer.release() would do (and any later touch would crash the process).
        self._maps.pop(native.int_ptr, None)

    def trim(self) -> int:
        """Release every cached buffer to the driver; returns the bytes released."""
        natives = self.pool.drain()
        released = sum(n.size for n in natives)
        for native in natives:
            self._really_release(native)
        return released

    def close(self) -> None:
        """Trim and stop caching: buffers freed from now on go straight back to the driver."""
        self._closed = True
        self.trim()

    def mapping(self, native: Any) -> np.ndarray:
        """The persistent whole-buffer uint8 mapping of a host-visible ``cl.Buffer``.

        Made on first use with a blocking map (which, on the in-order queue, also waits for all
        earlier work); the caller finishes the queue before handing it out again, so the host
        sees every kernel's writes. Valid until the ``cl.Buffer`` is really released.
        """
        key = native.int_ptr
        view = self._maps.get(key)
        if view is None:
            import pyopencl as cl

            flags = cl.map_flags.READ | cl.map_flags.WRITE
            with check(f"mapping {native.size} bytes on {self.device.name}"):
                view, _event = cl.enqueue_map_buffer(self.device.queue, native, flags, 0, (native.size,),
                                                     np.uint8, is_blocking=True)
            self._maps[key] = view
        return view

    def forget_mapping(self, native: Any) -> None:
        """Drop the mapping of a ``cl.Buffer`` this allocator did not make (a DLPack sub-buffer)."""
        self._maps.pop(native.int_ptr, None)
