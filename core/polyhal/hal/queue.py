"""Queues and timeline semaphores: how work on a device is ordered (IREE's HAL model).

IREE (``runtime/src/iree/hal/device.h``, ``semaphore.h``) submits all device work to queues:
``queue_alloca``, ``queue_dealloca``, ``queue_fill``, ``queue_copy`` and ``queue_execute`` each take
a *wait* semaphore list and a *signal* semaphore list -- pairs of (timeline semaphore, value). The
work starts once every wait semaphore has reached its value and, when it is done, sets every
signal semaphore to its value. A timeline semaphore is a monotonically increasing 64-bit counter:
the host can query, signal and wait on it with a timeout; when work fails, the semaphore is
*failed* and every waiter, now or later, receives the failure instead of a value.

polyhal keeps that model and those names:

- :class:`Semaphore` -- ``value``, ``signal(v)``, ``wait(v, timeout)``, ``fail(error)``. A wait that
  its timeout ends raises :class:`~polyhal.errors.SemaphoreTimeoutError` naming the semaphore (and
  its queue) and both values, never hangs; a failed one raises
  :class:`~polyhal.errors.SemaphoreFailedError` with the failure chained.
- :class:`Queue` -- ``execute`` (a list of callables: a plan's prepared steps, IREE's command
  buffer), ``copy``, ``fill``, ``alloca``, ``dealloca``, each with ``wait`` and ``signal`` lists
  (:data:`SemaphoreList`). A device lists its queues in :attr:`~polyhal.hal.device.Device.queues`.
- :class:`InlineQueue` -- runs each submission at once, in submission order, on the calling
  thread: it waits (with a timeout) for the wait list, does the work, finishes the device
  (``Device.synchronize``) and signals. Correct on every device, concurrent on none; every
  device has one by default.
- :class:`HostThreadQueue` -- one worker thread runs submissions in order; ``submit`` returns at
  once, so the host can do other work (or submit to another device) meanwhile. A submission whose
  work raises fails its signal semaphores, and later submissions waiting on them fail in turn.
- :class:`Fence` -- device work that reaches a semaphore value when it completes: a CUDA or HIP
  event recorded on a stream, an OpenCL marker event. A device queue that issues work
  asynchronously *attaches* a fence to each signal value (:meth:`Semaphore.attach`, IREE's
  semaphore timepoints backed by native events) instead of waiting for the device. A host wait
  synchronizes the fence; a queue of the same :attr:`Fence.domain` waits for it on the device
  (``cudaStreamWaitEvent``, an OpenCL wait list), without the host.
"""

from __future__ import annotations

import queue as _stdqueue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Protocol, Sequence, runtime_checkable

import numpy as np

from polyhal.config import Number, Settings, setting
from polyhal.errors import SemaphoreFailedError, SemaphoreTimeoutError
from polyhal.hal.flags import BufferUsage, MemoryAccess, MemoryType

if TYPE_CHECKING:
    from polyhal.hal.buffer import Buffer
    from polyhal.hal.device import Device

#: (semaphore, value) pairs: IREE's ``iree_hal_semaphore_list_t`` (semaphores plus payload values).
SemaphoreList = Sequence["tuple[Semaphore, int]"]


@dataclass(frozen=True)
class QueueSettings(Settings, component="queue"):
    """How long queue and host waits on semaphores last before they give up, read at each wait
    that takes the default."""

    timeout: float = setting(
        "POLYHAL_QUEUE_TIMEOUT", Number("seconds", low=0), 60.0,
        "seconds a semaphore wait (a queue's wait list, or the host's) lasts before a SemaphoreTimeoutError",
        hint="set e.g. 60; long enough for any real predecessor, short enough that a wait nothing will "
             "satisfy ends as an error instead of a hang")


def default_timeout() -> float:
    """Seconds a wait lasts when none is given (``POLYHAL_QUEUE_TIMEOUT``, default 60): long
    enough for any real predecessor, short enough that a wait nothing will satisfy ends as an
    error instead of a hang."""
    return QueueSettings.from_env().timeout


@runtime_checkable
class Fence(Protocol):
    """Device work that completes asynchronously: what a device queue attaches to a semaphore
    value (:meth:`Semaphore.attach`) instead of waiting for the device.

    ``domain`` says which queues can wait for it on the device, without the host (CUDA events:
    every stream of the process, ``cudaStreamWaitEvent``; OpenCL events: queues of one context);
    queues of another domain, and the host, :meth:`synchronize`.
    """

    domain: Hashable

    def query(self) -> bool:
        """Whether the work has completed (never blocks)."""

    def synchronize(self) -> None:
        """Block the calling thread until the work has completed; raises what the device reports."""


class Semaphore:
    """A timeline semaphore: a counter that only grows, waited on for a value (IREE's
    ``iree_hal_semaphore_t``).

    ``name`` says whose it is in errors (conventionally ``"<queue>/<purpose>"``). Thread-safe: any
    thread (a queue's worker, the host) may signal, wait or fail it. Values may also be reached
    by device work: :meth:`attach` a :class:`Fence` to a value, and the value is reached when the
    fence completes (seen by :attr:`value`, :meth:`wait` and :meth:`fence`).
    """

    __slots__ = ("name", "timeout", "_value", "_failure", "_cond", "_fences")

    def __init__(self, value: int = 0, name: str = "semaphore", timeout: float | None = None) -> None:
        self.name = name
        #: Seconds a wait on this semaphore lasts when the waiter gives no timeout (None:
        #: :func:`default_timeout`). A concurrent plan's semaphores wait as long as the work
        #: takes (``threading.TIMEOUT_MAX``): each is signalled by work submitted before anything
        #: waits for it, or failed with that work's error, so no wait on them can be one that
        #: nothing satisfies.
        self.timeout = timeout
        self._value = int(value)
        self._failure: BaseException | None = None
        self._cond = threading.Condition(threading.Lock())
        self._fences: list[tuple[int, Fence]] = []  # (value, fence), values increasing

    def __repr__(self) -> str:
        state = f"failed: {self._failure!r}" if self._failure is not None else f"value {self._value}"
        return f"<Semaphore {self.name} {state}>"

    @property
    def value(self) -> int:
        """The current value (IREE's ``iree_hal_semaphore_query``); attached fences that have
        completed count."""
        if self._fences:
            self._poll()
        return self._value

    def _poll(self) -> None:
        """Advance past every attached fence that has completed (queries only, never blocks)."""
        with self._cond:
            reached = None
            while self._fences and self._fences[0][1].query():
                reached = self._fences.pop(0)[0]
            if reached is not None and reached > self._value:
                self._value = reached
                self._cond.notify_all()

    def attach(self, value: int, fence: Fence) -> None:
        """Reach ``value`` when ``fence`` completes (a device queue's signal: IREE's timepoint
        backed by a native event). Waiters on the device side find it with :meth:`fence`; host
        waiters synchronize it. Values attached must grow, as signals do."""
        with self._cond:
            if self._failure is not None:
                return
            last = self._fences[-1][0] if self._fences else self._value
            if value < last:
                raise ValueError(f"semaphore {self.name}: attach({value}) is below its value {last}; "
                                 "timeline values only grow")
            self._fences.append((int(value), fence))
            self._cond.notify_all()

    def fence(self, value: int) -> "Fence | None":
        """The attached fence whose completion reaches ``value`` (the first one that does), or
        None: the value is already reached, or nothing attached reaches it yet."""
        with self._cond:
            if self._value >= value:
                return None
            for v, f in self._fences:
                if v >= value:
                    return f
            return None

    def _reach(self, value: int) -> None:
        with self._cond:
            if value > self._value and self._failure is None:
                self._value = value
                while self._fences and self._fences[0][0] <= value:
                    self._fences.pop(0)
                self._cond.notify_all()

    @property
    def failure(self) -> BaseException | None:
        """The error the semaphore was failed with, or None."""
        return self._failure

    def signal(self, value: int) -> None:
        """Set the value to ``value`` and wake the waiters it satisfies. A timeline only grows:
        a value below the current one is a ValueError (IREE: "semaphore values must be
        monotonically increasing"); signalling a failed semaphore does nothing."""
        with self._cond:
            if self._failure is not None:
                return
            if value < self._value:
                raise ValueError(f"semaphore {self.name}: signal({value}) is below its value {self._value}; "
                                 "timeline values only grow")
            self._value = value
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Fail the semaphore with ``error`` (IREE's ``iree_hal_semaphore_fail``): every waiter,
        current and future, receives it as a :class:`~polyhal.errors.SemaphoreFailedError`. The
        first failure wins."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    def wait(self, value: int, timeout: float | None = None) -> None:
        """Block until the value is at least ``value`` (IREE's ``iree_hal_semaphore_wait``).

        ``timeout`` in seconds (None: :func:`default_timeout`); when it ends first,
        :class:`~polyhal.errors.SemaphoreTimeoutError`. A failed semaphore raises
        :class:`~polyhal.errors.SemaphoreFailedError` whatever the value.
        """
        fence = self._wait_for(value, timeout)
        if fence is None:
            return
        try:
            fence.synchronize()
        except BaseException as exc:  # the device failed the work: every waiter learns it
            self.fail(exc)
            self._raise_failed(value)
        self._reach(self._fence_value(fence, value))

    def wait_enqueued(self, value: int, timeout: float | None = None) -> None:
        """Block until ``value`` is reached *or device work that reaches it has been issued* (a
        fence is attached); raises as :meth:`wait` does. What a host that only orders later
        work on the same device needs: the work is on the device's queue, and the host did not
        wait for the device."""
        self._wait_for(value, timeout)

    def _wait_for(self, value: int, timeout: float | None) -> "Fence | None":
        """Wait (on the host) until ``value`` is reached (returns None) or a fence reaching it
        is attached (returns it); raises on failure or timeout."""
        if self._fences:
            self._poll()
        if timeout is None and self._value < value:
            timeout = self.timeout if self.timeout is not None else default_timeout()

        def covering() -> "Fence | None":
            for v, f in self._fences:
                if v >= value:
                    return f
            return None

        with self._cond:
            if self._value < value and self._failure is None and covering() is None:
                self._cond.wait_for(lambda: self._value >= value or self._failure is not None
                                    or covering() is not None, timeout)
            if self._failure is not None:
                self._raise_failed(value)
            if self._value >= value:
                return None
            fence = covering()
            if fence is not None:
                return fence
            raise SemaphoreTimeoutError(
                f"semaphore {self.name} is at {self._value}; waited {timeout:g} "
                f"s for value {value} and nothing signalled it. Check that the work signalling {value} was "
                "submitted (and that its queue runs), or raise POLYHAL_QUEUE_TIMEOUT",
                semaphore=self.name, value=value)

    def _fence_value(self, fence: "Fence", at_least: int) -> int:
        with self._cond:
            return next((v for v, f in self._fences if f is fence), at_least)

    def _raise_failed(self, value: int) -> None:
        failure = self._failure
        raise SemaphoreFailedError(
            f"semaphore {self.name} failed while waiting for value {value}: "
            f"{type(failure).__name__}: {failure}", semaphore=self.name) from failure


def wait_all(semaphores: SemaphoreList, timeout: float | None = None) -> None:
    """Wait for every (semaphore, value) pair of a wait list (IREE's ``iree_hal_semaphore_list_wait``)."""
    for sem, value in semaphores:
        sem.wait(value, timeout)


def signal_all(semaphores: SemaphoreList) -> None:
    """Signal every (semaphore, value) pair of a signal list."""
    for sem, value in semaphores:
        sem.signal(value)


def fail_all(semaphores: SemaphoreList, error: BaseException) -> None:
    """Fail every semaphore of a signal list with ``error``."""
    for sem, _ in semaphores:
        sem.fail(error)


@runtime_checkable
class Queue(Protocol):
    """A device queue (IREE's queue affinity plus the ``iree_hal_device_queue_*`` calls).

    Every operation starts after each (semaphore, value) of ``wait`` is reached and, when it has
    completed on the device, signals each of ``signal``; if it fails, the ``signal`` semaphores
    are failed with its error. Operations without a common semaphore may run in any order or
    concurrently (a queue may be more ordered than that, never less).

    A queue may also say ``asynchronous = True``: its submissions return before the work is
    done (the signal semaphores say when). A concurrent plan submits to such a queue; a device
    whose queues are all synchronous gets a HostThreadQueue for it
    (:attr:`~polyhal.hal.device.Device.concurrent_queue`). Optional, so that queues written
    before it still match this protocol.
    """

    name: str
    device: "Device"

    def execute(self, work: Sequence[Callable[[], None]], wait: SemaphoreList = (),
                signal: SemaphoreList = ()) -> None:
        """Run ``work`` in order (IREE's ``queue_execute`` of a command buffer)."""

    def copy(self, src: "Buffer", src_offset: int, dst: "Buffer", dst_offset: int, nbytes: int,
             wait: SemaphoreList = (), signal: SemaphoreList = ()) -> None:
        """Copy ``nbytes`` between two buffers of the queue's device (IREE's ``queue_copy``)."""

    def fill(self, buffer: "Buffer", offset: int, nbytes: int, pattern: bytes,
             wait: SemaphoreList = (), signal: SemaphoreList = ()) -> None:
        """Repeat ``pattern`` (1, 2 or 4 bytes) over ``nbytes`` of ``buffer`` (IREE's ``queue_fill``)."""

    def alloca(self, nbytes: int, memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
               usage: BufferUsage = BufferUsage.DEFAULT, wait: SemaphoreList = (),
               signal: SemaphoreList = ()) -> "Buffer":
        """A buffer that is usable once ``signal`` is reached (IREE's ``queue_alloca``)."""

    def dealloca(self, buffer: "Buffer", wait: SemaphoreList = (), signal: SemaphoreList = ()) -> None:
        """Release ``buffer`` once ``wait`` is reached (IREE's ``queue_dealloca``)."""


class InlineQueue:
    """A :class:`Queue` that does each submission at once on the calling thread, in order.

    It waits for the wait list (raising :class:`~polyhal.errors.SemaphoreTimeoutError` after the
    timeout, so a wait nothing will satisfy ends), does the work, finishes the device
    (``Device.synchronize``: a no-op on the host) so that signalled work is complete, and
    signals. Work that raises fails the signal semaphores and the error propagates to the
    submitter. ``timeout`` (seconds; None: :func:`default_timeout`) bounds each wait.
    """

    asynchronous = False

    def __init__(self, device: "Device", name: str | None = None, timeout: float | None = None) -> None:
        self.device = device
        self.name = name or f"{device.name}/queue0"
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def semaphore(self, value: int = 0, purpose: str = "timeline") -> Semaphore:
        """A new semaphore named after this queue (so errors say whose it is)."""
        return Semaphore(value, f"{self.name}/{purpose}")

    def _submit(self, work: Callable[[], Any], wait: SemaphoreList, signal: SemaphoreList) -> Any:
        try:
            wait_all(wait, self.timeout)
            result = work()
            self.device.synchronize()
        except BaseException as exc:
            fail_all(signal, exc)
            raise
        signal_all(signal)
        return result

    def execute(self, work: Sequence[Callable[[], None]], wait: SemaphoreList = (),
                signal: SemaphoreList = ()) -> None:
        steps = tuple(work)

        def run() -> None:
            for step in steps:
                step()

        self._submit(run, wait, signal)

    def copy(self, src: "Buffer", src_offset: int, dst: "Buffer", dst_offset: int, nbytes: int,
             wait: SemaphoreList = (), signal: SemaphoreList = ()) -> None:
        self._submit(lambda: self.device.copy(src, src_offset, dst, dst_offset, nbytes), wait, signal)

    def fill(self, buffer: "Buffer", offset: int, nbytes: int, pattern: bytes,
             wait: SemaphoreList = (), signal: SemaphoreList = ()) -> None:
        if len(pattern) not in (1, 2, 4) or nbytes % len(pattern):
            raise ValueError(f"{self.name}: fill pattern must be 1, 2 or 4 bytes and divide the length "
                             f"({nbytes} B), got {len(pattern)} bytes")
        device = self.device

        def fill() -> None:
            host = np.frombuffer(pattern * (nbytes // len(pattern)), np.uint8)
            if buffer.host_visible and device.is_host:
                buffer.map(MemoryAccess.WRITE, offset, nbytes)[...] = host
            else:  # device-local memory: one host-to-device write of the pattern
                device.write(buffer, offset, host)

        self._submit(fill, wait, signal)

    def alloca(self, nbytes: int, memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
               usage: BufferUsage = BufferUsage.DEFAULT, wait: SemaphoreList = (),
               signal: SemaphoreList = ()) -> "Buffer":
        allocate = self.device.allocator.allocate
        if not self.asynchronous:
            return self._submit(lambda: allocate(nbytes, memory_type, usage), wait, signal)
        # An asynchronous queue returns before its work runs: the buffer is allocated at once and
        # the signal, in queue order, says it is usable.
        buffer = allocate(nbytes, memory_type, usage)
        self._submit(lambda: None, wait, signal)
        return buffer

    def dealloca(self, buffer: "Buffer", wait: SemaphoreList = (), signal: SemaphoreList = ()) -> None:
        self._submit(buffer.release, wait, signal)


class HostThreadQueue(InlineQueue):
    """A :class:`Queue` whose submissions run in order on one worker thread of its own.

    ``execute``, ``copy``, ``fill`` and ``dealloca`` return at once; the signal semaphores say
    when the work is done (or carry its failure). ``alloca`` allocates at once (the buffer must
    exist to be returned) and signals in queue order. The thread is a daemon started on first
    use; :meth:`close` stops it after the work already submitted.
    """

    asynchronous = True

    def __init__(self, device: "Device", name: str | None = None, timeout: float | None = None) -> None:
        super().__init__(device, name, timeout)
        self._pending: _stdqueue.SimpleQueue = _stdqueue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def _submit(self, work: Callable[[], Any], wait: SemaphoreList, signal: SemaphoreList) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"polyhal {self.name}", daemon=True)
                self._thread.start()
        self._pending.put((work, tuple(wait), tuple(signal)))

    def _run(self) -> None:
        # Kernels compute IEEE results (log(0) = -inf), as a plan run on the caller's thread does
        # under np.errstate; numpy's error state is per thread, and this thread is polyhal's.
        np.seterr(all="ignore")
        while True:
            item = self._pending.get()
            if item is None:
                return
            work, wait, signal = item
            try:
                InlineQueue._submit(self, work, wait, signal)
            except BaseException:  # noqa: BLE001 -- delivered through the failed signal semaphores
                pass

    def close(self) -> None:
        """Stop the worker once the submitted work is done (later submissions start a new one)."""
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._pending.put(None)
            thread.join()
