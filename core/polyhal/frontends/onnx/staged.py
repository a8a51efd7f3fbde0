"""Run-time control flow, sequences, optionals and data-dependent shapes: staged execution.

polyhal plans are straight-line programs with static shapes. Most models fit: shape subgraphs fold
at import, a Loop with a known trip count unrolls, NonMaxSuppression returns a padded result and a
count. Some do not: an ``If`` whose condition is data, a ``Loop`` that runs until its body says
stop, a ``NonZero`` or ``Unique`` whose result feeds later ops, values that are sequences or
optionals. For those :func:`polyhal.onnx.load` returns a :class:`StagedOnnxProgram`.

How it runs (the decision, and why):

* The graph is cut into **segments**: maximal runs of ordinary nodes. Each segment is imported
  as its own ONNX model, with the concrete shapes (and element types) of the values it reads,
  and compiled into a normal polyhal plan, which runs on the device like any other. Segment
  plans are cached in a bounded LRU (:class:`~polyhal.specialization.SpecializationCache`,
  ``POLYHAL_SHAPE_CACHE``) keyed by the segment and its input shapes, so a loop body or a branch
  compiles once per shape and later iterations only dispatch.
* A segment also ends after an op whose result length is data (NonZero, Unique, Compress,
  NonMaxSuppression): the plan computes it into a buffer of the static upper bound plus a
  count, the front end cuts it to the count, and the next segment is specialized to the real
  size. So buffers are sized at run time without dynamic shapes inside any plan.
* Operands that decide shapes (TopK's k, Range's limits, a Reshape target computed from data)
  are fixed to their run-time values for that segment's specialization (the value becomes part
  of the cache key), so they fold as constants.
* **Host ops** run in Python between segments: ``If`` picks a branch, ``Loop``/``SequenceMap``
  iterate their body (each body is itself staged), and the sequence and optional ops manage
  Python lists and ``None`` (a sequence is a list of arrays, an empty optional is ``None``).
  They move no tensor data except ``SplitToSequence``/``ConcatFromSequence`` and a Loop's
  scan outputs, which are a numpy split/concatenation on the host.

* A **Loop whose body is one segment** leaves the interpreter once its body plan is compiled
  and gives every carried value back at the shape and type it took (:class:`_LoopBody`): each
  later iteration is one call of that plan, with the previous iteration's result tensors as
  its inputs (they stay on the device) and one of two sets of result tensors, in turn, as its
  outputs; only the condition is read on the host. A body that changes a carried value's
  shape goes on through the interpreter, specializing its plan per shape.

Compared with compiling control flow into the plan, this keeps every plan static (buffer
planning, fusion, graph replay all still apply inside a segment) and works on every device
alike; the price is one plan dispatch per segment and per iteration, plus the host op itself
(``python -m bench control_flow`` measures it: a few microseconds per Loop iteration on top
of the body plan's call). Why this stays the front end's own interpreter rather than a core construct (decided with the
core's symbolic dims, issue 26): what the core would gain is ``If``/``Loop`` for ProgramBuilder
programs; what it would cost is region-carrying ops in the IR, which every pass (placement,
fusion, encodings, bufferize's liveness and arenas, replay) would have to walk or refuse, and a
plan whose buffers depend on the branch taken -- for behaviour that already runs here at a few
microseconds per iteration on top of static, fully optimized segment plans. The segments use the
core's specialization cache, and the data-dependent sizes they cut to are concrete, so nothing in
the core is missing for them. A ``Loop`` runs at most ``POLYHAL_LOOP_LIMIT``
(:data:`LOOP_LIMIT`) iterations, so a corrupt or hostile trip count fails with a clear error
instead of running for ever.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from polyhal.frontends.onnx.errors import NeedsValue, OnnxInputError, OnnxModelError, OnnxRunError
from polyhal.frontends.onnx.external import tensor_array
from polyhal.frontends.onnx.proto import attribute_value, np_dtype_of, onnx_package, pb
from polyhal.frontends.onnx.settings import LOOP_LIMIT, OnnxSettings
from polyhal.hal.tensor import Tensor
from polyhal.specialization import SpecializationCache

__all__ = ["HOST_OPS", "LOOP_LIMIT", "SPLIT_AFTER", "StagedOnnxProgram", "StagedPlan", "loop_limit",
           "needs_staging"]

#: Ops the staged runner evaluates on the host, between segments.
HOST_OPS = frozenset({
    "If", "Loop", "SequenceMap", "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceAt",
    "SequenceErase", "SequenceLength", "SplitToSequence", "ConcatFromSequence", "Optional",
    "OptionalHasElement", "OptionalGetElement",
})
#: Ops whose result length is data: a segment ends after them, so later ops see the real size.
SPLIT_AFTER = frozenset({"NonZero", "Unique", "Compress", "NonMaxSuppression"})

def loop_limit(value: int | str | None = None) -> int:
    """The Loop iteration limit: ``value``, else ``POLYHAL_LOOP_LIMIT``, else :data:`LOOP_LIMIT`."""
    if value is None:
        return OnnxSettings.from_env().loop_limit
    try:
        limit = int(value)
    except (TypeError, ValueError):
        limit = -1
    if limit < 0:
        raise OnnxInputError(f"loop limit {value!r} is not a non-negative integer; give e.g. 1000000 "
                             "(POLYHAL_LOOP_LIMIT)")
    return limit


def needs_staging(model: pb.ModelProto, *, any_host_op: bool = False) -> bool:
    """Whether ``model`` must run staged: an input that is not a tensor (a sequence, an optional),
    a sequence or optional op anywhere (subgraphs included), or (``any_host_op``) any host or
    data-dependent op at the top level. (Non-tensor *outputs* alone do not: ZipMap's sequence of
    maps is made on the host from a tensor, see ``HostOutput``.)"""
    graph = model.graph
    if any(vi.type.WhichOneof("value") not in ("tensor_type", None) for vi in graph.input):
        return True
    if any_host_op and {n.op_type for n in graph.node if n.domain in ("", "ai.onnx")} & (HOST_OPS | SPLIT_AFTER):
        return True
    return bool(_op_types(graph) & (HOST_OPS - {"If", "Loop"}))


def _op_types(graph: pb.GraphProto) -> set[str]:
    """Default-domain op types of ``graph`` and its subgraphs."""
    ops = set()
    for node in graph.node:
        if node.domain in ("", "ai.onnx"):
            ops.add(node.op_type)
        for g in _subgraphs(node):
            ops |= _op_types(g)
    return ops


_MISSING = object()


def _is_tensor(v: Any) -> bool:
    return isinstance(v, np.ndarray)


def _free_names(graph: pb.GraphProto) -> set[str]:
    """Names a (sub)graph reads from enclosing scopes."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    used: set[str] = set()
    for node in graph.node:
        used.update(n for n in node.input if n and n not in defined)
        for g in _subgraphs(node):
            used.update(n for n in _free_names(g) if n not in defined)
        defined.update(node.output)
    return used


def _subgraphs(node: pb.NodeProto) -> list[pb.GraphProto]:
    out = []
    for a in node.attribute:
        if a.type == pb.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == pb.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def _reads(node: pb.NodeProto) -> list[str]:
    """Every name ``node`` reads: its inputs and what its subgraphs take from outside."""
    names = [n for n in node.input if n]
    for g in _subgraphs(node):
        names.extend(sorted(_free_names(g)))
    return names


class _GraphInfo:
    """What the runner precomputes once per (sub)graph: initializers and last uses."""

    def __init__(self, graph: pb.GraphProto) -> None:
        self.graph = graph
        self.nodes = list(graph.node)
        self.initializers = {t.name: tensor_array(t, f"initializer {t.name!r}") for t in graph.initializer}
        self.last_use: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for name in _reads(node):
                self.last_use[name] = i
        for o in graph.output:
            self.last_use[o.name] = len(self.nodes)
        self._layouts: dict[tuple[int, int], tuple[list[str], list[str]]] = {}
        #: Whether the nodes run as one segment whenever every value they read is a tensor
        #: (no host op, no cut after a result of run-time length).
        self.one_segment = bool(self.nodes) and not any(
            (n.domain in ("", "ai.onnx") and n.op_type in HOST_OPS) or n.op_type in SPLIT_AFTER for n in self.nodes)
        #: (start, end, host op or not) per step, where the cut does not depend on the values
        #: (no Identity, which passes a sequence or an optional along on the host); else None.
        self.steps: list[tuple[int, int, bool]] | None = None
        if not any(n.op_type == "Identity" and n.domain in ("", "ai.onnx") for n in self.nodes):
            self.steps = []
            i = 0
            while i < len(self.nodes):
                j = i + 1
                host = self.nodes[i].domain in ("", "ai.onnx") and self.nodes[i].op_type in HOST_OPS
                while not host and j < len(self.nodes) and self.nodes[j - 1].op_type not in SPLIT_AFTER \
                        and not (self.nodes[j].domain in ("", "ai.onnx") and self.nodes[j].op_type in HOST_OPS):
                    j += 1
                self.steps.append((i, j, host))
                i = j

    def layout(self, start: int, end: int) -> tuple[list[str], list[str]]:
        """(names read from outside, names used after it) of the segment ``start:end``."""
        found = self._layouts.get((start, end))
        if found is None:
            nodes = self.nodes[start:end]
            produced = {n for node in nodes for n in node.output if n}
            reads = list(dict.fromkeys(n for node in nodes for n in _reads(node) if n not in produced))
            outputs = [n for node in nodes for n in node.output if n and self.last_use.get(n, -1) >= end]
            found = self._layouts[(start, end)] = (reads, outputs)
        return found


class StagedOnnxProgram:
    """An ONNX model that runs as device plans joined by host control flow (see the module doc).

    Compile it (:meth:`compile`) for a :class:`StagedPlan`; :meth:`run` compiles and runs once.
    Inputs and outputs may be tensors (numpy arrays), sequences (lists of arrays) or optionals
    (``None`` when empty).
    """

    def __init__(self, model: pb.ModelProto, *, source: str, opset: int,
                 import_segment: Callable[[pb.ModelProto, Mapping[str, tuple], Mapping[str, np.ndarray]], Any]
                 ) -> None:
        self.model = model
        self.source = source
        self.opset = opset
        self._import_segment = import_segment
        initialized = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in initialized]
        self.output_names = [o.name for o in model.graph.output]
        self.declared_inputs = {i.name: _describe_type(i.type) for i in model.graph.input
                                if i.name not in initialized}

    def check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """``feeds`` by name (arrays as numpy arrays; lists and None pass as sequences/optionals)
        after checking that every input is given and no unknown one is."""
        extra = [k for k in feeds if k not in self.input_names]
        if extra:
            raise OnnxInputError(f"{self.source}: the model has no input {extra[0]!r}; its inputs are "
                                 f"{', '.join(self.input_names) or '(none)'}")
        out = {}
        for name in self.input_names:
            if name not in feeds:
                raise OnnxInputError(f"{self.source}: missing input {name!r} ({self.declared_inputs[name]})")
            x = feeds[name]
            if x is None:
                out[name] = None
            elif isinstance(x, (list, tuple)):
                out[name] = [np.asarray(e) for e in x]
            else:
                out[name] = x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else np.asarray(x)
        return out

    def compile(self, devices: Sequence[str] | str | None = None, *, strict: bool = False, registry=None,
                cache_size: int | None = None, **options: Any) -> "StagedPlan":
        """A :class:`StagedPlan` compiling each segment for ``devices`` (as
        :meth:`OnnxProgram.compile`) on first use, keeping ``cache_size`` segment plans."""
        def make(model: pb.ModelProto, shapes: Mapping[str, tuple], values: Mapping[str, np.ndarray]):
            program = self._import_segment(model, shapes, values)
            return program, program.compile(devices, strict=strict, registry=registry, **options)

        return StagedPlan(self, make, SpecializationCache(cache_size))

    def execute(self, plan: "StagedPlan", feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Run ``plan`` on ``feeds`` and return the outputs by name."""
        return plan.run_feeds(self.check_feeds(feeds))

    def run(self, feeds: Mapping[str, Any], devices: Sequence[str] | str | None = None, *,
            strict: bool = False) -> dict[str, Any]:
        """Compile, run once on ``feeds`` and return {output name: value}."""
        return self.execute(self.compile(devices, strict=strict), feeds)

    def explain(self, plan: "StagedPlan | None" = None) -> str:
        """The staging decision; with ``plan``, its segment cache and run statistics."""
        host = collections.Counter(n.op_type for n in self.model.graph.node if n.op_type in HOST_OPS)
        lines = [f"model {self.source}: opset {self.opset}, staged (device plans per segment, host control "
                 f"flow): {len(self.model.graph.node)} top-level nodes, host ops "
                 + (", ".join(f"{k} x{v}" for k, v in sorted(host.items())) or "(none)")]
        if plan is not None:
            lines.append(plan.explain())
        return "\n".join(lines)


class StagedPlan:
    """A compiled :class:`StagedOnnxProgram`: interprets the graph's host ops and runs each
    segment through its cached plan. ``stats`` counts segment runs, host ops and the host time."""

    def __init__(self, program: StagedOnnxProgram, make: Callable, cache: SpecializationCache) -> None:
        self.program = program
        self.cache = cache
        self._make = make
        self._infos: dict[int, _GraphInfo] = {}
        self._fixed: dict[tuple, frozenset[str]] = {}
        self._submodels: dict[tuple, pb.ModelProto] = {}
        self._bodies: dict[tuple, tuple[Any, _LoopBody | None]] = {}
        self._lock = threading.Lock()  # for changes to _bodies
        self.limit = loop_limit()
        self.stats = collections.Counter()

    # -- entry points ----------------------------------------------------------------------

    def run_feeds(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """The outputs of the model for checked ``feeds``."""
        graph = self.program.model.graph
        env = self.run_graph(graph, collections.ChainMap(dict(feeds)))
        return {o.name: env[o.name] for o in graph.output}

    def __call__(self, **feeds: Any) -> dict[str, Any]:
        return self.program.execute(self, feeds)

    def explain(self) -> str:
        """Segment cache statistics and how much ran where."""
        s = self.stats
        return (f"staged plan: {s['segment_runs']} segment runs ({self.cache.misses} compiled, "
                f"{self.cache.hits} from the cache, {self.cache.evictions} evicted), {s['direct_iterations']} Loop "
                f"iterations straight on their body's plan, {s['host_ops']} host ops, "
                f"{s['host_seconds'] * 1e3:.2f} ms in host ops and segment dispatch overhead "
                f"{s['dispatch_seconds'] * 1e3:.2f} ms")

    # -- the interpreter -------------------------------------------------------------------

    def _info(self, graph: pb.GraphProto) -> _GraphInfo:
        info = self._infos.get(id(graph))
        if info is None or info.graph is not graph:
            info = self._infos[id(graph)] = _GraphInfo(graph)
        return info

    def run_graph(self, graph: pb.GraphProto, env: collections.ChainMap) -> collections.ChainMap:
        """Run ``graph``'s nodes with ``env`` (a scope whose first map receives the results)."""
        info = self._info(graph)
        for name, value in info.initializers.items():
            env.maps[0].setdefault(name, value)
        nodes = info.nodes
        if info.steps is not None:
            for start, end, host in info.steps:
                if host:
                    self._host_op(nodes[start], env)
                else:
                    self._run_segment(info, start, end, env)
            return env
        i = 0
        while i < len(nodes):
            if self._is_host(nodes[i], env):
                self._host_op(nodes[i], env)
                i += 1
                continue
            j = i
            while j < len(nodes) and not self._is_host(nodes[j], env):
                j += 1
                if nodes[j - 1].op_type in SPLIT_AFTER:
                    break
            self._run_segment(info, i, j, env)
            i = j
        return env

    def _host_op(self, node: pb.NodeProto, env: collections.ChainMap) -> None:
        t0 = time.perf_counter()
        outs = _HOST[node.op_type](self, node, env)
        self.stats["host_ops"] += 1
        self.stats["host_seconds"] += time.perf_counter() - t0
        for name, v in zip(node.output, outs):
            if name:
                env[name] = v

    def _is_host(self, node: pb.NodeProto, env: Mapping[str, Any]) -> bool:
        if node.domain not in ("", "ai.onnx"):
            return False
        if node.op_type in HOST_OPS:
            return True
        # Identity (and any op) passing a sequence or an optional along runs on the host.
        # (A name not yet in ``env`` is computed by the segment being gathered: a tensor.)
        return (node.op_type == "Identity" and bool(node.input) and node.input[0] in env
                and not _is_tensor(env[node.input[0]]))

    def _run_segment(self, info: _GraphInfo, start: int, end: int, env: Mapping[str, Any]) -> None:
        reads, outputs = info.layout(start, end)
        values = []
        for name in reads:
            try:
                v = env[name]
            except KeyError:
                v = _MISSING
            values.append(v)
            if not _is_tensor(v):
                if v is _MISSING:
                    raise OnnxModelError(f"{self.program.source}: {name!r} is read before it is defined")
                kind = "an empty optional" if v is None else "a sequence"
                reader = next(n for n in info.nodes[start:end] if name in _reads(n))
                raise OnnxModelError(f"{self.program.source}: {name!r} is {kind}, but node {reader.op_type} "
                                     "reads it as a tensor")
        if not outputs:
            return
        t0 = time.perf_counter()
        program, plan = self._segment_plan(info, start, end, reads, outputs, values, env)
        stats = self.stats
        stats["dispatch_seconds"] += time.perf_counter() - t0
        results = program.execute(plan, dict(zip(reads, values)))  # fixed inputs are ignored
        stats["segment_runs"] += 1
        target = env.maps[0]
        for name in outputs:
            target[name] = results[name]

    def _segment_plan(self, info: _GraphInfo, start: int, end: int, inputs: list[str], outputs: list[str],
                      values: list[np.ndarray], env: Mapping[str, Any]) -> tuple[Any, Any]:
        """(program, plan) of segment ``start:end`` for its input ``values``: from the cache,
        else imported and compiled (inputs whose values decide shapes are fixed to them)."""
        where = (id(info.graph), start)
        fixed = self._fixed.get(where, frozenset())
        while True:
            key = (where, tuple([(v.dtype, v.shape, v.tobytes() if n in fixed else None)
                                 for n, v in zip(inputs, values)]))
            found = self.cache.get(key)
            if found is not None:
                return found
            model = self._submodel(info, start, end, inputs, outputs, env)
            try:
                found = self._make(model, {n: env[n].shape for n in inputs if n not in fixed},
                                   {n: env[n] for n in fixed})
            except NeedsValue as exc:
                wanted = set(exc.inputs) - fixed
                if not wanted or not wanted <= set(inputs):
                    raise
                fixed = self._fixed[where] = fixed | wanted
                continue
            return self.cache.put(key, found)

    def loop_body(self, body: pb.GraphProto, env: Mapping[str, Any], carried: Sequence[Any]) -> "_LoopBody | None":
        """The Loop ``body`` bound for running straight on its plan from now on (see
        :class:`_LoopBody`), or None where an iteration must go through the interpreter: the
        body is not one segment of tensors, its plan is not compiled yet (the interpreted
        iteration compiles it), fixes inputs to their values, has host work, or changes the
        shape or type of a carried value it reads (the next iteration needs another plan)."""
        info = self._info(body)
        if not info.one_segment or len(body.input) != 2 + len(carried) or len(body.output) < 1 + len(carried):
            return None
        where = (id(body), 0)
        if self._fixed.get(where):
            return None
        reads, outputs = info.layout(0, len(info.nodes))
        # Body inputs by name: the iteration number, the condition (true while iterating), carried values.
        inputs = {vi.name: k for k, vi in enumerate(body.input)}
        first = [np.array(0, np.int64), np.array(True), *carried]
        initializers = info.initializers

        def value(name: str) -> Any:
            k = inputs.get(name)
            if k is not None:
                return first[k]
            return initializers[name] if name in initializers else env.get(name, _MISSING)

        values = [value(n) for n in reads]
        if not all(_is_tensor(v) for v in values):
            return None  # a sequence, an optional or an undefined name: the interpreter says which
        key = (where, tuple([(v.dtype, v.shape, None) for v in values]))
        found = self.cache.get(key)
        if found is None:
            return None
        made = self._bodies.get(key)
        if made is None or made[0] is not found:
            with self._lock:
                made = self._bodies[key] = (found, _LoopBody.make(found, body, reads, outputs, values, inputs))
                while len(self._bodies) > self.cache.capacity:
                    del self._bodies[next(iter(self._bodies))]
        runner = made[1]
        if runner is None or not runner.take():
            return None  # (taken: another thread runs this Loop now; this run is interpreted)
        runner.start(values, [value(o.name) for o in body.output])
        return runner

    def _submodel(self, info: _GraphInfo, start: int, end: int, inputs: list[str], outputs: list[str],
                  env: Mapping[str, Any]) -> pb.ModelProto:
        """Nodes ``start:end`` of ``info.graph`` as a model of their inputs' element types."""
        key = (id(info.graph), start, end, tuple((n, env[n].dtype.str) for n in inputs))
        model = self._submodels.get(key)
        if model is not None:
            return model
        main = self.program.model
        helper = onnx_package().helper
        graph = helper.make_graph(
            info.nodes[start:end], f"{main.graph.name or 'onnx'}_segment{start}",
            [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(env[n].dtype), None) for n in inputs],
            [helper.make_value_info(n, pb.TypeProto()) for n in outputs])
        model = helper.make_model(graph, opset_imports=list(main.opset_import), ir_version=main.ir_version)
        model.functions.extend(main.functions)
        self._submodels[key] = model
        return model


class _LoopBody:
    """A Loop body that is one segment, run iteration after iteration straight on its plan.

    Made only where the body's plan gives back every carried value it reads at the type and
    shape it took, so that every later iteration has the same plan: no shape lookup, no scope
    or feed dicts, no host round trip of the carried values. They stay the plan's result
    tensors on its device, and the plan writes into one of two sets of result tensors in turn
    (iteration k reads set k-1 and writes set k; the sets are allocated by the first two runs
    and kept for later Loop runs). Only the condition is read back each iteration; scan outputs
    are copied to the host, as the interpreter gives them.
    """

    def __init__(self, plan: Any, args: list[int], picks: list[int], constants: list[int],
                 iter_at: list[int], carried_at: list[tuple[int, int]]) -> None:
        self.plan = plan
        self._args = args  # per plan input: its index in the values the plan reads
        # per body output: an index into [*results, i, *carried, *constants]
        self._picks = picks
        self._constant_outputs = constants  # body outputs that are neither results, i nor carried
        self._iter_at = iter_at  # plan inputs that are the iteration number
        self._carried_at = carried_at  # (plan input, carried value) pairs
        self._bound: list[Any] = []
        self._constants: list[Any] = []
        self._sets: list[Any] = [None, None]
        self._handles: list[Any] = [None, None]  # per set: what the plan is given (_host_array)
        self._turn = 0
        self._lock = threading.Lock()

    @classmethod
    def make(cls, found: tuple[Any, Any], body: pb.GraphProto, reads: list[str], outputs: list[str],
             values: list[np.ndarray], inputs: Mapping[str, int]) -> "_LoopBody | None":
        """The runner for segment plan ``found`` of ``body`` (``reads``: the names the segment
        reads, ``values``: theirs now; ``inputs``: body input name -> position), or None where
        iterations must go through the interpreter."""
        program, plan = found
        if (program.host_feeds or program.host_outputs or program.host_reads or program.trims
                or program.finishes or program.string_inputs or program.frozen):
            return None
        position = {n: k for k, n in enumerate(reads)}
        args = [position[v.name] for v in program.inputs]
        types = [v.type for v in plan.program.outputs]
        produced = {n: program.slots[k] if program.slots else k for k, n in enumerate(program.output_names)}
        n_carried, n_results = len(inputs) - 2, len(types)
        picks, constants = [], []
        for k, vi in enumerate(body.output):
            source = inputs.get(vi.name, -1)
            if vi.name in produced:
                picks.append(produced[vi.name])
            elif source == 0 or source >= 2:  # the iteration number or a carried value, as it came in
                if 1 <= k <= n_carried and source >= 2 and source != k + 1:
                    return None  # carried values trading places: a result tensor would outlive its set
                picks.append(n_results + max(source - 1, 0))
            else:  # the condition (true while iterating) or a name from outside the body
                picks.append(n_results + 1 + n_carried + len(constants))
                constants.append(k)
        for k in range(n_carried):  # stable: a carried value the plan reads comes back as it was
            name = body.input[2 + k].name
            if name not in position:
                continue
            had, pick = values[position[name]], picks[1 + k]
            if pick < n_results:
                now = (types[pick].shape, types[pick].dtype)
            elif pick == n_results:
                now = ((), np.dtype(np.int64))
            elif pick == n_results + 1 + k:
                continue
            else:
                return None  # replaced by a value from outside: left to the interpreter
            if now != (had.shape, had.dtype):
                return None
        cond = picks[0]
        if cond < n_results and types[cond].size != 1:
            return None  # the interpreter reports the malformed condition
        first = body.input[0].name
        return cls(plan, args, picks, constants,
                   [p for p, a in enumerate(args) if reads[a] == first],
                   [(p, inputs[reads[a]] - 2) for p, a in enumerate(args) if inputs.get(reads[a], 0) >= 2])

    def take(self) -> bool:
        """Claim the runner for one Loop run (False where another thread holds it): its result
        tensors are one run's at a time. :meth:`release` gives it back."""
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        """End the Loop run that :meth:`take` began (its results copied out first)."""
        self._lock.release()

    def start(self, values: list[np.ndarray], body_values: list[Any]) -> None:
        """Bind one Loop run's values: ``values``, what the plan reads at its start;
        ``body_values``, each body output's value in the body's scope (for those the plan does
        not make)."""
        self._bound = [values[a] for a in self._args]
        self._constants = [body_values[k] for k in self._constant_outputs]

    def run(self, i: int, carried: list[Any]) -> tuple[bool, list[Any]]:
        """One iteration: (the condition, the body outputs); carried values come back as tensors."""
        args = self._bound
        it = np.array(i, np.int64)
        for p in self._iter_at:
            args[p] = it
        for p, m in self._carried_at:
            args[p] = carried[m]
        turn = self._turn
        out = self._sets[turn]
        if out is None:
            made = self.plan(*args)
            out = self._sets[turn] = made if isinstance(made, tuple) else (made,)
            self._handles[turn] = [_host_array(t) for t in out]
        else:
            self.plan(*args, out=out)
        self._turn = turn ^ 1
        values = [*self._handles[turn], it, *carried, *self._constants]
        outs = [values[k] for k in self._picks]
        cond = outs[0]
        if not (isinstance(cond, np.ndarray) and cond.size == 1):
            cond = _scalar(_on_host(cond), "the Loop body's condition")
        return bool(cond), outs


# ---------------------------------------------------------------------------------- host ops

def _arg(env: Mapping[str, Any], node: pb.NodeProto, i: int, default: Any = None) -> Any:
    return env[node.input[i]] if i < len(node.input) and node.input[i] else default


def _attr(node: pb.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return attribute_value(a)
    return default


def _scalar(v: Any, what: str) -> Any:
    a = np.asarray(v)
    if a.size != 1:
        raise OnnxModelError(f"{what} must hold one value, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


def _on_host(v: Any) -> np.ndarray:
    """``v`` (an array or a plan's result tensor) readable on the host (a view where it can be)."""
    return v.numpy() if isinstance(v, Tensor) else v


def _host_array(t: Tensor) -> Any:
    """A plan's result tensor as the next run takes it most cheaply: in host memory, the numpy
    array over it (used in place), else the tensor itself (bound on its device)."""
    if t.device.is_host and isinstance(t.native, np.ndarray):
        return t.native
    return t


def _own(v: Any) -> np.ndarray:
    """``v`` (an array or a result tensor of a :class:`_LoopBody`) copied to a host array of its
    own: the memory of result tensors is written again by later iterations."""
    return v.numpy(copy=True) if isinstance(v, Tensor) else np.array(v)


def _body(plan: StagedPlan, graph: pb.GraphProto, args: Sequence[Any], env: collections.ChainMap) -> list:
    """Run subgraph ``graph`` with its inputs bound to ``args`` in a scope over ``env``."""
    if len(args) != len(graph.input):
        raise OnnxModelError(f"a subgraph takes {len(graph.input)} inputs, the node gives it {len(args)}")
    scope = env.new_child({vi.name: a for vi, a in zip(graph.input, args)})
    plan.run_graph(graph, scope)
    return [scope[o.name] for o in graph.output]


def _if(plan: StagedPlan, node, env) -> list:
    branch = "then_branch" if bool(_scalar(_arg(env, node, 0), "If's condition")) else "else_branch"
    return _body(plan, _attr(node, branch), [], env)


def _loop(plan: StagedPlan, node, env) -> list:
    body = _attr(node, "body")
    trip, cond = _arg(env, node, 0), _arg(env, node, 1)
    carried = [_arg(env, node, i) for i in range(2, len(node.input))]
    source = plan.program.source
    limit = plan.limit
    if trip is not None:
        trip = int(_scalar(trip, "Loop's trip count"))
        if trip < 0:
            raise OnnxRunError(f"{source}: Loop node {node.name or node.output[0]!r}: trip count {trip} is "
                               "negative; a Loop runs a count of iterations from 0 up")
        if trip > limit and cond is None:
            raise OnnxRunError(f"{source}: Loop node {node.name or node.output[0]!r}: trip count {trip} exceeds "
                               f"the loop limit of {limit} iterations; raise POLYHAL_LOOP_LIMIT if that many "
                               "are intended")
    going = True if cond is None else bool(_scalar(cond, "Loop's condition"))
    n_scan = len(body.output) - 1 - len(carried)
    if n_scan < 0:
        raise OnnxModelError(f"{source}: the Loop body has fewer outputs than loop-carried values")
    scans: list[list] = [[] for _ in range(n_scan)]
    i = 0
    runner = None  # once the body runs straight on its plan, it does so to the end
    n = len(carried)
    try:
        while going and (trip is None or i < trip):
            if i >= limit:
                raise OnnxRunError(f"{source}: Loop node {node.name or node.output[0]!r} ran {limit} iterations "
                                   "without ending (the loop limit); raise POLYHAL_LOOP_LIMIT if more are intended")
            if runner is None:
                runner = plan.loop_body(body, env, carried)
            if runner is not None:
                going, outs = runner.run(i, carried)
                plan.stats["direct_iterations"] += 1
                for k in range(n_scan):
                    scans[k].append(_own(outs[1 + n + k]))
            else:
                outs = _body(plan, body, [np.array(i, np.int64), np.array(going)] + carried, env)
                going = bool(_scalar(outs[0], "the Loop body's condition"))
                for k in range(n_scan):
                    scans[k].append(outs[1 + n + k])
            carried = outs[1:1 + n]
            i += 1
        results = carried if runner is None else [_own(c) for c in carried]
    finally:
        if runner is not None:
            runner.release()
    for k, pieces in enumerate(scans):
        if pieces:
            results.append(np.stack(pieces))
        else:
            elem = body.output[1 + len(carried) + k].type.tensor_type.elem_type
            results.append(np.zeros((0,), np_dtype_of(elem) if elem else np.float32))
    return results


def _sequence_map(plan: StagedPlan, node, env) -> list:
    body = _attr(node, "body")
    args = [_arg(env, node, i) for i in range(len(node.input))]
    lengths = {len(a) for a in args if isinstance(a, list)}
    if len(lengths) != 1:
        raise OnnxModelError("SequenceMap's sequence inputs must have one length, got "
                             f"{sorted(lengths) or 'no sequence'}")
    n = lengths.pop()
    outs: list[list] = [[] for _ in body.output]
    for t in range(n):
        got = _body(plan, body, [a[t] if isinstance(a, list) else a for a in args], env)
        for k, v in enumerate(got):
            outs[k].append(v)
    return outs


def _position(seq: list, pos: Any, insert: bool = False) -> int:
    p = int(_scalar(pos, "the sequence position"))
    n = len(seq) + (1 if insert else 0)
    if not -n <= p < n:
        raise OnnxRunError(f"sequence position {p} is out of range for a sequence of {len(seq)} tensors")
    return p + n if p < 0 else p


def _sequence(v: Any, op: str) -> list:
    if not isinstance(v, list):
        raise OnnxModelError(f"{op} takes a sequence, got {'an empty optional' if v is None else 'a tensor'}")
    return v


def _insert(plan, node, env) -> list:
    seq = list(_sequence(_arg(env, node, 0), "SequenceInsert"))
    pos = _arg(env, node, 2)
    seq.insert(len(seq) if pos is None else _position(seq, pos, insert=True), _arg(env, node, 1))
    return [seq]


def _erase(plan, node, env) -> list:
    seq = list(_sequence(_arg(env, node, 0), "SequenceErase"))
    pos = _arg(env, node, 1)
    del seq[-1 if pos is None else _position(seq, pos)]
    return [seq]


def _split_to_sequence(plan, node, env) -> list:
    x, split = _arg(env, node, 0), _arg(env, node, 1)
    axis = int(_attr(node, "axis", 0)) % max(x.ndim, 1)
    n = x.shape[axis]
    if split is None:
        pieces = np.split(x, n, axis=axis)
        if not int(_attr(node, "keepdims", 1)):
            pieces = [np.squeeze(p, axis=axis) for p in pieces]
        return [[np.ascontiguousarray(p) for p in pieces]]
    split = np.asarray(split).astype(np.int64)
    if split.ndim == 0:
        size = int(split)
        if size <= 0:
            raise OnnxModelError(f"SplitToSequence's split {size} must be positive")
        bounds = list(range(size, n, size))
    else:
        if int(split.sum()) != n or (split < 0).any():
            raise OnnxModelError(f"SplitToSequence's split {split.tolist()} does not add up to the axis length {n}")
        bounds = np.cumsum(split)[:-1].tolist()
    return [[np.ascontiguousarray(p) for p in np.split(x, bounds, axis=axis)]]


def _concat_from_sequence(plan, node, env) -> list:
    seq = _sequence(_arg(env, node, 0), "ConcatFromSequence")
    if not seq:
        raise OnnxModelError("ConcatFromSequence of an empty sequence (the result's shape is unknown)")
    axis = int(_attr(node, "axis"))
    if int(_attr(node, "new_axis", 0)):
        return [np.stack(seq, axis=axis)]
    return [np.concatenate(seq, axis=axis)]


def _sequence_empty(plan, node, env) -> list:
    return [[]]


def _optional_get(plan, node, env) -> list:
    v = _arg(env, node, 0)
    if v is None:
        raise OnnxRunError(f"{plan.program.source}: OptionalGetElement of an empty optional "
                           f"({node.input[0]!r}); check it with OptionalHasElement first")
    return [v]


_HOST: dict[str, Callable[[StagedPlan, pb.NodeProto, Any], list]] = {
    "If": _if,
    "Loop": _loop,
    "SequenceMap": _sequence_map,
    "SequenceConstruct": lambda plan, node, env: [[env[n] for n in node.input]],
    "SequenceEmpty": _sequence_empty,
    "SequenceInsert": _insert,
    "SequenceAt": lambda plan, node, env: [_sequence(_arg(env, node, 0), "SequenceAt")[
        _position(_arg(env, node, 0), _arg(env, node, 1))]],
    "SequenceErase": _erase,
    "SequenceLength": lambda plan, node, env: [np.array(len(_sequence(_arg(env, node, 0), "SequenceLength")),
                                                        np.int64)],
    "SplitToSequence": _split_to_sequence,
    "ConcatFromSequence": _concat_from_sequence,
    "Optional": lambda plan, node, env: [_arg(env, node, 0)],
    "OptionalHasElement": lambda plan, node, env: [np.array(_arg(env, node, 0) is not None)],
    "OptionalGetElement": _optional_get,
    "Identity": lambda plan, node, env: [_arg(env, node, 0)],
}


def _describe_type(tp: pb.TypeProto) -> str:
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        try:
            elem = pb.TensorProto.DataType.Name(tp.tensor_type.elem_type).lower()
        except ValueError:
            elem = "?"
        dims = [d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?")
                for d in tp.tensor_type.shape.dim]
        return f"{elem}[{','.join(dims)}]" if tp.tensor_type.HasField("shape") else f"{elem}[...]"
    if kind == "sequence_type":
        return f"sequence({_describe_type(tp.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({_describe_type(tp.optional_type.elem_type)})"
    return kind or "untyped"
