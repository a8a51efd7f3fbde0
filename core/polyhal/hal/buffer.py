"""Buffers: a range of memory made by an allocator, with its memory type, usage and kind."""

from __future__ import annotations

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

    __slots__ = ("allocator", "heap", "nbytes", "memory_type", "usage", "kind", "native", "_finalizer", "_holds",
                 "_release_pending", "__weakref__")

    def __init__(
        self,
        allocator: "Allocator",
        heap: "Heap",
        nbytes: int,
        native: Any,
        *,
        memory_type: MemoryType | None = None,
        usage: BufferUsage = BufferUsage.DEFAULT,
        kind: BufferKind | None = None,
        on_release: Any = None,
    ) -> None:
        self.allocator = allocator
        self.heap = heap
        self.nbytes = nbytes
        self.native = native
        self.memory_type = heap.memory_type if memory_type is None else memory_type
        self.usage = usage
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

        Only host-visible buffers map. The mapping stays valid until the buffer is released;
        for non-coherent memory the backend flushes on :meth:`flush` (a no-op when coherent).
        """
        if self.released:
            raise MappingError("cannot map a released buffer")
        if not self.host_visible:
            raise MappingError(
                f"buffer of memory type {self.memory_type.describe()} on {self.device.name} is not "
                "HOST_VISIBLE and cannot be mapped; allocate it with MemoryType.HOST_VISIBLE, or copy "
                "it to the host with Tensor.numpy()"
            )
        length = self.nbytes - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise MappingError(f"mapping range [{offset}, {offset + length}) is outside the buffer of {self.nbytes} bytes")
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
