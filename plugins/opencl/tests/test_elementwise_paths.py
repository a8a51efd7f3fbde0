"""The elementwise generators' contiguous kernel (dense operands and single broadcast elements,
no index math) in its CPU form (a chunk of elements per work-item) and its GPU form (one element
per work-item), against numpy; other broadcasts keep the strided kernel."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import polyhal
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, infer_types
from polyhal_opencl import kernels


@pytest.fixture(params=["cpu", "gpu"])
def traits(request, dev):
    return dataclasses.replace(dev.traits, is_cpu=request.param == "cpu")


def _run(dev, traits, op, inputs, offset=0, **attrs):
    in_types = tuple(TensorType(x.shape, x.dtype) for x in inputs)
    out_types = infer_types(op, in_types, attrs)
    fn = kernels.prepare(dev, op, attrs, in_types, out_types, traits=traits)
    keep, ins = [], []
    for x in inputs:  # each operand `offset` elements into its buffer
        flat = polyhal.asarray(np.concatenate([np.zeros(offset, x.dtype), x.reshape(-1)]), device=dev)
        keep.append(flat)
        ins.append(flat.native[offset:].reshape(x.shape))
    outs = [polyhal.empty(t.shape, t.dtype, dev) for t in out_types]
    fn(*ins, *[o.native for o in outs])
    for got, want in zip([o.numpy() for o in outs], OPS[op].reference(*inputs, **attrs)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"{op} {[x.shape for x in inputs]}")
    return fn.recipe.source


def test_dense(dev, traits, rng):
    x, y = rng.standard_normal(70001).astype(np.float32), rng.standard_normal(70001).astype(np.float32)
    assert "rest_" not in _run(dev, traits, "add", [x, y])  # no index math; several chunks and a tail
    _run(dev, traits, "maximum", [x[:1000].reshape(-1, 1), y[:1000].reshape(-1, 1)], offset=3)
    _run(dev, traits, "neg", [x[:1]])


def test_single_broadcast_element(dev, traits, rng):
    x = rng.standard_normal((3, 100)).astype(np.float32)
    assert "rest_" not in _run(dev, traits, "mul", [x, np.float32(0.5) * np.ones((1, 1), np.float32)])
    _run(dev, traits, "sub", [np.ones((), np.float32), x])
    _run(dev, traits, "where", [x > 0, x, np.zeros((), np.float32)])


def test_other_broadcasts_stay_strided(dev, traits, rng):
    x, b = rng.standard_normal((5, 40)).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    assert "rest_" in _run(dev, traits, "add", [x, b])


def test_types(dev, traits, rng):
    i8 = np.array([127, -128, 100, 5] * 300, np.int8)
    _run(dev, traits, "add", [i8, np.ones_like(i8)])  # wraps like numpy
    h = rng.standard_normal(777).astype(np.float16)
    _run(dev, traits, "exp", [h])
    f = rng.standard_normal(999).astype(np.float32)
    _run(dev, traits, "less", [f, np.zeros_like(f)])  # bool output
    _run(dev, traits, "cast", [f], dtype="int32")
