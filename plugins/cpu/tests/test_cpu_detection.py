"""non_max_suppression on the CPU backend: against the reference, against onnxruntime, bad input."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.scratch import MemorySpace
from polyhal.ops import OPS
from polyhal.ops.detection import compact

NMS = OPS["non_max_suppression"]


def run(boxes, scores, device="cpu:0", **attrs):
    b = polyhal.ProgramBuilder("nms")
    bx, sc = b.input("boxes", boxes.shape), b.input("scores", scores.shape)
    b.output(*b.non_max_suppression(bx, sc, **attrs))
    plan = polyhal.compile(b.build(), device)
    sel, cnt = plan(boxes, scores)
    return sel.numpy(), int(cnt.numpy()), plan


def check(boxes, scores, **attrs):
    sel, cnt, _ = run(boxes, scores, **attrs)
    ws, wc = NMS.reference(boxes, scores, **attrs)
    np.testing.assert_array_equal(sel, ws)
    assert cnt == int(wc)
    return compact(sel, cnt)


def random_boxes(rng, n, nb=1, field=100.0, lo=5.0, hi=30.0):
    c = rng.uniform(0, field, (nb, n, 2))
    wh = rng.uniform(lo, hi, (nb, n, 2))
    return np.concatenate([c - wh / 2, c + wh / 2], -1).astype(np.float32)


@pytest.mark.parametrize("seed", range(12))
def test_matches_reference_on_samples(seed):
    inputs, attrs = NMS.sample(np.random.default_rng(seed))
    check(*inputs, **attrs)


@pytest.mark.parametrize("n, field", [(300, 100.0), (2000, 1000.0), (1500, 1.0)])
def test_matches_reference_on_larger_problems(n, field):
    rng = np.random.default_rng(n)
    boxes = random_boxes(rng, n, nb=2, field=field, lo=field / 20, hi=field / 3)
    scores = rng.random((2, 3, n)).astype(np.float32)
    check(boxes, scores, max_output_boxes_per_class=n, iou_threshold=0.5, score_threshold=0.1)


def test_small_problems_are_compared_densely_and_large_ones_through_the_index():
    from polyhal_cpu import detection

    rng = np.random.default_rng(7)
    for n, indexed in ((100, False), (2000, True)):
        boxes = random_boxes(rng, n, field=300.0)[0]
        scores = rng.random(n).astype(np.float32)
        g = detection._Geometry(boxes, 0, 0.5, np.empty(detection._PER_BOX * n + 64, np.uint8))
        sel = detection.nms_class(g, scores, None, 0.5, n)
        ws, wc = NMS.reference(boxes[None], scores[None, None], max_output_boxes_per_class=n, iou_threshold=0.5)
        np.testing.assert_array_equal(sel, compact(ws, wc)[:, 2])
        assert g.indexed is indexed, n  # the index is built only where blocks are too large to compare densely


def _ort():
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("NonMaxSuppression", ["b", "s", "m", "i"], ["o"])], "g",
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, None), helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("m", TensorProto.INT64, None), helper.make_tensor_value_info("i", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("o", TensorProto.INT64, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    del onnx
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind", ["detection", "uniform-corners"])
def test_identical_to_onnxruntime(kind):
    sess = _ort()
    rng = np.random.default_rng(7)
    n = 3000
    boxes = random_boxes(rng, n, field=1000.0, lo=10.0, hi=100.0) if kind == "detection" \
        else rng.random((1, n, 4)).astype(np.float32)
    scores = rng.random((1, 1, n)).astype(np.float32)  # distinct scores: onnxruntime's tie order is unspecified
    sel, cnt, _ = run(boxes, scores, max_output_boxes_per_class=n, iou_threshold=0.5)
    want = sess.run(None, {"b": boxes, "s": scores, "m": np.array([n], np.int64), "i": np.array([0.5], np.float32)})[0]
    np.testing.assert_array_equal(compact(sel, cnt), want)


def test_scratch_is_planned_global_memory():
    rng = np.random.default_rng(0)
    _, _, plan = run(random_boxes(rng, 50), rng.random((1, 1, 50)).astype(np.float32), max_output_boxes_per_class=5)
    ((a,),) = plan.buffer_plan.scratch.values()
    assert a.space is MemorySpace.GLOBAL and a.nbytes >= 50 * 52
    assert a.offset >= 0


def test_prepared_without_a_plan():
    from polyhal.ir.types import TensorType

    dev = polyhal.get_device("cpu:0")
    attrs = {"max_output_boxes_per_class": 3, "iou_threshold": 0.5}
    ins = (TensorType((1, 4, 4), "float32"), TensorType((1, 1, 4), "float32"))
    outs = polyhal.ops.infer_types("non_max_suppression", ins, attrs)
    fn = dev.prepare("non_max_suppression", attrs, ins, outs)
    boxes = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [5, 5, 6, 6], [0, 0, 1, 1]]], np.float32)
    scores = np.array([[[0.9, 0.8, 0.7, 0.6]]], np.float32)
    sel, cnt = np.empty((3, 3), np.int64), np.empty((), np.int64)
    fn(boxes, scores, sel, cnt)
    assert int(cnt) == 2 and sel.tolist() == [[0, 0, 0], [0, 0, 2], [-1, -1, -1]]


# -- bad input -------------------------------------------------------------------------------------

def test_no_boxes():
    sel, cnt, _ = run(np.zeros((2, 0, 4), np.float32), np.zeros((2, 3, 0), np.float32), max_output_boxes_per_class=5)
    assert sel.shape == (0, 3) and cnt == 0


def test_one_box():
    assert check(np.array([[[1, 1, 2, 2]]], np.float32), np.array([[[0.5]]], np.float32),
                 max_output_boxes_per_class=5).tolist() == [[0, 0, 0]]


def test_max_output_boxes_per_class_zero_selects_nothing():
    rng = np.random.default_rng(1)
    sel, cnt, _ = run(random_boxes(rng, 10), rng.random((1, 1, 10)).astype(np.float32),
                      max_output_boxes_per_class=0, iou_threshold=0.5)
    assert sel.shape == (0, 3) and cnt == 0
    sel, cnt, _ = run(random_boxes(rng, 10), rng.random((1, 1, 10)).astype(np.float32),
                      max_output_boxes_per_class=-3)  # negative counts as 0, as in onnxruntime
    assert cnt == 0


def test_nan_scores_are_never_selected():
    boxes = np.array([[[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]]], np.float32)
    scores = np.array([[[np.nan, 0.5, np.nan]]], np.float32)
    assert check(boxes, scores, max_output_boxes_per_class=3).tolist() == [[0, 0, 1]]
    assert check(boxes, scores, max_output_boxes_per_class=3, score_threshold=0.0).tolist() == [[0, 0, 1]]


def test_ties_pick_the_lower_index_first():
    boxes = np.array([[[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1], [3, 3, 4, 4]]], np.float32)
    scores = np.array([[[0.5, 0.9, 0.9, 0.9]]], np.float32)
    # 1 and 2 tie at 0.9 and overlap completely: 1 (the lower index) wins and suppresses 2 and 0.
    assert check(boxes, scores, max_output_boxes_per_class=4, iou_threshold=0.5).tolist() == [[0, 0, 1], [0, 0, 3]]


def test_inverted_corners_are_normalised():
    boxes = np.array([[[0, 0, 2, 2], [2, 2, 0.1, 0.1], [1, 2, 0, 0]]], np.float32)
    scores = np.array([[[0.9, 0.8, 0.7]]], np.float32)
    got = check(boxes, scores, max_output_boxes_per_class=3, iou_threshold=0.5)
    assert got.tolist() == [[0, 0, 0], [0, 0, 2]]  # box 1 is box 0 shrunk a little: suppressed


def test_degenerate_boxes_overlap_nothing():
    boxes = np.array([[[0, 0, 0, 1], [0, 0, 0, 1], [1, 1, 1, 1]]], np.float32)  # zero areas
    scores = np.array([[[0.9, 0.8, 0.7]]], np.float32)
    assert len(check(boxes, scores, max_output_boxes_per_class=3, iou_threshold=0.0)) == 3


def test_center_point_box_format():
    boxes = np.array([[[0.5, 0.5, 1, 1], [0.55, 0.5, 1, 1], [5, 5, 1, 1]]], np.float32)
    scores = np.array([[[0.9, 0.8, 0.7]]], np.float32)
    assert check(boxes, scores, max_output_boxes_per_class=3, iou_threshold=0.5,
                 center_point_box=1).tolist() == [[0, 0, 0], [0, 0, 2]]


@pytest.mark.parametrize("iou", [-0.1, 1.5, float("nan")])
def test_iou_threshold_outside_unit_interval_is_refused_when_building(iou):
    b = polyhal.ProgramBuilder("nms")
    bx, sc = b.input("boxes", (1, 3, 4)), b.input("scores", (1, 1, 3))
    with pytest.raises(polyhal.ProgramError, match=r"non_max_suppression: iou_threshold must be in \[0, 1\]"):
        b.non_max_suppression(bx, sc, iou_threshold=iou)


@pytest.mark.parametrize("shapes, match", [
    (((1, 3, 4), (2, 1, 3)), "num_batches"),
    (((1, 3, 4), (1, 1, 4)), "num_boxes"),
    (((1, 3, 5), (1, 1, 3)), r"\[num_batches, num_boxes, 4\]"),
])
def test_shape_errors(shapes, match):
    b = polyhal.ProgramBuilder("nms")
    bx, sc = b.input("boxes", shapes[0]), b.input("scores", shapes[1])
    with pytest.raises(polyhal.ShapeError, match=match):
        b.non_max_suppression(bx, sc)
