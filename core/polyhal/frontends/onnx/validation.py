"""ONNX's checker and shape inference on a model, remembered per model.

:func:`validated` runs :func:`_validate` (``onnx.checker.check_model``, then strict shape
inference) on a model whose weights were taken out (the importer's placeholders), and keeps
what it returns in a private cache (:class:`~polyhal.codecache.CodeCache`: a folder of this
user's that nobody else may write, each entry's sha256 checked before it is read), keyed by the
sha256 of the model's bytes, the onnx version and :data:`FORMAT`. A later process that imports
the same model reads the checked model back instead of checking again: the first check of a
process costs 50-100 ms on the 2-core VM (onnx builds its registry of op schemas then), about
as long as onnxruntime takes to create a whole session. Only models the checker accepted are
kept; a refused one is checked (and refused) every time.

``POLYHAL_ONNX_CACHE_DIR`` moves the folder (default ``$XDG_CACHE_HOME/polyhal/onnx``);
``off`` checks every model in every process.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from importlib import metadata
from pathlib import Path

from google.protobuf.message import DecodeError

from polyhal.codecache import CodeCache, default_folder
from polyhal.frontends.onnx.errors import OnnxModelError, first_line
from polyhal.frontends.onnx.proto import onnx_package, pb
from polyhal.frontends.onnx.settings import OnnxSettings

__all__ = ["validated"]

#: Changes whenever what :func:`_validate` returns for a model may change: entries made before
#: are then not read.
FORMAT = 1


def cache() -> CodeCache | None:
    """The cache of checked models (``POLYHAL_ONNX_CACHE_DIR``; ``off``: none)."""
    raw = OnnxSettings.from_env().cache_dir
    if raw.lower() in ("off", "0", "none"):
        return None
    return CodeCache(Path(raw) if raw else default_folder("onnx"), "polyhal (ONNX)", "POLYHAL_ONNX_CACHE_DIR",
                     "every model is checked again")


def validated(model: pb.ModelProto, source: str) -> pb.ModelProto:
    """:func:`_validate`'s result for ``model``, from the cache where this model was checked
    before (see the module docstring)."""
    disk = cache()
    if disk is None:
        return _validate(model, source)
    data = model.SerializeToString(deterministic=True)
    key = hashlib.sha256(f"{FORMAT} onnx {_onnx_version()}\0".encode() + data).hexdigest()
    name = f"{key}.onnx"
    found = _seen.get(key)
    if found is None:
        stored = disk.load(name)
        found = None if stored is None else stored[0]
    if found is not None:
        checked = pb.ModelProto()
        try:
            checked.ParseFromString(found)
            _remember(key, found)
            return checked
        except DecodeError:  # its sha256 matched what was stored: written by another protobuf, say
            pass
    checked = _validate(model, source)
    found = checked.SerializeToString()
    _remember(key, found)
    try:
        if disk.ready():
            disk.store(name, found)
    except OSError:  # a full or read-only disk: the model is checked again next time
        pass
    return checked


@functools.cache
def _onnx_version() -> str:
    """The installed onnx's version (its checker and shape inference decide what is cached): the
    module's where the process imported it already, else read from its distribution's metadata
    (~0.4 ms of a first session, parsing it): importing onnx to ask it costs ml_dtypes' import."""
    imported = getattr(sys.modules.get("onnx"), "__version__", None)
    if isinstance(imported, str):
        return imported
    try:
        return metadata.version("onnx")
    except metadata.PackageNotFoundError:  # an onnx run from a source tree: ask it
        return onnx_package().__version__


#: Checked models this process read or made, by key (a later session of the same model reads
#: no file), the newest last; at most :data:`SEEN_LIMIT`.
_seen: dict[str, bytes] = {}
SEEN_LIMIT = 64


def _remember(key: str, data: bytes) -> None:
    _seen.pop(key, None)
    _seen[key] = data
    while len(_seen) > SEEN_LIMIT:
        del _seen[next(iter(_seen))]


def _validate(model: pb.ModelProto, source: str) -> pb.ModelProto:
    """ONNX's checker, then strict shape inference; returns the model with inferred value_info.

    Graph outputs that declare an element type but no ``shape`` field (onnxruntime's tools and
    hand-built models write them; onnxruntime runs them, the checker refuses them) are left out
    of what the checker and inference see, and come back unchanged: the data decides them."""
    outputs = list(model.graph.output)
    shapeless = [o for o in outputs if o.type.WhichOneof("value") == "tensor_type"
                 and not o.type.tensor_type.HasField("shape")]
    if shapeless:
        copy = pb.ModelProto()
        copy.CopyFrom(model)
        kept = [o for o in outputs if o not in shapeless]
        del copy.graph.output[:]
        copy.graph.output.extend(kept)
        checked = _validate(copy, source)
        del checked.graph.output[:]
        checked.graph.output.extend(outputs)
        return checked
    onnx = onnx_package()
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise OnnxModelError(f"{source}: the ONNX checker rejects the model: {first_line(exc)}") from None
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError, RuntimeError):
        # Strict inference also fails on valid models (ONNX's own function bodies trip it, e.g.
        # MeanVarianceNormalization's); the importer checks every result against what is
        # declared anyway, so a real contradiction is still caught, naming its node.
        pass
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError, RuntimeError):
        return model
