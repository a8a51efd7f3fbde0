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
from typing import Any

from polyhal.errors import KernelNotFoundError
from polyhal.ir.program import Op, Program, Value
from polyhal.ir.types import Affinity
from polyhal.passes.fusion import Fusion
from polyhal.policy import AllocatorDecision, Workload
from polyhal.target import RESULT_MEMORY, RESULT_USAGE, Target



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


def place(program: Program, target: "Target") -> Placement:
    """Assign devices and insert transfers; returns a new Program (the input is not modified).

    Each device's kernel set comes from the target (from its spec); only the devices that ops
    are placed on are created, later, by the plan."""
    specs, selector, default_devices = target.specs, target.selector, target.devices
    value_device: dict[int, str] = {}
    copies: dict[tuple[int, str], Value] = {}
    placed_ops: list[Op] = []
    placement = Placement(program, value_device)
    constants = list(program.constants)
    constant_data = {v.id: data for v, data in constants}
    deferred: dict[int, Op] = {}  # encode ops whose operand is not placed yet, by result id
    busy: dict[str, float] = {}  # device -> estimated time its work so far is done (seconds)
    ready: dict[int, float] = {}  # value id -> estimated time it is ready

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
        names = target.candidates((op.name,), affinity)
        if not names:
            raise KernelNotFoundError(
                f"no device of {affinity} has a kernel for op {op.name!r}; devices with it: "
                f"{[n for n in specs if op.name in target.kernels(n)] or 'none'}")
        # The op as the cost policy sees it: operand types and where each operand lives so far
        # (None: a program input, bound at run time wherever the op lands, or a constant, copied
        # to each device that uses it once when the plan is built), and where the schedule
        # stands (each device's estimated busy time, each operand's ready time: what the policy
        # estimated for earlier ops; all zero when it estimates nothing).
        workload = Workload(op.name, tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs),
                            op.attrs, tuple(None if v.id in constant_data else value_device.get(v.id)
                                            for v in op.inputs),
                            tuple(sorted(busy.items())), tuple(ready.get(v.id, 0.0) for v in op.inputs))
        decision = selector.select(tuple((specs[n], affinity.queue_affinity) for n in names),
                                   RESULT_MEMORY, RESULT_USAGE, 0, devices=default_devices, workload=workload)
        device = decision.device_name
        if decision.finish is not None:
            finish = round(decision.finish, 12)  # (rounded: equal schedules give equal memo keys)
            busy[device] = max(busy.get(device, 0.0), finish)
            for v in op.outputs:
                ready[v.id] = finish
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
