"""The kernels written once for OpenCL, CUDA and HIP (:mod:`polyhal_gpu.portable`): grid_sample,
roi_align, det, tree_ensemble and tfidf_vectorizer against their numpy references, over their
modes, on every OpenCL, CUDA and HIP device (each compiled alone on that device, so no other
device can serve it; on CUDA and HIP the test also checks that the portable kernel, not the host
fallback, ran). Without such a device the tests skip (polyhal-hip's own tests compile and launch
the kernels on its stand-in runtime)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import polyhal
from polyhal.errors import KernelNotFoundError
from polyhal.ir.types import TensorType
from polyhal.ops import OPS, resolve_attrs
from polyhal.ops.ml import random_ensemble

_DEVICES = [s.name for s in polyhal.devices() if s.backend in ("opencl", "cuda", "hip")]


@pytest.fixture(params=_DEVICES or [None], ids=_DEVICES or ["no-gpu-device"])
def device(request) -> str:
    if request.param is None:
        pytest.skip("no OpenCL, CUDA or HIP device")
    return request.param


def _check(device: str, op: str, inputs: list, rtol: float | None = None, atol: float | None = None, **attrs) -> None:
    b = polyhal.ProgramBuilder(op)
    args = [b.input(f"x{i}", x.shape, x.dtype) for i, x in enumerate(inputs)]
    res = b.op(op, *args, **attrs)
    b.output(*(res if isinstance(res, tuple) else (res,)))
    got = polyhal.compile(b.build(), device)(*inputs)
    got = got if isinstance(got, tuple) else (got,)
    wants = OPS[op].reference(*inputs, **resolve_attrs(op, attrs))
    if device.startswith(("cuda", "hip")) and wants[0].size:  # (an empty result runs no kernel)
        types = tuple(TensorType(x.shape, x.dtype) for x in inputs)
        fn = polyhal.get_device(device).prepare(op, attrs, types, tuple(TensorType(w.shape, w.dtype) for w in wants))
        assert "portable" in fn.inner.kernel_name, fn.inner.kernel_name
    d_rtol, d_atol = OPS[op].tolerance
    for g, want in zip(got, wants):
        g = g.numpy()
        assert g.shape == want.shape and g.dtype == want.dtype
        np.testing.assert_allclose(g, want, rtol=rtol or d_rtol, atol=atol or d_atol, err_msg=f"{op} {attrs}")


_GRID_CASES = [(1 + i % 3, *c) for i, c in enumerate(itertools.product(
    ("nearest", "linear", "cubic"), ("zeros", "border", "reflection"), (False, True)))]


@pytest.mark.parametrize("rank,mode,padding,align", _GRID_CASES)
def test_grid_sample(device, rank, mode, padding, align):
    """Every mode, padding and align_corners, each at one of the spatial ranks 1, 2, 3."""
    rng = np.random.default_rng(rank * 100 + len(mode) + len(padding) + align)
    x = rng.standard_normal((2, 3) + (5, 4, 3)[:rank]).astype(np.float32)
    # points well outside [-1, 1] (padding and reflection), and the exact corners and centre
    grid = rng.uniform(-2.2, 2.2, size=(2,) + (3, 4, 2)[:rank] + (rank,)).astype(np.float32)
    grid.reshape(-1)[:3] = [-1.0, 0.0, 1.0]
    _check(device, "grid_sample", [x, grid], mode=mode, padding_mode=padding, align_corners=align)


def test_grid_sample_float64(device):
    rng = np.random.default_rng(3)
    x, grid = rng.standard_normal((1, 2, 6, 7)), rng.uniform(-1.2, 1.2, size=(1, 4, 5, 2))
    _check(device, "grid_sample", [x, grid], rtol=1e-10, atol=1e-12, mode="cubic", padding_mode="reflection",
           align_corners=False)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("transform", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_roi_align(device, mode, transform, sampling_ratio):
    rng = np.random.default_rng(sampling_ratio + len(mode) * 10 + len(transform))
    x = rng.standard_normal((2, 3, 7, 9)).astype(np.float32)
    a = rng.uniform(-2.0, 8.0, size=(5, 2))
    rois = np.concatenate([a, a + rng.uniform(0.1, 6.0, size=(5, 2))], axis=1).astype(np.float32)
    rois[0] = [3.0, 3.0, 2.0, 2.0]  # an inverted (empty) box
    batch = rng.integers(0, 2, size=5).astype(np.int64)
    _check(device, "roi_align", [x, rois, batch], mode=mode, output_height=3, output_width=2,
           sampling_ratio=sampling_ratio, spatial_scale=0.75, coordinate_transformation_mode=transform)


@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (4, 2, 2), (2, 3, 5, 5), (0, 4, 4), (6, 16, 16)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_det(device, shape, dtype):
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(dtype)
    if x.size and shape[-1] > 1:
        x.reshape((-1,) + shape[-2:])[0, 1] = x.reshape((-1,) + shape[-2:])[0, 0]  # a singular matrix
    rtol = 1e-4 if dtype == np.float32 else 1e-10
    _check(device, "det", [x], rtol=rtol, atol=1e-6 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("aggregate,base,binary,post,labels", [
    ("sum", (), "", "none", False), ("min", (0.5, -1.0, 2.0), "", "none", False),
    ("max", (), "", "logistic", True), ("sum", (0.25, 0.0, -0.5), "", "softmax", True),
    ("sum", (), "", "softmax_zero", False), ("sum", (0.5,), "probability", "none", True),
    ("max", (), "margin", "logistic", False)])
def test_tree_ensemble(device, dtype, aggregate, base, binary, post, labels):
    """Every aggregate, base values, binary columns and post transform, with and without labels."""
    rng = np.random.default_rng(11)
    nodes, thresholds, leaf_values, roots = random_ensemble(rng, 6, 7, 4, 1 if binary else 3, dtype)
    if aggregate != "sum" and not binary:  # leaves that give a target nothing (nan), a target no leaf gives anything
        leaf_values[::3, 1] = np.nan
        leaf_values[:, 2] = np.nan
    if post == "softmax_zero":
        leaf_values[::2, 0] = 0.0
    x = rng.choice(np.array([-0.5, 0.5, np.nan, 1.5, -2.0, 0.3]), size=(40, 6)).astype(dtype)
    operands = [x, nodes, thresholds, leaf_values, roots] + ([np.array([7, 3, 5][:2 if binary else 3])] if labels else [])
    _check(device, "tree_ensemble", operands, depth=4, aggregate=aggregate, base=list(base), binary=binary,
           post_transform=post)


@pytest.mark.parametrize("mode,weighted,dtype,rows", [
    ("TF", False, np.int32, (4, 11)), ("TF", True, np.int64, (13,)), ("IDF", False, np.int64, (13,)),
    ("IDF", True, np.int32, (4, 11)), ("TFIDF", False, np.int32, (4, 11)), ("TFIDF", True, np.int64, (13,))])
def test_tfidf_vectorizer(device, mode, weighted, dtype, rows):
    x = np.random.default_rng(5).integers(0, 5, size=rows).astype(dtype)
    # unigrams, bigrams and trigrams; the bigram (1, 3) twice (it counts in its last column) and
    # two n-grams sharing column 2
    attrs = dict(pool=[2, 3, 1, 0, 1, 3, 4, 2, 1, 3, 0, 4, 1, 2, 3], ngram_counts=[0, 3, 9],
                 ngram_indexes=[5, 0, 2, 1, 3, 4, 2, 6],
                 weights=[1.5, 2.0, 0.5, 1.0, 3.0, 0.25, 2.5] if weighted else [],
                 min_gram=1, max_gram=3, max_skip=2, mode=mode)
    _check(device, "tfidf_vectorizer", [x], **attrs)


def test_unserved_instances_are_refused():
    from polyhal_gpu import portable

    f16 = TensorType((1, 1, 4, 4), np.float16)
    grid = TensorType((1, 2, 2, 2), np.float16)
    with pytest.raises(KernelNotFoundError, match="float16"):
        portable.plan("grid_sample", resolve_attrs("grid_sample", {}), (f16, grid), (f16,), fp64=True)
    big = TensorType((17, 17), np.float32)
    with pytest.raises(KernelNotFoundError, match="17 x 17"):
        portable.plan("det", {}, (big,), (TensorType((), np.float32),), fp64=True)
    x = TensorType((2, 3), np.float32)
    with pytest.raises(KernelNotFoundError, match="float64"):
        portable.plan("tree_ensemble", resolve_attrs("tree_ensemble", {"depth": 1}), (x,), (x,), fp64=False)
