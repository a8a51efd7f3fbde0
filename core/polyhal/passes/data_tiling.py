"""Data tiling (IREE's ``SetEncoding``): wrap matmul operands and results in encodings.

Each 2-D matmul ``c = a @ b`` becomes::

    a' = encode(a -> matmul.LHS)      b' = encode(b -> matmul.RHS)
    c' = matmul(a', b')  : tensor<MxN, matmul.RESULT>
    c  = encode(c' -> none)

The pass is device-agnostic: it only says *what* each operand is. Which layout that means, and
whether the encode ops cost anything, is decided per device by MaterializeEncoding after
placement. On a device without data tiling every encode folds and the plan is the one the
un-encoded program gives; on the CPU the operands are packed once and a chain of matmuls keeps
the packed layout between its links (the unset/set pairs between them fold).

Enabled with ``polyhal.compile(program, data_tiling=True)`` or ``polyhal demo --data-tiling``.
"""

from __future__ import annotations

import dataclasses

from polyhal.ir.encoding import MatmulEncoding, _MATMUL_ELEMENT_TYPES
from polyhal.ir.program import Op, Program, Value
from polyhal.ir.types import TensorType


def tileable(op: Op) -> bool:
    """Whether data tiling wraps ``op``: a dispatch of a 2-D x 2-D matmul on unencoded operands
    of a type the matmul encoding describes, with no empty dim."""
    if op.kind != "dispatch" or op.name != "matmul" or len(op.inputs) != 2:
        return False
    a, b = op.inputs
    (c,) = op.outputs
    return (a.type.rank == b.type.rank == 2 and all(v.type.encoding is None for v in (a, b, c))
            and all(v.type.dtype in _MATMUL_ELEMENT_TYPES for v in (a, b, c))
            and all(d > 0 for d in (*a.type.shape, *b.type.shape)))


def set_encodings(program: Program) -> Program:
    """A new program in which every :func:`tileable` matmul carries LHS/RHS/RESULT encodings
    (the input program is not modified; values keep their identity, so outputs still match)."""
    ops: list[Op] = []
    changed = False
    for op in program.ops:
        if not tileable(op):
            ops.append(op)
            continue
        changed = True
        a, b = op.inputs
        (c,) = op.outputs
        lhs, rhs, res = MatmulEncoding.for_matmul(a.type, b.type, c.type)
        a_enc = _encoded(a, lhs, "lhs")
        b_enc = _encoded(b, rhs, "rhs")
        c_enc = _encoded(c, res, "res")
        ops.append(Op("encode", "encode", (a,), (a_enc,)))
        ops.append(Op("encode", "encode", (b,), (b_enc,)))
        ops.append(Op(op.kind, op.name, (a_enc, b_enc), (c_enc,), op.attrs, op.affinity))
        ops.append(Op("encode", "encode", (c_enc,), (c,)))
    return dataclasses.replace(program, ops=ops) if changed else program


def _encoded(v: Value, encoding: MatmulEncoding, role: str) -> Value:
    return Value(TensorType(v.type.shape, v.type.dtype, encoding), f"{v.name}.{role}", v.program_id)
