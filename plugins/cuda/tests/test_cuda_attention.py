"""The fused attention op on CUDA: strided head views, its scratch, and the example transformer
block compiled for the GPU, captured and replayed as one CUDA graph (GPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from polyhal.hal.scratch import MemorySpace
from polyhal.ir.types import TensorType
from polyhal.ops import OPS

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_on_strided_heads(cuda, cp, rng, dtype):
    # q, k, v as the heads of (batch, seq, heads * d) projections: strided views, as the
    # transformer block's transposes hand them in.
    b, s, h, d = 2, 37, 3, 8
    proj = [rng.standard_normal((b, s, h * d)).astype(dtype) for _ in range(3)]
    views = [cp.asarray(p).reshape(b, s, h, d).transpose(0, 2, 1, 3) for p in proj]
    assert not views[0].flags.c_contiguous
    t = TensorType((b, h, s, d), np.dtype(dtype))
    fn = cuda.prepare("attention", {"scale": 0.3}, (t, t, t), (t,))
    name = fn.inner.kernel_name  # not the host fallback: the own kernel or cuDNN's, measured faster
    assert "cublas" in name or "cuDNN SDPA (measured faster" in name, name
    out = cp.full((b, h, s, d), np.nan, dtype)
    fn(*views, out)
    want = OPS["attention"].reference(*[cp.asnumpy(v) for v in views], scale=0.3)[0]
    rtol, atol = (1e-4, 1e-5) if dtype == np.float32 else (1e-11, 1e-12)
    np.testing.assert_allclose(cp.asnumpy(out), want, rtol=rtol, atol=atol, err_msg=f"seed {rng.seed_value}")


def test_attention_scratch_is_declared(cuda):
    t = TensorType((4, 64, 32), np.float32)
    requests = cuda.scratch("attention", {}, (t, t, t), (t,))
    names = {r.name for r in requests}
    assert {"scores", "probs"} <= names
    assert all(r.spaces == (MemorySpace.GLOBAL,) for r in requests)
    assert next(r for r in requests if r.name == "scores").bytes_per_launch == 4 * 64 * 64 * 4
    half = TensorType((4, 64, 32), np.float16)  # computed in float32: its operands cast into scratch
    requests = {r.name: r for r in cuda.scratch("attention", {}, (half, half, half), (half,))}
    assert {"scores", "probs", "q32", "k32", "v32", "o32"} <= set(requests)
    assert requests["scores"].bytes_per_launch == 4 * 64 * 64 * 4
    assert requests["q32"].bytes_per_launch == 4 * 64 * 32 * 4


def test_transformer_block_runs_on_the_gpu_as_one_graph(cuda, rng):
    import polyhal.onnx

    x = rng.standard_normal((2, 64, 128)).astype(np.float32)
    program = polyhal.onnx.load(EXAMPLES / "transformer_block.onnx", shapes={"x": x.shape})
    plan = program.compile(cuda.name)
    assert any(op.name == "attention" for op in plan.program.ops)  # fused, and run here
    want = program.execute(program.compile("cpu:0"), {"x": x})["y"]
    for _ in range(3):
        got = program.execute(plan, {"x": x})["y"]
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4, err_msg=f"seed {rng.seed_value}")
    assert plan.replay is not None and plan.replay.mode == "graph", getattr(plan.replay, "reason", None)


def test_heads_at_two_batch_strides_are_read_in_place(cuda, cp, rng, monkeypatch):
    # torch's packed projection (S, B, 3, H, D): q, k and v as (B, H, S, D) views put batch and
    # head at two strides (3E and D), which no one cuBLAS batch stride reaches: the products
    # take the matrices' addresses, and nothing is copied.
    s, b, h, d = 11, 3, 4, 8
    proj = cp.asarray(rng.standard_normal((s, b, 3, h, d)).astype(np.float32))
    q, k, v = (proj[:, :, i].transpose(1, 2, 0, 3) for i in range(3))
    out = cp.full((b, h, s, d), np.nan, np.float32)
    copies = []
    real = cp.copyto
    monkeypatch.setattr(cp, "copyto", lambda *a, **kw: (copies.append(a), real(*a, **kw)))
    t = TensorType((b, h, s, d), np.dtype(np.float32))
    fn = cuda.prepare("attention", {"scale": 0.3}, (t, t, t), (t,))
    fn(q, k, v, out)
    assert copies == []
    want = OPS["attention"].reference(*[cp.asnumpy(x) for x in (q, k, v)], scale=0.3)[0]
    np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-4, atol=1e-5, err_msg=f"seed {rng.seed_value}")
    fn(q, k, cp.ascontiguousarray(v), out)  # one product through addresses, the other strided
    np.testing.assert_allclose(cp.asnumpy(out), want, rtol=1e-4, atol=1e-5, err_msg=f"seed {rng.seed_value}")


@pytest.mark.parametrize("moved", [False, True])
def test_torch_heads_compile_to_views_of_the_projection(cuda, rng, moved):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
    from test_fuse_attention import _torch_heads

    import polyhal

    program, (s, b, h, d) = _torch_heads(s=13, batch=3, h=4, d=8, key_transpose_moved=moved)
    plan = polyhal.compile(program, cuda.name)
    views = {w.value.name for w in plan.buffer_plan.views}
    ops = [op for op in plan.program.ops if op.name in ("gather", "reshape", "transpose")]
    assert ops and all(op.outputs[0].name in views for op in ops)  # no head is copied
    x = rng.standard_normal((s, b, 3 * h * d)).astype(np.float32)
    want = polyhal.compile(program, "cpu:0")(x).numpy()
    for _ in range(3):  # eager, then the captured graph replayed
        np.testing.assert_allclose(plan(x).numpy(), want, rtol=1e-4, atol=1e-5, err_msg=f"seed {rng.seed_value}")


def test_attention_accepts_the_views_it_reads_in_place():
    from polyhal_cuda.attention import accepts_view

    s, b, h, d = 11, 3, 4, 8
    t = TensorType((b, h, s, d), np.dtype(np.float32))
    packed = (3 * h * d, d, b * 3 * h * d, 1)  # a third of torch's (S, B, 3, H, D): two strides
    assert accepts_view("attention", {}, (t, t, t), (t,), 0, packed, 0)
    assert accepts_view("attention", {}, (t, t, t), (t,), 1, (h * s * d, s * d, 1, s), 0)  # k^T dense
    assert not accepts_view("attention", {}, (t, t, t), (t,), 2, packed[:3] + (2,), 0)  # no contiguous rows
    t5 = TensorType((2, b, h, s, d), np.dtype(np.float32))  # three levels: the bufferize pass copies
    assert not accepts_view("attention", {}, (t5, t5, t5), (t5,), 0, (10**6,) + packed, 0)


@pytest.mark.parametrize("sdpa", ["1", "0"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_attention_float16_and_cudnn_sdpa_against_float64(cuda, cp, rng, monkeypatch, sdpa, dtype):
    """float16 attention (what precision="fp16" now lowers to) and cuDNN's SDPA: the kernel the
    compile keeps -- cuDNN's where it measured faster and agreed with the own kernel, else the
    own one (float16 through float32) -- says which, and both read torch's packed heads."""
    from polyhal_cuda import sdpa as sdpa_module

    monkeypatch.setenv("POLYHAL_CUDA_SDPA", sdpa)
    s, b, h, d = 77, 4, 3, 64
    proj = cp.asarray(rng.standard_normal((s, b, 3, h, d)).astype(dtype))
    q, k, v = (proj[:, :, i].transpose(1, 2, 0, 3) for i in range(3))
    t = TensorType((b, h, s, d), np.dtype(dtype))
    fn = cuda.prepare("attention", {}, (t, t, t), (t,))
    name = fn.inner.kernel_name
    if sdpa == "0":
        assert "own kernel (POLYHAL_CUDA_SDPA=0)" in name, name
        assert ("float16 cast to float32" in name) == (dtype == np.float16), name
    elif sdpa_module.enabled()[0]:
        assert "measured faster" in name or "differs" in name, name  # timed against the own kernel
    want = OPS["attention"].reference(*[cp.asnumpy(x).astype(np.float64) for x in (q, k, v)])[0]
    tol = 4e-3 if dtype == np.float16 else 2e-5
    for x in ((q, k, v), tuple(cp.ascontiguousarray(a) for a in (q, k, v))):  # packed heads, then dense
        out = cp.full((b, h, s, d), np.nan, dtype)
        fn(*x, out)
        got = cp.asnumpy(out).astype(np.float64)
        assert np.isfinite(got).all(), name
        assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < tol, (name, rng.seed_value)


def test_sdpa_layouts_of_heads():
    """How q, k, v reach cuDNN's (B, H, S, D) tensors: torch's packed heads at two strides, a
    dense stack split by the head count, and what cuDNN cannot read (no GPU needed)."""
    from polyhal_cuda.sdpa import bhsd, dense_strides, heads_of

    s, b, h, d = 11, 3, 4, 8
    packed = (3 * h * d, d, b * 3 * h * d, 1)
    assert heads_of([((b, h, s, d), packed)]) == h
    assert bhsd((b, h, s, d), packed, h) == ([b, h, s, d], list(packed))
    dense = dense_strides((b * h, s, d))
    assert heads_of([((b * h, s, d), dense)]) == b * h
    assert bhsd((b * h, s, d), dense, h) == ([b, h, s, d], [h * s * d, s * d, d, 1])
    assert bhsd((b, h, s, d), packed[:3] + (2,), h) is None  # no unit last stride
    assert bhsd((2, b, h, s, d), (10**6,) + packed, h) is None  # three levels
