"""softmax and layer_norm through ``cu/rowwise.cu``: one block per row.

The kernel applies where the normalised dims are trailing, the type is float32 or float64 and the
shapes are what the kernel indexes (layer norm's scale and bias of exactly the normalised shape);
:func:`plan` says so, or returns None and the backend computes the op another way (polyhal-cuda:
a few cupy ops; polyhal-hip: the host reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

#: The CUDA C source, under ``polyhal_gpu/cu/``.
SOURCE = "rowwise.cu"
#: Every template instance of the source (one module holds them all).
EXPRESSIONS: tuple[str, ...] = tuple(f"{k}<{t}>" for k in ("softmax_rows", "layer_norm_rows") for t in ("float", "double"))
_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
#: Most blocks of one launch (rows beyond it are strided over).
MAX_BLOCKS = 65535 * 8


def block_size(cols: int) -> int:
    """Threads per row: the next power of two of ``cols``, between 32 and 1024."""
    return max(32, min(1024, 1 << max(cols - 1, 1).bit_length()))


@dataclass(frozen=True)
class RowPlan:
    """One softmax / layer_norm instance on the row kernel."""

    op: str
    expression: str      # the template instance, e.g. "softmax_rows<float>"
    rows: int
    cols: int
    epsilon: Any = None  # layer_norm: epsilon in the operand's type

    @property
    def grid(self) -> tuple[int]:
        return (min(self.rows, MAX_BLOCKS),)

    @property
    def block(self) -> tuple[int]:
        return (block_size(self.cols),)


def plan(op: str, attrs: dict, ins: Sequence[Any]) -> RowPlan | None:
    """The row kernel's plan of one instance (``attrs`` resolved), or None where it does not apply."""
    x = ins[0]
    ctype = _CTYPE.get(np.dtype(x.dtype))
    if ctype is None or x.size == 0:
        return None
    axis = int(attrs["axis"]) % x.rank
    if op == "softmax":
        if axis != x.rank - 1:
            return None
        rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
        epsilon = None
    else:
        if ins[1].shape != x.shape[axis:] or ins[2].shape != x.shape[axis:]:
            return None  # broadcast scale / bias: the kernel indexes them by column
        rows, cols = math.prod(x.shape[:axis]), math.prod(x.shape[axis:])
        epsilon = np.dtype(x.dtype).type(float(attrs["epsilon"]))
    if cols >= 2**31:
        return None
    name = "softmax_rows" if op == "softmax" else "layer_norm_rows"
    return RowPlan(op, f"{name}<{ctype}>", rows, cols, epsilon)


def kernel(row_plan: RowPlan, function: Any, launch: Callable[..., None]) -> Callable[..., None]:
    """``fn(x, out)`` (softmax) or ``fn(x, scale, bias, out)`` (layer_norm): ``function`` (the
    backend's loaded ``row_plan.expression``) launched through ``launch`` (the device's)."""
    name, grid, block = row_plan.expression, row_plan.grid, row_plan.block
    r, c = np.int64(row_plan.rows), np.int32(row_plan.cols)
    if row_plan.op == "softmax":
        def softmax(x, out):
            launch(function, name, grid, block, (x, out, r, c))
        softmax.kernel_name = name  # type: ignore[attr-defined]
        return softmax
    eps = row_plan.epsilon

    def layer_norm(x, scale, bias, out):
        launch(function, name, grid, block, (x, scale, bias, out, r, c, eps))
    layer_norm.kernel_name = name  # type: ignore[attr-defined]
    return layer_norm
