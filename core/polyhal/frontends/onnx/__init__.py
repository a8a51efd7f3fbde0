"""The ONNX front end: import ONNX models as polyhal programs, run them, test them.

* :func:`load` (also ``polyhal.onnx.load``): a model file, bytes or ModelProto in, an
  :class:`OnnxProgram` out (a :class:`~polyhal.ir.program.Program`; compile it and call the
  plan with the model's inputs by name); a model with symbolic input dims gives a
  :class:`DynamicOnnxProgram`, whose plan specializes per input shape and caches the plans;
  a model with control flow decided by data, data-dependent shapes feeding later ops,
  sequences or optionals gives a :class:`StagedOnnxProgram` (plans per segment, host control flow);
* :mod:`~polyhal.frontends.onnx.backend`: an ``onnx.backend.base.Backend`` over polyhal
  devices (``PolyhalBackend.prepare(model, "cpu:0").run(inputs)``);
* :mod:`~polyhal.frontends.onnx.node_tests`: ONNX's own node tests on every device
  (``python -m polyhal.frontends.onnx.node_tests``);
* ``polyhal run MODEL.onnx`` (:mod:`~polyhal.frontends.onnx.run`): the command line.

``import polyhal`` does not import this package. Importing it, or loading a model whose checked
copy is cached (:mod:`~polyhal.frontends.onnx.validation`) and whose types are numpy's, imports
ONNX's protobuf messages but not ``onnx`` (:mod:`~polyhal.frontends.onnx.proto` says why); the
checker, shape inference, op schemas and ml_dtypes' types import it when first needed.
"""

from polyhal.frontends.onnx.converters import CONVERTERS
from polyhal.frontends.onnx.dynamic import DynamicOnnxProgram, DynamicPlan
from polyhal.frontends.onnx.errors import (
    DeclaredShapeWarning, NeedsValue, OnnxError, OnnxInputError, OnnxModelError, OnnxRunError, OnnxUnsupportedError,
    StrictPlacementError,
)
from polyhal.frontends.onnx.importer import (
    MAX_OPSET, MIN_OPSET, SUPPORTED_OPSETS, OnnxProgram, load, read_model,
)
from polyhal.frontends.onnx.staged import StagedOnnxProgram, StagedPlan


def supported_ops() -> list[str]:
    """ONNX op types (default domain) with a converter; ops ONNX defines as functions of these
    are supported too, by expansion."""
    return sorted(op for domain, op in CONVERTERS if domain == "")


__all__ = [
    "DeclaredShapeWarning", "DynamicOnnxProgram", "DynamicPlan", "MAX_OPSET", "MIN_OPSET", "NeedsValue", "OnnxError", "OnnxInputError",
    "OnnxModelError", "OnnxRunError", "OnnxProgram", "StagedOnnxProgram", "StagedPlan",
    "OnnxUnsupportedError", "SUPPORTED_OPSETS", "StrictPlacementError", "load", "read_model", "supported_ops",
]
