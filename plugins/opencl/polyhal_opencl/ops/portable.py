"""The ops whose kernels are written once for OpenCL and CUDA (:mod:`polyhal_gpu.portable`:
grid_sample, roi_align, det, tree_ensemble, tfidf_vectorizer): their source as a recipe of one
launch, the operands in order."""

from __future__ import annotations

from typing import Any, Mapping

from polyhal_gpu import portable

from polyhal_opencl.codegen import Arg, DeviceTraits, Recipe, linear_launch


def generate(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """The recipe of one instance: the portable kernel, one work-item per element it computes."""
    kernel = portable.plan(op, attrs, in_types, out_types, fp64=traits.fp64)
    args = [Arg(i) for i in range(len(in_types) + len(out_types))]
    return Recipe(kernel.source, linear_launch(kernel.name, kernel.work_items, args, traits))


GENERATORS = {op: generate for op in portable.OPS}
