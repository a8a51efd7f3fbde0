"""Real models without their weights: the cut-model format and its refill from a seed.

The benchmark ``python -m bench real_models`` runs architectures exported by torch (see
``bench/models/export.py``, which also says how to regenerate the files). The repository keeps
their graphs -- every node, attribute and small tensor as exported -- but not their large
weights: each float initializer above :data:`CUT_ABOVE` elements is removed and described by a
record in the model's ``metadata_props`` under :data:`CUT_KEY`, a JSON list of::

    {"name": ..., "dtype": <onnx element type>, "shape": [...], "rule": "normal",
     "mean": ..., "std": ...}

:func:`refill` puts them back: ``normal(mean, std)`` of the original tensor, drawn from a
generator seeded by ``(seed, crc32(name))``, so the same seed gives the same weights in every
process and for every batch size, and the activations keep the scale they had in the exported
network (no overflow through deep nets, positive variances where the export kept them as small
tensors). Convolution weights (4-D) get the ``"normal_per_channel"`` rule: a mean and std per
output channel (base64 float32 arrays), since a BatchNormalization folded into the conv scales
each output channel by its own factor and one std per tensor would let activations drift through
deep nets. A cut tensor of a few distinct values (a mask, a constant table) gets the ``"zlib"``
rule instead and comes back bit-exact. The structure is the model's; only the numbers are not.

:func:`materialize` refills a cut model and fixes its symbolic dims (``{"batch": 8}``), giving a
static model that polyhal and onnxruntime load alike.
"""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

#: Where the cut models live.
MODELS = Path(__file__).resolve().parent
#: The metadata key holding the records of the cut initializers.
CUT_KEY = "polyhal.cut_initializers"
#: Float initializers with more elements than this are cut; smaller ones stay as exported.
CUT_ABOVE = 4096
#: A cut tensor with at most this many distinct values is stored exactly (zlib) instead.
EXACT_DISTINCT = 16

_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


class CutModelError(ValueError):
    """A cut-model file that cannot be refilled (no records, or records that disagree with the graph)."""


def _record(tensor: onnx.TensorProto) -> dict:
    array = numpy_helper.to_array(tensor)
    record = {"name": tensor.name, "dtype": int(tensor.data_type), "shape": [int(d) for d in array.shape]}
    values = np.unique(array)
    if values.size <= EXACT_DISTINCT or not np.isfinite(array).all():
        raw = np.ascontiguousarray(array).tobytes()
        record.update(rule="zlib", data=base64.b64encode(zlib.compress(raw, 9)).decode("ascii"))
    elif array.ndim == 4:
        wide = array.astype(np.float64).reshape(array.shape[0], -1)
        record.update(rule="normal_per_channel", mean=_b64(wide.mean(axis=1)), std=_b64(wide.std(axis=1)))
    else:
        wide = array.astype(np.float64)
        record.update(rule="normal", mean=float(wide.mean()), std=float(wide.std()))
    return record


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")


def _unb64(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float32)


def cut(model: onnx.ModelProto, *, above: int = CUT_ABOVE) -> onnx.ModelProto:
    """A copy of ``model`` with float initializers of more than ``above`` elements cut out.

    External data must already be loaded. ``value_info`` is dropped too (shape inference
    recomputes it, and it would pin symbolic dims that :func:`materialize` fixes).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep, records = [], []
    for tensor in out.graph.initializer:
        numel = int(np.prod(tensor.dims)) if len(tensor.dims) else 1
        if tensor.data_type in _FLOATS and numel > above:
            records.append(_record(tensor))
        else:
            keep.append(tensor)
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep)
    del out.graph.value_info[:]
    previous = [p for p in out.metadata_props if p.key != CUT_KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(previous)
    out.metadata_props.add(key=CUT_KEY, value=json.dumps(records, separators=(",", ":")))
    return out


def records(model: onnx.ModelProto) -> list[dict]:
    """The cut initializers' records of ``model`` (empty if none were cut)."""
    for prop in model.metadata_props:
        if prop.key == CUT_KEY:
            return json.loads(prop.value)
    return []


def _fill(record: dict, seed: int) -> onnx.TensorProto:
    dtype = onnx.helper.tensor_dtype_to_np_dtype(record["dtype"])
    shape = tuple(record["shape"])
    if record["rule"] == "zlib":
        array = np.frombuffer(zlib.decompress(base64.b64decode(record["data"])), dtype=dtype).reshape(shape)
    elif record["rule"] == "normal":
        rng = np.random.default_rng([seed, zlib.crc32(record["name"].encode())])
        array = rng.standard_normal(shape, dtype=np.float32)
        array = (array * np.float32(record["std"]) + np.float32(record["mean"])).astype(dtype)
    elif record["rule"] == "normal_per_channel":
        rng = np.random.default_rng([seed, zlib.crc32(record["name"].encode())])
        array = rng.standard_normal(shape, dtype=np.float32)
        mean, std = _unb64(record["mean"]), _unb64(record["std"])
        if mean.shape != (shape[0],) or std.shape != (shape[0],):
            raise CutModelError(f"initializer {record['name']!r}: {mean.size} channel statistics for shape {shape}")
        lead = (shape[0],) + (1,) * (len(shape) - 1)
        array = (array * std.reshape(lead) + mean.reshape(lead)).astype(dtype)
    else:
        raise CutModelError(f"initializer {record['name']!r}: unknown refill rule {record['rule']!r}")
    return numpy_helper.from_array(array, record["name"])


def refill(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """A copy of a cut ``model`` with every cut initializer drawn again from ``seed``."""
    cut_records = records(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    present = {t.name for t in out.graph.initializer}
    for record in cut_records:
        if record["name"] in present:
            raise CutModelError(f"initializer {record['name']!r} is both kept and cut; regenerate the file")
        out.graph.initializer.append(_fill(record, seed))
    del out.metadata_props[:]
    out.metadata_props.extend(p for p in model.metadata_props if p.key != CUT_KEY)
    return out


def fix_dims(model: onnx.ModelProto, dims: Mapping[str, int]) -> onnx.ModelProto:
    """``model`` (changed in place, and returned) with the named symbolic dims of its inputs and
    outputs set to sizes."""
    for value in list(model.graph.input) + list(model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in dims:
                dim.dim_value = int(dims[dim.dim_param])
    return model


def load_cut(name_or_path: str | Path) -> onnx.ModelProto:
    """Read a cut model by name (``"resnet50"``, from :data:`MODELS`) or by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = MODELS / f"{name_or_path}.cut.onnx"
    if not path.is_file():
        raise CutModelError(f"{path}: no such cut model (see {MODELS / 'export.py'} to regenerate)")
    return onnx.load(str(path))


def materialize(name_or_path: str | Path, dims: Mapping[str, int] | None = None, seed: int = 0) -> onnx.ModelProto:
    """The runnable model: a cut model refilled from ``seed`` with its symbolic dims fixed."""
    return fix_dims(refill(load_cut(name_or_path), seed), dims or {})


def manifest() -> dict:
    """``manifest.json``: per model, its inputs, the exporter used and the export's own checks."""
    return json.loads((MODELS / "manifest.json").read_text())
