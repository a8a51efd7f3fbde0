"""Host <-> device copies of pageable numpy memory through pinned staging buffers.

A copy from pageable (ordinary) host memory cannot be done by the GPU's copy engines directly:
CUDA stages it through its own small pinned buffer, one chunk at a time, on the calling thread,
which is why ``cudaMemcpy`` from a numpy array runs at a fraction of the bus speed. Here the
staging is ours, striped over :data:`WORKERS` host threads:

* each worker owns a stream and two pinned buffers of :data:`CHUNK` bytes (double buffering);
  chunk *i* of a copy goes to worker ``i % WORKERS``, so every worker walks the whole array;
* a worker fills one buffer (H2D) or drains it (D2H) with ``np.copyto`` (numpy releases the GIL)
  while the copy engine moves the other one, so host copies and bus transfers overlap on every
  worker at once, with no hand-off between threads;
* the chunks are small (a few MiB) so that the staging buffers of all workers stay in the CPU's
  last-level cache: a staged byte is then read from DRAM once (the pageable side), not three
  times (pageable read, pinned write, DMA read), which is what capped the earlier design of two
  64 MiB buffers filled by a thread pool at about 31 GB/s on an H100 host.

Copies are ordered on the device's stream: the workers' streams wait for the work queued on it
before (an event), and for host-to-device copies the device's stream waits for the workers'
copies after. ``h2d`` returns once the host array may be reused (every chunk has been staged);
``d2h`` returns once the data is in place. Transfers of at most :data:`SMALL` bytes skip the
staging (its fixed cost would dominate) and call ``cudaMemcpyAsync`` on the pageable memory.

An alternative measured and dropped: splitting a copy over threads that each call
``cudaMemcpyAsync`` on the pageable memory (the driver's own staging on several cores) ran at
7.7 / 10.3 GB/s on the H100 host, no faster than one such call.

**Page-locked host memory goes direct.** Staging reaches ~0.8 of the pinned bus at best (a staged
byte still crosses host memory twice), so host memory that is already page-locked (pinned by
CUDA, or registered) is copied by one ``cudaMemcpyAsync`` at the bus's speed. A host allocation
of :data:`REGISTER_MIN` bytes or more that a copy meets a *second* time -- a plan's arena, a
buffer a loop reuses -- is registered in place (``cudaHostRegister``: IREE's import of a host
allocation into a device allocator), since a buffer seen twice will likely be seen again and
registering costs about as much as one staged copy; it is unregistered when its array is freed
(:class:`HostRegistrations`). One-off copies keep the staging, which needs no page-locking.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import numpy as np

from polyhal_cuda.errors import check
from polyhal_cuda.settings import CUDATuningSettings

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Bytes per staging buffer (each worker has two).
CHUNK = CUDATuningSettings.from_env().staging_chunk
#: Copies up to this size go straight through cudaMemcpyAsync.
SMALL = 4 << 20
#: Host threads that stage a large copy, each with its own stream and buffers.
WORKERS = CUDATuningSettings.from_env().staging_threads or max(1, min(16, os.cpu_count() or 2))

#: Host allocations at least this large are registered (page-locked in place) on their second
#: large copy. At 32 MiB and more glibc's malloc maps every allocation on pages of its own (its
#: largest mmap threshold), so registering whole pages never pins a neighbour's bytes.
REGISTER_MIN = 32 << 20

_H2D, _D2H, _DEFAULT = 1, 2, 4  # cudaMemcpyKind
_PAGE = 4096
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every GPU, not one context


class HostRegistrations:
    """Host allocations page-locked in place for direct DMA (``cudaHostRegister``), process-wide.

    :meth:`direct` answers whether a copy of a host array may skip the staging: its memory is
    page-locked already (a user's pinned array, an allocation registered here), or it belongs to an
    allocation of :data:`REGISTER_MIN` bytes or more seen before, which is registered now. The
    allocation is the array's root (the ndarray at the end of its ``base`` chain), tracked weakly:
    when it is freed its registration is dropped first (numpy clears weak references before it
    frees the data). A registration CUDA refuses (file-backed or locked-down memory) is remembered
    and that allocation stays staged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, weakref.ref] = {}  # id(root) -> root, met once
        self._refused: dict[int, weakref.ref] = {}
        self.registered = 0  # registrations made (for tests and explain)

    @staticmethod
    def _root(a: np.ndarray) -> np.ndarray:
        while isinstance(a.base, np.ndarray):
            a = a.base
        return a

    @staticmethod
    def page_locked(ptr: int, n: int) -> bool:
        """Whether host bytes ``[ptr, ptr + n)`` are page-locked memory CUDA knows (both ends)."""
        from cupy.cuda import runtime

        try:
            return all(runtime.pointerGetAttributes(p).type == runtime.memoryTypeHost for p in (ptr, ptr + n - 1))
        except runtime.CUDARuntimeError:
            return False

    def direct(self, flat: np.ndarray) -> bool:
        """Whether a copy of contiguous host array ``flat`` goes direct (see the class doc)."""
        ptr, n = flat.ctypes.data, flat.nbytes
        if self.page_locked(ptr, n):
            return True
        root = self._root(flat)
        if root.nbytes < REGISTER_MIN or root.base is not None:  # memory numpy does not own: leave it
            return False
        key = id(root)
        with self._lock:
            if (ref := self._refused.get(key)) is not None and ref() is root:
                return False
            ref = self._seen.get(key)
            if ref is None or ref() is not root:
                self._seen[key] = weakref.ref(root, lambda _r, k=key: self._seen.pop(k, None))
                return False
            del self._seen[key]
            return self._register(root, key)

    def _register(self, root: np.ndarray, key: int) -> bool:
        from cupy.cuda import runtime

        start = root.ctypes.data & ~(_PAGE - 1)
        end = (root.ctypes.data + root.nbytes + _PAGE - 1) & ~(_PAGE - 1)
        try:
            runtime.hostRegister(start, end - start, _REGISTER_PORTABLE)
        except runtime.CUDARuntimeError:
            self._refused[key] = weakref.ref(root, lambda _r, k=key: self._refused.pop(k, None))
            return False
        self.registered += 1
        weakref.finalize(root, _unregister, start)
        return True


def _unregister(start: int) -> None:
    from cupy.cuda import runtime

    try:
        runtime.hostUnregister(start)
    except Exception:  # noqa: BLE001 -- at interpreter exit the context may be gone already
        pass


#: The process's registrations (page-locking is a property of host memory, not of one device:
#: registered portable, it serves every GPU).
host_registrations = HostRegistrations()


class _Worker:
    """One staging thread's stream, two pinned buffers and their events."""

    def __init__(self, chunk: int) -> None:
        import cupy
        from cupy.cuda import pinned_memory, runtime

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.owners = [pinned_memory.PinnedMemory(chunk, runtime.hostAllocPortable) for _ in range(2)]
        self.ptrs = [m.ptr for m in self.owners]
        self.views = [np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * chunk).from_address(p))
                      for p in self.ptrs]
        self.events = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]  # buffer b is free
        self.done = cupy.cuda.Event(disable_timing=True)

    def idle(self) -> None:
        """Wait until the copy engine is done with both buffers."""
        for ev in self.events:
            ev.synchronize()


class Stager:
    """Pinned staging for one device's pageable transfers (made on the first large one)."""

    def __init__(self, device: "Device") -> None:
        self.device = device
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._chunk = 0
        self._pool: ThreadPoolExecutor | None = None
        self._start = None
        self._side = None  # a stream of our own, for unordered small copies (d2h(ordered=False))

    def _ensure(self) -> None:
        if self._workers:
            return
        import cupy

        chunk, count = CHUNK, max(1, WORKERS)
        with check(f"allocating {2 * chunk * count} bytes of pinned staging memory for {self.device.name}"), \
                self.device.activate():
            self._workers = [_Worker(chunk) for _ in range(count)]
            self._start = cupy.cuda.Event(disable_timing=True)
        self._chunk = chunk
        self._pool = ThreadPoolExecutor(count, thread_name_prefix=f"polyhal-{self.device.name}-stage")

    def exclusive(self) -> threading.Lock:
        """``with stager.exclusive():`` no copy of this stager touches the device's stream
        meanwhile (a CUDA graph capture on that stream holds it: a concurrent plan's host thread
        may otherwise stage a copy on the stream being captured)."""
        return self._lock

    def close(self) -> None:
        """Finish pending copies and free the staging buffers and threads."""
        with self._lock:
            for w in self._workers:
                w.idle()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._workers, self._pool, self._chunk = [], None, 0

    # -- the two directions ------------------------------------------------------------------------

    def h2d(self, dst_ptr: int, host: np.ndarray) -> None:
        """Copy contiguous ``host`` (any dtype) to device address ``dst_ptr``."""
        from cupy.cuda import runtime

        flat = host.reshape(-1).view(np.uint8)
        n = flat.size
        if n == 0:
            return
        if n <= SMALL:
            with self._lock, check(f"copying {n} bytes to {self.device.name}"):
                # From pageable memory this returns once CUDA has taken the bytes: the caller may
                # reuse its array at once.
                runtime.memcpyAsync(dst_ptr, flat.ctypes.data, n, _DEFAULT, self.device.stream.ptr)
            return
        if host_registrations.direct(flat):
            self._direct(dst_ptr, flat.ctypes.data, n, _H2D, "to", self.device.stream)
            return

        def stage(w: _Worker, s: int, size: int, k: int) -> None:
            b = k & 1
            w.events[b].synchronize()  # the copy engine is done with this buffer
            np.copyto(w.views[b][:size], flat[s:s + size])
            runtime.memcpyAsync(dst_ptr + s, w.ptrs[b], size, _H2D, w.stream.ptr)
            w.events[b].record(w.stream)

        self._striped(n, stage, _H2D, "to")

    def d2h(self, host: np.ndarray, src_ptr: int, ordered: bool = True) -> None:
        """Fill contiguous ``host`` from device address ``src_ptr``; returns when it is filled.

        ``ordered``: after the work queued on the device's stream (the default). False when the
        caller has already waited for the data's producer (a concurrent plan's host queue waited
        for its event): the copy then leaves the device's stream alone, so it neither waits for
        later, unrelated work queued there nor touches a stream another thread may be capturing.
        """
        from cupy.cuda import runtime

        flat = host.reshape(-1).view(np.uint8)
        n = flat.size
        if n == 0:
            return
        if n <= SMALL:
            with self._lock, check(f"copying {n} bytes from {self.device.name}"):
                stream = self.device.stream if ordered else self._side_stream()
                runtime.memcpyAsync(flat.ctypes.data, src_ptr, n, _DEFAULT, stream.ptr)
                stream.synchronize()
            return
        if host_registrations.direct(flat):
            self._direct(flat.ctypes.data, src_ptr, n, _D2H, "from",
                         self.device.stream if ordered else self._side_stream())
            return

        def issue(w: _Worker, s: int, size: int, k: int) -> None:
            runtime.memcpyAsync(w.ptrs[k & 1], src_ptr + s, size, _D2H, w.stream.ptr)
            w.events[k & 1].record(w.stream)

        def drain(w: _Worker, s: int, size: int, k: int) -> None:
            w.events[k & 1].synchronize()
            np.copyto(flat[s:s + size], w.views[k & 1][:size])

        self._striped(n, drain, _D2H, "from", ahead=issue, ordered=ordered)

    def _direct(self, dst: int, src: int, n: int, kind: int, word: str, stream) -> None:
        """One copy engine transfer between page-locked host memory and the device, on
        ``stream``; complete on return (the host array may be reused or read)."""
        from cupy.cuda import runtime

        with self._lock, check(f"copying {n} bytes {word} {self.device.name} (page-locked host memory)"):
            runtime.memcpyAsync(dst, src, n, kind, stream.ptr)
            stream.synchronize()

    def _side_stream(self):
        """A stream of this stager's own (made on first use), for copies that need no order
        with the device's stream."""
        if self._side is None:
            import cupy

            with self.device.activate():
                self._side = cupy.cuda.Stream(non_blocking=True)
        return self._side

    # -- the workers ---------------------------------------------------------------------------------

    def _striped(self, n: int, step: Callable, kind: int, word: str, *, ahead: Callable | None = None,
                 ordered: bool = True) -> None:
        """Run ``step(worker, start, size, k)`` for every chunk of ``n`` bytes, chunk ``i`` on
        worker ``i % WORKERS`` (its ``k``-th). With ``ahead``, ``ahead(worker, ...)`` is called
        for chunks ``k`` and ``k + 1`` before ``step`` reaches chunk ``k`` (the D2H prefetch,
        two buffers deep)."""
        from cupy.cuda import runtime

        with self._lock, check(f"copying {n} bytes {word} {self.device.name} through pinned staging"):
            self._ensure()
            chunk = self._chunk
            starts = list(range(0, n, chunk))
            workers = self._workers[:len(starts)]
            ordinal, device_stream = self.device.ordinal, self.device.stream
            if ordered:
                self._start.record(device_stream)
                for w in workers:
                    w.stream.wait_event(self._start)

            def walk(j: int) -> None:
                runtime.setDevice(ordinal)  # the current device is per thread
                w = workers[j]
                mine = starts[j::len(workers)]
                sizes = [min(chunk, n - s) for s in mine]
                if ahead is not None:
                    for k in range(min(2, len(mine))):
                        ahead(w, mine[k], sizes[k], k)
                for k, s in enumerate(mine):
                    step(w, s, sizes[k], k)
                    if ahead is not None and k + 2 < len(mine):
                        ahead(w, mine[k + 2], sizes[k + 2], k + 2)

            futures = [self._pool.submit(walk, j) for j in range(len(workers))]
            errors = [f.exception() for f in futures]  # every worker finishes before we go on
            if kind == _H2D:
                for w in workers:
                    w.done.record(w.stream)
                    device_stream.wait_event(w.done)
            for e in errors:
                if e is not None:
                    raise e
