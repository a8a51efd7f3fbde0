"""The converter table: which function converts each ONNX op, and the decorator that fills it.

A leaf module: the converter families (:mod:`~polyhal.frontends.onnx.converters.elementwise`,
...) register into it when the package imports them, and the dispatch
(:mod:`~polyhal.frontends.onnx.converters.dispatch`) reads it; neither imports the package.

Registering::

    @converter("Relu")
    def relu(ctx):
        return [ctx.op("relu", ctx.input(0))]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from polyhal.frontends.onnx.converters.context import NodeContext

__all__ = ["CONVERTERS", "Converter", "Decline", "STRING_CONVERTERS", "converter"]

Converter = Callable[["NodeContext"], list]

#: (domain, op type) -> converter.
CONVERTERS: dict[tuple[str, str], Converter] = {}
#: (domain, op type) -> the converter of the op's string forms (Equal of strings, Cast to
#: string, ...), tried before the one in CONVERTERS; it raises Decline for a numeric node.
STRING_CONVERTERS: dict[tuple[str, str], Converter] = {}


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
