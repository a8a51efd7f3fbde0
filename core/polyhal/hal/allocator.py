"""Allocators: the public methods validate and account; backends implement the private ones."""

from __future__ import annotations

import functools
import operator
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polyhal.errors import IncompatibleBufferError, OutOfMemoryError
from polyhal.hal.buffer import Buffer
from polyhal.hal.flags import BufferCompatibility, BufferUsage, MemoryType
from polyhal.hal.records import Heap

if TYPE_CHECKING:
    from polyhal.hal.device import Device


@dataclass
class HeapStatistics:
    """Accounting for one heap (memory type) of an allocator."""

    live_bytes: int = 0
    peak_bytes: int = 0
    live_count: int = 0
    total_allocations: int = 0
    total_frees: int = 0


@dataclass
class AllocatorStatistics:
    """Live bytes, peak and counts, in total and per memory type."""

    by_memory_type: dict[MemoryType, HeapStatistics] = field(default_factory=dict)

    @property
    def live_bytes(self) -> int:
        return sum(s.live_bytes for s in self.by_memory_type.values())

    @property
    def live_count(self) -> int:
        return sum(s.live_count for s in self.by_memory_type.values())

    @property
    def peak_bytes(self) -> int:
        return sum(s.peak_bytes for s in self.by_memory_type.values())

    def __str__(self) -> str:
        parts = [
            f"{mt.describe()}: {s.live_bytes} B in {s.live_count} buffers (peak {s.peak_bytes} B)"
            for mt, s in self.by_memory_type.items()
            if s.total_allocations
        ]
        return "; ".join(parts) or "nothing allocated"


#: Every bit each flag type defines (anything else in a request is refused).
_DEFINED_BITS = {kind: functools.reduce(operator.or_, map(int, kind.__members__.values()))
                 for kind in (MemoryType, BufferUsage)}


class Allocator:
    """Allocates buffers for one device from its heaps.

    Subclasses implement :meth:`_allocate` (return the native handle, or raise ``MemoryError``)
    and :meth:`_free`. Everything else — OPTIMAL resolution, compatibility checks, size limits,
    accounting and out-of-memory messages — lives here once for every backend.
    """

    def __init__(self, device: "Device", heaps: tuple[Heap, ...]) -> None:
        if not heaps:
            raise ValueError(f"allocator for {device.name} needs at least one heap")
        self.device = device
        self.heaps = tuple(heaps)
        self.statistics = AllocatorStatistics({h.memory_type: HeapStatistics() for h in self.heaps})
        self._lock = threading.Lock()
        self._heap_memo: dict[tuple[int, int], Heap | None] = {}
        self._usage_memo: dict[tuple[Heap, int], BufferUsage] = {}  # (heap, usage asked) -> buffer usage

    # -- queries -----------------------------------------------------------------------------

    def select_heap(self, memory_type: MemoryType, usage: BufferUsage = BufferUsage.DEFAULT) -> Heap | None:
        """The heap a request is served from, or None. OPTIMAL prefers the device-local heap.

        Memoized per (memory type, usage): flag-enum arithmetic is slow in Python, and every
        allocation (plan outputs included) asks this.
        """
        key = (int(memory_type), int(usage))
        try:
            return self._heap_memo[key]
        except KeyError:
            heap = self._heap_memo[key] = self._select_heap(memory_type, usage)
            return heap

    def _select_heap(self, memory_type: MemoryType, usage: BufferUsage) -> Heap | None:
        memory_type, usage = MemoryType(memory_type), BufferUsage(usage)
        fits = [h for h in self.heaps if h.serves(memory_type, usage)]
        if not fits:
            return None
        # An optional mapping is still a wish: heaps that can map it come first (sorts are stable).
        if memory_type & MemoryType.OPTIMAL:
            # Prefer fast device memory unless the usage asks for mapping.
            want_host = bool(usage & (BufferUsage.MAPPING_SCOPED | BufferUsage.MAPPING_PERSISTENT))
            fits.sort(key=lambda h: (not h.maps(usage),
                                     bool(h.memory_type & MemoryType.HOST_VISIBLE) != want_host,
                                     not (h.memory_type & MemoryType.DEVICE_LOCAL == MemoryType.DEVICE_LOCAL)))
        else:
            fits.sort(key=lambda h: not h.maps(usage))
        return fits[0]

    def query_buffer_compatibility(self, memory_type: MemoryType, usage: BufferUsage = BufferUsage.DEFAULT,
                                   nbytes: int | None = None) -> BufferCompatibility:
        """What can be done with such a buffer here; ``NONE`` when it cannot be allocated.

        The buffer's own usage (what :meth:`Buffer.map` checks) is the selected heap's
        :meth:`~polyhal.hal.records.Heap.buffer_usage` of ``usage``: an optional mapping may be
        dropped, and host-visible heaps add the mapping usages.
        """
        heap = self.select_heap(memory_type, usage)
        if heap is None or (nbytes is not None and not 0 < nbytes <= heap.max_allocation_size):
            return BufferCompatibility.NONE
        compat = BufferCompatibility.ALLOCATABLE | BufferCompatibility.IMPORTABLE | BufferCompatibility.EXPORTABLE
        if usage & BufferUsage.TRANSFER:
            compat |= BufferCompatibility.QUEUE_TRANSFER
        if usage & BufferUsage.DISPATCH_STORAGE:
            compat |= BufferCompatibility.QUEUE_DISPATCH
        return compat

    # -- allocation --------------------------------------------------------------------------

    def allocate(self, nbytes: int, memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
                 usage: BufferUsage = BufferUsage.DEFAULT) -> Buffer:
        """Allocate ``nbytes`` of ``memory_type`` for ``usage``; the buffer may have more bits
        (never fewer, but for an optional mapping: see :meth:`query_buffer_compatibility`)."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise IncompatibleBufferError(f"allocation size must be an int number of bytes, got {nbytes!r}")
        for flags, kind in ((memory_type, MemoryType), (usage, BufferUsage)):
            if not isinstance(flags, int) or isinstance(flags, bool):  # "HOST_VISIBLE", 2.0: int() would guess
                example = flags if isinstance(flags, str) and flags in kind.__members__ else next(iter(kind)).name
                raise IncompatibleBufferError(f"{kind.__name__} must be polyhal.{kind.__name__} flags, got {flags!r}; "
                                              f"write e.g. polyhal.{kind.__name__}.{example}")
            undefined = int(flags) & ~_DEFINED_BITS[kind]
            if undefined:  # a typo'd or foreign constant would otherwise be served as if it meant nothing
                raise IncompatibleBufferError(
                    f"{kind.__name__} {int(flags):#x} has bits {undefined:#x} that polyhal does not define; "
                    f"build it from polyhal.{kind.__name__} members")
        heap = self.select_heap(memory_type, usage)
        if heap is None:
            raise IncompatibleBufferError(
                f"{self.device.name} cannot allocate memory type {MemoryType(memory_type).describe()} with usage "
                f"{BufferUsage(usage).describe()}; it serves: "
                + ", ".join(f"{h.memory_type.describe()} ({h.allowed_usage.describe()})" for h in self.heaps)
                + ". Use one of those, or pick another device (polyhal devices lists them)"
            )
        if nbytes <= 0:
            raise IncompatibleBufferError(f"allocation size must be positive, got {nbytes} bytes")
        if nbytes > heap.max_allocation_size:
            raise IncompatibleBufferError(
                f"{nbytes} bytes exceeds the largest single allocation of {heap.max_allocation_size} bytes "
                f"for {heap.memory_type.describe()} on {self.device.name}; split the tensor or use another device"
            )
        try:
            native = self._allocate(heap, nbytes)
        except OutOfMemoryError:
            raise  # already says device, request and use (an adaptor's limit, a pool's upstream)
        except MemoryError as exc:
            raise out_of_memory(self, heap, nbytes, exc) from exc
        self._account(heap, nbytes)
        key = (heap, int(usage))
        granted = self._usage_memo.get(key)
        if granted is None:  # (flag-enum arithmetic is slow in Python, and plans allocate outputs every run)
            granted = self._usage_memo[key] = heap.buffer_usage(usage)
        return Buffer(self, heap, nbytes, native, usage=granted)

    def _account(self, heap: Heap, nbytes: int) -> None:
        with self._lock:
            s = self.statistics.by_memory_type[heap.memory_type]
            s.live_bytes += nbytes
            s.live_count += 1
            s.total_allocations += 1
            s.peak_bytes = max(s.peak_bytes, s.live_bytes)

    def _release(self, heap: Heap, nbytes: int, native: Any) -> None:
        """Called exactly once per buffer (by its finalizer): free and account."""
        try:
            self._free(heap, native)
        finally:
            with self._lock:
                s = self.statistics.by_memory_type[heap.memory_type]
                s.live_bytes -= nbytes
                s.live_count -= 1
                s.total_frees += 1

    # -- backend interface ---------------------------------------------------------------------

    def _allocate(self, heap: Heap, nbytes: int) -> Any:
        """Return the native handle of ``nbytes`` fresh bytes from ``heap``; raise MemoryError if none."""
        raise NotImplementedError

    def _free(self, heap: Heap, native: Any) -> None:
        """Give the native handle back. Must not raise for a handle it made."""
        raise NotImplementedError


def out_of_memory(allocator: Allocator, heap: Heap, nbytes: int, cause: BaseException) -> OutOfMemoryError:
    """The error for a backend's ``MemoryError`` (``cause``) on a request of ``nbytes`` from ``heap``."""
    return OutOfMemoryError(
        f"out of memory on {allocator.device.name}: could not allocate {nbytes} bytes of "
        f"{heap.memory_type.describe()}; in use by polyhal: {allocator.statistics}. Free buffers "
        f"(Buffer.release), use a smaller problem or another device ({cause})")
