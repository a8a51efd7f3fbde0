"""Fold a ``transpose`` of a program constant into a constant that is a transposed view of it.

Exporters tie a language model's output projection to its token embedding: the embedding
table ``(vocab, d)`` is gathered from, and ``transpose(table)`` is the right operand of the last
MatMul (GPT-2 in the dynamo exporter). Front ends fold ops of constant operands only up to a
size limit (a folded result is a second copy of the data), so the transpose stays an op, and
copies the whole table on every run: 50257 x 768 floats, 190 ms of a 760 ms GPT-2 run on a
2-core VM. A transposed numpy array needs no copy -- it is a view with swapped strides -- and a
host device binds constants in place, so the fold costs no memory there; the matmul kernels
read a transposed operand through BLAS's transpose flag. Devices that upload constants make
their own row-major copy once, at compile time, instead of once per run.

**One copy of a tied table.** A device that uploads constants would hold the table twice when
the original is still read by another op: 147 MB more for GPT-2 on a GPU. When every other use
of the constant is a ``gather`` (an embedding lookup), those gathers read the transposed table
instead -- ``gather(table, ids, axis=0)`` is ``transpose(gather(tableᵀ, ids, axis=1))`` -- and
the original is no longer a constant of the program: the product keeps its fast row-major
operand, and the lookup (a few rows) pays the transpose of its small result. Any other use
keeps the original beside the view. Repeated transposes of one constant with the same
permutation share one view, and a constant no op reads any more is dropped.

The fold needs no kernel, so no gate is asked. A transpose whose result is a program output
stays an op (a constant is not an output).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from polyhal.ir.program import Op, Program, Value
from polyhal.ops import canonical_attrs
from polyhal.passes.fusion import Fusion, drop_unused_constants


def fold_constant_transposes(program: Program) -> tuple[Program, list[Fusion]]:
    """``program`` with every transpose of a constant replaced by a constant that views the
    transposed data, the gathers of a table that is also transposed reading the transposed
    table, and what changed (kinds ``"constant"`` and ``"gather"``)."""
    data = {v.id: a for v, a in program.constants}
    outputs = {v.id for v in program.outputs}
    views: dict[tuple[int, tuple[int, ...]], Value] = {}  # (constant id, perm) -> the folded view
    renamed: dict[int, Value] = {}  # result of a folded transpose -> the view that replaces it
    folded, changes = [], []
    for op in program.ops:
        src = op.inputs[0] if len(op.inputs) == 1 else None
        if (op.kind != "dispatch" or op.name != "transpose" or src is None or src.id not in data
                or len(op.outputs) != 1 or op.outputs[0].id in outputs or op.outputs[0].type.encoding is not None
                or src.type.encoding is not None):
            continue
        perm = dict(op.attrs).get("perm")
        perm = tuple(reversed(range(src.type.rank))) if perm is None else tuple(int(p) for p in perm)
        view = views.get((src.id, perm))
        if view is None:
            view = views[(src.id, perm)] = op.outputs[0]
            folded.append((view, np.transpose(data[src.id], perm)))
        else:
            renamed[op.outputs[0].id] = view
        changes.append(Fusion("constant", (op,), ()))
    if not changes:
        return program, []
    folded_ops = {id(f.ops[0]) for f in changes}
    ops = [op for op in program.ops if id(op) not in folded_ops]
    ops = [_rename(op, renamed) for op in ops]
    ops = _gathers_read_the_view(ops, views, changes)
    program = dataclasses.replace(program, ops=ops, constants=[*program.constants, *folded])
    return drop_unused_constants(program), changes


def _rename(op: Op, renamed: dict[int, Value]) -> Op:
    if not any(v.id in renamed for v in op.inputs):
        return op
    return dataclasses.replace(op, inputs=tuple(renamed.get(v.id, v) for v in op.inputs))


def _gathers_read_the_view(ops: list[Op], views: dict, changes: list[Fusion]) -> list[Op]:
    """``ops`` with the gathers of each transposed constant whose other uses are all gathers
    (on the data operand) rewritten to gather from its view (see the module docstring)."""
    users: dict[int, list[Op]] = {}
    for op in ops:
        for v in op.inputs:
            users.setdefault(v.id, []).append(op)
    rewrites: dict[int, tuple[Op, ...]] = {}
    for (cid, perm), view in views.items():
        uses = users.get(cid, [])
        if not uses or not all(u.kind == "dispatch" and u.name == "gather" and u.inputs[0].id == cid
                               and u.inputs[1].id != cid and u.outputs[0].type.encoding is None for u in uses):
            continue
        if len([p for p in views if p[0] == cid]) > 1:
            continue  # two views of one table: the gathers keep the original
        for g in uses:
            rewrites[id(g)] = _gather_from_view(g, view, perm)
            changes.append(Fusion("gather", (g,), rewrites[id(g)]))
    return [new for op in ops for new in rewrites.get(id(op), (op,))]


def _gather_from_view(g: Op, view: Value, perm: tuple[int, ...]) -> tuple[Op, Op]:
    """``gather(data, ids, axis)`` as a gather from ``view = transpose(data, perm)`` and a
    transpose of its result into the original result's layout."""
    (data, ids), (out,) = g.inputs, g.outputs
    rank, k = data.type.rank, ids.type.rank
    axis = int(dict(g.attrs).get("axis", 0)) % rank
    j = perm.index(axis)  # the view's axis that holds data's gathered axis
    # Label data's axes 0..rank-1 and the index dims rank..rank+k-1; the gather from the view
    # lays them out as below, the original result as `want`.
    index = list(range(rank, rank + k))
    got = [*perm[:j], *index, *perm[j + 1:]]
    want = [*range(axis), *index, *range(axis + 1, rank)]
    shape = tuple(view.type.shape[:j]) + tuple(ids.type.shape) + tuple(view.type.shape[j + 1:])
    moved = Value(dataclasses.replace(out.type, shape=shape), f"{out.name}_t", out.program_id)
    return (Op("dispatch", "gather", (view, ids), (moved,), canonical_attrs({"axis": j}), g.affinity),
            Op("dispatch", "transpose", (moved,), (out,), canonical_attrs({"perm": tuple(got.index(w) for w in want)}),
               g.affinity))
