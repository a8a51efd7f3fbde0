"""What the fusion passes share: the gate they ask and the record of what each did.

A fusion pass replaces a chain of dispatches by fewer ops with a kernel of their own
(:mod:`polyhal.passes.fuse_attention`, :mod:`polyhal.passes.fuse_linear`). Whether a chain is
fused is not the pass's to decide: it asks ``fusible(fused_op, ops)``, which the compile answers
from the kernel sets of the devices placement can choose (:meth:`polyhal.target.Target.fusible`).
Passes return a new program and never modify the one they are given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from polyhal.ir.program import Op, Program

#: ``fusible(fused_op_name, ops) -> bool``: may ``ops`` (in program order) become op ``fused_op_name``?
Fusible = Callable[[str, Sequence[Op]], bool]


def always(fused: str, ops: Sequence[Op]) -> bool:
    """The gate that fuses every match (a pass used on its own, in tests and tools)."""
    return True


@dataclass(frozen=True, eq=False)
class Fusion:
    """One rewrite by a fusion pass: ``ops`` of the program (in program order) became ``new``.

    ``kind`` names the rewrite: ``"attention"``, ``"linear"``, ``"gelu"``, ``"scaling"`` (a
    scalar scaling moved from a matmul's product onto its smaller operand), ``"constant"`` (ops of
    constant operands folded into a constant: ``new`` is empty), ``"gather"`` (a lookup in a table
    moved onto the table's folded transposed view), ``"batch_norm"`` (per-channel
    scales and shifts folded into a conv's weights), ``"epilogue"`` (a conv's or linear's residual
    add and activation), ``"scale_shift"`` (a per-channel scale, shift and activation),
    ``"pool_first"`` (an average pool moved before the pointwise conv it followed); a backend's
    pass names its own (the CPU's ``"prologue"``: a ``scale_shift`` taken into the conv that reads it).
    """

    kind: str
    ops: tuple[Op, ...]
    new: tuple[Op, ...]

    def explain(self) -> str:
        """One line: the ops replaced, the ops that replace them, and the value they produce."""
        result = (self.new or self.ops)[-1].outputs[0].name
        return (f"{self.kind}: {' + '.join(op.name for op in self.ops)} -> "
                f"{', '.join(op.name for op in self.new) or 'constant'} (%{result})")



def in_program_order(program: Program, ops: Sequence[Op]) -> tuple[Op, ...]:
    """The ops of ``ops`` in the order ``program`` runs them (what ``fusible`` and
    :class:`Fusion` are given)."""
    ids = {id(op) for op in ops}
    return tuple(op for op in program.ops if id(op) in ids)


def splice(program: Program, replaced: dict[int, tuple[Sequence[Op], Sequence[Op]]], removed: set[int],
           kind: str) -> tuple[Program, list[Fusion]]:
    """``program`` with each matched chain replaced: ``replaced`` maps ``id`` of the chain's last op
    to (the chain's ops, the ops that replace it), which go where that op was; the other ops of
    ``removed`` (ids) are dropped. Returns the new program and a :class:`Fusion` of ``kind`` per
    chain (the program itself is not changed)."""
    if not replaced:
        return program, []
    ops, changes = [], []
    for op in program.ops:
        if id(op) in replaced:
            chain, new = replaced[id(op)]
            ops.extend(new)
            changes.append(Fusion(kind, in_program_order(program, chain), tuple(new)))
        elif id(op) not in removed:
            ops.append(op)
    return dataclasses.replace(program, ops=ops), changes


def drop_unused_constants(program: Program) -> Program:
    """``program`` without the constants no op or output reads any more (replaced weights, a
    table only its folded views are read from): a plan would bind or upload them for nothing."""
    read = {v.id for op in program.ops for v in op.inputs} | {v.id for v in program.outputs}
    if all(v.id in read for v, _ in program.constants):
        return program
    return dataclasses.replace(program, constants=[(v, d) for v, d in program.constants if v.id in read])
