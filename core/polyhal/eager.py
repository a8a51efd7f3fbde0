"""Eager ops: run one op now, through a cached one-op plan.

``polyhal.eager.add(a, b)`` or ``polyhal.run_op("add", a, b)``: the first call for a given op,
attributes, input types and device compiles a plan; later calls reuse it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyhal.hal.tensor import Tensor
from polyhal.ir.program import ProgramBuilder
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, canonical_attrs
from polyhal.plan import Plan, compile
from polyhal.registry import get_device

_cache: dict[tuple, Plan] = {}


def run_op(name: str, *inputs: Any, device: Any = None, **attrs: Any) -> Any:
    """Run op ``name`` on ``inputs`` (tensors or arrays); the result is on the inputs' device
    (the first tensor's), or ``device``, or the best-ranked device."""
    if device is None:
        device = next((x.device for x in inputs if isinstance(x, Tensor)), None)
    dev = get_device(device)
    types = tuple(x.type if isinstance(x, Tensor) else TensorType(np.shape(x), np.asarray(x).dtype) for x in inputs)
    key = (name, canonical_attrs(attrs), types, dev.name)
    plan = _cache.get(key)
    if plan is None:
        b = ProgramBuilder(name)
        args = [b.input(f"x{i}", t.shape, t.dtype) for i, t in enumerate(types)]
        res = b.op(name, *args, **attrs)
        b.output(*(res if isinstance(res, tuple) else (res,)))
        plan = _cache[key] = compile(b.build(), dev.name)
    return plan(*inputs)


def __getattr__(name: str) -> Any:
    if name in OPS:
        return lambda *inputs, **attrs: run_op(name, *inputs, **attrs)
    raise AttributeError(f"module 'polyhal.eager' has no op {name!r}")
