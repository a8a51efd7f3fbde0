"""softmax and layer_norm: one CUDA C kernel per row where the normalised dims are trailing and
the type is float32 or float64 (``cu/rowwise.cu``); otherwise a few cupy ops (float16 computes
in float32 and rounds once)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal_cuda.cuda_source import function

if TYPE_CHECKING:
    from polyhal_cuda.device import CUDADevice

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_EXPRS = [f"{k}<{t}>" for k in ("softmax_rows", "layer_norm_rows") for t in ("float", "double")]


def _block(cols: int) -> int:
    return max(32, min(1024, 1 << max(cols - 1, 1).bit_length()))


def prepare(device: "CUDADevice", op: str, attrs: dict, ins, outs):
    """The kernel for one softmax / layer_norm instance."""
    import cupy as cp

    x = ins[0]
    axis = int(attrs["axis"]) % x.rank
    ctype = _CTYPE.get(x.dtype)
    rows = math.prod(x.shape[:axis]) if op == "layer_norm" else math.prod(x.shape) // max(x.shape[axis], 1)
    cols = math.prod(x.shape[axis:]) if op == "layer_norm" else x.shape[axis]
    last = op == "layer_norm" or axis == x.rank - 1
    if ctype is not None and last and rows and cols and cols < 2**31:
        name = f"{'softmax_rows' if op == 'softmax' else 'layer_norm_rows'}<{ctype}>"
        fn = function(device, "rowwise.cu", _EXPRS, name)
        block = (_block(cols),)
        grid = (min(rows, 65535 * 8),)
        r, c = np.int64(rows), np.int32(cols)
        launch = device.launch
        if op == "softmax":
            def softmax(x_, out):
                launch(fn, name, grid, block, (x_, out, r, c))
            softmax.kernel_name = name  # type: ignore[attr-defined]
            return softmax
        eps = x.dtype.type(float(attrs["epsilon"]))

        def layer_norm(x_, scale, bias, out):
            launch(fn, name, grid, block, (x_, scale, bias, out, r, c, eps))
        layer_norm.kernel_name = name  # type: ignore[attr-defined]
        return layer_norm
    return _composed(op, attrs, x)


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
