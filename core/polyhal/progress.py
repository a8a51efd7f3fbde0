"""Long work said on stderr: a line when it starts and one when it ends, with the time taken.

A first run that compiles for a minute must not look hung (issue 31), and a piped or tested run
must stay quiet: the lines are written where stderr is a terminal or polyhal logs at info or
finer (``polyhal -v``, ``POLYHAL_LOG``), and ``POLYHAL_PROGRESS`` forces them on or off.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from polyhal.config import Flag, Settings, setting

__all__ = ["LongWork", "ProgressSettings", "long_work", "shown"]


@dataclass(frozen=True)
class ProgressSettings(Settings, component="progress"):
    """Whether long work (the CPU backend's first build) is said on stderr."""

    progress: bool | None = setting(
        "POLYHAL_PROGRESS", Flag(), None,
        "say on stderr when long work (such as the CPU backend's first build) starts and ends: 1 always, 0 never",
        shown="when stderr is a terminal or polyhal logs at info (polyhal -v)")


def shown() -> bool:
    """Whether progress lines are written now (see the module's docstring)."""
    forced = ProgressSettings.from_env().progress
    if forced is not None:
        return forced
    level = logging.getLogger("polyhal").level  # set by configure_logging, NOTSET otherwise
    return logging.NOTSET < level <= logging.INFO or (sys.stderr is not None and sys.stderr.isatty())


@dataclass
class LongWork:
    """What the end line says: ``done`` (set it to say the work failed)."""

    done: str


@contextmanager
def long_work(what: str, done: str) -> Iterator[LongWork]:
    """Say ``polyhal: WHAT ...`` now and ``polyhal: DONE in N s`` when the block ends (not
    where it raises: the error says what happened), where :func:`shown`."""
    say = shown()
    if say:
        print(f"polyhal: {what} ...", file=sys.stderr, flush=True)
    work, start = LongWork(done), time.monotonic()
    yield work
    if say:
        print(f"polyhal: {work.done} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
