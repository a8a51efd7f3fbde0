"""Placement: a device for every op, and transfers where a value crosses devices.

(1) Candidates per dispatch: the devices of its affinity (or the compile-time device list) whose
backend has the kernel. (2) A device per dispatch: the memoized ``select_allocator`` decision for
its results' allocation among the candidates — execution follows the data; the policy may read
the compile's device list and the op's workload (types, where its operands live). (3) Transfers: a
value consumed on another device than where it lives is copied once per destination device.
(4) Encode ops run where their operand lives; an operand not placed yet (a program input) is
placed with the encode's first consumer, so data is packed where it is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from polyhal.errors import KernelNotFoundError
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.ir.program import Op, Program, Value
from polyhal.ir.types import Affinity
from polyhal.passes.fusion import Fusion
from polyhal.policy import AllocatorDecision, AllocatorSelector, Workload
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
    #: What MaterializeEncoding did (a polyhal.passes.materialize_encoding.EncodingReport).
    encodings: Any = None
    #: What the fusion passes did, in order; None when the compile was asked not to fuse.
    fusions: list[Fusion] | None = field(default_factory=list)
    #: What the precision policy did (a polyhal.passes.precision.PrecisionReport).
    precision: Any = None


#: ``device name -> the ops it has kernels for``.
KernelSets = Callable[[str], frozenset]


def kernel_sets(registry: Registry) -> KernelSets:
    """``device name -> its kernel set``, read once per device from its DeviceSpec (nothing is
    created); an unknown name raises DeviceNotFoundError listing the devices."""
    cache: dict[str, frozenset] = {}

    def kernels(device: str) -> frozenset:
        found = cache.get(device)
        if found is None:
            found = cache[device] = registry.kernel_names(device)
        return found

    return kernels


def candidates(op_names: Sequence[str], affinity: Affinity, kernels: KernelSets) -> list[str]:
    """The devices of ``affinity``, in order, that have a kernel for every op of ``op_names``."""
    return [d for d in affinity.devices if all(name in kernels(d) for name in op_names)]


def chosen_device(registry: Registry, selector: AllocatorSelector, devices: tuple[str, ...],
                  kernels: KernelSets) -> Callable[[Sequence[Op]], str | None]:
    """``chosen(ops) -> device name``: the device placement would choose for ``ops`` as they are
    (None when no device has all their kernels), for passes that decide before placement.

    That device is the ``select_allocator`` decision for the results of the last of ``ops``
    among the devices of their affinity (or ``devices``) that have every one of their kernels,
    as :func:`place` asks it.
    """
    specs = registry.specs_by_name()

    def chosen(ops: Sequence[Op]) -> str | None:
        last = ops[-1]
        affinity = last.affinity or Affinity(devices)
        names = candidates(dict.fromkeys(op.name for op in ops), affinity, kernels)
        if not names:
            return None
        workload = Workload(last.name, tuple(v.type for v in last.inputs), tuple(v.type for v in last.outputs),
                            last.attrs, (None,) * len(last.inputs))
        return selector.select(tuple((specs[n], affinity.queue_affinity) for n in names),
                               RESULT_MEMORY, RESULT_USAGE, 0, devices=devices, workload=workload).device_name

    return chosen


def fusion_gate(registry: Registry, selector: AllocatorSelector, devices: tuple[str, ...],
                kernels: KernelSets) -> Callable[[str, Sequence[Op]], bool]:
    """The fusion passes' question "fuse ``ops`` into one op ``fused``?", answered by placement:
    yes when the device that placement would choose for ``ops`` unfused
    (:func:`chosen_device`) has a ``fused`` kernel.

    So a fused op never pulls work away from the device the policy prefers (a device earlier
    in ``devices`` that lacks the fused kernel keeps the unfused ops), and since placement
    offers an op only to devices with its kernel, a fused op runs only where its kernel exists.
    """
    chosen = chosen_device(registry, selector, devices, kernels)

    def fusible(fused: str, ops: Sequence[Op]) -> bool:
        device = chosen(ops)
        return device is not None and fused in kernels(device)

    return fusible


def place(program: Program, registry: Registry, selector: AllocatorSelector,
          default_devices: tuple[str, ...], kernels: KernelSets | None = None) -> Placement:
    """Assign devices and insert transfers; returns a new Program (the input is not modified).

    ``kernels`` gives each device's kernel set (default: :func:`kernel_sets`); only the devices
    that ops are placed on are created, later, by the plan."""
    specs = registry.specs_by_name()
    kernels = kernels or kernel_sets(registry)
    value_device: dict[int, str] = {}
    copies: dict[tuple[int, str], Value] = {}
    placed_ops: list[Op] = []
    placement = Placement(program, value_device)
    constants = list(program.constants)
    constant_data = {v.id: data for v, data in constants}
    deferred: dict[int, Op] = {}  # encode ops whose operand is not placed yet, by result id

    def place_encode(op: Op, device: str) -> None:
        inputs = tuple(on_device(v, device) for v in op.inputs)
        for v in op.outputs:
            value_device[v.id] = device
        placed_ops.append(Op(op.kind, op.name, inputs, op.outputs, op.attrs, op.affinity, device))

    def on_device(value: Value, device: str) -> Value:
        if value.id in deferred:
            place_encode(deferred.pop(value.id), device)
        home = value_device.setdefault(value.id, device)  # an input lives where first used
        if home == device:
            return value
        key = (value.id, device)
        if key not in copies and value.id in constant_data:
            # A constant gets its own copy on each device that uses it, made once when the plan
            # is built, instead of a transfer on every run.
            moved = Value(value.type, f"{value.name}@{device}", value.program_id)
            constants.append((moved, constant_data[value.id]))
            value_device[moved.id] = device
            copies[key] = moved
        if key not in copies:
            moved = Value(value.type, f"{value.name}@{device}", value.program_id)
            placed_ops.append(Op("transfer", "copy", (value,), (moved,), device=device))
            value_device[moved.id] = device
            copies[key] = moved
            placement.transfers += 1
        return copies[key]

    for op in program.ops:
        if op.kind == "encode":
            home = value_device.get(op.inputs[0].id)
            if home is None:
                deferred[op.outputs[0].id] = op
            else:
                place_encode(op, home)
            continue
        affinity = op.affinity or Affinity(default_devices)
        names = candidates((op.name,), affinity, kernels)
        if not names:
            raise KernelNotFoundError(
                f"no device of {affinity} has a kernel for op {op.name!r}; devices with it: "
                f"{[n for n in specs if op.name in kernels(n)] or 'none'}")
        # The op as the cost policy sees it: operand types and where each operand lives so far
        # (None: a program input, bound at run time wherever the op lands).
        workload = Workload(op.name, tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs),
                            op.attrs, tuple(value_device.get(v.id) for v in op.inputs))
        decision = selector.select(tuple((specs[n], affinity.queue_affinity) for n in names),
                                   RESULT_MEMORY, RESULT_USAGE, 0, devices=default_devices, workload=workload)
        device = decision.device_name
        placement.decisions.append((op, tuple(names), decision))
        inputs = tuple(on_device(v, device) for v in op.inputs)
        for v in op.outputs:
            value_device[v.id] = device
        placed_ops.append(Op(op.kind, op.name, inputs, op.outputs, op.attrs, op.affinity, device))

    for op in list(deferred.values()):  # encodes whose results are only program outputs
        if op.outputs[0].id in deferred:
            place_encode(deferred.pop(op.outputs[0].id), default_devices[0])
    for v in program.inputs + program.outputs + [c for c, _ in constants]:
        value_device.setdefault(v.id, default_devices[0])
    outputs = _distinct_outputs(program, placed_ops, value_device)
    placement.program = Program(program.name, program.inputs, placed_ops, outputs, constants)
    return placement


def _distinct_outputs(program: Program, ops: list[Op], value_device: dict[int, str]) -> list[Value]:
    """Give every output its own value: a plan returns fresh buffers, so an output that is also
    an input (or a constant, or an earlier output) gets an explicit copy on its device."""
    taken = {v.id for v in program.inputs} | {c.id for c, _ in getattr(program, "constants", ())}
    outputs = []
    for v in program.outputs:
        if v.id in taken:
            device = value_device[v.id]
            copy = Value(v.type, f"{v.name}_copy", v.program_id)
            ops.append(Op("transfer", "copy", (v,), (copy,), device=device))
            value_device[copy.id] = device
            v = copy
        taken.add(v.id)
        outputs.append(v)
    return outputs
