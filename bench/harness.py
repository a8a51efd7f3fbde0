"""Benchmark harness: timing, the side-by-side table, and results under bench/results/.

Each benchmark module ``bench/<name>.py`` defines ``run(args) -> list[Row]``; run one with
``python -m bench <name>`` (see ``python -m bench --help``). Every row carries polyhal's figure
and the anchor's from the same run, and their ratio (polyhal / anchor: below 1 is faster).

A benchmark whose device is not on this machine raises :class:`DeviceAbsent`: the harness says
so and leaves its recorded results as they are (as it does when a benchmark measured nothing).
A benchmark with several devices, one of them absent, returns that part's rows as recorded
(:func:`recorded_rows`), so that the table it writes keeps them.
``python -m bench`` exits with status 1 when a row missed its target.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"


class DeviceAbsent(Exception):
    """Raised by a benchmark's ``run`` when the device it measures is not on this machine; the
    message says which and why."""


@dataclass
class Row:
    """One comparison: what was measured, polyhal's and the anchor's median, and the target."""

    case: str
    unit: str
    polyhal: float
    anchor: float
    anchor_name: str
    target: str = ""
    met: bool | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.polyhal / self.anchor if self.anchor else float("nan")


def recorded_rows(name: str, prefix: str, reason: str, suffix: str = "") -> list[Row]:
    """The rows of ``bench/results/<name><suffix>.json`` whose case starts with ``prefix``, as
    recorded (their run's time and ``reason`` noted in ``extra``), for a part of a benchmark
    whose device is absent here; none if nothing was recorded."""
    path = RESULTS / f"{name}{suffix}.json"
    print(f"{name}: {reason}; keeping the recorded rows of {prefix!r}")
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    fields = {f for f in Row.__dataclass_fields__}
    rows = []
    for r in recorded.get("rows", []):
        if r.get("case", "").startswith(prefix):
            row = Row(**{k: v for k, v in r.items() if k in fields})
            row.extra = {**row.extra, "recorded": row.extra.get("recorded", recorded.get("time")),
                         "absent_here": reason}
            rows.append(row)
    return rows


def median_time(fn: Callable[[], object], *, repeat: int = 30, number: int = 1, warmup: int = 3,
                sync: Callable[[], object] | None = None) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` samples of ``number`` calls each."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        if sync:
            sync()
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def paired_times(ours: Callable[[], object], theirs: Callable[[], object], *, repeat: int, number: int
                 ) -> tuple[float, float, float]:
    """Median seconds per call of ``ours`` and ``theirs`` and the median of their per-round
    ratio: the two alternate, ``number`` calls each per round, so that load from other
    processes on a shared machine falls on both alike."""
    for _ in range(3):
        ours(), theirs()
    a, b = [], []
    for _ in range(repeat):
        for fn, samples in ((ours, a), (theirs, b)):
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            samples.append((time.perf_counter() - t0) / number)
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


@contextmanager
def busy_core(settle: float = 0.5) -> Iterator[subprocess.Popen]:
    """A background process keeping one core busy (a Python busy loop) for the ``with`` block:
    the "loaded machine" condition of the CPU benchmarks."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(settle)  # let it be scheduled, and the thread budget's sampling see it
        yield process
    finally:
        process.kill()
        process.wait()


def machine() -> dict:
    """Which machine the figures come from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    from polyhal.testing.settings import BenchSettings

    gpu = BenchSettings.from_env().gpu
    if gpu:
        info["gpu"] = gpu
    return info


def report(name: str, rows: list[Row], suffix: str = "") -> str:
    """Print the table and write ``bench/results/<name><suffix>.json`` and ``.md``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    m = machine()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    header = "| case | polyhal | anchor | ratio | target | met |\n|---|---|---|---|---|---|\n"
    body = "".join(
        f"| {r.case} | {r.polyhal:.4g} {r.unit} | {r.anchor:.4g} {r.unit} ({r.anchor_name}) | {r.ratio:.3f} "
        f"| {r.target} | {'' if r.met is None else ('yes' if r.met else 'NO')} |\n"
        for r in rows)
    machine_line = ", ".join(f"{k}: {v}" for k, v in m.items())
    md = f"# {name}\n\nMachine: {machine_line}. Run: {stamp}.\n\n{header}{body}"
    (RESULTS / f"{name}{suffix}.md").write_text(md)
    (RESULTS / f"{name}{suffix}.json").write_text(json.dumps(
        {"benchmark": name, "machine": m, "time": stamp,
         "rows": [dict(asdict(r), ratio=r.ratio) for r in rows]}, indent=2))
    print(md)
    return md
