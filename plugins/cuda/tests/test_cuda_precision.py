"""The precision policy on CUDA (polyhal.passes.precision): fp32 is exact float32 in cuBLAS and
cuDNN, "tf32" reaches TF32 tensor cores per contraction, "fp16" runs a small CNN and an MLP in
float16 on the GPU within float16's error, inputs and outputs float32 (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal import ProgramBuilder
from polyhal.ir.types import TensorType
from polyhal.ops import OPS


def _rel_error(got, want):
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _matmul(cuda, precision, a, b):
    import cupy as cp

    ins = (TensorType(a.shape, a.dtype), TensorType(b.shape, b.dtype))
    attrs = {"precision": precision}
    fn = cuda.prepare("matmul", attrs, ins, OPS["matmul"].infer(ins, attrs))
    with cuda.activate():
        x, y = cp.asarray(a), cp.asarray(b)
        out = cp.empty((a.shape[0], b.shape[1]), np.float32)
    fn(x, y, out)
    cuda.synchronize()
    return cp.asnumpy(out), getattr(getattr(fn, "inner", fn), "kernel_name", "")


def test_tf32_capability_follows_the_architecture(cuda):
    major = int(cuda.spec.limits["compute_capability"].split(".")[0])
    assert ("tf32" in cuda.spec.capabilities) == (major >= 8)


def test_matmul_is_exact_float32_unless_tf32_is_asked_for(cuda):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 512), np.float32), rng.standard_normal((512, 256), np.float32)
    want = a.astype(np.float64) @ b
    exact, name = _matmul(cuda, "fp32", a, b)
    assert _rel_error(exact, want) < 2e-6 and "TF32" not in name
    if "tf32" not in cuda.spec.capabilities:
        pytest.skip(f"{cuda.spec.name} has no TF32 tensor cores")
    fast, name = _matmul(cuda, "tf32", a, b)
    assert "TF32" in name
    assert 2e-5 < _rel_error(fast, want) < 1e-2  # TF32's 10-bit mantissa shows; still a product


def _cnn(rng):
    b = ProgramBuilder("cnn")
    x = b.input("x", (2, 8, 16, 16), "float32")
    w = b.constant((rng.standard_normal((16, 8, 3, 3)) * 0.2).astype(np.float32))
    bias = b.constant(rng.standard_normal(16).astype(np.float32))
    h = b.relu(b.conv(x, w, bias, pads=[1, 1, 1, 1]))
    h = b.max_pool(h, kernel_shape=[2, 2], strides=[2, 2])
    flat = b.reshape(h, shape=(2, 16 * 8 * 8))
    w2 = b.constant((rng.standard_normal((16 * 8 * 8, 10)) * 0.05).astype(np.float32))
    b.output(b.softmax(b.matmul(flat, w2), axis=-1))
    return b.build()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16"])
def test_small_cnn_in_each_precision(cuda, precision):
    rng = np.random.default_rng(1)
    program = _cnn(rng)
    x = rng.standard_normal((2, 8, 16, 16), np.float32)
    want = polyhal.compile(program, "cpu:0").run_numpy(x)[0].astype(np.float64)
    plan = polyhal.compile(program, cuda.spec.name, precision=precision)
    (got,) = plan.run_numpy(x)
    assert got.dtype == np.float32
    text = plan.explain()
    assert f"precision {precision} (precision=)" in text
    tolerance = {"fp32": 1e-5, "tf32": 1e-2, "fp16": 2e-2}[precision]
    assert _rel_error(got, want) < tolerance, text
    if precision == "fp16":
        assert "op(s) compute in float16" in text and "softmax" in text
        lowered = [op for op in plan.program.ops if op.outputs[0].type.dtype == np.float16]
        assert any(op.name in ("conv", "fused_conv") for op in lowered)
    if precision == "tf32" and "tf32" in cuda.spec.capabilities:
        assert "contraction(s) may use TF32" in text
        assert any(("precision", "tf32") in op.attrs for op in plan.program.ops)
