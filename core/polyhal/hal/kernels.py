"""Kernel tables: a backend's op set, one builder per op, each kernel's scratch declared beside it.

Every backend -- built-in or third party -- keeps its kernels in one :class:`KernelTable` and
hands it to its device (``Device.kernels``); the device's ``prepare``, ``scratch`` and
``kernel_names`` then come from the table::

    TABLE = KernelTable("mydev")

    @TABLE.register("add", "mul")
    def _binary(device, op, attrs, in_types, out_types, scratch):
        ufunc = {"add": np.add, "mul": np.multiply}[op]
        return lambda x, y, out: ufunc(x, y, out=out)

A *builder* is ``builder(device, op, attrs, in_types, out_types, scratch)``. It runs when a plan
is compiled, never in its hot path: it does everything that depends only on the op instance
(parsing attributes, choosing a code path, compiling source) and returns the kernel
``fn(*inputs, *outputs)``, which writes its results into ``outputs`` (the device's native
views). It may return None to decline an instance (a dtype or a layout it has no code for); the
table's ``fallback`` builder then runs it, or, without one, preparing it is a
:class:`~polyhal.errors.KernelNotFoundError`. ``attrs`` arrive resolved
(:func:`polyhal.ops.resolve_attrs`: every attribute present, defaults filled in).

``scratch`` is where the kernel's declared scratch went (a
:class:`~polyhal.hal.scratch.ScratchBinding`; see :mod:`polyhal.hal.scratch`), or None for a
kernel that declared none. A kernel with scratch declares it where it is registered,
``register(..., scratch=...)``: a tuple of :class:`~polyhal.hal.scratch.ScratchDecl` (one launch of
one thread, as on a CPU), or a *declarer* ``declarer(device, op, attrs, in_types, out_types)``
returning the instance's evaluated :class:`~polyhal.hal.scratch.ScratchRequest`\\ s (GPU kernels
whose launch shape depends on the instance). Prepared outside a plan, a kernel with scratch gets
the binding of the table's ``standalone(device, requests)``, or None when the table has none
(then the builder allocates its scratch itself, once, at prepare -- never per call).

A kernel that reads operands through any strides declares it where it is registered too,
``register(..., views=...)``: ``True`` (every operand, any strides and offset: cupy's elementwise
and reduction kernels), a set of operand indices, or a *viewer* ``viewer(op, attrs, in_types,
out_types, index, strides, offset) -> bool`` (a library GEMM takes a transposed matrix through
its op flag, not any strides). The bufferize pass asks it (``Device.accepts_view``) before it
turns a transpose, slice or gather feeding the kernel into a view; undeclared kernels get
row-major operands.

A backend with many kernel modules may declare which module registers which ops instead of
importing them all, ``TABLE.register_lazily("mydev.conv_kernels", ("conv", "max_pool"))``: the
table lists those ops at once (``kernel_names``) and imports the module at the first question
about one of them (``prepare``, ``scratch``, ``accepts_view``), where it registers them the one
way, with ``register``; a process then imports the kernels its programs use (the CPU's first
session imported a dozen modules for a handful of ops). A module that registers fewer ops than
declared, or an op declared for another module, is a PluginError.

What every ``prepare`` checks before a builder runs is written here, once: an op polyhal does
not define, or one the table has no kernel for, is a KernelNotFoundError naming what the backend
offers; encoded (non row-major) operands are refused, since kernels of a table take dense
row-major tensors (the materialize-encoding pass lowers encoded ops to ops on packed dense
tensors first); operands of a storage-only element type (bfloat16, float8, int4, ...:
:data:`polyhal.ir.types.STORAGE_DTYPES`) reach only the ops the table declares with
``storage_types``: ``True`` for every op (the CPU, where numpy and ml_dtypes compute with
them), or a set of op names (the GPU backends convert them: ``cast``, ``identity``, ``bitcast``),
and never the fallback. A table that converts them also moves them: an op of
:data:`MOVES_ELEMENTS` (reshape, gather, pad, where, ...: no arithmetic on the values) runs as its
kernel for the unsigned integers of the same width (:func:`polyhal.ir.types.storage_bits`), which
moves the same bits. An instance whose outputs are all empty gets :func:`noop`.

**A backend's own ops.** The core op set (:func:`polyhal.ops.core_ops`) is what every backend
could serve. An op that exists for one backend's trick -- a fused form only its kernels have, a
conv on a storage only its layouts produce -- is defined by that backend, on its table, under its
own namespace, and created only by its own fusion passes (``register_passes``) or layouts::

    TABLE.define("mydev.add_relu", infer=..., reference=..., sample=..., arity=2, fused=True)

    @TABLE.register("mydev.add_relu")
    def _add_relu(device, op, attrs, in_types, out_types, scratch): ...

as onnxruntime's execution providers keep their fused kernels in a domain of their own
(``com.microsoft.nchwc``). The schema is an ordinary :class:`~polyhal.ops.OpDef` (type inference,
attributes, a reference the conformance suite checks the kernel against, a sampler), in
:data:`polyhal.ops.OPS` once the plugin is imported; no fallback serves it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, Union

import numpy as np

from polyhal.errors import KernelNotFoundError, PluginError
from polyhal.hal.scratch import KernelInfo, Problem, ScratchBinding, ScratchDecl, ScratchRequest
from polyhal.ir.types import STORAGE_DTYPES, TensorType, storage_bits
from polyhal.ops import OPS, resolve_attrs
from polyhal.ops._base import DEFAULT_TOLERANCE, define

__all__ = ["Builder", "Declarer", "Kernel", "KernelTable", "Viewer", "noop"]

#: A prepared kernel: ``fn(*inputs, *outputs)``, writing into the outputs.
Kernel = Callable[..., None]
#: ``builder(device, op, attrs, in_types, out_types, scratch) -> Kernel | None``.
Builder = Callable[..., Union[Kernel, None]]
#: ``declarer(device, op, attrs, in_types, out_types) -> Sequence[ScratchRequest]``.
Declarer = Callable[..., Sequence[ScratchRequest]]
#: ``viewer(op, attrs, in_types, out_types, index, strides, offset) -> bool``: whether a kernel reads
#: operand ``index`` as a view (element ``strides``, element ``offset``).
Viewer = Callable[..., bool]
#: ``standalone(device, requests) -> ScratchBinding``: scratch for a kernel prepared without a plan.
Standalone = Callable[[Any, tuple[ScratchRequest, ...]], ScratchBinding]


def noop(*arrays: Any) -> None:
    """The kernel of an instance whose outputs are all empty: there is nothing to write."""


noop.capturable = True  # type: ignore[attr-defined]  (a graph may capture it: it does nothing)


#: ``op name -> module`` that defined each backend's own op (:meth:`KernelTable.define`), for
#: messages and so that a re-imported plugin module may define its ops again.
_DEFINED_IN: dict[str, str] = {}


#: Ops that only move elements, never compute with their values: a table that converts the
#: storage-only types runs these on the types' bits (see the module docstring). Scatters qualify
#: without a reduction; pad's constant value is encoded to the type's bits.
MOVES_ELEMENTS = frozenset({"concat", "expand", "gather", "gather_elements", "gather_nd", "identity", "pad",
                            "reshape", "scatter_elements", "scatter_nd", "slice", "transpose", "where"})


def _as_bits(op: str, attrs: Mapping[str, Any], in_types: tuple, out_types: tuple) -> tuple | None:
    """``(attrs, in_types, out_types)`` of ``op`` on the storage types' bits, or None when the
    op computes with the values (it is not a pure move)."""
    if op not in MOVES_ELEMENTS or attrs.get("reduction", "none") != "none":
        return None
    attrs = dict(attrs)
    if op == "pad":
        stored = next(t.dtype for t in in_types if t.dtype in STORAGE_DTYPES)
        value = np.array(attrs.get("value", 0.0), np.float32).astype(stored)
        attrs["value"] = int(value.view(storage_bits(stored)))  # the constant's bits
    bits = lambda t: TensorType(t.shape, storage_bits(t.dtype)) if t.dtype in STORAGE_DTYPES else t  # noqa: E731
    return attrs, tuple(map(bits, in_types)), tuple(map(bits, out_types))


def _viewer(views: bool | Iterable[int] | Viewer) -> Viewer | None:
    """The viewer of a registration's ``views`` (None: no strided operand)."""
    if views is False:
        return None
    if views is True:
        return lambda *args: True
    if callable(views):
        return views
    indices = frozenset(int(i) for i in views)
    return lambda op, attrs, ins, outs, index, strides, offset: index in indices


class KernelTable:
    """One backend's kernels: op -> builder, op -> scratch declaration.

    ``backend`` names the backend in messages. ``fallback``, a builder, runs every op without a
    builder, and every instance a builder declined; a table with a fallback serves every op of
    :data:`polyhal.ops.OPS` but the fused forms (``OpDef.fused``), which it serves only with a
    builder of their own. ``standalone`` binds the scratch of kernels prepared without a plan
    (see the module docstring). ``storage_types``: the ops whose kernels take the storage-only
    element types, ``True`` for all of them (see the module docstring).
    """

    def __init__(self, backend: str, *, fallback: Builder | None = None,
                 standalone: Standalone | None = None, storage_types: bool | Iterable[str] = False) -> None:
        self.backend = backend
        #: The ops whose kernels take the storage-only element types; None: every op.
        self.storage_ops: frozenset[str] | None = (
            None if storage_types is True else frozenset(() if storage_types is False else storage_types))
        self.fallback = fallback
        self.standalone = standalone
        #: op -> builder.
        self.builders: dict[str, Builder] = {}
        #: op -> its kernel's scratch: ScratchDecls, or a declarer (ops with scratch only).
        self.declarations: dict[str, tuple[ScratchDecl, ...] | Declarer] = {}
        #: op -> which strided operands its kernel reads (ops declared with ``views`` only).
        self.viewers: dict[str, Viewer] = {}
        #: op -> the module that registers its kernel, not imported yet (:meth:`register_lazily`).
        self.lazy: dict[str, str] = {}
        #: op -> the module that registered its kernel.
        self._registered_in: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"<KernelTable {self.backend}: {len(self.builders) + len(self.lazy)} ops>"

    def register_lazily(self, module: str, names: Iterable[str]) -> None:
        """Declare that importing ``module`` registers (with :meth:`register`, the one way) the
        kernels of the ops ``names``: the table lists them from now on and imports the module at
        the first question about one of them (its kernel, scratch or views), so that a process
        pays only for the kernel modules its programs use. A module that then registers one of
        them from elsewhere, or leaves one out, is a PluginError naming both."""
        for n in names:
            if n not in OPS:
                raise PluginError(f"{self.backend}: {module} cannot declare a kernel for {n!r}: no such op is defined")
            if self._registered_in.get(n) == module:
                continue  # the module was imported first (by name)
            if n in self.builders or n in self.lazy:
                where = self.lazy.get(n) or _name(self.builders[n])
                raise PluginError(f"{self.backend}: op {n!r} has two kernels, {where} and {module}'s; register one")
            self.lazy[n] = module

    def _import_lazy(self, op: str) -> None:
        """Import the module that registers ``op``'s kernel, where it was declared lazily."""
        module = self.lazy.get(op)
        if module is None:
            return
        import importlib

        importlib.import_module(module)
        missing = sorted(n for n, m in self.lazy.items() if m == module)
        if missing:
            raise PluginError(f"{self.backend}: {module} was declared to register the kernels of {missing} "
                              "(register_lazily) but did not")

    def register(self, *names: str, scratch: Sequence[ScratchDecl] | Declarer | None = None,
                 views: bool | Iterable[int] | Viewer = False) -> Callable[[Builder], Builder]:
        """Decorator: the builder of the ops ``names``; ``scratch``, the scratch its kernels
        need (ScratchDecls, or a declarer); ``views``, the strided operands they read (see the
        module docstring). An op registered twice, or one that :data:`polyhal.ops.OPS` does not
        define, is a PluginError."""
        decls = scratch if scratch is None or callable(scratch) else tuple(scratch)
        viewer = _viewer(views)

        def deco(builder: Builder) -> Builder:
            module = sys._getframe(1).f_globals.get("__name__", "?")  # the registering module
            for n in names:
                declared = self.lazy.get(n)
                if declared is not None and declared != module:
                    raise PluginError(f"{self.backend}: op {n!r} was declared to be registered by {declared} "
                                      f"(register_lazily), not by {module}")
                if n not in OPS:
                    raise PluginError(f"{self.backend}: cannot register a kernel for {n!r}: no such op is defined "
                                      f"(a backend's own op is defined first: TABLE.define('{self.backend}.<name>', "
                                      "...))")
                if OPS[n].backend not in (None, self.backend):
                    raise PluginError(f"{self.backend}: cannot register a kernel for {n!r}: it is {_owner(n)}'s own "
                                      f"op; a table serves core ops and its own ({self.backend}.*)")
                if n in self.builders:
                    raise PluginError(f"{self.backend}: op {n!r} has two kernels, "
                                      f"{_name(self.builders[n])} and {_name(builder)}; register one")
                self.builders[n] = builder
                self._registered_in[n] = module
                self.lazy.pop(n, None)
                if decls:
                    self.declarations[n] = decls
                if viewer is not None:
                    self.viewers[n] = viewer
            return builder
        return deco

    def define(self, name: str, *, infer: Callable[..., Any], reference: Callable[..., Any],
               sample: Callable[..., Any], arity: int | tuple[int, int | None],
               tolerance: tuple[float, float] = DEFAULT_TOLERANCE, doc: str = "", fused: bool = True,
               contraction: bool = False) -> Any:
        """Define an op of this backend's own (see the module docstring): ``name`` is
        ``"<backend>.<op>"``; the other arguments are :func:`polyhal.ops._base.define`'s (``fused``
        defaults to True: such ops are what this backend's passes and layouts create). Returns
        the :class:`~polyhal.ops.OpDef`.

        A PluginError naming both definitions refuses a name outside this backend's namespace,
        one whose ``<op>`` is a core op's name (serve the core op instead: register a kernel for
        it), and one already defined by another module (another backend's op, or a second plugin
        with this backend's name); the module that defined it may define it again (a re-imported
        plugin)."""
        module = sys._getframe(1).f_globals.get("__name__", "?")  # the plugin module defining it, for messages
        me = f"{self.backend} ({module}): cannot define op {name!r}"
        prefix = f"{self.backend}."
        existing = OPS.get(name)
        if not isinstance(name, str) or not name.startswith(prefix) or not name[len(prefix):].isidentifier():
            taken = f"; {name!r} is {_owner(name)}'s" if existing is not None else ""
            raise PluginError(f"{me}: a backend's own op is named '{prefix}<name>'{taken}")
        short = name[len(prefix):]
        if short in OPS and OPS[short].backend is None:
            raise PluginError(f"{me}: it would shadow {_owner(short)}'s op {short!r}; register a kernel for {short!r} "
                              "to serve it, or give your op a name of its own")
        if existing is not None:
            if _DEFINED_IN.get(name) != module:
                raise PluginError(f"{me}: it is already {_owner(name)}'s; two plugins share the backend name "
                                  f"{self.backend!r}: rename one backend (its KernelTable and devices)")
            del OPS[name]  # the same module, imported again: its definition replaces the old one
        opdef = define(name, infer=infer, reference=reference, sample=sample, arity=arity, tolerance=tolerance,
                       doc=doc, fused=fused, contraction=contraction, backend=self.backend)
        _DEFINED_IN[name] = module
        return opdef

    def accepts_view(self, op: str, attrs: Mapping[str, Any], in_types: Sequence["TensorType"],
                     out_types: Sequence["TensorType"], index: int, strides: tuple[int, ...], offset: int) -> bool:
        """Whether the kernel of ``op`` reads operand ``index`` as a view (the core's
        ``Device.accepts_view``): what its registration declared, False for undeclared kernels."""
        self._import_lazy(op)
        viewer = self.viewers.get(op)
        if viewer is None:
            return False
        return bool(viewer(op, resolve_attrs(op, attrs), tuple(in_types), tuple(out_types), index, tuple(strides),
                           offset))

    def holds_storage(self, op: str) -> bool:
        """Whether this table's kernel of ``op`` takes operands of the storage-only element types."""
        return self.storage_ops is None or op in self.storage_ops

    @property
    def kernel_names(self) -> frozenset[str]:
        """The ops this table prepares: the registered ones, and with a fallback every other op
        of the core set but the fused forms."""
        own = frozenset(self.builders) | frozenset(self.lazy)
        return own | self.fallback_ops if self.fallback is not None else own

    @property
    def fallback_ops(self) -> frozenset[str]:
        """Core ops without a builder that a fallback would run (fused forms excepted; a
        backend's own ops never: their kernels are the point)."""
        return (frozenset(n for n, d in OPS.items() if not d.fused and d.backend is None) - frozenset(self.builders)
                - frozenset(self.lazy))

    def scratch(self, device: Any, op: str, attrs: Mapping[str, Any], in_types: Sequence["TensorType"],
                out_types: Sequence["TensorType"]) -> tuple[ScratchRequest, ...]:
        """The evaluated scratch requests of one op instance (the core's ``Device.scratch``);
        empty for ops without scratch and for instances with nothing to write."""
        self._import_lazy(op)
        decls = self.declarations.get(op)
        if decls is None or all(t.size == 0 for t in out_types):
            return ()
        attrs, in_types, out_types = resolve_attrs(op, attrs), tuple(in_types), tuple(out_types)
        if callable(decls):
            return tuple(decls(device, op, attrs, in_types, out_types))
        problem = Problem(op, attrs, in_types, out_types)
        kernel = KernelInfo(f"{self.backend}_{op}", op, 1, 1, self.backend)
        return tuple(d.request(problem, kernel) for d in decls)

    def prepare(self, device: Any, op: str, attrs: Mapping[str, Any], in_types: Sequence["TensorType"],
                out_types: Sequence["TensorType"], scratch: ScratchBinding | None = None) -> Kernel:
        """``fn(*inputs, *outputs)`` computing ``op`` on ``device`` (the core's ``Device.prepare``):
        the checks of the module docstring, then the op's builder, or the fallback where there is
        none or it declines. ``scratch`` is the plan's binding of the kernel's declared scratch."""
        self._import_lazy(op)
        builder = self.builders.get(op)
        if builder is None and (self.fallback is None or op not in OPS or OPS[op].fused or OPS[op].backend):
            unknown = " (polyhal.ops defines no such op)" if op not in OPS else ""
            raise KernelNotFoundError(f"{self.backend}: no kernel for op {op!r}{unknown}; this backend has kernels "
                                      f"for {', '.join(sorted(self.kernel_names)) or 'no op'}")
        in_types, out_types = tuple(in_types), tuple(out_types)
        encoded = next((t for t in (*in_types, *out_types) if t.encoding is not None), None)
        if encoded is not None:
            raise KernelNotFoundError(f"{self.backend}: no kernel for {op!r} on encoded tensor {encoded}; "
                                      f"{self.backend} kernels take dense row-major tensors (its encodings "
                                      "must resolve to identity layouts)")
        stored = next((t for t in (*in_types, *out_types) if t.dtype in STORAGE_DTYPES), None)
        if stored is not None and not self.holds_storage(op) and self.storage_ops:
            moved = _as_bits(op, attrs, in_types, out_types)
            if moved is not None:
                return self.prepare(device, op, moved[0], moved[1], moved[2], scratch)
        if stored is not None and not self.holds_storage(op):
            if self.storage_ops:
                where = (f"{self.backend} only converts those ({', '.join(sorted(self.storage_ops))}) and moves them "
                         f"({', '.join(sorted(MOVES_ELEMENTS))}): cast to float32 first, or run {op!r} on a device "
                         "that computes on them (cpu:0)")
            else:
                where = f"{self.backend} does not hold those: run the op on a device that holds them (cpu:0), " \
                        "or cast to float32 there first"
            raise KernelNotFoundError(f"{self.backend}: no kernel for {op!r} on {stored.dtype.name} ({stored}), a "
                                      f"storage-only element type; {where}")
        if all(t.size == 0 for t in out_types):
            return noop  # nothing to write (and numpy refuses some reductions of nothing)
        resolved = resolve_attrs(op, attrs)
        if builder is not None:
            if not scratch and self.standalone is not None and op in self.declarations:
                requests = self.scratch(device, op, resolved, in_types, out_types)
                scratch = self.standalone(device, requests) if requests else None
            fn = builder(device, op, resolved, in_types, out_types, scratch or None)
            if fn is not None:
                return fn
        if self.fallback is None or stored is not None:  # a fallback would compute on the types' raw bits
            raise KernelNotFoundError(f"{self.backend}: the kernel of {op!r} has no code for "
                                      f"{', '.join(map(str, in_types))} -> {', '.join(map(str, out_types))}")
        return self.fallback(device, op, resolved, in_types, out_types, scratch or None)


def _owner(op: str) -> str:
    """Who defined ``op``, for messages: ``the core (polyhal.ops.nn)``, ``backend 'cpu' (polyhal_cpu.ops)``."""
    opdef = OPS[op]
    where = _DEFINED_IN.get(op) or getattr(opdef.reference, "__module__", "?")
    return f"{'the core' if opdef.backend is None else f'backend {opdef.backend!r}'} ({where})"


def _name(f: Any) -> str:
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
