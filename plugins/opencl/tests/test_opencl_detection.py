"""Planner-placed kernels on OpenCL: non_max_suppression (IoU bitmask) and the lane-parallel row
sort, in each memory space the bufferize pass can give their scratch."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.scratch import MemorySpace
from polyhal.ops import OPS
from polyhal.ops.detection import compact

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install pyopencl)")


def _device() -> str:
    names = [s.name for s in polyhal.devices() if s.backend == "opencl"]
    if not names:
        pytest.skip("no OpenCL device (install an ICD such as pocl-opencl-icd)")
    return names[0]


@pytest.fixture(scope="module")
def device():
    return _device()


class Force:
    """A memory-space policy that puts every scratch it may into one space."""

    def __init__(self, space: MemorySpace) -> None:
        self.space = space

    @polyhal.hookimpl
    def select_memory_space(self, device, kernel, scratch, limits):
        return self.space if limits.fits(scratch, self.space) else None


@pytest.fixture(params=[None, MemorySpace.PRIVATE, MemorySpace.WORKGROUP, MemorySpace.GLOBAL],
                ids=["default", "private", "workgroup", "global"])
def space(request):
    reg = polyhal.default_registry()
    if request.param is None:
        yield None
        return
    name = reg.register(Force(request.param), name=f"force-{request.param}")
    yield request.param
    reg.unregister(name=name)


def compile_op(device, op, inputs, **attrs):
    b = polyhal.ProgramBuilder(op)
    args = [b.input(f"x{i}", x.shape, x.dtype) for i, x in enumerate(inputs)]
    res = b.op(op, *args, **attrs)
    b.output(*(res if isinstance(res, tuple) else (res,)))
    return polyhal.compile(b.build(), device)


def run_op(device, op, inputs, **attrs):
    plan = compile_op(device, op, inputs, **attrs)
    out = plan(*inputs)
    return tuple(o.numpy() for o in (out if isinstance(out, tuple) else (out,))), plan


def spaces_of(plan) -> set:
    return {a.space for assigned in plan.buffer_plan.scratch.values() for a in assigned
            if a.request.name in ("keys", "cols", "removed", "tile")}


# -- non_max_suppression ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(3))
def test_nms_matches_reference(device, space, seed):
    if space is MemorySpace.PRIVATE:
        pytest.skip("every NMS scratch is shared by a work-group")
    inputs, attrs = OPS["non_max_suppression"].sample(np.random.default_rng(seed))
    (sel, cnt), plan = run_op(device, "non_max_suppression", inputs, **attrs)
    ws, wc = OPS["non_max_suppression"].reference(*inputs, **attrs)
    np.testing.assert_array_equal(sel, ws)
    assert int(cnt) == int(wc)
    if space is not None and plan.buffer_plan.scratch:
        assert spaces_of(plan) == {space}


def test_nms_identical_to_onnxruntime_on_1k_boxes(device):
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("NonMaxSuppression", ["b", "s", "m", "i"], ["o"])], "g",
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("b", TensorProto.FLOAT), ("s", TensorProto.FLOAT), ("m", TensorProto.INT64), ("i", TensorProto.FLOAT))],
        [helper.make_tensor_value_info("o", TensorProto.INT64, None)])
    sess = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    n = 1000
    c, wh = rng.uniform(0, 300, (1, n, 2)), rng.uniform(10, 60, (1, n, 2))
    boxes = np.concatenate([c - wh / 2, c + wh / 2], -1).astype(np.float32)
    scores = rng.random((1, 2, n)).astype(np.float32)
    (sel, cnt), _ = run_op(device, "non_max_suppression", [boxes, scores], max_output_boxes_per_class=n,
                           iou_threshold=0.5)
    want = sess.run(None, {"b": boxes, "s": scores, "m": np.array([n], np.int64), "i": np.array([0.5], np.float32)})[0]
    np.testing.assert_array_equal(compact(sel, cnt), want)


def test_nms_bad_input(device):
    boxes = np.array([[[0, 0, 1, 1], [1, 1, 0, 0.05], [3, 3, 4, 4], [0, 0, 0, 5]]], np.float32)  # inverted, empty
    scores = np.array([[[0.9, np.nan, 0.9, 0.8]]], np.float32)  # a nan, a tie
    (sel, cnt), _ = run_op(device, "non_max_suppression", [boxes, scores], max_output_boxes_per_class=4,
                           iou_threshold=0.5)
    assert compact(sel, cnt).tolist() == [[0, 0, 0], [0, 0, 2], [0, 0, 3]]
    (sel, cnt), _ = run_op(device, "non_max_suppression", [boxes, scores], max_output_boxes_per_class=0)
    assert sel.shape == (0, 3) and int(cnt) == 0
    empty = (np.zeros((1, 0, 4), np.float32), np.zeros((1, 2, 0), np.float32))
    (sel, cnt), _ = run_op(device, "non_max_suppression", list(empty), max_output_boxes_per_class=3)
    assert sel.shape == (0, 3) and int(cnt) == 0


def test_nms_mask_larger_than_any_allocation_is_a_compile_time_error(device):
    from polyhal.hal.scratch import ScratchError

    spec = polyhal.get_device(device).spec
    largest = max(h.max_allocation_size for h in spec.heaps)
    n = 64 * (int((16 * largest) ** 0.5) // 64 + 64)  # a bitmask of n * n / 8 bytes > largest
    assert n * (n // 64) * 8 > largest
    b = polyhal.ProgramBuilder("nms")
    bx, sc = b.input("boxes", (1, n, 4)), b.input("scores", (1, 1, n))
    b.output(*b.non_max_suppression(bx, sc, max_output_boxes_per_class=10))
    with pytest.raises(ScratchError, match=r"'mask' of opencl kernel 'nms_mask'.*needs \d+ B, limit \d+ B"):
        polyhal.compile(b.build(), device)


# -- row sort --------------------------------------------------------------------------------------

def _rows(rng, rows, n, dtype=np.float32):
    if dtype == np.float32:
        x = rng.choice(np.array([-2, -1, 0, 1, 2, 3], np.float32), size=(rows, n))
        x[::3] = rng.standard_normal((len(x[::3]), n)).astype(np.float32)
        x[0, : min(3, n)] = np.nan
        x[1, : min(4, n)] = -0.0
        x[2, ::2] = np.float32(np.nan) * -1  # negative nans
        return x
    return rng.integers(-4, 4, (rows, n)).astype(dtype)


# Each distinct instance is an OpenCL build (seconds on PoCL without a warm cache): few sizes.
@pytest.mark.parametrize("n", [300])
def test_row_sort_paths(device, space, n):
    rng = np.random.default_rng(n)
    x = _rows(rng, 70, n)
    for op, descending in (("sort", False), ("sort", True), ("argsort", True)):
        (got,), plan = run_op(device, op, [x], axis=-1, descending=descending)
        (want,) = OPS[op].reference(x, descending=descending)
        # Bitwise: zeros and nans keep their own bits, in input order (the stable order).
        bits = np.uint32 if op == "sort" else np.int64
        np.testing.assert_array_equal(got.view(bits), want.view(bits))
    if space is not None and polyhal.get_device(device).spec.limits.get("type") == "cpu":
        placed = spaces_of(plan)
        assert placed == {space} or (space is MemorySpace.PRIVATE and placed == {MemorySpace.WORKGROUP})


@pytest.mark.parametrize("k, largest, in_order", [(7, False, True), (20, True, False)])
def test_row_topk(device, k, largest, in_order):
    rng = np.random.default_rng(k)
    x = _rows(rng, 40, 50)
    (v, i), _ = run_op(device, "topk", [x], k=k, largest=largest, sorted=in_order)
    wv, wi = OPS["topk"].reference(x, k=k, largest=largest, sorted=in_order)
    np.testing.assert_array_equal(i, wi)
    np.testing.assert_array_equal(v.view(np.uint32), wv.view(np.uint32))


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_row_sort_integers(device, dtype):
    x = _rows(np.random.default_rng(0), 64, 33, dtype)
    (got,), _ = run_op(device, "sort", [x], axis=-1, descending=True)
    np.testing.assert_array_equal(got, OPS["sort"].reference(x, descending=True)[0])


def test_short_rows_whole_tensor_and_tiny_sorts(device):
    x = _rows(np.random.default_rng(1), 40, 5)
    (got,), _ = run_op(device, "sort", [x], axis=-1, descending=False)
    np.testing.assert_array_equal(got.view(np.uint32), OPS["sort"].reference(x)[0].view(np.uint32))
    x = np.random.default_rng(5).standard_normal(20000).astype(np.float32)  # one long row: tiles merged
    (got,), plan = run_op(device, "sort", [x[:20000]], axis=0, descending=False)
    np.testing.assert_array_equal(got, np.sort(x))
    assert plan.buffer_plan.scratch  # its scratch is declared and placed too
    (got,), _ = run_op(device, "argsort", [np.array([3.0], np.float32)], axis=0, descending=False)
    assert got.tolist() == [0]
    (got,), _ = run_op(device, "sort", [np.zeros((0, 4), np.float32)], axis=-1, descending=False)
    assert got.shape == (0, 4)
