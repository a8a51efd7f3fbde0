"""ONNX's backend node tests on the CPU device (the CI part of
``python -m polyhal.frontends.onnx.node_tests``): a floor on passes, and every case classified
(none may take the process down or escape as an exception)."""

from __future__ import annotations

import collections

import pytest

pytest.importorskip("onnx")

from polyhal.frontends.onnx import node_tests  # noqa: E402

#: Passes on cpu:0 when this floor was set: 1528 of 1884 (onnxruntime passes ~1525 with a plain
#: wrapper). The issue's target is 600; the floor sits below today's count to catch regressions.
PASS_FLOOR = 1450
#: Wrong results / errors allowed (today 4: two float16 attention cases a half-ulp off, and two
#: inverse DFTs whose expected near-zero values carry float32 rounding noise above atol).
FAIL_CEILING = 10


@pytest.fixture(scope="module")
def cpu_results():
    return node_tests.run(["cpu:0"])


def test_node_tests_on_cpu(cpu_results):
    counts = collections.Counter(r.status for r in cpu_results)
    assert sum(counts.values()) == len(node_tests.load_cases()) > 1800
    assert set(counts) <= {"pass", "fail", "unsupported"}
    fails = [f"{r.name}: {r.reason}" for r in cpu_results if r.status == "fail"]
    assert counts["pass"] >= PASS_FLOOR, f"{counts['pass']} pass (floor {PASS_FLOOR}); failures: {fails[:20]}"
    assert len(fails) <= FAIL_CEILING, "\n".join(fails)


def test_core_ops_pass(cpu_results):
    """The ops the issue names pass their node tests (those with supported element types)."""
    by_op = collections.defaultdict(collections.Counter)
    for r in cpu_results:
        by_op[r.op][r.status] += 1
    for op in ["Gemm", "MatMul", "Add", "Mul", "Div", "Sub", "Pow", "Relu", "Gelu", "Erf", "Tanh", "Sigmoid",
               "Softmax", "LayerNormalization", "Reshape", "Transpose", "Concat", "Slice", "Gather", "Unsqueeze",
               "Squeeze", "Expand", "Shape", "Where", "ReduceSum", "ReduceMean", "ReduceMax", "ArgMax", "TopK"]:
        c = by_op[op]
        assert c["pass"] > 0 and c["fail"] == 0, f"{op}: {dict(c)}"
