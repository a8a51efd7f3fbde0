"""Bufferization: memory spaces for kernel scratch, and a buffer plan for intermediates.

Runs after placement, at plan-compile time, and decides every byte a plan will touch:

1. **Scratch placement.** For each dispatch, the device states what its kernel needs
   (:meth:`~polyhal.hal.device.Device.scratch`: :class:`~polyhal.hal.scratch.ScratchRequest`
   records). The device places them (:meth:`~polyhal.hal.device.Device.place_scratch`, shared
   with backends that prepare a kernel outside a plan): each request goes to its registry's
   ``select_memory_space`` hook with the limits the kernel has left; the answer is validated
   (the kernel must have code for that space and it must fit) and recorded as a
   :class:`~polyhal.hal.scratch.ScratchAssignment`. A scratch that fits
   no space is a :class:`~polyhal.hal.scratch.ScratchError` naming kernel, size and limits.
2. **Memory types.** Every intermediate gets the memory type and usage its producer and
   consumers need (device-local storage for dispatches; transfer source/target for copies).
   Program outputs, which the host reads, are host-visible where the device has host-visible
   device memory (unified memory: a CPU OpenCL device, an integrated GPU), since a mapping is
   cheaper there than a copy; elsewhere they stay device-local and are copied on read.
3. **Buffer planning.** Intermediates and global scratch are given offsets in one arena per
   (device, memory type), so that two buffers share bytes only when their lifetimes (first
   and last op that touch them) do not overlap: greedy by size, largest first, each at the
   lowest offset that conflicts with no live buffer already placed (TFLite's and IREE's
   "greedy by size" planner). An op's outputs never share memory with its inputs or its
   scratch, because they are live at the same op. The arenas are allocated once, when the plan
   is built, through ``select_allocator``; the peak is the sum of their sizes, reported beside
   the unplanned peak (one buffer per intermediate and per global scratch, which is what a plan
   without this pass allocates).
4. **Views** (before 2). An op of :data:`VIEW_OPS` whose result is its operand's bytes seen
   anew gets no buffer and no kernel: its result is a :class:`View` of the buffer that holds the
   operand (element strides and an element offset over it), whose lifetime grows to cover the
   view's uses (IREE folds ``flow.tensor.reshape`` the same way, and folds a strided
   ``tensor.extract_slice`` into its consumers). ``reshape`` and ``identity`` keep the operand's
   layout (a reshape of a strided view only where no copy is needed, as numpy's); ``transpose``
   permutes strides; ``slice`` with positive steps and ``gather`` of one constant index move the
   offset and scale strides; a ``pad`` that pads nothing is the operand (Swin's window partition
   pads by zero wherever the feature map is a multiple of the window). A view that is row-major
   at an offset aligned as an intermediate's is valid everywhere (attention's split of q, k and v
   on any device); any other is made only when every consumer accepts it
   (:meth:`~polyhal.hal.device.Device.accepts_view`: the CPU's kernels take any strides, a CUDA
   GEMM a transposed matrix, ...), decided to a fixed point (refusing one view turns views of it
   into views of a copy, whose consumers are asked again; a strided gather that a reshape
   hands on towards a kernel of a device taking any strides counts as read by that kernel);
   otherwise the op stays and copies. A
   view needs an operand whose buffer the plan owns: the result of an op of the program, not a
   program input, a constant or a program output (those change per run or are handed to the
   caller), and it is never itself a program output (those are fresh, row-major tensors per
   run): those cases keep the op, which copies. The plan runs no step for an op whose result
   is a view.
5. **Concatenations in place** (with 4). Where a ``concat`` joins slices that lie contiguously in
   its result (every dim before the axis is 1: a batch of one, channels), each operand's producer
   writes straight into its slice of the result and the concat runs no step (bufferization's
   concat-in-place, as TensorRT and oneDNN do). Later concatenations are placed first, so that
   earlier ones of the same operands become prefixes of one buffer: DenseNet's dense block, whose
   every layer concatenates all the features before it, keeps its features in one block buffer
   rather than copying them again at each layer (:func:`plan_concats`). An operand placed so has
   no bytes of its own (an :class:`InPlace`); the buffer it lies in lives from the first write into
   it to the last read of any part of it. Only intermediates a dispatch of the same device writes,
   each in one place; slices at offsets an intermediate's alignment allows, or anywhere on a device
   whose kernels take any strides and offsets (``strided_views``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from polyhal.dlpack import reshaped_strides, row_major_strides
from polyhal.errors import OutOfMemoryError
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.hal.scratch import MemorySpace, Problem, ScratchAssignment, ScratchBinding
from polyhal.hal.tensor import Tensor
from polyhal.ir.types import TensorType
from polyhal.ops import normalize_slice

if TYPE_CHECKING:
    from polyhal.hal.buffer import Buffer
    from polyhal.ir.program import Op, Value
    from polyhal.passes.placement import Placement
    from polyhal.registry import Registry
    from polyhal.target import Target

__all__ = ["Arena", "BufferPlan", "InPlace", "PlannedBuffer", "VIEW_OPS", "View", "bufferize",
           "plan_concats", "plan_offsets", "plan_views"]

#: Byte alignment of intermediates inside an arena (covers every element type and vector loads).
VALUE_ALIGNMENT = 256
#: Byte alignment of global scratch inside an arena, unless the device declares its own
#: (``DeviceSpec.limits["scratch_alignment"]``; OpenCL sub-buffers need origins aligned to
#: CL_DEVICE_MEM_BASE_ADDR_ALIGN, at most a page on any driver we know).
SCRATCH_ALIGNMENT = 4096

_INTERMEDIATE = MemoryType.DEVICE_LOCAL
_HOST_READ = MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE

#: Ops whose result may be a view of the operand's bytes instead of a copy (see the module doc),
#: and how the view's strides follow from the operand's: "reshape" keeps the layout, "transpose"
#: permutes it, "slice" and "gather" (of one constant index) move the offset, and "pad" is a view
#: only where it pads nothing (Swin's window partition pads by zero wherever the feature map is
#: a multiple of the window: a copy of a whole feature map otherwise).
VIEW_OPS: dict[str, str] = {"reshape": "reshape", "identity": "reshape", "pad": "pad", "transpose": "transpose",
                            "slice": "slice", "gather": "gather"}


@dataclass
class PlannedBuffer:
    """One intermediate value or global scratch: where it lives and when.

    ``first``/``last`` are the indices of the first and last op that touch it (inclusive);
    ``offset`` its byte offset in arena ``arena``.
    """

    name: str
    device: str
    nbytes: int
    first: int
    last: int
    memory_type: MemoryType
    usage: BufferUsage
    value: "Value | None" = None
    scratch: ScratchAssignment | None = None
    op_index: int = -1
    alignment: int = VALUE_ALIGNMENT
    arena: int = -1
    offset: int = -1

    def overlaps(self, other: "PlannedBuffer") -> bool:
        """Whether the two are live at a common op."""
        return self.first <= other.last and other.first <= self.last


@dataclass
class View:
    """An intermediate that is a view of another intermediate's buffer: no bytes of its own and
    no kernel. ``source`` owns the bytes (it is never a view itself); ``strides`` are the view's
    element strides over them (``None``: row-major) and ``offset`` the element it starts at;
    ``op_index`` is the op it replaces."""

    value: "Value"
    source: "Value"
    strides: tuple[int, ...] | None
    op_index: int
    op: str = ""
    offset: int = 0

    @property
    def plain(self) -> bool:
        """Row-major, at an offset aligned as an intermediate's would be: valid for every consumer
        on every device (each reads its operands at such offsets in an arena anyway)."""
        return self.strides is None and self.offset * self.value.type.dtype.itemsize % VALUE_ALIGNMENT == 0


@dataclass
class InPlace:
    """An intermediate that its producer writes straight into its slice of a concatenation's
    buffer (see the module doc): no bytes of its own. ``owner`` owns the bytes (it is never placed
    itself), ``offset`` is the element the value starts at in them, row-major."""

    value: "Value"
    owner: "Value"
    offset: int


@dataclass
class Arena:
    """One allocation of a plan: a device, a memory type, a usage and a size."""

    device: str
    memory_type: MemoryType
    usage: BufferUsage
    nbytes: int = 0


@dataclass
class BufferPlan:
    """What bufferize decided; :meth:`materialize` allocates it, :meth:`explain` shows it."""

    #: op index -> the assignments of that op's scratch.
    scratch: dict[int, tuple[ScratchAssignment, ...]] = field(default_factory=dict)
    buffers: list[PlannedBuffer] = field(default_factory=list)
    arenas: list[Arena] = field(default_factory=list)
    #: program output value id -> the memory type its fresh tensors are allocated with.
    output_memory: dict[int, MemoryType] = field(default_factory=dict)
    #: intermediates that view another's buffer (in program order); their ops run no kernel.
    views: list[View] = field(default_factory=list)
    #: intermediates written in place into a concatenation's buffer, and the concats that they
    #: make steps with nothing to do (op indices).
    in_place: list[InPlace] = field(default_factory=list)
    concats_in_place: frozenset[int] = frozenset()

    @property
    def elided_ops(self) -> frozenset[int]:
        """Indices of the ops whose result is a view, or a concatenation whose operands were
        written in place: the plan runs no step for them."""
        return frozenset(v.op_index for v in self.views) | self.concats_in_place

    @property
    def peak_bytes(self) -> int:
        """Bytes the plan allocates for intermediates and global scratch (all arenas)."""
        return sum(a.nbytes for a in self.arenas)

    @property
    def unplanned_bytes(self) -> int:
        """Bytes without buffer planning: one buffer per intermediate and per global scratch."""
        return sum(b.nbytes for b in self.buffers)

    def explain(self) -> str:
        """Scratch placements, arenas, and each buffer's offset, memory type and lifetime."""
        lines = [f"buffers: {len(self.buffers)} planned into {len(self.arenas)} arena(s), peak "
                 f"{self.peak_bytes} B (unplanned {self.unplanned_bytes} B)"]
        for i, a in enumerate(self.arenas):
            lines.append(f"  arena {i}: {a.device} {a.memory_type.describe()} {a.nbytes} B "
                         f"(usage {a.usage.describe()})")
        for b in sorted(self.buffers, key=lambda b: (b.arena, b.offset)):
            what = "scratch" if b.scratch is not None else "value"
            lines.append(f"    +{b.offset} {b.nbytes} B {what} {b.name} live ops {b.first}..{b.last} "
                         f"({b.usage.describe()})")
        for w in self.views:
            how = "row-major" if w.strides is None else f"strides {list(w.strides)}"
            how += f", offset {w.offset}" if w.offset else ""
            lines.append(f"  view %{w.value.name} of %{w.source.name}'s buffer ({w.op} at op {w.op_index}, "
                         f"{how}): no copy")
        for p in self.in_place:
            lines.append(f"  %{p.value.name} written in place into %{p.owner.name}'s buffer at element {p.offset}")
        if self.concats_in_place:
            lines.append(f"  concats in place (no copy): ops {sorted(self.concats_in_place)}")
        for vid, mt in self.output_memory.items():
            if mt & MemoryType.HOST_VISIBLE:
                lines.append(f"  output value #{vid}: {mt.describe()} (host reads it without a copy)")
        if self.scratch:
            lines.append("scratch:")
            for i, assigned in sorted(self.scratch.items()):
                for a in assigned:
                    lines.append(f"  op {i}: {a}")
        return "\n".join(lines)

    # -- allocation --------------------------------------------------------------------------------

    def materialize(self, registry: "Registry", selector: Any, name: str = "") -> "Materialized":
        """Allocate the arenas (through ``select_allocator``) and make every planned view.

        Arenas that together exceed a device's available memory are refused first, with an
        :class:`~polyhal.errors.OutOfMemoryError` naming the plan (``name``) and its largest value
        there: an allocation the OS overcommits would fail later, in a kernel, or take the host down.
        """
        self._check_available(registry, name)
        specs = registry.specs_by_name()
        arenas = [self._allocate_arena(registry, selector, specs, i, name) for i in range(len(self.arenas))]
        values: dict[int, Tensor] = {}
        bindings: dict[int, dict[tuple[str, str], Any]] = {}
        for b in self.buffers:
            buf = arenas[b.arena]
            if b.value is not None:
                values[b.value.id] = Tensor(buf, b.value.type, offset=b.offset)
            else:
                view = Tensor(buf, TensorType((b.nbytes,), "uint8"), offset=b.offset)
                key = (b.scratch.request.kernel.name, b.scratch.request.name)
                bindings.setdefault(b.op_index, {})[key] = view.native
        for p in self.in_place:  # before the views: a view's source may lie in a concatenation's buffer
            owner = values[p.owner.id]
            values[p.value.id] = Tensor(owner.buffer, p.value.type,
                                        offset=owner.offset + p.offset * owner.dtype.itemsize)
        for w in self.views:
            src = values[w.source.id]
            values[w.value.id] = Tensor(src.buffer, w.value.type, offset=src.offset + w.offset * src.dtype.itemsize,
                                        strides=w.strides)
        scratch = {}
        global_scratch = _global_scratch(self.buffers)
        for i, assigned in self.scratch.items():
            placed = tuple(_with_offset(a, global_scratch, i) for a in assigned)
            scratch[i] = ScratchBinding(placed, bindings.get(i, {}))
        return Materialized(arenas, values, scratch)


    def _allocate_arena(self, registry: "Registry", selector: Any, specs: Mapping, index: int, name: str) -> "Buffer":
        """Arena ``index``; an allocator that refuses it (a limit, a device whose free memory went
        to other work since :meth:`_check_available`, a cuDNN workspace larger than expected) gets
        an :class:`~polyhal.errors.OutOfMemoryError` naming the plan and what the arena holds --
        the allocator's own message names only a byte count. Arenas allocated before it are
        dropped with the exception, so nothing stays allocated."""
        arena = self.arenas[index]
        try:
            return _allocate(registry, selector, specs, arena)
        except OutOfMemoryError as exc:
            held = sorted((b for b in self.buffers if b.arena == index), key=lambda b: -b.nbytes)[:3]
            what = ", ".join(f"{b.name} ({b.nbytes} bytes"
                             + (f": {b.scratch.request.purpose}" if b.scratch is not None and b.scratch.request.purpose
                                else "") + ")" for b in held)
            raise OutOfMemoryError(
                f"plan {name!r} could not allocate its {arena.nbytes}-byte arena of intermediates and kernel "
                f"scratch on {arena.device}; the largest in it: {what}. {exc}") from exc

    def _check_available(self, registry: "Registry", name: str) -> None:
        need: dict[str, int] = {}
        for a in self.arenas:
            need[a.device] = need.get(a.device, 0) + a.nbytes
        for device_name, nbytes in need.items():
            available = registry.get_device(device_name).memory_available()
            if available is None or nbytes <= available:
                continue
            on_device = [b for b in self.buffers if self.arenas[b.arena].device == device_name]
            largest = max(on_device, key=lambda b: b.nbytes)
            raise OutOfMemoryError(
                f"plan {name!r} needs {nbytes} bytes of intermediates on {device_name}, which has {available} "
                f"bytes available; the largest is {largest.name} ({largest.nbytes} bytes). Use smaller shapes, "
                "split the model, or place it on a device with more memory")


@dataclass
class Materialized:
    """The allocated arenas, a tensor per planned intermediate (by value id) and the scratch
    binding of each op that has scratch (by op index)."""

    arenas: list["Buffer"]
    values: dict[int, "Tensor"]
    scratch: dict[int, ScratchBinding]


def _global_scratch(buffers: list[PlannedBuffer]) -> dict[tuple[int, int], PlannedBuffer]:
    """The planned buffers of global scratch by (id of their assignment, op index); the first
    one where several match."""
    return {(id(b.scratch), b.op_index): b for b in reversed(buffers) if b.scratch is not None}


def _with_offset(a: ScratchAssignment, global_scratch: Mapping[tuple[int, int], PlannedBuffer],
                 op_index: int) -> ScratchAssignment:
    """``a`` at the offset its planned buffer got (``a`` itself when it has none: not global)."""
    b = global_scratch.get((id(a), op_index))
    if b is None or b.scratch is not a:
        return a
    return ScratchAssignment(a.request, a.space, a.nbytes, a.limit, a.plugin, b.offset)


def _allocate(registry: "Registry", selector: Any, specs: Mapping, arena: Arena) -> "Buffer":
    spec = specs.get(arena.device) or registry.get_device(arena.device).spec
    site = selector.site(((spec, -1),), arena.memory_type, arena.usage)
    alloc = getattr(site, "allocate", None)
    if alloc is not None:
        return alloc(max(arena.nbytes, 1))
    device = registry.get_device(site.decision.device_name)
    return device.allocator.allocate(max(arena.nbytes, 1), arena.memory_type, arena.usage)


# -- the pass ------------------------------------------------------------------------------------------

def bufferize(placement: "Placement", target: "Target") -> BufferPlan:
    """Place every scratch and plan every intermediate of a placed program (see the module doc)."""
    program = placement.program
    ops = program.ops
    plan = BufferPlan()
    device_of = placement.value_device
    output_ids = {v.id for v in program.outputs}
    host_read = _host_read_memory(target)

    # 1. scratch
    for i, op in enumerate(ops):
        if op.kind != "dispatch":
            continue
        device = target.device(op.device)
        requests = tuple(device.scratch(op.name, dict(op.attrs), tuple(v.type for v in op.inputs),
                                        tuple(v.type for v in op.outputs)) or ())
        if requests:
            plan.scratch[i] = device.place_scratch(requests)

    # 2. lifetimes and memory types of intermediates; views (4) share their source's buffer
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    usage: dict[int, BufferUsage] = {}
    values: dict[int, "Value"] = {}
    views = plan_views(program, target, frozenset(plan.scratch))
    plan.views = [views[i] for i in sorted(views)]
    plan.in_place, plan.concats_in_place = plan_concats(program, target, views)
    owner = {p.value.id: p.owner for p in plan.in_place}  # value id -> the value whose buffer holds it
    for w in plan.views:  # view value id -> the value whose buffer it views
        owner[w.value.id] = owner.get(w.source.id, w.source)
    elided = plan.elided_ops
    for i, op in enumerate(ops):
        for v in op.inputs:
            vid = owner[v.id].id if v.id in owner else v.id
            if vid in first:
                last[vid] = i
                usage[vid] |= (BufferUsage.TRANSFER_SOURCE if op.kind == "transfer"
                               else BufferUsage.DISPATCH_STORAGE_READ)
        if i in elided:
            continue
        for v in op.outputs:
            if v.id in output_ids:
                continue
            home = owner.get(v.id, v)  # written in place: the concatenation's buffer lives from here
            if home.id not in first:
                first[home.id] = i
                values[home.id] = home
                usage[home.id] = BufferUsage.NONE
            last[home.id] = i
            usage[home.id] |= (BufferUsage.TRANSFER_TARGET if op.kind == "transfer"
                               else BufferUsage.DISPATCH_STORAGE_WRITE)
    for vid, v in values.items():
        plan.buffers.append(PlannedBuffer(
            f"%{v.name}", device_of[vid], max(v.type.nbytes, 1), first[vid], last[vid], _INTERMEDIATE,
            usage[vid], value=v))
    for i, assigned in plan.scratch.items():
        for a in assigned:
            if a.space is MemorySpace.GLOBAL:
                plan.buffers.append(PlannedBuffer(
                    f"{a.request.kernel.name}.{a.request.name}", ops[i].device, max(a.nbytes, 1), i, i,
                    _INTERMEDIATE, BufferUsage.DISPATCH_STORAGE, scratch=a, op_index=i,
                    alignment=max(_scratch_alignment(target, ops[i].device), a.request.alignment, VALUE_ALIGNMENT)))
    for v in program.outputs:
        plan.output_memory[v.id] = host_read(device_of.get(v.id))

    # 3. offsets, one arena per (device, memory type)
    groups: dict[tuple[str, MemoryType], list[PlannedBuffer]] = {}
    for b in plan.buffers:
        groups.setdefault((b.device, b.memory_type), []).append(b)
    for (device, mt), members in groups.items():
        size = plan_offsets(members)
        arena_usage = BufferUsage.DEFAULT
        for b in members:
            arena_usage |= b.usage
        for b in members:
            b.arena = len(plan.arenas)
        plan.arenas.append(Arena(device, mt, arena_usage, size))
    # Record where each global scratch landed (its arena offset) in the assignments themselves.
    global_scratch = _global_scratch(plan.buffers)
    for b in plan.buffers:
        if b.scratch is not None:
            placed = _with_offset(b.scratch, global_scratch, b.op_index)
            plan.scratch[b.op_index] = tuple(placed if a is b.scratch else a for a in plan.scratch[b.op_index])
            b.scratch = placed
    return plan


def plan_views(program, target: "Target", keep: frozenset[int] = frozenset()) -> dict[int, View]:
    """The ops of ``program`` (by index) whose result is a :class:`View` (see the module doc);
    ``keep``: ops that must run (they have scratch). Views are proposed in program order, then
    each one that is not plain is checked against its consumers; refused ones copy, and the
    proposal is made again until no consumer refuses."""
    ops = program.ops
    output_ids = {v.id for v in program.outputs}
    owned = {v.id for op in ops for v in op.outputs if v.id not in output_ids}
    constants = {v.id: data for v, data in program.constants}
    consumers: dict[int, list[tuple[int, int]]] = {}
    for j, op in enumerate(ops):
        for k, v in enumerate(op.inputs):
            consumers.setdefault(v.id, []).append((j, k))
    refused = set(keep)
    while True:
        views: dict[int, View] = {}
        of_value: dict[int, View] = {}
        for i, op in enumerate(ops):
            if i not in refused:
                view = _as_view(op, i, of_value, owned, output_ids, constants)
                if view is not None:
                    views[i] = of_value[view.value.id] = view
        bad = {i for i, w in views.items() if not w.plain and not all(
            (j in views and not _block_reread(target, ops, views, consumers, w, j))
            or (j not in views and _accepts(target, ops[j], k, w, ops[i]))
            for j, k in consumers.get(w.value.id, ()))}
        if not bad:
            return views
        refused |= bad


def plan_concats(program, target: "Target", views: Mapping[int, View]) -> tuple[list[InPlace], frozenset[int]]:
    """The intermediates of ``program`` written in place into a concatenation's buffer, and the
    concats (op indices) left with nothing to do (see the module doc); ``views``: the ops whose
    result is a view (:func:`plan_views`), whose values stay as they are. Concats are taken last
    first: one whose operands already lie, in order, in a later one's buffer is a slice of it."""
    ops = program.ops
    output_ids = {v.id for v in program.outputs}
    producer: dict[int, int] = {}  # value id -> index of the op that writes it (not a view)
    for i, op in enumerate(ops):
        if i not in views:
            for v in op.outputs:
                producer[v.id] = i
    viewed = {w.source.id for w in views.values()} | {w.value.id for w in views.values()}
    home: dict[int, tuple["Value", int]] = {}  # value id -> (owner, element offset)
    taken: dict[int, list[tuple[int, int]]] = {}  # owner id -> (offset, size) of what is written in it
    concats: set[int] = set()
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if i in views or op.kind != "dispatch" or op.name != "concat" or len(op.outputs) != 1:
            continue
        out = op.outputs[0]
        if out.id in output_ids or out.id in viewed or out.type.encoding is not None or out.type.nbytes == 0:
            continue
        axis = int(dict(op.attrs)["axis"]) % out.type.rank
        if any(d != 1 for d in out.type.shape[:axis]):
            continue  # the operands' slices would be strided
        inner = 1
        for d in out.type.shape[axis + 1:]:
            inner *= d
        owner, base = home.get(out.id, (out, 0))
        starts, at = [], 0
        for v in op.inputs:
            starts.append(at)
            at += v.type.shape[axis] * inner
        placed = [(v, off) for v, off in zip(op.inputs, starts) if v.id in home]
        if placed and out.id not in home:  # operands already in a later concatenation's buffer
            v, off = placed[0]
            owner, base = home[v.id][0], home[v.id][1] - off
        device = target.device(op.device)
        anywhere = bool(getattr(device, "strided_views", False))
        item = out.type.dtype.itemsize
        fits = (len({v.id for v in op.inputs}) == len(op.inputs) and 0 <= base
                and base + out.type.size <= owner.type.size and (anywhere or base * item % VALUE_ALIGNMENT == 0))
        new = []
        for v, off in zip(op.inputs, starts):
            if v.id in home:
                fits &= home[v.id] == (owner, base + off)
                continue
            j = producer.get(v.id)
            fits &= (j is not None and ops[j].kind == "dispatch" and ops[j].device == op.device
                     and v.id not in output_ids and v.id not in viewed and v.type.encoding is None
                     and v.type.dtype == out.type.dtype and (anywhere or (base + off) * item % VALUE_ALIGNMENT == 0)
                     and not any(o < base + off + v.type.size and base + off < o + n
                                 for o, n in taken.get(owner.id, ())))
            new.append((v, base + off))
        if not fits:
            continue
        for v, off in new:
            home[v.id] = (owner, off)
            taken.setdefault(owner.id, []).append((off, v.type.size))
        if owner is not out:
            home[out.id] = (owner, base)
        concats.add(i)
    in_place = [InPlace(v, *home[v.id]) for op in ops for v in op.outputs if v.id in home]
    return in_place, frozenset(concats)


def _block_reread(target: "Target", ops, views: dict, consumers: dict, view: View, j: int) -> bool:
    """Whether strided gather ``view``, reshaped by view op ``j``, reaches (through views) a kernel
    of a device that accepts any strides blindly: that device keeps the block a copy (see
    :func:`_accepts`), and a reshape of it is the same block -- the q, k or v third of torch's
    packed attention projection, which :mod:`polyhal.passes.fuse_attention` splits into heads,
    so that the CPU's attention reads the heads of a dense copy as it did before that split.
    (Slices handed on by a reshape, GPT-2's heads, have long been views there and stay so.)"""
    if view.op != "gather" or view.strides is None or ops[j].name != "reshape":
        return False
    todo, seen = [views[j].value.id], set()
    while todo:
        for c, _k in consumers.get(todo.pop(), ()):
            if c in seen:
                continue
            seen.add(c)
            if c in views:
                todo.append(views[c].value.id)
            elif ops[c].kind == "dispatch" and getattr(target.device(ops[c].device), "strided_views", False):
                return True
    return False


def _accepts(target: "Target", consumer: "Op", index: int, view: View, producer: "Op") -> bool:
    """Whether ``consumer`` reads ``view`` as its operand ``index`` without a copy."""
    if consumer.kind != "dispatch":  # a transfer or encode reads it through its device's copies
        return bool(getattr(target.device(producer.device), "strided_views", False))
    device = target.device(consumer.device)
    if view.op in ("slice", "gather") and view.strides is not None and getattr(device, "strided_views", False):
        # Such a device says yes to any strides, but its compiled loops copy a strided operand
        # again, per run: a strided block stays a copy there (on the CPU, Swin-T b8 peaked 33 MB
        # higher with them); transposes were measured to pay as views.
        return False
    strides = view.strides if view.strides is not None else tuple(row_major_strides(view.value.type.shape))
    return bool(device.accepts_view(
        consumer.name, dict(consumer.attrs), tuple(v.type for v in consumer.inputs),
        tuple(v.type for v in consumer.outputs), index, strides, view.offset))


def _as_view(op: "Op", index: int, of_value: dict, owned: set, output_ids: set, constants: dict) -> View | None:
    """The :class:`View` that would replace ``op``, or None when it must run (see the module doc)."""
    kind = VIEW_OPS.get(op.name)
    if kind is None or op.kind != "dispatch" or not op.inputs or len(op.outputs) != 1:
        return None
    src, (out,) = op.inputs[0], op.outputs
    base = of_value.get(src.id)
    source = base.source if base is not None else src
    if (out.id in output_ids or source.id not in owned or src.type.encoding is not None
            or out.type.encoding is not None or src.type.dtype != out.type.dtype
            or len(op.inputs) != (2 if kind == "gather" else 1)):
        return None
    strides = base.strides if base is not None and base.strides is not None else tuple(
        row_major_strides(src.type.shape))
    offset = base.offset if base is not None else 0
    attrs = dict(op.attrs)
    shape = src.type.shape
    if kind == "pad":
        if any(int(p) for p in attrs["pads"]):
            return None
        new = strides
    elif kind == "reshape":
        new = reshaped_strides(shape, strides, out.type.shape)
    elif kind == "transpose":
        perm = attrs.get("perm")
        perm = tuple(reversed(range(src.type.rank))) if perm is None else tuple(int(p) for p in perm)
        new = tuple(strides[p] for p in perm)
    elif kind == "slice":
        index_ = normalize_slice(shape, attrs["starts"], attrs["ends"], attrs.get("axes"), attrs.get("steps"))
        if any(s.step is not None and s.step <= 0 for s in index_):
            return None  # a reversed slice would need negative strides
        new = list(strides)
        for axis, sl in enumerate(index_):
            start, _stop, step = sl.indices(shape[axis])
            if start < shape[axis]:
                offset += start * strides[axis]
            new[axis] = strides[axis] * step
        new = tuple(new)
    else:  # gather of one constant index along an axis
        data = constants.get(op.inputs[1].id)
        if data is None or data.size != 1 or data.dtype.kind not in "iu":
            return None
        axis = int(attrs.get("axis", 0)) % src.type.rank
        at = int(data.reshape(-1)[0])
        at += shape[axis] if at < 0 else 0
        if not 0 <= at < shape[axis]:
            return None  # out of range: the kernel's semantics (and errors) apply
        offset += at * strides[axis]
        new = strides[:axis] + (strides[axis],) * data.ndim + strides[axis + 1:]
    if new is None or len(new) != out.type.rank:
        return None
    return View(out, source, None if _row_major(out.type.shape, new) else new, index, op.name, offset)


def _row_major(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether element ``strides`` lay ``shape`` out row-major (dims of size 1 do not count)."""
    expect = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        if d == 0:
            return True
        if d != 1 and s != expect:
            return False
        expect *= d
    return True


def _scratch_alignment(target: "Target", device: str) -> int:
    return int(target.device(device).spec.limits.get("scratch_alignment", SCRATCH_ALIGNMENT))


def plan_offsets(buffers: list[PlannedBuffer]) -> int:
    """Give each buffer an offset so that buffers live at a common op never overlap; returns the
    arena size. Greedy by size: largest first, each at the lowest aligned gap among the
    conflicting buffers already placed. How equal sizes are ordered matters (a gap left by one
    no later buffer fits), and no one order wins everywhere, so both are tried and the smaller
    arena is kept: the earliest first (ResNet-50 b8: 55 MB, 61 the other way) and the longest
    lived first (Swin-T b16 on a GPU: 165 MB, the most live at once, 175 the other way)."""
    best: tuple[int, list[int]] | None = None
    for tie in (lambda b: (b.first, b.name), lambda b: (b.first - b.last, b.first, b.name)):
        size, offsets = _greedy(buffers, tie)
        if best is None or size < best[0]:
            best = (size, offsets)
    size, offsets = best if best is not None else (0, [])
    for b, offset in zip(buffers, offsets):
        b.offset = offset
    return size


def _greedy(buffers: list[PlannedBuffer], tie) -> tuple[int, list[int]]:
    """The arena size and each buffer's offset (in the order given) when placed largest first,
    equal sizes ordered by ``tie``.

    Each buffer goes first-fit among the placed buffers whose lifetimes meet its own, which
    :class:`_Lifetimes` finds without looking at the others: O(n log n) for n buffers when the
    number live at once is bounded (as it is in a chain: 64k ops plan in well under a second;
    a scan of every placed buffer made this quadratic, 40 s for a 16k-op chain), and
    O((n + ops) * w log w) with at most w live at once."""
    lifetimes = _Lifetimes(max((b.last for b in buffers), default=0) + 1)
    offsets = [0] * len(buffers)
    size = 0
    for i in sorted(range(len(buffers)), key=lambda i: (-buffers[i].nbytes, tie(buffers[i]))):
        b = buffers[i]
        offset = 0
        for p_offset, p_end in sorted(lifetimes.meeting(b.first, b.last)):
            if offset + b.nbytes <= p_offset:
                break  # fits in the gap before p
            offset = max(offset, _align(p_end, b.alignment))
        offsets[i] = offset
        lifetimes.add(b.first, b.last, (offset, offset + b.nbytes))
        size = max(size, offset + b.nbytes)
    return size, offsets


class _Lifetimes:
    """Placed buffers by lifetime (inclusive op ranges over ``0 .. ops - 1``): which ones meet a
    given range. Those that meet ``[first, last]`` are the ones live at ``first`` (a segment tree:
    each range is kept at the O(log ops) nodes that cover it exactly, and the nodes on the path to
    leaf ``first`` hold every range that contains it, once each) and those that start after
    ``first`` (a list per op, looked up for each op of the range)."""

    def __init__(self, ops: int) -> None:
        self._leaves = 1 << max(ops - 1, 0).bit_length()
        self._covering: dict[int, list] = collections.defaultdict(list)  # tree node -> ranges
        self._starting: dict[int, list] = collections.defaultdict(list)  # op -> ranges starting there

    def add(self, first: int, last: int, item) -> None:
        """Record ``item`` as live over ops ``first`` to ``last``."""
        self._starting[first].append(item)
        lo, hi = first + self._leaves, last + self._leaves + 1
        while lo < hi:
            if lo & 1:
                self._covering[lo].append(item)
                lo += 1
            if hi & 1:
                hi -= 1
                self._covering[hi].append(item)
            lo, hi = lo >> 1, hi >> 1

    def meeting(self, first: int, last: int) -> list:
        """The items whose ranges share an op with ``first .. last``."""
        out: list = []
        covering, starting = self._covering, self._starting
        node = first + self._leaves
        while node:
            if node in covering:
                out += covering[node]
            node >>= 1
        for t in range(first + 1, last + 1):
            if t in starting:
                out += starting[t]
        return out


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _host_read_memory(target: "Target"):
    """memory type of program outputs on a device: host-visible where that is device memory too."""
    cache: dict[str | None, MemoryType] = {}

    def memory(device_name: str | None) -> MemoryType:
        if device_name not in cache:
            mt = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL
            if device_name is not None:
                device = target.device(device_name)
                # Only where host-visible memory *is* the device's memory (capability
                # "unified-memory"): a discrete GPU's managed memory would migrate pages on every
                # kernel write, far dearer than the copy on read.
                if not device.is_host and "unified-memory" in device.spec.capabilities and any(
                        h.serves(_HOST_READ, BufferUsage.DEFAULT) for h in device.spec.heaps):
                    mt = _HOST_READ
            cache[device_name] = mt
        return cache[device_name]

    return memory


def problem_of(op: "Op") -> Problem:
    """The :class:`~polyhal.hal.scratch.Problem` of a dispatch op."""
    return Problem(op.name, dict(op.attrs), tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs))
