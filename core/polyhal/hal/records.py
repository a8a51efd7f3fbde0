"""Frozen records that plugins hand to the core through hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from polyhal.hal.flags import HOST_MAPPING_USAGE, MAPPING_USAGE, BufferKind, BufferUsage, MemoryType

if TYPE_CHECKING:
    from polyhal.hal.device import Device
    from polyhal.ir.types import TensorType

#: Queue affinity meaning "any queue of the device" (IREE's IREE_HAL_QUEUE_AFFINITY_ANY).
ANY_QUEUE = -1


@dataclass(frozen=True)
class Heap:
    """One kind of memory an allocator serves (IREE's ``iree_hal_allocator_memory_heap_t``).

    ``memory_type`` is what the memory *is* (an allocation asking for a subset of these bits is
    served from here); ``allowed_usage`` the usages it supports; ``max_allocation_size`` the
    largest single allocation in bytes; ``kind`` the :class:`BufferKind` of its buffers.
    """

    memory_type: MemoryType
    allowed_usage: BufferUsage
    max_allocation_size: int
    kind: BufferKind = BufferKind.DEVICE
    #: Minimum alignment in bytes of every buffer from this heap.
    alignment: int = 64

    def serves(self, memory_type: MemoryType, usage: BufferUsage) -> bool:
        """True when a request for ``memory_type`` / ``usage`` can come from this heap.

        With ``MAPPING_OPTIONAL`` the mapping usages are a wish: a heap that cannot map still
        serves, and its buffers then carry no mapping usage (see :meth:`buffer_usage`).
        """
        wanted = MemoryType(memory_type) & ~MemoryType.OPTIMAL
        if (self.memory_type & wanted) != wanted:
            return False
        usage = BufferUsage(usage)
        if usage & BufferUsage.MAPPING_OPTIONAL:
            usage &= ~MAPPING_USAGE
        return (self.allowed_usage & usage) == usage

    def maps(self, usage: BufferUsage) -> bool:
        """True when this heap allows every mapping usage in ``usage`` (MAPPING_OPTIONAL aside)."""
        wanted = BufferUsage(usage) & MAPPING_USAGE & ~BufferUsage.MAPPING_OPTIONAL
        return (self.allowed_usage & wanted) == wanted

    def buffer_usage(self, usage: BufferUsage) -> BufferUsage:
        """The usage a buffer from this heap carries when ``usage`` was asked (IREE's allocators
        return more than asked, never less, except for what MAPPING_OPTIONAL lets them drop).

        A heap that cannot map drops an optional mapping request (as IREE's Vulkan allocator
        does); a host-visible heap that allows mapping grants :data:`HOST_MAPPING_USAGE`
        (scoped and persistent mapping, random access) to every buffer, as IREE's heap allocator
        does for host memory, so that memory the host can address is mappable without asking.
        """
        usage = BufferUsage(usage)
        if not self.maps(usage):
            usage &= ~MAPPING_USAGE
        if self.memory_type & MemoryType.HOST_VISIBLE:
            usage |= self.allowed_usage & HOST_MAPPING_USAGE
        return usage


@dataclass(frozen=True, eq=False)
class DeviceSpec:
    """A device as a plugin registers it: cheap to make, describes without creating anything.

    The core ranks devices by ``rank`` (higher first; ties broken by backend then name) and calls
    ``factory(spec)`` on first use to create the :class:`~polyhal.hal.device.Device` (contexts,
    queues). ``name`` is unique across all plugins, conventionally ``"<backend>:<index>"``.

    Records compare and hash by identity: the registry makes exactly one per device, and identity
    hashing keeps memoized policy keys cheap (a C-level hash, no Python call).
    """

    name: str
    backend: str
    rank: int
    factory: Callable[["DeviceSpec"], "Device"] = field(compare=False, repr=False)
    #: Memory heaps the device's allocator serves.
    heaps: tuple[Heap, ...] = ()
    #: Bytes of workgroup (shared / ``__local``) memory per workgroup; 0 if none.
    workgroup_bytes: int = 0
    #: Free-form capability tags, e.g. ``{"fp16", "svm", "cuda-graphs"}``. ``"ftz"`` says the
    #: device's float32 kernels flush denormal inputs and results to zero (GPU fast paths do); the
    #: conformance suite then checks them against a reference on flushed inputs.
    capabilities: frozenset[str] = frozenset()
    #: Device limits for display and planning (max workgroup size, global memory, ...).
    limits: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: DLPack (device type, id) pairs whose memory this device can import without a copy.
    dlpack_devices: frozenset[tuple[int, int]] = frozenset()
    description: str = ""
    #: Names of the ops the device has kernels for (its backend's kernel set). Placement and the
    #: fusion passes read them here, so a compile creates only the devices it places ops on.
    #: ``None`` (a plugin that does not declare them): the core creates the device to ask it
    #: (:attr:`Device.kernel_names <polyhal.hal.device.Device.kernel_names>`).
    kernel_names: frozenset[str] | None = field(default=None, compare=False, repr=False)
    #: Name of the plugin that registered it; filled in by the registry.
    plugin: str = ""

    @property
    def memory_types(self) -> tuple[MemoryType, ...]:
        """The memory types of the device's heaps, in order."""
        return tuple(h.memory_type for h in self.heaps)


@dataclass(frozen=True)
class Workload:
    """The op whose results an allocation holds, as placement sees it (static shapes).

    A cost model needs what the op reads and writes and where its operands live now, so that it
    can price moving them; ``input_devices[i]`` is the device holding operand ``i`` (``None``
    where it is not placed yet, e.g. a program input bound at run time).

    Placement also says where the schedule stands, so that a policy can spread independent
    work over devices that run concurrently (a concurrent plan's lanes): ``busy`` holds
    ``(device, seconds)`` -- when each device placed so far is estimated to finish its work --
    and ``input_ready[i]`` when operand ``i`` is estimated to be ready (seconds from the start
    of a run). Both are estimates the policy itself reported for earlier ops
    (:meth:`~polyhal.policy.Selection.estimated`); empty where none did.
    """

    op: str
    inputs: tuple["TensorType", ...] = ()
    outputs: tuple["TensorType", ...] = ()
    attrs: tuple = ()
    input_devices: tuple[str | None, ...] = ()
    busy: tuple[tuple[str, float], ...] = ()
    input_ready: tuple[float, ...] = ()

    def signature(self) -> tuple:
        """What the op computes, wherever it runs: (op, inputs, outputs, attrs) -- the key of a
        measured kernel time."""
        return (self.op, self.inputs, self.outputs, self.attrs)

    @property
    def input_bytes(self) -> int:
        return sum(t.nbytes for t in self.inputs)

    @property
    def output_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    def bytes_from(self, device: str) -> dict[str, int]:
        """Bytes of operands that would have to move onto ``device``, per source device."""
        moved: dict[str, int] = {}
        for t, home in zip(self.inputs, self.input_devices):
            if home is not None and home != device:
                moved[home] = moved.get(home, 0) + t.nbytes
        return moved

    @property
    def flops(self) -> float:
        """A rough count of arithmetic operations (for default kernel-time estimates)."""
        attrs = dict(self.attrs)
        out = self.outputs[0] if self.outputs else None
        if self.op in ("matmul", "gemm") and len(self.inputs) >= 2 and out is not None:
            a = self.inputs[0]
            k = a.shape[-2] if attrs.get("trans_a") and a.rank >= 2 else (a.shape[-1] if a.shape else 1)
            return 2.0 * out.size * k
        return float(max(sum(t.size for t in self.outputs), sum(t.size for t in self.inputs)))

    def __str__(self) -> str:
        ins = ", ".join(f"{t}@{d}" if d else str(t) for t, d in zip(self.inputs, self.input_devices))
        return f"{self.op}({ins})"


# --------------------------------------------------------------------------------------------------
# The selection in progress
# --------------------------------------------------------------------------------------------------
