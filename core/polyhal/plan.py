"""Compiling a program into a plan, and running plans.

A :class:`Plan` holds bound kernels (one prepared executable per dispatch), the buffers of its
intermediates and the allocation decisions made while compiling. Running it calls no hook: the
hot path binds the inputs, then loops over prepared steps that read and write a slot table.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import itertools
import operator
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from polyhal.errors import (
    DTypeError, KernelError, LifetimeError, PluginError, PolyhalError, ProgramError, SemaphoreFailedError, ShapeError,
)
from polyhal.hal.device import Device
from polyhal.hal.queue import Semaphore
from polyhal.hal.tensor import Tensor, asarray, empty
from polyhal.hal.transfer import route, transfer_fn
from polyhal.ir.program import Program, Value
from polyhal.passes.pipeline import Compilation, Pipeline, pipeline_for
from polyhal.passes.placement import Placement
from polyhal.policies.precision import resolve_precision
from polyhal.profile import Profile, StepEvent, StepInfo
from polyhal.progress import SAY_AFTER, long_work
from polyhal.registry import Registry, default_registry
from polyhal.specialization import Specialization, SpecializationCache
from polyhal.target import Target


@contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """CPython's cyclic garbage collector paused for the ``with`` block (a compile, an import),
    unless it was already off; reference counting still frees what the block drops.

    A compile makes objects in proportion to the program, most of which outlive the young
    generations, so the collector's full passes -- each over every object of the process -- come
    more often as the program grows: a 64k-op chain spent 3.5 of its 6.2 s of compile there
    (2.7 s without), and compile time grew 11x from 8k to 64k ops instead of 8x. The collector is
    the process's, so other threads go without cycle collection for the block's duration too;
    what they leave is collected after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def compile(program: Program, devices: Sequence[str] | str | None = None, *,
            registry: Registry | None = None, fuse: bool = True, data_tiling: bool | None = None,
            precision: str | None = None, pipeline: Pipeline | None = None,
            cache_size: int | None = None, concurrent: bool | None = None) -> "Plan | PolymorphicPlan":
    """Place ``program`` on ``devices`` and bind its kernels; ``program`` itself is not changed.

    A program with symbolic dims (``ProgramBuilder.input("x", ("batch", 256))``) gives a
    :class:`PolymorphicPlan`: each call binds its inputs' shapes to the symbols and runs the
    plan compiled (with these options) for that binding, made on first use and kept in a
    bounded cache of ``cache_size`` plans (default ``POLYHAL_SHAPE_CACHE``, else 16).

    ``devices`` is the ordered candidate list for ops without an affinity of their own (default:
    every device that can be created, best-ranked first). Each op's candidates are those of the
    list that have its kernel, and the ``select_allocator`` policy chooses among them (memoized);
    the default policy takes the first, so an op runs on the best device that can run it and
    values are moved between devices where needed. Only the devices that ops land on are
    created; when one of the default list fails to create, it is left out (with a warning) and
    the program placed again.

    ``fuse`` (default on) runs the fusion passes first: each attention head (matmul, scaling,
    softmax, matmul) becomes one ``attention`` op (:mod:`polyhal.passes.fuse_attention`) and
    each matmul with a bias add one ``linear`` op (:mod:`polyhal.passes.fuse_linear`), each GELU
    formula one ``gelu`` op (:mod:`polyhal.passes.fuse_gelu`); per-channel scales and shifts after
    a conv with constant weights (BatchNormalization) fold into its weights, and a conv's or
    linear's residual add and activation become one ``fused_conv`` / ``fused_linear``
    (:mod:`polyhal.passes.fuse_conv`), and backends add fusions of their own (``register_passes``)
    -- fused ops wherever the device placement would choose for those ops has the fused kernel
    (:meth:`polyhal.Target.fusible`). Before them,
    transposes of constants become transposed views of the data
    (:mod:`polyhal.passes.fold_constants`). ``plan.explain()`` lists what was fused.

    ``data_tiling`` wraps values in encodings (:mod:`polyhal.passes.data_tiling`): by default
    (None) the feature maps of depthwise conv chains, which the CPU keeps channel-blocked; with
    True matmul operands and results too; with False nothing. After placement,
    MaterializeEncoding resolves every
    encoding on its device and folds or materializes the encode ops
    (:mod:`polyhal.passes.materialize_encoding`).

    ``precision`` says how float32 work may be computed (default ``POLYHAL_PRECISION``, else
    ``"fp32"``; see :mod:`polyhal.passes.precision`): ``"fp32"`` in float32 (no TF32 anywhere),
    ``"tf32"`` with float32 contractions allowed on TF32 tensor cores, ``"fp16"`` with the
    program's float32 compute run in float16 where safe (weights converted once here; inputs and
    outputs stay float32). It applies after fusion, per op on the device placement would choose;
    a device without the precision computes in float32, and ``plan.explain()`` says what changed.
    An unknown precision (or ``"bf16"``, which no device computes in) is a PrecisionError.

    The passes run in the order of ``pipeline`` (default: :data:`polyhal.passes.pipeline.DEFAULT_PIPELINE`
    with the passes plugins register through ``register_passes``), each on the compile's
    :class:`~polyhal.target.Target`; ``plan.explain()`` lists each pass, its time and what it
    changed. Pass your own pipeline (``DEFAULT_PIPELINE.insert(Pass(...), after=...)``) to add a pass.

    ``concurrent`` says how a plan over several devices runs (see :class:`ConcurrentSchedule`
    and docs/queues.md): None (default) as per-device parts on the devices' queues, joined by
    semaphore waits at transfers, when two devices have independent work that can overlap, else
    step by step; True always as parts; False always step by step. A plan on one device runs
    its steps in one loop (or its device's replay, a CUDA graph) whatever this says.
    """
    resolve_precision(precision)  # an unknown precision fails here, before anything is built
    if pipeline is not None:
        pipeline.validate()
    if not isinstance(program, Program):
        raise ProgramError(f"polyhal.compile takes a Program (from ProgramBuilder or a front end such as "
                           f"polyhal.onnx.load), got {type(program).__name__}; a front end's own program "
                           "compiles with its .compile()")
    if not program.is_static:
        options = dict(fuse=fuse, data_tiling=data_tiling, precision=precision, pipeline=pipeline,
                       concurrent=concurrent)
        return PolymorphicPlan.of(program, lambda p: compile(p, devices, registry=registry, **options), cache_size)
    registry = registry or default_registry()
    if isinstance(devices, str):
        devices = (devices,)
    options = dict(fuse=fuse, data_tiling=data_tiling, precision=precision)

    def compile_on(names: tuple[str, ...]) -> Plan:
        for name in names:  # the registry imports their backends now, if not yet: their passes join the pipeline
            registry.spec(name)
        with cycle_collection_paused():
            plan = _compile_on(program, pipeline if pipeline is not None else pipeline_for(registry),
                               Target.build(registry, names, **options), registry, concurrent)
        trim_heap()  # what the passes and the kernels' preparation made and dropped (<1 ms)
        return plan

    if devices:
        return compile_on(tuple(devices))
    while True:
        devices = tuple(registry.default_devices())
        try:
            return compile_on(devices)
        except PluginError:
            # A device of the default list failed to create (recorded and warned about by the
            # registry): place again without it; anything else is the caller's to see.
            if not any(registry.is_broken(d) for d in devices):
                raise


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, looked up once among the symbols the process already has loaded
    (``dlopen(NULL)``): ``ctypes.util.find_library`` would run ``ldconfig`` in a child process
    (2-4 ms of the first session of a process). None where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (or no dlopen(NULL)): nothing to trim this way
        return None


def trim_heap() -> None:
    """Give the heap pages freed by an import or a compile back to the system. Both make many
    small objects that die at their end (protobuf's blocks of a parsed ModelProto; a compile's
    intermediate programs, fusion candidates, kernel-choice trials), and glibc keeps the freed
    blocks for reuse: without this a process stays as large as at the peak of its last import or
    compile (a parsed ModelProto doubles the weights; MobileNetV3's compile leaves 5.6 MB)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _compile_on(program: Program, pipeline: Pipeline, target: Target, registry: Registry,
                concurrent: bool | None = None) -> "Plan":
    """Run ``pipeline`` over ``program`` for ``target`` and bind the result into a Plan (said on a
    terminal where it takes over a second: kernel builds, cuDNN's engine timing, a large model)."""
    with long_work(f"compiling {program.name!r} for {', '.join(target.devices)}", f"compiled {program.name!r}",
                   after=SAY_AFTER):
        return Plan(pipeline.run(program, target), target, registry, concurrent=concurrent)


class Plan:
    """A compiled program, ready to run many times.

    Call it with the inputs (positionally or by name; numpy arrays or polyhal tensors); it
    returns the outputs as polyhal tensors (a tuple when there are several). Pass ``out=`` to
    write into tensors you own instead of fresh ones, or call :meth:`run_numpy` for numpy
    arrays. A plan is not re-entrant: concurrent calls are serialised.
    """

    def __init__(self, compilation: Compilation, target: Target, registry: Registry, *,
                 concurrent: bool | None = None) -> None:
        placement = compilation.placement
        if placement is None or compilation.buffer_plan is None:
            raise ProgramError(f"the compile pipeline {[r.name for r in compilation.records]} did not place and bufferize the "
                               "program; a pipeline must keep the 'place' and 'bufferize' passes")
        self.placement: Placement = placement
        #: What the compile passes did (one record per pass) and their notes, for explain.
        self.compilation = compilation
        #: The compile's Target (devices, kernel sets and policies the passes used).
        self.target = target
        #: The ordered device list the plan was compiled for (explain says which lacked an op).
        self.devices = target.devices
        self.program = program = placement.program
        self.registry = registry
        self._concurrent = concurrent
        self._lock = threading.Lock()
        self._staging: dict[int, Tensor] = {}  # per input value: upload buffer on a non-host device
        slot_of: dict[int, int] = {}
        for v in [*program.inputs, *(c for c, _ in program.constants)]:
            slot_of[v.id] = len(slot_of)
        for op in program.ops:
            for v in op.outputs:
                slot_of[v.id] = len(slot_of)
        self._slots: list[Any] = [None] * len(slot_of)
        dev = lambda v: registry.get_device(placement.value_device[v.id])  # noqa: E731
        # Constants are bound once, here: in place on host devices (they are read-only), one
        # upload elsewhere.
        self.constants: list[Tensor] = []
        for v, data in program.constants:
            device = dev(v)
            if device.is_host:
                self._slots[slot_of[v.id]] = data
            else:
                t = asarray(data, data.dtype, device)
                self.constants.append(t)
                self._slots[slot_of[v.id]] = t.native
        self._input_devices = [dev(v) for v in program.inputs]
        self._input_slots = [slot_of[v.id] for v in program.inputs]
        self._input_names = tuple(v.name for v in program.inputs)
        self._output_slots = [slot_of[v.id] for v in program.outputs]
        self._output_devices = [dev(v) for v in program.outputs]
        output_ids = {v.id for v in program.outputs}
        # Intermediates and global kernel scratch live in arenas that bufferize planned (bytes
        # reused where lifetimes do not overlap), allocated once, here; outputs are fresh per run
        # (or given by out=), in the memory type bufferize chose for a host reader.
        self.buffer_plan = compilation.buffer_plan
        self._buffers = self.buffer_plan.materialize(registry, target.selector, program.name)
        self._output_memory = [self.buffer_plan.output_memory[v.id] for v in program.outputs]
        # What a run allocates for each output (what tensor.empty would, resolved once).
        self._output_alloc = [(d, max(v.type.nbytes, 1), mt, v.type)
                              for v, d, mt in zip(program.outputs, self._output_devices, self._output_memory)]
        # Outputs that live in host memory can be plain numpy arrays for run_numpy: (shape, dtype)
        # per output, or None when some output lives elsewhere.
        self._host_outputs = ([(v.type.shape, v.type.dtype) for v in program.outputs]
                              if all(d.is_host for d in self._output_devices) else None)
        # What a run walks per input and per host output, zipped once here (a run of a small model
        # costs a few microseconds, and each zip over parallel lists a few hundred nanoseconds).
        self._input_binding = tuple(zip(program.inputs, self._input_slots, self._input_devices))
        self._host_binding = (tuple((slot, shape, dtype) for slot, (shape, dtype)
                                    in zip(self._output_slots, self._host_outputs))
                              if self._host_outputs is not None else ())
        self.intermediates: list[Tensor] = []
        for op in program.ops:
            for v in op.outputs:
                if v.id not in output_ids:
                    t = self._buffers.values[v.id]
                    self.intermediates.append(t)
                    self._slots[slot_of[v.id]] = t.native
        # An op whose result bufferize made a view of its operand's buffer (a reshape, a host
        # transpose) has nothing to run: its slot holds the view.
        elided = self.buffer_plan.elided_ops
        self._step_ops = [op for i, op in enumerate(program.ops) if i not in elided]
        self._steps: list[Callable[[], None]] = [
            self._step(op, slot_of, dev, self._buffers.scratch.get(i))
            for i, op in enumerate(program.ops) if i not in elided]
        #: ``node_names(op) -> str``: the source node an op came from, for profiles (a front end
        #: sets it: the ONNX one's is ``OnnxProgram.origin``); None names a step by its result.
        self.node_names: Callable[[Any], str] | None = None
        self.dispatch_count = sum(op.kind == "dispatch" for i, op in enumerate(program.ops) if i not in elided)
        # Replay hook: a device may turn the whole step list into one replayable unit (CUDA: a
        # graph captured once, inputs and outputs rebound per call); only for a plan that lives
        # entirely on that one device. ``None`` (the default) keeps the plain step loop.
        self.replay: Callable[[], None] | None = None
        homes = {op.device for op in program.ops} | {placement.value_device[v.id]
                                                      for v in (*program.inputs, *program.outputs)}
        #: The per-device parts the plan runs as on the devices' queues, or None (step by step).
        self.schedule: ConcurrentSchedule | None = None
        if len(homes) == 1 and not placement.transfers and None not in homes:
            self.replay = registry.get_device(homes.pop()).record(
                tuple(self._steps), self._slots, tuple(self._input_slots), tuple(self._output_slots))
        elif concurrent is not False and len({op.device for op in self._step_ops}) > 1:
            schedule = ConcurrentSchedule(self, slot_of, dev)
            if concurrent or schedule.overlaps:
                self.schedule = schedule
                self.replay = schedule.run

    def duplicate(self) -> "Plan":
        """A plan of the same compile -- program, placement, buffer plan, target -- with buffers,
        scratch, staging and a lock of its own: what compiling the program again for the same
        target gives, without running the passes again. The two run independently (on different
        threads at once, too); constants on host devices are shared (they are read-only)."""
        return self.binder()()

    def binder(self) -> Callable[[], "Plan"]:
        """A function that makes :meth:`duplicate` s of this plan without holding on to it: it
        keeps the compile (program, placement, buffer plan, target), none of this plan's
        buffers, scratch or constants uploaded to a device -- what a cache of compiled programs
        keeps (:class:`polyhal.InferenceSession`'s)."""
        compilation, target, registry, concurrent, names = (self.compilation, self.target, self.registry,
                                                           self._concurrent, self.node_names)

        def bind() -> Plan:
            plan = Plan(compilation, target, registry, concurrent=concurrent)
            plan.node_names = names
            return plan
        return bind

    def _step(self, op, slot_of: dict[int, int], dev, scratch=None) -> Callable[[], None]:
        """The prepared step of ``op``; its ``writes`` attribute names the slots it writes (for
        a device's replay, :meth:`~polyhal.hal.device.Device.record`)."""
        step = self._prepared_step(op, slot_of, dev, scratch)
        step.writes = tuple(slot_of[v.id] for v in op.outputs)  # type: ignore[attr-defined]
        return step

    def _prepared_step(self, op, slot_of: dict[int, int], dev, scratch=None) -> Callable[[], None]:
        slots = self._slots
        ins = [slot_of[v.id] for v in op.inputs]
        outs = [slot_of[v.id] for v in op.outputs]
        if op.kind == "transfer":
            return _transfer_step(dev(op.inputs[0]), dev(op.outputs[0]), slots, ins[0], outs[0], op.outputs[0])
        device = dev(op.outputs[0])
        extra = {"scratch": scratch} if scratch else {}  # only kernels that declared scratch get one
        fn = device.prepare(op.name, dict(op.attrs), tuple(v.type for v in op.inputs),
                            tuple(v.type for v in op.outputs), **extra)
        # Specialised closures for the common arities keep the per-step cost to one call.
        if len(ins) == 1 and len(outs) == 1:
            a, o = ins[0], outs[0]
            return lambda: fn(slots[a], slots[o])
        if len(ins) == 2 and len(outs) == 1:
            a, b, o = ins[0], ins[1], outs[0]
            return lambda: fn(slots[a], slots[b], slots[o])
        idx = ins + outs
        if len(idx) < 2:
            return lambda: fn(*[slots[i] for i in idx])
        take = operator.itemgetter(*idx)  # the arguments in one C call (a list comprehension of 8: +0.3 us)
        return lambda: fn(*take(slots))

    # -- running -----------------------------------------------------------------------------------

    def __call__(self, *args: Any, out: Sequence[Tensor] | None = None, **kwargs: Any) -> Any:
        inputs = self._gather_inputs(args, kwargs)
        with self._lock:
            results = self._run(inputs, self._bind_outputs, out)
        return results[0] if len(results) == 1 else tuple(results)

    run = __call__

    def run_numpy(self, *args: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        """Run the plan (inputs as for calling it) and return every output as a numpy array,
        in a tuple even when there is one.

        Outputs that live in host memory are written straight into fresh numpy arrays, which the
        caller owns like any array it made (the device allocator does not count them); others are
        computed into polyhal tensors and copied to the host. This is the cheaper path for callers
        that want numpy results (the ONNX front end's ``execute``): it skips making a buffer and
        a tensor per output and mapping them back.
        """
        inputs = self._gather_inputs(args, kwargs)
        if self._host_outputs is None:
            with self._lock:
                tensors = self._run(inputs, self._bind_outputs, None)
            return tuple(t.numpy() for t in tensors)
        with self._lock:
            return tuple(self._run(inputs, self._bind_host_outputs, None))

    def _run(self, inputs: Sequence[Any], bind_outputs: Callable[[Any], list], out: Any) -> list:
        """Bind ``inputs``, then the outputs (``bind_outputs(out)``, whose result is returned),
        and run the steps. The caller holds the lock."""
        slots = self._slots
        staging = self._staging
        try:
            for (value, slot, device), x in zip(self._input_binding, inputs):
                slots[slot] = _bind_input(value, device, x, staging)
            results = bind_outputs(out)
            # The try costs nothing while no kernel raises (zero-cost exceptions): the failing
            # step is looked for only on the way out.
            try:
                # Kernels compute IEEE results (log(0) = -inf, 0/0 = nan), as onnxruntime does;
                # numpy's RuntimeWarnings about them would reach users with polyhal's source paths.
                with np.errstate(all="ignore"):
                    if self.replay is not None:
                        self.replay()
                    else:
                        for step in self._steps:
                            step()
            except BaseException as exc:
                if out is None and bind_outputs == self._bind_outputs:
                    for t in results:  # the run's own outputs go back now, not when the traceback goes
                        t.release()
                if isinstance(exc, PolyhalError) or not isinstance(exc, Exception):
                    raise
                raise self._kernel_error(exc) from exc
        finally:
            for i in self._input_slots:
                slots[i] = None  # do not keep the caller's arrays alive
        return results

    def _kernel_error(self, exc: Exception) -> KernelError:
        """``exc``, raised by a step, as a KernelError naming the op, its device and plugin. The step
        is the one whose frame is in the traceback (its code and closure are those of a step)."""
        index = None
        tb = exc.__traceback__
        while tb is not None and index is None:
            frame, tb = tb.tb_frame, tb.tb_next
            for i, step in enumerate(self._steps):
                closure = getattr(step, "__closure__", None)
                if closure and getattr(step, "__code__", None) is frame.f_code and all(
                        frame.f_locals.get(name, closure) is cell.cell_contents
                        for name, cell in zip(frame.f_code.co_freevars, closure)):
                    index = i
                    break
        what = f"{type(exc).__name__}: {exc}"
        if index is None:  # replayed as one unit (a CUDA graph): the plan's one device is all we know
            device = next(iter({op.device for op in self._step_ops}), None)
            return KernelError(f"plan {self.program.name!r} on device {device} (plugin {self._plugin_of(device)!r}) "
                               f"raised {what}", device=device, plugin=self._plugin_of(device))
        op = self._step_ops[index]
        device = self.placement.value_device[op.outputs[0].id]
        plugin = self._plugin_of(device)
        if op.kind == "transfer":
            source = self.placement.value_device[op.inputs[0].id]
            message = f"transfer of {op.inputs[0]} from {source} to device {device} (plugin {plugin!r})"
        else:
            message = f"kernel {op.name!r} on device {device} (plugin {plugin!r})"
        return KernelError(f"{message} raised {what} (plan {self.program.name!r}, step {index})",
                           device=device, op=op.name, plugin=plugin)

    def _plugin_of(self, device: str | None) -> str | None:
        try:
            return self.registry.spec(device).plugin if device is not None else None
        except PolyhalError:
            return None

    def _bind_host_outputs(self, out: None) -> list[np.ndarray]:
        slots, arrays = self._slots, []
        for slot, shape, dtype in self._host_binding:
            slots[slot] = a = np.empty(shape, dtype)
            arrays.append(a)
        return arrays

    def _gather_inputs(self, args: tuple, kwargs: dict) -> Sequence[Any]:
        names = self._input_names
        if not kwargs and len(args) == len(names) and all(map(operator.is_not, args, itertools.repeat(None))):
            return args  # the common positional call: no further function call (a plan call costs ~3 us)
        return gather_inputs(self.program.name, names, args, kwargs)

    def _bind_outputs(self, out: Sequence[Tensor] | None) -> list[Tensor]:
        values = self.program.outputs
        if out is None:
            tensors = [Tensor(d.allocator.allocate(nbytes, mt), ttype) for d, nbytes, mt, ttype in self._output_alloc]
        else:
            tensors = list(out) if isinstance(out, (list, tuple)) else [out]
            if len(tensors) != len(values):
                raise ProgramError(f"out= needs {len(values)} tensors, got {len(tensors)}")
            for v, t, d in zip(values, tensors, self._output_devices):
                # (one read of each attribute: callers that loop over a plan pass out= every run)
                tt = t.type if isinstance(t, Tensor) else None
                vt = v.type
                if tt is None or tt.shape != vt.shape or tt.dtype != vt.dtype or t.buffer.device is not d \
                        or not t.is_contiguous:
                    raise ShapeError(f"out= tensor for %{v.name} must be a contiguous {vt} on {d.name}, got {t!r}")
                if t.readonly or t.buffer.released:
                    what = "is read-only (imported from a read-only DLPack producer)" if t.readonly else \
                        "has been released"
                    raise LifetimeError(f"out= tensor for %{v.name} {what}; pass a writable tensor you own, "
                                        "e.g. polyhal.empty(...)")
        slots = self._slots
        # Every output has a slot of its own: placement copies an output that aliases an input,
        # a constant or another output (placement._distinct_outputs).
        for slot, t in zip(self._output_slots, tensors):
            slots[slot] = t.native
        return tensors

    # -- profiling ---------------------------------------------------------------------------------

    @contextmanager
    def profiling(self, *, trace: str | None = None, node_names: Callable[[Any], str] | None = None
                  ) -> Iterator[Profile]:
        """Profile every run of this plan inside the ``with`` block::

            with plan.profiling(trace="run.json") as prof:
                plan(x)
            print(prof.table())

        While the block is active the plan runs a loop of its own that times each step (see
        :mod:`polyhal.profile`; a replayed plan, such as a CUDA graph, runs step by step); the
        plain loop is put back on leaving it, so an unprofiled run costs what it did. If a run
        raises, the profile keeps what ran, the error included, the trace (if ``trace`` names
        a file) is still written, and the exception carries the profile as ``exc.profile``.
        ``node_names(op)`` names each step's source node (default: :attr:`node_names`).
        """
        names = node_names or self.node_names
        devices = [self.registry.get_device(op.device) for op in self._step_ops]
        timers: dict[str, Any] = {}
        for d in devices:
            if d.name not in timers:
                timers[d.name] = d.profile_timer()
        infos = [StepInfo(i, "transfer" if op.kind == "transfer" else op.name,
                          (names(op) if names else "") or "%" + op.outputs[0].name, d.name, op.kind,
                          getattr(timers[d.name], "name", "host clock + synchronize"))
                 for i, (op, d) in enumerate(zip(self._step_ops, devices))]
        profile = Profile(self.program.name, infos)
        plain = self.replay
        self.replay = self._profiled_loop(profile, devices, timers)
        try:
            yield profile
        except BaseException as exc:
            profile.error = f"{type(exc).__name__}: {exc}"
            exc.profile = profile
            if trace is not None and hasattr(exc, "add_note"):
                exc.add_note(f"(the partial profile's trace was written to {trace})")
            raise
        finally:
            self.replay = plain
            if trace is not None:
                profile.write_trace(trace)

    def profile(self, *args: Any, runs: int = 1, trace: str | None = None,
                node_names: Callable[[Any], str] | None = None, **kwargs: Any) -> Profile:
        """Run the plan ``runs`` times on the inputs (as for calling it) under :meth:`profiling`
        and return the :class:`~polyhal.profile.Profile` (``.table()``, ``.write_trace(path)``)."""
        if runs < 1:
            raise ProgramError(f"profile needs runs >= 1, got {runs}")
        with self.profiling(trace=trace, node_names=node_names) as profile:
            for _ in range(runs):
                self(*args, **kwargs)
        return profile

    def _profiled_loop(self, profile: Profile, devices: list[Device], timers: dict[str, Any]) -> Callable[[], None]:
        """The step loop that times each step into ``profile`` (a separate loop: the plain one
        stays untouched). Steps on a device with event timing are timed by its events, read
        once the run's steps are queued; the others by the host clock around the step and the
        device's synchronize."""
        plan = [(i, step, d, timers[d.name]) for i, (step, d) in enumerate(zip(self._steps, devices))]
        events, clock, origin = profile.events, time.perf_counter_ns, profile.origin_ns

        def run() -> None:
            index = profile.runs
            profile.runs += 1
            pending = []  # (event, timer, start mark, end mark) awaiting the device's times
            try:
                for i, step, device, timer in plan:
                    t0 = clock()
                    marks = timer.mark() if timer is not None else None
                    try:
                        step()
                        if timer is None:
                            device.synchronize()
                    except BaseException as exc:
                        took = clock() - t0
                        error = f"{type(exc).__name__}: {exc}"
                        events.append(StepEvent(i, index, t0 - origin, took, took, error=error))
                        raise
                    t1 = clock()
                    event = StepEvent(i, index, t0 - origin, t1 - t0, t1 - t0)
                    events.append(event)
                    if timer is not None:
                        pending.append((event, timer, marks, timer.mark()))
            finally:
                for event, timer, start, end in pending:
                    try:
                        event.duration_ns = timer.elapsed_ns(start, end)
                    except Exception:  # noqa: BLE001 -- a failed device keeps the host time, not a second error
                        pass
        return run

    # -- introspection -----------------------------------------------------------------------------

    def explain(self) -> str:
        """Placement, transfers and allocation decisions of this plan, as text."""
        views = len(self.buffer_plan.views) + len(self.buffer_plan.in_place)
        lines = [f"plan @{self.program.name}: {self.dispatch_count} dispatches, "
                 f"{self.placement.transfers} transfers, {len(self.intermediates) - views} intermediate buffers "
                 + (f"and {views} views of them " if views else "") +
                 f"(planned peak {self.buffer_plan.peak_bytes} B, unplanned {self.buffer_plan.unplanned_bytes} B)"]
        if self.placement.fusions is None:
            lines.append("  fusion: off (compiled with fuse=False)")
        for fusion in self.placement.fusions or ():
            lines.append(f"  fused {fusion.explain()}")
        if self.placement.precision is not None:
            lines.extend(self.placement.precision.explain_lines())
        for op, candidates, d in self.placement.decisions:
            lacking = [name for name in self.devices if name not in candidates]
            why = f"; {', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} no {op.name!r} kernel" \
                if lacking and op.affinity is None else ""
            lines.append(f"  {op.name} -> {d.device_name} (candidates {list(candidates)}{why}; "
                         f"select_allocator by {d.plugin!r}, index {d.index}: {d.reason})")
        for op in self.program.ops:
            if op.kind == "transfer":
                src, dst = (self.registry.get_device(self.placement.value_device[v.id]) for v in (op.inputs[0], op.outputs[0]))
                r = route(src, dst)
                lines.append(f"  transfer %{op.inputs[0].name}: {r.explain(op.outputs[0].type.nbytes)}; {r.direction}")
        if self.schedule is not None:
            lines.extend(self.schedule.explain_lines())
        if self.placement.encodings is not None:
            lines.extend(self.placement.encodings.explain_lines())
        lines.extend("  " + line for line in self.buffer_plan.explain().splitlines())  # bufferize's decisions
        lines.extend(self.explain_passes())
        return "\n".join(lines)

    def explain_passes(self) -> list[str]:
        """The compile pipeline as run: each pass, its time and what it changed, and passes' notes."""
        records = self.compilation.records
        ran = [r for r in records if r.ran]
        lines = [f"  passes ({len(ran)} run, {sum(r.seconds for r in ran) * 1e3:.1f} ms):"]
        lines.extend(f"    {r.explain()}" for r in ran)
        skipped: dict[str, int] = {}
        for r in records:
            if not r.ran:
                skipped[r.detail] = skipped.get(r.detail, 0) + 1
        lines.extend(f"    {n} passes skipped{f' ({why})' if why else ''}" for why, n in skipped.items())
        lines.extend(f"  note: {note}" for note in self.compilation.notes)
        return lines

    def __str__(self) -> str:
        return str(self.program)


def gather_inputs(name: str, names: tuple[str, ...], args: tuple, kwargs: dict) -> Sequence[Any]:
    """A call's inputs in order, from ``args`` (by position) and ``kwargs`` (by name) for a plan
    of program ``name`` whose inputs are ``names``; ProgramError for extra, unknown or missing ones."""
    if not kwargs and len(args) == len(names) and all(map(operator.is_not, args, itertools.repeat(None))):
        return args  # the common positional call builds nothing (and map runs in C: no generator)
    if len(args) > len(names):
        raise ProgramError(f"plan {name!r} takes {len(names)} inputs {list(names)}, got {len(args)}")
    values = list(args) + [None] * (len(names) - len(args))
    for k, x in kwargs.items():
        if k not in names:
            raise ProgramError(f"plan {name!r} has no input {k!r}; inputs: {list(names)}")
        values[names.index(k)] = x
    missing = [n for n, x in zip(names, values) if x is None]
    if missing:
        raise ProgramError(f"plan {name!r} is missing inputs {missing}; pass them by position or by name")
    return values


class PolymorphicPlan:
    """A compiled program with symbolic dims: call it like a :class:`Plan`.

    Each call looks up the plan for its inputs' shapes (one key tuple and one lookup in a bounded
    LRU :class:`~polyhal.specialization.SpecializationCache`); on a miss it binds the shapes to
    the symbols (:meth:`Program.bind <polyhal.ir.program.Program.bind>`: a symbol at two sizes
    is a ShapeError naming it and both sizes), specializes the program to that binding
    (:meth:`Program.specialize <polyhal.ir.program.Program.specialize>`) and compiles it through
    the ordinary pipeline. A binding the cache evicted is compiled again (and counted again as a
    miss); ``cache`` holds the statistics and :meth:`explain` prints them.
    """

    def __init__(self, name: str, input_names: Sequence[str], make: Callable[[tuple], Specialization],
                 cache: SpecializationCache[Specialization], *, symbols: Sequence[str] = ()) -> None:
        self.name = name
        self.cache = cache
        #: The symbolic dims a call binds.
        self.symbols = tuple(symbols)
        self._make = make
        self._names = tuple(input_names)

    @classmethod
    def of(cls, program: Program, compile: Callable[[Program], Plan], cache_size: int | None = None
           ) -> "PolymorphicPlan":
        """The polymorphic plan of ``program`` (with symbolic dims), each specialization of which
        ``compile`` compiles."""
        def make(shapes: tuple[tuple[int, ...], ...]) -> Specialization:
            concrete = program.specialize(program.bind(shapes))
            return Specialization(concrete, compile(concrete))

        return cls(program.name, [v.name for v in program.inputs], make, SpecializationCache(cache_size),
                   symbols=program.symbols)

    def _gather(self, args: tuple, kwargs: dict) -> Sequence[Any]:
        return gather_inputs(self.name, self._names, args, kwargs)

    def specialization(self, *args: Any, **kwargs: Any) -> Specialization:
        """The specialization (concrete program and plan) for these inputs (positionally or by
        name), made on first use."""
        return self.lookup(self._gather(args, kwargs))

    def lookup(self, inputs: Sequence[Any]) -> Specialization:
        """The specialization for ``inputs`` (one per program input, in order)."""
        try:
            key = tuple([x.shape for x in inputs])
        except AttributeError:
            key = tuple(np.shape(x) for x in inputs)
        found = self.cache.get(key)
        return found if found is not None else self.cache.put(key, self._make(key))

    def __call__(self, *args: Any, out: Sequence[Tensor] | None = None, **kwargs: Any) -> Any:
        inputs = self._gather(args, kwargs)
        return self.lookup(inputs).plan(*inputs, out=out)

    run = __call__

    def run_numpy(self, *args: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        """As :meth:`Plan.run_numpy`, through the plan of these inputs' shapes."""
        inputs = self._gather(args, kwargs)
        return self.lookup(inputs).plan.run_numpy(*inputs)

    @property
    def plans(self) -> list[Plan]:
        """The cached plans, least recently used first."""
        return [s.plan for s in self.cache.values()]

    def explain(self) -> str:
        """The symbolic program's inputs, the cache's statistics and shapes, and the most recently
        used plan's explanation."""
        names = self._names
        lines = [f"polymorphic plan @{self.name}: a plan per binding of {', '.join(self.symbols)}",
                 self.cache.explain(lambda key: ", ".join(f"{n}{list(s)}" for n, s in zip(names, key)))]
        specs = self.cache.values()
        if specs:
            lines.append("most recent specialization:")
            lines.append(specs[-1].plan.explain())
        return "\n".join(lines)


def _bind_input(value: Value, device: Device, x: Any, staging: dict[int, Tensor]) -> Any:
    """The native object for one input: zero-copy where the data already sits on ``device``,
    else uploaded into the plan's staging tensor for that input (made on first need, reused by
    later runs: runs are serialised and uploads are queue-ordered before the kernels)."""
    t = value.type
    if isinstance(x, Tensor):
        if x.shape != t.shape or x.dtype != t.dtype:
            raise ShapeError(f"input %{value.name} expects {t}, got {x.type}")
        if x.buffer.released:  # its memory may already belong to someone else
            raise LifetimeError(f"input %{value.name}: {x} was released (Tensor.release / Buffer.release) and "
                                "cannot be read; keep it alive until the run, or pass a new tensor")
        if x.device is device and x.is_contiguous:
            return x.native
        x = x.numpy()
    arr = np.asarray(x)
    if arr.dtype != t.dtype:
        raise DTypeError(f"input %{value.name} expects {t.dtype}, got {arr.dtype}; cast it with .astype('{t.dtype}')")
    if arr.shape != t.shape:
        raise ShapeError(f"input %{value.name} expects shape {t.shape}, got {arr.shape}")
    if device.is_host:  # host memory: numpy arrays are used in place
        return arr
    staged = staging.get(value.id)
    if staged is None:
        staged = staging[value.id] = empty(t.shape, t.dtype, device)
    device.upload(np.asarray(arr, order="C"), staged.native)
    return staged.native


def _transfer_step(src: Device, dst: Device, slots: list, a: int, b: int, value: Value,
                   queued: bool = False) -> Callable[[], None]:
    # The route (which backend copies, or a host array between) is chosen once, here.
    move = transfer_fn(route(src, dst), value.type.shape, value.type.dtype, queued)
    return lambda: move(slots[a], slots[b])


# ------------------------------------------------------------------------------------------------
# Concurrent plans: per-device parts on the devices' queues, joined by semaphore waits
# ------------------------------------------------------------------------------------------------

class Part:
    """A run of consecutive steps of one device that a queue executes as one submission.

    ``waits`` are (lane, ordinal) pairs: this part starts once part ``ordinal`` of ``lane`` has
    signalled; it signals its own ``ordinal`` (1, 2, ... within its lane) when done. A transfer
    is a part of its own, on the destination's lane.
    """

    __slots__ = ("lane", "ordinal", "steps", "waits", "transfer", "work", "mode")

    def __init__(self, lane: int, ordinal: int, transfer: bool) -> None:
        self.lane, self.ordinal, self.transfer = lane, ordinal, transfer
        self.steps: list[int] = []
        self.waits: dict[int, int] = {}
        self.work: tuple[Callable[[], None], ...] = ()
        self.mode = ""


class ConcurrentSchedule:
    """How a plan over several devices runs concurrently (issue 28; IREE's per-device command
    buffers joined by timeline semaphores).

    Built once with the plan. Every device the steps run on is a *lane* with one queue
    (:attr:`~polyhal.hal.device.Device.concurrent_queue`: a GPU's event-backed stream queue, a
    host thread for the CPU) and one timeline semaphore. The steps, in program order, are cut
    into :class:`Part` s: a part ends where another lane needs what it wrote, and a transfer is a
    part of its own on the destination's lane (its copy is ordered after the source's part by a
    semaphore wait: on the device for queues of one domain, ``cudaStreamWaitEvent``, else on the
    host). Ordering comes from two hazards between lanes: read after write (a step reads a
    value another lane wrote) and write after read (a lane overwrites memory bufferize reused
    while a transfer on another lane may still read it). Inside a lane, program order holds.

    A run submits every part in program order -- never blocking: host queues return at once,
    GPU queues issue at once or hand the part to their issue thread -- and then waits until each
    lane's last part is done (host lanes) or issued (GPU lanes: later work on their stream is
    ordered after it, as in the step-by-step plan). A part that fails fails its lane's
    semaphore, the parts waiting on it fail in turn, the other lanes finish their work, and the
    run raises a :class:`~polyhal.errors.KernelError` naming the device and step that failed (a
    polyhal error a kernel raised keeps its type, with a note naming them).

    A kernel part of a device that records (CUDA graphs) replays through the device's
    :meth:`~polyhal.hal.device.Device.record`, as a single-device plan does.
    """

    #: Above this many parts the overlap analysis (quadratic) is skipped: the plan runs step by step
    #: unless compiled with concurrent=True.
    MAX_ANALYSED_PARTS = 2048

    def __init__(self, plan: Plan, slot_of: dict[int, int], dev: Callable[[Value], Device]) -> None:
        self.plan = plan
        ops = plan._step_ops
        registry = plan.registry
        lane_names: list[str] = []
        for op in ops:
            if op.device not in lane_names:
                lane_names.append(op.device)
        self.devices = [registry.get_device(n) for n in lane_names]
        self.queues = [d.concurrent_queue for d in self.devices]
        lane_of = [lane_names.index(op.device) for op in ops]
        deps, fed = self._dependencies(plan, slot_of, lane_of)
        needed = set()
        for d in deps:
            needed.update(d)
        self.parts: list[Part] = []
        current: list[Part | None] = [None] * len(lane_names)
        counts = [0] * len(lane_names)
        part_of: list[Part] = []
        for i, op in enumerate(ops):
            lane = lane_of[i]
            part = current[lane]
            is_transfer = op.kind == "transfer"
            if part is None or is_transfer or part.transfer or deps[i]:
                counts[lane] += 1
                part = current[lane] = Part(lane, counts[lane], is_transfer)
                self.parts.append(part)
            part.steps.append(i)
            part_of.append(part)
            for j in deps[i]:
                dep = part_of[j]
                if dep.lane != lane and part.waits.get(dep.lane, 0) < dep.ordinal:
                    part.waits[dep.lane] = dep.ordinal
            if i in needed or is_transfer:
                current[lane] = None  # another lane waits for this step: its part signals here
        self.counts = counts
        self._bind_work(plan, slot_of, dev, fed)
        self.overlaps = self._overlaps()
        self._runs = 0
        self._semaphores = self._fresh_semaphores()

    # -- building ----------------------------------------------------------------------------------

    @staticmethod
    def _dependencies(plan: Plan, slot_of: dict[int, int], lane_of: list[int]) -> tuple[list[set[int]], list[bool]]:
        """Per step, the earlier steps of *other* lanes it must wait for (read after write, and
        write after a transfer's read of reused memory), and whether it reads a value another
        lane wrote."""
        ops = plan._step_ops
        program = plan.program
        elided = plan.buffer_plan.elided_ops
        step_of_op: dict[int, int] = {}
        writer: dict[int, int | None] = {}  # slot -> step writing its memory
        k = 0
        for index, op in enumerate(program.ops):
            if index in elided:  # a view: its memory is its source's
                source = writer.get(slot_of[op.inputs[0].id]) if op.inputs else None
                for v in op.outputs:
                    writer[slot_of[v.id]] = source
                continue
            step_of_op[index] = k
            for v in op.outputs:
                writer[slot_of[v.id]] = k
            k += 1
        deps: list[set[int]] = [set() for _ in ops]
        fed = [False] * len(ops)
        for i, op in enumerate(ops):
            for v in op.inputs:
                w = writer.get(slot_of[v.id])
                if w is not None and lane_of[w] != lane_of[i]:
                    deps[i].add(w)
                    fed[i] = True
        # Write after read: a transfer reads memory of its source's lane; the first later step of
        # that lane that writes overlapping memory (bufferize reuses arena bytes) waits for it.
        values = plan._buffers.values
        scratch = plan._buffers.scratch
        extents: dict[int, tuple[int, int, int] | None] = {}

        def extent(v: Value) -> tuple[int, int, int] | None:
            if v.id not in extents:
                t = values.get(v.id)
                if t is None:
                    extents[v.id] = None
                else:
                    item = t.dtype.itemsize
                    span = (sum((d - 1) * abs(s) for d, s in zip(t.shape, t.strides)) + 1) * item if t.size else 0
                    extents[v.id] = (id(t.buffer), t.offset, t.offset + span)
            return extents[v.id]

        by_lane: dict[int, list[int]] = {}
        for i, lane in enumerate(lane_of):
            by_lane.setdefault(lane, []).append(i)
        op_index = {k: i for i, k in step_of_op.items()}
        for t, op in enumerate(ops):
            if op.kind != "transfer":
                continue
            src = extent(op.inputs[0])
            if src is None:
                continue
            source_step = writer.get(slot_of[op.inputs[0].id])
            if source_step is None:
                continue
            lane = lane_of[source_step]
            for later in by_lane[lane]:
                if later <= t:
                    continue
                hit = op_index[later] in scratch  # a kernel's global scratch may lie anywhere in the arenas
                for v in ops[later].outputs:
                    e = extent(v)
                    if e is not None and e[0] == src[0] and e[1] < src[2] and src[1] < e[2]:
                        hit = True
                if hit:
                    deps[later].add(t)
                    break
        return deps, fed

    def _bind_work(self, plan: Plan, slot_of: dict[int, int], dev: Callable[[Value], Device],
                   fed: list[bool]) -> None:
        """Each part's callables: a transfer on its queue, kernel steps as they are, or the
        device's replay of them (a CUDA graph). A transfer whose source a part of another lane
        wrote is *queued* (``Device.transfer(queued=True)``): its queue waited for that part, so
        the backend may leave the copy queued, or copy off the source's stream. One that reads
        what no part wrote (a program input the plan uploaded) is not: the upload may still be
        on the source's stream."""
        ops, steps, slots = plan._step_ops, plan._steps, plan._slots
        input_slots, output_slots = set(plan._input_slots), set(plan._output_slots)
        for part in self.parts:
            if part.transfer:
                op = ops[part.steps[0]]
                step = _transfer_step(dev(op.inputs[0]), dev(op.outputs[0]), slots, slot_of[op.inputs[0].id],
                                      slot_of[op.outputs[0].id], op.outputs[0], queued=fed[part.steps[0]])
                part.work, part.mode = (step,), "transfer"
                continue
            mine = tuple(steps[i] for i in part.steps)
            reads = [slot_of[v.id] for i in part.steps for v in ops[i].inputs if slot_of[v.id] in input_slots]
            writes = [slot for i in part.steps for slot in steps[i].writes if slot in output_slots]
            replay = self.devices[part.lane].record(mine, slots, tuple(dict.fromkeys(reads)),
                                                    tuple(dict.fromkeys(writes))) if len(mine) > 1 else None
            part.work, part.mode = ((replay,), "replay") if replay is not None else (mine, "steps")

    def _overlaps(self) -> bool:
        """Whether two kernel parts of different lanes are unordered (neither waits, directly or
        through others, for the other): only then can running on queues gain anything."""
        parts = self.parts
        if len(parts) > self.MAX_ANALYSED_PARTS:
            return False
        index = {(p.lane, p.ordinal): n for n, p in enumerate(parts)}
        last_of_lane: dict[int, int] = {}
        ancestors: list[int] = []
        for n, p in enumerate(parts):
            bits = 0
            preds = [index[(lane, o)] for lane, o in p.waits.items()]
            if p.lane in last_of_lane:
                preds.append(last_of_lane[p.lane])
            for q in preds:
                bits |= ancestors[q] | (1 << q)
            ancestors.append(bits)
            last_of_lane[p.lane] = n
        kernel = [n for n, p in enumerate(parts) if not p.transfer]
        for a in kernel:
            for b in kernel:
                if b > a and parts[a].lane != parts[b].lane and not (ancestors[b] >> a) & 1:
                    return True
        return False

    def _fresh_semaphores(self) -> list:
        name = self.plan.program.name
        # Waited on as long as the work takes: every value is signalled by a part submitted
        # before anything waits for it, or failed with its error (a CPU part may take minutes).
        return [Semaphore(0, f"{q.name}/plan {name}", timeout=threading.TIMEOUT_MAX) for q in self.queues]

    # -- running -----------------------------------------------------------------------------------

    def run(self) -> None:
        """One run of the plan's steps on the queues (the plan has bound inputs and outputs)."""
        sems, counts, queues = self._semaphores, self.counts, self.queues
        bases = [self._runs * c for c in counts]
        self._runs += 1
        submitted = [0] * len(queues)
        failure: BaseException | None = None
        for part in self.parts:
            lane = part.lane
            value = bases[lane] + part.ordinal
            try:
                queues[lane].execute(part.work, [(sems[w], bases[w] + o) for w, o in part.waits.items()],
                                     [(sems[lane], value)])
            except BaseException as exc:  # issued on this thread and failed: its semaphore is failed
                failure = exc
                submitted[lane] = value
                break  # start nothing more; what was submitted finishes below
            submitted[lane] = value
        errors: list[BaseException] = [failure] if failure is not None else []
        for sem, value in zip(sems, submitted):
            if value:
                try:
                    sem.wait_enqueued(value)
                except PolyhalError as exc:
                    errors.append(exc)
        if errors:
            self._semaphores = self._fresh_semaphores()  # failed timelines stay failed
            self._runs = 0
            raise self._error(errors)

    def _error(self, errors: list[BaseException]) -> BaseException:
        """The error of a failed run: the first failure that is not a wait on a failed semaphore
        (the cause such waits chain to), as a KernelError naming its device and step; a polyhal
        error (an out-of-memory, a backend's launch error) keeps its type, with a note that says
        where."""
        def cause(e: BaseException) -> BaseException:
            while isinstance(e, SemaphoreFailedError) and e.__cause__ is not None:
                e = e.__cause__
            return e

        roots = [cause(e) for e in errors]
        root = next((e for e in roots if not isinstance(e, SemaphoreFailedError)), roots[0])
        if not isinstance(root, Exception) or isinstance(root, KernelError):
            return root
        located = self.plan._kernel_error(root)
        if isinstance(root, PolyhalError):
            if hasattr(root, "add_note"):
                root.add_note(f"({located})")
            return root
        located.__cause__ = root
        return located

    # -- explain -----------------------------------------------------------------------------------

    def explain_lines(self) -> list[str]:
        """The lanes, their queues and parts, and what each part waits for."""
        ops = self.plan._step_ops
        lanes = [f"{d.name} on {type(q).__name__} {q.name}" for d, q in zip(self.devices, self.queues)]
        lines = [f"  concurrent: {len(self.parts)} parts on {len(lanes)} queues ({'; '.join(lanes)}), "
                 f"joined by semaphore waits"]
        for p in self.parts:
            device = self.devices[p.lane].name
            waits = ", ".join(f"{self.devices[lane].name} part {o}" for lane, o in sorted(p.waits.items()))
            if p.transfer:
                op = ops[p.steps[0]]
                what = f"transfer %{op.inputs[0].name} ({op.outputs[0].type.nbytes} B)"
            else:
                names = [ops[i].name for i in p.steps]
                what = f"{len(names)} steps [{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}] ({p.mode})"
            lines.append(f"    {device} part {p.ordinal}: {what}" + (f"; waits for {waits}" if waits else ""))
        return lines
