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
* ``o = matmul(p, v)``, ``p`` used by it alone, ``v`` (batch..., Lk, Dv);
* optionally ``kT = mul(x, c)`` with a scalar constant ``c`` (folded into ``scale``): torch's
  SDPA export scales both q and kT by the square root of the scale.

``k`` is ``kT`` with its last two dims swapped: a ``transpose`` op, which composes with the
transpose that usually made ``kT`` (exporters transpose the keys' heads) into one, and which is
a view, not a copy, on devices whose kernels take strided operands (see the bufferize pass).
q, k and v that torch's ``multi_head_attention_forward`` wrote as ``view(S, B * H, D).transpose(0,
1).view(B, H, S, D)`` of an (S, B, E) tensor are taken as ``transpose(view(S, B, H, D), (1, 2, 0,
3))`` of it instead (:func:`_split_heads`): the same elements, but only splits, so a view where
the tensor is itself a strided view (a third of a packed projection), which merging B with H is
not. Values the match would remove but that something else reads keep their ops. A match is fused
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
        post = dispatch(kt, "mul")  # kT = mul(k', c): torch's SDPA export scales q and kT by sqrt(c)
        if post is not None and uses[kt.id] == 1 and post.affinity == mm1.affinity:
            other = next((x for x in post.inputs if scalar(x) is None), None)
            c = None if other is None or other.type != kt.type else scaling(post, other)
            if c is not None:
                kt, scale = other, scale * c
                chain.append(post)
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
        q, v = _split_heads(q, dispatch, uses, chain, new), _split_heads(v, dispatch, uses, chain, new)
        swap = tuple(range(rank - 2)) + (rank - 1, rank - 2)
        t = dispatch(kt, "transpose")
        if t is not None and uses[kt.id] == 1 and t.affinity == mm1.affinity:
            perm = dict(t.attrs).get("perm")
            perm = tuple(reversed(range(rank))) if perm is None else tuple(int(x) for x in perm)
            chain.append(t)
            src = _split_heads(t.inputs[0], dispatch, uses, chain, new)
            composed = tuple(perm[i] for i in swap)
            if composed == tuple(range(rank)):
                k = src
            else:
                k = Value(_swapped(kt), f"{kt.name}_k", kt.program_id)
                new.append(Op("dispatch", "transpose", (src,), (k,), canonical_attrs({"perm": composed}), mm2.affinity))
        else:  # (torch's exporter may have moved SDPA's key transpose into the heads' one)
            src = _split_heads(kt, dispatch, uses, chain, new)
            k = Value(_swapped(kt), f"{kt.name}_k", kt.program_id)
            new.append(Op("dispatch", "transpose", (src,), (k,), canonical_attrs({"perm": swap}), mm2.affinity))
        fused = "attention" if mask is None else "masked_attention"
        if not fusible(fused, in_program_order(program, chain)):
            continue
        operands = (q, k, v) if mask is None else (q, k, v, mask)
        new.append(Op("dispatch", fused, operands, mm2.outputs, canonical_attrs({"scale": scale}), mm2.affinity))
        replaced[id(mm2)] = [chain, new]
        removed.update(id(op) for op in chain)
    return splice(program, replaced, removed, "attention")


def _split_heads(x: Value, dispatch, uses: dict, chain: list, new: list) -> Value:
    """``x``, or the same tensor as a split of its source followed by one transpose when ``x`` is
    ``reshape(transpose(reshape(src)))`` whose first reshape merges dims (appending the three ops
    to ``chain`` and the two or three that replace them to ``new``).

    torch's ``multi_head_attention_forward`` hands q, k and v to attention as
    ``x.view(S, B * H, D).transpose(0, 1).view(B, H, S, D)`` of an (S, B, E) projection. Where x is
    a strided view (the q, k or v third of a packed projection), merging B with H needs a copy;
    ``transpose(reshape(x, (S, B, H, D)), (1, 2, 0, 3))`` is the same tensor with only splits, a
    view of any layout, which a kernel taking two batch strides reads in place."""
    r2 = dispatch(x, "reshape")
    t = None if r2 is None else dispatch(r2.inputs[0], "transpose")
    r1 = None if t is None else dispatch(t.inputs[0], "reshape")
    if r1 is None or uses[x.id] != 1 or uses[r2.inputs[0].id] != 1 or uses[t.inputs[0].id] != 1 or len(
            {r1.affinity, t.affinity, r2.affinity}) != 1:
        return x
    src, mid = r1.inputs[0], r1.outputs[0]
    groups = _refinement(src.type.shape, mid.type.shape)
    if groups is None or all(len(g) < 2 for g in groups):
        return x  # no merge to undo (or no common split)
    perm = dict(t.attrs).get("perm")
    perm = tuple(reversed(range(mid.type.rank))) if perm is None else tuple(int(p) for p in perm)
    fine = tuple(d for g in groups for d in g)
    starts = [sum(len(g) for g in groups[:i]) for i in range(len(groups))]
    order: list[int] = []
    for p in perm:
        order.extend(range(starts[p], starts[p] + len(groups[p])))
    moved = tuple(fine[i] for i in order)
    if moved != tuple(d for d in x.type.shape if d != 1):
        return x
    dtype, pid, aff = x.type.dtype, x.program_id, r2.affinity
    split = Value(TensorType(fine, dtype), f"{x.name}_split", pid)
    heads = x if moved == x.type.shape else Value(TensorType(moved, dtype), f"{x.name}_heads", pid)
    ops = [Op("dispatch", "reshape", (src,), (split,), canonical_attrs({"shape": fine}), aff),
           Op("dispatch", "transpose", (split,), (heads,), canonical_attrs({"perm": tuple(order)}), aff)]
    if heads is not x:  # dims of size 1 back in place
        ops.append(Op("dispatch", "reshape", (heads,), (x,), canonical_attrs({"shape": x.type.shape}), aff))
    chain.extend((r1, t, r2))
    new.extend(ops)
    return x


def _refinement(shape: tuple[int, ...], target: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """For each dim of ``target``, the dims it is made of in the coarsest shape that both
    ``shape`` and ``target`` are merges of (dims of size 1 dropped), or None when there is none
    (a dim of one does not divide the other's) or a dim is empty."""
    if 0 in shape or 0 in target:
        return None
    rest = [d for d in shape if d != 1]
    groups: list[tuple[int, ...]] = []
    i, left = 0, 1  # left: what remains of shape's current dim
    for d in target:
        group = []
        while d != 1:
            if left == 1:
                if i == len(rest):
                    return None
                left, i = rest[i], i + 1
            if left % d == 0:
                group.append(d)
                left, d = left // d, 1
            elif d % left == 0:
                group.append(left)
                d, left = d // left, 1
            else:
                return None
        groups.append(tuple(group))
    return groups if left == 1 and i == len(rest) else None


def _swapped(v: Value) -> TensorType:
    shape = v.type.shape
    return TensorType(shape[:-2] + (shape[-1], shape[-2]), v.type.dtype)
