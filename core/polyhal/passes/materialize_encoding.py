"""MaterializeEncoding: encodings become concrete layouts, encode ops fold or become dispatches.

Runs after placement (IREE: ``SpecializeEncodings`` on ``stream.tensor.encode`` with each
affinity's resolver, then ``MaterializeEncoding`` into ``pack`` / ``unpack`` / ``mmt4d``):

1. **Resolve.** Every value with an encoding gets a :class:`~polyhal.ir.encoding.Layout` from the
   ``resolve_encoding`` hook of the device it lives on (memoized per (device, type)); a device
   whose resolver does not know the encoding, or that has no resolver, gets the identity layout.
2. **Fold.** An encode op whose source and target layouts are the same (``is_same_layout``;
   two identity layouts are the same) disappears: its result *is* its source. So does one whose
   target layout some earlier form of the same value already has on that device: an unset
   followed by a set (``matmul -> unset -> set -> matmul``) hands the first matmul's packed
   result straight to the second, and a set followed by an unset gives back the original.
3. **Convert.** Where layouts really differ, the encode becomes ``unpack`` and/or ``pack``
   dispatches (the layout says which). A value crossing devices whose layouts differ on the two
   sides is unpacked before the transfer and packed after it. A packed form of a constant is
   made once, at compile time.
4. **Lower.** A dispatch whose operands or results are not in the identity layout runs on the
   storage directly when a layout says how (matmul on packed operands: ``mmt4d``); otherwise
   its operands are unpacked and its results packed around it.
5. **Clean up.** Conversions and transfers whose results nobody reads are dropped, so an encode
   whose only user folded costs nothing.

After this pass no type carries an encoding: every value has the dense type of its storage,
and the plan allocates and runs exactly what a program without encodings would, plus the
conversions listed by :meth:`EncodingReport.explain_lines`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.errors import KernelNotFoundError, PluginError
from polyhal.ir.encoding import IdentityLayout, Layout, dense_type
from polyhal.ir.program import Op, Program, Value
from polyhal.ir.types import TensorType
from polyhal.ops import canonical_attrs, infer_types
from polyhal.policies.layouts import Resolution, describe_encoding

if TYPE_CHECKING:
    from polyhal.passes.placement import Placement
    from polyhal.target import Target

# ------------------------------------------------------------------------------------------------
# Report (explain)
# ------------------------------------------------------------------------------------------------

@dataclass
class EncodeRecord:
    """What became of one encode op: folded (and why), or the dispatches it became."""

    op: Op
    device: str
    source: Layout
    target: Layout
    folded: bool = False
    reason: str = ""
    dispatches: list[Op] = field(default_factory=list)

    def line(self) -> str:
        (src,), (dst,) = self.op.inputs, self.op.outputs
        head = (f"encode %{src.name} -> %{dst.name} on {self.device} "
                f"({_enc(src.type)} -> {_enc(dst.type)})")
        if self.folded:
            return f"{head}: folded, {self.reason}"
        names = ", ".join(op.name for op in self.dispatches)
        return f"{head}: {len(self.dispatches)} dispatch{'es' * (len(self.dispatches) != 1)} ({names}), {self.reason}"


def _enc(t: TensorType) -> str:
    return "none" if t.encoding is None else describe_encoding(t.encoding)


@dataclass
class EncodingReport:
    """What MaterializeEncoding did, for :meth:`polyhal.Plan.explain` and benchmarks."""

    resolutions: list[Resolution] = field(default_factory=list)
    encodes: list[EncodeRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: pack / unpack dispatches in the plan (from encodes, transfers, lowering and outputs).
    encode_dispatches: int = 0
    #: compile-time packs of constants.
    constant_packs: int = 0

    @property
    def folded(self) -> int:
        """Number of encode ops that cost nothing."""
        return sum(r.folded for r in self.encodes)

    def explain_lines(self) -> list[str]:
        """Explain lines (indented like the plan's own)."""
        if not (self.resolutions or self.encodes or self.notes):
            return []
        lines = [f"  encodings: {len(self.encodes)} encode ops, {self.folded} folded, "
                 f"{self.encode_dispatches} pack/unpack dispatches"
                 + (f", {self.constant_packs} constants packed at compile time" if self.constant_packs else "")]
        # Identity resolutions are grouped (one line per device, resolver and reason); each
        # non-identity layout gets its own line.
        groups: dict[tuple, list[Resolution]] = {}
        for r in self.resolutions:
            key = (r.device, r.plugin, r.note) if r.layout.is_identity_layout() else (id(r),)
            groups.setdefault(key, []).append(r)
        for group in groups.values():
            r = group[0]
            what = (f"{describe_encoding(r.tensor_type.encoding)} {r.tensor_type.shape}" if len(group) == 1
                    else f"{len(group)} encodings")
            lines.append(f"    resolve {what} on {r.device}: {r.layout.describe()} by {r.plugin!r}"
                         + (f" ({r.note})" if r.note else ""))
        lines += [f"    {r.line()}" for r in self.encodes]
        lines += [f"    {n}" for n in self.notes]
        return lines


# ------------------------------------------------------------------------------------------------
# The pass
# ------------------------------------------------------------------------------------------------

def has_encodings(program: Program) -> bool:
    """Whether any op of ``program`` is an encode or touches an encoded value."""
    return any(op.kind == "encode" or any(v.type.encoding is not None for v in (*op.inputs, *op.outputs))
               for op in program.ops) or any(v.type.encoding is not None for v in program.outputs)


def materialize_encodings(placement: "Placement", target: "Target") -> "Placement":
    """Resolve, fold and convert every encoding of a placed program (see the module doc).

    Returns a placement whose program has no encode ops and no encoded types, with an
    :class:`EncodingReport` in ``placement.encodings``. A program without encodings is returned
    unchanged (with an empty report): materialization costs it nothing.
    """
    if not has_encodings(placement.program):
        return _with_report(placement, EncodingReport())
    return _Materializer(placement, target).run()


def _with_report(placement: "Placement", report: EncodingReport, **changes: Any) -> "Placement":
    if any(f.name == "encodings" for f in dataclasses.fields(placement)):
        return dataclasses.replace(placement, encodings=report, **changes)
    placement = dataclasses.replace(placement, **changes)
    placement.encodings = report  # type: ignore[attr-defined]
    return placement


@dataclass
class _Form:
    """One materialized form of a logical value: its storage on a device, in a layout."""

    device: str
    layout: Layout
    storage: Value
    logical: Value


class _Materializer:
    def __init__(self, placement: "Placement", target: "Target") -> None:
        self.placement = placement
        self.program = placement.program
        self.target = target
        self.resolver = target.layouts
        self.value_device: dict[int, str] = dict(placement.value_device)
        self.report = EncodingReport()
        self.ops: list[Op] = []
        self.storage: dict[int, Value] = {}        # logical value id -> its storage value
        self.cls: dict[int, int] = {}              # logical value id -> id of the value it encodes
        self.forms: dict[int, list[_Form]] = {}    # class -> forms available so far
        self.removable: set[int] = set()           # id(op) of conversions and transfers
        constants = list(getattr(self.program, "constants", ()))
        self.constants = constants
        self.constant_data = {v.id: data for v, data in constants}
        self.folded_constants: set[int] = set()

    # -- helpers -------------------------------------------------------------------------------------

    def device_of(self, v: Value) -> str:
        return self.value_device[v.id]

    def layout_of(self, v: Value, device: str | None = None) -> Layout:
        return self.resolver.resolve(device or self.device_of(v), v.type).layout

    def bind(self, logical: Value, storage: Value, layout: Layout, cls: int | None = None) -> None:
        """Record that ``storage`` holds ``logical`` in ``layout`` on its device."""
        self.storage[logical.id] = storage
        c = self.cls.setdefault(logical.id, logical.id if cls is None else cls)
        device = self.value_device[storage.id]
        forms = self.forms.setdefault(c, [])
        if not any(f.device == device and f.storage is storage for f in forms):
            forms.append(_Form(device, layout, storage, logical))

    def find_form(self, cls: int, device: str, layout: Layout) -> _Form | None:
        for f in self.forms.get(cls, ()):
            if f.device == device and f.layout.is_same_layout(layout):
                return f
        return None

    def storage_value(self, logical: Value, layout: Layout, device: str) -> Value:
        """A fresh storage value for ``logical`` in ``layout`` (the value itself when unchanged)."""
        st = layout.storage_type
        if logical.type == st and logical.id not in self.storage:
            value = logical
        else:
            value = Value(st, logical.name, logical.program_id)
        self.value_device[value.id] = device
        return value

    def need_kernel(self, device: str, name: str, why: str) -> None:
        if name not in self.target.kernels(device):
            raise KernelNotFoundError(
                f"{device} has no kernel for {name!r}, needed to {why}; a resolver that returns a "
                f"non-identity layout for a device must only do so where the device can {name} it")

    def emit_conversion(self, name: str, attrs: dict, src: Value, out_type: TensorType, device: str,
                        record: EncodeRecord | None, base: str) -> Value:

        (inferred,) = infer_types(name, (src.type,), attrs)
        if inferred != out_type:
            raise PluginError(f"layout conversion {name}{attrs} gives {inferred}, but the layout's storage type "
                              f"is {out_type}; the resolver's layout is inconsistent")
        out = Value(out_type, base, src.program_id)
        self.value_device[out.id] = device
        op = Op("dispatch", name, (src,), (out,), canonical_attrs(attrs), None, device)
        self.ops.append(op)
        self.removable.add(id(op))
        if record is not None:
            record.dispatches.append(op)
        return out

    def convert(self, logical: Value, device: str, target: Layout, record: EncodeRecord | None,
                name: str | None = None) -> Value:
        """Storage of ``logical`` on ``device`` in ``target``: an existing form, or one made by
        unpacking an existing form and/or packing the dense one (the value made last is called
        ``name``)."""
        c = self.cls[logical.id]
        found = self.find_form(c, device, target)
        if found is not None:
            return found.storage
        dense_layout = IdentityLayout(dense_type(logical.type))
        dense = self.find_form(c, device, dense_layout)
        if dense is None:
            src = next((f for f in self.forms[c] if f.device == device), None)
            if src is None:
                raise AssertionError(f"no form of %{logical.name} on {device}")  # placement guarantees one
            op_name, attrs = src.layout.unpack_op()
            self.need_kernel(device, op_name, f"unpack %{logical.name} from {src.layout.describe()}")
            out = self.emit_conversion(op_name, dict(attrs), src.storage, dense_layout.storage_type, device, record,
                                       name if target.is_identity_layout() and name else f"{logical.name}.unpacked")
            dense = _Form(device, dense_layout, out, logical)
            self.forms[c].append(dense)
        if target.is_identity_layout():
            return dense.storage
        op_name, attrs = target.pack_op()
        name = name or f"{logical.name}.packed"
        data = self.constant_data.get(dense.storage.id)
        if data is not None:
            # IREE const-evals set_encoding of weights: pack a constant once, here.
            out = Value(target.storage_type, name, logical.program_id)
            self.value_device[out.id] = device
            self.constants.append((out, np.ascontiguousarray(target.pack(data))))
            self.constant_data[out.id] = self.constants[-1][1]
            self.folded_constants.add(out.id)
            self.report.constant_packs += 1
            if record is not None:
                record.reason = "constant packed at compile time"
        else:
            self.need_kernel(device, op_name, f"pack %{logical.name} into {target.describe()}")
            out = self.emit_conversion(op_name, dict(attrs), dense.storage, target.storage_type, device, record, name)
        self.forms[c].append(_Form(device, target, out, logical))
        return out

    # -- ops -----------------------------------------------------------------------------------------

    def run(self) -> "Placement":
        p = self.program
        for v in p.inputs:
            self.bind(v, v, IdentityLayout(v.type))
        for v, _ in list(self.constants):
            self.bind(v, v, IdentityLayout(v.type))
        for op in p.ops:
            if op.kind == "encode":
                self.encode(op)
            elif op.kind == "transfer":
                self.transfer(op)
            else:
                self.dispatch(op)
        outputs: list[Value] = []
        for v in p.outputs:
            outputs.append(self.output(v, outputs))
        self.cleanup(outputs)
        self.report.resolutions = self.resolver.resolutions()
        program = dataclasses.replace(p, ops=self.ops, outputs=outputs)
        if hasattr(p, "constants"):
            program = dataclasses.replace(program, constants=self.constants)
        transfers = sum(op.kind == "transfer" for op in self.ops)
        return _with_report(self.placement, self.report, program=program, value_device=self.value_device,
                            transfers=transfers)

    def encode(self, op: Op) -> None:
        (src,), (dst,) = op.inputs, op.outputs
        device = op.device or self.device_of(src)
        self.value_device.setdefault(dst.id, device)
        ls, ld = self.layout_of(src, device), self.layout_of(dst, device)
        record = EncodeRecord(op, device, ls, ld)
        self.report.encodes.append(record)
        c = self.cls[src.id]
        self.cls[dst.id] = c
        if ls.is_same_layout(ld):
            record.folded = True
            record.reason = ("both layouts are the identity" if ls.is_identity_layout() else
                             f"same layout on both sides ({ld.describe()})")
            self.storage[dst.id] = self.storage[src.id]
            return
        found = self.find_form(c, device, ld)
        if found is not None:
            record.folded = True
            record.reason = (f"%{found.logical.name} already holds this value in that layout ({ld.describe()})"
                             + (": a set/unset pair" if found.logical.type.encoding == dst.type.encoding else ""))
            self.storage[dst.id] = found.storage
            return
        record.reason = f"layouts differ ({ls.describe()} -> {ld.describe()})"
        self.storage[dst.id] = self.convert(src, device, ld, record, dst.name)

    def transfer(self, op: Op) -> None:
        (src,), (dst,) = op.inputs, op.outputs
        s, d = self.device_of(src), op.device or self.device_of(dst)
        self.value_device.setdefault(dst.id, d)
        ls, ld = self.layout_of(src, s), self.layout_of(dst, d)
        c = self.cls[src.id]
        self.cls[dst.id] = c
        if ls.is_same_layout(ld):
            moving, layout = self.storage[src.id], ls
        else:
            moving, layout = self.convert(src, s, IdentityLayout(dense_type(src.type)), None, src.name), None
            self.report.notes.append(
                f"transfer %{src.name} {s} -> {d}: layouts differ ({ls.describe()} on {s}, {ld.describe()} on {d}); "
                f"moved dense" + (f", unpacked on {s}" if not ls.is_identity_layout() else "")
                + (f", packed on {d}" if not ld.is_identity_layout() else ""))
        if moving is src and dst.type == src.type:
            out = dst
            self.value_device[dst.id] = d
        else:
            out = Value(moving.type, dst.name, dst.program_id)
            self.value_device[out.id] = d
        new = Op("transfer", op.name, (moving,), (out,), op.attrs, op.affinity, d)
        self.ops.append(new)
        self.removable.add(id(new))
        if layout is not None:
            self.bind(dst, out, layout, c)
        else:
            self.bind(dst, out, IdentityLayout(dense_type(dst.type)), c)
            if not ld.is_identity_layout():
                self.storage[dst.id] = self.convert(dst, d, ld, None, f"{dst.name}.packed")

    def dispatch(self, op: Op) -> None:
        device = op.device
        ins = tuple(self.layout_of(v) for v in op.inputs)
        outs = tuple(self.layout_of(v, device) for v in op.outputs)
        for v in op.outputs:
            self.value_device.setdefault(v.id, device)
        if all(l.is_identity_layout() for l in (*ins, *outs)):
            inputs = tuple(self.storage[v.id] for v in op.inputs)
            results = tuple(self.storage_value(v, l, device) for v, l in zip(op.outputs, outs))
            self.emit(op, op.name, op.attrs, inputs, results)
            for v, r, l in zip(op.outputs, results, outs):
                self.bind(v, r, l)
            return
        lowered = None
        for layout in (*outs, *ins):
            if not layout.is_identity_layout():
                lowered = layout.materialize_dispatch(op.name, op.attr_dict, ins, outs)
                if lowered is not None:
                    break
        if lowered is not None and lowered[0] in self.target.kernels(device):

            name, attrs = lowered
            inputs = tuple(self.storage[v.id] for v in op.inputs)
            results = tuple(self.storage_value(v, l, device) for v, l in zip(op.outputs, outs))
            inferred = infer_types(name, tuple(v.type for v in inputs), dict(attrs))
            if inferred != tuple(r.type for r in results):
                raise PluginError(f"{op.name} on {device} lowered to {name}, which gives {inferred}, not the "
                                  f"layouts' storage types {tuple(r.type for r in results)}")
            self.emit(op, name, canonical_attrs(dict(attrs)), inputs, results)
            for v, r, l in zip(op.outputs, results, outs):
                self.bind(v, r, l)
            return
        # No layout knows this op: it runs dense, between unpacks and packs.
        inputs = tuple(self.storage[v.id] if l.is_identity_layout() else
                       self.convert(v, device, IdentityLayout(dense_type(v.type)), None, f"{v.name}.unpacked")
                       for v, l in zip(op.inputs, ins))
        dense_outs = tuple(IdentityLayout(dense_type(v.type)) for v in op.outputs)
        results = tuple(self.storage_value(v, l, device) for v, l in zip(op.outputs, dense_outs))
        self.emit(op, op.name, op.attrs, inputs, results)
        for v, r, dl, l in zip(op.outputs, results, dense_outs, outs):
            self.bind(v, r, dl)
            if not l.is_identity_layout():
                self.storage[v.id] = self.convert(v, device, l, None, f"{v.name}.packed")
        self.report.notes.append(
            f"{op.name} on {device} cannot run on "
            f"{', '.join(sorted({l.describe() for l in (*ins, *outs) if not l.is_identity_layout()}))}: "
            "its operands are unpacked and results packed around it")

    def emit(self, op: Op, name: str, attrs: tuple, inputs: tuple, results: tuple) -> None:
        if name == op.name and inputs == op.inputs and results == op.outputs:
            self.ops.append(op)  # unchanged: the very same op object
        else:
            self.ops.append(Op(op.kind, name, inputs, results, attrs, op.affinity, op.device))

    def output(self, v: Value, earlier: list[Value]) -> Value:
        layout = self.layout_of(v)
        if layout.is_identity_layout():
            out = self.storage[v.id]
        else:
            self.report.notes.append(f"output %{v.name} is unpacked from {layout.describe()}")
            out = self.convert(v, self.device_of(v), IdentityLayout(dense_type(v.type)), None, v.name)
        bound = {x.id for x in self.program.inputs} | {c.id for c, _ in self.constants} | {x.id for x in earlier}
        if out is not v and out.id in bound:
            # Folding made this output the very storage of an input, a constant or another
            # output; a plan's outputs are fresh buffers, so it gets its own copy.
            out = self.copy(out, v.name)
        return out

    def copy(self, src: Value, name: str) -> Value:
        device = self.device_of(src)
        out = Value(src.type, name, src.program_id)
        self.value_device[out.id] = device
        if "reshape" in self.target.kernels(device):

            self.ops.append(Op("dispatch", "reshape", (src,), (out,), canonical_attrs({"shape": src.type.shape}),
                               None, device))
        else:
            self.ops.append(Op("transfer", "copy", (src,), (out,), (), None, device))
        return out

    def cleanup(self, outputs: list[Value]) -> None:
        """Drop conversions and transfers whose results are unused; fold their encodes."""
        live = {v.id for v in outputs}
        kept: list[Op] = []
        dropped: set[int] = set()
        for op in reversed(self.ops):
            if id(op) in self.removable and not any(v.id in live for v in op.outputs):
                dropped.add(id(op))
                continue
            kept.append(op)
            live.update(v.id for v in op.inputs)
        self.ops = kept[::-1]
        self.constants = [(v, d) for v, d in self.constants if v.id not in self.folded_constants or v.id in live]
        self.report.constant_packs = sum(1 for v, _ in self.constants if v.id in self.folded_constants)
        for record in self.report.encodes:
            if record.dispatches and all(id(op) in dropped for op in record.dispatches):
                record.folded = True
                record.reason = ("unused: its result is only read in layouts that already existed (an encode "
                                 "after it folded)")
                record.dispatches = []
            else:
                record.dispatches = [op for op in record.dispatches if id(op) not in dropped]
            if not record.folded and not record.dispatches and record.reason == "constant packed at compile time":
                record.folded = True
        self.report.encode_dispatches = sum(1 for op in self.ops if id(op) in self.removable and op.kind == "dispatch")


# ------------------------------------------------------------------------------------------------
# Traffic (benchmarks, tests)
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Traffic:
    """What a compiled program does per run, counted from its ops."""

    dispatches: int
    transfers: int
    #: bytes every dispatch reads and writes, plus the bytes every transfer copies.
    bytes_moved: int
    #: bytes of intermediates (values produced by ops that are not program outputs).
    intermediate_bytes: int


def traffic(program: Program) -> Traffic:
    """Count dispatches, transfers and bytes moved by ``program`` (a placed, materialized one)."""
    outputs = {v.id for v in program.outputs}
    moved = inter = 0
    for op in program.ops:
        if op.kind == "transfer":
            moved += sum(v.type.nbytes for v in op.outputs)
        else:
            moved += sum(v.type.nbytes for v in (*op.inputs, *op.outputs))
        inter += sum(v.type.nbytes for v in op.outputs if v.id not in outputs)
    return Traffic(sum(op.kind == "dispatch" for op in program.ops), sum(op.kind == "transfer" for op in program.ops),
                   moved, inter)
