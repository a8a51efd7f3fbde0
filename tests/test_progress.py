"""Long work said on stderr only where asked (issue 31's first run that talks): POLYHAL_PROGRESS
forces it, ``polyhal -v`` (logging at info or finer) asks for it, a pipe or a test stays quiet."""

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import polyhal
from polyhal.cli import main
from polyhal.progress import long_work, shown
from polyhal.registry import configure_logging

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def polyhal_log_level():
    logger = logging.getLogger("polyhal")
    level, handlers = logger.level, list(logger.handlers)
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_quiet_when_stderr_is_not_a_terminal(capsys, monkeypatch, polyhal_log_level):
    monkeypatch.delenv("POLYHAL_PROGRESS", raising=False)
    logging.getLogger("polyhal").setLevel(logging.NOTSET)
    with long_work("working", "worked"):
        pass
    assert capsys.readouterr().err == ""


def test_forced_on_it_says_the_start_and_the_time(capsys, monkeypatch):
    monkeypatch.setenv("POLYHAL_PROGRESS", "1")
    with long_work("working", "worked") as work:
        assert capsys.readouterr().err == "polyhal: working ...\n"
        work.done = "failed"
    assert re.fullmatch(r"polyhal: failed in \d+\.\d s\n", capsys.readouterr().err)


def test_verbose_asks_for_it_and_zero_forces_it_off(monkeypatch, polyhal_log_level):
    monkeypatch.delenv("POLYHAL_PROGRESS", raising=False)
    configure_logging("debug")  # what `polyhal -v` does
    assert shown()
    monkeypatch.setenv("POLYHAL_PROGRESS", "0")
    assert not shown()


def test_usually_short_work_is_said_only_once_it_takes_long(capsys, monkeypatch):
    monkeypatch.setenv("POLYHAL_PROGRESS", "1")
    with long_work("compiling quickly", "compiled", after=5.0):
        pass
    assert capsys.readouterr().err == ""  # shorter than `after`: neither line
    with long_work("compiling slowly", "compiled", after=0.05):
        time.sleep(0.5)
        assert capsys.readouterr().err == "polyhal: compiling slowly ...\n"  # said while it runs
    assert re.fullmatch(r"polyhal: compiled in 0\.\d s\n", capsys.readouterr().err)
    with pytest.raises(ValueError), long_work("failing", "failed", after=5.0):
        raise ValueError  # an error says what happened: no end line
    assert capsys.readouterr().err == ""


def test_a_compile_over_a_second_is_said(capsys, monkeypatch):
    monkeypatch.setenv("POLYHAL_PROGRESS", "1")
    monkeypatch.setattr(polyhal.plan, "SAY_AFTER", 0.0)  # every compile counts as long here: said at once
    b = polyhal.ProgramBuilder("said")
    b.output(b.relu(b.input("x", (4,))))
    polyhal.compile(b.build(), "cpu:0")
    err = capsys.readouterr().err
    assert re.fullmatch(r"polyhal: compiling 'said' for cpu:0 \.\.\.\npolyhal: compiled 'said' in \d+\.\d s\n", err), err


def test_quiet_silences_progress_even_where_forced_on(capsys, monkeypatch):
    monkeypatch.setenv("POLYHAL_PROGRESS", "1")
    seen = []
    monkeypatch.setattr("polyhal.cli.cmd_devices", lambda args, registry: seen.append(shown()) or 0)
    assert main(["-q", "devices"]) == 0 and seen == [False]
    assert shown()  # only for that command: main() may run again in this process
    with pytest.raises(SystemExit):
        main(["-q", "-v", "devices"])
    assert "-q and -v contradict each other" in capsys.readouterr().err


def test_polyhal_run_piped_draws_no_progress_bar(tmp_path):
    """A piped run (as in CI, or `| tail`) prints its results and no progress on stderr."""
    run = subprocess.run([sys.executable, "-m", "polyhal.cli", "run", str(EXAMPLES / "mlp.onnx"), "--dim", "batch=2",
                          "--repeat", "3", "--device", "cpu:0"], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "POLYHAL_PROGRESS": ""})
    assert run.returncode == 0, run.stderr
    assert "runs," not in run.stderr and "polyhal:" not in run.stderr, run.stderr
