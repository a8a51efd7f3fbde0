"""Fuse the GELU formulas that exporters write out op by op into one ``gelu`` op.

torch exports ``nn.GELU()`` and BERT-style activations as ``x * 0.5 * (1 + erf(x / sqrt 2))``
(Div, Erf, Add, Mul, Mul) and GPT-2's ``gelu_new`` as ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
x^3)))`` (Mul, Pow, Mul, Add, Mul, Tanh, Add, Mul): five and eight passes over a (seq, 4 d)
activation, where ``gelu`` is one (a fused loop on the CPU). On a 2-core VM the Pow alone took
28 ms of a GPT-2 layer's 110 (numpy's float power), the Erf form 8 ms of DistilBERT's 75.

The pass matches, for dispatches of one affinity whose intermediate results have no other use:

* the inner term: ``erf(x / c)`` with c = sqrt 2, or ``erf(x * c)`` with c = 1/sqrt 2; or
  ``tanh(c * (x + k * x^3))`` with c = sqrt(2/pi) and k = 0.044715, x^3 written as
  ``pow(x, 3)``, ``x * x * x`` in either grouping, and the products in either operand order;
* ``a = 1 + t`` for that term t;
* the product of x, a and 0.5 in any grouping: ``(x * a) * 0.5``, ``(x * 0.5) * a``,
  ``x * (a * 0.5)``, ``(a * x) / 2`` ...

Constants are scalars (any size-1 array) within 1e-6 (relative) of the values above, so the
float32 roundings that exporters store match. The result becomes ``gelu(x, approximate="none")``
or ``"tanh"`` where ``fusible("gelu", ops)`` says so (see :mod:`polyhal.passes.fusion`).
"""

from __future__ import annotations

import math

import numpy as np

from polyhal.ir.program import Op, Program, Value, consumers_of, uses_and_producers
from polyhal.ops import canonical_attrs
from polyhal.passes.fusion import Fusible, Fusion, always, in_program_order, splice

_SQRT2 = math.sqrt(2.0)
_TANH_SCALE = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def fuse_gelu(program: Program, fusible: Fusible = always) -> tuple[Program, list[Fusion]]:
    """``program`` with GELU formulas fused into ``gelu`` ops where ``fusible`` allows, and what
    changed."""
    uses, producer = uses_and_producers(program)
    consumers = consumers_of(program)
    constants = {v.id: data for v, data in program.constants}

    def const(v: Value, want: float) -> bool:
        data = constants.get(v.id)
        if data is None or data.size != 1 or data.dtype.kind != "f":
            return False
        got = float(np.asarray(data).reshape(()))
        return math.isclose(got, want, rel_tol=1e-6)

    def made_by(v: Value, *names: str) -> Op | None:
        op = producer.get(v.id)
        return op if op is not None and op.kind == "dispatch" and op.name in names else None

    def private(op: Op) -> bool:
        """Whether ``op``'s result is read once (by the next op of the match)."""
        return uses[op.outputs[0].id] == 1

    def split(op: Op, want: float) -> Value | None:
        """y when ``op`` is y * c or c * y with the constant c == ``want``."""
        if op is None or op.name != "mul" or len(op.inputs) != 2:
            return None
        a, b = op.inputs
        return a if const(b, want) else b if const(a, want) else None

    def cube_of(v: Value, chain: list[Op]) -> Value | None:
        """x when ``v`` is pow(x, 3), (x * x) * x or x * (x * x)."""
        op = made_by(v, "pow", "mul")
        if op is None or not private(op):
            return None
        a, b = op.inputs
        if op.name == "pow":
            if not const(b, 3.0):
                return None
            chain.append(op)
            return a
        for sq, x in ((a, b), (b, a)):
            inner = made_by(sq, "mul")
            if inner is not None and private(inner) and inner.inputs[0] is inner.inputs[1] is x:
                chain += [op, inner]
                return x
        return None

    def erf_input(t: Op, chain: list[Op]) -> Value | None:
        """x when erf's operand is x / sqrt 2 or x * (1 / sqrt 2)."""
        op = made_by(t.inputs[0], "div", "mul")
        if op is None or not private(op):
            return None
        x = (op.inputs[0] if const(op.inputs[1], _SQRT2) else None) if op.name == "div" else split(op, 1 / _SQRT2)
        if x is not None:
            chain.append(op)
        return x

    def tanh_input(t: Op, chain: list[Op]) -> Value | None:
        """x when tanh's operand is sqrt(2/pi) * (x + 0.044715 * x^3)."""
        op = made_by(t.inputs[0], "mul")
        inner = split(op, _TANH_SCALE)
        add = None if inner is None or not private(op) else made_by(inner, "add")
        if add is None or not private(add):
            return None
        for x, term in (add.inputs, reversed(add.inputs)):
            scaled = made_by(term, "mul")
            cube = split(scaled, _CUBIC)
            found: list[Op] = []
            if cube is not None and private(scaled) and cube_of(cube, found) is x:
                chain += [op, add, scaled, *found]
                return x
        return None

    def product(a: Value, x: Value, chain: list[Op]) -> Op | None:
        """The op whose result is x * a * 0.5 (grouped in any way), starting from a's use."""
        need = {"x": True, "half": True}
        v = a
        for _ in range(2):
            users = consumers.get(v.id, [])
            if uses[v.id] != 1 or len(users) != 1:
                return None
            op = users[0]
            if op.kind != "dispatch" or len(op.inputs) != 2 or op.name not in ("mul", "div"):
                return None
            other = op.inputs[1] if op.inputs[0] is v else op.inputs[0]
            if op.name == "div":  # (x * a) / 2
                if op.inputs[0] is not v or not need["half"] or not const(other, 2.0):
                    return None
                need["half"] = False
            elif other is x and need["x"]:
                need["x"] = False
            elif const(other, 0.5) and need["half"]:
                need["half"] = False
            else:  # (x * 0.5) * a, or (0.5 * x) * a
                half = made_by(other, "mul")
                if (not (need["x"] and need["half"]) or half is None or not private(half)
                        or split(half, 0.5) is not x):
                    return None
                chain.append(half)
                need = {"x": False, "half": False}
            chain.append(op)
            if not any(need.values()):
                return op
            v = op.outputs[0]
        return None

    replaced: dict[int, tuple[tuple[Op, ...], Op]] = {}  # id(last op) -> (the chain in order, gelu)
    removed: set[int] = set()
    for t in program.ops:
        if t.kind != "dispatch" or t.name not in ("erf", "tanh") or not private(t):
            continue
        chain: list[Op] = [t]
        x = erf_input(t, chain) if t.name == "erf" else tanh_input(t, chain)
        if x is None or x.type.dtype.kind != "f" or x.type.encoding is not None:
            continue
        users = consumers.get(t.outputs[0].id, [])
        one = users[0] if len(users) == 1 else None
        if one is None or one.kind != "dispatch" or one.name != "add" or not private(one):
            continue
        other = one.inputs[1] if one.inputs[0] is t.outputs[0] else one.inputs[0]
        if not const(other, 1.0):
            continue
        chain.append(one)
        last = product(one.outputs[0], x, chain)
        if last is None or last.outputs[0].type != x.type:
            continue
        if len({op.affinity for op in chain}) > 1 or any(id(op) in removed for op in chain):
            continue
        if any(v.type != x.type for op in chain for v in op.outputs):
            continue  # a broadcast along the way: not an elementwise function of x
        ordered = in_program_order(program, chain)
        if not fusible("gelu", ordered):
            continue
        approximate = "none" if t.name == "erf" else "tanh"
        gelu = Op("dispatch", "gelu", (x,), last.outputs, canonical_attrs({"approximate": approximate}),
                  last.affinity)
        replaced[id(last)] = (ordered, (gelu,))
        removed.update(id(op) for op in chain)
    return splice(program, replaced, removed, "gelu")
