"""MyDevice: the allocator, the kernel table, data movement and DLPack of the mydev backend."""

import ctypes

import numpy as np

from polyhal import Buffer, BufferKind, Device, MemoryAccess

from polyhal_mydev.allocator import MyAllocator
from polyhal_mydev.kernels import TABLE

#: The DLPack (device type, id) of this device's memory: kDLExtDev, DLPack's type for devices it
#: does not list. polyhal hands imported capsules of this type to this device. A copy of the
#: template renames it with the rest: two backends claiming one (type, id) collide.
DLPACK_DEVICE = (12, 0)


class MyDevice(Device):
    """The device, made by its spec's factory on first use."""

    kernels = TABLE  # prepare, scratch and kernel_names come from the table
    dlpack_device_type = DLPACK_DEVICE[0]

    def __init__(self, spec):
        super().__init__(spec)
        # allocator: what allocations go through (adaptors may wrap it); native_allocator: the
        # backend's own, for backend-only operations.
        self.native_allocator = self.allocator = MyAllocator(self, spec.heaps)

    def view(self, tensor):
        """The native array kernels take for ``tensor``: a numpy view of its bytes."""
        raw = tensor.buffer.native[tensor.offset: tensor.offset + tensor.nbytes]
        return np.lib.stride_tricks.as_strided(
            raw.view(tensor.dtype), tensor.shape, tuple(s * tensor.dtype.itemsize for s in tensor.strides))

    # -- data movement (a real device copies through its queue here) -----------------------------

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

    def download(self, native: np.ndarray, host: np.ndarray) -> None:
        np.copyto(host, native)

    def upload(self, host: np.ndarray, native: np.ndarray) -> None:
        np.copyto(native, host)

    # -- DLPack ----------------------------------------------------------------------------------

    def buffer_address(self, buffer: Buffer) -> int:
        return buffer.native.ctypes.data

    def import_dlpack(self, imported) -> Buffer:
        """Wrap the memory of a capsule of this device (no copy); released with the capsule."""
        item = imported.dtype.itemsize
        extent = 0
        if all(d > 0 for d in imported.shape):
            extent = (sum((d - 1) * s for d, s in zip(imported.shape, imported.strides)) + 1) * item
        native = (np.frombuffer((ctypes.c_uint8 * extent).from_address(imported.data_ptr), np.uint8)
                  if extent else np.empty(0, np.uint8))
        if imported.readonly:
            native.flags.writeable = False
        return Buffer(self.allocator, self.allocator.heaps[0], extent, native, kind=BufferKind.EXTERNAL,
                      on_release=lambda *_: imported.release())
