"""Host <-> device copies of pageable numpy memory through pinned staging buffers.

A copy from pageable (ordinary) host memory cannot be done by the GPU's copy engines directly:
CUDA stages it through its own small pinned buffer, one chunk at a time, on the calling thread,
which is why ``cudaMemcpy`` from a numpy array runs at about a fifth of the bus speed. Here the
staging is ours and overlapped:

* two pinned buffers of :data:`CHUNK` bytes (double buffering): while the copy engine moves
  chunk *i* out of (H2D) or into (D2H) one buffer, host threads fill or drain the other;
* the host side of each chunk is copied by a small thread pool (numpy releases the GIL for
  large copies), because one CPU core cannot memcpy as fast as the bus moves data.

Transfers of at most :data:`SMALL` bytes skip the staging (its fixed cost would dominate) and
call ``cudaMemcpyAsync`` on the pageable memory directly.

``POLYHAL_CUDA_TRANSFER=parallel`` picks another strategy for large copies: the copy is split
over several threads, each calling ``cudaMemcpyAsync`` on the pageable memory on its own stream,
so that the driver's own staging runs on several cores at once (ordered after, and before, the
device's stream through events). Copies are ordered on the device's
stream, so they follow the kernels queued before them. ``h2d`` returns once the host array may
be reused (the last chunk is in a staging buffer); ``d2h`` returns once the data is in place.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from polyhal_cuda.errors import check

if TYPE_CHECKING:
    from polyhal_cuda.device import CUDADevice

#: Bytes per staging buffer (two are used).
CHUNK = int(os.environ.get("POLYHAL_CUDA_STAGING_CHUNK", 64 << 20))
#: Copies up to this size go straight through cudaMemcpyAsync.
SMALL = 4 << 20
#: Host threads that fill or drain a staging buffer.
THREADS = int(os.environ.get("POLYHAL_CUDA_STAGING_THREADS", max(1, min(16, os.cpu_count() or 2))))

#: Large-copy strategy: "staged" (our pinned double buffers) or "parallel" (driver copies on
#: several threads and streams).
STRATEGY = os.environ.get("POLYHAL_CUDA_TRANSFER", "staged")

_H2D, _D2H, _DEFAULT = 1, 2, 4  # cudaMemcpyKind


def _parallel_copy(pool: ThreadPoolExecutor | None, dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for flat uint8 arrays, split across the pool's threads."""
    n = dst.size
    if pool is None or n < (1 << 20):
        np.copyto(dst, src)
        return
    parts = THREADS
    step = -(-n // parts)
    step = -(-step // 4096) * 4096  # page-sized pieces
    futures = [pool.submit(np.copyto, dst[i:i + step], src[i:i + step]) for i in range(0, n, step)]
    for f in futures:
        f.result()


class Stager:
    """Double-buffered pinned staging for one device (made on the first large transfer)."""

    def __init__(self, device: "CUDADevice") -> None:
        self.device = device
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] | None = None
        self._owners: list = []
        self._events: list = []
        self._pool: ThreadPoolExecutor | None = None

    def _ensure(self) -> None:
        if self._buffers is not None:
            return
        import cupy
        from cupy.cuda import pinned_memory, runtime

        flags = runtime.hostAllocPortable
        with check(f"allocating {2 * CHUNK} bytes of pinned staging memory for {self.device.name}"):
            owners = [pinned_memory.PinnedMemory(CHUNK, flags) for _ in range(2)]
        self._owners = owners
        self._buffers = [np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * CHUNK).from_address(m.ptr))
                         for m in owners]
        self._events = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix=f"polyhal-{self.device.name}-stage") \
            if THREADS > 1 else None

    def close(self) -> None:
        """Finish pending copies and free the staging buffers."""
        with self._lock:
            if self._buffers is None:
                return
            for ev in self._events:
                ev.synchronize()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._buffers, self._owners, self._events, self._pool = None, [], [], None

    # -- the two directions ------------------------------------------------------------------------

    def h2d(self, dst_ptr: int, host: np.ndarray) -> None:
        """Copy contiguous ``host`` (any dtype) to device address ``dst_ptr``."""
        from cupy.cuda import runtime

        flat = host.reshape(-1).view(np.uint8)
        n = flat.size
        if n == 0:
            return
        stream = self.device.stream
        if n <= SMALL:
            with check(f"copying {n} bytes to {self.device.name}"):
                # From pageable memory this returns once CUDA has taken the bytes: the caller may
                # reuse its array at once.
                runtime.memcpyAsync(dst_ptr, flat.ctypes.data, n, _DEFAULT, stream.ptr)
            return
        if STRATEGY == "parallel":
            return self._parallel(dst_ptr, flat.ctypes.data, n, _H2D)
        with self._lock, check(f"copying {n} bytes to {self.device.name} through pinned staging"):
            self._ensure()
            bufs, events = self._buffers, self._events
            for i, start in enumerate(range(0, n, CHUNK)):
                size = min(CHUNK, n - start)
                b = i & 1
                events[b].synchronize()  # the copy engine is done with this buffer
                _parallel_copy(self._pool, bufs[b][:size], flat[start:start + size])
                runtime.memcpyAsync(dst_ptr + start, self._owners[b].ptr, size, _H2D, stream.ptr)
                events[b].record(stream)

    def d2h(self, host: np.ndarray, src_ptr: int) -> None:
        """Fill contiguous ``host`` from device address ``src_ptr``; returns when it is filled."""
        from cupy.cuda import runtime

        flat = host.reshape(-1).view(np.uint8)
        n = flat.size
        if n == 0:
            return
        stream = self.device.stream
        if n <= SMALL:
            with check(f"copying {n} bytes from {self.device.name}"):
                runtime.memcpyAsync(flat.ctypes.data, src_ptr, n, _DEFAULT, stream.ptr)
                stream.synchronize()
            return
        if STRATEGY == "parallel":
            return self._parallel(flat.ctypes.data, src_ptr, n, _D2H)
        with self._lock, check(f"copying {n} bytes from {self.device.name} through pinned staging"):
            self._ensure()
            bufs, events = self._buffers, self._events
            starts = list(range(0, n, CHUNK))

            def issue(i: int) -> None:
                start = starts[i]
                size = min(CHUNK, n - start)
                runtime.memcpyAsync(self._owners[i & 1].ptr, src_ptr + start, size, _D2H, stream.ptr)
                events[i & 1].record(stream)

            for i in range(min(2, len(starts))):
                issue(i)
            for i, start in enumerate(starts):
                size = min(CHUNK, n - start)
                events[i & 1].synchronize()
                _parallel_copy(self._pool, flat[start:start + size], bufs[i & 1][:size])
                if i + 2 < len(starts):
                    issue(i + 2)

    # -- the "parallel" strategy -------------------------------------------------------------

    def _parallel(self, dst: int, src: int, n: int, kind: int) -> None:
        """``n`` bytes split over THREADS driver copies on THREADS streams, ordered after the
        device stream's work and (for host-to-device) before its later work."""
        import cupy
        from cupy.cuda import runtime

        with self._lock, check(f"copying {n} bytes {'to' if kind == _H2D else 'from'} {self.device.name} "
                               "with parallel driver copies"):
            if not getattr(self, "_streams", None):
                with self.device.activate():
                    self._streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(THREADS)]
                    self._pevents = [cupy.cuda.Event(disable_timing=True) for _ in range(THREADS + 1)]
                self._ppool = ThreadPoolExecutor(THREADS, thread_name_prefix=f"polyhal-{self.device.name}-copy")
            streams, events, ordinal = self._streams, self._pevents, self.device.ordinal
            events[-1].record(self.device.stream)
            for st in streams:
                st.wait_event(events[-1])
            step = -(-n // len(streams))
            step = -(-step // 4096) * 4096

            def piece(i: int) -> None:
                off = i * step
                size = min(step, n - off)
                if size > 0:
                    runtime.setDevice(ordinal)
                    runtime.memcpyAsync(dst + off, src + off, size, kind, streams[i].ptr)
                    if kind == _D2H:
                        streams[i].synchronize()

            for f in [self._ppool.submit(piece, i) for i in range(len(streams))]:
                f.result()
            if kind == _H2D:
                for st, ev in zip(streams, events):
                    ev.record(st)
                    self.device.stream.wait_event(ev)
