"""Bufferization: planned scratch and buffers, and the kernels that use them.

Targets (issue: memory-space bufferization and buffer planning):

* NMS on the CPU backend, 10k random boxes, IoU 0.5: within 2x of onnxruntime's CPU
  NonMaxSuppression on the same machine, with identical selected indices. "Random boxes" here
  are detection-like: centres uniform in a 1000 x 1000 image, sides uniform in 10..100 px,
  uniform scores. A second row (no target) uses boxes whose corners are uniform in [0, 1],
  large and heavily overlapping, where onnxruntime's early exit helps it most.
* Per-row sort of 4096 rows x 1024 float32 on PoCL (the OpenCL CPU device): faster than
  numpy's ``np.sort(axis=-1)``.
* Buffer planning: peak bytes of a 20-op chain at most half of the unplanned program's.
"""

from __future__ import annotations

import numpy as np

import polyhal
from bench.harness import Row, median_time, recorded_rows
from polyhal.ops.detection import compact

N_BOXES = 10_000


def _ort_nms():
    import onnxruntime as ort
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("NonMaxSuppression", ["b", "s", "m", "i"], ["o"])], "g",
        [helper.make_tensor_value_info(n, t, None) for n, t in
         (("b", TensorProto.FLOAT), ("s", TensorProto.FLOAT), ("m", TensorProto.INT64), ("i", TensorProto.FLOAT))],
        [helper.make_tensor_value_info("o", TensorProto.INT64, None)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # its NMS is single-threaded anyway; keeps the comparison fair
    return ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString(),
                                so, providers=["CPUExecutionProvider"])


def _boxes(rng, kind: str) -> np.ndarray:
    if kind == "uniform corners":
        return rng.random((1, N_BOXES, 4)).astype(np.float32)
    c, wh = rng.uniform(0, 1000, (1, N_BOXES, 2)), rng.uniform(10, 100, (1, N_BOXES, 2))
    return np.concatenate([c - wh / 2, c + wh / 2], -1).astype(np.float32)


def _nms_rows(args, repeat: int) -> list[Row]:
    try:
        sess = _ort_nms()
    except ImportError as exc:
        print(f"skipping NMS rows: {exc}")
        return []
    rows = []
    for kind, target in (("detection-like", "<= 2x onnxruntime"), ("uniform corners", "")):
        rng = np.random.default_rng(0)
        boxes = _boxes(rng, kind)
        scores = rng.random((1, 1, N_BOXES)).astype(np.float32)
        b = polyhal.ProgramBuilder("nms")
        bx, sc = b.input("boxes", boxes.shape), b.input("scores", scores.shape)
        b.output(*b.non_max_suppression(bx, sc, max_output_boxes_per_class=N_BOXES, iou_threshold=0.5))
        plan = polyhal.compile(b.build(), "cpu:0")
        feed = {"b": boxes, "s": scores, "m": np.array([N_BOXES], np.int64), "i": np.array([0.5], np.float32)}
        sel, cnt = plan(boxes, scores)
        want = sess.run(None, feed)[0]
        same = bool(np.array_equal(compact(sel.numpy(), cnt.numpy()), want))
        # Interleaved, so that load on the machine hits both alike.
        tp, to = [], []
        for _ in range(repeat):
            tp.append(median_time(lambda: plan(boxes, scores), repeat=1, number=1, warmup=0))
            to.append(median_time(lambda: sess.run(None, feed), repeat=1, number=1, warmup=0))
        tp_, to_ = float(np.median(tp)), float(np.median(to))
        rows.append(Row(f"NMS cpu, {N_BOXES} {kind} boxes, IoU 0.5 ({len(want)} selected)", "ms", tp_ * 1e3,
                        to_ * 1e3, "onnxruntime CPU NonMaxSuppression", target,
                        (tp_ <= 2 * to_ and same) if target else None, {"identical_indices": same}))
    return rows


def _sort_row(args, repeat: int) -> list[Row]:
    names = [s.name for s in polyhal.devices() if s.backend == "opencl" and s.limits.get("type") == "cpu"]
    if not names:
        return recorded_rows("bufferization", "sort 4096x1024", "no OpenCL CPU device", args.suffix)
    dev = polyhal.get_device(names[0])
    x = np.random.default_rng(1).standard_normal((4096, 1024)).astype(np.float32)
    b = polyhal.ProgramBuilder("rowsort")
    xi = b.input("x", x.shape)
    b.output(b.sort(xi, axis=-1))
    plan = polyhal.compile(b.build(), dev.name)
    xin, out = polyhal.asarray(x, device=dev), polyhal.empty(x.shape, "float32", dev)
    plan(xin, out=out)
    dev.synchronize()
    same = bool(np.array_equal(out.numpy(), np.sort(x, axis=-1)))
    tp, tn = [], []
    for _ in range(repeat):
        tp.append(median_time(lambda: plan(xin, out=out), repeat=1, number=1, warmup=0, sync=dev.synchronize))
        tn.append(median_time(lambda: np.sort(x, axis=-1), repeat=1, number=1, warmup=0))
    tp_, tn_ = float(np.median(tp)), float(np.median(tn))
    space = next(str(a.space) for assigned in plan.buffer_plan.scratch.values() for a in assigned)
    return [Row(f"sort 4096x1024 float32 per row, {dev.name} (PoCL), tile in {space} memory", "ms", tp_ * 1e3,
                tn_ * 1e3, "numpy np.sort(axis=-1)", "faster than numpy", tp_ < tn_ and same, {"correct": same})]


def _planning_row() -> list[Row]:
    b = polyhal.ProgramBuilder("chain20")
    x, y = b.input("x", (256, 256)), b.input("y", (256, 256))
    v = x
    for i in range(20):
        v = b.add(v, y) if i % 2 else b.mul(v, y)
    b.output(v)
    bp = polyhal.compile(b.build(), "cpu:0").buffer_plan
    return [Row("peak bytes, 20-op chain of 256x256 float32 (planned vs one buffer per intermediate)", "MiB",
                bp.peak_bytes / 2**20, bp.unplanned_bytes / 2**20, "unplanned program", "<= 0.5x",
                bp.peak_bytes <= bp.unplanned_bytes / 2)]


def run(args) -> list[Row]:
    repeat = 5 if args.quick else 15
    return _nms_rows(args, repeat) + _sort_row(args, repeat) + _planning_row()
