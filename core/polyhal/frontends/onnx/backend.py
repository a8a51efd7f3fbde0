"""An ``onnx.backend.base.Backend`` over polyhal devices, for ONNX's backend test suite.

``PolyhalBackend.prepare(model, device)`` returns a :class:`PolyhalRep` whose ``run(inputs)``
returns the outputs as numpy arrays. polyhal programs have static shapes, so a rep imports and
compiles the model per distinct input signature (shapes and element types), caching the plans;
graph inputs that decide shapes (a Reshape's ``shape`` fed as an input, say) are fixed to their
values, learnt from :class:`~polyhal.frontends.onnx.errors.NeedsValue`, and then key the cache too.

``device`` is a polyhal device name (``"cpu:0"``) or ONNX's ``"CPU"`` (the first CPU device).
By default placement is strict: a node whose op the device lacks makes the model unsupported
there, so results say what *that* device runs. ``strict=False`` lets such ops run on another
device.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend, BackendRep

from polyhal.frontends.onnx.errors import NeedsValue, OnnxInputError, OnnxUnsupportedError
from polyhal.frontends.onnx.importer import OnnxProgram, load
from polyhal.frontends.onnx.types import as_strings, is_strings
from polyhal.frontends.onnx.staged import StagedOnnxProgram
from polyhal.registry import devices

#: How many different value-fixed variants one rep compiles before refusing (a model whose
#: shape-deciding inputs change every run is not what static shapes are for).
MAX_VARIANTS = 64


def resolve_device(device: str) -> str:
    """A polyhal device name for ``device`` (polyhal names pass through; "CPU" is cpu:0)."""
    if ":" in device and not device.upper().startswith(("CPU:", "CUDA:")):
        return device
    kind = device.split(":")[0].upper()
    backend = {"CPU": "cpu", "CUDA": "cuda"}.get(kind, device.lower())
    for spec in devices():
        if spec.backend == backend:
            return spec.name
    return device


class PolyhalRep(BackendRep):
    """A prepared model: compiled per input signature on first use, then run from the cache."""

    def __init__(self, model: onnx.ModelProto, device: str | Sequence[str] | None, *, strict: bool = True,
                 **options: Any) -> None:
        self.model = model
        self.device = resolve_device(device) if isinstance(device, str) else device  # a list: compile's order
        self.strict = strict
        self.options = options  # for compile (fuse=False, precision=...)
        initialized = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in initialized]
        self.output_names = [o.name for o in model.graph.output]
        self._fixed: set[str] = set()
        self._plans: dict[tuple, tuple[OnnxProgram, Any]] = {}
        self._staged: tuple[StagedOnnxProgram, Any] | None = None

    def as_feeds(self, inputs: Any) -> dict[str, np.ndarray]:
        """``inputs`` (a list in graph-input order, or a dict) as {name: array}; sequences and
        optionals pass as given, strings as arrays of str."""
        if isinstance(inputs, Mapping):
            items = list(inputs.items())
        else:
            if isinstance(inputs, np.ndarray) or not isinstance(inputs, Sequence):
                inputs = [inputs]
            if len(inputs) > len(self.input_names):
                raise OnnxInputError(f"the model takes {len(self.input_names)} inputs {self.input_names}, "
                                     f"got {len(inputs)}")
            items = list(zip(self.input_names, inputs))
        feeds = {}
        for name, x in items:
            if isinstance(x, (list, tuple)) or x is None:  # a sequence or an optional: a staged model's
                feeds[name] = x
                continue
            x = np.asarray(x)
            feeds[name] = as_strings(x, f"input {name!r}") if is_strings(x) else x  # strings stay on the host
        return feeds

    def compiled(self, feeds: Mapping[str, np.ndarray]) -> tuple[OnnxProgram, Any]:
        """The (program, plan) for these feeds, imported and compiled on first use."""
        if self._staged is not None or not all(isinstance(x, np.ndarray) for x in feeds.values()):
            if self._staged is None:  # staged models take any shapes and values: one program
                program = load(self.model)
                self._staged = (program, program.compile(self.device, strict=self.strict, **self.options))
            return self._staged
        while True:
            key = tuple((k, x.shape, x.dtype.str, x.tobytes() if k in self._fixed else None)
                        for k, x in sorted(feeds.items()))
            found = self._plans.get(key)
            if found is not None:
                return found
            if len(self._plans) >= MAX_VARIANTS:
                self._plans.clear()
            try:
                program = load(self.model, shapes={k: x.shape for k, x in feeds.items()},
                               values={k: feeds[k] for k in self._fixed if k in feeds})
            except NeedsValue as exc:
                wanted = set(exc.inputs) - self._fixed
                if not wanted or not wanted <= set(feeds):
                    raise
                self._fixed |= wanted
                continue
            plan = program.compile(self.device, strict=self.strict, **self.options)
            if isinstance(program, StagedOnnxProgram):
                self._staged = (program, plan)
                return self._staged
            self._plans[key] = (program, plan)
            return program, plan

    def run(self, inputs: Any, **kwargs: Any) -> tuple:
        """The model's outputs for ``inputs`` (a list in graph-input order, or a dict)."""
        feeds = self.as_feeds(inputs)
        program, plan = self.compiled(feeds)
        results = program.execute(plan, feeds)
        Outputs = namedtuple("Outputs", [f"o{i}" for i in range(len(results))])  # names may not be identifiers
        return Outputs(*results.values())


class PolyhalBackend(Backend):
    """ONNX's backend interface over polyhal (``onnx.backend.test`` runs its tests through it)."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        """Always True: what polyhal cannot run is reported when the model is prepared or run."""
        return True

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> PolyhalRep:
        """A rep of ``model`` on ``device`` (``strict=False`` lets ops run on other devices)."""
        super().prepare(model, device, **kwargs)
        return PolyhalRep(model, device, strict=kwargs.get("strict", True))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple:
        """Prepare ``model`` and run it once on ``inputs``."""
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU", outputs_info=None,
                 **kwargs: Any) -> tuple:
        """Run one node: wrapped in a one-node model of the inputs' types."""
        arrays = [np.asarray(x) for x in inputs]
        graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                        for n, a in zip(node.input, arrays)]
        graph_outputs = [helper.make_empty_tensor_value_info(n) for n in node.output]
        graph = helper.make_graph([node], "node", graph_inputs, graph_outputs)
        model = helper.make_model(graph)
        return cls.run_model(model, arrays, device, **kwargs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """Whether ``device`` (a polyhal name, or "CPU"/"CUDA") names an installed device."""
        name = resolve_device(device)
        return any(s.name == name for s in devices())


prepare = PolyhalBackend.prepare
run_model = PolyhalBackend.run_model
run_node = PolyhalBackend.run_node
supports_device = PolyhalBackend.supports_device
