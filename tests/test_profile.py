"""Profiles of plan runs (polyhal.profile, Plan.profile / Plan.profiling, polyhal run --profile)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import polyhal
from polyhal.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _plan():
    """relu -> gather -> neg on cpu:0; an index out of range makes the gather raise at run time."""
    b = polyhal.ProgramBuilder("profiled")
    x, i = b.input("x", (4, 3)), b.input("i", (2,), "int64")
    b.output(b.neg(b.gather(b.relu(x), i, axis=0)))
    return polyhal.compile(b.build(), "cpu:0")


X = np.arange(12, dtype=np.float32).reshape(4, 3) - 5
GOOD, BAD = np.array([0, 3]), np.array([0, 9])


def test_table_has_a_row_per_step_and_per_op_type():
    plan = _plan()
    prof = plan.profile(X, GOOD, runs=4)
    assert prof.runs == 4 and len(prof.events) == 3 * 4
    rows = prof.rows()
    assert sorted(r["op"] for r in rows) == ["gather", "neg", "relu"]
    for r in rows:
        assert r["calls"] == 4 and r["device"] == "cpu:0" and r["total_ms"] > 0
        assert r["mean_us"] == pytest.approx(r["total_ms"] * 1e3 / 4)
        assert r["node"].startswith("%")  # no front end: the result value names the step
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert [r["total_ms"] for r in rows] == sorted((r["total_ms"] for r in rows), reverse=True)
    groups = {g["op"]: g for g in prof.by_op()}
    assert set(groups) == {"gather", "neg", "relu"} and all(g["calls"] == 4 for g in groups.values())
    text = prof.table()
    assert "profile of @profiled: 4 run(s), 3 steps" in text and "cpu:0: host clock" in text
    assert "by op type:" in text
    for header in ("step", "op", "node", "device", "calls", "total ms", "mean us", "share"):
        assert header in text.splitlines()[1]


def test_results_are_those_of_a_plain_run():
    plan = _plan()
    with plan.profiling() as prof:
        got = plan(X, GOOD).numpy()
    np.testing.assert_array_equal(got, -np.maximum(X, 0)[[0, 3]])
    assert prof.runs == 1


def test_trace_is_chrome_json_with_one_event_per_step_and_run(tmp_path):
    plan = _plan()
    path = tmp_path / "trace.json"
    prof = plan.profile(X, GOOD, runs=3, trace=str(path))
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(prof.trace()))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 3 * 3
    assert {(e["args"]["step"], e["args"]["run"]) for e in complete} == {(s, r) for s in range(3) for r in range(3)}
    for e in complete:
        assert e["name"] in ("relu", "gather", "neg") and e["dur"] >= 0 and e["ts"] >= 0
        assert e["pid"] == 0 and e["tid"] == 0
    starts = [e["ts"] for e in complete]
    assert starts == sorted(starts)  # steps ran in order, runs one after another
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert names == [{"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "cpu:0"}}]


def test_a_failed_run_still_writes_the_partial_trace(tmp_path):
    plan = _plan()
    path = tmp_path / "partial.json"
    with pytest.raises(polyhal.KernelError, match="kernel 'gather' on device cpu:0") as info:
        with plan.profiling(trace=str(path)):
            plan(X, GOOD)
            plan(X, BAD)
    prof = info.value.profile
    assert prof.runs == 2 and prof.error.startswith("KernelError") and "raised IndexError" in prof.error
    assert any(str(path) in note for note in getattr(info.value, "__notes__", [str(path)]))
    complete = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["args"]["run"]) for e in complete] == [
        ("relu", 0), ("gather", 0), ("neg", 0), ("relu", 1), ("gather", 1)]
    assert "index 9 is out of bounds" in complete[-1]["args"]["error"]
    assert "error" not in complete[-2]["args"]
    assert "the last run raised: KernelError" in prof.table()


def test_profiling_off_leaves_the_plain_loop():
    plan = _plan()
    plain, steps = plan.replay, list(plan._steps)
    with plan.profiling() as prof:
        assert plan.replay is not plain  # the profiled loop, only inside the block
        plan(X, GOOD)
    assert plan.replay is plain and plan._steps == steps
    plan(X, GOOD)
    assert prof.runs == 1 and len(prof.events) == 3  # a run after the block is not profiled
    with pytest.raises(polyhal.KernelError):
        with plan.profiling():
            plan(X, BAD)
    assert plan.replay is plain


def test_runs_must_be_positive():
    with pytest.raises(polyhal.ProgramError, match="runs >= 1"):
        _plan().profile(X, GOOD, runs=0)


def test_onnx_node_names_reach_the_steps():
    import polyhal.onnx

    program = polyhal.onnx.load(EXAMPLES / "mlp.onnx", dims={"batch": 2})
    plan = program.compile("cpu:0")
    feeds = {v.name: np.ones(v.type.shape, v.type.dtype) for v in program.inputs}
    prof = plan.profile(**feeds)  # the ONNX front end's compile gives the plan its node names
    # fc0's Gemm and its Relu are one fused_linear step, named after both nodes
    assert {r["node"] for r in prof.rows()} >= {"fc0 (Gemm) + relu0 (Relu)", "softmax (Softmax)"}


def test_cli_profile_and_trace(tmp_path, capsys):
    path = tmp_path / "run.json"
    # On cpu:0, whose fusions the names below are (the default device of a GPU machine fuses less).
    assert main(["run", str(EXAMPLES / "mlp.onnx"), "--device", "cpu:0", "--repeat", "3", "--profile",
                 "--trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "profile of @" in out and "fc0 (Gemm) + relu0 (Relu)" in out and "by op type:" in out
    assert out.rstrip().splitlines()[-1].startswith("3 runs: median")
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * len({e["args"]["step"] for e in events})
    assert main(["run", str(EXAMPLES / "mlp.onnx"), "--device", "cpu:0", "--profile", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {r["op"] for r in report["profile"]["by_op"]} >= {"gemm", "fused_linear"}


def _cuda_devices() -> list[str]:
    return [s.name for s in polyhal.devices() if s.backend == "cuda"]


@pytest.mark.parametrize("device", _cuda_devices() or [pytest.param("cuda:0", marks=pytest.mark.skip(
    reason="no CUDA device here (cupy and a GPU are needed)"))])
def test_cuda_steps_are_timed_by_events(device, tmp_path):
    b = polyhal.ProgramBuilder("gpu")
    x = b.input("x", (512, 512))
    b.output(b.relu(b.matmul(x, x)))
    plan = polyhal.compile(b.build(), device)
    xs = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)
    prof = plan.profile(xs, runs=3, trace=str(tmp_path / "gpu.json"))
    assert prof.timing == f"{device}: CUDA events"
    assert {r["op"]: r["calls"] for r in prof.rows()} == {"matmul": 3, "relu": 3}
    assert all(e.duration_ns > 0 for e in prof.events)
    np.testing.assert_allclose(plan(xs).numpy(), np.maximum(xs @ xs, 0), rtol=1e-3, atol=1e-2)
