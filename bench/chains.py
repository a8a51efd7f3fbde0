"""Long chains: the front end's cost as a model grows, against onnxruntime's.

The model is a chain of n ``Add`` nodes (``t_i = t_{i-1} + y`` on float[1, 16]): every node's
cost is import, passes and planning, none of it kernel time, so the chain shows how those grow
with n. Each row times, from the same serialized model and in the same process, polyhal's
``polyhal.onnx.load`` + ``compile("cpu:0")`` + one run against onnxruntime's ``InferenceSession``
creation (CPU provider, default options) + one run; the outputs are compared. n = 1k and 8k take
the median of 3 alternating runs, 64k one run of each (``--quick``: 1k and 8k, one run).

Targets (issue 27, Build 5):

* *growth*: polyhal's 64k / 8k time ratio at most 10, what n log n allows
  (8 x log 64k / log 8k = 9.9); a quadratic step makes it 64. Before this benchmark a 16k
  chain took 40 s (buffer planning and value naming were quadratic, and CPython's cyclic
  collector took half of a large compile); onnxruntime's own ratio is about 8.5-11.
* *against onnxruntime*: each size within 4x of onnxruntime's session create + run. polyhal's
  import, passes and plan are Python, onnxruntime's C++; measured first at 1.8-2.6x on the
  2-core VM under load (8k: 1.3 s against 0.6 s), so 4x leaves room for noise while catching a
  step that turns super-linear at some size (8k took 10 s before, 16x onnxruntime's 0.6 s).
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from bench.harness import Row

SIZES = (1_000, 8_000, 64_000)
SHAPE = (1, 16)
GROWTH_TARGET = 10.0
ORT_TARGET = 4.0


def chain_model(n: int) -> bytes:
    """The serialized ONNX model of a chain of ``n`` Adds (inputs x and y, output out)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Add", ["x" if i == 0 else f"t{i - 1}", "y"], [f"t{i}" if i < n - 1 else "out"])
             for i in range(n)]
    graph = helper.make_graph(nodes, f"chain{n}", [helper.make_tensor_value_info(v, TensorProto.FLOAT, SHAPE)
                                                     for v in ("x", "y")],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, SHAPE)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _timed(fn) -> tuple[float, object]:
    gc.collect()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(args) -> list[Row]:
    import onnxruntime as ort

    import polyhal.onnx

    device = args.device or "cpu:0"
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(SHAPE, dtype=np.float32), "y": rng.standard_normal(SHAPE, dtype=np.float32)}

    def polyhal_side(data):
        program = polyhal.onnx.load(data)
        return program.execute(program.compile(device), feeds)["out"]

    def ort_side(data):
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        return session.run(None, feeds)[0]

    polyhal_side(chain_model(10))  # the registry, the CPU kernels: not the chain's cost
    ort_side(chain_model(10))
    sizes = SIZES[:2] if args.quick else SIZES
    rows, times = [], {}
    for n in sizes:
        data = chain_model(n)
        repeat = 1 if args.quick or n > 10_000 else 3
        tp, to, same = [], [], True
        for _ in range(repeat):  # alternating, so that load on the machine hits both alike
            t, out_p = _timed(lambda: polyhal_side(data))
            tp.append(t)
            t, out_o = _timed(lambda: ort_side(data))
            to.append(t)
            same &= bool(np.allclose(out_p, out_o, rtol=1e-5, atol=1e-5))
        tp_, to_ = statistics.median(tp), statistics.median(to)
        times[n] = (tp_, to_)
        rows.append(Row(f"chain of {n} Adds: load + compile + run (onnxruntime: session create + run)", "s", tp_,
                        to_, "onnxruntime CPU session create + run", f"<= {ORT_TARGET:g}x onnxruntime",
                        tp_ <= ORT_TARGET * to_ and same, {"device": device, "same_output": same, "runs": repeat}))
    if len(sizes) == 3:
        (p8, o8), (p64, o64) = times[sizes[1]], times[sizes[2]]
        rows.append(Row(f"growth: time of {sizes[2]} / time of {sizes[1]} (n log n allows 9.9, n^2 64)", "x",
                        p64 / p8, o64 / o8, "onnxruntime's own ratio", f"<= {GROWTH_TARGET:g}",
                        p64 / p8 <= GROWTH_TARGET, {"device": device}))
    return rows
