"""Devices: what a backend implements so that the core can allocate, move data and dispatch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from polyhal.errors import KernelNotFoundError
from polyhal.hal.allocator import Allocator
from polyhal.hal.flags import MemoryAccess
from polyhal.hal.records import DeviceSpec

if TYPE_CHECKING:
    from polyhal.dlpack import ImportedTensor
    from polyhal.hal.buffer import Buffer
    from polyhal.hal.scratch import ScratchRequest
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

    #: Whether this device's kernels take strided (not row-major) operands. Then the bufferize
    #: pass makes a ``transpose`` whose operand is an intermediate a strided view of that
    #: operand's buffer instead of a copy (its consumers read the view). Results are always
    #: written row-major.
    strided_views: bool = False

    def __init__(self, spec: DeviceSpec, allocator: Allocator | None = None) -> None:
        self.spec = spec
        self.allocator: Allocator = allocator  # type: ignore[assignment]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ordinal(self) -> int:
        """The device's index within its backend (used as the DLPack device id)."""
        return int(self.spec.limits.get("ordinal", 0))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # -- kernels (backend) ---------------------------------------------------------------------

    #: Names of the ops this device has kernels for.
    kernel_names: frozenset[str] = frozenset()

    def prepare(self, op: str, attrs: Mapping[str, Any], in_types: tuple["TensorType", ...],
                out_types: tuple["TensorType", ...]) -> Executable:
        """Compile/bind the kernel for one op instance; the result is the plan's hot path.

        When :meth:`scratch` declared scratch for the instance, the plan passes one more keyword
        argument, ``scratch=`` a :class:`~polyhal.hal.scratch.ScratchBinding`: where each scratch
        was placed (private, workgroup or global memory) and the global buffers, allocated by the
        runtime. The kernel uses those and allocates nothing.
        """
        raise KernelNotFoundError(f"{self.name} has no kernel for op {op!r}")

    def scratch(self, op: str, attrs: Mapping[str, Any], in_types: tuple["TensorType", ...],
                out_types: tuple["TensorType", ...]) -> Sequence["ScratchRequest"]:
        """The scratch the kernel(s) of one op instance need, as evaluated
        :class:`~polyhal.hal.scratch.ScratchRequest` records (backend; default: none).

        Called at plan-compile time by the bufferize pass, which places each request in a memory
        space (the ``select_memory_space`` hook) and passes the result to :meth:`prepare`.
        """
        return ()

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
        and outputs on replay (CUDA: :mod:`polyhal_cuda.graphs`).
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
