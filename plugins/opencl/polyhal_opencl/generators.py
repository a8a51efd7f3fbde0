"""Every op's kernel generator, and :func:`generate`: the recipe of one op instance, no device needed.

:data:`GENERATORS` merges the ``GENERATORS`` of the op families of :mod:`polyhal_opencl.ops`;
the kernels written for the bufferize pass (:mod:`polyhal_opencl.ops.planned_generators`)
replace the plain generators of their ops. :mod:`polyhal_opencl.kernels` builds and binds the
recipes; :mod:`polyhal_opencl.scratch` reads their scratch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from polyhal.errors import KernelNotFoundError
from polyhal.ops import resolve_attrs

from polyhal_opencl.codegen import DeviceTraits, Recipe
from polyhal_opencl.ops import (
    data_tiling, elementwise, indexing, linalg, logical, mathfn, nn, planned_generators, portable, reduction, shape,
    sorting,
)

if TYPE_CHECKING:
    from polyhal.ir.types import TensorType

__all__ = ["GENERATORS", "generate"]

#: op name -> generator(op, attrs, in_types, out_types, traits) -> Recipe. The planned generators
#: come last: they are generated here with the placements the core's default rule gives; plans
#: generate them for the placements the select_memory_space policy chose (polyhal_opencl.scratch).
GENERATORS: dict[str, Callable[..., Recipe]] = {
    **elementwise.GENERATORS, **mathfn.GENERATORS, **logical.GENERATORS, **linalg.GENERATORS,
    **reduction.GENERATORS, **shape.GENERATORS, **sorting.GENERATORS, **indexing.GENERATORS,
    **nn.GENERATORS, **data_tiling.GENERATORS, **portable.GENERATORS, **planned_generators.GENERATORS,
}


def generate(op: str, attrs: Mapping[str, Any], in_types: tuple["TensorType", ...],
             out_types: tuple["TensorType", ...], traits: DeviceTraits) -> Recipe:
    """The recipe (source, launches, scratch) for one op instance; no device needed."""
    gen = GENERATORS.get(op)
    if gen is None:
        raise KernelNotFoundError(f"{traits.name} (OpenCL) has no kernel for op {op!r}; it has {sorted(GENERATORS)}")
    return gen(op, resolve_attrs(op, attrs), tuple(in_types), tuple(out_types), traits)
