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

The fold needs no kernel, so no gate is asked. A transpose whose result is a program output
stays an op (a constant is not an output).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from polyhal.ir.program import Program
from polyhal.passes.fusion import Fusion


def fold_constant_transposes(program: Program) -> tuple[Program, list[Fusion]]:
    """``program`` with every transpose of a constant replaced by a constant that views the
    transposed data, and what changed (kind ``"constant"``)."""
    data = {v.id: a for v, a in program.constants}
    outputs = {v.id for v in program.outputs}
    folded, changes = [], []
    ops = []
    for op in program.ops:
        src = op.inputs[0] if len(op.inputs) == 1 else None
        if (op.kind != "dispatch" or op.name != "transpose" or src is None or src.id not in data
                or len(op.outputs) != 1 or op.outputs[0].id in outputs or op.outputs[0].type.encoding is not None
                or src.type.encoding is not None):
            ops.append(op)
            continue
        perm = dict(op.attrs).get("perm")
        perm = tuple(reversed(range(src.type.rank))) if perm is None else tuple(int(p) for p in perm)
        folded.append((op.outputs[0], np.transpose(data[src.id], perm)))
        changes.append(Fusion("constant", (op,), ()))
    if not changes:
        return program, []
    return dataclasses.replace(program, ops=ops, constants=[*program.constants, *folded]), changes
