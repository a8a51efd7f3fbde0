"""OpTable: a GPU backend's op set -- the builder of each op, the scratch declarer of the ops
with scratch, and what every ``prepare`` checks before a builder runs.

A *builder* is ``builder(device, op, attrs, in_types, out_types, scratch_binding)`` returning
``fn(*inputs, *outputs)``, or None to leave the instance (a dtype, a layout) to the backend's
fallback. A *declarer* is ``declarer(device, op, attrs, in_types, out_types)`` returning the
instance's scratch requests. ``attrs`` reach both resolved (:func:`polyhal.ops.resolve_attrs`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from polyhal.errors import KernelNotFoundError
from polyhal.ops import OPS, resolve_attrs

Kernel = Callable[..., None]
Builder = Callable[..., "Kernel | None"]
Declarer = Callable[..., Sequence[Any]]


def noop(*arrays: Any) -> None:
    """The kernel of an instance whose outputs are all empty."""


noop.capturable = True  # type: ignore[attr-defined]


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


class OpTable:
    """Builders and scratch declarers of one backend (``backend``: its name in messages);
    ``fallback(device, op, attrs, in_types, out_types)`` runs what no builder takes."""

    def __init__(self, backend: str, fallback: Builder) -> None:
        self.backend = backend
        self.fallback = fallback
        #: op -> builder.
        self.builders: dict[str, Builder] = {}
        #: op -> scratch declarer (ops with scratch: sorting, NMS).
        self.declarers: dict[str, Declarer] = {}

    def register(self, *names: str, scratch: Declarer | None = None) -> Callable[[Builder], Builder]:
        """Decorator: the builder of ``names``; ``scratch``, their scratch declarer (ops with scratch)."""
        def deco(builder: Builder) -> Builder:
            for n in names:
                self.builders[n] = builder
                if scratch is not None:
                    self.declarers[n] = scratch
            return builder
        return deco

    @property
    def host_fallback_ops(self) -> frozenset[str]:
        """Ops of :data:`polyhal.ops.OPS` without a builder: they run through the fallback."""
        return frozenset(OPS) - frozenset(self.builders)

    def scratch(self, device: Any, op: str, attrs: Mapping[str, Any], in_types, out_types) -> tuple:
        """The scratch requests of one op instance (the core's ``Device.scratch``); empty for most ops."""
        declarer = self.declarers.get(op)
        if declarer is None or any(t.size == 0 for t in (*in_types, *out_types)):
            return ()
        return tuple(declarer(device, op, resolve_attrs(op, attrs), tuple(in_types), tuple(out_types)))

    def prepare(self, device: Any, op: str, attrs: Mapping[str, Any], in_types, out_types,
                binding: Any = None) -> Kernel:
        """``fn(*inputs, *outputs)`` computing ``op`` on ``device``: the op's builder, or the
        fallback where there is none or it declines."""
        if op not in OPS:
            raise KernelNotFoundError(f"{self.backend}: unknown op {op!r}")
        encoded = [t for t in (*in_types, *out_types) if t.encoding is not None]
        if encoded:
            raise KernelNotFoundError(f"{self.backend}: no kernel for {op!r} on encoded tensor {encoded[0]}; "
                                      f"{self.backend} kernels take dense row-major tensors (its encodings resolve "
                                      "to identity layouts)")
        in_types, out_types = tuple(in_types), tuple(out_types)
        if all(t.size == 0 for t in out_types):
            return noop
        resolved = resolve_attrs(op, attrs)
        builder = self.builders.get(op)
        if builder is not None:
            fn = builder(device, op, resolved, in_types, out_types, binding)
            if fn is not None:
                return fn
        return self.fallback(device, op, resolved, in_types, out_types)
