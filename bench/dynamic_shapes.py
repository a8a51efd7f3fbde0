"""Shape dispatch of a shape-polymorphic ONNX model: the cost of finding the plan for a batch
size seen before, and the compiles a new batch size costs.

The model is examples/mlp.onnx (input float[batch, 256]) loaded without sizes, so
``polyhal.onnx.load`` gives a DynamicOnnxProgram; its DynamicPlan specializes per shape.

Rows:
* *shape dispatch*: ``DynamicPlan.specialization(x)`` for a cached shape (the lookup alone), and
  a whole call through the DynamicPlan minus a call of the cached static plan itself (what the
  polymorphism adds to a call), on a one-op model (Relu of float[batch, 16]) so that the
  difference is not lost in the noise of a long call. Target (issue 19): <= 5 µs. Anchor: the
  static plan's call.
* *compiles per new batch size*: the cache misses that calling with batch sizes 1, 8, 64, 1, 8,
  64 cost (one per new size; target <= 1 each). Anchor: the number of distinct sizes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.harness import Row, median_time

MODEL = Path(__file__).resolve().parent.parent / "examples" / "mlp.onnx"


def run(args) -> list[Row]:
    import polyhal.onnx as ponnx

    device = args.device or "cpu:0"
    repeat = 5 if args.quick else 40
    program = ponnx.load(MODEL)
    assert isinstance(program, ponnx.DynamicOnnxProgram)
    plan = program.compile(device)
    sizes = (1, 8, 64, 1, 8, 64)
    rng = np.random.default_rng(0)
    inputs = {n: rng.standard_normal((n, 256)).astype(np.float32) for n in set(sizes)}
    for n in sizes:
        plan(inputs[n])
    misses = plan.cache.misses
    rows = [Row("compiles for batch sizes 1, 8, 64 called twice each", "compiles", misses, len(set(sizes)),
                "distinct batch sizes", "one per new size", misses <= len(set(sizes)), {"device": device})]
    x = inputs[8]
    static = plan.specialization(x).plan
    t_lookup = median_time(lambda: plan.specialization(x), repeat=repeat, number=2000)
    t_static = median_time(lambda: static(x), repeat=repeat, number=50)
    rows.append(Row("shape dispatch: lookup of a cached shape (mlp, batch 8)", "µs", t_lookup * 1e6, t_static * 1e6,
                    "the static plan's whole call", "<= 5 µs", t_lookup * 1e6 <= 5.0, {"device": device}))
    relu = ponnx.load(_relu_model()).compile(device)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    static = relu.specialization(x).plan
    # Alternate the two, several rounds, and keep each one's best median: the machine is shared.
    t_dynamic = min(median_time(lambda: relu(x), repeat=repeat, number=2000) for _ in range(3))
    t_static = min(median_time(lambda: static(x), repeat=repeat, number=2000) for _ in range(3))
    added = max(t_dynamic - t_static, 0.0)
    rows.append(Row("shape dispatch: dynamic call minus static call (relu, batch 8)", "µs", added * 1e6,
                    t_static * 1e6, "the static plan's whole call", "<= 5 µs", added * 1e6 <= 5.0,
                    {"device": device, "dynamic_call_us": t_dynamic * 1e6}))
    return rows


def _relu_model():
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
