"""How long ``import polyhal`` takes, against ``import numpy, pluggy`` (what it cannot do without).

Each sample is a fresh interpreter that times its own import with ``time.perf_counter`` (the
interpreter's start-up is left out of both); the two are run in turn, ``--quick`` 5 else 21
times each, and the medians compared. Target (issue 26): polyhal <= 4x the anchor.

Beside the JSON and markdown of the harness, the run writes
``bench/results/import_time-importtime.md``: the modules ``python -X importtime -c "import
polyhal"`` names, slowest first (cumulative microseconds), so that a regression shows its cause.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from bench.harness import RESULTS, Row, machine

#: Most polyhal's import may take, in multiples of ``import numpy, pluggy``.
TARGET_RATIO = 4.0
#: Rows of the -X importtime table kept (the slowest modules, by cumulative time).
IMPORTTIME_ROWS = 40

_TIMED = "import time; t = time.perf_counter(); import {what}; print(time.perf_counter() - t)"


def import_seconds(what: str) -> float:
    """Seconds a fresh interpreter takes to run ``import <what>``."""
    out = subprocess.run([sys.executable, "-c", _TIMED.format(what=what)], capture_output=True, text=True,
                         check=True, env=os.environ)
    return float(out.stdout.strip().splitlines()[-1])


def importtime_table(what: str = "polyhal", rows: int = IMPORTTIME_ROWS) -> list[tuple[int, int, str]]:
    """``(self µs, cumulative µs, module)`` of ``python -X importtime -c "import <what>"``, the
    ``rows`` slowest by cumulative time (a module's indentation is kept: it shows who imported it)."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {what}"], capture_output=True,
                         text=True, check=True, env=os.environ).stderr
    return slowest_imports(err, rows)


def slowest_imports(stderr: str, rows: int = IMPORTTIME_ROWS) -> list[tuple[int, int, str]]:
    """``(self µs, cumulative µs, module)`` rows of ``-X importtime`` output ``stderr``, the
    ``rows`` slowest by cumulative time."""
    table = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, cumulative, module = line.removeprefix("import time:").split("|", 2)
        table.append((int(own), int(cumulative), module.rstrip()))
    return sorted(table, key=lambda r: -r[1])[:rows]


def _write_importtime(table: list[tuple[int, int, str]], suffix: str) -> None:
    m = ", ".join(f"{k}: {v}" for k, v in machine().items())
    lines = [f"# import_time: python -X importtime -c \"import polyhal\"\n",
             f"Machine: {m}. Run: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}. The {len(table)} slowest modules "
             "by cumulative time (one run; indentation: who imported whom).\n",
             "| cumulative µs | self µs | module |", "|---|---|---|"]
    lines += [f"| {c} | {s} | `{mod.replace('|', '/')}` |" for s, c, mod in table]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"import_time{suffix}-importtime.md").write_text("\n".join(lines) + "\n")


def run(args) -> list[Row]:
    repeat = 5 if args.quick else 21
    polyhal_s, anchor_s = [], []
    for _ in range(repeat):  # in turn, so that a busy moment of the machine hits both alike
        anchor_s.append(import_seconds("numpy, pluggy"))
        polyhal_s.append(import_seconds("polyhal"))
    p, a = statistics.median(polyhal_s), statistics.median(anchor_s)
    _write_importtime(importtime_table(), args.suffix)
    return [Row("import polyhal (fresh interpreter, median)", "ms", p * 1e3, a * 1e3, "import numpy, pluggy",
                f"<= {TARGET_RATIO:g}x", p <= TARGET_RATIO * a,
                {"runs": repeat, "load_average": os.getloadavg(), "polyhal_ms": [round(s * 1e3, 1) for s in polyhal_s],
                 "anchor_ms": [round(s * 1e3, 1) for s in anchor_s]})]
