"""The kernel lint: no kernel source (OpenCL C, CUDA C; shipped or generated) allocates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from polyhal.hal.kernel_lint import KernelLintError, check, lint, lint_file, scan, shipped_sources

ROOT = Path(__file__).resolve().parents[1]

PLANTED_CL = """
#define N 64
__kernel void k(__global float* x, const int n) {
  __local float tile[N];            // fine: a constant extent
  float ok[2 * N + 1];              // fine
  float priv[n];                    // variable-length array
  __local float open[];             // unbounded
  float* p = (float*)malloc(n * 4);
  int* r = (int*)alloca(n);
  char* s = "malloc(1) in a string is fine";  /* and malloc(2) in a comment */
  x[0] = tile[0] + priv[0] + ok[0];
}
"""

PLANTED_CU = """
extern __shared__ float dyn[];      // fine: launch-sized, from the plan's binding
__global__ void k(float* x, int n) {
  __shared__ float t[256];
  int* p = new int[n];
  float* q; cudaMalloc(&q, 4);
  float v[n];
  x[0] = t[0] + dyn[0] + v[0];
}
"""


def test_planted_violations_are_caught():
    rules = sorted((f.rule, f.line) for f in lint(PLANTED_CL, "planted.cl"))
    assert rules == [("alloca", 9), ("heap-allocation", 8), ("unbounded-array", 7), ("variable-length-array", 6)]
    with pytest.raises(KernelLintError, match="planted.cl:8: \\[heap-allocation\\] malloc"):
        check(PLANTED_CL, "planted.cl")


def test_planted_cuda_violations_are_caught():
    rules = sorted(f.rule for f in lint(PLANTED_CU, "planted.cu", "cuda"))
    assert rules == ["heap-allocation", "new-expression", "variable-length-array"]


def test_constant_extents_are_evaluated():
    src = "#define NP 1024\n#define WG 64\n__kernel void k() { __local ulong keys[NP]; __local float2 s[WG / 2][3]; }"
    _, arrays = scan(src)
    assert [(a.name, a.space, a.elements, a.nbytes) for a in arrays] == [
        ("keys", "workgroup", 1024, 8192), ("s", "workgroup", 96, 768)]
    # A template macro without a value is constant but unknown; a parameter is not constant.
    assert lint("__kernel void k() { __local int a[NP]; }") == []
    assert [f.rule for f in lint("void f(int n) { int a[n]; }")] == ["variable-length-array"]


def test_identifiers_that_look_like_allocation_are_not_flagged():
    src = "__kernel void k(__global int* renew) { int new_value = 1; int mallocs = 2; renew[0] = new_value + mallocs; }"
    assert lint(src) == []


def test_every_shipped_kernel_source_is_clean():
    files = shipped_sources([ROOT / "plugins", ROOT / "core"])
    assert any(p.suffix == ".cl" for p in files)
    problems = [str(f) for p in files for f in lint_file(p)]
    assert problems == []


def _generated_opencl_sources():
    pytest.importorskip("pyopencl")
    from polyhal.ir.types import TensorType
    from polyhal.ops import OPS, infer_types
    from polyhal_opencl import kernels
    from polyhal_opencl.codegen import DeviceTraits
    from polyhal_opencl.ops import nms_bitmask, rowsort
    from polyhal.hal.scratch import MemorySpace

    traits = DeviceTraits("lint", True, 256, 65536)
    rng = np.random.default_rng(0)
    for op in sorted(kernels.GENERATORS):
        if op not in OPS:
            continue
        for _ in range(2):
            inputs, attrs = OPS[op].sample(rng)
            ins = tuple(TensorType(x.shape, x.dtype) for x in inputs)
            try:
                outs = infer_types(op, ins, attrs)
                recipe = kernels.generate(op, attrs, ins, outs, traits)
            except Exception:  # noqa: BLE001 - an op this device cannot run (fp64, ...)
                continue
            yield f"{op}", recipe.source
    # The planner-aware kernels, in every memory space they have code for.
    x = TensorType((64, 300), "float32")
    for space in (MemorySpace.PRIVATE, MemorySpace.WORKGROUP, MemorySpace.GLOBAL):
        for op, attrs in (("sort", {"axis": -1, "descending": False}), ("argsort", {"axis": -1, "descending": True}),
                          ("topk", {"k": 5, "axis": -1, "largest": True, "sorted": False})):
            outs = infer_types(op, (x,), attrs)
            yield f"rowsort-{op}-{space}", rowsort.generate(op, attrs, (x,), outs, traits,
                                                             {("sort_lanes", "tile"): space}).source
    b, s = TensorType((1, 100, 4), "float32"), TensorType((1, 2, 100), "float32")
    attrs = {"max_output_boxes_per_class": 10, "iou_threshold": 0.5, "score_threshold": None, "center_point_box": 0}
    for space in (MemorySpace.WORKGROUP, MemorySpace.GLOBAL):
        spaces = {("nms_prep", "keys"): space, ("nms_mask", "cols"): space, ("nms_reduce", "removed"): space}
        yield f"nms-{space}", nms_bitmask.generate("non_max_suppression", attrs, (b, s), (), traits, spaces).source


def test_every_generated_opencl_source_is_clean():
    checked = 0
    for name, source in _generated_opencl_sources():
        if source:
            assert lint(source, name) == [], name
            checked += 1
    assert checked > 50
