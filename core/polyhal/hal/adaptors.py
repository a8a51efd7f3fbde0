"""Allocator adaptors, in the manner of RAPIDS RMM's resource adaptors.

An adaptor is an :class:`~polyhal.hal.allocator.Allocator` over another one (its ``upstream``):
the device's own allocator, or another adaptor, so they stack::

    from polyhal.hal.adaptors import CachingPoolAdaptor, LimitingAdaptor, StatisticsAdaptor, set_device_allocator

    dev = polyhal.get_device("cpu:0")
    stats = StatisticsAdaptor(LimitingAdaptor(CachingPoolAdaptor(dev.allocator), limit=1 << 30))
    previous = set_device_allocator(dev, stats)     # new allocations go through the stack
    ...
    set_device_allocator(dev, previous)             # swap back at any time

=========================  ==========================================================================
RMM                        polyhal
=========================  ==========================================================================
``pool_memory_resource``   :class:`CachingPoolAdaptor` — freed blocks are kept per (heap, size class)
                           and handed out again (no sub-allocation: a native handle is opaque)
``statistics_resource_``   :class:`StatisticsAdaptor` — bytes and counts: current, peak, total;
``adaptor``                ``push_counters`` / ``pop_counters`` for scoped measurements
``limiting_resource_``     :class:`LimitingAdaptor` — a request beyond the limit raises
``adaptor``                ``OutOfMemoryError`` naming device, request and use
``logging_resource_``      :class:`LoggingAdaptor` — one CSV line per allocate / free
``adaptor``
``failure_callback_``      :class:`FaultInjectionAdaptor` — fails every k-th request (or those of a
``resource_adaptor``       size or memory type) with ``OutOfMemoryError``, to test cleanup paths
``do_allocate`` /          :meth:`AllocatorAdaptor.allocate_raw` / :meth:`~AllocatorAdaptor.deallocate_raw`:
``do_deallocate``          native memory without a :class:`~polyhal.hal.buffer.Buffer`
``set_current_device_``    :func:`set_device_allocator` (and the ``wrap_allocator`` hook, which lets a
``resource``               plugin install adaptors when a device is created)
=========================  ==========================================================================

Swapping is safe at any time, even with buffers alive: a buffer's finalizer is bound to the
allocator that made it, so it always returns there (a pool that is no longer installed still
takes its blocks back, and gives its cache back upstream when it is garbage collected).

Adaptors layer at the native level: an adaptor's ``_allocate`` asks its upstream for raw memory
(accounted upstream) and the public :meth:`allocate` wraps it in a buffer accounted here, so every
layer's ``statistics`` balance.
"""

from __future__ import annotations

import collections
import csv
import io
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from polyhal.config import parse_size  # noqa: F401  (re-exported: the allocator spec sizes)
from polyhal.errors import OutOfMemoryError, PluginError
from polyhal.hal.allocator import Allocator, AllocatorStatistics, out_of_memory
from polyhal.hal.buffer import Buffer
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.hal.records import Heap

if TYPE_CHECKING:
    from polyhal.hal.device import Device

__all__ = [
    "AllocatorAdaptor", "CachingPoolAdaptor", "Counters", "FaultInjectionAdaptor", "LimitingAdaptor", "LoggingAdaptor",
    "MemoryTypeRouter", "StatisticsAdaptor", "adaptor_chain", "get_device_allocator",
    "parse_adaptor_spec", "raw_allocate", "raw_deallocate", "set_device_allocator",
]


# --------------------------------------------------------------------------------------------------
# Raw (Buffer-less) allocation through any allocator: RMM's allocate / deallocate
# --------------------------------------------------------------------------------------------------

def raw_allocate(allocator: Allocator, heap: Heap, nbytes: int) -> Any:
    """``nbytes`` of native memory from ``heap`` of ``allocator``, accounted there; give it back
    with :func:`raw_deallocate` (same heap and size)."""
    if isinstance(allocator, AllocatorAdaptor):
        return allocator.allocate_raw(heap, nbytes)
    try:
        native = allocator._allocate(heap, nbytes)
    except OutOfMemoryError:
        raise
    except MemoryError as exc:
        raise out_of_memory(allocator, heap, nbytes, exc) from exc
    allocator._account(heap, nbytes)
    return native


def raw_deallocate(allocator: Allocator, heap: Heap, nbytes: int, native: Any) -> None:
    """Give back memory from :func:`raw_allocate` (frees and accounts)."""
    allocator._release(heap, nbytes, native)


# --------------------------------------------------------------------------------------------------
# The base adaptor
# --------------------------------------------------------------------------------------------------

class AllocatorAdaptor(Allocator):
    """An allocator over ``upstream`` (RMM's ``device_memory_resource`` adaptor).

    It serves the same device and heaps. Subclasses override :meth:`_allocate` (native memory for
    a request, usually from upstream) and :meth:`_deallocate` (which, unlike ``_free``, receives
    the size). Heap selection is memoized per (memory type, usage): heaps never change, and
    resolving flags costs tens of microseconds in Python.
    """

    def __init__(self, upstream: Allocator) -> None:
        if not isinstance(upstream, Allocator):
            raise TypeError(f"an allocator adaptor needs an upstream polyhal.Allocator, got {upstream!r}")
        super().__init__(upstream.device, upstream.heaps)
        self.upstream = upstream
        self._heap_memo: dict[tuple[int, int], Heap | None] = {}
        self._fast: dict[tuple[int, int], tuple[Heap, BufferUsage]] = {}
        # Statistics by heap identity: a MemoryType key would cost a Python-level hash per call.
        self._stats_of = {id(h): self.statistics.by_memory_type[h.memory_type] for h in self.heaps}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self.device.name} over {self.upstream!r}>"

    # -- heap selection and the allocation fast path ------------------------------------------------

    def select_heap(self, memory_type: MemoryType, usage: BufferUsage = BufferUsage.DEFAULT) -> Heap | None:
        key = (int(memory_type), int(usage))
        try:
            return self._heap_memo[key]
        except KeyError:
            heap = self._heap_memo[key] = self.upstream.select_heap(memory_type, usage)
            return heap

    def allocate(self, nbytes: int, memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
                 usage: BufferUsage = BufferUsage.DEFAULT) -> Buffer:
        """As :meth:`Allocator.allocate`; a request seen before skips re-validating its flags."""
        fast = self._fast.get((memory_type, usage))  # flags hash as their ints; anything else misses and is refused
        if fast is None or type(nbytes) is not int or not 0 < nbytes <= fast[0].max_allocation_size:
            buf = super().allocate(nbytes, memory_type, usage)  # validates, with its error messages
            self._fast[(int(memory_type), int(usage))] = (buf.heap, buf.usage)
            return buf
        heap, usage_flags = fast
        try:
            native = self._allocate(heap, nbytes)
        except OutOfMemoryError:
            raise
        except MemoryError as exc:  # a backend's own: the same error the validating path gives
            raise out_of_memory(self, heap, nbytes, exc) from exc
        self._account(heap, nbytes)
        return Buffer(self, heap, nbytes, native, usage=usage_flags)

    # -- RMM's allocate / deallocate ------------------------------------------------------------------

    def allocate_raw(self, heap: Heap, nbytes: int) -> Any:
        """Native memory without a Buffer (RMM's ``allocate``), accounted here."""
        try:
            native = self._allocate(heap, nbytes)
        except OutOfMemoryError:
            raise
        except MemoryError as exc:
            raise out_of_memory(self, heap, nbytes, exc) from exc
        self._account(heap, nbytes)
        return native

    def deallocate_raw(self, heap: Heap, nbytes: int, native: Any) -> None:
        """Give back memory from :meth:`allocate_raw` (RMM's ``deallocate``)."""
        self._release(heap, nbytes, native)

    # -- accounting ---------------------------------------------------------------------------------

    def _account(self, heap: Heap, nbytes: int) -> None:
        s = self._stats_of[id(heap)]
        with self._lock:
            s.live_bytes += nbytes
            s.live_count += 1
            s.total_allocations += 1
            if s.live_bytes > s.peak_bytes:
                s.peak_bytes = s.live_bytes

    def _release(self, heap: Heap, nbytes: int, native: Any) -> None:
        try:
            self._deallocate(heap, nbytes, native)
        finally:
            s = self._stats_of[id(heap)]
            with self._lock:
                s.live_bytes -= nbytes
                s.live_count -= 1
                s.total_frees += 1

    # -- what subclasses override ---------------------------------------------------------------------

    def _allocate(self, heap: Heap, nbytes: int) -> Any:
        return raw_allocate(self.upstream, heap, nbytes)

    def _deallocate(self, heap: Heap, nbytes: int, native: Any) -> None:
        raw_deallocate(self.upstream, heap, nbytes, native)

    def _free(self, heap: Heap, native: Any) -> None:
        raise NotImplementedError("adaptors give memory back through _deallocate, which knows the size")


def adaptor_chain(allocator: Allocator) -> list[Allocator]:
    """``allocator`` and its upstreams, outermost first (for display and tests)."""
    chain = [allocator]
    while isinstance(chain[-1], AllocatorAdaptor):
        chain.append(chain[-1].upstream)
    return chain


# --------------------------------------------------------------------------------------------------
# Caching pool
# --------------------------------------------------------------------------------------------------

def _drain(state: dict, heaps: dict, upstream: Allocator) -> int:
    """Give every cached block back upstream; returns the bytes given back. A pool's finalizer
    calls it too, so it must not reference the pool."""
    released = 0
    for heap_id, (by_size, _events) in state.items():
        for size, blocks in list(by_size.items()):
            while True:
                try:
                    native = blocks.pop()  # atomic: a concurrent allocation gets a block or a miss
                except IndexError:
                    break
                raw_deallocate(upstream, heaps[heap_id], size, native)
                released += size
    return released


class CachingPoolAdaptor(AllocatorAdaptor):
    """Keeps freed blocks and hands them out again (RMM's pool resource, CuPy's memory pool).

    Requests are rounded up to ``granularity`` bytes (a power of two; CuPy's 512 by default) and
    served from the freed blocks of that size class and heap; only a miss reaches upstream. When
    upstream is out of memory the cache is released and the request retried once. With
    ``max_cached_bytes``, blocks beyond it go back upstream instead of into the cache.

    ``cached_bytes`` is what the pool holds unused; upstream's statistics count it as live.

    The hit path takes no lock: a block moves with one ``list.pop`` / ``list.append`` (atomic)
    and accounting is one ``deque.append`` of the signed size (atomic), folded into
    ``statistics`` — live, peak and counts, exactly, in the order they happened — when they are
    read or every :attr:`FOLD_EVERY` events. A lock would cost as much as the rest of the path.
    """

    #: Accounting events kept per heap before they are folded into the statistics.
    FOLD_EVERY = 4096

    def __init__(self, upstream: Allocator, *, granularity: int = 512, max_cached_bytes: int | None = None) -> None:
        if granularity <= 0 or granularity & (granularity - 1):
            raise ValueError(f"pool granularity must be a power of two, got {granularity}")
        super().__init__(upstream)
        self.granularity = granularity
        self.max_cached_bytes = max_cached_bytes
        self._round = granularity - 1
        self._mask = -granularity
        self._heaps = {id(h): h for h in self.heaps}
        #: per heap: (size class -> free blocks, accounting events)
        self._state: dict[int, tuple[dict[int, list[Any]], collections.deque]] = {
            id(h): ({}, collections.deque()) for h in self.heaps}
        self.cache_misses = 0
        self._finalizer = weakref.finalize(self, _drain, self._state, self._heaps, upstream)

    # -- statistics: folded from the event log ------------------------------------------------------

    @property
    def statistics(self) -> AllocatorStatistics:  # type: ignore[override]
        self._fold()
        return self._statistics

    @statistics.setter
    def statistics(self, value: AllocatorStatistics) -> None:
        self._statistics = value

    def _fold(self) -> None:
        if "_state" not in self.__dict__:  # still in __init__
            return
        with self._lock:
            for heap_id, (_by_size, events) in self._state.items():
                n = len(events)
                if not n:
                    continue
                # n poplefts, in C; appends racing with this stay queued for the next fold
                taken = list(itertools.islice(iter(events.popleft, None), n))
                s = self._stats_of[heap_id]
                peak = max(itertools.accumulate(taken, initial=s.live_bytes))
                allocations = sum(map((0).__lt__, taken))
                s.live_bytes += sum(taken)
                s.live_count += 2 * allocations - n
                s.total_allocations += allocations
                s.total_frees += n - allocations
                if peak > s.peak_bytes:
                    s.peak_bytes = peak

    @property
    def cache_hits(self) -> int:
        """Allocations served from the cache."""
        return sum(s.total_allocations for s in self.statistics.by_memory_type.values()) - self.cache_misses

    @property
    def cached_bytes(self) -> int:
        """Bytes held in the cache, unused."""
        return sum(size * len(blocks) for by_size, _e in self._state.values() for size, blocks in list(by_size.items()))

    # -- allocation ---------------------------------------------------------------------------------

    def allocate_raw(self, heap: Heap, nbytes: int) -> Any:
        by_size, events = self._state[id(heap)]
        blocks = by_size.get((nbytes + self._round) & self._mask)
        if blocks:
            try:
                native = blocks.pop()
            except IndexError:  # another thread took the last one
                pass
            else:
                # No fold check here: frees check, and allocations without frees are bounded by memory.
                events.append(nbytes)
                return native
        native = self._allocate(heap, nbytes)
        self._account(heap, nbytes)
        return native

    def _account(self, heap: Heap, nbytes: int) -> None:
        events = self._state[id(heap)][1]
        events.append(nbytes)
        if len(events) > self.FOLD_EVERY:
            self._fold()

    def _release(self, heap: Heap, nbytes: int, native: Any) -> None:
        by_size, events = self._state[id(heap)]
        size = (nbytes + self._round) & self._mask
        blocks = by_size.get(size)
        if blocks is None:
            with self._lock:
                blocks = by_size.setdefault(size, [])
        if self.max_cached_bytes is None or self.cached_bytes + size <= self.max_cached_bytes:
            blocks.append(native)
        else:
            raw_deallocate(self.upstream, heap, size, native)
        events.append(-nbytes)
        if len(events) > 4096:  # FOLD_EVERY, inlined
            self._fold()

    deallocate_raw = _release  # one call less on the hot path

    def _allocate(self, heap: Heap, nbytes: int) -> Any:
        size = (nbytes + self._round) & self._mask
        blocks = self._state[id(heap)][0].get(size)
        if blocks:
            try:
                return blocks.pop()
            except IndexError:
                pass
        with self._lock:
            self.cache_misses += 1
        try:
            return raw_allocate(self.upstream, heap, size)
        except OutOfMemoryError:
            if not self.cached_bytes:
                raise
            self.release_cached()  # cached blocks of other sizes may be what upstream is missing
            return raw_allocate(self.upstream, heap, size)

    def release_cached(self) -> int:
        """Give every cached block back upstream; returns the bytes released (CuPy's free_all_blocks)."""
        return _drain(self._state, self._heaps, self.upstream)


# --------------------------------------------------------------------------------------------------
# Statistics, limit, logging
# --------------------------------------------------------------------------------------------------

@dataclass
class Counters:
    """RMM's statistics: bytes and allocation counts — current, peak and total."""

    current_bytes: int = 0
    peak_bytes: int = 0
    total_bytes: int = 0
    current_count: int = 0
    peak_count: int = 0
    total_count: int = 0


class StatisticsAdaptor(AllocatorAdaptor):
    """Counts what goes through it (RMM's ``statistics_resource_adaptor``).

    ``counters`` are for the innermost scope; :meth:`push_counters` opens a nested scope (its
    counters start at zero) and :meth:`pop_counters` closes it, returning its counters and folding
    them into the enclosing scope, as RMM does.
    """

    def __init__(self, upstream: Allocator) -> None:
        super().__init__(upstream)
        self._stack: list[Counters] = [Counters()]

    @property
    def counters(self) -> Counters:
        return replace(self._stack[-1])

    def push_counters(self) -> Counters:
        """Start a nested scope; returns the enclosing scope's counters so far."""
        with self._lock:
            outer = replace(self._stack[-1])
            self._stack.append(Counters())
        return outer

    def pop_counters(self) -> Counters:
        """End the innermost scope; its counters are returned and added to the enclosing scope."""
        with self._lock:
            if len(self._stack) == 1:
                raise RuntimeError("pop_counters without a matching push_counters")
            inner = self._stack.pop()
            outer = self._stack[-1]
            outer.peak_bytes = max(outer.peak_bytes, outer.current_bytes + inner.peak_bytes)
            outer.peak_count = max(outer.peak_count, outer.current_count + inner.peak_count)
            outer.current_bytes += inner.current_bytes
            outer.current_count += inner.current_count
            outer.total_bytes += inner.total_bytes
            outer.total_count += inner.total_count
        return inner

    def _account(self, heap: Heap, nbytes: int) -> None:
        super()._account(heap, nbytes)
        with self._lock:
            c = self._stack[-1]
            c.current_bytes += nbytes
            c.total_bytes += nbytes
            c.current_count += 1
            c.total_count += 1
            c.peak_bytes = max(c.peak_bytes, c.current_bytes)
            c.peak_count = max(c.peak_count, c.current_count)

    def _release(self, heap: Heap, nbytes: int, native: Any) -> None:
        try:
            super()._release(heap, nbytes, native)
        finally:
            with self._lock:
                c = self._stack[-1]
                c.current_bytes -= nbytes
                c.current_count -= 1


class LimitingAdaptor(AllocatorAdaptor):
    """Refuses to hold more than ``limit`` bytes at once (RMM's ``limiting_resource_adaptor``).

    A request that would exceed it raises :class:`~polyhal.errors.OutOfMemoryError` naming the
    device, the request, the limit and what is in use — the error an allocation policy's
    out-of-memory fallback reacts to, so a limit is also how to test that fallback.
    """

    def __init__(self, upstream: Allocator, limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"allocation limit must be a number of bytes >= 0, got {limit!r}")
        super().__init__(upstream)
        self.limit = limit
        self.used_bytes = 0

    def _allocate(self, heap: Heap, nbytes: int) -> Any:
        with self._lock:
            used = self.used_bytes
            if used + nbytes > self.limit:
                raise OutOfMemoryError(
                    f"out of memory on {self.device.name}: a request for {nbytes} bytes of "
                    f"{heap.memory_type.describe()} would exceed the allocation limit of {self.limit} bytes; "
                    f"in use: {used} bytes ({self.statistics}). Free buffers, raise the limit "
                    "(LimitingAdaptor(limit=...), POLYHAL_ALLOCATOR=limit=...) or use another device")
            self.used_bytes = used + nbytes
        try:
            return raw_allocate(self.upstream, heap, nbytes)
        except BaseException:
            with self._lock:
                self.used_bytes -= nbytes
            raise

    def _deallocate(self, heap: Heap, nbytes: int, native: Any) -> None:
        try:
            raw_deallocate(self.upstream, heap, nbytes, native)
        finally:
            with self._lock:
                self.used_bytes -= nbytes


class FaultInjectionAdaptor(AllocatorAdaptor):
    """Fails chosen allocations with :class:`~polyhal.errors.OutOfMemoryError`, for testing
    that every path that allocates cleans up and reports a polyhal error.

    A request fails when it is the ``every``-th one to pass the filters (``every=1``: all of
    them), is at least ``min_bytes``, and its heap has every bit of ``memory_type`` (``None``:
    any heap). ``injected`` counts the failures. ``POLYHAL_ALLOCATOR=fault=7`` installs one that
    fails every 7th allocation of every device.
    """

    def __init__(self, upstream: Allocator, every: int = 1, *, min_bytes: int = 0,
                 memory_type: MemoryType | None = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"fault injection needs every >= 1, got {every!r}")
        super().__init__(upstream)
        self.every, self.min_bytes, self.memory_type = every, min_bytes, memory_type
        self.calls = 0  # requests that passed the filters
        self.injected = 0

    def _allocate(self, heap: Heap, nbytes: int) -> Any:
        if nbytes >= self.min_bytes and (self.memory_type is None
                                         or heap.memory_type & self.memory_type == self.memory_type):
            with self._lock:
                self.calls += 1
                fail = self.calls % self.every == 0
                self.injected += fail
            if fail:
                raise OutOfMemoryError(
                    f"out of memory on {self.device.name}: injected failure of a request for {nbytes} bytes "
                    f"of {heap.memory_type.describe()} (FaultInjectionAdaptor, every {self.every})")
        return raw_allocate(self.upstream, heap, nbytes)


def _address(native: Any) -> int:
    """A printable address for a native handle (numpy, pyopencl, cupy), else its id."""
    iface = getattr(native, "__array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    for attr in ("int_ptr", "ptr"):
        value = getattr(native, attr, None)
        if isinstance(value, int):
            return value
    return id(native)


class LoggingAdaptor(AllocatorAdaptor):
    """Writes one CSV line per allocate and free (RMM's ``logging_resource_adaptor``).

    Columns: ``time,thread,action,device,memory_type,size,pointer``. ``sink`` is a path (appended
    to), a writable text file, or a :class:`logging.Logger` (lines at DEBUG); by default the
    ``polyhal.allocations`` logger.
    """

    HEADER = ("time", "thread", "action", "device", "memory_type", "size", "pointer")

    def __init__(self, upstream: Allocator, sink: "str | os.PathLike | TextIO | logging.Logger | None" = None,
                 *, flush: bool = True) -> None:
        super().__init__(upstream)
        self._owned: TextIO | None = None
        if sink is None:
            sink = logging.getLogger("polyhal.allocations")
        if isinstance(sink, (str, os.PathLike)):
            path = Path(sink)
            new = not path.exists() or path.stat().st_size == 0
            sink = self._owned = open(path, "a", newline="")  # noqa: SIM115 - closed by close()/finalizer
            if new:
                sink.write(",".join(self.HEADER) + "\n")
            weakref.finalize(self, sink.close)
        self.sink = sink
        self.flush = flush
        self._t0 = time.perf_counter()

    def _log(self, action: str, heap: Heap, nbytes: int, native: Any) -> None:
        row = (f"{time.perf_counter() - self._t0:.9f}", threading.get_ident(), action, self.device.name,
               heap.memory_type.describe(), nbytes, f"0x{_address(native):x}")
        out = io.StringIO()
        csv.writer(out, lineterminator="").writerow(row)
        line = out.getvalue()
        if isinstance(self.sink, logging.Logger):
            self.sink.debug(line)
            return
        with self._lock:
            self.sink.write(line + "\n")
            if self.flush:
                self.sink.flush()

    def _allocate(self, heap: Heap, nbytes: int) -> Any:
        native = raw_allocate(self.upstream, heap, nbytes)
        self._log("allocate", heap, nbytes, native)
        return native

    def _deallocate(self, heap: Heap, nbytes: int, native: Any) -> None:
        self._log("free", heap, nbytes, native)
        raw_deallocate(self.upstream, heap, nbytes, native)

    def close(self) -> None:
        """Close the log file this adaptor opened (a no-op for sinks it was given)."""
        if self._owned is not None:
            self._owned.close()


# --------------------------------------------------------------------------------------------------
# Routing per memory type, swapping, the wrap_allocator hook, POLYHAL_ALLOCATOR
# --------------------------------------------------------------------------------------------------

class MemoryTypeRouter(AllocatorAdaptor):
    """Serves each heap from its own allocator (``routes``: heap -> allocator), the rest from
    upstream. Made by the registry's ``wrap_allocator`` step when plugins wrap some memory types only."""

    def __init__(self, upstream: Allocator, routes: dict[Heap, Allocator]) -> None:
        super().__init__(upstream)
        self.routes = {id(h): a for h, a in routes.items()}
        self._by_memory_type = {h.memory_type: a for h, a in routes.items()}

    def route(self, memory_type: MemoryType) -> Allocator:
        """The allocator that serves heaps of ``memory_type``."""
        return self._by_memory_type.get(memory_type, self.upstream)

    def _allocate(self, heap: Heap, nbytes: int) -> Any:
        return raw_allocate(self.routes.get(id(heap), self.upstream), heap, nbytes)

    def _deallocate(self, heap: Heap, nbytes: int, native: Any) -> None:
        raw_deallocate(self.routes.get(id(heap), self.upstream), heap, nbytes, native)


def get_device_allocator(device: "Device") -> Allocator:
    """The allocator new buffers of ``device`` come from (RMM's ``get_current_device_resource``)."""
    return device.allocator


def set_device_allocator(device: "Device", allocator: Allocator) -> Allocator:
    """Make ``allocator`` serve ``device`` from now on; returns the previous one.

    Safe with live buffers: each returns to the allocator that made it. ``allocator`` must be an
    allocator of this device (an adaptor over its allocator, usually).
    """
    if not isinstance(allocator, Allocator):
        raise TypeError(f"set_device_allocator needs a polyhal.Allocator, got {allocator!r}")
    if allocator.device is not device:
        raise ValueError(f"{allocator!r} allocates for {allocator.device.name}, not {device.name}")
    previous, device.allocator = device.allocator, allocator
    return previous


def parse_adaptor_spec(spec: str) -> list[Callable[[Allocator], Allocator]]:
    """Adaptor factories from ``POLYHAL_ALLOCATOR`` syntax, innermost first.

    ``pool`` / ``pool=MAX_CACHED``, ``stats``, ``limit=SIZE``, ``log`` / ``log=PATH``,
    ``fault=N`` (every Nth allocation fails), separated by commas; e.g. ``"pool,limit=1GiB,stats"``.
    """
    makers: list[Callable[[Allocator], Allocator]] = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        name, _, arg = token.partition("=")
        name = name.strip().lower()
        try:
            if name == "pool":
                cap = parse_size(arg) if arg else None
                makers.append(lambda a, cap=cap: CachingPoolAdaptor(a, max_cached_bytes=cap))
            elif name in ("stats", "statistics"):
                makers.append(StatisticsAdaptor)
            elif name == "limit":
                if not arg:
                    raise ValueError("limit needs a size, e.g. limit=512MiB")
                size = parse_size(arg)
                makers.append(lambda a, size=size: LimitingAdaptor(a, size))
            elif name in ("log", "logging"):
                makers.append(lambda a, path=arg or None: LoggingAdaptor(a, path))
            elif name == "fault":
                every = int(arg or 1)
                if every < 1:
                    raise ValueError("fault needs a count >= 1, e.g. fault=7 (every 7th allocation fails)")
                makers.append(lambda a, every=every: FaultInjectionAdaptor(a, every))
            else:
                raise ValueError(f"unknown adaptor {name!r}; use pool, stats, limit=SIZE, log[=PATH] or fault=N")
        except ValueError as exc:
            raise PluginError(f"POLYHAL_ALLOCATOR={spec!r}: {exc}") from None
    return makers

