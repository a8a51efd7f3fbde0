"""CPUDevice: kernels run synchronously in numpy on the calling thread."""

from __future__ import annotations

import ctypes
import time

import numpy as np

from polyhal.hal.buffer import Buffer
from polyhal.hal.device import Device
from polyhal.hal.flags import BufferKind, MemoryAccess
from polyhal.hal.records import DeviceSpec

from polyhal_cpu import threads
from polyhal_cpu.allocator import CPUAllocator
from polyhal_cpu.kernels import TABLE  # the module lists every kernel module's ops (imported on use)


class CPUDevice(Device):
    """The host CPU as a polyhal device. Work is synchronous, so ``synchronize`` has nothing to do."""

    dlpack_device_type = 1  # kDLCPU
    kernels = TABLE
    strided_views = True  # kernels take operands of any strides (see polyhal_cpu.kernels)

    def __init__(self, spec: DeviceSpec) -> None:
        super().__init__(spec)
        self.native_allocator = self.allocator = CPUAllocator(self, spec.heaps)
        threads.budget()  # BLAS runs on one thread from the first device on (polyhal_cpu.threads)

    def record(self, steps, slots, input_slots, output_slots):
        """The plain step loop, after the thread budget's look at how busy the CPUs are (at most
        every few hundred milliseconds; :mod:`polyhal_cpu.threads`)."""
        adjust = threads.budget().adjust
        steps = tuple(steps)

        def run() -> None:
            adjust()
            for step in steps:
                step()
        return run

    def profile_timer(self) -> "_HostTimer":
        """Step timing for profiles: the host clock (kernels run synchronously on the calling
        thread), with the thread budget's look at the CPUs' load that a plain run makes."""
        return _HostTimer(threads.budget().adjust)

    def dlpack_device(self, buffer: Buffer) -> tuple[int, int]:
        return (1, 0)  # every logical CPU device shares the host's memory

    def view(self, tensor) -> np.ndarray:
        raw = tensor.buffer.native
        dtype = tensor.dtype
        if tensor.is_contiguous:
            return raw[tensor.offset: tensor.offset + tensor.nbytes].view(dtype).reshape(tensor.shape)
        return tensor._host_view()

    def _map(self, buffer: Buffer, offset: int, length: int, access: MemoryAccess) -> np.ndarray:
        return buffer.native[offset: offset + length]

    def write(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        flat = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        buffer.native[offset: offset + flat.size] = flat

    def read(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        flat = host.reshape(-1).view(np.uint8)
        flat[...] = buffer.native[offset: offset + flat.size]

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        dst.native[dst_offset: dst_offset + nbytes] = src.native[src_offset: src_offset + nbytes]

    def buffer_address(self, buffer: Buffer) -> int:
        return buffer.native.ctypes.data

    def import_dlpack(self, imported) -> Buffer:
        item = imported.dtype.itemsize
        extent = 0
        if all(d > 0 for d in imported.shape):
            extent = (sum((d - 1) * s for d, s in zip(imported.shape, imported.strides)) + 1) * item
        if extent:
            native = np.frombuffer((ctypes.c_uint8 * extent).from_address(imported.data_ptr), dtype=np.uint8)
        else:
            native = np.empty(0, np.uint8)
        if imported.readonly:
            native.flags.writeable = False
        heap = self.native_allocator.heaps[0]
        return Buffer(self.native_allocator, heap, extent, native, kind=BufferKind.EXTERNAL,
                      allowed_access=MemoryAccess.READ if imported.readonly else MemoryAccess.ALL,
                      on_release=lambda *_: imported.release())

    def download(self, native: np.ndarray, host: np.ndarray) -> None:
        np.copyto(host, native)

    def upload(self, host: np.ndarray, native: np.ndarray) -> None:
        np.copyto(native, host)


class _HostTimer:
    """Marks are host clock readings (ns); each lets the thread budget re-sample when due."""

    __slots__ = ("_adjust",)
    name = "host clock (synchronous kernels)"

    def __init__(self, adjust) -> None:
        self._adjust = adjust

    def mark(self) -> int:
        self._adjust()
        return time.perf_counter_ns()

    @staticmethod
    def elapsed_ns(start: int, end: int) -> int:
        return end - start
