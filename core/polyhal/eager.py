"""Eager ops: run one op now, through a cached one-op plan.

``polyhal.eager.add(a, b)`` or ``polyhal.run_op("add", a, b)``: the first call for a given op,
attributes, input types and device compiles a plan; later calls reuse it. The cache keeps the
:data:`CACHE_SIZE` plans used most recently and drops the least recently used one beyond that
(each holds its kernels and its arena: unbounded, 3,000 shapes held 49 MB more);
:func:`cache_info` counts hits, misses and evictions.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyhal.hal.tensor import Tensor
from polyhal.ir.program import ProgramBuilder
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, canonical_attrs
from polyhal.plan import Plan, compile
from polyhal.registry import get_device

#: The most one-op plans the cache keeps (least recently used dropped first).
CACHE_SIZE = 256

_cache: OrderedDict[tuple, Plan] = OrderedDict()  # least recently used first
_lock = threading.Lock()
_counts = {"hits": 0, "misses": 0, "evictions": 0}


@dataclass(frozen=True)
class CacheInfo:
    """The eager plan cache: plans held, its bound, and calls that found a plan, compiled one,
    and dropped one to stay within the bound (since the process started)."""

    size: int
    maxsize: int
    hits: int
    misses: int
    evictions: int


def cache_info() -> CacheInfo:
    """How the eager plan cache stands (see :class:`CacheInfo`)."""
    with _lock:
        return CacheInfo(len(_cache), CACHE_SIZE, **_counts)


def run_op(name: str, *inputs: Any, device: Any = None, **attrs: Any) -> Any:
    """Run op ``name`` on ``inputs`` (tensors or arrays); the result is on the inputs' device
    (the first tensor's), or ``device``, or the best-ranked device."""
    if device is None:
        device = next((x.device for x in inputs if isinstance(x, Tensor)), None)
    dev = get_device(device)
    types = tuple(x.type if isinstance(x, Tensor) else TensorType(np.shape(x), np.asarray(x).dtype) for x in inputs)
    key = (name, canonical_attrs(attrs), types, dev.name)
    with _lock:
        plan = _cache.get(key)
        if plan is not None:
            _cache.move_to_end(key)
            _counts["hits"] += 1
    if plan is None:
        b = ProgramBuilder(name)
        args = [b.input(f"x{i}", t.shape, t.dtype) for i, t in enumerate(types)]
        res = b.op(name, *args, **attrs)
        b.output(*(res if isinstance(res, tuple) else (res,)))
        plan = compile(b.build(), dev.name)  # outside the lock: other ops go on meanwhile
        with _lock:
            _counts["misses"] += 1
            _cache[key] = plan
            _cache.move_to_end(key)
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
                _counts["evictions"] += 1
    return plan(*inputs)


def __getattr__(name: str) -> Any:
    if name in OPS:
        return lambda *inputs, **attrs: run_op(name, *inputs, **attrs)
    raise AttributeError(f"module 'polyhal.eager' has no op {name!r}")
