"""Fuse ``add(matmul(x, w), b)`` into ``linear(x, w, b)``.

A bias added to a matmul's result is a second pass over that result; ``linear`` adds it where
the product is written. Front ends emit MatMul and Add separately (as ONNX graphs have them),
so this pass finds the pairs: a ``matmul`` with a 2-D right operand whose only use is an ``add``
of a bias of shape ``(N,)`` (or a scalar). Ops with different affinities are left alone.
"""

from __future__ import annotations

import collections
import dataclasses

from polyhal.ir.program import Op, Program


def fuse_linear(program: Program) -> tuple[Program, list[tuple[Op, Op]]]:
    """``program`` with matmul + bias add pairs fused, and the (matmul, add) pairs fused."""
    from polyhal.ops import OPS

    if "linear" not in OPS:
        return program, []
    uses: collections.Counter[int] = collections.Counter()
    for op in program.ops:
        for v in op.inputs:
            uses[v.id] += 1
    for v in program.outputs:
        uses[v.id] += 1
    producer = {v.id: op for op in program.ops for v in op.outputs}
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
                    or op.outputs[0].type != mm.outputs[0].type):
                continue
            fused[id(op)] = (mm, op)
            dropped.add(id(mm))
            break
    if not fused:
        return program, []
    ops = []
    for op in program.ops:
        if id(op) in dropped:
            continue
        pair = fused.get(id(op))
        if pair is not None:
            mm, add = pair
            bias = add.inputs[1] if add.inputs[0] is mm.outputs[0] else add.inputs[0]
            op = Op("dispatch", "linear", (mm.inputs[0], mm.inputs[1], bias), add.outputs, (), add.affinity)
        ops.append(op)
    return dataclasses.replace(program, ops=ops), list(fused.values())
