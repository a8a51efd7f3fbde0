"""Fuse ``matmul(softmax(matmul(q, kT) [* c] [+ mask]), v)`` into ``attention(q, k, v, scale=c)``
or ``masked_attention(q, k, v, mask, scale=c)``.

Exporters write a self-attention head as MatMul (queries by transposed keys), a scaling by
1/sqrt(d) (on the product, or moved onto the queries by :mod:`polyhal.passes.fuse_linear`),
Softmax over the keys and MatMul by the values. As separate ops the (Lq, Lk) scores are written,
read and written again by the softmax, and read by the second product; ``attention`` is one op,
so a kernel can keep one head's weights in cache and normalise the small (Lq, Dv) result instead
of the weights.

The pass matches, for dispatches with one affinity:

* ``s = matmul(a, kT)`` with ``a`` (batch..., Lq, D) and ``kT`` (batch..., D, Lk), equal batch
  dims, a float type; optionally ``s = mul(matmul(a, kT), c)``, or ``a = mul(q, c)``, with ``c``
  a scalar program constant (folded into ``scale``);
* optionally ``s = add(scores, mask)`` (either order) with ``scores`` as above, of the type of
  ``s`` (the mask broadcasts to it): the padding mask of an encoder (DistilBERT, TorchScript
  exporter) or the causal mask of a decoder (GPT-2, dynamo exporter; a constant once the front
  end folded its Trilu/Where/Expand), which makes the op ``masked_attention``;
* ``p = softmax(s)`` over the last axis, ``s`` used by it alone;
* ``o = matmul(p, v)``, ``p`` used by it alone, ``v`` (batch..., Lk, Dv).

``k`` is ``kT`` with its last two dims swapped: a ``transpose`` op, which composes with the
transpose that usually made ``kT`` (exporters transpose the keys' heads) into one, and which is
a view, not a copy, on devices whose kernels take strided operands (see the bufferize pass).
Values the match would remove but that something else reads keep their ops. A match is fused
only where ``fusible("attention", ops)`` (``"masked_attention"``) says so (see
:mod:`polyhal.passes.fusion`).
"""

from __future__ import annotations


import numpy as np

from polyhal.ir.program import Op, Program, Value, consumers_of, uses_and_producers
from polyhal.ir.types import TensorType
from polyhal.ops import canonical_attrs
from polyhal.passes.fusion import Fusible, Fusion, always, in_program_order, splice


def fuse_attention(program: Program, fusible: Fusible = always) -> tuple[Program, list[Fusion]]:
    """``program`` with attention heads fused where ``fusible`` allows, and what changed."""
    uses, producer = uses_and_producers(program)
    consumers = consumers_of(program)
    constants = {v.id: data for v, data in program.constants}

    def dispatch(v: Value, name: str) -> Op | None:
        op = producer.get(v.id)
        return op if op is not None and op.kind == "dispatch" and op.name == name else None

    def scalar(v: Value) -> float | None:
        data = constants.get(v.id)
        if data is None or data.size != 1 or data.dtype.kind != "f" or not np.isfinite(data).all():
            return None
        return float(np.asarray(data).reshape(()))

    def scaling(op: Op | None, keep: Value) -> float | None:
        """c when ``op`` is mul(keep, c) or mul(c, keep) with a scalar constant c."""
        if op is None or len(op.inputs) != 2:
            return None
        i = 0 if op.inputs[0] is keep else 1 if op.inputs[1] is keep else None
        return None if i is None else scalar(op.inputs[1 - i])

    replaced: dict[int, list[Op]] = {}  # id(final matmul) -> the ops it replaces, new ops
    removed: set[int] = set()
    for sm in program.ops:
        if sm.kind != "dispatch" or sm.name != "softmax" or len(sm.inputs) != 1:
            continue
        s, p = sm.inputs[0], sm.outputs[0]
        rank = s.type.rank
        if rank < 2 or int(dict(sm.attrs).get("axis", -1)) % rank != rank - 1 or s.type.dtype.kind != "f":
            continue
        users = consumers.get(p.id, [])
        if uses[p.id] != 1 or len(users) != 1:
            continue
        mm2 = users[0]
        if mm2.kind != "dispatch" or mm2.name != "matmul" or mm2.inputs[0] is not p or mm2.inputs[1] is p:
            continue
        if uses[s.id] != 1:
            continue
        scale, chain = 1.0, [sm, mm2]
        mask = None
        add = dispatch(s, "add")
        if add is not None:  # s = add(scores, mask), in either order
            scores = next((x for x in add.inputs if uses[x.id] == 1 and x.type == s.type
                           and (dispatch(x, "matmul") or dispatch(x, "mul"))), None)
            mask = None if scores is None or len(add.inputs) != 2 else (
                add.inputs[1] if add.inputs[0] is scores else add.inputs[0])
            if mask is None or mask is scores or mask.type.dtype != s.type.dtype or mask.type.encoding is not None:
                continue
            s = scores
            chain.append(add)
        mm1 = dispatch(s, "matmul")
        if mm1 is None:  # s = mul(matmul(a, kT), c)
            mul = dispatch(s, "mul")
            if mul is None:
                continue
            inner = next((v for v in mul.inputs if dispatch(v, "matmul") is not None), None)
            c = None if inner is None or uses[inner.id] != 1 else scaling(mul, inner)
            if c is None:
                continue
            mm1, scale = dispatch(inner, "matmul"), c
            chain.append(mul)
        chain.append(mm1)
        a, kt = mm1.inputs
        v = mm2.inputs[1]
        if not (a.type.rank == kt.type.rank == v.type.rank == rank
                and a.type.shape[:-2] == kt.type.shape[:-2] == v.type.shape[:-2]
                and a.type.shape[-1] == kt.type.shape[-2] and kt.type.shape[-1] == v.type.shape[-2]
                and a.type.dtype == kt.type.dtype == v.type.dtype
                and all(t.encoding is None for t in (a.type, kt.type, v.type))):
            continue
        if len({op.affinity for op in chain}) > 1:
            continue
        if any(id(op) in removed for op in chain):
            continue
        q = a
        pre = dispatch(a, "mul")  # a = mul(q, c): fold c too
        if pre is not None and uses[a.id] == 1 and pre.affinity == mm1.affinity:
            other = next((x for x in pre.inputs if scalar(x) is None), None)  # the non-constant operand
            c = None if other is None else scaling(pre, other)
            if c is not None:
                q, scale = other, scale * c
                chain.append(pre)
        new: list[Op] = []
        swap = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        t = dispatch(kt, "transpose")
        if t is not None and uses[kt.id] == 1 and t.affinity == mm1.affinity:
            perm = dict(t.attrs).get("perm")
            perm = tuple(reversed(range(rank))) if perm is None else tuple(int(x) for x in perm)
            src = t.inputs[0]
            chain.append(t)
            composed = tuple(perm[i] for i in swap)
            if composed == tuple(range(rank)):
                k = src
            else:
                k = Value(_swapped(kt), f"{kt.name}_k", kt.program_id)
                new.append(Op("dispatch", "transpose", (src,), (k,), canonical_attrs({"perm": composed}), mm2.affinity))
        else:
            k = Value(_swapped(kt), f"{kt.name}_k", kt.program_id)
            new.append(Op("dispatch", "transpose", (kt,), (k,), canonical_attrs({"perm": swap}), mm2.affinity))
        fused = "attention" if mask is None else "masked_attention"
        if not fusible(fused, in_program_order(program, chain)):
            continue
        operands = (q, k, v) if mask is None else (q, k, v, mask)
        new.append(Op("dispatch", fused, operands, mm2.outputs, canonical_attrs({"scale": scale}), mm2.affinity))
        replaced[id(mm2)] = [chain, new]
        removed.update(id(op) for op in chain)
    return splice(program, replaced, removed, "attention")


def _swapped(v: Value) -> TensorType:
    shape = v.type.shape
    return TensorType(shape[:-2] + (shape[-1], shape[-2]), v.type.dtype)
