"""Plans on the GPU: CUDA-graph capture and replay with inputs and outputs rebound (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal


def _chain(n: int, steps: int):
    b = polyhal.ProgramBuilder("chain")
    x, y = b.input("x", (n,)), b.input("y", (n,))
    v = x
    for i in range(steps):
        v = b.add(v, y) if i % 2 == 0 else b.mul(v, y)
    b.output(v)
    return b.build()


def _ref(x, y, steps):
    v = x.astype(np.float64)
    for i in range(steps):
        v = v + y if i % 2 == 0 else v * y
    return v


def test_plan_is_captured_once_and_replayed(cuda, rng):
    plan = polyhal.compile(_chain(16, 20), cuda.name)
    replay = plan.replay
    assert replay is not None and replay.mode == "eager"
    for i in range(5):
        x, y = rng.standard_normal(16).astype(np.float32), rng.uniform(0.5, 1.5, 16).astype(np.float32)
        np.testing.assert_allclose(plan(x, y).numpy(), _ref(x, y, 20), rtol=1e-4, err_msg=f"call {i}")
    assert replay.mode == "graph" and replay.replays == 4
    graph = replay.graph
    plan(x, y)
    assert replay.graph is graph  # never re-captured


def test_replay_rebinds_device_tensors_and_out(cuda, rng):
    plan = polyhal.compile(_chain(1000, 6), cuda.name)
    out = polyhal.empty((1000,), "float32", cuda)
    for _ in range(4):
        x = polyhal.asarray(rng.standard_normal(1000).astype(np.float32), device=cuda)
        y = polyhal.asarray(rng.uniform(0.5, 1.5, 1000).astype(np.float32), device=cuda)
        plan(x, y, out=out)
        np.testing.assert_allclose(out.numpy(), _ref(x.numpy(), y.numpy(), 6), rtol=1e-4, atol=1e-6)  # sums may cancel to ~0
    assert plan.replay.mode == "graph"


def test_steps_that_only_write_large_outputs_run_after_the_graph():
    from polyhal_cuda.graphs import eager_tail

    big, small = np.empty(4 << 20, np.float32), np.empty(16, np.float32)  # 16 MB: more than a launch's copy

    def step(*writes):
        fn = lambda: None  # noqa: E731
        fn.writes = writes
        return fn

    slots = [small, big, big, small, big]  # inputs 0, intermediate 1, outputs 2 (big), 3 (small), 4 (big)
    assert eager_tail([step(1), step(2), step(4)], slots, (2, 3, 4)) == 2
    assert eager_tail([step(1), step(3), step(4)], slots, (2, 3, 4)) == 1  # a small output stays in the graph
    assert eager_tail([step(2), step(1)], slots, (2, 3, 4)) == 0  # the last step writes an intermediate
    assert eager_tail([step(2), lambda: None], slots, (2,)) == 0  # a step that says nothing stays in


def test_a_large_output_is_written_in_place_not_copied_out_of_the_graph(cuda, rng):
    n = 4 << 20  # 16 MB of float32: the last step runs after the graph, into the caller's output
    plan = polyhal.compile(_chain(n, 6), cuda.name)
    for i in range(4):
        x, y = rng.standard_normal(n).astype(np.float32), rng.uniform(0.5, 1.5, n).astype(np.float32)
        np.testing.assert_allclose(plan(x, y).numpy(), _ref(x, y, 6), rtol=1e-4, atol=1e-5, err_msg=f"call {i}")
    replay = plan.replay
    assert replay.mode == "graph", replay.reason
    assert len(replay._tail) == 1 and replay._outputs == []  # no graph-owned copy of the output


def test_sort_and_reductions_capture(cuda, rng):
    b = polyhal.ProgramBuilder("mix")
    x = b.input("x", (64, 300))
    s = b.sort(x, axis=1)
    t = b.op("topk", x, k=5, axis=1)
    b.output(b.reduce_sum(s, axes=[1]), t[1], b.softmax(x, axis=-1))
    plan = polyhal.compile(b.build(), cuda.name)
    for _ in range(3):
        xs = rng.standard_normal((64, 300)).astype(np.float32)
        total, idx, sm = plan(xs)
        np.testing.assert_allclose(total.numpy(), np.sort(xs, 1).sum(1), rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(idx.numpy(), np.argsort(-xs, 1, kind="stable")[:, :5])
        e = np.exp(xs - xs.max(1, keepdims=True))
        np.testing.assert_allclose(sm.numpy(), e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert plan.replay.mode == "graph", plan.replay.reason


def test_uncapturable_step_stays_eager_with_a_reason(cuda, rng, monkeypatch):
    from polyhal_cuda import kernels

    # A step that synchronises with the host cannot be captured: the replay stays eager, right.
    monkeypatch.setitem(kernels.TABLE.builders, "neg", lambda d, op, a, i, o, b: kernels.host_fallback(d, op, a, i, o))
    b = polyhal.ProgramBuilder("host")
    x = b.input("x", (8,))
    b.output(b.add(b.neg(x), x))
    plan = polyhal.compile(b.build(), cuda.name)
    for _ in range(3):
        xs = rng.standard_normal(8).astype(np.float32)
        np.testing.assert_allclose(plan(xs).numpy(), np.zeros(8), atol=1e-6)
    assert plan.replay.mode.startswith("eager (capture failed"), plan.replay.mode


def test_graphs_can_be_turned_off(cuda, rng, monkeypatch):
    monkeypatch.setenv("POLYHAL_CUDA_GRAPHS", "0")
    plan = polyhal.compile(_chain(16, 4), cuda.name)
    for _ in range(3):
        plan(np.ones(16, np.float32), np.ones(16, np.float32))
    assert plan.replay.mode.startswith("eager (not worth")


def test_demo_mlp_block_on_gpu(cuda):
    from polyhal import cli

    assert cli.main(["demo", "--device", cuda.name, "--repeat", "5"]) == 0


def test_scratch_is_planned_by_bufferize(cuda):
    b = polyhal.ProgramBuilder("sorts")
    x = b.input("x", (2, 1 << 18))
    b.output(b.op("argsort", x, axis=1, descending=True))
    plan = polyhal.compile(b.build(), cuda.name)
    text = plan.explain()
    assert "radix_sort.keys" in text and "global" in text
    xs = np.random.default_rng(0).standard_normal((2, 1 << 18)).astype(np.float32)
    np.testing.assert_array_equal(plan(xs).numpy(), np.argsort(-xs, 1, kind="stable"))
