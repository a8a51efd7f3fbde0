"""Event-backed device queues: the HAL queue of a GPU stream (or an OpenCL command queue).

A GPU queue must not wait for the device to say that work is done: it *issues* the work on its
stream (kernel launches and copies return at once) and records an event after it. That event is
the :class:`~polyhal.hal.queue.Fence` the queue attaches to each signal value
(:meth:`~polyhal.hal.queue.Semaphore.attach`), as IREE's CUDA and HIP drivers back semaphore
timepoints with events:

* a host wait synchronizes the event (``cudaEventSynchronize``, ``hipEventSynchronize``,
  ``clWaitForEvents``);
* a queue of the same :attr:`~polyhal.hal.queue.Fence.domain` waits for it *on the device*
  (``cudaStreamWaitEvent``, ``hipStreamWaitEvent``, an OpenCL marker with a wait list), so two
  GPUs, or a copy and a kernel, are ordered without a round trip through the host;
* a wait on a value that nothing has issued yet (the CPU is still computing it) cannot be put on
  the stream: that submission, and every later one of the queue (a queue keeps its order), goes
  to the queue's issue thread, which waits on the host and then issues. Submissions whose waits
  are all issued already are issued on the caller's thread, so a plan's GPU part costs the
  launches and nothing more.

A backend subclasses :class:`EventQueue` with four native calls (:meth:`~EventQueue._record`,
:meth:`~EventQueue._device_wait`, and the fence's ``query`` / ``synchronize``) and says what its
:attr:`~EventQueue.domain` is. polyhal-cuda's ``CUDAQueue``, polyhal-hip's ``HIPQueue`` and
polyhal-opencl's ``CLQueue`` are that, nothing more.
"""

from __future__ import annotations

import queue as _stdqueue
import threading
from typing import TYPE_CHECKING, Any, Callable, Hashable

from polyhal.hal.queue import InlineQueue, SemaphoreList, fail_all

if TYPE_CHECKING:
    from polyhal.hal.device import Device

__all__ = ["EventFence", "EventQueue"]


class EventFence:
    """A recorded native event as a :class:`~polyhal.hal.queue.Fence`: ``query`` and
    ``synchronize`` are the backend's calls on ``event``; ``domain`` the queues that can wait
    for it on the device."""

    __slots__ = ("event", "domain", "_query", "_synchronize", "__weakref__")

    def __init__(self, event: Any, domain: Hashable, query: Callable[[Any], bool],
                 synchronize: Callable[[Any], None]) -> None:
        self.event, self.domain = event, domain
        self._query, self._synchronize = query, synchronize

    def query(self) -> bool:
        return self._query(self.event)

    def synchronize(self) -> None:
        self._synchronize(self.event)

    def __repr__(self) -> str:
        return f"<EventFence {self.domain}>"


class EventQueue(InlineQueue):
    """A device stream as a HAL queue: work issued asynchronously, signals as recorded events.

    Subclasses implement :meth:`_record` (record an event after the work issued so far and
    return it as an :class:`EventFence`) and :meth:`_device_wait` (make the stream wait for a
    fence of :attr:`domain`), and set :attr:`domain`. ``execute``, ``copy``, ``fill``,
    ``alloca`` and ``dealloca`` all go through :meth:`_submit`; the work callables issue
    asynchronous device calls on the device's stream (a plan's prepared steps do).
    """

    asynchronous = True
    #: Fences of this domain are waited for on the device (set by the backend).
    domain: Hashable = None

    def __init__(self, device: "Device", name: str | None = None, timeout: float | None = None) -> None:
        super().__init__(device, name, timeout)
        self._lock = threading.Lock()  # issue order: one submission issues at a time
        self._backlog = 0  # submissions handed to the issue thread and not issued yet
        self._pending: _stdqueue.SimpleQueue = _stdqueue.SimpleQueue()
        self._thread: threading.Thread | None = None
        #: Submissions that went through the issue thread (their waits were not issued yet).
        self.deferred = 0

    # -- backend ---------------------------------------------------------------------------------

    def _record(self) -> EventFence:
        """Record an event on the stream after everything issued so far (backend)."""
        raise NotImplementedError

    def _device_wait(self, fence: EventFence) -> None:
        """Make the stream wait for ``fence`` (of :attr:`domain`) without the host (backend)."""
        raise NotImplementedError

    # -- submission ------------------------------------------------------------------------------

    def _issuable(self, wait: SemaphoreList) -> bool:
        """Whether every wait is reached or has a fence of this domain attached (nothing to wait
        for on the host before the work can be put on the stream)."""
        for sem, value in wait:
            if sem.value < value and not self._same_domain(sem.fence(value)):
                return False
        return True

    def _same_domain(self, fence: Any) -> bool:
        return fence is not None and self.domain is not None and getattr(fence, "domain", None) == self.domain

    def _submit(self, work: Callable[[], Any], wait: SemaphoreList, signal: SemaphoreList) -> Any:
        wait, signal = tuple(wait), tuple(signal)
        with self._lock:
            if not self._backlog and self._issuable(wait):
                return self._issue(work, wait, signal)
            self._backlog += 1
            self.deferred += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"polyhal {self.name} issue", daemon=True)
                self._thread.start()
            self._pending.put((work, wait, signal))
        return None

    def _issue(self, work: Callable[[], Any], wait: SemaphoreList, signal: SemaphoreList) -> Any:
        """Order the stream after ``wait``, issue ``work``, attach a fence to each signal value.
        Raises what the work raised, after failing the signal semaphores."""
        try:
            for sem, value in wait:
                sem.wait_enqueued(value, self.timeout)  # returns at once unless nothing is issued yet
                fence = sem.fence(value)
                if fence is None:
                    continue  # reached already
                if self._same_domain(fence):
                    self._device_wait(fence)
                else:  # another backend's (or context's) work: the host waits for it
                    sem.wait(value, self.timeout)
            result = work()
            if signal:
                fence = self._record()
                for sem, value in signal:
                    sem.attach(value, fence)
        except BaseException as exc:
            fail_all(signal, exc)
            raise
        return result

    def _run(self) -> None:
        while True:
            work, wait, signal = self._pending.get()
            try:
                # No lock while issuing: submitters see the backlog and queue behind us, so the
                # host waits here never block them.
                self._issue(work, wait, signal)
            except BaseException:  # noqa: BLE001 -- delivered through the failed signal semaphores
                pass
            finally:
                with self._lock:
                    self._backlog -= 1

