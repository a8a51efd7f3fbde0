"""bench's harness: exit status on a missed target, and recorded results kept when a benchmark's
device is absent."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from bench.__main__ import main, run_benchmarks  # noqa: E402


def _module(monkeypatch, name: str, run) -> None:
    monkeypatch.setitem(sys.modules, f"bench.{name}", types.SimpleNamespace(run=run))


@pytest.fixture
def results(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "RESULTS", tmp_path)
    return tmp_path


def _args():
    return types.SimpleNamespace(device=None, suffix="", quick=True)


def test_missed_target_counts_and_is_recorded(monkeypatch, results):
    _module(monkeypatch, "fake_missed", lambda args: [
        harness.Row("fast", "ms", 1.0, 1.0, "numpy", "<= 1.5x", True),
        harness.Row("slow", "ms", 3.0, 1.0, "numpy", "<= 1.5x", False),
        harness.Row("report only", "ms", 3.0, 1.0, "numpy")])
    assert run_benchmarks(["fake_missed"], _args()) == 1
    assert "| slow | 3 ms | 1 ms (numpy) | 3.000 | <= 1.5x | NO |" in (results / "fake_missed.md").read_text()


def test_all_targets_met_counts_nothing(monkeypatch, results):
    _module(monkeypatch, "fake_met", lambda args: [harness.Row("fast", "ms", 1.0, 1.0, "numpy", "<= 1.5x", True)])
    assert run_benchmarks(["fake_met"], _args()) == 0
    assert (results / "fake_met.json").exists()


def test_absent_device_leaves_recorded_results(monkeypatch, results, capsys):
    (results / "fake_absent.md").write_text("recorded")

    def run(args):
        raise harness.DeviceAbsent("no OpenCL device (PoCL not installed)")
    _module(monkeypatch, "fake_absent", run)
    assert run_benchmarks(["fake_absent"], _args()) == 0
    assert (results / "fake_absent.md").read_text() == "recorded"
    assert not (results / "fake_absent.json").exists()
    assert "skipped, no OpenCL device (PoCL not installed)" in capsys.readouterr().out


def test_nothing_measured_leaves_recorded_results(monkeypatch, results):
    (results / "fake_empty.md").write_text("recorded")
    _module(monkeypatch, "fake_empty", lambda args: [])
    assert run_benchmarks(["fake_empty"], _args()) == 0
    assert (results / "fake_empty.md").read_text() == "recorded"


def test_exit_status_of_python_m_bench(monkeypatch, results):
    monkeypatch.setattr(sys, "argv", ["python -m bench"])
    import pkgutil

    real = pkgutil.iter_modules
    fake = [types.SimpleNamespace(name="fake_exit", ispkg=False)]
    monkeypatch.setattr(pkgutil, "iter_modules", lambda paths: list(real(paths)) + fake)
    _module(monkeypatch, "fake_exit", lambda args: [harness.Row("slow", "ms", 3.0, 1.0, "numpy", "<= 1.5x", False)])
    assert main(["fake_exit"]) == 1


def test_opencl_ops_without_opencl_keeps_its_table(tmp_path):
    """The real benchmark, with the OpenCL backend left out: skipped, nothing written."""
    recorded = (ROOT / "bench" / "results" / "opencl_ops.md").read_text()
    (tmp_path / "opencl_ops.md").write_text(recorded)
    script = ("import sys; from pathlib import Path; import bench.harness as h; "
              f"h.RESULTS = Path({str(tmp_path)!r}); from bench.__main__ import main; sys.exit(main(['opencl_ops']))")
    env = dict(os.environ, POLYHAL_BACKENDS="cpu")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "opencl_ops: skipped, no OpenCL device" in out.stdout
    assert (tmp_path / "opencl_ops.md").read_text() == recorded
    assert not (tmp_path / "opencl_ops.json").exists()


def test_cuda_benchmark_without_a_gpu_is_skipped(results, capsys):
    import polyhal

    if any(s.backend == "cuda" for s in polyhal.devices()):
        pytest.skip("a CUDA device is here: the benchmark would run")
    (results / "cuda_plan.md").write_text("recorded")
    assert run_benchmarks(["cuda_plan"], _args()) == 0
    assert (results / "cuda_plan.md").read_text() == "recorded"
    assert "cuda_plan: skipped, no CUDA device" in capsys.readouterr().out


def test_busy_core_runs_only_inside_the_block():
    with harness.busy_core(settle=0.05) as process:
        assert process.poll() is None
    assert process.poll() is not None


def test_absent_part_keeps_its_recorded_rows(results):
    harness.report("mixed", [harness.Row("sort on PoCL", "ms", 9.0, 13.0, "numpy", "faster", True),
                             harness.Row("NMS cpu", "ms", 70.0, 120.0, "onnxruntime", "<= 2x", True)])
    kept = harness.recorded_rows("mixed", "sort on", "no OpenCL CPU device")
    assert [(r.case, r.polyhal, r.anchor, r.met) for r in kept] == [("sort on PoCL", 9.0, 13.0, True)]
    assert kept[0].extra["absent_here"] == "no OpenCL CPU device" and kept[0].extra["recorded"]
    harness.report("mixed", [harness.Row("NMS cpu", "ms", 71.0, 119.0, "onnxruntime", "<= 2x", True)] + kept)
    assert "| sort on PoCL | 9 ms | 13 ms (numpy) |" in (results / "mixed.md").read_text()
    assert harness.recorded_rows("never_recorded", "sort", "absent") == []
