"""The CPU backend's own fusion: a conv's prologue (``cpu.scale_shift_conv``).

A ``scale_shift`` (a per-channel scale, shift and activation: a BatchNormalization and ReLU that
no conv before them took) whose only reader is a 2-D conv becomes that conv's prologue, one
``cpu.scale_shift_conv`` (:func:`fuse_conv_prologue`): the CPU's conv paths normalise the input
as they fill their own slabs of it, instead of writing the normalised map and reading it again
(DenseNet's norm and ReLU before each 1x1 conv; :mod:`polyhal_cpu.conv_kernels`).

The core's fusions are what every backend could use; this one is worth it only with the CPU's
kernels, so the CPU claims it (as an onnxruntime execution provider claims the nodes it fuses):
:data:`PROLOGUE_PASS` goes into every compile's pipeline through ``register_passes``, right after
the core's ``pool-before-pointwise-conv`` (a transition's norm then feeds the average pool moved
before its conv and stays a ``scale_shift`` of its own), and asks ``target.fusible`` before each
rewrite, so that a fused op lands only where placement would put the two ops and the device is a
CPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from polyhal import Fusion, PassRegistration, fusion_pass
from polyhal.ir.program import Op, Program, Value, consumers_of, uses_and_producers
from polyhal.ir.types import TensorType
from polyhal.ops import canonical_attrs

from polyhal_cpu import onednn
from polyhal_cpu.ops import SCALE_SHIFT_CONV

__all__ = ["PROLOGUE_PASS", "fuse_conv_prologue", "registrations"]


def _prologue_conv(op: Op, uses, readers_of: dict[int, list[Op]]) -> Op | None:
    """The conv that ``op``, a float 2-D ``scale_shift``, is the prologue of: the one reader of
    its result, a same-affinity ``conv`` or ``fused_conv`` reading it as its input; else None."""
    if op.kind != "dispatch" or op.name != "scale_shift" or op.inputs[0].type.rank != 4 \
            or op.inputs[0].type.dtype.kind != "f":
        return None
    y = op.outputs[0]
    readers = readers_of.get(y.id, ())
    if uses[y.id] != 1 or len(readers) != 1:
        return None
    conv = readers[0]
    ok = conv.kind == "dispatch" and conv.name in ("conv", "fused_conv") and conv.affinity == op.affinity \
        and conv.inputs[0] is y
    return conv if ok else None


def fuse_conv_prologue(program: Program, fusible) -> tuple[Program, list[Fusion]]:
    """Each ``scale_shift`` whose only reader is a 2-D conv taken into it, one cpu.scale_shift_conv.

    ``program`` with each ``scale_shift`` whose only reader is a 2-D conv (or fused conv) taken
    into it as its prologue, where ``fusible(SCALE_SHIFT_CONV, (scale_shift, conv))`` allows, and
    what changed (see the module docstring). Not where oneDNN runs the convs
    (:mod:`polyhal_cpu.onednn_kernels`): its primitives have no prologue, so the conv stays a
    oneDNN conv and the ``scale_shift`` one pass of its own."""
    if not any(op.kind == "dispatch" and op.name == "scale_shift" for op in program.ops):
        return program, []  # nothing to take: oneDNN is not loaded to say so
    if onednn.usable():
        return program, []
    uses, _ = uses_and_producers(program)
    readers_of = consumers_of(program)
    fused: dict[int, tuple[Op, Op]] = {}  # id(conv) -> (scale_shift, conv)
    for op in program.ops:
        conv = _prologue_conv(op, uses, readers_of)
        if conv is not None and fusible(SCALE_SHIFT_CONV, (op, conv)):
            fused[id(conv)] = (op, conv)
    if not fused:
        return program, []
    dropped = {id(ss) for ss, _ in fused.values()}
    constants = list(program.constants)
    ops, changes = [], []
    for op in program.ops:
        if id(op) in dropped:
            continue
        if id(op) in fused:
            ss, conv = fused[id(op)]
            w = conv.inputs[1]
            b = conv.inputs[2] if len(conv.inputs) >= 3 else _zero_bias(w, constants)
            pre = ss.attr_dict
            attrs = {"activation": "none", "alpha": 0.0, "beta": 0.0, **conv.attr_dict,
                     "pre_activation": pre["activation"], "pre_alpha": float(pre["alpha"]),
                     "pre_beta": float(pre["beta"])}
            ins = (*ss.inputs, w, b, *conv.inputs[3:])
            op = Op("dispatch", SCALE_SHIFT_CONV, ins, conv.outputs, canonical_attrs(attrs), conv.affinity)
            changes.append(Fusion("prologue", (ss, conv), (op,)))
        ops.append(op)
    return dataclasses.replace(program, ops=ops, constants=constants), changes


def _zero_bias(w: Value, constants: list) -> Value:
    """A new read-only program constant of zeros, the bias of a conv with weights ``w`` that has none."""
    zeros = np.zeros(w.type.shape[0], w.type.dtype)
    zeros.flags.writeable = False
    bias = Value(TensorType(zeros.shape, zeros.dtype), f"{w.name}_zero_bias", w.program_id)
    constants.append((bias, zeros))
    return bias


#: The CPU's claim: the prologue fusion, creating only cpu.scale_shift_conv.
PROLOGUE_PASS = fusion_pass("cpu-fuse-conv-prologue", fuse_conv_prologue, creates=(SCALE_SHIFT_CONV,),
                            requires=("scale-shifts-fused", "pools-first"), provides="cpu-conv-prologues-fused")


def registrations() -> list[PassRegistration]:
    """What the CPU plugin's ``register_passes`` returns."""
    return [PassRegistration(PROLOGUE_PASS, after="pool-before-pointwise-conv")]
