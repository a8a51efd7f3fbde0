"""What a converter sees of one ONNX node: :class:`NodeContext`."""

from __future__ import annotations

import collections
from collections.abc import Iterable, MutableMapping
from typing import Any, Callable, Mapping

import numpy as np

from polyhal.frontends.onnx.errors import NeedsStaging, NeedsValue, OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.proto import attribute_value, pb
from polyhal.frontends.onnx.types import HostValue, is_strings
from polyhal.ir.program import Value
from polyhal.ir.types import TensorType

__all__ = ["NodeContext"]

_REQUIRED: Any = object()


class NodeContext:
    """What a converter sees of one node: its inputs, attributes and opset, and ways to emit ops."""

    def __init__(self, importer, node: pb.NodeProto, env: Mapping[str, Any], opsets: Mapping[str, int],
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
        value = attribute_value(a)
        if isinstance(value, bytes):
            return value.decode("utf-8", "replace")
        if isinstance(value, pb.TensorProto):
            return self.importer.tensor_value(value, f"attribute {name!r}")
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

    def inline_graph(self, graph: pb.GraphProto, *, name: str) -> list:
        """Convert subgraph ``graph`` (e.g. a branch of If) in this node's scope; returns its outputs."""
        env = collections.ChainMap({}, dict(self.env))
        for t in graph.initializer:
            env[t.name] = self.initializer(t)
        for vi in graph.input:
            if vi.name not in env.maps[0]:
                raise OnnxUnsupportedError(f"subgraph {name!r} takes inputs ({vi.name!r}); only If branches "
                                           "(which take none) are inlined")
        self.convert_nodes(graph.node, env, scope=name)
        return [env.get(o.name) for o in graph.output]

    def initializer(self, t: pb.TensorProto) -> Any:
        """Initializer ``t`` of a subgraph (a branch, a loop body) as the importer reads a graph's."""
        return self.importer.initializer(t)

    def convert_nodes(self, nodes: Iterable[pb.NodeProto], env: MutableMapping[str, Any], *,
                      opsets: Mapping[str, int] | None = None, scope: str = "") -> None:
        """Convert ``nodes`` (a subgraph's or a function body's) in order into ``env``, inside this
        node: their labels read ``<this node>/<scope>/<node>`` (``<this node>/<node>`` without a
        scope), and they use this node's opsets unless ``opsets`` is given. Their outputs are not
        checked against the graph's declared types: their names are their own."""
        prefix = f"{self.label}/{scope}/" if scope else f"{self.label}/"
        self.importer.convert_nodes(nodes, env, self.opsets if opsets is None else opsets, prefix,
                                    check_declared=False)
