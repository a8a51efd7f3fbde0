"""Converters: one function per ONNX op, from a node to polyhal ops.

A converter takes a :class:`NodeContext` and returns the node's outputs (a list, one entry per
output it produces; ``None`` for an optional output it does not). It emits polyhal ops with
``ctx.op(name, *inputs, **attrs)``: when every input is known at import time the op is folded
(run by its numpy reference) and the result is an array, otherwise it becomes a dispatch of the
program. Operands that decide shapes are read with ``ctx.const(i)``.

Ops without a converter, and nodes a converter declines (by raising :class:`Decline`, e.g. an
optional output it cannot produce), are expanded through the function body ONNX defines for
the op, when there is one; otherwise the op is unsupported.

Registering (:mod:`~polyhal.frontends.onnx.converters.registry`; a family imports
:class:`~polyhal.frontends.onnx.converters.context.NodeContext` and ``converter`` from their own
modules, never from this package, which imports the families)::

    @converter("Relu")
    def relu(ctx):
        return [ctx.op("relu", ctx.input(0))]
"""

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.dispatch import convert_node
from polyhal.frontends.onnx.converters.registry import CONVERTERS, STRING_CONVERTERS, Decline, converter

# Importing a family registers its converters.
from polyhal.frontends.onnx.converters import (  # noqa: F401
    contrib, control, datadep, elementwise, images, misc, ml, nn, quantize, reduce, resize, rnn, signal, strings, tensor,
    vision,
)

__all__ = ["CONVERTERS", "Decline", "NodeContext", "STRING_CONVERTERS", "convert_node", "converter"]
