"""softmax and layer_norm: one CUDA C kernel per row where the normalised dims are trailing and
the type is float32 or float64 (``cu/rowwise.cu``, planned by :mod:`polyhal_gpu.rowwise`);
otherwise a few cupy ops (float16 computes in float32 and rounds once)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal_cuda.cuda_source import function
from polyhal_gpu import rowwise

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one


def prepare(device: "Device", op: str, attrs: dict, ins, outs):
    """The kernel for one softmax / layer_norm instance."""
    row_plan = rowwise.plan(op, attrs, ins)
    if row_plan is None:
        return _composed(op, attrs, ins[0])
    fn = function(device, rowwise.SOURCE, rowwise.EXPRESSIONS, row_plan.expression)
    return rowwise.kernel(row_plan, fn, device.launch)


def _composed(op: str, attrs: dict, x) -> Any:
    import cupy as cp

    axis = int(attrs["axis"]) % x.rank
    half = x.dtype == np.float16
    if op == "softmax":
        def softmax(x_, out):
            w = x_.astype(np.float32) if half else x_
            e = cp.exp(w - cp.amax(w, axis=axis, keepdims=True))
            e /= cp.sum(e, axis=axis, keepdims=True)
            cp.copyto(out, e, casting="unsafe")
        return softmax
    axes = tuple(range(axis, x.rank))
    eps = float(attrs["epsilon"])

    def layer_norm(x_, scale, bias, out):
        w = x_.astype(np.float32) if half else x_
        c = w - cp.mean(w, axis=axes, keepdims=True)
        var = cp.mean(c * c, axis=axes, keepdims=True)
        y = c / cp.sqrt(var + eps) * (scale.astype(np.float32) if half else scale) + (
            bias.astype(np.float32) if half else bias)
        cp.copyto(out, y, casting="unsafe")
    return layer_norm
