"""The matmul variants (polyhal_opencl.ops.linalg): every variant against numpy on small shapes,
including ragged edges, batches with broadcasting, 1-D operands, gemm transposes, alpha/beta/C,
linear's bias, and operands that start at odd element offsets (the unaligned-load path).

The GPU variants run here on whatever OpenCL device there is (PoCL in CI): their barriers,
local tiles and guards are the same code a GPU runs, only slower."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import polyhal
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, infer_types
from polyhal_opencl import kernels
from polyhal_opencl.ops import linalg

#: variant -> traits overrides that make choose() pick it (with POLYHAL_OPENCL_MATMUL).
VARIANTS = {
    "gpu128": {"is_cpu": False, "max_work_group_size": 1024, "local_mem_size": 48 * 1024, "compute_units": 1},
    "gpu64": {"is_cpu": False, "max_work_group_size": 1024, "local_mem_size": 48 * 1024},
    "cpu_outer": {"is_cpu": True, "vector_width": 16, "fma": True},
    "cpu_dot": {"is_cpu": True, "vector_width": 8, "fma": False},
    "portable": {},
}


def _variant(dev, monkeypatch, name):
    if name.startswith("gpu") and dev.traits.max_work_group_size < 256:
        pytest.skip("the device's work-groups are smaller than 256 work-items")
    monkeypatch.setenv("POLYHAL_OPENCL_MATMUL", name)
    return dataclasses.replace(dev.traits, **VARIANTS[name])


def _types(*arrays):
    return tuple(TensorType(a.shape, a.dtype) for a in arrays)


def _run(dev, op, inputs, traits, offset=0, **attrs):
    in_types = _types(*inputs)
    out_types = infer_types(op, in_types, attrs)
    fn = kernels.prepare(dev, op, attrs, in_types, out_types, traits=traits)
    keep, ins = [], []  # the tensors stay alive while the kernel runs (else their buffers are reused)
    for x in inputs:  # each operand `offset` elements into a larger buffer
        flat = polyhal.asarray(np.concatenate([np.zeros(offset, x.dtype), x.reshape(-1)]), device=dev)
        keep.append(flat)
        ins.append(flat.native[offset:].reshape(x.shape))
    outs = [polyhal.empty(t.shape, t.dtype, dev) for t in out_types]
    fn(*ins, *[o.native for o in outs])
    got = [o.numpy() for o in outs]
    want = OPS[op].reference(*inputs, **attrs)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4, err_msg=f"{op} {attrs} {[x.shape for x in inputs]}")
    return fn


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# Each case is one program build (shapes are compile-time literals), so the cases are few and
# chosen per variant: cpu_dot only where both operands are k-contiguous, the old portable kernel
# (tested throughout the conformance suite) once.
FAST = ["gpu128", "gpu64", "cpu_outer"]


@pytest.mark.parametrize("name, m, k, n", [
    *[(name, 128, 16, 128) for name in FAST],  # whole blocks (GPU variants: no guards)
    *[(name, 129, 9, 65) for name in FAST],    # ragged in every dim
    ("gpu128", 1, 40, 37), ("cpu_outer", 1, 40, 37),  # a single row
    ("cpu_outer", 96, 300, 40),  # K above the CPU kernel's K block (partial sums)
])
def test_matmul_shapes(dev, rng, monkeypatch, name, m, k, n):
    _run(dev, "matmul", [_f32(rng, m, k), _f32(rng, k, n)], _variant(dev, monkeypatch, name))


@pytest.mark.parametrize("name", [*VARIANTS])
def test_variant_is_the_forced_one(dev, monkeypatch, name):
    t = TensorType((64, 64), "float32")
    src = kernels.generate("gemm", {"trans_b": 1}, (t, t), (t,), _variant(dev, monkeypatch, name)).source
    marker = {"gpu128": "#define BM 128", "gpu64": "#define BM 64", "cpu_outer": "#define KC ",
              "cpu_dot": "#define RN ", "portable": "#define TS "}[name]
    assert marker in src


@pytest.mark.parametrize("name", ["gpu128", "cpu_outer", "portable"])
def test_batched_and_broadcast(dev, rng, monkeypatch, name):
    traits = _variant(dev, monkeypatch, name)
    _run(dev, "matmul", [_f32(rng, 2, 1, 37, 45), _f32(rng, 3, 45, 29)], traits)
    _run(dev, "matmul", [_f32(rng, 2, 36, 24), _f32(rng, 24)], traits)  # 1-D b: matrix-vector


@pytest.mark.parametrize("name, trans_a, trans_b", [
    *[(name, ta, tb) for name in ("gpu128", "cpu_outer") for ta in (0, 1) for tb in (0, 1)],
    ("cpu_dot", 0, 1),  # the one layout cpu_dot reads (both operands k-contiguous)
])
def test_gemm_transposes(dev, rng, monkeypatch, name, trans_a, trans_b):
    traits = _variant(dev, monkeypatch, name)
    m, k, n = (67, 44, 3) if name == "cpu_dot" else (67, 44, 72)
    a = _f32(rng, k, m) if trans_a else _f32(rng, m, k)
    b = _f32(rng, n, k) if trans_b else _f32(rng, k, n)
    c = _f32(rng, m, 1) if trans_a else _f32(rng, n)  # C broadcast along rows or columns
    _run(dev, "gemm", [a, b, c], traits, trans_a=trans_a, trans_b=trans_b, alpha=0.5, beta=-2.0)


@pytest.mark.parametrize("name", ["gpu64", "cpu_outer"])
def test_linear_bias(dev, rng, monkeypatch, name):
    _run(dev, "linear", [_f32(rng, 2, 33, 40), _f32(rng, 40, 70), _f32(rng, 70)], _variant(dev, monkeypatch, name))


@pytest.mark.parametrize("name", ["gpu128", "cpu_outer", "cpu_dot"])
def test_unaligned_operands(dev, rng, monkeypatch, name):
    """Operands 1 or 3 elements into their buffers: 128-bit loads would be misaligned, which the
    GPU kernel's run-time offset check avoids."""
    traits = _variant(dev, monkeypatch, name)
    if name != "cpu_dot":
        _run(dev, "matmul", [_f32(rng, 64, 32), _f32(rng, 32, 128)], traits, offset=1)
    _run(dev, "gemm", [_f32(rng, 64, 32), _f32(rng, 128, 32)], traits, offset=3, trans_b=1)


@pytest.mark.parametrize("trans_a, trans_b", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_gpu_loads_are_vectors_for_every_layout(dev, monkeypatch, trans_a, trans_b):
    """128-bit global loads for both operands whatever their transposition (extents multiples
    of 4), and none where a row of the contiguous dim is not a multiple of 4 long."""
    traits = _variant(dev, monkeypatch, "gpu128")

    def source(m, k, n):
        a = TensorType((k, m) if trans_a else (m, k), "float32")
        b = TensorType((n, k) if trans_b else (k, n), "float32")
        attrs = {"trans_a": trans_a, "trans_b": trans_b}
        return kernels.generate("gemm", attrs, (a, b), (TensorType((m, n), "float32"),), traits).source

    src = source(64, 32, 128)
    assert "#define A_VEC 1" in src and "#define B_VEC 1" in src
    assert f"#define A_KMAJ {int(not trans_a)}" in src and f"#define B_NMAJ {int(not trans_b)}" in src
    src = source(63, 31, 129)
    assert "#define A_VEC 0" in src and "#define B_VEC 0" in src


def test_gpu_block_override(dev, rng, monkeypatch):
    """Another block shape: two float4 loads of A per work-item and slab, transposed operands."""
    traits = _variant(dev, monkeypatch, "gpu128")
    monkeypatch.setenv("POLYHAL_OPENCL_GPU_BLOCK", "128,64,16,8,4")
    _run(dev, "gemm", [_f32(rng, 37, 130), _f32(rng, 70, 37)], traits, trans_a=1, trans_b=1)


def test_gpu_block_override_is_checked(monkeypatch):
    monkeypatch.setenv("POLYHAL_OPENCL_GPU_BLOCK", "128,128,8,8,6")
    with pytest.raises(ValueError, match="multiples of 4"):
        linalg.gpu_block("gpu128")


def test_non_float32_uses_the_portable_kernel(dev, rng, run_prepared):
    t = TensorType((64, 64), "float16")
    src = kernels.generate("matmul", {}, (t, t), (t,), dataclasses.replace(dev.traits, **VARIANTS["gpu128"])).source
    assert "#define TS " in src
    ints = rng.integers(-5, 5, size=(20, 30)).astype(np.int32)
    _run(dev, "matmul", [ints, ints.T.copy()], None)


def test_choice_by_device_and_shape(dev, monkeypatch):
    monkeypatch.delenv("POLYHAL_OPENCL_MATMUL", raising=False)
    f32 = linalg.ctype("float32", dev.traits)
    gpu = dataclasses.replace(dev.traits, is_cpu=False, max_work_group_size=1024, local_mem_size=48 * 1024,
                              compute_units=132)
    cpu = dataclasses.replace(dev.traits, is_cpu=True)

    def pick(traits, m, n, k, sa=None, sb=None, nbatch=1):
        return linalg.choose(f32, f32, linalg.Problem(m, n, k, nbatch, sa or (k, 1), sb or (n, 1)), traits)

    assert pick(gpu, 4096, 4096, 4096) == "gpu128"
    assert pick(gpu, 512, 512, 512) == "gpu64"          # 16 blocks of 128 would leave SMs idle
    assert pick(gpu, 512, 512, 512, nbatch=16) == "gpu128"
    assert pick(gpu, 16, 4096, 4096) == "portable"
    assert pick(dataclasses.replace(gpu, max_work_group_size=128), 4096, 4096, 4096) == "portable"
    assert pick(cpu, 1024, 1024, 1024) == "cpu_outer"
    assert pick(cpu, 64, 1024, 256, sb=(1, 256)) == "cpu_outer"  # x @ W^T: B's panel is packed
    assert pick(cpu, 1, 1024, 256, sb=(1, 256)) == "cpu_dot"     # vector @ W^T
    assert pick(cpu, 64, 1, 256, sb=(1, 1)) == "cpu_dot"         # matrix-vector


def test_plan_intermediates(dev, rng, monkeypatch):
    """The GPU kernel reading and writing a plan's arena (operands at nonzero offsets in one
    buffer; CPU devices run plans through cpu_outer in the conformance suite anyway)."""
    monkeypatch.setattr(dev, "traits", _variant(dev, monkeypatch, "gpu128"))
    b = polyhal.ProgramBuilder("chain")
    x, w1, w2 = b.input("x", (40, 64)), b.input("w1", (64, 72)), b.input("w2", (72, 36))
    h = b.relu(b.matmul(x, w1))
    b.output(b.matmul(b.add(h, h), w2))
    plan = polyhal.compile(b.build(), dev.name)
    feeds = [_f32(rng, 40, 64), _f32(rng, 64, 72), _f32(rng, 72, 36)]
    want = (2 * np.maximum(feeds[0] @ feeds[1], 0)) @ feeds[2]
    np.testing.assert_allclose(plan(*feeds).numpy(), want, rtol=2e-4, atol=2e-4)


def test_portable_fallback_when_the_tuned_kernel_fails_to_build(dev, rng, monkeypatch):
    traits = _variant(dev, monkeypatch, "gpu128")
    real = linalg.cl_source
    monkeypatch.setattr(linalg, "cl_source", lambda name: real(name) + ("\n#error a driver bug\n" if name == "sgemm.cl" else ""))
    with pytest.warns(RuntimeWarning, match="tuned kernel failed to build"):
        fn = _run(dev, "matmul", [_f32(rng, 33, 20), _f32(rng, 20, 35)], traits)
    assert "#define TS " in fn.recipe.source
