"""Placement: a device for every op, and transfers where a value crosses devices.

(1) Candidates per dispatch: the devices of its affinity (or the compile-time device list) whose
backend has the kernel. (2) A device per dispatch: the memoized ``select_allocator`` decision for
its results' allocation among the candidates — execution follows the data. (3) Transfers: a
value consumed on another device than where it lives is copied once per destination device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polyhal.errors import KernelNotFoundError
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.ir.program import Op, Program, Value
from polyhal.ir.types import Affinity
from polyhal.policy import AllocatorDecision, AllocatorSelector
from polyhal.registry import Registry

#: What placement asks the allocation policy for: results of dispatches.
RESULT_MEMORY = MemoryType.DEVICE_LOCAL
RESULT_USAGE = BufferUsage.DEFAULT


@dataclass
class Placement:
    """The placed program plus what explain needs."""

    program: Program
    value_device: dict[int, str]
    decisions: list[tuple[Op, tuple[str, ...], AllocatorDecision]] = field(default_factory=list)
    transfers: int = 0


def place(program: Program, registry: Registry, selector: AllocatorSelector,
          default_devices: tuple[str, ...]) -> Placement:
    """Assign devices and insert transfers; returns a new Program (the input is not modified)."""
    specs = {s.name: s for s in registry.device_specs()}
    value_device: dict[int, str] = {}
    copies: dict[tuple[int, str], Value] = {}
    placed_ops: list[Op] = []
    placement = Placement(program, value_device)

    def on_device(value: Value, device: str) -> Value:
        home = value_device.setdefault(value.id, device)  # an input lives where first used
        if home == device:
            return value
        key = (value.id, device)
        if key not in copies:
            moved = Value(value.type, f"{value.name}@{device}", value.program_id)
            placed_ops.append(Op("transfer", "copy", (value,), (moved,), device=device))
            value_device[moved.id] = device
            copies[key] = moved
            placement.transfers += 1
        return copies[key]

    for op in program.ops:
        affinity = op.affinity or Affinity(default_devices)
        candidates = []
        for name in affinity.devices:
            registry.get_device(name)  # unknown names fail here with the list of devices
            if op.name in registry.get_device(name).kernel_names:
                candidates.append(name)
        if not candidates:
            raise KernelNotFoundError(
                f"no device of {affinity} has a kernel for op {op.name!r}; devices with it: "
                f"{[n for n in specs if op.name in registry.get_device(n).kernel_names] or 'none'}")
        decision = selector.select(tuple((specs[n], affinity.queue_affinity) for n in candidates),
                                   RESULT_MEMORY, RESULT_USAGE, 0)
        device = decision.device_name
        placement.decisions.append((op, tuple(candidates), decision))
        inputs = tuple(on_device(v, device) for v in op.inputs)
        for v in op.outputs:
            value_device[v.id] = device
        placed_ops.append(Op(op.kind, op.name, inputs, op.outputs, op.attrs, op.affinity, device))

    for v in program.inputs + program.outputs:
        value_device.setdefault(v.id, default_devices[0])
    placement.program = Program(program.name, program.inputs, placed_ops, program.outputs)
    return placement
