"""Convolution and linear fusions: fold per-channel scales and shifts (BatchNormalization) into a
conv's constant weights and bias, and fuse the epilogue (bias, residual add, activation) of a
conv into one ``fused_conv`` op and of a ``linear`` (or a plain ``gemm``) into ``fused_linear``.

**Folding.** ONNX's BatchNormalization with known statistics imports as ``x * a + c`` with
per-channel constants ``a`` and ``c`` (:mod:`polyhal.frontends.onnx.converters.nn`). After a
``conv`` whose weights (and bias, if any) are program constants, ``conv(x, w, b) * a + c`` is
``conv(x, w * a, b * a + c)``: new constants, computed here, at compile time, and two passes
over the conv's result fewer. Any chain of ``mul``/``add`` by per-channel constants (shape
``(M, 1, ...)``, ``(1, M, 1, ...)`` or a scalar) folds, each step only when the conv's result
has no other reader. No new kernel is needed, so folding always happens.

**Epilogue.** ``act(conv(x, w, b) + r)`` -- a residual add of a value of the result's type,
then one activation, each optional -- becomes ``fused_conv(x, w, b[, r], activation=...)``
wherever ``fusible("fused_conv", ops)`` says so (:mod:`polyhal.passes.fusion`); likewise
``act(linear(x, w, b) + r)`` becomes ``fused_linear``, and so does a ``gemm`` with a bias and
alpha = beta = 1 (ONNX's Gemm; with ``trans_b`` only when its weights are a constant, transposed
here once). Activations are
found as front ends emit them: ``relu``, ``sigmoid``, ``gelu``; Clip as ``maximum``/``minimum``
by scalar constants; HardSigmoid as ``mul``, ``add``, then a clamp to [0, 1]; HardSwish as that
times the input; SiLU as ``x * sigmoid(x)``.

**Pool first.** An average pool of a pointwise conv's result (1x1, stride 1, no padding, no
activation), whose windows all lie inside the map, is the conv of the pooled input: both are
linear per pixel, and a bias survives a mean. :func:`pool_before_pointwise_conv` swaps them, so
that the conv runs on the pooled map: DenseNet's transitions (a 1x1 conv halving the channels,
then a 2x2 average pool) compute a quarter of the products, as onnxruntime's graph does not
but its kernels could not beat.

**Scale and shift.** A per-channel ``mul`` and ``add`` by constants that no conv before them
takes (a BatchNormalization after a concatenation), with the activation after them, becomes one
``scale_shift`` (:func:`fuse_scale_shift`): one pass over the tensor instead of three.

A backend's own conv fusions live with the backend: the CPU's prologue (a ``scale_shift`` taken
into the conv that reads it) is ``polyhal_cpu.fusions``, registered through ``register_passes``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from polyhal.ir.program import Op, Program, Value, uses_and_producers
from polyhal.ir.types import TensorType
from polyhal.ops import canonical_attrs
from polyhal.passes.fusion import Fusible, Fusion, always, drop_unused_constants


def _constants(program: Program) -> dict[int, np.ndarray]:
    return {v.id: data for v, data in program.constants}


def _users(program: Program) -> dict[int, list[Op]]:
    users: dict[int, list[Op]] = {}
    for op in program.ops:
        for v in op.inputs:
            users.setdefault(v.id, []).append(op)
    return users


def _other(op: Op, v: Value) -> Value:
    return op.inputs[1] if op.inputs[0] is v else op.inputs[0]


def _per_channel(value: Value, data: np.ndarray | None, y: Value) -> np.ndarray | None:
    """``data`` as an (M,) float64 vector if it broadcasts against ``y`` (N, M, ...) along the
    channels only (and keeps y's type), else None."""
    if data is None or value.type.dtype != y.type.dtype or value.type.rank > y.type.rank:
        return None
    shape = (1,) * (y.type.rank - value.type.rank) + value.type.shape
    m = y.type.shape[1]
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, m):
        return None
    return np.broadcast_to(np.asarray(data, np.float64).reshape(-1), (m,)).copy()


def fold_conv_affine(program: Program) -> tuple[Program, list[Fusion]]:
    """``program`` with per-channel ``mul``/``add`` by constants after convs with constant
    weights folded into new weights and biases (see the module docstring), and what changed."""
    uses, producer = uses_and_producers(program)
    consts, users = _constants(program), _users(program)
    rewrites: dict[int, tuple[Op, list[Op], np.ndarray, np.ndarray]] = {}  # id(conv) -> (conv, chain, w, b)
    for op in program.ops:
        if op.kind != "dispatch" or op.name != "conv" or op.inputs[1].id not in consts \
                or (len(op.inputs) == 3 and op.inputs[2].id not in consts):
            continue
        y, chain = op.outputs[0], []
        m = y.type.shape[1]
        scale, shift = np.ones(m), (np.asarray(consts[op.inputs[2].id], np.float64).copy()
                                    if len(op.inputs) == 3 else np.zeros(m))
        while uses[y.id] == 1 and len(users.get(y.id, ())) == 1:
            nxt = users[y.id][0]
            if nxt.kind != "dispatch" or nxt.name not in ("mul", "add") or nxt.affinity != op.affinity \
                    or nxt.outputs[0].type != y.type:
                break
            c = _other(nxt, y)
            vec = _per_channel(c, consts.get(c.id), y)
            if vec is None or c is y:
                break
            if nxt.name == "mul":
                scale, shift = scale * vec, shift * vec
            else:
                shift = shift + vec
            chain.append(nxt)
            y = nxt.outputs[0]
        if chain:
            w = consts[op.inputs[1].id]
            w_new = (np.asarray(w, np.float64) * scale.reshape((m,) + (1,) * (w.ndim - 1))).astype(w.dtype)
            rewrites[id(op)] = (op, chain, w_new, shift.astype(w.dtype))
    if not rewrites:
        return program, []
    dropped = {id(o) for _, chain, _, _ in rewrites.values() for o in chain}
    ops, changes, constants = [], [], list(program.constants)
    for op in program.ops:
        if id(op) in dropped:
            continue
        rewrite = rewrites.get(id(op))
        if rewrite is not None:
            conv, chain, w_new, b_new = rewrite
            w_val = _constant(conv.inputs[1], "folded", w_new, constants)
            b_val = _constant(conv.inputs[1], "folded_bias", b_new, constants)
            op = Op("dispatch", "conv", (conv.inputs[0], w_val, b_val), chain[-1].outputs, conv.attrs, conv.affinity)
            changes.append(Fusion("batch_norm", (conv, *chain), (op,)))
        ops.append(op)
    return drop_unused_constants(dataclasses.replace(program, ops=ops, constants=constants)), changes


def _constant(like: Value, suffix: str, data: np.ndarray, constants: list, copy: bool = True) -> Value:
    """A new program constant holding ``data`` (read-only), named after ``like``: row-major,
    unless ``copy`` is False (a view of another constant, as it lies)."""
    data = np.ascontiguousarray(data) if copy else data.view()
    data.flags.writeable = False
    value = Value(TensorType(data.shape, data.dtype), f"{like.name}_{suffix}", like.program_id)
    constants.append((value, data))
    return value


# ---------------------------------------------------------------------------------- epilogue

class _Matcher:
    """Finds the residual add and the activation after a conv's result."""

    def __init__(self, program: Program) -> None:
        self.uses, _ = uses_and_producers(program)
        self.users, self.consts = _users(program), _constants(program)
        self.affinity = None  # the conv's: every fused op must share it

    def only_user(self, v: Value, names: tuple[str, ...]) -> Op | None:
        """The one op reading ``v`` if it is a same-type dispatch among ``names``."""
        if self.uses[v.id] != 1 or len(self.users.get(v.id, ())) != 1:
            return None
        op = self.users[v.id][0]
        ok = (op.kind == "dispatch" and op.name in names and op.affinity == self.affinity
              and op.outputs[0].type == v.type)
        return op if ok else None

    def scalar(self, v: Value) -> float | None:
        data = self.consts.get(v.id)
        return float(data.reshape(-1)[0]) if data is not None and data.size == 1 else None

    def by_scalar(self, v: Value, names: tuple[str, ...]) -> tuple[Op, float] | None:
        """The one op reading ``v`` (one of ``names``) with a scalar constant as other operand."""
        op = self.only_user(v, names)
        if op is None or len(op.inputs) != 2:
            return None
        c = self.scalar(_other(op, v))
        return None if c is None else (op, c)

    def clamp(self, v: Value) -> tuple[float, float, list[Op], Value]:
        """A ``maximum`` and a ``minimum`` by scalars (either, or both, in either order) after
        ``v``: (lo, hi, ops, result). min-then-max is a clip only for lo <= hi."""
        lo, hi, ops, start = -math.inf, math.inf, [], v
        for _ in range(2):
            found = self.by_scalar(v, ("maximum", "minimum"))
            if found is None or any(o.name == found[0].name for o in ops):
                break
            op, c = found
            lo, hi = (c, hi) if op.name == "maximum" else (lo, c)
            ops.append(op)
            v = op.outputs[0]
        if len(ops) == 2 and ops[0].name == "minimum" and lo > hi:
            return -math.inf, math.inf, [], start
        return lo, hi, ops, v

    def hard_sigmoid(self, v: Value, first: Op | None = None) -> tuple[float, float, list[Op], Value] | None:
        """``clamp(v * a + b, 0, 1)``: (a, b, ops, result), or None. ``first``: the ``mul``
        reading ``v`` when ``v`` has other readers too."""
        if first is None:
            mul = self.by_scalar(v, ("mul",))
        else:
            c = self.scalar(_other(first, v)) if first.name == "mul" and first.affinity == self.affinity \
                and first.outputs[0].type == v.type else None
            mul = None if c is None else (first, c)
        add = mul and self.by_scalar(mul[0].outputs[0], ("add",))
        if not add:
            return None
        lo, hi, clamp, out = self.clamp(add[0].outputs[0])
        return (mul[1], add[1], [mul[0], add[0], *clamp], out) if (lo, hi) == (0.0, 1.0) else None

    def activation(self, y: Value) -> tuple[str, float, float, list[Op]] | None:
        """The activation applied to ``y``: (name, alpha, beta, its ops), or None."""
        users = self.users.get(y.id, [])
        if self.uses[y.id] == 2 and len(users) == 2:  # y * f(y): silu, hard_swish
            for inner, outer in (users, users[::-1]):
                if outer.kind != "dispatch" or outer.name != "mul" or outer.affinity != self.affinity \
                        or outer.outputs[0].type != y.type or y not in outer.inputs:
                    continue
                gate = _other(outer, y)
                if inner.name == "sigmoid" and inner.inputs[0] is y and gate is inner.outputs[0] \
                        and self.only_user(gate, ("mul",)) is outer:
                    return "silu", 0.0, 0.0, [inner, outer]
                if inner.name == "mul":
                    hs = self.hard_sigmoid(y, inner)
                    if hs and hs[3] is gate and self.only_user(gate, ("mul",)) is outer:
                        return "hard_swish", hs[0], hs[1], [*hs[2], outer]
            return None
        op = self.only_user(y, ("relu", "sigmoid", "gelu", "maximum", "minimum", "mul"))
        if op is None:
            return None
        if op.name in ("relu", "sigmoid"):
            return op.name, 0.0, 0.0, [op]
        if op.name == "gelu":
            return ("gelu_tanh" if op.attr_dict.get("approximate") == "tanh" else "gelu"), 0.0, 0.0, [op]
        if op.name == "mul":
            hs = self.hard_sigmoid(y)
            return ("hard_sigmoid", hs[0], hs[1], hs[2]) if hs else None
        lo, hi, ops, _ = self.clamp(y)
        return ("clip", lo, hi, ops) if ops else None


#: The op whose epilogue fuses -> the fused op.
_FUSED = {"conv": "fused_conv", "linear": "fused_linear", "gemm": "fused_linear"}


def _plain_gemm(op: Op, consts: dict[int, np.ndarray]) -> bool:
    """A ``gemm`` that is ``linear`` (bias of shape (N,) or a scalar, alpha = beta = 1, A not
    transposed, B transposed only if it is a constant)."""
    a = op.attr_dict
    if len(op.inputs) != 3 or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0 or a.get("trans_a"):
        return False
    w, b = op.inputs[1], op.inputs[2]
    n = w.type.shape[0] if a.get("trans_b") else w.type.shape[1]
    return b.type.shape in ((n,), (), (1,)) and (not a.get("trans_b") or w.id in consts)


def fuse_conv_epilogue(program: Program, fusible: Fusible = always) -> tuple[Program, list[Fusion]]:
    """``program`` with each conv's and linear's residual add and activation fused into a
    ``fused_conv`` or ``fused_linear`` where ``fusible`` allows (see the module docstring),
    and what changed."""
    fused: dict[int, tuple[Op, list[Op], Value | None, tuple]] = {}  # id(last op) -> (base, chain, r, act)
    taken: set[int] = set()
    match = _Matcher(program)
    for base in program.ops:
        if base.kind != "dispatch" or base.name not in _FUSED or id(base) in taken \
                or (base.name == "gemm" and not _plain_gemm(base, match.consts)) \
                or base.outputs[0].type.dtype.kind != "f":
            continue
        match.affinity = base.affinity
        y, chain, residual = base.outputs[0], [base], None
        add = match.only_user(y, ("add",))
        if add is not None and len(add.inputs) == 2 and id(add) not in taken:
            r = _other(add, y)
            if r is not y and r.type == y.type:
                residual, y = r, add.outputs[0]
                chain.append(add)
        act = match.activation(y)
        if act is not None and not any(id(o) in taken for o in act[3]):
            chain.extend(act[3])
        if len(chain) == 1 or not fusible(_FUSED[base.name], chain):
            continue
        taken.update(id(o) for o in chain)
        fused[id(chain[-1])] = (base, chain, residual, act[:3] if act and chain[-1] is act[3][-1] else ("none", 0, 0))
    if not fused:
        return program, []
    constants = list(program.constants)
    consts = match.consts
    ops, changes = [], []
    for op in program.ops:
        if id(op) in taken and id(op) not in fused:
            continue
        if id(op) in fused:
            base, chain, residual, (name, alpha, beta) = fused[id(op)]
            x, w = base.inputs[:2]
            if base.name == "gemm" and base.attr_dict.get("trans_b"):
                # A transposed view, as fold_constants makes: the program keeps the original for
                # a later compile, so a row-major copy would hold the weights twice (MobileNetV3's
                # classifier: 4.9 MB; ResNet-50's: 8 MB). Host kernels read it through BLAS's
                # transpose flag, oneDNN's matmul reorders it once into the copy it keeps, and a
                # device that uploads constants makes its own row-major copy.
                w = _constant(w, "transposed", consts[w.id].T, constants, copy=False)
            b = base.inputs[2] if len(base.inputs) == 3 else _constant(
                w, "zero_bias", np.zeros(w.type.shape[0], w.type.dtype), constants)
            attrs = {"activation": name, "alpha": float(alpha), "beta": float(beta)}
            if base.name == "conv":
                attrs = {**base.attr_dict, **attrs}
            ins = (x, w, b) if residual is None else (x, w, b, residual)
            op = Op("dispatch", _FUSED[base.name], ins, chain[-1].outputs, canonical_attrs(attrs), base.affinity)
            changes.append(Fusion("epilogue", tuple(chain), (op,)))
        ops.append(op)
    return drop_unused_constants(dataclasses.replace(program, ops=ops, constants=constants)), changes


# ---------------------------------------------------------------------------------- scale_shift

def _by_channel_constant(op: Op, consts: dict[int, np.ndarray]) -> tuple[Value, np.ndarray] | None:
    """(x, vector) when ``op`` is a float ``mul`` or ``add`` of a feature map x (N, C, spatial...)
    and a constant that broadcasts along x's channels only, keeping x's type; else None. (Rank 2
    is left alone: there "channels" are a matrix's last dim, a layer norm's gain and bias.)"""
    if op.kind != "dispatch" or op.name not in ("mul", "add") or len(op.inputs) != 2:
        return None
    for x, c in (op.inputs, op.inputs[::-1]):
        if x.id in consts or c.id not in consts or x.type.rank < 3 or x.type.dtype.kind != "f" \
                or op.outputs[0].type != x.type:
            continue
        vec = _per_channel(c, consts[c.id], x)
        if vec is not None:
            return x, vec
    return None


def fuse_scale_shift(program: Program, fusible: Fusible = always) -> tuple[Program, list[Fusion]]:
    """``program`` with each per-channel ``mul`` by a constant, ``add`` of a constant (either or
    both, in that order) and the activation after them -- at least two of the three -- fused into
    one ``scale_shift`` where ``fusible`` allows, and what changed. Meant to run after
    :func:`fold_conv_affine` and :func:`fuse_conv_epilogue`, which take the scales and
    shifts and activations that follow a conv: what is left is a normalisation of a value no conv
    produced (DenseNet's norm and ReLU after each concatenation)."""
    match = _Matcher(program)
    consts = match.consts
    fused: dict[int, tuple[Op, list[Op], np.ndarray, np.ndarray, tuple]] = {}  # id(last op) -> ...
    taken: set[int] = set()
    for op in program.ops:
        first = _by_channel_constant(op, consts)
        if first is None or id(op) in taken:
            continue
        x, vec = first
        match.affinity = op.affinity
        m = x.type.shape[1]
        scale, shift = (vec, np.zeros(m)) if op.name == "mul" else (np.ones(m), vec)
        chain, y = [op], op.outputs[0]
        if op.name == "mul":
            add = match.only_user(y, ("add",))
            second = add and _by_channel_constant(add, consts)
            if second and second[0] is y:
                shift = second[1]
                chain.append(add)
                y = add.outputs[0]
        act = match.activation(y)
        if act is not None:
            chain.extend(act[3])
        if len(chain) < 2 or any(id(o) in taken for o in chain) or not fusible("scale_shift", chain):
            continue
        taken.update(id(o) for o in chain)
        fused[id(chain[-1])] = (op, chain, scale, shift, act[:3] if act else ("none", 0.0, 0.0))
    if not fused:
        return program, []
    constants = list(program.constants)
    ops, changes = [], []
    for op in program.ops:
        if id(op) in taken and id(op) not in fused:
            continue
        if id(op) in fused:
            first, chain, scale, shift, (name, alpha, beta) = fused[id(op)]
            x = _by_channel_constant(first, consts)[0]
            dtype = x.type.dtype
            ins = (x, _constant(x, "scale", scale.astype(dtype), constants),
                   _constant(x, "shift", shift.astype(dtype), constants))
            attrs = canonical_attrs({"activation": name, "alpha": float(alpha), "beta": float(beta)})
            op = Op("dispatch", "scale_shift", ins, chain[-1].outputs, attrs, first.affinity)
            changes.append(Fusion("scale_shift", tuple(chain), (op,)))
        ops.append(op)
    return drop_unused_constants(dataclasses.replace(program, ops=ops, constants=constants)), changes


# ------------------------------------------------------------------------------------ pool first

def _pointwise(op: Op) -> bool:
    """Whether ``op`` is a conv (or a fused one with no residual nor activation) of a 1x1 kernel,
    stride 1 and no padding: a per-pixel linear map of its input."""
    if op.kind != "dispatch" or op.name not in ("conv", "fused_conv"):
        return False
    attrs = dict(op.attrs)
    if op.name == "fused_conv" and (len(op.inputs) > 3 or attrs["activation"] != "none"):
        return False
    w = op.inputs[1].type
    return (all(k == 1 for k in w.shape[2:]) and all(int(v) == 1 for v in attrs.get("strides") or ())
            and not any(int(v) for v in attrs.get("pads") or ()))


def pool_before_pointwise_conv(program: Program) -> tuple[Program, list[Fusion]]:
    """``program`` with each ``avg_pool`` (no padding, no ceil mode) that is the only reader of a
    pointwise conv's result moved before that conv (see the module docstring), and what changed.
    No new kernel is needed, so the swap always happens."""
    uses, producer = uses_and_producers(program)
    swaps: dict[int, tuple[Op, Op]] = {}  # id(pool) -> (conv, the pool and conv replacing both)
    dropped: set[int] = set()
    for op in program.ops:
        if op.kind != "dispatch" or op.name != "avg_pool":
            continue
        attrs = dict(op.attrs)
        conv = producer.get(op.inputs[0].id)
        if (conv is None or not _pointwise(conv) or uses[conv.outputs[0].id] != 1 or conv.affinity != op.affinity
                or any(int(v) for v in attrs.get("pads") or ()) or int(attrs.get("ceil_mode") or 0)):
            continue
        x, y = conv.inputs[0], op.outputs[0]
        pooled = Value(TensorType((x.type.shape[:2]) + y.type.shape[2:], x.type.dtype), f"{x.name}_pooled",
                       x.program_id)
        swaps[id(op)] = (conv, Op("dispatch", "avg_pool", (x,), (pooled,), op.attrs, op.affinity),
                         Op("dispatch", conv.name, (pooled,) + tuple(conv.inputs[1:]), (y,), conv.attrs, conv.affinity))
        dropped.add(id(conv))
    if not swaps:
        return program, []
    ops, changes = [], []
    for op in program.ops:
        if id(op) in dropped:
            continue
        if id(op) in swaps:
            conv, pool, new_conv = swaps[id(op)]
            ops += [pool, new_conv]
            changes.append(Fusion("pool_first", (conv, op), (pool, new_conv)))
            continue
        ops.append(op)
    return dataclasses.replace(program, ops=ops), changes
