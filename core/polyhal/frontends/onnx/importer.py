"""The ONNX importer: a ModelProto in, an :class:`OnnxProgram` (a polyhal Program) out.

What it does, in order:

1. reads the model (path, bytes, file object or ModelProto) and refuses what is not one:
   undecodable or truncated bytes, no graph, no default-domain opset;
2. checks the opset against :data:`SUPPORTED_OPSETS`, runs ONNX's checker and its strict shape
   inference (so a model whose declared shapes contradict its data is refused up front);
3. walks the graph in order, converting each node with the converter registered for its op
   (:mod:`polyhal.frontends.onnx.converters`), or, for ops ONNX defines as a function of
   other ops, by expanding that function body; an op with neither is unsupported;
4. folds at import time every op whose operands are all known (initializers, ``Constant``,
   ``Shape`` of a static shape, ...) by running the op's numpy reference, so shape subgraphs
   disappear and what remains is the model's real data flow;
5. checks every result against the type ONNX declared or inferred for it.

Inputs with symbolic dims take their shape from ``shapes=``, ``dims=`` or ``default_dim``; a
model whose dims stay open loads as a
:class:`~polyhal.frontends.onnx.dynamic.DynamicOnnxProgram`: one program with symbolic dims
(the core specializes it per call's shapes), or, where a node needs a symbol's size at import
(a ``Shape`` read of a symbolic dim, a shape computed from one), imported per input shape.
Operands that decide a shape (Reshape's ``shape``, TopK's
``k``, ...) fold when known at import time; when they come from graph inputs (or data computed
from them) the model loads staged, specialized per value of those inputs, unless ``values=``
fixes them (:class:`NeedsValue`, caught by the load, names them).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from google.protobuf.message import DecodeError, Message

from polyhal.config import parse_size
from polyhal.errors import DTypeError, PolyhalError
from polyhal.frontends.onnx.errors import (
    DeclaredShapeWarning, NeedsStaging, NeedsValue, OnnxError, OnnxInputError, OnnxModelError, OnnxRunError, OnnxUnsupportedError,
    StrictPlacementError, first_line as _first_line,
)
from polyhal.frontends.onnx.external import load_external_data, tensor_array
from polyhal.frontends.onnx.proto import onnx_package, pb, tensor_value_info
from polyhal.frontends.onnx.settings import FOLD_LIMIT, OnnxSettings
from polyhal.frontends.onnx.converters import convert_node
from polyhal.frontends.onnx.dynamic import (
    DynamicOnnxProgram, InputSignature, bind_dims, check_input_names, feed_array,
)
from polyhal.frontends.onnx.staged import StagedOnnxProgram, needs_staging
from polyhal.frontends.onnx.wire import read_split
from polyhal.frontends.onnx.validation import _validate, validated  # noqa: F401  (_validate: tests)
from polyhal.frontends.onnx.types import (
    STRING_DTYPE, Dynamic, HostOutput, HostValue, as_strings, is_strings, np_dtype, value_dtype,
)
from polyhal.ir.program import Program, ProgramBuilder, Value
from polyhal.ir.types import STORAGE_DTYPES, DTypeSet, SymbolicDim, TensorType
from polyhal.ops import OPS, infer_types
from polyhal.passes.decompose import DECOMPOSITIONS
from polyhal.plan import compile as polyhal_compile, cycle_collection_paused, trim_heap
from polyhal.progress import SAY_AFTER, long_work
from polyhal.registry import default_registry

#: The default-domain opsets the importer accepts (ONNX 1.23's opset 28 is the newest it was
#: tested against; opset 7 is where numpy-style broadcasting became ONNX's rule for every op).
MIN_OPSET, MAX_OPSET = 7, 28
SUPPORTED_OPSETS = range(MIN_OPSET, MAX_OPSET + 1)

_DEFAULT_DOMAINS = ("", "ai.onnx")
def _fold_limit(value: int | str | None = None) -> int:
    """The fold limit in bytes: ``value`` if given, else ``POLYHAL_FOLD_LIMIT``, else :data:`FOLD_LIMIT`."""
    if value is None:
        return OnnxSettings.from_env().fold_limit
    try:
        limit = parse_size(value) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        limit = -1
    if limit < 0:
        raise OnnxInputError(f"fold limit {value!r} is not a size in bytes; write e.g. 33554432 or 32MiB "
                             "(POLYHAL_FOLD_LIMIT, load(..., fold_limit=))")
    return limit

Val = Any  # np.ndarray (known at import time) or Value (computed when the plan runs)


# ------------------------------------------------------------------------------------- types

def _declared(type_proto: pb.TypeProto) -> tuple[int | None, tuple | None]:
    """(elem_type, dims) of a tensor TypeProto; a dim is an int or None (symbolic/unknown);
    dims is None when the rank is unknown. Non-tensor types give (None, None)."""
    if type_proto.WhichOneof("value") != "tensor_type":
        return None, None
    tt = type_proto.tensor_type
    elem = tt.elem_type or None
    if not tt.HasField("shape"):
        return elem, None
    dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
    return elem, dims


def _fmt_declared(elem: int | None, dims: tuple | None, type_proto: pb.TypeProto | None = None) -> str:
    try:
        name = pb.TensorProto.DataType.Name(elem).lower() if elem else "?"
    except ValueError:
        name = f"type{elem}"
    if dims is None:
        return f"{name}[...]"
    syms = []
    if type_proto is not None and type_proto.WhichOneof("value") == "tensor_type":
        syms = [d.dim_param or "?" for d in type_proto.tensor_type.shape.dim]
    text = [str(d) if d is not None else (syms[i] if i < len(syms) else "?") for i, d in enumerate(dims)]
    return f"{name}[{','.join(text)}]"


# ------------------------------------------------------------------------------- the program

@dataclass(eq=False)
class OnnxProgram(Program):
    """A polyhal :class:`~polyhal.ir.program.Program` imported from an ONNX model.

    Compile it with :meth:`compile` (or :func:`polyhal.compile`) and call the plan with the
    model's inputs by name. Besides the program it keeps what explain needs: which ONNX node
    each op came from (``origins``, by result value id), which nodes were folded away at
    import time (``folded``), and which graph inputs were fixed to values (``frozen``).
    """

    source: str = ""
    opset: int = 0
    output_names: list[str] = field(default_factory=list)
    declared_inputs: dict[str, str] = field(default_factory=dict)
    origins: dict[int, str] = field(default_factory=dict)
    folded: list[str] = field(default_factory=list)
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    node_count: int = 0
    #: ONNX output index -> index of the program output holding its run-time length (outputs
    #: such as NonMaxSuppression's are computed padded to a static bound, plus a count).
    trims: dict[int, int] = field(default_factory=dict)
    #: ONNX output index -> the axis ``trims`` cuts, where it is not the first.
    trim_axes: dict[int, int] = field(default_factory=dict)
    #: ONNX output index -> what turns the plan's array into the declared output on the host
    #: (string labels, ZipMap's list of dicts: see :class:`~polyhal.frontends.onnx.types.HostOutput`).
    finishes: dict[int, Any] = field(default_factory=dict)
    #: The inputs a run takes, in the graph's order: program inputs and string inputs (which
    #: stay on the host), but not the program inputs the host makes (``host_feeds``).
    feed_names: list[str] = field(default_factory=list)
    #: String graph input -> its shape (held on the host as arrays of str, never in the plan).
    string_inputs: dict[str, tuple] = field(default_factory=dict)
    #: Program inputs that the host computes before the plan runs (numbers made from strings):
    #: (program input name, the :class:`~polyhal.frontends.onnx.types.HostValue` it is).
    host_feeds: list[tuple[str, HostValue]] = field(default_factory=list)
    #: ONNX output index -> the HostValue (or array known at import) it is, made on the host.
    host_outputs: dict[int, Any] = field(default_factory=dict)
    #: Program value id -> index of the program output holding it, for host outputs to read.
    host_reads: dict[int, int] = field(default_factory=dict)
    #: ONNX output index -> index of the program output holding it (-1: a host output).
    slots: list[int] = field(default_factory=list)
    #: What execute's path without host work returns from (see _plain_outputs); made on first run.
    _direct_outputs: Any = field(default=None, init=False, repr=False)
    #: What check_feeds reads (names, declarations, listing, per-input types); made on first run.
    _feed_checks: Any = field(default=None, init=False, repr=False)

    @property
    def input_names(self) -> list[str]:
        """Names of the inputs a run takes (graph inputs not fixed at import), in order."""
        return list(self.feed_names) if self.feed_names else [v.name for v in self.inputs]

    def feed_types(self) -> list[tuple[str, tuple, np.dtype]]:
        """(name, shape, dtype) of every input a run takes, in order; strings have dtype object."""
        types = {v.name: (v.type.shape, v.type.dtype) for v in self.inputs}
        types.update((k, (shape, STRING_DTYPE)) for k, shape in self.string_inputs.items())
        return [(n, *types[n]) for n in self.input_names]

    def origin(self, op, plan=None) -> str:
        """The ONNX node an op of this program, or of ``plan`` compiled from it, came from (an
        op made by fusing the ops of several nodes names them all)."""
        return _origin(op, self.node_labels(plan) if plan is not None else self.origins)

    def node_labels(self, plan) -> dict[int, str]:
        """Value id -> the ONNX node label for the values of ``plan`` (compiled from this
        program): ``origins``, the results of the ops that fusions made, and the storage values
        that materialized encodings gave results (which keep their value's name)."""
        origins = dict(self.origins)
        named = {v.name: v.id for op in self.ops for v in op.outputs}
        for fusion in plan.placement.fusions or ():
            labels = dict.fromkeys(filter(None, (origins.get(op.outputs[0].id) for op in fusion.ops)))
            for op in fusion.new:
                for v in op.outputs:
                    origins[v.id] = " + ".join(labels)
                    named[v.name] = v.id
        for op in plan.program.ops:
            for v in op.outputs:
                # data tiling names an encoded value "<value>.<role>" (polyhal.passes.data_tiling)
                source = named.get(v.name, named.get(v.name.rsplit(".", 1)[0]))
                if v.id not in origins and source in origins:
                    origins[v.id] = origins[source]
        return origins

    def compile(self, devices: Sequence[str] | str | None = None, *, strict: bool = False,
                registry=None, **options: Any):
        """Compile for ``devices`` (ordered; default every device, best first).

        Ops that none of ``devices`` has a kernel for run on another device that has one, with
        transfers inserted (heterogeneous placement); ``strict=True`` refuses that instead,
        with a :class:`StrictPlacementError` naming the node, its op and the devices lacking it.
        ``options`` go to :func:`polyhal.compile` (``fuse=False`` to keep MatMul, Softmax, ...
        unfused, ``data_tiling=True``).
        """
        registry = registry or default_registry()
        if isinstance(devices, str):
            devices = (devices,)
        # Every device is listed only when needed: a program given cpu:0 loads no other driver.
        every = lambda: tuple(s.name for s in registry.device_specs())  # noqa: E731
        requested = tuple(devices) if devices else every()
        kernels = functools.cache(registry.kernel_names)  # kernel sets, from the specs: nothing is created
        for name in requested:
            kernels(name)  # unknown names fail here, listing the devices
        # (an op the compile decomposes where no device has its kernel is not missing)
        missing = [op for op in self.ops if op.affinity is None and op.name not in DECOMPOSITIONS
                   and not any(op.name in kernels(d) for d in requested)]
        if missing and strict:
            lines = [f"node {self.origin(op)}: op {op.name!r}" for op in missing[:10]]
            more = f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""
            elsewhere = sorted({d for op in missing for d in every()
                                if d not in requested and op.name in kernels(d)})
            hint = (f"; without --strict they would run on {', '.join(elsewhere)}" if elsewhere
                    else "; no installed device has them")
            raise StrictPlacementError(
                f"{self.source}: {len(missing)} op(s) have no kernel on {', '.join(requested)} "
                f"(strict placement): " + "; ".join(lines) + more + hint)
        order = requested + tuple(d for d in every() if d not in requested) if missing else requested
        try:
            plan = polyhal_compile(self, order, registry=registry, **options)
            # Profiles name each step's ONNX nodes (a fused op all of its nodes, as explain does).
            labels = self.node_labels(plan)
            plan.node_names = lambda op: _origin(op, labels)
            return plan
        except PolyhalError:
            raise
        except Exception as exc:  # a kernel that cannot be prepared for these operands
            raise OnnxRunError(f"{self.source}: compiling the model failed: {type(exc).__name__}: "
                               f"{_first_line(exc)}") from exc

    def check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """``feeds`` as numpy arrays, after checking names, element types and shapes against
        the program's inputs (OnnxInputError naming the input and what the model declares)."""
        checks = self._feed_checks
        if checks is None:
            declared = self.declared_inputs
            checks = self._feed_checks = (self.input_names, declared, self._listing(),
                                          [(n, shape, dtype, declared.get(n)) for n, shape, dtype in self.feed_types()])
        names, declared, listing, types = checks
        if self.frozen:
            fixed = [k for k in feeds if k not in names and k in self.frozen]
            for k in fixed:
                if not np.array_equal(np.asarray(feeds[k]), self.frozen[k]):
                    raise OnnxInputError(
                        f"{self.source}: input {k!r} was fixed to a value when the model was loaded (it "
                        f"decides a shape); load the model again with this value")
            feeds = {k: v for k, v in feeds.items() if k not in fixed}
        check_input_names(self.source, feeds, names, declared, listing)
        out = {}
        for name, shape, dtype, declared_as in types:
            arr = feed_array(self.source, name, feeds[name], dtype, declared_as)
            if arr.shape != shape:
                diff = next((f"; dim {i} is {w} in this program, got {g}" for i, (w, g)
                             in enumerate(zip(shape, arr.shape)) if w != g), "")
                raise OnnxInputError(f"{self.source}: input {name!r} must have shape {shape} "
                                     f"(declared {declared_as}), got {arr.shape}{diff}")
            out[name] = arr
        return out

    def _listing(self) -> str:
        return ", ".join(f"{n} ({self.declared_inputs.get(n, '')})" for n in self.input_names) or "(none)"

    def _on_host(self, v: Any, known: Mapping[Any, Any], memo: dict[int, Any]) -> Any:
        """Host value ``v`` evaluated (an array known at import is itself)."""
        if not isinstance(v, HostValue):
            return v
        try:
            return v.evaluate(known, memo)
        except PolyhalError:
            raise
        except Exception as exc:  # a string op's own error on this data
            raise OnnxRunError(f"{self.source}: computing {v.what} on the host failed: {type(exc).__name__}: "
                               f"{_first_line(exc)}") from exc

    def run(self, feeds: Mapping[str, Any], devices: Sequence[str] | str | None = None, *,
            strict: bool = False) -> dict[str, np.ndarray]:
        """Compile, run once on ``feeds`` and return {output name: numpy array}."""
        return self.execute(self.compile(devices, strict=strict), self.check_feeds(feeds))

    def execute(self, plan, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run ``plan`` (compiled from this program) on ``feeds`` and return the ONNX outputs by
        name, as numpy arrays: outputs of run-time length are cut to it (see ``trims``).

        Host work runs around the plan: first the program inputs the host makes from strings
        (``host_feeds``), then the plan, then the outputs made on the host (``host_outputs``)."""
        direct = self._direct_outputs
        if direct is None:
            direct = self._direct_outputs = self._plain_outputs()
        if direct:  # no host work but finishing outputs: the inputs go straight to the plan
            arrays = self._run_plan(plan, [feeds[v.name] for v in self.inputs])
            return {name: arrays[k] if finish is None else finish(arrays[k]) for name, k, finish in direct}
        known: dict[Any, Any] = dict(feeds)  # graph input name, or program value id -> array
        memo: dict[int, Any] = {}
        for v in self.inputs:
            if v.name in feeds:
                known[v.id] = feeds[v.name]
        args = []
        made = dict(self.host_feeds)
        for v in self.inputs:
            if v.name in made:
                a = np.asarray(self._on_host(made[v.name], known, memo), dtype=v.type.dtype)
                if a.shape != v.type.shape:
                    raise OnnxRunError(f"{self.source}: {made[v.name].what} has shape {a.shape} on the host, "
                                       f"not the {v.type.shape} the program was built for")
                known[v.id] = a
            args.append(known[v.id])
        arrays = self._run_plan(plan, args)
        known.update((vid, arrays[k]) for vid, k in self.host_reads.items())
        result = {}
        for i, name in enumerate(self.output_names):
            if i in self.host_outputs:
                result[name] = self._on_host(self.host_outputs[i], known, memo)
                continue
            a = arrays[self.slots[i] if self.slots else i]
            if i in self.trims:
                a = a[(slice(None),) * self.trim_axes.get(i, 0) + (slice(0, int(arrays[self.trims[i]])),)]
            if i in self.finishes:
                a = self.finishes[i](a)
            result[name] = a
        return result

    def _run_plan(self, plan, args: Sequence[Any]) -> tuple[np.ndarray, ...]:
        try:
            return plan.run_numpy(*args)
        except PolyhalError:
            raise
        except Exception as exc:  # a kernel's own error (an index out of range in the data, ...)
            raise OnnxRunError(f"{self.source}: running the model failed: {type(exc).__name__}: "
                               f"{_first_line(exc)}") from exc

    def _plain_outputs(self) -> list[tuple[str, int, Any]] | bool:
        """For a program without host work (no inputs made on the host, no outputs made or
        trimmed there): ``(output name, plan result index, finish or None)`` per ONNX output,
        what :meth:`execute` returns without building its bookkeeping; else False."""
        if self.host_feeds or self.host_outputs or self.trims or self.host_reads:
            return False
        return [(name, self.slots[i] if self.slots else i, self.finishes.get(i))
                for i, name in enumerate(self.output_names)]

    def explain(self, plan=None) -> str:
        """Where every ONNX node's ops run (after compiling: ``plan``), what was folded at import
        time and which inputs were fixed, followed by the plan's own explanation."""
        lines = [f"model {self.source}: opset {self.opset}, {self.node_count} nodes -> "
                 f"{len(self.ops)} ops, {len(self.constants)} constants "
                 f"({sum(a.nbytes for _, a in self.constants)} B), {len(self.folded)} nodes folded at import"]
        for name, value in self.frozen.items():
            lines.append(f"  input {name!r} fixed at import to {value.dtype}{list(value.shape)} (it decides a shape)")
        if self.string_inputs or self.host_feeds or self.host_outputs:
            lines.append("on the host (strings; device buffers hold numbers):")
            for name in self.string_inputs:
                lines.append(f"  input {name!r} ({self.declared_inputs.get(name)}) stays on the host")
            for name, hv in self.host_feeds:
                lines.append(f"  before the plan: {hv.what} -> program input {name!r}")
            for i, hv in self.host_outputs.items():
                what = getattr(hv, "what", "a constant")
                lines.append(f"  after the plan: output {self.output_names[i]!r} ({what})")
        ops = plan.program.ops if plan is not None else self.ops
        origins = self.node_labels(plan) if plan is not None else self.origins
        by_node: dict[str, list] = collections.defaultdict(list)
        for op in ops:
            if op.kind == "dispatch":
                by_node[_origin(op, origins)].append(op)
        lines.append("ops by node:")
        for label, node_ops in by_node.items():
            where = collections.Counter(op.device or "(not placed)" for op in node_ops)
            placed = ", ".join(f"{d}" for d in where)
            lines.append(f"  {label}: {', '.join(op.name for op in node_ops)} -> {placed}")
        if plan is not None:
            transfers = [op for op in ops if op.kind == "transfer"]
            if transfers:
                lines.append("transfers:")
                for op in transfers:
                    src = plan.placement.value_device.get(op.inputs[0].id, "?")
                    lines.append(f"  %{op.inputs[0].name} {op.inputs[0].type}: {src} -> {op.device}")
        if self.folded:
            shown = ", ".join(self.folded[:20]) + (f" (+{len(self.folded) - 20} more)" if len(self.folded) > 20 else "")
            lines.append(f"folded at import: {shown}")
        if plan is not None:
            lines.append(plan.explain())
        return "\n".join(lines)


# --------------------------------------------------------------------------------- reading

def read_model(model: Any) -> tuple[pb.ModelProto, str]:
    """The ModelProto of ``model`` (path, bytes, file object or ModelProto) and a name for
    messages; OnnxModelError when it is not a readable ONNX model."""
    proto, source, _ = _read(model, split=False)
    return proto, source


def model_bytes(model: Any) -> tuple[bytes, str, str | None] | None:
    """The serialized model ``model`` names (a path, bytes or a binary file object), what
    messages call it, and its folder (a path's; None otherwise); None for an ``pb.ModelProto``,
    which has no bytes. :func:`parse_model` makes the ModelProto of the three."""
    if isinstance(model, pb.ModelProto):
        return None
    data, source, base_dir, _ = _data(model, split=False)
    return data, source, base_dir


def parse_model(data: bytes, source: str, base_dir: str | None) -> tuple[pb.ModelProto, int]:
    """The ModelProto of the bytes :func:`model_bytes` read, its external data read from
    ``base_dir`` (the model's folder), and how many tensors kept their data outside these bytes
    (0: ``data`` is the whole model)."""
    if not data:
        raise OnnxModelError(f"{source}: empty file, not an ONNX model")
    proto = pb.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise OnnxModelError(f"{source}: not an ONNX model, or a truncated one ({len(data)} bytes do not "
                             f"decode as pb.ModelProto: {exc})") from None
    if not proto.HasField("graph") or proto.ir_version <= 0:
        what = "no graph" if not proto.HasField("graph") else "no IR version"
        raise OnnxModelError(f"{source}: not an ONNX model ({len(data)} bytes decode, but with {what}); "
                             "is the file truncated, or another format?")
    external = load_external_data(proto, base_dir, source)  # every tensor at every depth, from the model's folder only
    return proto, external


def _data(model: Any, split: bool) -> tuple[bytes, str, str | None, dict[str, np.ndarray]]:
    """The bytes of ``model`` (not a ModelProto), what messages call it, its folder (a path's)
    and, with ``split``, a model file's large initializers read straight into arrays
    (:mod:`polyhal.frontends.onnx.wire`), by name: the bytes then hold them as placeholders."""
    base_dir, arrays = None, {}
    if isinstance(model, (bytes, bytearray, memoryview)):
        data, source = bytes(model), "<bytes>"
    elif hasattr(model, "read"):
        data, source = model.read(), getattr(model, "name", "<file>")
        if isinstance(data, str):
            raise OnnxModelError(f"{source}: opened in text mode; open ONNX models with 'rb'")
    else:
        try:
            path = os.fspath(model)
        except TypeError:
            raise OnnxModelError(f"cannot read a model from {type(model).__name__}; give a path, bytes "
                                 "or an onnx.ModelProto") from None
        source = str(path)
        if not os.path.isfile(path):
            raise OnnxModelError(f"{source}: no such file")
        with open(path, "rb") as f:
            taken = read_split(f, STRIP_ABOVE) if split else None
            data, arrays = taken if taken is not None else (f.read(), {})
        base_dir = os.path.dirname(os.path.abspath(path))
    return data, source, base_dir, arrays


def _read(model: Any, split: bool) -> tuple[pb.ModelProto, str, dict[str, np.ndarray]]:
    """:func:`read_model`, and with ``split`` a model file's large initializers read straight
    into arrays (:mod:`polyhal.frontends.onnx.wire`): the ModelProto then holds them as
    placeholders (name, type and dims, no data), and the arrays come third, by name."""
    if isinstance(model, pb.ModelProto):
        source = model.graph.name or "<model>"
        load_external_data(model, None, source)  # refuses external data (no folder): changes nothing
        return model, source, {}
    data, source, base_dir, arrays = _data(model, split)
    proto, _ = parse_model(data, source, base_dir)
    return proto, source, arrays


def default_opset(model: pb.ModelProto, source: str) -> int:
    """The model's default-domain opset, checked against :data:`SUPPORTED_OPSETS`."""
    if not model.opset_import:
        raise OnnxModelError(f"{source}: the model imports no opset (opset_import is empty); is it truncated?")
    versions = [o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS]
    if not versions:  # only other domains (ai.onnx.ml, ...): their ops say whether they run
        return MAX_OPSET
    opset = max(versions)
    if opset > MAX_OPSET:
        raise OnnxUnsupportedError(f"{source}: opset {opset} is newer than polyhal supports "
                                   f"(opsets {MIN_OPSET} to {MAX_OPSET}); convert the model with "
                                   f"onnx.version_converter.convert_version(model, {MAX_OPSET})")
    if opset < MIN_OPSET and not _same_ops_since(model.graph, opset, MIN_OPSET):
        raise OnnxUnsupportedError(f"{source}: opset {opset} is older than polyhal supports "
                                   f"(opsets {MIN_OPSET} to {MAX_OPSET}); convert the model with "
                                   f"onnx.version_converter.convert_version(model, {MIN_OPSET})")
    return opset


def _same_ops_since(graph: pb.GraphProto, old: int, new: int) -> bool:
    """Whether every default-domain op of ``graph`` has one definition from opset ``old`` to
    ``new`` (e.g. Not, unchanged since opset 1): such a model means what it would at ``new``."""
    for node in graph.node:
        if node.domain not in _DEFAULT_DOMAINS or any(a.g.node or a.graphs for a in node.attribute):
            return False
        defs = onnx_package().defs
        try:
            if defs.get_schema(node.op_type, old).since_version != defs.get_schema(node.op_type, new).since_version:
                return False
        except defs.SchemaError:
            return False
    return True


#: Initializers holding more bytes than this are kept out of the copies that validation makes.
STRIP_ABOVE = 1024


def _strip_weights(model: pb.ModelProto, arrays: Mapping[str, np.ndarray] | None = None
                   ) -> tuple[pb.ModelProto, dict[str, pb.TensorProto | np.ndarray]]:
    """A copy of ``model`` without the data of its large top-level initializers, and those
    initializers by name (the TensorProtos of ``model`` itself, not copies; for the
    placeholders of initializers read into ``arrays``, the arrays).

    ONNX's checker and shape inference serialize the model and parse it back (a transformer's
    weights would be held three or four times over); the copy they get declares each large
    initializer as a graph input of its type and shape instead. :func:`_restore_placeholders`
    turns those inputs back into data-less initializers that the importer fills from the
    originals, so the weights exist once in the ModelProto and once as arrays, never more
    (from a model file, only as arrays: :func:`_read` leaves them out of the ModelProto).
    """
    graph, arrays = model.graph, arrays or {}
    weights = {t.name: arrays.get(t.name, t) for t in graph.initializer if t.name in arrays or (
        len(t.raw_data) > STRIP_ABOVE and t.data_location != pb.TensorProto.EXTERNAL)}
    if not weights:
        return model, {}
    light = pb.ModelProto()
    for fd, value in model.ListFields():
        if fd.name != "graph":
            _copy_field(light, fd, value)
    for fd, value in graph.ListFields():
        if fd.name != "initializer":
            _copy_field(light.graph, fd, value)
    declared = {i.name for i in graph.input}
    for t in graph.initializer:
        if t.name not in weights:
            light.graph.initializer.append(t)
        elif t.name not in declared:
            light.graph.input.append(tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light, weights


def _copy_field(dst: Any, fd: Any, value: Any) -> None:
    try:
        if isinstance(value, Message):
            getattr(dst, fd.name).CopyFrom(value)
        elif isinstance(value, (str, bytes, int, float)):
            setattr(dst, fd.name, value)
        else:  # a repeated field
            getattr(dst, fd.name).extend(value)
    except UnicodeDecodeError:
        # protobuf parses a proto2 string field without checking its UTF-8; setting it does check.
        raise OnnxModelError(f"the model's {fd.name!r} field holds text that is not UTF-8: the file is damaged "
                             "or was not written as ONNX") from None


def _restore_placeholders(model: pb.ModelProto, original: pb.ModelProto,
                          weights: Mapping[str, pb.TensorProto | np.ndarray]) -> pb.ModelProto:
    """Undo :func:`_strip_weights` on the (inferred) copy: the inputs it added go, and every
    stripped initializer comes back in its place as a TensorProto with name, type and dims but
    no data (:meth:`_Importer.initializer` reads the data from ``weights``)."""
    if not weights:
        return model
    declared = {i.name for i in original.graph.input}
    inputs = [i for i in model.graph.input if i.name not in weights or i.name in declared]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    stripped = {t.name: t for t in model.graph.initializer}
    del model.graph.initializer[:]
    for t in original.graph.initializer:
        w = weights.get(t.name)
        model.graph.initializer.append(stripped[t.name] if w is None else
                                       pb.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims))
    return model


def _fill_placeholders(model: pb.ModelProto, weights: Mapping[str, pb.TensorProto | np.ndarray]
                       ) -> pb.ModelProto:
    """``model`` with the data of its placeholder initializers copied back in from ``weights``."""
    for t in model.graph.initializer:
        w = weights.get(t.name)
        if isinstance(w, np.ndarray):
            t.raw_data = w.tobytes()
        elif w is not None:
            t.CopyFrom(w)
    return model


# ------------------------------------------------------------------------------------ load

def load(model: Any, *, shapes: Mapping[str, Sequence[int]] | None = None,
         values: Mapping[str, Any] | None = None, dims: Mapping[str, int] | None = None,
         default_dim: int | None = None, name: str | None = None, validate: bool = True,
         source: str | None = None, fold_limit: int | str | None = None, strict_shapes: bool = False
         ) -> OnnxProgram | DynamicOnnxProgram | StagedOnnxProgram:
    """Import an ONNX model as a polyhal program.

    When every input dim is known (fixed by the model, or given by ``shapes``, ``dims`` or
    ``default_dim``) the result is a static :class:`OnnxProgram`. Otherwise it is a
    :class:`~polyhal.frontends.onnx.dynamic.DynamicOnnxProgram`, whose compiled plan specializes
    per input shape on first use (symbols given in ``dims`` stay bound to those sizes). A model
    that one static plan cannot hold (an If or Loop decided by data, NonZero or Unique feeding
    later ops, sequences, optionals) is a
    :class:`~polyhal.frontends.onnx.staged.StagedOnnxProgram`: plans per segment, specialized
    to the shapes each sees, joined by host control flow.

    Args:
        model: a path, the model's bytes, a binary file object or an ``onnx.ModelProto``.
        shapes: ``{input: shape}`` for inputs whose declared shape has symbolic dims (a given
            shape must agree with the dims the model fixes).
        values: ``{input: array}``: graph inputs to fix to these values at import time (they
            are then not inputs of the program). Needed for inputs that decide shapes.
        dims: ``{symbol: size}`` for symbolic dims by name (``{"batch": 8}``), for every input
            that uses them.
        default_dim: the size of symbolic dims not given otherwise (default: none; they are then
            taken from each call's inputs).
        name: the program's name (default: the graph's).
        validate: run ONNX's checker and strict shape inference first.
        source: what messages call the model (default: its path, or its graph's name).
        fold_limit: the largest result in bytes (or ``"64MiB"``) an op may produce by running at
            import time; larger ones stay in the program (default ``POLYHAL_FOLD_LIMIT``, else
            :data:`FOLD_LIMIT`).
        strict_shapes: refuse a model whose graph output's declared shape contradicts what it
            computes (default: trust the data, as onnxruntime does, with one
            :class:`~polyhal.frontends.onnx.errors.DeclaredShapeWarning` per output).

    Raises:
        OnnxModelError: not a model, truncated, or inconsistent.
        OnnxUnsupportedError: an opset, op, element type or feature polyhal lacks
            (:class:`NeedsValue` when an operand that decides a shape comes from nothing a run
            can change).
        OnnxInputError: ``shapes`` / ``values`` that do not fit the model.
    """
    proto, read_as, arrays = _read(model, split=True)
    source = source or read_as
    opset = default_opset(proto, source)
    light, weights = _strip_weights(proto, arrays) if validate else (proto, arrays)
    checked = _restore_placeholders(validated(light, source), proto, weights) if validate else proto
    del light
    shapes, values, dims = shapes or {}, values or {}, {str(k): int(v) for k, v in (dims or {}).items()}
    limit = _fold_limit(fold_limit)
    outputs = _DeclaredOutputs(strict_shapes)

    def specialize(concrete: Mapping[str, Sequence[int]]) -> OnnxProgram:
        importer = _Importer(checked, source, opset, {**shapes, **concrete}, values, dims, default_dim, name, limit,
                             weights, outputs)
        try:
            # As compile does: the program's objects outlive young generations. Said on a terminal
            # where it takes over a second (a large model).
            with cycle_collection_paused(), long_work(f"importing {source}", f"imported {source}", after=SAY_AFTER):
                return importer.run()
        except PolyhalError:
            raise
        except RecursionError:
            raise OnnxModelError(f"{source}: the graph nests too deeply") from None
        except Exception as exc:  # noqa: BLE001  (a malformed model the checks above did not foresee)
            raise OnnxModelError(f"{source}: malformed model ({type(exc).__name__}: {_first_line(exc)})") from exc

    def staged() -> StagedOnnxProgram:
        def segment(model: pb.ModelProto, seg_shapes, seg_values) -> OnnxProgram:
            return _Importer(model, source, opset, seg_shapes, seg_values, {}, None, None, limit,
                             declared_outputs=outputs).run()
        # staging cuts submodels out of the whole model: the weights go back in
        whole = _fill_placeholders(checked, weights) if weights else checked
        return StagedOnnxProgram(whole, source=source, opset=opset, import_segment=segment)

    if needs_staging(checked):
        return staged()
    initialized = {t.name for t in checked.graph.initializer}
    _check_symbols([i for i in checked.graph.input if i.name not in initialized or i.name in values], dims, source)
    signature = _signature(checked, shapes, values, dims, default_dim)
    if signature is None or all(s.dims is not None and all(isinstance(d, int) or d in dims for d in s.dims)
                                for s in signature):
        try:
            program = specialize({})
        except NeedsStaging:
            return staged()
        except NeedsValue as exc:
            if not _stages(exc, values):
                raise
            return staged()  # each segment is specialized per value of the inputs that decide shapes
        del proto, checked, weights
        trim_heap()  # the heap pages freed with the parsed ModelProto (protobuf's many small blocks)
        return program
    if needs_staging(checked, any_host_op=True):
        return staged()  # staging specializes each segment to the shapes it sees
    try:
        symbolic, reimport = _import_symbolic(specialize, signature, dims)
    except NeedsValue as exc:
        if not _stages(exc, values):
            raise
        return staged()
    return DynamicOnnxProgram(source=source, opset=opset, signature=signature, bound=dims,
                              output_names=[o.name for o in checked.graph.output], specialize=specialize,
                              program=symbolic, reimport=reimport)


def _import_symbolic(specialize: Callable[[Mapping[str, tuple]], OnnxProgram], signature: Sequence[InputSignature],
                     bound: Mapping[str, int]) -> tuple[OnnxProgram | None, str]:
    """The model imported once with its open dims symbolic (a named dim by its name, an unnamed
    one as ``input[axis]``, one symbol each; ``dims=`` sizes put in), and ``""``; or None and
    why the model must be imported per shape: a node needs a symbolic dim's size at import
    (``Shape`` of it, a shape computed from it), or the model has inputs or outputs the host
    makes, whose code reads concrete shapes."""
    shapes = {s.name: tuple(bound.get(d, d) if isinstance(d, str) else f"{s.name}[{axis}]" if d is None else d
                            for axis, d in enumerate(s.dims)) for s in signature if s.dims is not None}
    if len(shapes) < len(signature):
        return None, "an input declares no rank"
    try:
        program = specialize(shapes)
    except NeedsValue:
        raise
    except PolyhalError as exc:
        return None, _first_line(exc)
    if program.string_inputs or program.host_feeds or program.host_outputs or program.trims or program.finishes:
        return None, "the host makes some of its inputs or outputs (strings, run-time lengths, ZipMap)"
    symbolic = [op for op in program.ops if _has_symbol(op.attrs)]
    if symbolic:
        return None, f"an op's attribute holds a symbolic dim ({program.origin(symbolic[0])})"
    return program, ""


def _stages(exc: NeedsValue, values: Mapping[str, Any]) -> bool:
    """Whether a model that raised ``exc`` at import runs staged instead: the operand that decides
    a shape comes from graph inputs given at run time (TopK's k, Range's bounds, LSTM's sequence
    lengths, a Reshape target), so the staged runner fixes them to each run's values, one plan
    per value in the bounded specialization cache. Inputs fixed by ``values=`` cannot change."""
    return bool(exc.inputs) and not exc.inputs & set(values)


def _has_symbol(attrs: Any) -> bool:
    if isinstance(attrs, SymbolicDim):
        return True
    return isinstance(attrs, tuple) and any(map(_has_symbol, attrs))


def _check_symbols(graph_inputs: Iterable[pb.ValueInfoProto], dims: Mapping[str, int], source: str) -> None:
    """Refuse ``dims`` naming a symbol that no input uses (a misspelt symbol would otherwise
    leave its dim at the default, or free, silently)."""
    symbols = {d.dim_param for vi in graph_inputs if vi.type.WhichOneof("value") == "tensor_type"
               for d in vi.type.tensor_type.shape.dim if d.dim_param}
    unknown = sorted(set(dims) - symbols)
    if unknown:
        raise OnnxInputError(f"{source}: the model's inputs have no symbolic dim {unknown[0]!r}; "
                             f"their symbolic dims are {', '.join(sorted(symbols)) or '(none)'}")


def _signature(model: pb.ModelProto, shapes, values, dims, default_dim) -> list[InputSignature] | None:
    """The run-time inputs of ``model`` with the dims ``shapes``, ``dims`` and ``default_dim`` fix
    put in; None when some input is not a tensor (the static import reports that)."""
    initialized = {t.name for t in model.graph.initializer}
    out = []
    for vi in model.graph.input:
        if (vi.name in initialized and vi.name not in values) or vi.name in values:
            continue
        if vi.type.WhichOneof("value") != "tensor_type":
            return None
        elem, declared = _declared(vi.type)
        try:
            dtype = value_dtype(elem or 0, f"input {vi.name!r}")
        except OnnxError:
            return None  # the static import reports the element type
        if vi.name in shapes:
            spec: tuple | None = tuple(int(d) for d in shapes[vi.name])
        elif declared is None:
            if default_dim is not None:
                return None  # a static import was asked for: it says that this input needs a shape
            spec = None
        else:
            params = [d.dim_param for d in vi.type.tensor_type.shape.dim]
            # A symbol keeps its name (dims= binds it: DynamicOnnxProgram.bind checks that);
            # default_dim stands for every other dynamic dim, as in a static import.
            spec = tuple(d if d is not None else p if p in dims else default_dim if default_dim is not None
                         else p or None for d, p in zip(declared, params))
        out.append(InputSignature(vi.name, dtype, spec, _fmt_declared(elem, declared, vi.type)))
    return out


class _Importer:
    def __init__(self, model: pb.ModelProto, source: str, opset: int, shapes, values, dims, default_dim, name,
                 fold_limit: int = FOLD_LIMIT, weights: Mapping[str, pb.TensorProto | np.ndarray] | None = None,
                 declared_outputs: "_DeclaredOutputs | None" = None):
        self.model = model
        self.declared_outputs = declared_outputs or _DeclaredOutputs(False)
        self.graph_outputs = {o.name for o in model.graph.output}
        self.weights = weights or {}
        self.fold_limit = fold_limit
        self.source = source
        self.opset = opset
        # (a str dim is a symbolic dim: the import of a DynamicOnnxProgram's one program)
        self.shapes = {k: tuple(d if isinstance(d, str) else int(d) for d in v) for k, v in shapes.items()}
        self.values = dict(values)
        self.dims = {str(k): int(v) for k, v in dims.items()}
        self.default_dim = default_dim
        graph = model.graph
        self.builder = ProgramBuilder(name or graph.name or "onnx")
        self.opsets = {o.domain or "": o.version for o in model.opset_import}
        self.opsets[""] = opset
        self.functions = {(f.domain, f.name): f for f in model.functions}
        self.deps: dict[int, frozenset[str]] = {}
        self.origins: dict[int, str] = {}
        self.folded: list[str] = []
        self._const_values: dict[int, tuple[np.ndarray, Value]] = {}
        self._renamed: set[int] = set()
        self.declared: dict[str, pb.TypeProto] = {}
        for vi in list(graph.value_info) + list(graph.output):
            self.declared[vi.name] = vi.type
        self.node_count = 0
        self.input_ids: set[int] = set()  # program inputs: known before the plan runs
        self.string_inputs: dict[str, tuple] = {}
        self.host_feeds: list[tuple[str, HostValue]] = []
        self._fed: dict[int, tuple[HostValue, Value]] = {}

    # -- values ----------------------------------------------------------------------------

    def type_of(self, v: Val) -> TensorType:
        if isinstance(v, (Value, HostValue)):
            return v.type if isinstance(v, Value) else TensorType(v.shape, v.dtype)
        return TensorType(v.shape, v.dtype)

    def as_value(self, v: Val) -> Value:
        """A program value for ``v``: constants become program constants (one per array)."""
        if isinstance(v, Value):
            return v
        found = self._const_values.get(id(v))
        if found is not None and found[0] is v:
            return found[1]
        # The importer's arrays (initializers, folded results) are read-only and never written.
        value = self.builder.constant(v, "const", copy=False)
        self.deps[value.id] = frozenset()
        self._const_values[id(v)] = (v, value)
        return value

    def emit(self, label: str, op: str, inputs: Sequence[Val], attrs: Mapping[str, Any]) -> Any:
        """Op ``op`` on ``inputs``: folded to arrays when every input is known, else a dispatch."""
        types = tuple(self.type_of(v) for v in inputs)
        try:
            out_types = infer_types(op, types, attrs)
        except DTypeError as exc:
            storage = sorted({str(t.dtype) for t in types if t.dtype in STORAGE_DTYPES})
            if not storage:
                raise
            if _computes_widened(types):
                return self._emit_widened(label, op, inputs, attrs)
            raise OnnxUnsupportedError(
                f"{label}: {op} on {', '.join(storage)}: polyhal stores and converts these types (Cast, "
                "QuantizeLinear, DequantizeLinear) but computes only in float16/32/64, the integer types and "
                "bfloat16 (in float32); "
                "cast to float32 first") from exc
        if all(isinstance(v, np.ndarray) for v in inputs) and all(t.nbytes <= self.fold_limit for t in out_types):
            with np.errstate(all="ignore"):
                outs = OPS[op].reference(*inputs, **attrs)
            outs = tuple(np.array(o, dtype=t.dtype, order="C").reshape(t.shape)
                         for o, t in zip(outs, out_types))
            return outs[0] if len(outs) == 1 else outs
        values = [self.as_value(v) for v in inputs]
        result = self.builder.append(op, values, out_types, attrs)  # types inferred above
        results = result if isinstance(result, tuple) else (result,)
        deps = frozenset().union(*(self.deps.get(v.id, frozenset()) for v in values)) if values else frozenset()
        for r in results:
            self.deps[r.id] = deps
            self.origins[r.id] = label
        return result

    def _emit_widened(self, label: str, op: str, inputs: Sequence[Val], attrs: Mapping[str, Any]) -> Any:
        """Op ``op`` computed in float32 on bfloat16 operands: they are cast to float32, the op
        runs, and its float32 results are rounded back to bfloat16 (see :data:`BFLOAT16`)."""
        wide = [self.emit(label, "cast", [v], {"dtype": "float32"}) if self.type_of(v).dtype in BFLOAT16 else v
                for v in inputs]
        result = self.emit(label, op, wide, attrs)
        results = result if isinstance(result, tuple) else (result,)
        narrow = tuple(self.emit(label, "cast", [r], {"dtype": "bfloat16"})
                       if self.type_of(r).dtype == np.float32 else r for r in results)
        return narrow if isinstance(result, tuple) else narrow[0]

    def host(self, compute, args: Sequence[Any], dtype: Any, shape: Any, what: str) -> Any:
        """``compute(*args)`` on the host: now, when no arg is computed at run time (a program
        value or a :class:`HostValue`), else a HostValue that the program evaluates around its plan."""
        if not any(isinstance(a, (Value, HostValue)) for a in args):
            result = compute(*args)
            for a in result if isinstance(result, tuple) else (result,):
                if isinstance(a, np.ndarray):
                    a.flags.writeable = False
            return result
        after = any(isinstance(a, Value) and a.id not in self.input_ids for a in args)
        return HostValue(compute, args, dtype, shape, what, after_plan=after)

    def host_feed(self, hv: HostValue) -> Value:
        """The program input that ``hv`` (numbers made on the host) becomes when a device op
        uses it; the program evaluates ``hv`` before the plan runs."""
        found = self._fed.get(id(hv))
        if found is not None:
            return found[1]
        if hv.dtype is None or hv.dtype == STRING_DTYPE:
            raise OnnxUnsupportedError(f"{hv.what} holds strings, which device ops cannot take")
        if hv.after_plan:
            raise OnnxUnsupportedError(
                f"{hv.what} is computed on the host from results of the device plan, and a device op uses it; "
                "polyhal runs host work (strings) before and after the plan, not between its ops")
        if hv.shape is None:
            raise OnnxUnsupportedError(
                f"{hv.what} has a shape that depends on the data (it is computed on the host), and a device op "
                "uses it; polyhal programs have static shapes")
        name, n = "host", 0
        while name in self.builder._names:
            n += 1
            name = f"host{n}"
        value = self.builder.input(name, hv.shape, hv.dtype)
        names, values = hv.reads()
        self.deps[value.id] = frozenset(names).union(*(self.deps.get(v.id, frozenset()) for v in values))
        self.input_ids.add(value.id)
        self.host_feeds.append((name, hv))
        self._fed[id(hv)] = (hv, value)
        return value

    def check_fold(self, nbytes: int, what: str) -> None:
        """Refuse to build ``what`` (``nbytes``) at import when it exceeds the fold limit and no
        polyhal op can compute it at run time instead."""
        if nbytes > self.fold_limit:
            raise OnnxUnsupportedError(
                f"{what} would take {nbytes} bytes at import, more than the fold limit of {self.fold_limit} "
                "bytes; raise it with POLYHAL_FOLD_LIMIT or load(..., fold_limit=) if that much is intended")

    # -- the graph -------------------------------------------------------------------------

    def run(self) -> OnnxProgram:
        graph = self.model.graph
        env: dict[str, Val] = {}
        for t in graph.initializer:
            env[t.name] = self.initializer(t, self.weights.get(t.name, t))
        for t in graph.sparse_initializer:
            env[t.values.name] = _Unsupported(f"sparse initializer {t.values.name!r}")
        declared_inputs = {}
        feed_names = []
        graph_inputs = [i for i in graph.input if i.name not in env or i.name in self.values]
        known = {i.name for i in graph.input}
        for k in list(self.shapes) + list(self.values):
            if k not in known:
                raise OnnxInputError(f"{self.source}: the model has no input {k!r}; its inputs are "
                                     f"{[i.name for i in graph_inputs]}")
        _check_symbols(graph_inputs, self.dims, self.source)
        # Symbols that inputs of given shape size (and contradictions among those shapes and
        # dims=) are settled before any input takes default_dim.
        signature = _signature(self.model, {}, self.values, {}, None) or []
        given = [s for s in signature if s.name in self.shapes]
        self.dims = bind_dims(self.source, given, [self.shapes[s.name] for s in given], self.dims)
        for vi in graph.input:
            elem, dims = _declared(vi.type)
            if vi.name in env and vi.name not in self.values:
                self._check_initializer_decl(vi, env[vi.name])
                continue
            declared_inputs[vi.name] = _fmt_declared(elem, dims, vi.type)
            env[vi.name] = self._graph_input(vi, elem, dims)
            if not isinstance(env[vi.name], np.ndarray):
                feed_names.append(vi.name)
        self.convert_nodes(graph.node, env, self.opsets, "")
        outputs, names, counts, slots = [], [], [], []
        trims: dict[int, int] = {}
        trim_axes: dict[int, int] = {}
        finishes: dict[int, Any] = {}
        host_outputs: dict[int, Any] = {}
        seen: set[int] = set()

        def result(v: Val, name: str) -> Value:
            # A plan returns results of dispatches: an output that is a constant, an input or
            # another output is copied by an identity op.
            if not isinstance(v, Value) or v.id in seen or v.id not in self.origins:
                v = self.emit(f"output {name!r}", "identity", [self.as_value(v)], {})
            seen.add(v.id)
            return v

        for vi in graph.output:
            if vi.name not in env:
                raise OnnxModelError(f"{self.source}: graph output {vi.name!r} is not produced by any node, "
                                     "input or initializer")
            v = env[vi.name]
            if isinstance(v, _Unsupported):
                raise OnnxUnsupportedError(f"{self.source}: graph output {vi.name!r}: {v.reason}")
            if isinstance(v, HostValue) or is_strings(v):
                host_outputs[len(names)] = v
                slots.append(-1)
                names.append(vi.name)
                continue
            if isinstance(v, HostOutput):
                finishes[len(names)] = v.finish
                v = v.value
            if isinstance(v, Dynamic):
                trims[len(names)] = len(counts)
                if v.axis:
                    trim_axes[len(names)] = v.axis
                counts.append(result(v.count, vi.name + ":count"))
                v = v.padded
            slots.append(len(outputs))
            outputs.append(result(v, vi.name))
            names.append(vi.name)
        trims = {i: len(outputs) + c for i, c in trims.items()}
        # Host outputs read the plan's results they are made from: those become program outputs.
        reads: dict[int, Value] = {}
        for v in host_outputs.values():
            if isinstance(v, HostValue):
                reads.update((r.id, r) for r in v.reads()[1] if r.id not in self.input_ids)
        returned = {v.id: k for k, v in enumerate(outputs)}  # results the plan returns anyway
        fresh = [r for r in reads.values() if r.id not in returned]
        read_outputs = [result(r, f"host reads {r.name}") for r in fresh]
        host_reads = {vid: returned[vid] for vid in reads if vid in returned}
        host_reads.update((r.id, len(outputs) + len(counts) + k) for k, r in enumerate(fresh))
        if not outputs and not counts and not read_outputs:
            # Every output is made on the host; a program has at least one result.
            outputs.append(self.emit("(every output is made on the host)", "identity",
                                     [self.as_value(np.zeros(0, np.int8))], {}))
        self.builder.output(*outputs, *counts, *read_outputs)
        base = _without_dead_ops(self.builder.build())
        frozen = {k: env[k] for k in self.values if isinstance(env.get(k), np.ndarray)}
        return OnnxProgram(base.name, base.inputs, base.ops, base.outputs, base.constants,
                           source=self.source, opset=self.opset, output_names=names,
                           declared_inputs=declared_inputs, origins=self.origins, folded=self.folded,
                           frozen=frozen, node_count=self.node_count, trims=trims, trim_axes=trim_axes,
                           finishes=finishes, feed_names=feed_names, string_inputs=self.string_inputs,
                           host_feeds=self.host_feeds, host_outputs=host_outputs, host_reads=host_reads,
                           slots=slots)

    def initializer(self, t: pb.TensorProto, data: pb.TensorProto | np.ndarray | None = None) -> Val:
        """An initializer as a read-only array (an unsupported element type is reported when
        the initializer is used, so unused ones do no harm). ``data``: the TensorProto holding
        its data (default ``t``), or the flat array it was read into from the model file."""
        try:
            if not isinstance(data, np.ndarray):
                return self.tensor_value(t if data is None else data, f"initializer {t.name!r}")
            dtype = value_dtype(t.data_type, f"initializer {t.name!r}")
            if data.size != int(np.prod(t.dims, dtype=np.int64)):
                raise OnnxModelError(f"{self.source}: initializer {t.name!r} declares dims {list(t.dims)} "
                                     f"but holds {data.size} elements")
            arr = data.reshape(tuple(t.dims))  # a view of the read-only array the file was read into
            if arr.dtype != dtype:
                arr = arr.astype(dtype)
                arr.flags.writeable = False
            return arr
        except OnnxUnsupportedError as exc:
            return _Unsupported(str(exc))

    def tensor_value(self, t: pb.TensorProto, what: str) -> np.ndarray:
        """The data of tensor ``t`` (an initializer, a tensor attribute) as a read-only array;
        ``what`` names it in errors."""
        dtype = value_dtype(t.data_type, what)
        try:
            arr = tensor_array(t, f"{self.source}: {what}")
        except OnnxModelError:
            raise
        except Exception as exc:  # noqa: BLE001  (malformed tensors raise anything)
            raise OnnxModelError(f"{self.source}: {what} is malformed: {_first_line(exc)}") from None
        if tuple(arr.shape) != tuple(t.dims):
            raise OnnxModelError(f"{self.source}: {what} declares dims {list(t.dims)} but holds {arr.size} elements")
        if dtype == STRING_DTYPE:
            arr = as_strings(arr, f"{self.source}: {what}")
        # No second copy: to_array of raw_data is already a C-ordered array over bytes of its own
        # (protobuf hands out a copy of raw_data), read-only. ascontiguousarray would make 0-d 1-d.
        arr = np.asarray(arr, dtype=dtype, order="C")
        arr.flags.writeable = False
        return arr

    def _check_initializer_decl(self, vi: pb.ValueInfoProto, arr: Val) -> None:
        if not isinstance(arr, np.ndarray):
            return
        elem, dims = _declared(vi.type)
        if dims is not None and (len(dims) != arr.ndim or any(d is not None and d != s for d, s in zip(dims, arr.shape))):
            raise OnnxModelError(f"{self.source}: input {vi.name!r} is declared {_fmt_declared(elem, dims, vi.type)} "
                                 f"but its initializer has shape {list(arr.shape)}")

    def _graph_input(self, vi: pb.ValueInfoProto, elem: int | None, dims: tuple | None) -> Val:
        what = f"input {vi.name!r}"
        if vi.type.WhichOneof("value") != "tensor_type":
            kind = vi.type.WhichOneof("value") or "untyped"
            raise OnnxUnsupportedError(f"{self.source}: {what} is a {kind.replace('_type', '')}, not a tensor; "
                                       "polyhal runs tensor models only")
        dtype = value_dtype(elem or 0, f"{self.source}: {what}")
        decl = _fmt_declared(elem, dims, vi.type)
        if vi.name in self.values:
            arr = self.values[vi.name]
            arr = as_strings(arr, f"{self.source}: {what}") if dtype == STRING_DTYPE else np.asarray(arr)
            if arr.dtype != dtype:
                raise OnnxInputError(f"{self.source}: {what} is declared {decl} but its value has element type {arr.dtype}")
            self._check_shape(what, decl, dims, arr.shape)
            arr = np.array(arr, order="C")
            arr.flags.writeable = False
            return arr
        if vi.name in self.shapes:
            shape = self.shapes[vi.name]
            self._check_shape(what, decl, dims, shape)
        elif dims is None:
            raise OnnxInputError(f"{self.source}: {what} ({decl}) declares no shape; give one "
                                 f"(load(..., shapes={{{vi.name!r}: (...)}}) or polyhal run --input)")
        elif any(d is None for d in dims):
            symbols = [d.dim_param for d in vi.type.tensor_type.shape.dim]
            shape = tuple(self.dims.get(sym, self.default_dim) if d is None else d for d, sym in zip(dims, symbols))
            if any(d is None for d in shape):
                raise OnnxInputError(f"{self.source}: {what} has symbolic dims ({decl}); give their sizes "
                                     f"(load(..., dims={{'name': size}}) or shapes={{{vi.name!r}: (...)}}; "
                                     "polyhal run --dim NAME=SIZE, --shape or --input)")
        else:
            shape = dims
        if dtype == STRING_DTYPE:  # strings stay on the host (see HostValue)
            self.string_inputs[vi.name] = tuple(shape)
            return HostValue(None, (), dtype, shape, f"string input {vi.name!r}", name=vi.name)
        value = self.builder.input(vi.name, shape, dtype)
        self.deps[value.id] = frozenset([vi.name])
        self.input_ids.add(value.id)
        return value

    def _check_shape(self, what: str, decl: str, dims: tuple | None, shape: tuple) -> None:
        if dims is None:
            return
        if len(dims) != len(shape) or any(d is not None and d != s for d, s in zip(dims, shape)):
            raise OnnxInputError(f"{self.source}: {what} is declared {decl}, which shape {tuple(shape)} does not fit")

    def convert_nodes(self, nodes: Iterable[pb.NodeProto], env: dict, opsets: Mapping[str, int], prefix: str,
                      check_declared: bool = True) -> None:
        """Convert ``nodes`` in order into ``env``. Function bodies and subgraphs are walked with
        a ``prefix`` for their labels and without the graph's declared types (their names are
        their own)."""
        for index, node in enumerate(nodes):
            self.node_count += 1 if not prefix else 0
            label = _label(node, index, prefix)
            try:
                outs = convert_node(self, node, env, opsets, label)
            except NeedsValue:
                raise
            except OnnxError as exc:
                raise _with_context(exc, self.source, label) from None
            except PolyhalError as exc:  # a shape or type error from an op's inference
                raise _with_context(exc, self.source, label) from None
            except RecursionError:
                raise OnnxModelError(f"{self.source}: node {label}: functions or subgraphs nest too deeply") from None
            except Exception as exc:  # noqa: BLE001  (a model the converters did not foresee)
                raise OnnxModelError(f"{self.source}: node {label}: cannot convert it "
                                     f"({type(exc).__name__}: {_first_line(exc)})") from exc
            produced = 0
            for name, v in zip(node.output, outs):
                if not name:
                    continue
                if v is None:
                    raise OnnxUnsupportedError(f"{self.source}: node {label}: output {name!r} is not supported")
                if check_declared:
                    self._check_declared(name, v, label)
                if isinstance(v, Value) and self.origins.get(v.id) == label and v.id not in self._renamed:
                    # Values carry the model's names, so that explain and errors read like the model.
                    v.name = self.builder._fresh(name)
                    self._renamed.add(v.id)
                env[name] = v
                produced += 1
            for name in node.output[len(outs):]:
                if name:
                    raise OnnxUnsupportedError(f"{self.source}: node {label}: output {name!r} is not supported")
            if produced and all(isinstance(v, np.ndarray) for n, v in zip(node.output, outs) if n):
                self.folded.append(label)

    def _check_declared(self, name: str, v: Val, label: str) -> None:
        tp = self.declared.get(name)
        if tp is None or isinstance(v, (_Unsupported, HostOutput)):
            return
        elem, dims = _declared(tp)
        if isinstance(v, HostValue) or is_strings(v):
            dtype, shape = v.dtype, v.shape
            strings = elem == pb.TensorProto.STRING
            if elem and dtype is not None and strings != (dtype == STRING_DTYPE):
                raise OnnxModelError(f"{self.source}: node {label}: output {name!r} is declared "
                                     f"{_fmt_declared(elem, dims, tp)} but computes {'strings' if not strings else dtype}")
            if shape is None or dtype == STRING_DTYPE:
                return
            v = HostValue(None, (), dtype, shape, "")  # numbers from strings: checked as a tensor below
        if isinstance(v, Dynamic):  # only the element type and the static dims are known
            axis = v.axis
            v, dims = v.padded, None if dims is None else dims[:axis] + (None,) + dims[axis + 1:]
        t = self.type_of(v)
        if elem:
            try:
                want = np_dtype(elem, name)
            except OnnxError:
                want = None
            if want is not None and want != t.dtype:
                raise OnnxModelError(f"{self.source}: node {label}: output {name!r} is declared "
                                     f"{_fmt_declared(elem, dims, tp)} but computes {t.dtype}")
        # (a symbolic dim is checked by the op's inference when the program is specialized)
        if dims is not None and (len(dims) != t.rank or any(d is not None and not isinstance(s, SymbolicDim) and d != s
                                                            for d, s in zip(dims, t.shape))):
            what = (f"{self.source}: node {label}: output {name!r} is declared {_fmt_declared(elem, dims, tp)} "
                    f"but the data gives shape {list(t.shape)} (declared shapes contradict the data)")
            if name in self.graph_outputs:
                self.declared_outputs.contradicted(name, what)
            else:
                raise OnnxModelError(what)


#: bfloat16, which ONNX models may compute in (a bf16 Attention, Einsum, Celu): a storage type of
#: the IR, so an op that has no bfloat16 form computes in float32, which holds every bfloat16
#: exactly: its operands are cast up, its results rounded back. Op by op, so each result is
#: rounded as a bfloat16 computation rounds it (onnx's reference evaluator, whose numpy ops on
#: ml_dtypes arrays compute in float32 and round each result; onnxruntime's CPU provider
#: likewise casts around the kernels it lacks). Data movement (reshape, gather, concat, ...) and
#: cast keep bfloat16: only ops that cannot take it widen. A set (of the one type), so that asking
#: imports no ml_dtypes where no bfloat16 can exist (see :class:`~polyhal.ir.types.DTypeSet`).
BFLOAT16 = DTypeSet(("bfloat16",))


def _computes_widened(types: Sequence[TensorType]) -> bool:
    """Whether an op refused on ``types`` computes in float32 instead: some operands are
    bfloat16 and no other is of another float or storage type (a mix has no one result type)."""
    floats = {t.dtype for t in types if t.dtype.kind == "f" or t.dtype in STORAGE_DTYPES}
    return len(floats) == 1 and next(iter(floats)) in BFLOAT16


class _DeclaredOutputs:
    """What a load does with a graph output whose declared shape contradicts the data: refuse
    (``strict``), or trust the data as onnxruntime does and warn once per output and model (a
    model imported per shape or per segment is imported many times over)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.warned: set[str] = set()

    def contradicted(self, name: str, what: str) -> None:
        if self.strict:
            raise OnnxModelError(f"{what}; load it without strict_shapes=True to trust the data, as onnxruntime does")
        if name not in self.warned:
            self.warned.add(name)
            warnings.warn(f"{what}: polyhal trusts the data, as onnxruntime does (strict_shapes=True refuses)",
                          DeclaredShapeWarning, stacklevel=2)


class _Unsupported:
    """Stands in the environment for a value polyhal cannot hold (raised when it is used)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _without_dead_ops(program: Program) -> Program:
    """``program`` without the ops and constants no output depends on: what converters emitted
    and a later node made unneeded (a Scaler whose scaling a tree ensemble took into its
    thresholds), and nodes of the model whose results nothing reads."""
    live = {v.id for v in program.outputs}
    kept = []
    for op in reversed(program.ops):
        if any(v.id in live for v in op.outputs):
            kept.append(op)
            live.update(v.id for v in op.inputs)
    if len(kept) == len(program.ops):
        return program
    return dataclasses.replace(program, ops=kept[::-1], constants=[(v, a) for v, a in program.constants
                                                                   if v.id in live])


def _origin(op, origins: Mapping[int, str]) -> str:
    """The node label of the first result of ``op`` that ``origins`` knows."""
    return next((origins[v.id] for v in op.outputs if v.id in origins), "(import)")


def _label(node: pb.NodeProto, index: int, prefix: str) -> str:
    name = node.name or (f"#{index}" + (f" -> {node.output[0]}" if node.output and node.output[0] else ""))
    return f"{prefix}{name!s} ({node.op_type})" if node.name else f"{prefix}{name} ({node.op_type})"


def _with_context(exc: PolyhalError, source: str, label: str) -> PolyhalError:
    """``exc`` with its message prefixed by the model and node (same class and attributes)."""
    text = str(exc)
    if label not in text:
        text = f"node {label}: {text}"
    if not text.startswith(source):
        text = f"{source}: {text}"
    exc.args = (text,)
    return exc


__all__ = [
    "FOLD_LIMIT", "MAX_OPSET", "MIN_OPSET", "SUPPORTED_OPSETS", "OnnxProgram", "load", "read_model",
]

