"""The compile :class:`Target`: what one compile is for, built once and handed to every pass.

A compile asks the same questions many times: which devices may run an op, which kernels a
device has, which device the allocation policy picks for a result, how a device lays out an
encoded tensor, where a kernel's scratch may live, how much memory a device has, in which
precision float32 work may run. Before the Target, every pass took the
:class:`~polyhal.registry.Registry` and asked it again. Now :meth:`Target.build` reads the
registry once per compile into this record, passes take ``(compilation, target)`` (see
:mod:`polyhal.passes.pipeline`), and only the :class:`~polyhal.plan.Plan` keeps the registry, to
create devices and allocate.

IREE draws the same line: its compiler runs on ``#hal.executable.target`` / ``#hal.device.target``
attributes (what the devices are and can do), its runtime on ``iree_hal_device_t`` objects.
Devices are still created lazily (:meth:`Target.device`): a plan for ``cpu:0`` loads no other
backend's driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.hal.records import DeviceSpec
from polyhal.ir.types import Affinity
from polyhal.policies.layouts import LayoutResolver
from polyhal.policies.precision import CAPABILITY, resolve_precision
from polyhal.policy import AllocatorSelector, Workload, selector_for

if TYPE_CHECKING:
    from polyhal.hal.device import Device
    from polyhal.hookcall import PluginManager
    from polyhal.ir.program import Op
    from polyhal.registry import Registry

__all__ = ["RESULT_MEMORY", "RESULT_USAGE", "Target"]

#: What placement asks the allocation policy for: results of dispatches.
RESULT_MEMORY = MemoryType.DEVICE_LOCAL
RESULT_USAGE = BufferUsage.DEFAULT


@dataclass(eq=False)
class Target:
    """The devices, kernels and policies one compile targets (see the module doc).

    Attributes are read by passes; nothing here changes while a compile runs, except the
    memo tables (kernel sets, layout resolutions), which fill as passes ask.
    """

    #: The ordered candidate list for ops without an affinity of their own (best first).
    devices: tuple[str, ...]
    #: ``device name -> DeviceSpec`` (names outside :attr:`devices` are looked up on demand:
    #: an op's own affinity may name them).
    specs: Mapping[str, DeviceSpec]
    #: The memoizing ``select_allocator`` policy (one per registry, shared across compiles).
    selector: AllocatorSelector
    #: The ``resolve_encoding`` policy, memoized per (device, encoded type) for this compile.
    layouts: LayoutResolver
    #: The hook relay, for policies a pass asks directly (``select_memory_space``).
    hooks: "PluginManager"
    #: ``"fp32"``, ``"tf32"`` or ``"fp16"`` (see :mod:`polyhal.passes.precision`).
    precision: str = "fp32"
    #: Where :attr:`precision` came from (``precision=``, ``POLYHAL_PRECISION`` or ``default``).
    precision_source: str = "default"
    #: Whether the fusion passes run (``compile(fuse=...)``).
    fuse: bool = True
    #: ``compile(data_tiling=...)``: None (conv chains only), True (matmuls too) or False.
    data_tiling: bool | None = None
    _kernel_names: Callable[[str], frozenset] = field(default=frozenset, repr=False)
    _create: Callable[[str], "Device"] | None = field(default=None, repr=False)
    _kernels: dict[str, frozenset] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, registry: "Registry", devices: Sequence[str], *, fuse: bool = True,
              data_tiling: bool | None = None, precision: str | None = None) -> "Target":
        """The target of a compile onto ``devices`` (in order) with ``registry``'s plugins; an
        unknown precision is a PrecisionError."""
        precision, source = resolve_precision(precision)
        specs = registry.specs_by_name()
        return cls(tuple(devices), specs, selector_for(registry),
                   LayoutResolver(specs, registry.pm, registry.policy_answer), registry.pm, precision, source,
                   fuse, data_tiling, registry.kernel_names, registry.get_device)

    # -- devices and kernels ---------------------------------------------------------------------

    def device(self, name: str) -> "Device":
        """The device ``name``, created on first use (a pass that needs the device itself, not
        just its spec: its scratch declarations, its free memory)."""
        if self._create is None:
            raise RuntimeError("this Target was built without a device factory; build it with Target.build")
        return self._create(name)

    def kernels(self, device: str) -> frozenset:
        """The ops ``device`` has kernels for (from its spec: nothing is created), read once."""
        found = self._kernels.get(device)
        if found is None:
            found = self._kernels[device] = self._kernel_names(device)
        return found

    def candidates(self, op_names: Sequence[str], affinity: Affinity) -> list[str]:
        """The devices of ``affinity``, in order, that have a kernel for every op of ``op_names``."""
        return [d for d in affinity.devices if all(name in self.kernels(d) for name in op_names)]

    def limits(self, device: str) -> Mapping[str, Any]:
        """Device ``device``'s memory limits (workgroup / private bytes, scratch alignment...)."""
        return self.specs[device].limits

    def supports_precision(self, device: str, precision: str) -> bool:
        """Whether ``device`` can compute float32 work in ``precision``."""
        return CAPABILITY[precision] in self.specs[device].capabilities

    # -- policy questions asked before placement -----------------------------------------------------

    def chosen_device(self, ops: Sequence["Op"]) -> str | None:
        """The device placement would choose for ``ops`` as they are (None when no device has
        all their kernels), for passes that decide before placement.

        That is the ``select_allocator`` decision for the results of the last of ``ops`` among
        the devices of their affinity (or :attr:`devices`) that have every one of their kernels,
        as :func:`~polyhal.passes.placement.place` asks it.
        """
        last = ops[-1]
        affinity = last.affinity or Affinity(self.devices)
        names = self.candidates(dict.fromkeys(op.name for op in ops), affinity)
        if not names:
            return None
        workload = Workload(last.name, tuple(v.type for v in last.inputs), tuple(v.type for v in last.outputs),
                            last.attrs, (None,) * len(last.inputs))
        return self.selector.select(tuple((self.specs[n], affinity.queue_affinity) for n in names),
                                    RESULT_MEMORY, RESULT_USAGE, 0, devices=self.devices,
                                    workload=workload).device_name

    def fusible(self, fused: str, ops: Sequence["Op"]) -> bool:
        """The fusion passes' question "fuse ``ops`` into one op ``fused``?": yes when the device
        placement would choose for ``ops`` unfused (:meth:`chosen_device`) has a ``fused`` kernel.

        So a fused op never pulls work away from the device the policy prefers (a device earlier
        in :attr:`devices` that lacks the fused kernel keeps the unfused ops), and since placement
        offers an op only to devices with its kernel, a fused op runs only where its kernel exists.
        """
        device = self.chosen_device(ops)
        return device is not None and fused in self.kernels(device)

    def __repr__(self) -> str:
        return (f"Target(devices={list(self.devices)}, precision={self.precision!r}, fuse={self.fuse}, "
                f"data_tiling={self.data_tiling})")

