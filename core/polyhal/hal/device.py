"""Devices: what a backend implements so that the core can allocate, move data and dispatch."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from polyhal.dlpack import DLDeviceType
from polyhal.errors import KernelNotFoundError
from polyhal.hal.allocator import Allocator
from polyhal.hal.flags import MemoryAccess
from polyhal.hal.records import DeviceSpec
from polyhal.hal.scratch import MemoryLimits, MemorySpacePolicy, ScratchAssignment, place_scratch

if TYPE_CHECKING:
    from polyhal.dlpack import ImportedTensor
    from polyhal.hal.buffer import Buffer
    from polyhal.hal.kernels import KernelTable
    from polyhal.hal.queue import Queue
    from polyhal.hal.scratch import ScratchBinding, ScratchRequest
    from polyhal.hal.tensor import Tensor
    from polyhal.ir.types import TensorType

#: A prepared kernel: called with the native views of the inputs, then of the outputs.
Executable = Callable[..., None]


class Device:
    """A created device: its allocator, its kernels and its data movement.

    A backend subclasses this and implements the methods marked "backend". The core never
    calls a backend's native API itself, so every backend is found in the same place: its
    ``device.py`` (this class), ``allocator.py`` and ``kernels.py``.
    """

    #: DLPack device type of this device's device-local memory (see polyhal.dlpack.DLDeviceType).
    dlpack_device_type: int = 1

    #: Whether every kernel of this device takes strided (not row-major) operands at any offset
    #: (then :meth:`accepts_view` says yes for every op; otherwise each kernel's registration
    #: answers). Results are always written row-major.
    strided_views: bool = False

    def __init__(self, spec: DeviceSpec, allocator: Allocator | None = None) -> None:
        self.spec = spec
        #: What allocation goes through: the backend's allocator, or adaptors over it installed by
        #: the ``wrap_allocator`` hook, ``POLYHAL_ALLOCATOR`` or ``set_device_allocator``.
        self.allocator: Allocator = allocator  # type: ignore[assignment]
        #: The backend's own allocator, never replaced: operations only it knows (trim a pool,
        #: map a native buffer, look up live buffers) go here, since an adaptor has none of them.
        #: A backend sets both in its ``__init__``: ``self.native_allocator = self.allocator = X``.
        self.native_allocator: Allocator = allocator  # type: ignore[assignment]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def queues(self) -> tuple["Queue", ...]:
        """The device's queues (IREE's queue affinity bits index them); default: one
        :class:`~polyhal.hal.queue.InlineQueue`, made on first use. A backend with streams or
        several hardware queues overrides it."""
        queues = self.__dict__.get("_queues")
        if queues is None:
            from polyhal.hal.queue import InlineQueue

            queues = self.__dict__["_queues"] = (InlineQueue(self),)
        return queues

    @property
    def concurrent_queue(self) -> "Queue":
        """The queue a concurrent plan submits this device's work to: the first of :attr:`queues`
        that is asynchronous (a GPU stream's event-backed queue), else a
        :class:`~polyhal.hal.queue.HostThreadQueue` of this device made on first use (so the
        host keeps submitting to other devices while this one works)."""
        found = self.__dict__.get("_concurrent_queue")
        if found is None:
            from polyhal.hal.queue import HostThreadQueue

            found = next((q for q in self.queues if getattr(q, "asynchronous", False)), None)
            if found is None:
                found = HostThreadQueue(self, f"{self.name}/thread0")
            found = self.__dict__.setdefault("_concurrent_queue", found)
        return found

    #: How a name given to :meth:`~polyhal.hal.tensor.Tensor.to_device` is found: the registry
    #: that creates the device sets its ``get_device`` here; a device made outside a registry
    #: knows only itself.
    find_device: Callable[[str], "Device"] | None = None

    #: Why this device can no longer be used (a remote node that died), or None: set by its
    #: backend. The registry's default device list leaves a lost device out, so that a later
    #: compile places nothing on it.
    lost: BaseException | None = None

    @property
    def is_host(self) -> bool:
        """Whether this device's memory is the host's own (DLPack device type CPU): numpy arrays
        over it are used in place, and data moves between two such devices by a host copy."""
        return self.dlpack_device_type == DLDeviceType.CPU

    @property
    def ordinal(self) -> int:
        """The device's index within its backend (used as the DLPack device id)."""
        return int(self.spec.limits.get("ordinal", 0))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def accepts_view(self, op: str, attrs: Mapping[str, Any], in_types: Sequence[TensorType],
                     out_types: Sequence[TensorType], index: int, strides: tuple[int, ...], offset: int) -> bool:
        """Whether this device's kernel for ``op`` reads its operand ``index`` as a view: element
        ``strides`` over a buffer (not necessarily row-major), starting ``offset`` elements into it.

        The bufferize pass asks before it makes a data-movement op (transpose, reshape, slice,
        gather of one index) a view instead of a copy: it does so only when every consumer of the
        result accepts the view (IREE's "fold the copy into the consumer"); otherwise the op
        copies. Backends answer per op and operand -- a library GEMM takes a transposed matrix
        through its op flag and leading dimension, an elementwise kernel any strides; the
        default answers True on a device with :attr:`strided_views`, else what the kernel's
        registration in :attr:`kernels` declared (``register(..., views=...)``).
        """
        if self.strided_views:
            return True
        return self.kernels is not None and self.kernels.accepts_view(op, attrs, in_types, out_types, index,
                                                                      strides, offset)

    def memory_available(self) -> int | None:
        """Bytes this device could still allocate, as far as polyhal can tell; None if unknown.

        Devices whose memory is host memory (DLPack type CPU) answer the operating system's
        available memory; others their global memory (``limits["global_mem_size"]``) less what
        polyhal holds there. Plans and ``polyhal run`` use it to refuse what cannot fit up front,
        before an allocation that the OS would overcommit and a kernel would then fault on.
        Backends with a native query (``cudaMemGetInfo``) may override it.
        """
        if self.is_host:
            return host_memory_available()
        total = self.spec.limits.get("global_mem_size")
        if not isinstance(total, int) or self.allocator is None:
            return None
        return max(total - self.allocator.statistics.live_bytes, 0)

    # -- kernels (backend) ---------------------------------------------------------------------

    #: The backend's :class:`~polyhal.hal.kernels.KernelTable`; ``prepare``, ``scratch`` and
    #: ``kernel_names`` come from it (a backend sets it on its device class).
    kernels: KernelTable | None = None

    @property
    def kernel_names(self) -> frozenset[str]:
        """Names of the ops this device has kernels for."""
        return self.kernels.kernel_names if self.kernels is not None else frozenset()

    def prepare(self, op: str, attrs: Mapping[str, Any], in_types: tuple["TensorType", ...],
                out_types: tuple["TensorType", ...], scratch: "ScratchBinding | None" = None) -> Executable:
        """Compile/bind the kernel for one op instance; the result is the plan's hot path.

        ``scratch`` is given when :meth:`scratch` declared scratch for the instance: a
        :class:`~polyhal.hal.scratch.ScratchBinding` saying where each scratch was placed
        (private, workgroup or global memory), with the global buffers, allocated by the
        runtime. The kernel uses those and allocates nothing. Default: the kernel table's
        :meth:`~polyhal.hal.kernels.KernelTable.prepare`.
        """
        if self.kernels is None:
            raise KernelNotFoundError(f"{self.name} has no kernel for op {op!r}: its device class "
                                      f"{type(self).__name__} sets no kernel table (Device.kernels)")
        return self.kernels.prepare(self, op, attrs, in_types, out_types, scratch)

    def scratch(self, op: str, attrs: Mapping[str, Any], in_types: tuple["TensorType", ...],
                out_types: tuple["TensorType", ...]) -> Sequence["ScratchRequest"]:
        """The scratch the kernel(s) of one op instance need, as evaluated
        :class:`~polyhal.hal.scratch.ScratchRequest` records (default: what the kernel table
        declares; none without a table).

        Called at plan-compile time by the bufferize pass, which places each request in a memory
        space (the ``select_memory_space`` hook) and passes the result to :meth:`prepare`.
        """
        if self.kernels is None:
            return ()
        return self.kernels.scratch(self, op, attrs, in_types, out_types)

    #: How this device's scratch is placed (:data:`~polyhal.hal.scratch.MemorySpacePolicy`): the
    #: registry that creates the device sets its ``select_memory_space`` hook here; a device made
    #: outside a registry places by the core's default rule (:func:`~polyhal.hal.scratch.first_fit`).
    memory_space_policy: MemorySpacePolicy | None = None

    def place_scratch(self, requests: Sequence["ScratchRequest"]) -> tuple[ScratchAssignment, ...]:
        """Place ``requests`` (what :meth:`scratch` declared for one op instance) in memory spaces
        by this device's :attr:`memory_space_policy`, within its :class:`~polyhal.hal.scratch.MemoryLimits`.

        The bufferize pass calls it when a plan is compiled; a backend that prepares a kernel
        outside a plan calls it too, so that both place alike. Raises
        :class:`~polyhal.hal.scratch.ScratchError` when a scratch fits nowhere.
        """
        return place_scratch(tuple(requests), MemoryLimits.of(self.spec), self.name, self.memory_space_policy)

    def view(self, tensor: "Tensor") -> Any:
        """The native object kernels take for ``tensor`` (numpy view, pyopencl array, cupy array)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until all work queued on the device has finished."""

    def record(self, steps: Sequence[Callable[[], None]], slots: list, input_slots: Sequence[int],
               output_slots: Sequence[int]) -> Callable[[], None] | None:
        """Plan replay hook (backend): return a callable that runs ``steps`` (a compiled plan's
        prepared steps, which read and write ``slots``) as one replayable unit, or ``None`` to
        keep the plain step loop (the default).

        Called once when a plan that lives entirely on this device is built; the plan then calls
        the result on every run, after binding the run's inputs and outputs into
        ``slots[input_slots]`` and ``slots[output_slots]`` (the other slots never change). A
        backend with command buffers or graphs captures the steps once and rebinds the inputs
        and outputs on replay (CUDA: :mod:`polyhal_cuda.graphs`). Each step's ``writes``
        attribute is the tuple of slots it writes (a step writing only outputs may run outside
        the replayed unit, straight into the caller's outputs).
        """
        return None

    def profile_timer(self) -> Any:
        """Profiling hook (backend): an object that times steps on this device's queue, or
        ``None`` (the default: profiles time each step by the host clock around it and
        :meth:`synchronize`). The object has ``mark()``, which records a point on the queue and
        returns it, and ``elapsed_ns(start, end)``, which waits for ``end`` and returns the
        device time between two marks (CUDA: events on the device's stream). Called once per
        profiled plan; see :mod:`polyhal.profile`.
        """
        return None

    # -- data movement (backend) -----------------------------------------------------------------

    def _map(self, buffer: "Buffer", offset: int, length: int, access: MemoryAccess) -> np.ndarray:
        """Host view (uint8) of a host-visible buffer's bytes; valid until the buffer is released."""
        raise NotImplementedError

    def write(self, buffer: "Buffer", offset: int, host: np.ndarray) -> None:
        """Copy the bytes of contiguous ``host`` into ``buffer`` at ``offset`` (host to device)."""
        raise NotImplementedError

    def read(self, buffer: "Buffer", offset: int, host: np.ndarray) -> None:
        """Fill contiguous ``host`` from ``buffer`` at ``offset`` (device to host); waits for it."""
        raise NotImplementedError

    def copy(self, src: "Buffer", src_offset: int, dst: "Buffer", dst_offset: int, nbytes: int) -> None:
        """Copy bytes between two buffers of this device (queue-ordered)."""
        raise NotImplementedError

    # -- transfers between devices (backend capability) ------------------------------------------
    # onnxruntime's OrtDataTransferImpl (CanCopy / CopyTensors): a backend says which device pairs
    # it moves data between itself, and does it without a detour through a host array.

    #: How this backend moves data between host memory and this device by its own
    #: :meth:`upload` / :meth:`download`, straight from and into the host array (e.g.
    #: ``"enqueue_copy"``); None (the default) offers no transfer. When set, :meth:`can_copy`
    #: says yes for host <-> this device and :meth:`transfer` does it.
    host_copy_path: str | None = None

    def can_copy(self, src: "Device", dst: "Device") -> bool:
        """Whether this device's backend copies data from ``src`` to ``dst`` itself (one of them
        is this device) with :meth:`transfer`; otherwise the core downloads into a host array
        and uploads it. Asked once per plan transfer, when the plan is built. Default: host
        memory to and from this device where :attr:`host_copy_path` is set."""
        return self.host_copy_path is not None and ((src is self and dst.is_host) or (dst is self and src.is_host))

    def copy_path(self, src: "Device", dst: "Device") -> str:
        """How :meth:`transfer` moves data from ``src`` to ``dst``, for explain (e.g.
        ``"enqueue_copy"``, ``"peer copy"``, ``"staged through pinned host memory"``)."""
        return self.host_copy_path or "copy"

    def transfer(self, src: "Device", src_native: Any, dst: "Device", dst_native: Any, nbytes: int,
                 queued: bool = False) -> None:
        """Copy ``nbytes`` from ``src_native`` (a native array of ``src``) into ``dst_native`` (a
        native array of ``dst``), both dense row-major, complete on return; called only where
        :meth:`can_copy` said yes. Default: host <-> this device by :meth:`upload` / :meth:`download`.

        ``queued``: the caller (a concurrent plan) runs this on the destination's queue after a
        semaphore wait that orders the source's work before it, and learns of completion from
        that queue's signal -- so a copy between two devices with streams may stay queued on
        the destination's stream instead of waiting for both devices (CUDA's peer copy does)."""
        if dst is self:
            self.upload(src_native, dst_native)
        else:
            self.download(src_native, dst_native)

    # -- DLPack (backend) ----------------------------------------------------------------------

    def dlpack_device(self, buffer: "Buffer") -> tuple[int, int]:
        """The DLPack (device type, id) of ``buffer``: the kind decides (host, managed, device)."""
        return (self.dlpack_device_type, self.ordinal)

    def buffer_address(self, buffer: "Buffer") -> int:
        """The address DLPack exports for ``buffer`` (a device pointer, or a host pointer)."""
        raise NotImplementedError

    def dlpack_alias(self, buffer: "Buffer", dl_device: tuple[int, int]) -> bool:
        """Whether ``buffer`` may also be exported, without a copy, as memory of DLPack device
        ``dl_device`` (e.g. CUDA managed or pinned memory as plain CUDA memory, for consumers
        that read only kDLCUDA). The CPU needs no alias: host-visible memory maps. Default: no."""
        return False

    def dlpack_consumer_stream(self) -> Any:
        """The ``stream`` this device passes to a producer's ``__dlpack__`` when it imports
        (Array API: the consumer's stream, which the producer orders its work before); ``None``
        for devices without streams."""
        return None

    def _export_sync(self, buffer: "Buffer", stream: Any) -> None:
        """Order pending work on ``buffer`` before a consumer on ``stream`` reads it (DLPack's
        ``stream`` argument). Backends without asynchronous queues need nothing."""

    def import_dlpack(self, imported: "ImportedTensor") -> "Buffer":
        """Wrap memory described by a consumed DLPack capsule as an EXTERNAL buffer (no copy)."""
        raise NotImplementedError

    # -- native array movement (used by plan transfer steps) -----------------------------------

    def download(self, native: Any, host: np.ndarray) -> None:
        """Copy a native array of this device into the contiguous numpy array ``host``."""
        raise NotImplementedError

    def upload(self, host: np.ndarray, native: Any) -> None:
        """Copy contiguous numpy ``host`` into a native array of this device."""
        raise NotImplementedError


def host_memory_available() -> int | None:
    """The host's available memory in bytes (Linux ``MemAvailable``, else free pages); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
