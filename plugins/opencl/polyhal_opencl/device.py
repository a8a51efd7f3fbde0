"""CLDevice: one OpenCL device with its context, one in-order queue, its allocator and kernels.

Ordering: every command (kernels, copies, maps) goes to one in-order queue, so work is ordered
without events. ``write``/``upload`` block until the host data is copied (the caller may reuse
its array at once), ``read``/``download`` block until the data has arrived, kernels and
buffer-to-buffer copies do not block. ``synchronize`` finishes the queue. As a HAL queue
(``queues``, :class:`~polyhal_opencl.queue.CLQueue`) it signals timeline semaphores with marker
events, which other queues of the context wait for on the device.

DLPack: every buffer reports DLPack device ``(kDLOpenCL=4, ordinal)`` and exports its
``cl_mem`` handle as the data pointer, as dlpack.h specifies for OpenCL. Host-visible buffers
are reported as OpenCL memory too, not as CPU memory: ``polyhal.from_dlpack`` hands a capsule
to the best-ranked device claiming its DLPack device, so a CPU report would send our own tensors
to the CPU backend and lose the zero-copy round trip. CPU consumers still get host-visible
memory without a copy by asking for the CPU (``np.from_dlpack(t, device="cpu")``: the core
exports the persistent mapping, valid while the tensor lives), and device-only memory by copy.
Import accepts only this device's own live ``cl_mem`` handles (see :meth:`import_dlpack`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.errors import DLPackError
from polyhal.hal.buffer import Buffer
from polyhal.hal.device import Device
from polyhal.hal.flags import BufferKind, MemoryAccess
from polyhal.hal.records import DeviceSpec

from polyhal_opencl.kernels import TABLE
from polyhal_opencl.allocator import CLAllocator
from polyhal_opencl.codegen import DeviceTraits
from polyhal_opencl.errors import check
from polyhal_opencl.program import ProgramCache, default_cache_dir
from polyhal_opencl.queue import CLQueue

# pyopencl is imported inside the functions that use it: without pyopencl the plugin still imports,
# lists no device and says why (plugin.enumerate_devices).

if TYPE_CHECKING:
    from polyhal.dlpack import ImportedTensor

#: DLPack's kDLOpenCL.
DLPACK_OPENCL = 4


class CLDevice(Device):
    """An OpenCL device as a polyhal device; made by the spec's factory on first use.

    ``context``, ``queue`` (in-order), ``traits`` (what kernel generation needs to know),
    ``programs`` (the :class:`~polyhal_opencl.program.ProgramCache`) and ``allocator`` (a
    :class:`~polyhal_opencl.allocator.CLAllocator`) are public for tools and tests.
    """

    dlpack_device_type = DLPACK_OPENCL
    host_copy_path = "enqueue_copy"  # host <-> device transfers: one copy straight from/into the host array
    kernels = TABLE

    def __init__(self, spec: DeviceSpec, cl_device: Any) -> None:
        import pyopencl as cl

        super().__init__(spec)
        self.cl_device = cl_device
        with check(f"creating the OpenCL context and queue of {spec.name}"):
            self.context = cl.Context([cl_device])
            self.queue = cl.CommandQueue(self.context, cl_device)
        self.traits = DeviceTraits.from_cl(cl_device)
        self.programs = ProgramCache(self.context, cl_device, default_cache_dir())
        self.native_allocator = self.allocator = CLAllocator(self, spec.heaps)

    @property
    def queues(self) -> tuple[CLQueue, ...]:
        """One :class:`~polyhal_opencl.queue.CLQueue` on :attr:`queue` (signals are marker events)."""
        queues = self.__dict__.get("_queues")
        if queues is None:
            queues = self.__dict__.setdefault("_queues", (CLQueue(self),))
        return queues

    def close(self) -> None:
        """Finish queued work and release the allocator's cached buffers (the device stays usable)."""
        self.synchronize()
        self.native_allocator.trim()

    def view(self, tensor) -> Any:
        """A ``pyopencl.array.Array`` over the tensor's bytes (buffer, byte offset, strides)."""
        import pyopencl.array as cla

        item = tensor.dtype.itemsize
        return cla.Array(self.queue, tensor.shape, tensor.dtype, data=tensor.buffer.native,
                         offset=tensor.offset, strides=tuple(s * item for s in tensor.strides))

    def synchronize(self) -> None:
        with check(f"waiting for {self.name}"):
            self.queue.finish()

    # -- data movement ---------------------------------------------------------------------------

    def _map(self, buffer: Buffer, offset: int, length: int, access: MemoryAccess) -> np.ndarray:
        # The mapping is persistent (see CLAllocator.mapping); finishing the queue makes every
        # kernel's writes visible before the host looks, on the unified memory this heap needs.
        self.synchronize()
        return self.native_allocator.mapping(buffer.native)[offset: offset + length]

    def write(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        import pyopencl as cl

        flat = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        if flat.size:
            with check(f"writing {flat.size} bytes to {self.name}"):
                cl.enqueue_copy(self.queue, buffer.native, flat, dst_offset=offset, is_blocking=True)

    def read(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        import pyopencl as cl

        flat = host.reshape(-1).view(np.uint8)
        if flat.size:
            with check(f"reading {flat.size} bytes from {self.name}"):
                cl.enqueue_copy(self.queue, flat, buffer.native, src_offset=offset, is_blocking=True)

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        import pyopencl as cl

        if nbytes:
            with check(f"copying {nbytes} bytes on {self.name}"):
                cl.enqueue_copy(self.queue, dst.native, src.native, byte_count=nbytes,
                                src_offset=src_offset, dst_offset=dst_offset)

    def download(self, native: Any, host: np.ndarray) -> None:
        import pyopencl as cl

        flat = host.reshape(-1).view(np.uint8)
        if flat.size:
            with check(f"reading {flat.size} bytes from {self.name}"):
                cl.enqueue_copy(self.queue, flat, native.base_data, src_offset=native.offset, is_blocking=True)

    def upload(self, host: np.ndarray, native: Any) -> None:
        import pyopencl as cl

        flat = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
        if flat.size:
            with check(f"writing {flat.size} bytes to {self.name}"):
                cl.enqueue_copy(self.queue, native.base_data, flat, dst_offset=native.offset, is_blocking=True)

    # -- DLPack ----------------------------------------------------------------------------------

    def dlpack_device(self, buffer: Buffer) -> tuple[int, int]:
        return (DLPACK_OPENCL, self.ordinal)

    def buffer_address(self, buffer: Buffer) -> int:
        """The ``cl_mem`` handle (DLPack's data pointer for OpenCL memory)."""
        return buffer.native.int_ptr

    def _export_sync(self, buffer: Buffer, stream: Any) -> None:
        # A consumer on another API cannot wait on our events: finish the queue.
        self.synchronize()

    def import_dlpack(self, imported: "ImportedTensor") -> Buffer:
        """Wrap a ``cl_mem`` this device exported and that is still alive, without a copy.

        The core folds DLPack's byte_offset into the data pointer, which for an opaque handle
        is handle + offset; so an exact handle is taken as offset 0, and otherwise the one live
        buffer whose handle range contains the address gives the offset (a sub-buffer, which
        needs an origin aligned to CL_DEVICE_MEM_BASE_ADDR_ALIGN). Foreign OpenCL memory is
        refused: its handle could belong to another context, unusable on our queue.
        """
        if (int(imported.device[0]), int(imported.device[1])) != (DLPACK_OPENCL, self.ordinal):
            raise DLPackError(f"{self.name} imports only DLPack device ({DLPACK_OPENCL}, {self.ordinal}), "
                              f"not {tuple(imported.device)}")
        owner, offset = self._find_export(imported.data_ptr)
        item = imported.dtype.itemsize
        extent = 0
        if all(d > 0 for d in imported.shape):
            if any(s < 0 for s in imported.strides):
                raise DLPackError(f"{self.name} cannot import OpenCL memory with negative strides")
            extent = (sum((d - 1) * s for d, s in zip(imported.shape, imported.strides)) + 1) * item
        if offset + extent > owner.native.size:
            raise DLPackError(f"DLPack tensor of {extent} bytes at offset {offset} does not fit its "
                              f"{owner.native.size}-byte OpenCL buffer")
        native = owner.native if offset == 0 else self._sub_buffer(owner, offset, extent)
        allocator = self.native_allocator

        def release(*_: Any) -> None:
            if native is not owner.native:
                allocator.forget_mapping(native)  # the sub-buffer goes with its last reference
            imported.release()

        return Buffer(self.native_allocator, owner.heap, extent, native, memory_type=owner.memory_type,
                      kind=BufferKind.EXTERNAL, on_release=release)

    def _find_export(self, address: int) -> tuple[Buffer, int]:
        live = self.native_allocator.live
        exact = live.get(address)
        if exact is not None and not exact.released:
            return exact, 0
        hits = [b for b in list(live.values())
                if not b.released and b.native.int_ptr < address < b.native.int_ptr + b.native.size]
        if len(hits) != 1:
            why = "no live buffer of this device" if not hits else "several buffers (ambiguous offset)"
            raise DLPackError(
                f"{self.name} can import only OpenCL memory it exported itself and that is still alive; "
                f"address {address:#x} matches {why}. Copy the data instead (tensor.numpy())")
        return hits[0], address - hits[0].native.int_ptr

    def _sub_buffer(self, owner: Buffer, offset: int, extent: int) -> Any:
        align = owner.heap.alignment
        if offset % align:
            raise DLPackError(f"cannot import an OpenCL tensor at byte offset {offset}: sub-buffers need "
                              f"offsets aligned to {align} bytes on {self.name}")
        with check(f"making a sub-buffer on {self.name}"):
            return owner.native.get_sub_region(offset, max(extent, 1))
