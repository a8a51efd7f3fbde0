"""A user's mistakes at the ``polyhal`` command line: each ends in one clear line on stderr and a
non-zero status, before any work where it can be found before (issue 31's CLI cases)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from polyhal.cli import main
from polyhal.registry import default_registry

MLP = str(Path(__file__).resolve().parents[1] / "examples" / "mlp.onnx")


def _one_line(capsys, *argv: str) -> str:
    """Run ``polyhal run mlp.onnx --device cpu:0 ARGV``; the one line it printed to stderr (usage error, status 2)."""
    status = main(["run", MLP, "--device", "cpu:0", *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (status, err)
    return err


def test_a_trace_into_a_missing_folder_is_refused_before_the_run(capsys, tmp_path):
    err = _one_line(capsys, "--trace", str(tmp_path / "missing" / "run.json"))
    assert "no such folder" in err and "create it first" in err and "1 run" not in err


def test_a_trace_through_a_symbolic_link_is_refused_before_the_run(capsys, tmp_path):
    target = tmp_path / "elsewhere.json"
    (tmp_path / "run.json").symlink_to(target)
    err = _one_line(capsys, "--trace", str(tmp_path / "run.json"))
    assert "symbolic link" in err and not target.exists()


def test_a_negative_print_limit_is_one_line(capsys):
    assert "--print-limit must be >= 0" in _one_line(capsys, "--print-limit", "-1")


@pytest.mark.parametrize("content", [b"1,2,3\n4,5,6\n" * 4, b"\x80\x04\x95\t\x00\x00\x00pickled"])
def test_an_input_that_is_not_npy_is_one_line_without_numpys_pickle_advice(capsys, tmp_path, content):
    path = tmp_path / "x.csv"
    path.write_bytes(content)
    err = _one_line(capsys, "--input", f"x={path}")
    assert "is not a .npy or .npz file" in err and "numpy.save" in err and "pickle" not in err


def test_an_npy_input_still_reads(capsys, tmp_path):
    np.save(tmp_path / "x.npy", np.ones((2, 256), np.float32))
    assert main(["run", MLP, "--device", "cpu:0", "--input", f"x={tmp_path / 'x.npy'}"]) == 0


def test_a_cuda_device_that_is_not_there_gives_the_plugins_reason(capsys):
    registry = default_registry()
    if any(s.name == "cuda:0" for s in registry.device_specs()):
        pytest.skip("cuda:0 is present here")
    reasons = registry.unavailable_reasons().get("cuda")
    if not reasons:
        pytest.skip("the CUDA plugin is not installed, so it has no reason to give")
    status = main(["run", MLP, "--device", "cuda:0"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert "unknown device 'cuda:0'" in err and reasons[0] in err


def test_ctrl_c_during_a_long_repeat_ends_with_one_line_and_status_130():
    # -v logs each plugin as it loads: once a line is there, main() is running (not Python's start).
    proc = subprocess.Popen([sys.executable, "-m", "polyhal.cli", "-v", "run", MLP, "--device", "cpu:0",
                             "--repeat", "10000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "POLYHAL_LOG": ""})
    try:
        assert proc.stderr.readline().startswith(b"polyhal:")
        time.sleep(1.0)  # into loading, compiling or the runs: wherever, the answer is the same
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    lines = [line for line in err.decode().splitlines()
             if not line.startswith(("polyhal: loading", "polyhal: plugin", "polyhal: warning:"))]
    assert proc.returncode == 130, err.decode()
    assert lines == ["polyhal: interrupted"], err.decode()


def test_a_warning_is_one_line_without_source_paths():
    """A warning raised while a command runs reads as the command's user needs it: one line, no
    file path or line of code (a failed CPU build's warning came out as two lines with the
    plugin's path)."""
    code = ("import sys, warnings, polyhal.cli as cli\n"
            "cli._main = lambda argv: (warnings.warn('polyhal-cpu: something to know\\nmore detail', RuntimeWarning),"
            " warnings.warn('a numpy-style warning', UserWarning), 0)[-1]\n"
            "sys.exit(cli.main([]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["polyhal: warning: polyhal-cpu: something to know",
                                        "polyhal: warning: UserWarning: a numpy-style warning"]
