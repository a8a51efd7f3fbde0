"""The host fallback of a GPU backend: an op without a device kernel runs its numpy reference."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from polyhal.hal.kernels import Kernel
from polyhal.ops import OPS


def host_fallback(op: str, attrs: dict, in_types: Sequence[Any], to_host: Callable[[Any, Any], np.ndarray],
                  to_device: Callable[[np.ndarray, Any], None]) -> Kernel:
    """``fn(*inputs, *outputs)`` running the op's numpy reference on the host: each input comes
    down through ``to_host(array, tensor_type)``, each result (in its output's dtype) goes up
    through ``to_device(result, array)``. Correct and slow; it waits for the host, so a plan that
    has one is never captured into a graph (``capturable = False``)."""
    reference, n = OPS[op].reference, len(in_types)

    def kernel(*arrays: Any) -> None:
        ins = [to_host(a, t) for a, t in zip(arrays[:n], in_types)]
        for o, r in zip(arrays[n:], reference(*ins, **attrs)):
            to_device(np.asarray(r).astype(o.dtype, copy=False), o)

    kernel.capturable = False  # type: ignore[attr-defined]
    kernel.kernel_name = f"host-fallback({op})"  # type: ignore[attr-defined]
    return kernel
