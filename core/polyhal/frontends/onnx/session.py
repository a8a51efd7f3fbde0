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

Sessions of one model share its compile: a process keeps the last ``POLYHAL_SESSION_CACHE``
(default 8; 0 turns it off) static models its sessions compiled, keyed by the SHA-256 of the
model's bytes, its name, the devices, the options, the registry's plugins and the ``POLYHAL_*``
environment, and a later session of the same model binds that compile into a plan of its own
(:meth:`~polyhal.plan.Plan.binder`: its own buffers, so the sessions run independently) instead
of checking, importing and compiling the model again -- onnxruntime's session creation does all
of that each time, in C++. The cache keeps each model's program (its weights on the host), not a
plan's buffers or device copies. A model with external data files, or given as an
``onnx.ModelProto``, is compiled per session; a model with symbolic dims compiles nothing when
its session is made (nor is it hashed).

``run_with_dlpack`` is the device-resident form (onnxruntime's ``run_with_ort_values`` /
IOBinding idea): inputs are polyhal :class:`~polyhal.hal.tensor.Tensor` s or any DLPack producer
(cupy, torch, jax, numpy), imported without a copy, and the outputs are polyhal Tensors on the
device that computed them, which ``np.from_dlpack`` / ``cupy.from_dlpack`` / ``torch.from_dlpack``
take without a copy.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from polyhal.creation import from_dlpack
from polyhal.errors import PolyhalError
from polyhal.frontends.onnx.dynamic import DynamicOnnxProgram, check_input_names
from polyhal.frontends.onnx.errors import NeedsValue, OnnxInputError
from polyhal.frontends.onnx.importer import OnnxProgram, load, model_bytes, parse_model, read_model
from polyhal.frontends.onnx.proto import elem_type_name, pb
from polyhal.frontends.onnx.settings import OnnxSettings
from polyhal.hal.tensor import Tensor
from polyhal.registry import default_registry
from polyhal.specialization import SpecializationCache

if TYPE_CHECKING:
    from polyhal.frontends.onnx.backend import PolyhalRep

__all__ = ["InferenceSession", "NodeArg"]


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime's ``NodeArg`` describes it: ``name``, ``shape``
    (a list: an int per fixed dim, the symbol's name per named dim, None per unnamed one) and
    ``type`` (``"tensor(float)"``, ``"seq(tensor(int64))"``, ...)."""

    name: str
    shape: list | None
    type: str


def type_string(tp: pb.TypeProto) -> str:
    """onnxruntime's text for an ONNX type: ``tensor(float)``, ``seq(tensor(int64))``,
    ``optional(tensor(float))``, ``map(string,tensor(float))``."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        elem = elem_type_name(getattr(tp, kind).elem_type)
        name = elem.removeprefix("TensorProto.").lower()
        return f"{'sparse_tensor' if kind == 'sparse_tensor_type' else 'tensor'}({name})"
    if kind == "sequence_type":
        return f"seq({type_string(tp.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({type_string(tp.optional_type.elem_type)})"
    if kind == "map_type":
        key = elem_type_name(tp.map_type.key_type).removeprefix("TensorProto.").lower()
        return f"map({key},{type_string(tp.map_type.value_type)})"
    return "unknown"


def _node_arg(vi: pb.ValueInfoProto) -> NodeArg:
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
        if devices is not None and not isinstance(devices, str):
            devices = tuple(devices)  # read once: the cache key and the compile see the same list
        self.devices = devices
        self._by_value: PolyhalRep | None = None
        raw = model_bytes(path_or_bytes)
        if raw is None:  # a ModelProto: no bytes to know it by, compiled per session
            (proto, source), external = read_model(path_or_bytes), 0
        else:
            source = raw[1]
            proto, external = parse_model(*raw)
        initialized = {t.name for t in proto.graph.initializer}
        self._inputs = [_node_arg(vi) for vi in proto.graph.input if vi.name not in initialized]
        self._outputs = [_node_arg(vi) for vi in proto.graph.output]
        self._all_outputs = [o.name for o in self._outputs]  # what run(None, ...) returns, in order
        self.source = source
        key = None
        # Only a model whose inputs are all fixed compiles here; the others are not hashed.
        fixed = all(isinstance(d, int) for i in self._inputs for d in i.shape or [None])
        if raw is not None and not external and fixed:
            key = _cache_key(raw[0], source, (devices,) if isinstance(devices, str) else devices, options)
            cache = _compiled_cache()
            compiled = cache.get(_with_generation(key, options)) if key is not None and len(cache) else None
            if compiled is not None:
                self.program, self.plan = compiled.program, compiled.bind()
                return
        del raw
        try:
            self.program = load(proto, source=source)  # read once: load takes the ModelProto
        except NeedsValue:  # inputs decide shapes: imported per value of those, as the ONNX backend does
            # (here: the backend subclasses onnx's, and importing onnx costs ml_dtypes', see .proto)
            from polyhal.frontends.onnx.backend import PolyhalRep

            self.program = self.plan = None
            self._by_value = PolyhalRep(proto, devices, strict=options.pop("strict", False), **options)
            return
        self.plan = self.program.compile(devices, **options)
        if key is not None and type(self.program) is OnnxProgram:
            # (the registry's generation read after the compile, which may have loaded a backend)
            _compiled_cache().put(_with_generation(key, options), _Compiled(self.program, self.plan.binder()))

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
        names = self._output_names(output_names)
        program, plan = (self.program, self.plan) if self._by_value is None else \
            self._by_value.compiled(self._by_value.as_feeds(input_feed))
        results = program.execute(plan, program.check_feeds(input_feed))
        return [results[n] for n in names]

    def run_with_dlpack(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                        run_options: Any = None) -> list[Any]:
        """As :meth:`run`, with inputs and outputs that stay where they live.

        Each input is a polyhal :class:`~polyhal.hal.tensor.Tensor` or any object with
        ``__dlpack__`` (a cupy, torch or jax array; a numpy array), imported without a copy; a
        tensor already on the device an input is placed on is read in place. The outputs are
        polyhal Tensors on the device that computed them, never copied to the host (take them
        with ``np.from_dlpack``, ``cupy.from_dlpack``, ``torch.from_dlpack``). Where the model's
        outputs are finished on the host -- cut to a run-time length (NonMaxSuppression's),
        made from strings, or a model run staged (If/Loop decided by data) -- those outputs are
        made there and returned as host tensors; sequences and string outputs come as
        :meth:`run` gives them.

        Raises:
            OnnxInputError: as :meth:`run`, and for an input that is neither a Tensor nor a
                DLPack producer.
        """
        names = self._output_names(output_names)
        feeds = {name: self._imported(name, value) for name, value in input_feed.items()}
        compiled = self._specialization(feeds)
        if compiled is not None:
            program, plan = compiled
            direct = program._plain_outputs()
            if direct and all(finish is None for _, _, finish in direct):
                self._check_tensors(program, feeds)
                results = plan(**{v.name: feeds[v.name] for v in program.inputs})
                results = results if isinstance(results, tuple) else (results,)
                by_name = {name: results[k] for name, k, _ in direct}
                return [by_name[n] for n in names]
        # Host work finishes some output: run as run() does, on host views of the inputs.
        host = self.run(names, {n: t.numpy() for n, t in feeds.items()})
        return [from_dlpack(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) and a.dtype != object else a
                for a in host]

    # -- helpers ----------------------------------------------------------------------------

    def _output_names(self, output_names: Sequence[str] | None) -> list[str]:
        """``output_names`` checked against the model's (None: every output, in order)."""
        if output_names is None:
            return self._all_outputs
        names = list(output_names)
        known = {o.name for o in self._outputs}
        for name in names:
            if name not in known:
                listing = ", ".join(f"{o.name} ({o.type})" for o in self._outputs)
                raise OnnxInputError(f"{self.source}: the model has no output {name!r}; its outputs are {listing}")
        return names

    def _imported(self, name: str, value: Any) -> Tensor:
        """``value`` as a polyhal Tensor, without a copy."""
        if isinstance(value, Tensor):
            return value
        advice = ("run_with_dlpack takes polyhal Tensors and DLPack producers (numpy, cupy, torch arrays); use "
                  "run() for other array-likes and strings")
        if not hasattr(value, "__dlpack__"):
            raise OnnxInputError(f"{self.source}: input {name!r} is a {type(value).__name__}; {advice}")
        try:
            return from_dlpack(value)
        except PolyhalError:
            raise
        except (BufferError, TypeError, ValueError) as exc:  # the producer cannot export it (strings, say)
            raise OnnxInputError(f"{self.source}: input {name!r} cannot be exported through DLPack ({exc}); "
                                 f"{advice}") from None

    def _specialization(self, feeds: Mapping[str, Tensor]) -> tuple[OnnxProgram, Any] | None:
        """The program and plan that run ``feeds`` on the devices (compiled for their shapes where
        the model has symbolic dims); None where the model runs staged or is imported per value."""
        if isinstance(self.program, OnnxProgram):
            return self.program, self.plan
        if isinstance(self.program, DynamicOnnxProgram):
            program = self.program
            check_input_names(self.source, feeds, program.input_names, program.declared_inputs, program._listing())
            spec = self.plan.lookup([feeds[n] for n in program.input_names])
            return spec.program, spec.plan
        return None

    def _check_tensors(self, program: OnnxProgram, feeds: Mapping[str, Tensor]) -> None:
        """OnnxInputError for a missing or unknown input, or one of another element type or shape."""
        check_input_names(self.source, feeds, program.input_names, program.declared_inputs, program._listing())
        for name, shape, dtype in program.feed_types():
            t = feeds[name]
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise OnnxInputError(f"{self.source}: input {name!r} must be {dtype}{list(shape)} (declared "
                                     f"{program.declared_inputs.get(name)}), got a tensor of {t.dtype}{list(t.shape)}")


# -- the compiled models of this process ------------------------------------------------------


@dataclass(frozen=True)
class _Compiled:
    """What a session made of a static model, for later sessions of the same model: they share
    ``program`` (read-only once imported) and each runs a plan of its own, made by ``bind``
    (:meth:`polyhal.plan.Plan.binder`: the compile, without the first session's buffers)."""

    program: OnnxProgram
    bind: Callable[[], Any]  # () -> polyhal.plan.Plan


_cache: SpecializationCache[_Compiled] | None = None
_cache_lock = threading.Lock()


def _compiled_cache() -> SpecializationCache[_Compiled]:
    """The process's cache of compiled models, its capacity ``POLYHAL_SESSION_CACHE`` as read now."""
    global _cache
    capacity = OnnxSettings.from_env().session_cache
    if _cache is None:
        with _cache_lock:
            if _cache is None:
                _cache = SpecializationCache(max(capacity, 1))
                # Dropped before the interpreter tears modules down: the plans' kernels (oneDNN
                # primitives) release native objects through their modules' functions.
                atexit.register(_cache.clear)
    if capacity and _cache.capacity != capacity:
        _cache.capacity = capacity  # (takes effect at the next put)
    return _cache


def _cache_key(data: bytes, source: str, devices: tuple[str, ...] | None,
               options: Mapping[str, Any]) -> Hashable | None:
    """What a compile of the model ``data`` depends on, but for the registry's generation (see
    :func:`_with_generation`); None where the cache is off or an option cannot be a key (a list)."""
    if not OnnxSettings.from_env().session_cache:
        return None
    # The environment's POLYHAL_* variables choose compile policies (precision, kernels, tiling).
    environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("POLYHAL_")))
    key = (hashlib.sha256(data).digest(), source, devices, tuple(sorted(options.items())), environment)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _with_generation(key: Hashable, options: Mapping[str, Any]) -> Hashable:
    """``key`` with the registry the compile uses and its generation (plugins registered or
    removed since make other plans)."""
    registry = options.get("registry") or default_registry()
    return key, registry, registry.generation
