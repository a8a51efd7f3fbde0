"""Kernel results on a real AMD GPU: these skip here (no machine of this project has one) and
say why. ``python -m polyhal_hip.selftest`` runs these and much more, as a JSON report; the
core's suite runs with ``pytest --pyargs polyhal.testing.conformance --polyhal-backend=hip``."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal


def _run(device, op, *inputs, **attrs):
    b = polyhal.ProgramBuilder(op)
    args = [b.input(f"x{i}", x.shape, x.dtype) for i, x in enumerate(inputs)]
    res = b.op(op, *args, **attrs)
    b.output(*(res if isinstance(res, tuple) else (res,)))
    out = polyhal.compile(b.build(), device.name)(*inputs)
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def test_elementwise_with_broadcast(hip, rng):
    x, y = rng.standard_normal((64, 33), np.float32), rng.standard_normal(33, np.float32)
    (got,) = _run(hip, "add", x, y)
    np.testing.assert_array_equal(got, x + y)


def test_matmul_batched(hip, rng):
    a, b = rng.standard_normal((3, 40, 50), np.float32), rng.standard_normal((50, 30), np.float32)
    (got,) = _run(hip, "matmul", a, b)
    np.testing.assert_allclose(got, a @ b, rtol=1e-4, atol=1e-4)


def test_reduce_and_softmax(hip, rng):
    x = rng.standard_normal((8, 300), np.float32)
    (s,) = _run(hip, "reduce_sum", x, axes=(1,), keepdims=False)
    np.testing.assert_allclose(s, x.sum(1), rtol=1e-4, atol=1e-4)
    (p,) = _run(hip, "softmax", x, axis=-1)
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(p, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [100, 20000])  # pairs in LDS; pairs in global scratch
def test_sort_both_scratch_spaces(hip, rng, n):
    x = rng.standard_normal((3, n)).astype(np.float32)
    (got,) = _run(hip, "argsort", x, axis=-1, descending=False)
    np.testing.assert_array_equal(got, np.argsort(x, axis=-1, kind="stable"))


def test_async_buffer_exports_to_torch(hip):
    torch = pytest.importorskip("torch")
    if not getattr(torch.version, "hip", None):
        pytest.skip(f"torch {torch.__version__} is not a ROCm build")
    buf = hip.allocator.allocate(64, polyhal.MemoryType.DEVICE_LOCAL, kind=polyhal.BufferKind.ASYNC)
    t = polyhal.Tensor(buf, polyhal.TensorType((16,), np.float32))
    hip.write(buf, 0, np.arange(16, dtype=np.float32))
    assert torch.from_dlpack(t).cpu().tolist() == list(range(16))
