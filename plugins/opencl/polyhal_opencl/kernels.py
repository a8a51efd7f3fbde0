"""The op set on OpenCL: :data:`TABLE` (its ``KERNEL_NAMES``) and :func:`prepare`, the builder
of every op in the table.

``prepare`` asks the op's generator (:mod:`polyhal_opencl.generators`) for a
:class:`~polyhal_opencl.codegen.Recipe`, builds its source through the device's program cache,
makes one ``cl.Kernel`` per launch, sets every argument that does not change between calls
(scratch buffers, scalars), allocates scratch, and returns a closure over all of it. The
closure is a plan's hot path: it sets the operands' buffers and offsets and enqueues, nothing
more. It never waits for the device; the in-order queue orders everything.

Kernels take the native arrays of dense row-major tensors (what plans pass): the
``pyopencl.array.Array`` views made by :meth:`CLDevice.view`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from polyhal.errors import ArithmeticDomainError
from polyhal.hal.kernels import KernelTable
from polyhal_gpu.storage import STORAGE_OPS

from polyhal_opencl import scratch as planned
from polyhal_opencl.codegen import Check, Copy, DeviceTraits, Launch, Recipe
from polyhal_opencl.errors import CLBuildError, check, translate
from polyhal_opencl.generators import GENERATORS, generate

# pyopencl is imported inside the functions that use it: without pyopencl the plugin still imports,
# lists no device and says why (plugin.enumerate_devices).

if TYPE_CHECKING:
    from polyhal.ir.types import TensorType

    from polyhal.hal.device import Device  # the OpenCL device; its module imports this one

__all__ = ["GENERATORS", "KERNEL_NAMES", "TABLE", "generate", "prepare"]


def prepare(device: "Device", op: str, attrs: Mapping[str, Any], in_types: tuple["TensorType", ...],
            out_types: tuple["TensorType", ...], scratch: Any = None,
            traits: DeviceTraits | None = None) -> Callable[..., None]:
    """Compile and bind one op instance on ``device``; returns ``fn(*in_arrays, *out_arrays)``
    (the builder of every op of :data:`TABLE`, which checks the instance first).

    ``traits`` overrides the device's (tests use it to force e.g. the global sort path).
    ``scratch`` is the plan's :class:`~polyhal.hal.scratch.ScratchBinding` (see
    :mod:`polyhal_opencl.scratch`): the recipe is generated for its memory spaces and its global
    scratch comes from the plan's arena.
    """
    traits = traits or device.traits
    recipe = planned.generate(device, op, attrs, in_types, out_types, traits, scratch)
    itemsizes = [t.dtype.itemsize for t in (*in_types, *out_types)]
    # Empty tensors give recipes without launches; their sources would divide by zero extents.
    launches = any(isinstance(s, Launch) for s in recipe.steps)
    program, recipe = _build(device, op, recipe, traits) if launches else (None, recipe)
    # Global scratch: slices of the plan's arena, or (prepared without a plan) allocated here, once,
    # living as long as the closure; never allocated by a kernel.
    scratch = planned.buffers(device, recipe, scratch)
    flag = _error_flag(device) if any(isinstance(s, Check) for s in recipe.steps) else None
    steps = [_bind_launch(device, program, s, scratch, itemsizes, flag) if isinstance(s, Launch)
             else _bind_check(device, s, flag) if isinstance(s, Check)
             else _bind_copy(device, s) for s in recipe.steps]
    what = f"running {op} on {device.name}"

    # The hot path: try/except costs nothing until something raises, where `with check(...)`
    # (a generator context manager) cost ~1-4 us per call on PoCL.
    if len(steps) == 1:
        (only,) = steps

        def run(*arrays: Any) -> None:
            try:
                only(arrays)
            except Exception as exc:
                _reraise(exc, what)
    else:
        def run(*arrays: Any) -> None:
            try:
                for step in steps:
                    step(arrays)
            except Exception as exc:
                _reraise(exc, what)

    run.recipe = recipe  # for inspection and tests
    run.scratch = scratch
    return run


#: The op set: every op has a generator, and :func:`prepare` builds them all; the scratch of each
#: instance is read off its recipe or declared by its planner-aware kernel (polyhal_opencl.scratch).
TABLE = KernelTable("opencl", storage_types=STORAGE_OPS)  # cast converts the storage types, moves copy them
TABLE.register(*GENERATORS, scratch=planned.requests)(prepare)
#: Every op this backend has a kernel for: the CPU backend's set (float64 needs cl_khr_fp64).
KERNEL_NAMES = TABLE.kernel_names


def _build(device: "Device", op: str, recipe: Recipe, traits: DeviceTraits) -> tuple[Any, Recipe]:
    """The built program of ``recipe``; where the driver's compiler rejects it and the generator
    gave a ``fallback`` recipe (a tuned kernel's portable equivalent), that one, with a warning
    carrying the build log: a compiler bug of one driver costs speed, not the op."""
    try:
        return device.programs.get(recipe.source, traits.build_options()), recipe
    except CLBuildError as exc:
        fallback = getattr(recipe, "fallback", None)
        if fallback is None:
            raise
        warnings.warn(f"{op} on {device.name}: the tuned kernel failed to build, using the portable one; "
                      f"please report this with the log:\n{exc.log.strip()}", RuntimeWarning, stacklevel=3)
        return device.programs.get(fallback.source, traits.build_options()), fallback


def _reraise(exc: Exception, what: str) -> None:
    """Raise what :func:`polyhal_opencl.errors.check` would have raised for ``exc``."""
    new = translate(exc, what)
    if new is exc:
        raise exc
    raise new from exc


def _error_flag(device: "Device") -> Any:
    """A zeroed ``int`` buffer for a recipe's error flag (see :class:`~polyhal_opencl.codegen.Check`),
    living as long as the prepared kernel."""
    import pyopencl as cl

    with check(f"allocating an error flag on {device.name}"):
        return cl.Buffer(device.context, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR,
                         hostbuf=np.zeros(1, np.int32))


def _bind_check(device: "Device", step: Check, flag: Any):
    import pyopencl as cl

    queue, seen, zero = device.queue, np.zeros(1, np.int32), np.zeros(1, np.int32)

    def run(arrays: tuple) -> None:
        cl.enqueue_copy(queue, seen, flag, is_blocking=True)
        if seen[0]:
            cl.enqueue_copy(queue, flag, zero, is_blocking=True)  # the next call starts clean
            raise ArithmeticDomainError(f"{step.message} (on {device.name})")

    return run


def _bind_launch(device: "Device", program: Any, launch: Launch, scratch: list, itemsizes: list[int],
                 flag: Any = None):
    import pyopencl as cl

    with check(f"creating kernel {launch.kernel} on {device.name}"):
        kernel = cl.Kernel(program, launch.kernel)
    n_buf = len(launch.args)
    operand_slots = []  # (parameter index, operand index, itemsize)
    for i, arg in enumerate(launch.args):
        if arg.flag:
            kernel.set_arg(2 * i, flag)
            kernel.set_arg(2 * i + 1, np.uint64(0))
        elif arg.scratch:
            kernel.set_arg(2 * i, scratch[arg.index].native)
            kernel.set_arg(2 * i + 1, np.uint64(0))
        else:
            operand_slots.append((2 * i, arg.index, itemsizes[arg.index]))
    for j, value in enumerate(launch.scalars):
        kernel.set_arg(2 * n_buf + j, np.int64(value))
    queue, gsize, lsize = device.queue, launch.gsize, launch.lsize
    enqueue, set_arg, u64 = cl.enqueue_nd_range_kernel, kernel.set_arg, np.uint64
    # Offsets are set only when they change: a scalar set_arg costs ~10 us in pyopencl (a
    # buffer handle ~0.2 us), and tensors nearly always start at offset 0.
    offsets = {}
    for p, _, _ in operand_slots:
        set_arg(p + 1, u64(0))
        offsets[p] = 0

    def step(arrays: tuple) -> None:
        for p, k, item in operand_slots:
            a = arrays[k]
            set_arg(p, a.base_data)
            off = a.offset // item
            if off != offsets[p]:
                set_arg(p + 1, u64(off))
                offsets[p] = off
        enqueue(queue, kernel, gsize, lsize)

    return step


def _bind_copy(device: "Device", copy: Copy):
    import pyopencl as cl

    queue, src, dst, nbytes = device.queue, copy.src, copy.dst, copy.nbytes

    def step(arrays: tuple) -> None:
        if nbytes:
            a, b = arrays[src], arrays[dst]
            cl.enqueue_copy(queue, b.base_data, a.base_data, byte_count=nbytes,
                            src_offset=a.offset, dst_offset=b.offset)

    return step
