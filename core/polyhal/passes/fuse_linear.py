"""Fuse ``add(matmul(x, w), b)`` into ``linear(x, w, b)``, and move a scalar scaling of a
matmul's product onto its (smaller) left operand.

A bias added to a matmul's result is a second pass over that result; ``linear`` adds it where
the product is written. Front ends emit MatMul and Add separately (as ONNX graphs have them),
so this pass finds the pairs: a ``matmul`` with a 2-D right operand whose only use is an ``add``
of a bias of shape ``(N,)`` (or a scalar). Likewise ``mul(matmul(a, b), c)`` with a scalar ``c``
(attention scores scaled by 1/sqrt(d)) becomes ``matmul(mul(a, c), b)`` when ``a`` has fewer
elements than the product. Ops with different affinities are left alone. A pair becomes
``linear`` only where ``fusible("linear", ops)`` says so (see :mod:`polyhal.passes.fusion`); moving
a scaling needs no kernel that the ops did not already need, so it always happens.
"""

from __future__ import annotations

import dataclasses

from polyhal.ir.program import Op, Program, Value, uses_and_producers
from polyhal.passes.fusion import Fusible, Fusion, always


def fuse_linear(program: Program, fusible: Fusible = always) -> tuple[Program, list[Fusion]]:
    """``program`` with matmul + bias add pairs fused where ``fusible`` allows and scalings
    moved, and what changed."""
    uses, producer = uses_and_producers(program)
    fused: dict[int, tuple[Op, Op]] = {}  # id(add op) -> (matmul, add)
    dropped: set[int] = set()
    for op in program.ops:
        if op.kind != "dispatch" or op.name != "add" or len(op.inputs) != 2:
            continue
        for i in (0, 1):
            mm = producer.get(op.inputs[i].id)
            bias = op.inputs[1 - i]
            if mm is None or mm.kind != "dispatch" or mm.name != "matmul" or id(mm) in dropped:
                continue
            x, w = mm.inputs
            n = w.type.shape[-1] if w.type.rank == 2 else None
            if (n is None or x.type.rank < 1 or uses[mm.outputs[0].id] != 1 or mm.affinity != op.affinity
                    or bias.type.shape not in ((n,), (), (1,)) or bias.type.dtype != x.type.dtype
                    or op.outputs[0].type != mm.outputs[0].type or not fusible("linear", (mm, op))):
                continue
            fused[id(op)] = (mm, op)
            dropped.add(id(mm))
            break
    # mul(matmul(a, b), c) with a scalar c (attention's 1/sqrt(d) scaling): scale the smaller
    # operand a instead of the product, when a is smaller than the product.
    scaled: dict[int, Op] = {}  # id(mul op) -> its matmul
    for op in program.ops:
        if op.kind != "dispatch" or op.name != "mul" or len(op.inputs) != 2:
            continue
        for i in (0, 1):
            mm = producer.get(op.inputs[i].id)
            c = op.inputs[1 - i]
            if (mm is None or mm.kind != "dispatch" or mm.name != "matmul" or id(mm) in dropped
                    or uses[mm.outputs[0].id] != 1 or mm.affinity != op.affinity or c.type.rank != 0
                    or c.type.dtype != mm.outputs[0].type.dtype or op.outputs[0].type != mm.outputs[0].type
                    or mm.inputs[0].type.size >= mm.outputs[0].type.size):
                continue
            scaled[id(op)] = mm
            dropped.add(id(mm))
            break
    if not fused and not scaled:
        return program, []
    ops, changes = [], []
    for op in program.ops:
        if id(op) in dropped:
            continue
        mm = scaled.get(id(op))
        if mm is not None:
            c = op.inputs[1] if op.inputs[0] is mm.outputs[0] else op.inputs[0]
            a = mm.inputs[0]
            a_scaled = Value(a.type, f"{a.name}_scaled", a.program_id)
            new = [Op("dispatch", "mul", (a, c), (a_scaled,), (), op.affinity),
                   Op("dispatch", "matmul", (a_scaled, mm.inputs[1]), op.outputs, (), op.affinity)]
            ops.extend(new)
            changes.append(Fusion("scaling", (mm, op), tuple(new)))
            continue
        pair = fused.get(id(op))
        if pair is not None:
            mm, add = pair
            bias = add.inputs[1] if add.inputs[0] is mm.outputs[0] else add.inputs[0]
            op = Op("dispatch", "linear", (mm.inputs[0], mm.inputs[1], bias), add.outputs, (), add.affinity)
            changes.append(Fusion("linear", (mm, add), (op,)))
        ops.append(op)
    return dataclasses.replace(program, ops=ops), changes
