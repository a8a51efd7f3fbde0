"""Errors of the ONNX front end. All derive from :class:`~polyhal.errors.PolyhalError`."""

from __future__ import annotations

from polyhal.errors import PolyhalError, ProgramError


class OnnxError(PolyhalError):
    """Base class of the ONNX front end's errors."""


class OnnxModelError(OnnxError, ValueError):
    """The model is malformed: not ONNX at all, truncated, inconsistent (a node reads a value
    nothing defines, declared shapes contradict the data, ...)."""


class OnnxUnsupportedError(OnnxError, NotImplementedError):
    """A valid model that polyhal cannot run: an op, element type, opset or feature it lacks."""


class OnnxInputError(OnnxError, ValueError):
    """Inputs given to a model that do not fit it: missing, extra, wrong shape or element type."""


class OnnxRunError(OnnxError, RuntimeError):
    """Running an imported model failed in a kernel (for example an index out of range in the
    data); the kernel's own exception is chained."""


class NeedsValue(OnnxUnsupportedError):
    """An operand that decides a shape (Reshape's shape, TopK's k, Slice's starts, ...) comes
    from graph inputs whose values are not known at import time.

    polyhal programs have static shapes, so such inputs are fixed: :func:`polyhal.onnx.load`
    catches this and loads the model staged, specialized per value of those inputs (or fixes
    them at load with ``values=``; ``polyhal run`` does this for inputs read from files, the
    ONNX backend per run). ``inputs`` names them.
    """

    def __init__(self, message: str, inputs: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.inputs = frozenset(inputs)


class NeedsStaging(OnnxUnsupportedError):
    """A feature a single static plan cannot hold: control flow decided by data, a value whose
    length is data feeding a later op, sequences and optionals. :func:`polyhal.onnx.load` then
    runs the model staged (:mod:`polyhal.frontends.onnx.staged`)."""


class DeclaredShapeWarning(UserWarning):
    """A graph output's declared shape contradicts what the model computes (onnxmltools declares
    a LightGBM classifier's ``label`` as int64[1] at any batch): polyhal trusts the data, as
    onnxruntime does, and warns once per model; ``load(..., strict_shapes=True)`` refuses instead."""


class StrictPlacementError(OnnxUnsupportedError, ProgramError):
    """``strict=True`` (``polyhal run --strict``): a node's op has no kernel on the requested
    devices, and polyhal was told not to run it elsewhere."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for
    messages that quote a library's error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
