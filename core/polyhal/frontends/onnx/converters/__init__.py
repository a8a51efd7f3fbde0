"""Converters: one function per ONNX op, from a node to polyhal ops.

A converter takes a :class:`NodeContext` and returns the node's outputs (a list, one entry per
output it produces; ``None`` for an optional output it does not). It emits polyhal ops with
``ctx.op(name, *inputs, **attrs)``: when every input is known at import time the op is folded
(run by its numpy reference) and the result is an array, otherwise it becomes a dispatch of the
program. Operands that decide shapes are read with ``ctx.const(i)``.

Ops without a converter, and nodes a converter declines (by raising :class:`Decline`, e.g. an
optional output it cannot produce), are expanded through the function body ONNX defines for
the op, when there is one; otherwise the op is unsupported.

Registering::

    @converter("Relu")
    def relu(ctx):
        return [ctx.op("relu", ctx.input(0))]
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Mapping

import numpy as np
import onnx
from onnx import helper

from polyhal.frontends.onnx.errors import NeedsStaging, NeedsValue, OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.types import HostValue, is_strings
from polyhal.ir.program import Value
from polyhal.ir.types import TensorType

Converter = Callable[["NodeContext"], list]

#: (domain, op type) -> converter.
CONVERTERS: dict[tuple[str, str], Converter] = {}
#: (domain, op type) -> the converter of the op's string forms (Equal of strings, Cast to
#: string, ...), tried before the one in CONVERTERS; it raises Decline for a numeric node.
STRING_CONVERTERS: dict[tuple[str, str], Converter] = {}

_REQUIRED: Any = object()


class Decline(Exception):
    """Raised by a converter that cannot handle this node; the op's ONNX function body is
    expanded instead (or the op is reported unsupported, with this message, if it has none)."""


def converter(*op_types: str, domain: str = "", strings: bool = False) -> Callable[[Converter], Converter]:
    """Register the decorated function as the converter of ``op_types`` in ``domain``;
    ``strings=True``: of their string forms only (tried first; Decline hands a node that
    touches no strings to the op's ordinary converter)."""
    def register(fn: Converter) -> Converter:
        for op_type in op_types:
            (STRING_CONVERTERS if strings else CONVERTERS)[(domain, op_type)] = fn
        return fn
    return register


class NodeContext:
    """What a converter sees of one node: its inputs, attributes and opset, and ways to emit ops."""

    def __init__(self, importer, node: onnx.NodeProto, env: Mapping[str, Any], opsets: Mapping[str, int],
                 label: str) -> None:
        self.importer = importer
        self.node = node
        self.env = env
        self.opsets = opsets
        self.label = label
        self.op_type = node.op_type
        self.domain = "" if node.domain in ("", "ai.onnx") else node.domain
        #: The version of the node's domain the model (or function body) imports.
        self.opset = opsets.get(self.domain, importer.opset if self.domain == "" else 1)
        self._attrs = {a.name: a for a in node.attribute}

    # -- inputs ----------------------------------------------------------------------------

    @property
    def num_inputs(self) -> int:
        """Inputs given, counting trailing empty names (omitted optional inputs) as given."""
        return len(self.node.input)

    def has(self, i: int) -> bool:
        """Whether optional input ``i`` is given."""
        return i < len(self.node.input) and bool(self.node.input[i])

    def input(self, i: int) -> Any:
        """Input ``i``: an array (known at import time), a program value, or None if omitted."""
        if not self.has(i):
            return None
        name = self.node.input[i]
        if name not in self.env:
            raise OnnxModelError(f"input {i} ({name!r}) is not defined before this node (no graph input, "
                                 "initializer or earlier node output has that name)")
        v = self.env[name]
        if is_strings(v):
            raise OnnxUnsupportedError(
                f"input {i} ({name!r}) holds strings, which polyhal keeps on the host (device buffers hold "
                f"numbers); {self.op_type} has no string form in polyhal")
        if isinstance(v, HostValue):
            return self.importer.host_feed(v)
        if not isinstance(v, (np.ndarray, Value)):
            if hasattr(v, "padded"):
                raise NeedsStaging(
                    f"input {i} ({name!r}) has a length known only at run time (it comes from {v.what}); "
                    "one static plan cannot use it, so the model runs staged (a plan per segment)")
            raise OnnxUnsupportedError(f"input {i} ({name!r}): {getattr(v, 'reason', v)}")
        return v

    def raw_input(self, i: int) -> Any:
        """Input ``i`` as the environment holds it, including values of run-time length (for
        ops, such as Identity, that pass them through)."""
        return self.env.get(self.node.input[i]) if self.has(i) else None

    def host_input(self, i: int) -> Any:
        """Input ``i`` for a converter that computes on the host (string ops): an array, a
        program value or a :class:`~polyhal.frontends.onnx.types.HostValue`; None if omitted."""
        v = self.raw_input(i)
        if isinstance(v, HostValue) or (isinstance(v, np.ndarray) and is_strings(v)):
            return v
        return self.input(i)

    def inputs(self) -> list:
        """Every input (None for omitted optional ones)."""
        return [self.input(i) for i in range(len(self.node.input))]

    def const(self, i: int, what: str = "") -> np.ndarray | None:
        """Input ``i`` as an array, for operands that decide shapes or attributes.

        Raises :class:`NeedsValue` naming the graph inputs it comes from when it is computed at
        run time (polyhal programs have static shapes).
        """
        v = self.input(i)
        if v is None or isinstance(v, np.ndarray):
            return v
        deps = self.importer.deps.get(v.id, frozenset())
        name = self.node.input[i]
        what = f", {what}" if what else ""
        raise NeedsValue(
            f"{self.importer.source}: node {self.label}: input {i} ({name!r}{what}) must be known when the "
            f"model is loaded, because polyhal programs have static shapes; it is computed from graph "
            f"input(s) {', '.join(map(repr, sorted(deps))) or '(none)'}: give their values "
            "(polyhal.onnx.load(..., values={...}), or polyhal run --input NAME=FILE)", deps)

    def known(self, i: int, why: str) -> np.ndarray | None:
        """Input ``i`` as an array for ops whose *result shape* depends on the data (NonZero,
        If's condition, ...): those fold when the data is known; otherwise the model runs staged
        (:class:`NeedsStaging`)."""
        v = self.input(i)
        if v is None or isinstance(v, np.ndarray):
            return v
        raise NeedsStaging(f"{self.op_type} {why}; one static plan cannot hold it, so the model runs staged "
                           "(a plan per segment, host control flow)")

    # -- attributes ------------------------------------------------------------------------

    def attr(self, name: str, default: Any = _REQUIRED) -> Any:
        """Attribute ``name`` as a Python value (strings decoded, tensors as arrays)."""
        a = self._attrs.get(name)
        if a is None or a.ref_attr_name:
            if default is _REQUIRED:
                raise OnnxModelError(f"required attribute {name!r} is missing")
            return default
        value = helper.get_attribute_value(a)
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        if isinstance(value, onnx.TensorProto):
            return self.importer._initializer_value(value, f"attribute {name!r}")
        if isinstance(value, list):
            return [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in value]
        return value

    def has_attr(self, name: str) -> bool:
        """Whether attribute ``name`` is set on the node."""
        a = self._attrs.get(name)
        return a is not None and not a.ref_attr_name

    # -- outputs ---------------------------------------------------------------------------

    @property
    def num_outputs(self) -> int:
        """Outputs the node declares (named or empty)."""
        return len(self.node.output)

    def wants(self, k: int) -> bool:
        """Whether output ``k`` is requested (present and named)."""
        return k < len(self.node.output) and bool(self.node.output[k])

    # -- emitting --------------------------------------------------------------------------

    def op(self, name: str, *inputs: Any, **attrs: Any) -> Any:
        """Emit polyhal op ``name`` (folded when all inputs are known); returns its result(s)."""
        return self.importer.emit(self.label, name, inputs, attrs)

    def host(self, compute: Callable, *args: Any, dtype: Any, shape: Any, what: str = "") -> Any:
        """``compute(*args)`` on the host: run now when every arg is an array, else a
        :class:`~polyhal.frontends.onnx.types.HostValue` evaluated around the plan. ``shape``
        None: known only from the data."""
        return self.importer.host(compute, args, dtype, shape, what or f"the result of {self.label}")

    def full(self, shape: Any, value: Any, dtype: Any) -> Any:
        """A tensor of ``shape`` filled with ``value``: an array when it is within the fold limit,
        else an ``expand`` the program computes (so a large fill costs no memory at import)."""
        return self.op("expand", np.array(value, dtype=dtype), shape=[int(d) for d in shape])

    def type(self, v: Any) -> TensorType:
        """The tensor type of ``v`` (an array or a program value)."""
        return self.importer.type_of(v)

    def shape(self, v: Any) -> tuple[int, ...]:
        """The static shape of ``v``."""
        return self.importer.type_of(v).shape

    def dtype(self, v: Any) -> np.dtype:
        """The element type of ``v``."""
        return self.importer.type_of(v).dtype

    def rank(self, v: Any) -> int:
        """The rank of ``v``."""
        return len(self.importer.type_of(v).shape)

    @staticmethod
    def scalar(value: Any, dtype: Any) -> np.ndarray:
        """A 0-d array of ``dtype`` (a constant operand)."""
        return np.array(value, dtype=dtype)

    def inline_graph(self, graph: onnx.GraphProto, *, name: str) -> list:
        """Convert subgraph ``graph`` (e.g. a branch of If) in this node's scope; returns its outputs."""
        env = collections.ChainMap({}, dict(self.env))
        for t in graph.initializer:
            env[t.name] = self.importer._initializer(t)
        for vi in graph.input:
            if vi.name not in env.maps[0]:
                raise OnnxUnsupportedError(f"subgraph {name!r} takes inputs ({vi.name!r}); only If branches "
                                           "(which take none) are inlined")
        self.importer._walk(graph.node, env, self.opsets, f"{self.label}/{name}/", check_declared=False)
        return [env.get(o.name) for o in graph.output]


# ------------------------------------------------------------------------------------ dispatch

def convert_node(importer, node: onnx.NodeProto, env: Mapping[str, Any], opsets: Mapping[str, int],
                 label: str) -> list:
    """The outputs of ``node``: by its converter, else by its ONNX function body."""
    ctx = NodeContext(importer, node, env, opsets, label)
    local = importer.functions.get((node.domain, node.op_type))
    if local is not None:
        return _expand(ctx, local)
    if ctx.domain not in opsets:
        raise OnnxModelError(f"uses domain {node.domain!r}, which the model does not import (opset_import)")
    conv = CONVERTERS.get((ctx.domain, node.op_type))
    declined = None
    on_strings = STRING_CONVERTERS.get((ctx.domain, node.op_type))
    if on_strings is not None:
        try:
            return list(on_strings(ctx))
        except Decline:
            pass  # a numeric node: the ordinary converter's
    if conv is not None:
        try:
            return list(conv(ctx))
        except Decline as exc:
            declined = str(exc)
    fn = _function_body(ctx)
    if fn is not None:
        schema = _schema(node.op_type, ctx.opset, ctx.domain)
        defaults = {name: a.default_value for name, a in schema.attributes.items()
                    if a.default_value.type != onnx.AttributeProto.UNDEFINED}
        return _expand(ctx, fn, defaults)
    where = f" (domain {ctx.domain!r})" if ctx.domain else ""
    if declined:
        raise OnnxUnsupportedError(f"{node.op_type}{where}: {declined}")
    if _schema(node.op_type, ctx.opset, ctx.domain) is None:
        raise OnnxUnsupportedError(f"op {node.op_type!r}{where} is not an op of opset {ctx.opset}")
    raise OnnxUnsupportedError(f"op {node.op_type}{where} (opset {ctx.opset}) is not supported by polyhal's "
                               "ONNX importer")


def _schema(op_type: str, version: int, domain: str):
    try:
        return onnx.defs.get_schema(op_type, version, domain)
    except onnx.defs.SchemaError:
        return None


def _function_body(ctx: NodeContext) -> onnx.FunctionProto | None:
    """The function body ONNX defines for the node's op at its opset, if any."""
    schema = _schema(ctx.op_type, ctx.opset, ctx.domain)
    if schema is None:
        return None
    fn = onnx.FunctionProto()
    versions = [v for v in getattr(schema, "function_opset_versions", []) if v <= ctx.opset]
    if versions:
        fn.ParseFromString(schema.get_function_with_opset_version(max(versions)))
        return fn if fn.node else None
    versions = [v for v in getattr(schema, "context_dependent_function_opset_versions", []) if v <= ctx.opset]
    if versions:
        types = []
        for i in range(len(ctx.node.input)):
            v = ctx.input(i)
            if v is None:
                types.append(onnx.TypeProto().SerializeToString())
            else:
                t = ctx.type(v)
                types.append(helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(t.dtype),
                                                           list(t.shape)).SerializeToString())
        try:
            body = schema.get_context_dependent_function_with_opset_version(
                max(versions), ctx.node.SerializeToString(), types)
        except Exception as exc:  # noqa: BLE001  (onnx reports unbuildable bodies variously)
            raise OnnxUnsupportedError(f"{ctx.op_type}: its ONNX function body cannot be built for these "
                                       f"operands ({str(exc).strip().splitlines()[0] if str(exc).strip() else exc})") from None
        fn.ParseFromString(body)
        return fn if fn.node else None
    return None


def _expand(ctx: NodeContext, fn: onnx.FunctionProto, defaults: Mapping[str, onnx.AttributeProto] | None = None
            ) -> list:
    """Convert the nodes of function ``fn`` with the node's inputs and attributes bound
    (attributes the node leaves out take the function's, or the op schema's, defaults)."""
    env: dict[str, Any] = {}
    for i, formal in enumerate(fn.input):
        if ctx.has(i):
            env[formal] = ctx.input(i)
    attrs = dict(defaults or {})
    attrs.update({a.name: a for a in fn.attribute_proto})
    attrs.update(ctx._attrs)
    nodes = []
    for n in fn.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(n)
        del copy.attribute[:]
        for a in n.attribute:
            if a.ref_attr_name:
                if a.ref_attr_name in attrs:
                    bound = onnx.AttributeProto()
                    bound.CopyFrom(attrs[a.ref_attr_name])
                    bound.name = a.name
                    copy.attribute.append(bound)
            else:
                copy.attribute.append(a)
        nodes.append(copy)
    opsets = dict(ctx.opsets)
    for o in fn.opset_import:
        opsets["" if o.domain in ("", "ai.onnx") else o.domain] = o.version
    ctx.importer._walk(nodes, env, opsets, f"{ctx.label}/", check_declared=False)
    return [env.get(o) for o in fn.output]


# Importing the families registers their converters.
from polyhal.frontends.onnx.converters import (  # noqa: E402,F401  isort: skip
    elementwise, tensor, reduce, nn, misc, resize, control, rnn, signal, ml,
    quantize,
)
from polyhal.frontends.onnx.converters import vision  # noqa: E402,F401  isort: skip
from polyhal.frontends.onnx.converters import strings  # noqa: E402,F401  isort: skip
from polyhal.frontends.onnx.converters import datadep  # noqa: E402,F401  isort: skip
from polyhal.frontends.onnx.converters import images  # noqa: E402,F401  isort: skip

__all__ = ["CONVERTERS", "Decline", "NodeContext", "convert_node", "converter"]
