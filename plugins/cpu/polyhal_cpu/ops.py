"""The CPU backend's own ops: what only the CPU's kernels make worth creating.

The core op set (:func:`polyhal.ops.core_ops`) is what every backend could serve. These two ops
exist for tricks of this backend's, so they are defined here, on its kernel table, under its
namespace, and only its own fusion pass (:mod:`polyhal_cpu.fusions`) and layouts
(:mod:`polyhal_cpu.encoding`) create them:

* :data:`SCALE_SHIFT_CONV` (``cpu.scale_shift_conv``): a ``fused_conv`` reading its input
  through a ``scale_shift`` (a BatchNormalization and activation before a conv: DenseNet's),
  which the CPU's conv paths apply as they fill their own input (:mod:`polyhal_cpu.conv_kernels`);
* :data:`BLOCKED_CONV` (``cpu.blocked_conv``): a conv on channel-blocked (NHWC) feature maps,
  what the convs of the depthwise chains the CPU keeps channel-blocked lower to; its schema is
  the core's :data:`polyhal.ops.nn.CHANNEL_BLOCKED_CONV`, which CUDA's channels-last convs share.

Each has a numpy reference and a sampler, so the conformance suite checks the CPU's kernels
against them as it checks the core ops'.
"""

from __future__ import annotations

import numpy as np

from polyhal.errors import PolyhalError
from polyhal.ops import OPS
from polyhal.ops.nn import CHANNEL_BLOCKED_CONV, sample_activation

from polyhal_cpu.table import TABLE

__all__ = ["BLOCKED_CONV", "SCALE_SHIFT_CONV"]


def _infer_scale_shift_conv(x, scale, shift, w, b, r=None, *, strides, pads, dilations, group, activation, alpha,
                            beta, pre_activation, pre_alpha, pre_beta):
    try:
        OPS["scale_shift"].infer((x, scale, shift), {"activation": pre_activation, "alpha": pre_alpha,
                                                     "beta": pre_beta})
    except PolyhalError as exc:  # say which part of the op is wrong
        raise type(exc)(f"its prologue (x, scale, shift; pre_activation, pre_alpha, pre_beta): {exc}") from None
    conv = {"strides": strides, "pads": pads, "dilations": dilations, "group": group, "activation": activation,
            "alpha": alpha, "beta": beta}
    return OPS["fused_conv"].infer((x, w, b) if r is None else (x, w, b, r), conv)


def _ref_scale_shift_conv(x, scale, shift, w, b, r=None, *, strides=None, pads=None, dilations=None, group=1,
                          activation="none", alpha=0.0, beta=0.0, pre_activation="none", pre_alpha=0.0, pre_beta=0.0):
    wide = [np.asarray(a, np.float64) for a in (x, scale, shift, w, b) + (() if r is None else (r,))]
    (normalised,) = OPS["scale_shift"].reference(*wide[:3], activation=pre_activation, alpha=pre_alpha,
                                                 beta=pre_beta)  # in float64, as the conv reads it
    (y,) = OPS["fused_conv"].reference(normalised, *wide[3:], strides=strides, pads=pads, dilations=dilations,
                                       group=group, activation=activation, alpha=alpha, beta=beta)
    return (y.astype(x.dtype),)


def _sample_scale_shift_conv(rng: np.random.Generator):
    (x, w, b, *r), attrs = OPS["fused_conv"].sample(rng)
    c = x.shape[1]
    scale, shift = (rng.uniform(0.5, 2.0, c) * rng.choice([-1.0, 1.0], c) for _ in range(2))
    pre = {f"pre_{k}": v for k, v in sample_activation(rng).items()}
    return [x, scale.astype(x.dtype), shift.astype(x.dtype), w, b, *r], {**attrs, **pre}


#: ``cpu.scale_shift_conv``: a conv with a prologue.
SCALE_SHIFT_CONV = TABLE.define(
    "cpu.scale_shift_conv", infer=_infer_scale_shift_conv, reference=_ref_scale_shift_conv,
    sample=_sample_scale_shift_conv, arity=(5, 6), tolerance=(1e-4, 1e-5), contraction=True, doc="""
    ``fused_conv`` with a prologue: fused_conv(scale_shift(x, scale, shift), w, b[, residual]),
    the input normalised per channel as the conv reads it. Operands x (N, C, spatial...), scale
    and shift (C,) of x's type, then w, b and the optional residual as for ``fused_conv``.
    Attributes: the conv's (``strides``, ``pads``, ``dilations``, ``group``), its epilogue's
    (``activation``, ``alpha``, ``beta``) and the prologue's (``pre_activation``, ``pre_alpha``,
    ``pre_beta``: as ``scale_shift``'s ``activation``, ``alpha``, ``beta``). The padding pads the
    normalised map: padded positions read 0, not ``act(shift)``. What a ``scale_shift`` whose
    only reader is a conv becomes on the CPU (DenseNet's norm and ReLU before each 1x1 conv;
    :func:`polyhal_cpu.fusions.fuse_conv_prologue`).
""").name

#: ``cpu.blocked_conv``: a conv on channel-blocked (NHWC) maps.
BLOCKED_CONV = TABLE.define("cpu.blocked_conv", **CHANNEL_BLOCKED_CONV).name
