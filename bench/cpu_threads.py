"""The CPU backend's thread budget: the README's main job with default settings against the
same job with every thread pool cut to one, idle and with one core kept busy.

``python -m bench cpu_threads [--quick]``

The job is the README's first command, ``polyhal run examples/transformer_block.onnx --dim
seq=128 --repeat 20``, its output piped to ``tail -n 1`` (the consumer process shares the
cores, as in a user's shell), run as a whole process each time; the figure of a run is the
median per run that its last line prints. The anchor is the same job under
``OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1``: what a user would set by hand
when threads fight. Runs alternate default / single-threaded (drift and other processes hit
both alike); the median of each side's run medians is reported, with every run's figure in
the JSON. "One core kept busy": a background Python process spinning for the whole condition
(:func:`bench.harness.busy_core`); "no load added": none, but whatever else the machine runs
(its load average at the start is in the JSON: a shared machine is rarely idle).

Target (issue: one thread budget): default settings within 1.5x of the single-thread
settings' median, idle and with one core busy.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench.harness import Row, busy_core

ROOT = Path(__file__).resolve().parent.parent
JOB = ["-m", "polyhal.cli", "run", "examples/transformer_block.onnx", "--dim", "seq=128", "--repeat", "20"]
SINGLE = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
TARGET = 1.5
_MEDIAN = re.compile(r"median ([0-9.]+) ms")


def _env(single: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in SINGLE and k not in ("POLYHAL_CPU_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")}
    paths = [str(ROOT / "core"), str(ROOT / "plugins" / "cpu")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if single:
        env.update(SINGLE)
    return env


def job_median(single: bool) -> float:
    """One run of the piped job: the median (ms) its last line reports."""
    shell = '"$@" 2>/dev/null | tail -n 1'
    out = subprocess.run(["sh", "-c", shell, "sh", sys.executable, *JOB], cwd=ROOT, env=_env(single),
                         capture_output=True, text=True, timeout=300)
    found = _MEDIAN.search(out.stdout)
    if not found:
        raise RuntimeError(f"the job printed no median: {out.stdout!r} {out.stderr[-2000:]!r}")
    return float(found.group(1))


def run(args) -> list[Row]:
    from polyhal_cpu.threads import available_cpus, budget_size

    runs = 3 if args.quick else 9
    rows = []
    for condition in ("no load added", "one core kept busy"):
        with busy_core() if condition != "no load added" else contextlib.nullcontext():
            load = os.getloadavg()[0]
            ours, theirs = [], []
            for _ in range(runs):
                ours.append(job_median(single=False))
                theirs.append(job_median(single=True))
        m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
        rows.append(Row(
            f"README job piped to tail -n 1, {condition}: median per run, default settings", "ms", m_ours, m_theirs,
            "OPENBLAS/OMP/NUMBA_NUM_THREADS=1", f"<= {TARGET}x", m_ours <= TARGET * m_theirs,
            {"runs_default_ms": ours, "runs_single_thread_ms": theirs, "load_average_at_start": load,
             "available_cpus": available_cpus(), "budget": budget_size(environ={})}))
        print(f"{condition}: default {m_ours:.3f} ms, single-threaded {m_theirs:.3f} ms, "
              f"ratio {m_ours / m_theirs:.2f} (runs: {ours} / {theirs})", flush=True)
    return rows
