"""Channels-last (NHWC) feature maps on CUDA: the backend's encoding resolver.

The data-tiling pass (:func:`polyhal.passes.data_tiling.set_conv_encodings`) marks the feature
maps of conv chains with :class:`~polyhal.ir.encoding.FeatureMapEncoding` (and, in chains of
ordinary convs, the filters). Here a CUDA device with cuDNN resolves them to
:class:`ChannelsLastLayout`: a map (N, C, H, W) is stored (N, 1, H, W, C) -- NHWC bytes -- and a
filter (M, C/g, kh, kw) as (M, 1, kh, kw, C/g) -- cuDNN's KRSC --, converted once when the plan
is compiled. Convs between such maps lower to ``cuda.blocked_conv`` (cuDNN graphs over NHWC strides,
:mod:`polyhal_cuda.cudnn`; depthwise convs by the backend's own kernel, reading NHWC), the
elementwise ops and global average pools of the chain run on the storage as they are, and the
encodes between the chain's links fold; only its edges (and ops that want NCHW, e.g. a pool or
a Flatten) pay a relayout, which ``plan.explain()`` lists.

Where NHWC pays is measured, not assumed: ``POLYHAL_CUDA_LAYOUT`` is ``auto`` (default: the rule
of :func:`choose`, from the measurements in :data:`MEASURED`: float32 stays NCHW, since without
TF32 cuDNN's NHWC engines are slower; float16 chains of ordinary convs go NHWC), ``nhwc`` (every chain) or ``nchw`` (none; every encode folds). Without cuDNN
maps stay NCHW (the im2col conv reads NCHW only). Explain shows the choice and its reason on
each resolution line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import polyhal
from polyhal.ir.encoding import ChannelBlockedLayout, FeatureMapEncoding, IdentityLayout
from polyhal_cuda.cudnn import BLOCKED_CONV
from polyhal_cuda.settings import LAYOUTS, CUDASettings

#: Why ``auto`` keeps float32 NCHW (one H200, cuDNN 9.19, fp32 without TF32, polyhal's plans
#: side by side): the fp32-exact NHWC engines (no tensor cores) ran ResNet-50 b16 in 42.2 ms
#: against 6.0 NCHW, b1 4.9 against 2.0; MobileNetV3-large b1/b16 2.2/4.9 against 0.93/1.8;
#: EfficientNet-B0 4.7/16.5 against 1.4/4.3; ConvNeXt-T 1.36/8.7 against 1.14/6.5.
MEASURED = "cuDNN's fp32-exact NHWC engines measured 1.2-7x slower than NCHW on an H200"
#: float16 chains ``auto`` keeps channels-last (tensor-core engines; same H200, precision="fp16"):
#: ResNet-50's dense chains ran b1/b16 in 0.55/1.65 ms against 1.09/3.11 NCHW; EfficientNet-B0's
#: depthwise chains 0.91/3.69 against 1.08/3.14 (34 relayouts: not faster at b16), so they stay NCHW.
#: Checked again on an H200 with the rule in place (NHWC against NCHW, ms, b1/b16): ResNet-50
#: 0.56/1.54 against 1.02/3.09; EfficientNet-B0 0.85/3.74 against 0.91/3.23; MobileNetV3-large
#: 0.67/2.16 against 0.63/1.74 (the NCHW b16 figures of the last two from before the fix to
#: float16 one-pixel convs, :mod:`polyhal_cuda.cudnn`).
NHWC_FP16_CHAINS = ("dense",)
#: ``POLYHAL_CUDA_LAYOUT`` values.
CHOICES = LAYOUTS


def layout_choice() -> str:
    """``POLYHAL_CUDA_LAYOUT``: ``auto`` (default), ``nhwc`` or ``nchw``."""
    return CUDASettings.from_env().layout


def choose(device, encoding: FeatureMapEncoding, tensor_type) -> tuple[bool, str]:
    """``(channels-last?, why)`` for one encoded map or filter on a CUDA device."""
    choice = layout_choice()
    if "cudnn" not in device.capabilities:
        return False, "NCHW: without cuDNN convs run as im2col over NCHW"
    if choice != "auto":
        return choice == "nhwc", f"POLYHAL_CUDA_LAYOUT={choice}"
    if tensor_type.dtype == np.dtype(np.float16) and encoding.chain in NHWC_FP16_CHAINS:
        return True, "NHWC: cuDNN's float16 NHWC (tensor-core) engines measured ~2x faster"
    return False, (f"NCHW: {MEASURED}; POLYHAL_CUDA_LAYOUT=nhwc forces channels-last"
                   if tensor_type.dtype == np.dtype(np.float32) else
                   f"NCHW: channels-last was not measured faster for {tensor_type.dtype}")


@dataclass(frozen=True)
class ChannelsLastLayout(ChannelBlockedLayout):
    """NHWC on CUDA: a :class:`~polyhal.ir.encoding.ChannelBlockedLayout` with one block of all
    channels (storage (N, 1, H, W, C)); a conv's filter may be channels-last too (cuDNN's
    KRSC). ``why`` is the resolver's reason (explain); it takes no part in comparisons."""

    why: str = ""

    def materialize_dispatch(self, op, attrs, in_layouts, out_layouts):
        if op in ("conv", "fused_conv") and len(out_layouts) == 1:
            def last(x) -> bool:
                return isinstance(x, ChannelBlockedLayout) and x.one_block

            w = in_layouts[1]
            if all(last(x) for x in (in_layouts[0], out_layouts[0], *in_layouts[3:])) \
                    and (w.is_identity_layout() or last(w)) and all(x.is_identity_layout() for x in in_layouts[2:3]):
                return self.conv_on_storage(attrs)
            return None
        return super().materialize_dispatch(op, attrs, in_layouts, out_layouts)

    def describe(self) -> str:
        t = self.tensor_type
        if t.rank != 4:
            return super().describe()
        form = "NHWC" if self.one_block else f"NCHW{self.inner_tiles[0]}c"
        why = f" ({self.why})" if self.why else ""
        return f"cuda {form} -> {'x'.join(map(str, self.storage_type.shape))}{why}"


@dataclass(frozen=True)
class KeptLayout(IdentityLayout):
    """NCHW kept for an encoded map on CUDA, with the reason (explain)."""

    why: str = ""

    def describe(self) -> str:
        return f"identity ({self.why})" if self.why else "identity"


@polyhal.hookimpl
def resolve_encoding(device, encoding, tensor_type):
    """Channels-last for conv feature maps and filters on CUDA devices where :func:`choose`
    says so, NCHW (with the reason) where not; ``None`` for other devices and encodings."""
    if device.backend != "cuda" or not isinstance(encoding, FeatureMapEncoding):
        return None
    last, why = choose(device, encoding, tensor_type)
    if not last:
        return KeptLayout(tensor_type, why)
    return ChannelsLastLayout(tensor_type, (1,), (tensor_type.shape[1],), resolver="", conv_op=BLOCKED_CONV, why=why)
