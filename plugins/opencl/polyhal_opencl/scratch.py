"""The OpenCL backend's scratch, in the core's terms (:mod:`polyhal.hal.scratch`).

``CLDevice.scratch`` declares what the kernels of an op instance need besides their operands:

* kernels written for the planner (:mod:`~polyhal_opencl.ops.rowsort`,
  :mod:`~polyhal_opencl.ops.nms_bitmask`) declare their scratch with the spaces they have code
  for; the recipe is generated *after* the bufferize pass chose, for those spaces (``__private``
  arrays, ``__local`` arrays, or a global buffer parameter);
* every other generator's recipe is read: each entry of ``Recipe.scratch`` is a GLOBAL request
  (``recipe.scratch<i>``), and each fixed-size ``__local`` array of the generated source (found
  by :mod:`polyhal.hal.kernel_lint`, its extent evaluated with the source's ``#define``\\ s) is
  a WORKGROUP-only request of its kernel, so that a local array larger than the device's local
  memory is a compile-time :class:`~polyhal.hal.scratch.ScratchError`, not a failed launch.

Every generated source is also checked by the kernel lint (no ``malloc``, no variable-length
array, ...) when the plan is compiled.

``CLDevice.prepare`` then receives the :class:`~polyhal.hal.scratch.ScratchBinding`: the global
slices of the plan's arena become OpenCL sub-buffers (the planner aligns them to 4096 bytes,
above any CL_DEVICE_MEM_BASE_ADDR_ALIGN) passed to the launches. Prepared without a plan, the
same declarations are placed by the core's default rule and the global scratch is allocated
once, there -- still never by a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from polyhal.hal.flags import MemoryType
from polyhal.hal.scratch import KernelInfo, MemorySpace, Problem, ScratchBinding, ScratchDecl, ScratchRequest
from polyhal.ops import resolve_attrs
from polyhal.hal import kernel_lint

from polyhal_opencl import generators
from polyhal_opencl.codegen import DeviceTraits, Launch, Recipe
from polyhal_opencl.ops import nms_bitmask, rowsort
from polyhal_opencl.ops.planned_generators import default_spaces, memory_limits

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the OpenCL device; its module imports this one

__all__ = ["buffers", "declared", "derived", "generate", "requests"]

#: Bytes per element assumed for a __local array of a struct type the lint cannot size.
UNKNOWN_ELEMENT_BYTES = 16

#: op -> module with ``declarations(op, attrs, ins, outs, kind)`` and ``generate(..., spaces)``.
HANDLERS = {"sort": rowsort, "argsort": rowsort, "topk": rowsort, "non_max_suppression": nms_bitmask}


def _device_kind(device: "Device") -> str:
    return str(device.spec.limits.get("type", ""))


def declared(device: "Device", op: str, attrs: Mapping[str, Any], in_types, out_types) -> list | None:
    """``[(KernelInfo, [ScratchDecl])]`` of a planner-aware kernel for this instance, or None."""
    handler = HANDLERS.get(op)
    if handler is None:
        return None
    if handler is rowsort and _device_kind(device) != "cpu":
        return None  # GPUs: a work-group per row (polyhal_opencl.ops.sorting) suits them better
    return handler.declarations(op, attrs, tuple(in_types), tuple(out_types))


def requests(device: "Device", op: str, attrs: Mapping[str, Any], in_types, out_types
             ) -> tuple[ScratchRequest, ...]:
    """Every scratch request of one op instance (see the module docstring)."""
    attrs = resolve_attrs(op, attrs)
    problem = Problem(op, dict(attrs), tuple(in_types), tuple(out_types))
    decls = declared(device, op, attrs, in_types, out_types)
    if decls is not None:
        return tuple(d.request(problem, k) for k, ds in decls for d in ds)
    recipe = generators.generate(op, attrs, in_types, out_types, device.traits)
    return derived(op, recipe, problem)


def derived(op: str, recipe: Recipe, problem: Problem) -> tuple[ScratchRequest, ...]:
    """Requests read off a recipe whose generator does not declare its own (module docstring);
    raises KernelLintError when the source allocates."""
    out: list[ScratchRequest] = []
    launches = [s for s in recipe.steps if isinstance(s, Launch)]
    if launches and recipe.source:
        arrays = kernel_lint.check(recipe.source, f"<{op} kernel>", "opencl")
        for a in arrays:
            if a.space != "workgroup" or a.dynamic:
                continue
            launch = next((x for x in launches if x.kernel == a.function), None)
            if launch is None:
                continue  # a helper function's array belongs to the kernel that calls it
            nbytes = a.nbytes if a.nbytes is not None else (a.elements or 0) * UNKNOWN_ELEMENT_BYTES
            wg = _product(launch.lsize) if launch.lsize else 1
            groups = max(_product(launch.gsize) // max(wg, 1), 1)
            kernel = KernelInfo(a.function, op, wg, groups, "opencl")
            out.append(ScratchDecl(a.name, shared=True, per_workgroup=nbytes, spaces=(MemorySpace.WORKGROUP,),
                                   purpose="a fixed __local array of the generated kernel").request(problem, kernel))
    for i, n in enumerate(recipe.scratch):
        kernel = KernelInfo("recipe", op, 1, 1, "opencl")
        out.append(ScratchDecl(f"scratch{i}", shared=True, per_workgroup=int(n), spaces=(MemorySpace.GLOBAL,),
                               purpose="a global buffer of the kernel generator's recipe").request(problem, kernel))
    return tuple(out)


def _product(dims) -> int:
    p = 1
    for d in dims:
        p *= int(d)
    return p


def generate(device: "Device", op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits,
             binding: ScratchBinding | None) -> Recipe:
    """The recipe for this instance, generated for the binding's placements (or, without one,
    for the placements the core's default rule gives against the device's limits)."""
    attrs = resolve_attrs(op, attrs)
    decls = declared(device, op, attrs, in_types, out_types)
    if decls is None:
        return generators.generate(op, attrs, in_types, out_types, traits)
    if binding:
        spaces = {(a.request.kernel.name, a.request.name): a.space for a in binding.assignments}
    else:  # prepared without a plan: the default rule, within the traits' local memory
        problem = Problem(op, dict(attrs), tuple(in_types), tuple(out_types))
        spaces = default_spaces(problem, decls, memory_limits(traits, _device_kind(device)))
    recipe = HANDLERS[op].generate(op, attrs, tuple(in_types), tuple(out_types), traits, spaces)
    kernel_lint.check(recipe.source, f"<{op} kernel>", "opencl")
    return recipe


@dataclass
class _Slice:
    """A global scratch buffer as ``kernels._bind_launch`` takes it (``.native``)."""

    native: Any
    owner: Any = None  # keeps a standalone allocation alive


def buffers(device: "Device", recipe: Recipe, binding: ScratchBinding | None) -> list[_Slice]:
    """One object with ``.native`` (a ``cl.Buffer``) per entry of ``recipe.scratch``: sub-buffers
    of the plan's arena when a binding is given, else buffers allocated here, once."""
    names = getattr(recipe, "scratch_names", None) or [("recipe", f"scratch{i}") for i in range(len(recipe.scratch))]
    out = []
    for (kernel, name), nbytes in zip(names, recipe.scratch):
        if binding:
            view = binding.buffer(name, kernel)  # a pyopencl Array of uint8 at the slice's offset
            base = view.base_data
            sub = base if view.offset == 0 and base.size == view.nbytes else base.get_sub_region(view.offset, max(view.nbytes, 1))
            out.append(_Slice(sub, view))
        else:
            buf = device.allocator.allocate(max(int(nbytes), 1), MemoryType.DEVICE_LOCAL)
            out.append(_Slice(buf.native, buf))
    return out
