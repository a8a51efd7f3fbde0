"""``polyhal.onnx``: run ONNX models on polyhal devices.

::

    import polyhal.onnx
    program = polyhal.onnx.load("examples/mlp.onnx")      # an OnnxProgram (a polyhal Program)
    plan = program.compile()                                # or polyhal.compile(program, "cpu:0")
    y = plan(x=np.ones((32, 256), np.float32))

This module imports the ``onnx`` package; ``import polyhal`` alone does not. Everything here is
:mod:`polyhal.frontends.onnx`, re-exported.
"""

from polyhal.frontends.onnx import (  # noqa: F401
    DeclaredShapeWarning, DynamicOnnxProgram, DynamicPlan, MAX_OPSET, MIN_OPSET, SUPPORTED_OPSETS, NeedsValue, OnnxError, OnnxInputError,
    OnnxModelError, OnnxRunError,
    OnnxProgram, OnnxUnsupportedError, StagedOnnxProgram, StagedPlan, StrictPlacementError, load, read_model,
    supported_ops,
)

__all__ = [
    "DeclaredShapeWarning", "DynamicOnnxProgram", "DynamicPlan", "MAX_OPSET", "MIN_OPSET", "NeedsValue", "OnnxError", "OnnxInputError",
    "OnnxModelError", "OnnxRunError", "OnnxProgram", "StagedOnnxProgram", "StagedPlan",
    "OnnxUnsupportedError", "SUPPORTED_OPSETS", "StrictPlacementError", "load", "read_model", "supported_ops",
]
