"""The compile pipeline: the passes as a declared list, each with what it requires and provides.

A compile (:func:`polyhal.compile`) builds a :class:`~polyhal.target.Target` and runs its
:class:`Pipeline` over a :class:`Compilation` (the program and what passes record about it).
:data:`DEFAULT_PIPELINE` is the whole order in one place::

    decompose (ops no device has a kernel for, into core ops: recurrent layers unrolled),
    fold-constant-transposes, fuse-attention, fuse-linear, fuse-gelu, fold-conv-affine,
    fuse-conv-epilogue, fuse-scale-shift, pool-before-pointwise-conv
        (the fusions: only with compile(fuse=True); backends add their own here, e.g. the
        CPU's cpu-fuse-conv-prologue after pool-before-pointwise-conv)
    precision -> set-encodings -> place -> materialize-encodings -> bufferize

Each :class:`Pass` names the properties it ``requires`` and ``provides`` (and those it
``invalidates``: ``place`` ends the ``"unplaced"`` phase in which passes rewrite the program
freely). The pipeline is checked before it runs: a pass whose requirement no earlier pass
provides is a :class:`~polyhal.errors.PipelineError` naming both passes. A pass that is
disabled for a compile (a fusion under ``fuse=False``) still counts as providing its properties:
"every attention head that should be fused is fused" holds vacuously when none is.

Inserting a pass, in code::

    from polyhal.passes.pipeline import DEFAULT_PIPELINE, Pass

    def count_matmuls(compilation, target):
        compilation.notes.append(f"{sum(op.name == 'matmul' for op in compilation.program.ops)} matmuls")

    pipeline = DEFAULT_PIPELINE.insert(Pass("count-matmuls", count_matmuls, requires=("unplaced",)),
                                       after="fuse-linear")
    plan = polyhal.compile(program, pipeline=pipeline)

or from a plugin, for every compile, through the ``register_passes`` hook (see
:mod:`polyhal.hookspecs`), which returns :class:`PassRegistration` records (a pass and where it
goes). ``plan.explain()`` lists each pass with its time and what it changed.

**Backends claim fusions** (as onnxruntime's execution providers claim nodes in
``GetCapability``, fused groups with ``EpGraphSupportInfo_AddNodesToFuse``): a fusion that only
one backend's kernels make worth it is that backend's pass, made with :func:`fusion_pass` and
naming in ``creates`` the ops it may create -- the backend's own ops
(:meth:`polyhal.hal.kernels.KernelTable.define`). It asks ``target.fusible(op, ops)`` before each
rewrite, so a fused op lands only where placement would put the ops and that device has its
kernel. A plugin's pass that creates an op none of the plugin's devices has a kernel for is
left out, with a warning naming the plugin and the op (:class:`polyhal.Target` checks when it
builds the pipeline); the compile goes on without that fusion.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from polyhal.errors import KernelNotFoundError, PipelineError, PluginError, PolyhalError
from polyhal.ir.program import Program
from polyhal.ir.types import Affinity
from polyhal.ops import OPS
from polyhal.passes.bufferize import BufferPlan, bufferize
from polyhal.passes.data_tiling import set_conv_encodings, set_encodings
from polyhal.passes.decompose import decompose
from polyhal.passes.fold_constants import fold_constant_transposes
from polyhal.passes.fuse_attention import fuse_attention
from polyhal.passes.fuse_conv import fold_conv_affine, fuse_conv_epilogue, fuse_scale_shift, pool_before_pointwise_conv
from polyhal.passes.fuse_gelu import fuse_gelu
from polyhal.passes.fuse_linear import fuse_linear
from polyhal.passes.fuse_quantized import fuse_quantized
from polyhal.passes.fusion import Fusion
from polyhal.passes.materialize_encoding import materialize_encodings
from polyhal.passes.placement import Placement, place
from polyhal.passes.precision import PrecisionReport, apply_precision

if TYPE_CHECKING:
    from polyhal.registry import Registry
    from polyhal.target import Target

__all__ = ["Compilation", "DEFAULT_PIPELINE", "Pass", "PassRecord", "PassRegistration", "Pipeline", "fusion_pass",
           "pipeline_for"]

#: The property every pipeline starts with: ops carry no device yet, and passes may rewrite them.
UNPLACED = "unplaced"


@dataclass
class Compilation:
    """What a pipeline works on: the program and what the passes have recorded about it.

    Program-level passes replace :attr:`program`; ``place`` sets :attr:`placement` (whose
    program later passes replace); ``bufferize`` sets :attr:`buffer_plan`.
    """

    program: Program
    #: Set by ``place``: the placed program, a device per value, the allocation decisions.
    placement: Placement | None = None
    #: What the fusion passes did, in order; None when the compile was asked not to fuse.
    fusions: list[Fusion] | None = field(default_factory=list)
    #: What the precision policy did.
    precision: PrecisionReport | None = None
    #: Set by ``bufferize``: memory spaces of scratch, buffer reuse, arenas.
    buffer_plan: BufferPlan | None = None
    #: One record per pass run (or skipped), in order: explain's pipeline section.
    records: list["PassRecord"] = field(default_factory=list)
    #: Free-form lines a pass wants ``plan.explain()`` to show (a user's pass, a plugin's).
    notes: list[str] = field(default_factory=list)

    @property
    def current_program(self) -> Program:
        """The program as it stands: the placed one once ``place`` ran."""
        return self.placement.program if self.placement is not None else self.program

    def add_fusions(self, fusions: Iterable[Fusion]) -> None:
        """Record what a fusion pass did (kept in pass order, for explain)."""
        if self.fusions is None:
            self.fusions = []
        self.fusions.extend(fusions)


#: ``run(compilation, target)``: a pass updates the compilation in place.
PassFn = Callable[[Compilation, "Target"], None]


@dataclass(frozen=True)
class Pass:
    """One compile pass: a name, the function that runs it, and its contract.

    ``requires``: properties that must hold before it runs (an earlier pass provides each;
    ``"unplaced"`` holds from the start until ``place``). ``provides``: properties that hold after
    it. ``invalidates``: properties that no longer hold after it. ``enabled(target)`` says whether
    it runs in a compile (a disabled pass is listed as skipped, ``disabled_by`` saying why). The first line of the function's
    docstring is the pass's description unless ``doc`` is given.
    """

    name: str
    run: PassFn
    requires: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    invalidates: tuple[str, ...] = ()
    enabled: Callable[["Target"], bool] = field(default=lambda target: True, compare=False, repr=False)
    doc: str = ""
    #: What turns the pass off, for explain (``"compile(fuse=False)"``).
    disabled_by: str = ""
    #: The ops the pass may create (a fusion's fused ops). A plugin's pass claims them: the
    #: plugin's devices must have their kernels (see the module docstring).
    creates: tuple[str, ...] = ()
    #: The plugin that registered it (``register_passes``; filled in by :func:`pipeline_for`), or "".
    plugin: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PipelineError(f"a pass needs a non-empty name, got {self.name!r}")
        if not callable(self.run):
            raise PipelineError(f"pass {self.name!r}: run must be callable run(compilation, target), got {self.run!r}")
        for attr in ("requires", "provides", "invalidates", "creates"):
            value = getattr(self, attr)
            if isinstance(value, str) or not all(isinstance(p, str) for p in value):
                raise PipelineError(f"pass {self.name!r}: {attr} must be a tuple of property names, got {value!r}")
            object.__setattr__(self, attr, tuple(value))

    @property
    def description(self) -> str:
        """One line saying what the pass does."""
        text = self.doc or (self.run.__doc__ or "")
        return text.strip().splitlines()[0] if text.strip() else ""


@dataclass(frozen=True)
class PassRegistration:
    """A plugin's pass and where it goes (``register_passes`` returns these): right ``after`` the
    named pass, or right ``before`` it (exactly one of the two)."""

    pass_: Pass
    after: str | None = None
    before: str | None = None


@dataclass(frozen=True)
class PassRecord:
    """What one pass did in one compile: its time, the op count before and after, its notes."""

    name: str
    seconds: float
    ops_before: int
    ops_after: int
    ran: bool = True
    detail: str = ""

    def explain(self) -> str:
        """One line for ``plan.explain()``."""
        if not self.ran:
            return f"{self.name}: skipped{f' ({self.detail})' if self.detail else ''}"
        change = (f"{self.ops_before} -> {self.ops_after} ops" if self.ops_before != self.ops_after
                  else f"{self.ops_after} ops")
        return f"{self.name}: {self.seconds * 1e3:.2f} ms, {change}" + (f"; {self.detail}" if self.detail else "")


class Pipeline(Sequence[Pass]):
    """An ordered, validated list of passes (immutable: :meth:`insert` and :meth:`remove` return
    new pipelines)."""

    def __init__(self, passes: Iterable[Pass]) -> None:
        self._passes = tuple(passes)
        names = [p.name for p in self._passes]
        for p in self._passes:
            if not isinstance(p, Pass):
                raise PipelineError(f"a pipeline holds Pass records, got {p!r}")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise PipelineError(f"pass names must be unique in a pipeline; {dupes} appear more than once")

    def __getitem__(self, index):  # type: ignore[override]
        return self._passes[index]

    def __len__(self) -> int:
        return len(self._passes)

    def __iter__(self) -> Iterator[Pass]:
        return iter(self._passes)

    @property
    def names(self) -> list[str]:
        """The pass names, in order."""
        return [p.name for p in self._passes]

    def _index(self, name: str, role: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise PipelineError(f"no pass named {name!r} to insert {role}; passes: {self.names}") from None

    def insert(self, new: Pass, *, after: str | None = None, before: str | None = None) -> "Pipeline":
        """A pipeline with ``new`` right after (or before) the pass named so; validated."""
        if (after is None) == (before is None):
            raise PipelineError(f"inserting pass {new.name!r}: give exactly one of after= or before=")
        at = self._index(after, "after") + 1 if after is not None else self._index(before, "before")
        pipeline = Pipeline([*self._passes[:at], new, *self._passes[at:]])
        pipeline.validate()
        return pipeline

    def remove(self, name: str) -> "Pipeline":
        """A pipeline without the pass ``name``; validated (a pass that needed it fails here)."""
        at = self._index(name, "remove")
        pipeline = Pipeline([*self._passes[:at], *self._passes[at + 1:]])
        pipeline.validate()
        return pipeline

    def validate(self) -> None:
        """Check that each pass's requirements hold where it runs; raises PipelineError naming
        the pass and the pass that provides (or invalidated) what it needs."""
        holds = {UNPLACED}
        ended_by: dict[str, str] = {}
        for i, p in enumerate(self._passes):
            for need in p.requires:
                if need in holds:
                    continue
                later = [q.name for q in self._passes[i + 1:] if need in q.provides]
                if need in ended_by:
                    why = f"pass {ended_by[need]!r} (earlier) ends it"
                    fix = f"; move {p.name!r} before {ended_by[need]!r}"
                elif later:
                    why = f"pass {later[0]!r} provides it, but runs later"
                    fix = f"; move {p.name!r} after {later[0]!r}"
                else:
                    why, fix = "no pass of the pipeline provides it", ""
                raise PipelineError(f"pass {p.name!r} requires {need!r}: {why}{fix} (order: {self.names})")
            for gone in p.invalidates:
                holds.discard(gone)
                ended_by[gone] = p.name
            for made in p.provides:
                holds.add(made)
                ended_by.pop(made, None)

    def run(self, program: Program, target: "Target") -> Compilation:
        """Run every enabled pass on ``program`` (not modified) for ``target``; the result's
        ``records`` say what each did."""
        compilation = Compilation(program, fusions=[] if target.fuse else None)
        clock = time.perf_counter
        for p in self._passes:
            before = len(compilation.current_program.ops)
            if not p.enabled(target):
                compilation.records.append(PassRecord(p.name, 0.0, before, before, ran=False, detail=p.disabled_by))
                continue
            fusions = len(compilation.fusions or ())
            t0 = clock()
            try:
                p.run(compilation, target)
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+: the traceback says which pass failed
                    exc.add_note(f"(in compile pass {p.name!r})")
                raise
            took = clock() - t0
            if compilation.placement is not None and p.name not in _CORE_PASSES:
                _check_placed(compilation, target, p)
            after = len(compilation.current_program.ops)
            made = len(compilation.fusions or ()) - fusions
            compilation.records.append(PassRecord(p.name, took, before, after,
                                                  detail=f"{made} rewrites" if made else ""))
        return compilation


# ------------------------------------------------------------------------------------------------
# The built-in passes
# ------------------------------------------------------------------------------------------------

def fusion_pass(name: str, fn: Callable[..., tuple[Program, list[Fusion]]], *, gated: bool = True,
                requires: tuple[str, ...] = (), provides: str, creates: tuple[str, ...] = ()) -> Pass:
    """A program-level fusion pass: ``fn(program, fusible) -> (program, fusions)`` (``fn(program)``
    when not ``gated``: a rewrite that needs no new kernel), run before placement and only with
    ``compile(fuse=True)``; ``fusible`` is ``target.fusible``, ``fusions`` the
    :class:`~polyhal.passes.fusion.Fusion` records explain lists. ``creates``: the ops ``fn`` may
    create (a backend's claim; see the module docstring). The first line of ``fn``'s docstring
    describes the pass."""
    claimed = frozenset(creates)

    def run(c: Compilation, target: "Target") -> None:
        before = {op.name for op in c.program.ops} if claimed else ()
        c.program, fusions = fn(c.program, target.fusible) if gated else fn(c.program)
        if claimed:  # a claim is honest: the pass makes no op it did not declare
            made = {op.name for f in fusions for op in f.new} - before - claimed
            if made:
                raise PipelineError(f"fusion pass {name!r} created {sorted(made)}, which it does not claim "
                                    f"(creates={sorted(claimed)}); declare every op it makes")
        c.add_fusions(fusions)

    return Pass(name, run, requires=(UNPLACED, *requires), provides=(provides,), enabled=lambda target: target.fuse,
                doc=next(iter((fn.__doc__ or "").strip().splitlines()), ""), disabled_by="compile(fuse=False)",
                creates=tuple(creates))


def _precision(c: Compilation, target: "Target") -> None:
    """float32 work in the requested precision (tf32 / fp16) on the devices that can, per op."""
    c.program, c.precision = apply_precision(
        c.program, (target.precision, target.precision_source), lambda op: target.chosen_device((op,)),
        target.supports_precision)


def _set_encodings(c: Compilation, target: "Target") -> None:
    """Wrap values in encodings (data tiling): conv chains by default, matmuls too with data_tiling=True."""
    if target.data_tiling is not False:
        c.program = set_conv_encodings(set_encodings(c.program) if target.data_tiling else c.program)


def _place(c: Compilation, target: "Target") -> None:
    """A device for every op (select_allocator among those with its kernel); transfers where values cross."""
    c.placement = place(c.program, target)
    c.placement.fusions = c.fusions
    c.placement.precision = c.precision


def _materialize(c: Compilation, target: "Target") -> None:
    """Encodings resolved per device; encode ops folded, or pack/unpack where layouts differ."""
    c.placement = materialize_encodings(c.placement, target)


def _bufferize(c: Compilation, target: "Target") -> None:
    """Memory spaces for kernel scratch, memory types and reuse for intermediates, arenas."""
    c.buffer_plan = bufferize(c.placement, target)


def _decompose(c: Compilation, target: "Target") -> None:
    """Ops no device has a kernel for, as core ops every device has (recurrent layers unrolled)."""
    c.program, records = decompose(c.program, lambda name, affinity: target.candidates(
        [name], affinity or Affinity(target.devices)))
    if records:
        c.add_fusions(records)


#: The passes every compile runs, in order (plugins' passes are inserted into it per compile).
DEFAULT_PIPELINE = Pipeline([
    Pass("decompose", _decompose, requires=(UNPLACED,), provides=("decomposed",)),
    # Quantized contractions first: they take the matmuls, bias adds and convs of the QDQ
    # patterns that the float fusions below would take.
    fusion_pass("fuse-quantized", fuse_quantized, provides="quantized-fused",
                creates=("quantized_conv", "quantized_matmul", "max_pool", "reshape")),
    fusion_pass("fold-constant-transposes", fold_constant_transposes, gated=False, provides="constant-views",
                requires=("quantized-fused",), creates=("transpose",)),
    # Attention first: it takes the matmuls (and scalings) that linear would fuse or move.
    fusion_pass("fuse-attention", fuse_attention, requires=("constant-views",), provides="attention-fused",
                creates=("attention", "masked_attention", "transpose", "reshape")),
    fusion_pass("fuse-linear", fuse_linear, requires=("attention-fused",), provides="linear-fused",
                creates=("linear", "mul")),
    fusion_pass("fuse-gelu", fuse_gelu, provides="gelu-fused", creates=("gelu",)),
    # BatchNormalization's scale and shift into the conv weights first, then the epilogue (after
    # fuse-gelu, so that a GELU formula is one activation the epilogue can take).
    fusion_pass("fold-conv-affine", fold_conv_affine, gated=False, provides="conv-affine-folded", creates=("conv",)),
    fusion_pass("fuse-conv-epilogue", fuse_conv_epilogue,
                requires=("gelu-fused", "conv-affine-folded", "linear-fused"), provides="conv-epilogues-fused",
                creates=("fused_conv", "fused_linear")),
    fusion_pass("fuse-scale-shift", fuse_scale_shift, requires=("conv-epilogues-fused",), provides="scale-shifts-fused",
                creates=("scale_shift",)),
    fusion_pass("pool-before-pointwise-conv", pool_before_pointwise_conv, gated=False, provides="pools-first",
                creates=("avg_pool",)),
    # (Backends insert their own fusions here, after the core's: the CPU's conv prologue.)
    # After fusion, so that a fused op is lowered (or allowed TF32) as one unit, and before data
    # tiling and placement, which then see the program's final element types.
    Pass("precision", _precision, requires=(UNPLACED, "scale-shifts-fused", "pools-first"), provides=("precision",)),
    Pass("set-encodings", _set_encodings, requires=(UNPLACED, "precision"), provides=("encodings-set",)),
    Pass("place", _place, requires=(UNPLACED, "encodings-set"), provides=("placed",), invalidates=(UNPLACED,)),
    Pass("materialize-encodings", _materialize, requires=("placed",), provides=("encodings-materialized",)),
    Pass("bufferize", _bufferize, requires=("placed", "encodings-materialized"), provides=("buffers-planned",)),
])



#: The core's own passes (place chooses only among devices with the kernel; the others keep devices).
_CORE_PASSES = frozenset(DEFAULT_PIPELINE.names)


def _check_placed(c: Compilation, target: "Target", p: Pass) -> None:
    """After a user's or plugin's pass in the placed phase: every dispatch still runs on a
    device with its kernel, else a KernelNotFoundError naming the pass (and its plugin) and the op.
    A ``select_allocator`` hook cannot get there (it chooses among the devices with the kernel);
    a pass that rewrites placement can."""
    for op in c.placement.program.ops:
        if op.kind == "dispatch" and op.device is not None and op.name not in target.kernels(op.device):
            by = f"pass {p.name!r}" + (f" (registered by plugin {p.plugin!r} through register_passes)" if p.plugin else "")
            having = [n for n in target.specs if op.name in target.kernels(n)]
            raise KernelNotFoundError(
                f"{by} placed op {op.name!r} (%{op.outputs[0].name}) on {op.device}, which has no {op.name!r} kernel; "
                f"devices with it: {having or 'none'}. Place it on one of those, or give {op.device} the kernel")


def pipeline_for(registry: "Registry", pipeline: Pipeline | None = None) -> Pipeline:
    """``pipeline`` (default :data:`DEFAULT_PIPELINE`) with the passes ``registry``'s plugins register
    (``register_passes``) inserted in registration order. A record that is not a PassRegistration, that cannot go where it asks, or whose pass
    claims ops the plugin has no kernel for (:func:`_check_claims`), is left out with a warning
    naming the plugin: one plugin's bad pass does not stop every compile."""
    pipeline = DEFAULT_PIPELINE if pipeline is None else pipeline
    for plugin, record in registry.plugin_passes():
        try:
            if not isinstance(record, PassRegistration):
                raise PipelineError(f"register_passes must return PassRegistration records, got {record!r}")
            _check_claims(plugin, record.pass_, registry)
            pipeline = pipeline.insert(replace(record.pass_, plugin=plugin), after=record.after,
                                       before=record.before)
        except (PipelineError, PluginError) as exc:
            warnings.warn(f"polyhal: a compile pass of plugin {plugin!r} is left out: {exc}", RuntimeWarning,
                          stacklevel=4)
    return pipeline


def _check_claims(plugin: str, pass_: Pass, registry: "Registry") -> None:
    """Check the claim of plugin ``plugin``'s ``pass_``: every op it ``creates`` is defined and
    has a kernel on one of the plugin's devices (as onnxruntime's EPs claim only nodes they have
    kernels for). Else a PluginError naming the plugin, the pass and each op, and what to do."""
    if not pass_.creates:
        return
    specs = registry.specs_of_plugin(plugin)  # asks that plugin only: no other backend's driver loads
    served: set[str] = set()
    for spec in specs:
        try:
            served |= spec.kernel_names if spec.kernel_names is not None else registry.kernel_names(spec.name)
        except PolyhalError:  # a device that cannot be created serves nothing; `polyhal devices` says why
            pass
    missing = [op for op in pass_.creates if op not in served]
    if not missing:
        return
    undefined = [op for op in missing if op not in OPS]
    why = "; ".join(filter(None, [
        f"{', '.join(map(repr, undefined))} {'is' if len(undefined) == 1 else 'are'} not defined (a backend defines "
        "its own ops on its kernel table: TABLE.define(name, ...))" if undefined else "",
        f"no device of plugin {plugin!r} has a kernel for {', '.join(repr(op) for op in missing if op in OPS)} "
        f"(register one: @TABLE.register(name))" if len(undefined) < len(missing) else "",
    ]))
    devices = [s.name for s in specs]
    raise PluginError(f"pass {pass_.name!r} claims a fusion into {', '.join(map(repr, missing))}, which plugin "
                      f"{plugin!r} cannot run: {why}; its devices: {', '.join(devices) or 'none'}. The compile goes "
                      "on without that fusion")
