"""``polyhal.InferenceSession``: onnxruntime's session API over polyhal.

::

    import polyhal                      # instead of: import onnxruntime as ort
    session = polyhal.InferenceSession("examples/mlp.onnx")
    x = session.get_inputs()[0]         # .name, .shape (symbolic dims as strings), .type ("tensor(float)")
    (y,) = session.run(None, {x.name: np.ones((32, 256), np.float32)})

The session loads the model once and keeps what :func:`~polyhal.frontends.onnx.importer.load`
made of it (a model whose inputs decide shapes, a Reshape's ``shape`` fed as an input, is
imported per value of those inputs): a static :class:`OnnxProgram` is compiled when the session is created (as
onnxruntime builds its session); a model with symbolic dims is a
:class:`~polyhal.frontends.onnx.dynamic.DynamicOnnxProgram`, whose plan specializes per input
shape and caches the plans; a model with data-decided control flow is a
:class:`~polyhal.frontends.onnx.staged.StagedOnnxProgram`. ``run`` returns numpy arrays (sequences
as lists, empty optionals as None), outputs of run-time length cut to it, in the order asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import onnx

from polyhal.frontends.onnx.backend import PolyhalRep
from polyhal.frontends.onnx.errors import NeedsValue, OnnxInputError
from polyhal.frontends.onnx.importer import load, read_model

__all__ = ["InferenceSession", "NodeArg"]


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime's ``NodeArg`` describes it: ``name``, ``shape``
    (a list: an int per fixed dim, the symbol's name per named dim, None per unnamed one) and
    ``type`` (``"tensor(float)"``, ``"seq(tensor(int64))"``, ...)."""

    name: str
    shape: list | None
    type: str


def type_string(tp: onnx.TypeProto) -> str:
    """onnxruntime's text for an ONNX type: ``tensor(float)``, ``seq(tensor(int64))``,
    ``optional(tensor(float))``, ``map(string,tensor(float))``."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem = onnx.helper.tensor_dtype_to_string(getattr(tp, kind).elem_type)
        name = elem.removeprefix("TensorProto.").lower()
        return f"{'sparse_tensor' if kind == 'sparse_tensor_type' else 'tensor'}({name})"
    if kind == "sequence_type":
        return f"seq({type_string(tp.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({type_string(tp.optional_type.elem_type)})"
    if kind == "map_type":
        key = onnx.helper.tensor_dtype_to_string(tp.map_type.key_type).removeprefix("TensorProto.").lower()
        return f"map({key},{type_string(tp.map_type.value_type)})"
    return "unknown"


def _node_arg(vi: onnx.ValueInfoProto) -> NodeArg:
    tensor = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    shape = None
    if tensor is not None and tensor.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
    return NodeArg(vi.name, shape, type_string(vi.type))


class InferenceSession:
    """An ONNX model ready to run on polyhal devices, with onnxruntime's session API.

    Args:
        path_or_bytes: a model path, its bytes, a binary file object or an ``onnx.ModelProto``.
        devices: the ordered device list (``"cpu:0"`` or ``["opencl:0", "cpu:0"]``): each op runs
            on the first that has its kernel (default: every device, best first).
        **options: what :meth:`OnnxProgram.compile` takes (``strict=True``, ``fuse=False``,
            ``data_tiling=True``, ``precision=...``).

    Raises:
        OnnxModelError, OnnxUnsupportedError: the model cannot be read or imported; compile
            errors (a strict placement, say) for a static model.
    """

    def __init__(self, path_or_bytes: Any, devices: Sequence[str] | str | None = None, **options: Any) -> None:
        proto, source = read_model(path_or_bytes)  # read once: load takes the ModelProto
        initialized = {t.name for t in proto.graph.initializer}
        self._inputs = [_node_arg(vi) for vi in proto.graph.input if vi.name not in initialized]
        self._outputs = [_node_arg(vi) for vi in proto.graph.output]
        self.source = source
        self.devices = devices
        self._by_value: PolyhalRep | None = None
        try:
            self.program = load(proto, source=source)
        except NeedsValue:  # inputs decide shapes: imported per value of those, as the ONNX backend does
            self.program = self.plan = None
            self._by_value = PolyhalRep(proto, devices, strict=options.pop("strict", False), **options)
            return
        self.plan = self.program.compile(devices, **options)

    def get_inputs(self) -> list[NodeArg]:
        """The inputs a run takes (graph inputs without an initializer), in the graph's order."""
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        """The model's outputs, in the graph's order."""
        return list(self._outputs)

    def get_modelmeta(self) -> Any:
        """Not kept: polyhal's programs do not hold the model's metadata (read it with ``onnx``)."""
        raise NotImplementedError("InferenceSession keeps no model metadata; read it with onnx.load")

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[Any]:
        """The outputs named by ``output_names`` (None: every output, in the graph's order) for
        the inputs ``input_feed`` ({name: numpy array}), as a list of numpy arrays.

        Raises:
            OnnxInputError: an output the model lacks, an input missing or unknown, or one of
                another element type or a shape the model's declaration excludes (the message
                names it and what the model declares).
        """
        names = [o.name for o in self._outputs] if output_names is None else list(output_names)
        known = {o.name for o in self._outputs}
        for name in names:
            if name not in known:
                listing = ", ".join(f"{o.name} ({o.type})" for o in self._outputs)
                raise OnnxInputError(f"{self.source}: the model has no output {name!r}; its outputs are {listing}")
        program, plan = (self.program, self.plan) if self._by_value is None else \
            self._by_value.compiled(self._by_value.as_feeds(input_feed))
        results = program.execute(plan, program.check_feeds(input_feed))
        return [results[n] for n in names]
