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

Convolution chains get the same treatment (:func:`set_conv_encodings`): the feature maps
between depthwise and pointwise convs (MobileNet's and EfficientNet's blocks) carry a
:class:`~polyhal.ir.encoding.FeatureMapEncoding`, which the CPU resolves to a channel-blocked
layout (NCHWc), and so do those of chains of ordinary convs (ResNet's), which CUDA with cuDNN
resolves to channels-last (NHWC) and the CPU to NCHW; the chain's links fold and only its edges
pay a relayout.

Enabled with ``polyhal.compile(program, data_tiling=True)`` or ``polyhal demo --data-tiling``.
"""

from __future__ import annotations

import dataclasses

from polyhal.ir.encoding import CHANNEL_BLOCKED_ELEMENTWISE, FeatureMapEncoding, MatmulEncoding, _MATMUL_ELEMENT_TYPES
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


def _encoded(v: Value, encoding, role: str) -> Value:
    return Value(TensorType(v.type.shape, v.type.dtype, encoding), f"{v.name}.{role}", v.program_id)


#: Input channels up to which a dense conv joins the chain of its result as its "stem": it reads
#: its input (an RGB image) as it lies and writes the chain's layout, where converting the image
#: costs as much as the conv (a 3-channel transpose is a strided gather: 0.18 ms at 224x224) and
#: converting the result more (MobileNetV3's and EfficientNet's first convs, 16 and 32 channels
#: at 112x112).
STEM_CHANNELS = 4


#: The convs of a chain -> the position of their filter (their bias follows it, then the
#: optional residual). A backend's own conv ops (the CPU's conv with a prologue) take no part:
#: a chain ends at them.
_FILTER = {"conv": 1, "fused_conv": 1}


def _chain_kind(op: Op) -> str | None:
    """What ``op`` is in a conv chain whose feature maps a channel-blocked layout serves (see
    polyhal.ir.encoding.ChannelBlockedLayout): "depthwise" or "pointwise" for 2-D float convs
    of those kinds, "stem" for another dense one of few input channels (:data:`STEM_CHANNELS`),
    "general" for any other 2-D float conv, "map" for an
    elementwise op over (N, C, H, W) / (N, C, 1, 1) maps of one N and C (and scalars) or a
    global average pool (``reduce_mean`` over dims 2 and 3, kept); else None."""
    if op.kind != "dispatch" or any(v.type.encoding is not None for v in (*op.inputs, *op.outputs)):
        return None
    if op.name in CHANNEL_BLOCKED_ELEMENTWISE or op.name == "reduce_mean":
        maps = [v.type for v in (*op.inputs, *op.outputs) if v.type.rank > 0]
        if not maps or any(t.rank != 4 or t.dtype.kind != "f" or t.shape[:2] != maps[0].shape[:2] or 0 in t.shape
                           for t in maps):
            return None
        if op.name == "reduce_mean":
            a = op.attr_dict
            axes = a.get("axes")
            axes = (axes,) if isinstance(axes, int) else (axes or ())  # the op takes one axis as an int too
            if sorted(axes) != [2, 3] or not a.get("keepdims", True):
                return None
        return "map"
    if op.name not in _FILTER:
        return None
    x, w = op.inputs[0].type, op.inputs[_FILTER[op.name]].type
    if x.rank != 4 or x.dtype.kind != "f" or 0 in x.shape:
        return None
    a = op.attr_dict
    group, m = int(a.get("group", 1)), w.shape[0]
    if group == x.shape[1] and w.shape[1] == 1 and m == group:
        return "depthwise"
    if w.shape[2:] == (1, 1) and group == 1 and list(a.get("strides") or [1, 1]) == [1, 1] \
            and not any(a.get("pads") or ()):
        return "pointwise"
    if group == 1 and x.shape[1] <= STEM_CHANNELS:
        return "stem"
    return "general"


def _maps(op: Op, stem: bool = False) -> list[int]:
    """The operand positions of ``op`` that are feature maps of its chain (a depthwise chain's
    ``stem`` does not read its input as one: it reads its image as it lies)."""
    if op.name in _FILTER:
        return [*([] if stem else [0]), *range(_FILTER[op.name] + 2, len(op.inputs))]
    return [i for i, v in enumerate(op.inputs) if v.type.rank > 0]


def _chains(program: Program, kinds: dict[int, str]) -> dict[int, int]:
    """Union-find over the ops of ``kinds`` linked by a feature map: op id -> its chain's root."""
    parent = {i: i for i in kinds}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer = {v.id: op for op in program.ops for v in op.outputs}
    for op in program.ops:
        if id(op) not in kinds:
            continue
        for v in (op.inputs[i] for i in _maps(op, kinds[id(op)] == "stem")):
            src = producer.get(v.id)
            if src is not None and id(src) in kinds:
                parent[find(id(src))] = find(id(op))
    return {i: find(i) for i in kinds}


#: Convs a chain of ordinary convs needs before its maps are encoded: a lone conv would pay a
#: relayout at both of its ends for what it gains.
DENSE_CHAIN_CONVS = 2


#: Input channels per output channel from which a pointwise conv that a chain of ordinary convs
#: would start with is left out of it (see :func:`_wide_entries`).
WIDE_ENTRY_RATIO = 2


def _wide_entries(program: Program, kinds: dict[int, str]) -> set[int]:
    """The pointwise convs of at least :data:`WIDE_ENTRY_RATIO` input channels per output channel
    whose input map comes from outside any chain (through chain maps only): DenseNet's
    bottlenecks, each reading the block's whole concatenation. In a chain, each would pay a
    relayout of that wide map on every layer (DenseNet-121 b1: 58 of them, 5.5 of its 38.6 ms
    of steps on the 2-core VM); left out, it reads it as it lies (a GEMM over the NCHW map) and
    the narrow rest of the layer is relaid instead."""
    producer = {v.id: op for op in program.ops for v in op.outputs}
    entries = set()
    for op in program.ops:
        if kinds.get(id(op)) != "pointwise":
            continue
        x, w = op.inputs[0], op.inputs[_FILTER[op.name]].type
        if x.type.shape[1] < WIDE_ENTRY_RATIO * w.shape[0]:
            continue
        src = producer.get(x.id)
        while src is not None and kinds.get(id(src)) == "map":
            maps = [v for v in src.inputs if v.type.rank == 4]
            src = producer.get(maps[0].id) if len(maps) == 1 else None
        if src is None or id(src) not in kinds:
            entries.add(id(op))
    return entries


def set_conv_encodings(program: Program) -> Program:
    """A new program in which the feature maps of conv chains carry
    :class:`~polyhal.ir.encoding.FeatureMapEncoding`: each op of such a chain reads encoded maps
    and writes an encoded result, with encode ops around it. Each device's resolver decides
    what the encodings become (see ``chain``): a resolver that keeps NCHW makes every encode fold.

    - Chains that contain a depthwise conv (chains of depthwise and pointwise convs, elementwise
      ops over their maps and global average pools -- squeeze-excite blocks -- linked through
      their feature maps, and a few-channel "stem" conv feeding them, whose image input stays
      as it lies): ``chain="depthwise"``.
    - Chains of other convs (and the same maps) with at least :data:`DENSE_CHAIN_CONVS` convs:
      ``chain="dense"``, and their convs' filters ``role="filter"`` (a channels-last device
      converts the constant weights once, at compile time).
    """
    kinds = {id(op): k for op in program.ops if (k := _chain_kind(op)) is not None}
    if not any(k != "map" for k in kinds.values()):
        return program
    thin = _chains(program, {i: k for i, k in kinds.items() if k != "general"})
    with_depthwise = {thin[i] for i, k in kinds.items() if k == "depthwise"}
    chain_of = {i: ("depthwise", root) for i, root in thin.items() if root in with_depthwise}
    # A few-channel conv outside a depthwise chain is an ordinary one (ResNet's first conv).
    entries = _wide_entries(program, kinds)
    rest = _chains(program, {i: "general" if k == "stem" else k for i, k in kinds.items()
                             if i not in chain_of and k != "depthwise" and i not in entries})
    convs: dict[int, int] = {}
    for i, root in rest.items():
        convs[root] = convs.get(root, 0) + (kinds[i] != "map")
    chain_of.update((i, ("dense", root)) for i, root in rest.items() if convs[root] >= DENSE_CHAIN_CONVS)
    if not chain_of:
        return program
    maps = {c: FeatureMapEncoding(chain=c) for c in ("depthwise", "dense")}
    filters = FeatureMapEncoding(chain="dense", role="filter")
    ops: list[Op] = []
    for op in program.ops:
        if id(op) not in chain_of:
            ops.append(op)
            continue
        chain = chain_of[id(op)][0]
        inputs = list(op.inputs)
        stem = chain == "depthwise" and kinds[id(op)] == "stem"
        encoded = [(i, maps[chain], "nchwc") for i in _maps(op, stem)]
        if chain == "dense" and op.name in _FILTER:
            encoded.append((_FILTER[op.name], filters, "filter"))
        for i, encoding, role in encoded:
            enc = _encoded(inputs[i], encoding, role)
            ops.append(Op("encode", "encode", (inputs[i],), (enc,)))
            inputs[i] = enc
        (y,) = op.outputs
        y_enc = _encoded(y, maps[chain], "nchwc")
        ops.append(Op(op.kind, op.name, tuple(inputs), (y_enc,), op.attrs, op.affinity))
        ops.append(Op("encode", "encode", (y_enc,), (y,)))
    return dataclasses.replace(program, ops=ops)
