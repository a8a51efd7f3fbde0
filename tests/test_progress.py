"""Long work said on stderr only where asked (issue 31's first run that talks): POLYHAL_PROGRESS
forces it, ``polyhal -v`` (logging at info or finer) asks for it, a pipe or a test stays quiet."""

import logging
import re

import pytest

from polyhal.progress import long_work, shown
from polyhal.registry import configure_logging


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
    assert re.fullmatch(r"polyhal: failed in \d+ s\n", capsys.readouterr().err)


def test_verbose_asks_for_it_and_zero_forces_it_off(monkeypatch, polyhal_log_level):
    monkeypatch.delenv("POLYHAL_PROGRESS", raising=False)
    configure_logging("debug")  # what `polyhal -v` does
    assert shown()
    monkeypatch.setenv("POLYHAL_PROGRESS", "0")
    assert not shown()
