"""Buffers: a range of memory made by an allocator, with its memory type, usage and kind."""

from __future__ import annotations

import operator
import threading
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.errors import MappingError
from polyhal.hal.flags import BufferKind, BufferUsage, MemoryAccess, MemoryType

if TYPE_CHECKING:
    from polyhal.hal.allocator import Allocator
    from polyhal.hal.records import Heap


class Buffer:
    """Memory owned by an :class:`~polyhal.hal.allocator.Allocator` (or imported from elsewhere).

    ``native`` is the backend's handle (a numpy byte array on the CPU, a ``cl.Buffer`` on OpenCL,
    a cupy memory pointer on CUDA). A buffer goes back to the allocator that made it when
    :meth:`release` is called, when a ``with`` block ends, or when it is garbage collected, so the
    allocator's accounting always balances.
    """

    __slots__ = ("allocator", "heap", "nbytes", "memory_type", "usage", "allowed_access", "kind", "native",
                 "_finalizer", "_holds", "_release_pending", "__weakref__")

    def __init__(
        self,
        allocator: "Allocator",
        heap: "Heap",
        nbytes: int,
        native: Any,
        *,
        memory_type: MemoryType | None = None,
        usage: BufferUsage | None = None,
        kind: BufferKind | None = None,
        allowed_access: MemoryAccess = MemoryAccess.ALL,
        on_release: Any = None,
    ) -> None:
        self.allocator = allocator
        self.heap = heap
        self.nbytes = nbytes
        self.native = native
        self.memory_type = heap.memory_type if memory_type is None else memory_type
        #: What the buffer may be used for (IREE's allowed usage): what was asked plus what its
        #: heap grants (see Heap.buffer_usage); None: the heap's usage for BufferUsage.DEFAULT.
        self.usage = heap.buffer_usage(BufferUsage.DEFAULT) if usage is None else usage
        #: How the host may access a mapping (IREE's allowed access): READ for read-only memory.
        self.allowed_access = allowed_access
        self.kind = heap.kind if kind is None else kind
        # The finalizer must not reference self; it holds what freeing needs.
        self._finalizer = weakref.finalize(self, on_release or allocator._release, heap, nbytes, native)
        self._holds = 0  # DLPack consumers using the memory (see hold)
        self._release_pending = False

    @property
    def device(self):
        """The :class:`~polyhal.hal.device.Device` whose allocator made this buffer."""
        return self.allocator.device

    @property
    def released(self) -> bool:
        """True once :meth:`release` was called (or the memory was freed): polyhal no longer uses it."""
        return self._release_pending or not self._finalizer.alive

    def hold(self, *keep: Any) -> "BufferHold":
        """A token that keeps this buffer's memory allocated, and counted live by its allocator,
        for as long as the token exists, even across :meth:`release` (which then only marks the
        buffer released). DLPack exports give one to the consumer, so that memory a consumer
        still reads is never freed under it. ``keep``: other objects the token keeps alive."""
        return BufferHold(self, keep)

    @property
    def host_visible(self) -> bool:
        return bool(self.memory_type & MemoryType.HOST_VISIBLE)

    def release(self) -> None:
        """Return the memory now (idempotent). Views and mappings of it become invalid.

        While a DLPack consumer holds the memory (see :meth:`hold`) the buffer is marked released
        at once, and the memory is returned when the last consumer lets go.
        """
        with _hold_lock:
            if self._holds:
                self._release_pending = True
                return
        self._finalizer()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def map(self, access: MemoryAccess = MemoryAccess.READ | MemoryAccess.WRITE, offset: int = 0,
            length: int | None = None) -> np.ndarray:
        """Map ``[offset, offset+length)`` for host access; returns a uint8 numpy array.

        As IREE's ``iree_hal_buffer_map_range``, a map needs memory that is ``HOST_VISIBLE``, a
        usage with ``MAPPING_SCOPED`` or ``MAPPING_PERSISTENT`` (host-visible heaps grant both to
        every buffer; an allocation with ``MAPPING_OPTIONAL`` may come back without them: check
        ``buffer.usage`` and copy with ``Device.read``/``write`` instead), ``access`` within the
        buffer's ``allowed_access``, and a range inside the buffer. Without ``WRITE`` the array
        is read-only. ``length`` None: to the end of the buffer.

        The mapping is persistent: the array stays valid until the buffer is released. Each map
        first waits for the work queued on the device, so the host sees every device write made
        before it; device work queued after a host write sees that write. polyhal has no
        flush/invalidate step: its backends' host-visible memory is coherent at those two
        points, non-coherent (``HOST_CACHED`` without ``HOST_COHERENT``) memory included (HIP's
        non-coherent pinned memory is coherent at kernel boundaries and synchronization). What
        is not guaranteed is host and device touching the same bytes concurrently: map again
        after queued work to see its writes, and do not write through an array while queued
        work reads the buffer.
        """
        if self.released:
            raise MappingError(f"cannot map {self!r}: it was released")
        if not self.host_visible:
            raise MappingError(
                f"buffer of memory type {self.memory_type.describe()} on {self.device.name} is not "
                "HOST_VISIBLE and cannot be mapped; allocate it with MemoryType.HOST_VISIBLE, or copy "
                "it to the host with Tensor.numpy()"
            )
        if not self.usage & (BufferUsage.MAPPING_SCOPED | BufferUsage.MAPPING_PERSISTENT):
            raise MappingError(
                f"buffer of usage {self.usage.describe()} on {self.device.name} was not allocated for "
                "mapping; allocate it with usage | BufferUsage.MAPPING (MAPPING_SCOPED) from a heap that "
                f"allows it (this one allows {self.heap.allowed_usage.describe()}), or copy it with "
                "Device.read / Tensor.numpy()"
            )
        access = MemoryAccess(access)
        if not access & (MemoryAccess.READ | MemoryAccess.WRITE):
            raise MappingError(f"mapping access {access.describe()} has neither READ nor WRITE; pass "
                               "MemoryAccess.READ, MemoryAccess.WRITE or both")
        if access & ~self.allowed_access & MemoryAccess.ALL:
            raise MappingError(f"{self!r} allows only {self.allowed_access.describe()} access (read-only "
                               f"memory) and cannot be mapped for {access.describe()}; map it with MemoryAccess.READ")
        try:
            offset = operator.index(offset)
            length = self.nbytes - offset if length is None else operator.index(length)
        except TypeError:
            raise MappingError(f"mapping offset and length must be ints, got {offset!r} and {length!r}") from None
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise MappingError(f"mapping range [{offset}, {offset + length}) is outside the buffer of {self.nbytes} "
                               "bytes; pass offset >= 0 and length >= 0 with offset + length <= buffer.nbytes")
        view = self.device._map(self, offset, length, access)
        if not access & MemoryAccess.WRITE:
            view = view.view()
            view.flags.writeable = False
        return view

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return (
            f"<Buffer {self.nbytes} B {self.kind.value} {self.memory_type.describe()} "
            f"on {self.device.name}, {state}>"
        )


_hold_lock = threading.Lock()


class BufferHold:
    """What :meth:`Buffer.hold` returns: the buffer's memory stays allocated while this lives."""

    __slots__ = ("buffer", "keep")

    def __init__(self, buffer: Buffer, keep: tuple = ()) -> None:
        with _hold_lock:
            buffer._holds += 1
        self.buffer = buffer
        self.keep = keep

    def __del__(self, _lock: threading.Lock = _hold_lock) -> None:  # bound now: it may run at shutdown
        buffer = self.buffer
        with _lock:
            buffer._holds -= 1
            free = not buffer._holds and buffer._release_pending
        if free:
            buffer._finalizer()
