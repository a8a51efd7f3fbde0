"""The CPU's compiled loops for the less common ops (issue 32's slow paths): ``grid_sample`` and
``roi_align`` (:mod:`polyhal_cpu.vision_loops`), ``topk`` (:mod:`polyhal_cpu.select_loops`) and
``pairwise_coupling`` (:mod:`polyhal_cpu.coupling_loops`), each against the op's reference and
the numpy path it replaces, on the inputs that decide their rules: points outside the image for
every padding, nan in the grid, ROIs partly outside, ties and nan for TopK, every k."""

from __future__ import annotations

import numpy as np
import pytest

from polyhal.ir.types import TensorType
from polyhal.ops import OPS, infer_types

pytest.importorskip("numba", reason="the compiled loops need numba")
from polyhal_cpu import kernels  # noqa: E402
from polyhal_cpu.kernels import prepare  # noqa: E402


def _run(op: str, attrs: dict, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    types = tuple(TensorType(a.shape, a.dtype) for a in arrays)
    outs = infer_types(op, types, attrs)
    results = tuple(np.empty(t.shape, t.dtype) for t in outs)
    prepare(op, attrs, types, outs)(*arrays, *results)
    return results


@pytest.fixture(autouse=True)
def every_topk_selects(monkeypatch):
    """TopK's compiled selection for inputs of any size here (a run takes it from
    SELECT_MIN_ELEMENTS elements), so that these small cases test it."""
    monkeypatch.setattr(kernels, "SELECT_MIN_ELEMENTS", 0)


def _both(op: str, attrs: dict, arrays, monkeypatch) -> tuple[tuple, tuple]:
    """``op`` by the compiled loop and by the numpy path."""
    native = _run(op, attrs, *arrays)
    monkeypatch.setenv("POLYHAL_CPU_NATIVE", "0")
    numpy_path = _run(op, attrs, *arrays)
    monkeypatch.delenv("POLYHAL_CPU_NATIVE")
    return native, numpy_path


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align", [False, True])
def test_grid_sample_matches_reference(dtype, rank, mode, padding, align, monkeypatch):
    rng = np.random.default_rng(rank)
    dims = (5, 4, 3)[:rank]
    x = rng.standard_normal((2, 3, *dims)).astype(dtype)
    grid = rng.uniform(-2.5, 2.5, (2, *(3,) * rank, rank)).astype(dtype)
    grid.reshape(-1)[:4] = [-1.0, 1.0, 0.0, -1.0]  # corners and centres exactly
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    (want,) = OPS["grid_sample"].reference(x, grid, **attrs)
    (got,), (numpy_path,) = _both("grid_sample", attrs, (x, grid), monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, numpy_path, rtol=1e-5, atol=1e-6)


def test_grid_sample_nan_point_reads_nan():
    x = np.ones((1, 2, 4, 4), np.float32)
    grid = np.zeros((1, 1, 2, 2), np.float32)
    grid[0, 0, 0] = np.nan
    (got,) = _run("grid_sample", {"mode": "linear", "padding_mode": "zeros", "align_corners": False}, x, grid)
    assert np.isnan(got[0, :, 0, 0]).all() and np.allclose(got[0, :, 0, 1], 1.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ratio", [0, 2])
@pytest.mark.parametrize("transform", ["half_pixel", "output_half_pixel"])
@pytest.mark.parametrize("channels", [3, 8])  # plane by plane, channels last
def test_roi_align_matches_reference(dtype, mode, ratio, transform, channels, monkeypatch):
    rng = np.random.default_rng(ratio)
    x = rng.standard_normal((2, channels, 9, 11)).astype(dtype)
    a = rng.uniform(-3.0, 11.0, (7, 2))
    rois = np.concatenate([a, a + rng.uniform(0.0, 9.0, (7, 2))], axis=1).astype(dtype)
    rois[0] = [4.0, 4.0, 4.0, 4.0]  # empty
    batch = rng.integers(0, 2, 7).astype(np.int64)
    attrs = {"mode": mode, "output_height": 3, "output_width": 2, "sampling_ratio": ratio, "spatial_scale": 0.75,
             "coordinate_transformation_mode": transform}
    (want,) = OPS["roi_align"].reference(x, rois, batch, **attrs)
    (got,), (numpy_path,) = _both("roi_align", attrs, (x, rois, batch), monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, numpy_path, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("ratio", [0, 2])
def test_roi_align_channels_last_matches_plane_by_plane(dtype, mode, ratio):
    """The channels-last loop (from CHANNELS_LAST_MIN channels) gives the very bits of the
    plane-by-plane one (fewer channels): the same sums in the same order, samples outside the
    image reading the first pixel at weight 0 (inf and nan there included) in both."""
    from polyhal_cpu.vision_loops import CHANNELS_LAST_MIN

    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2 * CHANNELS_LAST_MIN, 9, 11)).astype(dtype)
    x[0, :, 0, 0] = np.inf
    x[1, 1, 0, 0] = np.nan
    x[2, :, 4, 5] = -np.inf
    a = rng.uniform(-6.0, 12.0, (9, 2))
    rois = np.concatenate([a, a + rng.uniform(0.0, 12.0, (9, 2))], axis=1).astype(dtype)
    batch = np.array([0, 1, 2, 0, 1, 2, 0, 0, 1], np.int64)
    attrs = {"mode": mode, "output_height": 4, "output_width": 3, "sampling_ratio": ratio, "spatial_scale": 0.8,
             "coordinate_transformation_mode": "half_pixel"}
    (whole,) = _run("roi_align", attrs, x, rois, batch)
    step = CHANNELS_LAST_MIN - 1
    parts = [_run("roi_align", attrs, np.ascontiguousarray(x[:, c:c + step]), rois, batch)[0]
             for c in range(0, x.shape[1], step)]
    np.testing.assert_array_equal(whole, np.concatenate(parts, axis=1))


def test_roi_align_refuses_a_batch_index_out_of_range():
    x = np.ones((2, 1, 4, 4), np.float32)
    rois = np.array([[0, 0, 2, 2]], np.float32)
    attrs = {"mode": "avg", "output_height": 1, "output_width": 1, "sampling_ratio": 1, "spatial_scale": 1.0,
             "coordinate_transformation_mode": "half_pixel"}
    with pytest.raises(IndexError, match="batch index"):
        _run("roi_align", attrs, x, rois, np.array([2], np.int64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_topk_matches_the_sort(dtype, largest, in_order, axis, monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 4, (6, 9, 5)).astype(dtype)  # many ties, at the cut too
    if x.dtype.kind == "f":
        x[rng.random(x.shape) < 0.1] = np.nan
    for k in (0, 1, 3, x.shape[axis]):
        attrs = {"axis": axis, "k": k, "largest": largest, "sorted": in_order}
        (v, i), (nv, ni) = _both("topk", attrs, (x,), monkeypatch)
        np.testing.assert_array_equal(i, ni)
        np.testing.assert_array_equal(v, nv)
        if in_order and x.dtype.kind == "i":
            want = OPS["topk"].reference(x, **attrs)
            np.testing.assert_array_equal(i, want[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("in_order", [True, False])
def test_topk_block_floor_matches_the_sort(dtype, largest, in_order, monkeypatch):
    """Lanes long enough for the first pass over blocks (select_loops.BLOCK elements, the floor
    from their bests): ties at the floor, nan (many: more than k in some lanes), infinities,
    +-0, a tail past the last whole block, and a lane copied from a strided axis."""
    from polyhal_cpu.select_loops import BLOCK

    rng = np.random.default_rng(3)
    n = BLOCK * 40 + 7
    x = rng.integers(-6, 7, (3, n, 2)).astype(dtype)
    if x.dtype.kind == "f":
        x[rng.random(x.shape) < 0.05] = np.nan
        x[0, : n // 2, 0] = np.nan  # more nan than k: nan fills the result's best or worst end
        x[1, rng.integers(0, n, 20), 1] = np.inf
        x[1, rng.integers(0, n, 20), 0] = -np.inf
        x[2, :, 0] = rng.choice(np.array([0.0, -0.0, 6.0, -6.0], dtype), n)
    for axis, lanes in ((1, x), (-1, np.ascontiguousarray(x.transpose(0, 2, 1)))):
        for k in (1, 4, 13):
            attrs = {"axis": axis, "k": k, "largest": largest, "sorted": in_order}
            (v, i), (nv, ni) = _both("topk", attrs, (lanes,), monkeypatch)
            np.testing.assert_array_equal(i, ni)
            np.testing.assert_array_equal(v, nv)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("classes", [2, 3, 7])
def test_pairwise_coupling_matches_reference(dtype, classes, monkeypatch):
    rng = np.random.default_rng(classes)
    r = rng.uniform(1e-7, 1 - 1e-7, (40, classes * (classes - 1) // 2)).astype(dtype)
    (want,) = OPS["pairwise_coupling"].reference(r, classes=classes)
    (got,), (numpy_path,) = _both("pairwise_coupling", {"classes": classes}, (r,), monkeypatch)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-5)


def test_strided_outputs_are_written():
    """Outputs that are strided views (a kernel may be handed one) get the results."""
    x = np.random.default_rng(0).standard_normal((4, 9)).astype(np.float32)
    attrs = {"axis": 1, "k": 3, "largest": True, "sorted": True}
    types = (TensorType(x.shape, x.dtype),)
    outs = infer_types("topk", types, attrs)
    values, indices = np.zeros((4, 6), np.float32)[:, ::2], np.zeros((4, 6), np.int64)[:, ::2]
    prepare("topk", attrs, types, outs)(x, values, indices)
    want = OPS["topk"].reference(x, **attrs)
    np.testing.assert_array_equal(values, want[0])
    np.testing.assert_array_equal(indices, want[1])
    grid = np.zeros((1, 2, 2, 2), np.float32)
    img = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    attrs = {"mode": "linear", "padding_mode": "border", "align_corners": True}
    out = np.zeros((1, 1, 2, 4), np.float32)[..., ::2]
    prepare("grid_sample", attrs, (TensorType(img.shape, img.dtype), TensorType(grid.shape, grid.dtype)),
            infer_types("grid_sample", (TensorType(img.shape, img.dtype), TensorType(grid.shape, grid.dtype)),
                        attrs))(img, grid, out)
    np.testing.assert_allclose(out, 7.5)


@pytest.mark.parametrize("k", [7, 100])  # the first pass leaves most blocks out / the heap takes many
def test_topk_split_across_threads_matches_the_sort(monkeypatch, k):
    """A batch large enough to be cut across the backend's threads (lanes along the last axis)."""
    from polyhal_cpu import parallel, threads

    monkeypatch.setenv("POLYHAL_CPU_THREADS", "2")
    threads.reset()
    monkeypatch.setattr(threads, "_budget", None)
    pieces = []
    real_run = parallel.run
    monkeypatch.setattr(parallel, "run", lambda tasks: pieces.append(len(tasks)) or real_run(tasks))
    rows = 160 if k == 7 else 24  # ~256k and ~32k elements: the least each is cut from
    x = np.random.default_rng(2).integers(-50, 50, (rows, 2000)).astype(np.float32)  # ties everywhere
    attrs = {"axis": 1, "k": k, "largest": False, "sorted": True}
    (v, i), (nv, ni) = _both("topk", attrs, (x,), monkeypatch)
    np.testing.assert_array_equal(i, ni)
    np.testing.assert_array_equal(v, nv)
    assert pieces and pieces[0] == 2


def test_a_small_topk_sorts_without_numba():
    """A small TopK (a detector's scores) takes the sort: loading the compiled selection costs
    numba's import, which a detection model's first session paid (1.1 s against 82 ms)."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from polyhal.ir.types import TensorType\n"
            "from polyhal.ops import infer_types\n"
            "from polyhal_cpu.kernels import prepare, SELECT_MIN_ELEMENTS\n"
            "x = np.random.default_rng(0).standard_normal((1, 8000)).astype(np.float32)\n"
            "assert x.size < SELECT_MIN_ELEMENTS\n"
            "attrs = {'axis': 1, 'k': 100, 'largest': True, 'sorted': True}\n"
            "types = (TensorType(x.shape, x.dtype),); outs = infer_types('topk', types, attrs)\n"
            "v, i = (np.empty(t.shape, t.dtype) for t in outs)\n"
            "prepare('topk', attrs, types, outs)(x, v, i)\n"
            "assert np.array_equal(v[0], np.sort(x[0])[::-1][:100])\n"
            "print('numba' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
