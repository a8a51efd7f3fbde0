"""Converting one node: by its registered converter, else by the function body ONNX defines for its op."""

from __future__ import annotations

from typing import Any, Mapping

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import CONVERTERS, STRING_CONVERTERS, Decline
from polyhal.frontends.onnx.errors import OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.proto import onnx_package, pb

__all__ = ["convert_node"]


def convert_node(importer, node: pb.NodeProto, env: Mapping[str, Any], opsets: Mapping[str, int],
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
                    if a.default_value.type != pb.AttributeProto.UNDEFINED}
        return _expand(ctx, fn, defaults)
    where = f" (domain {ctx.domain!r})" if ctx.domain else ""
    if declined:
        raise OnnxUnsupportedError(f"{node.op_type}{where}: {declined}")
    if ctx.domain == "com.microsoft":
        raise OnnxUnsupportedError(
            f"op {node.op_type!r} of domain 'com.microsoft' (an onnxruntime contrib op) is not supported by polyhal, "
            "which runs onnxruntime's QOperator quantized ops (QGemm, QLinearAdd, ...) but not this one; a model "
            "from onnxruntime's quantizer can be quantized to QDQ instead (quantize_static(..., "
            "quant_format=QuantFormat.QDQ)), whose QuantizeLinear/DequantizeLinear pairs polyhal runs")
    if _schema(node.op_type, ctx.opset, ctx.domain) is None:
        raise OnnxUnsupportedError(f"op {node.op_type!r}{where} is not an op of opset {ctx.opset}")
    raise OnnxUnsupportedError(f"op {node.op_type}{where} (opset {ctx.opset}) is not supported by polyhal's "
                               "ONNX importer")


def _schema(op_type: str, version: int, domain: str):
    defs = onnx_package().defs  # (ONNX's op schemas: a model with an op that has no converter)
    try:
        return defs.get_schema(op_type, version, domain)
    except defs.SchemaError:
        return None


def _function_body(ctx: NodeContext) -> pb.FunctionProto | None:
    """The function body ONNX defines for the node's op at its opset, if any."""
    schema = _schema(ctx.op_type, ctx.opset, ctx.domain)
    if schema is None:
        return None
    fn = pb.FunctionProto()
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
                types.append(pb.TypeProto().SerializeToString())
            else:
                t = ctx.type(v)
                helper = onnx_package().helper
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


def _expand(ctx: NodeContext, fn: pb.FunctionProto, defaults: Mapping[str, pb.AttributeProto] | None = None
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
        copy = pb.NodeProto()
        copy.CopyFrom(n)
        del copy.attribute[:]
        for a in n.attribute:
            if a.ref_attr_name:
                if a.ref_attr_name in attrs:
                    bound = pb.AttributeProto()
                    bound.CopyFrom(attrs[a.ref_attr_name])
                    bound.name = a.name
                    copy.attribute.append(bound)
            else:
                copy.attribute.append(a)
        nodes.append(copy)
    opsets = dict(ctx.opsets)
    for o in fn.opset_import:
        opsets["" if o.domain in ("", "ai.onnx") else o.domain] = o.version
    ctx.convert_nodes(nodes, env, opsets=opsets)
    return [env.get(o) for o in fn.output]
