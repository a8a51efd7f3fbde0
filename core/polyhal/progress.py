"""Long work said on stderr: a line when it starts and one when it ends, with the time taken.

A first run that compiles for a minute must not look hung (issue 31), and a piped or tested run
must stay quiet: the lines are written where stderr is a terminal or polyhal logs at info or
finer (``polyhal -v``, ``POLYHAL_LOG``); ``POLYHAL_PROGRESS`` forces them on or off, and
:func:`configure` (``polyhal -q`` / ``-v``) overrides both for this process.

Work known to be long (the CPU backend's first build) is said at once; work that is usually
short (a compile, a model's import) is said only once it has taken ``after`` seconds, by one
watcher thread made on first need, so that short work prints nothing and costs a dictionary
entry (and nothing at all where progress is not shown).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from polyhal.config import Flag, Settings, setting

__all__ = ["LongWork", "ProgressSettings", "configure", "long_work", "say", "shown"]

#: Seconds usually-short work (a compile) runs before it is said.
SAY_AFTER = 1.0


@dataclass(frozen=True)
class ProgressSettings(Settings, component="progress"):
    """Whether long work (the CPU backend's first build, a compile over a second) is said on stderr."""

    progress: bool | None = setting(
        "POLYHAL_PROGRESS", Flag(), None,
        "say on stderr when long work (the CPU backend's first build, a compile or import over a second) starts and "
        "ends: 1 always, 0 never (polyhal -q: never)",
        shown="when stderr is a terminal or polyhal logs at info (polyhal -v)")


_forced: bool | None = None


def configure(show: bool | None) -> None:
    """Force progress lines on (True) or off (False) in this process, whatever the environment
    says; None: back to :func:`shown`'s rules. ``polyhal -q`` calls ``configure(False)``."""
    global _forced
    _forced = show


def shown() -> bool:
    """Whether progress lines are written now (see the module's docstring)."""
    if _forced is not None:
        return _forced
    forced = ProgressSettings.from_env().progress
    if forced is not None:
        return forced
    level = logging.getLogger("polyhal").level  # set by configure_logging, NOTSET otherwise
    return logging.NOTSET < level <= logging.INFO or (sys.stderr is not None and sys.stderr.isatty())


@dataclass
class LongWork:
    """What the end line says: ``done`` (set it to say the work failed)."""

    done: str


def say(line: str) -> None:
    """Say ``polyhal: LINE`` on stderr where :func:`shown` (work left running, e.g. a build in the
    background: there is no end to wait for)."""
    if shown():
        _say(line)


def _say(line: str) -> None:
    # Control characters escaped: a line may name a model's graph, which must not drive the terminal.
    line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)
    print(f"polyhal: {line}", file=sys.stderr, flush=True)


class _Watcher:
    """One daemon thread that says each watched work's start line once its deadline passes."""

    def __init__(self) -> None:
        self._reset()
        # A forked child has no watcher thread, and its copy of the lock may be held: start afresh.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[int, tuple[float, str]] = {}  # key -> (deadline, what)
        self._said: set[int] = set()
        self._keys = 0
        self._thread: threading.Thread | None = None

    def watch(self, what: str, deadline: float) -> int:
        with self._cond:
            self._keys += 1
            self._pending[self._keys] = (deadline, what)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="polyhal-progress", daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._keys

    def forget(self, key: int) -> bool:
        """Stop watching ``key``; whether its start line was said."""
        with self._cond:
            self._pending.pop(key, None)
            said = key in self._said
            self._said.discard(key)
            return said

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._pending:
                    self._cond.wait()
                    continue
                key, (deadline, what) = min(self._pending.items(), key=lambda item: item[1][0])
                wait = deadline - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                del self._pending[key]
                self._said.add(key)
                _say(f"{what} ...")


_WATCHER = _Watcher()


@contextmanager
def long_work(what: str, done: str, after: float = 0.0) -> Iterator[LongWork]:
    """Say ``polyhal: WHAT ...`` and, when the block ends, ``polyhal: DONE in N s`` (not where it
    raises: the error says what happened), where :func:`shown`. With ``after`` > 0 the start
    line waits until the work has run that long, and neither line is said for shorter work."""
    work = LongWork(done)
    if not shown():
        yield work
        return
    start = time.monotonic()
    key = _WATCHER.watch(what, start + after) if after > 0 else None
    if key is None:
        _say(f"{what} ...")
    try:
        yield work
    except BaseException:
        if key is not None:
            _WATCHER.forget(key)
        raise
    if key is None or _WATCHER.forget(key):
        took = time.monotonic() - start
        _say(f"{work.done} in {took:.1f} s" if took < 10 else f"{work.done} in {took:.0f} s")
