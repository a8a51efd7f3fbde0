"""The README's main job in a later process, on this user's own caches: seconds to its first output
and the CPU seconds it took, against onnxruntime's session creation and first run (issue 30).

:mod:`bench.first_run` measures the same row after building the CPU backend's caches from
nothing (minutes on 2 cores per cold sample); this bench measures only what a user meets on
every run after the first: ``polyhal run examples/transformer_block.onnx --dim seq=128 --repeat
20`` as a fresh process, the caches (``POLYHAL_CPU_CACHE_DIR``, ``NUMBA_CACHE_DIR``, the ONNX
checker's cache, Python's byte code: see :func:`bench.first_run.bytecode_env`) those of the
environment it runs in. When the compiled loops module is not
there yet, one run starts its build and the bench waits for it (as first_run does).

Each sample is a polyhal process and an onnxruntime process, in turn (load from other processes
falls on both). Wall seconds to the first line on stdout are the target's measure; the CPU
seconds of each process (``RUSAGE_CHILDREN``) are recorded beside them, being less sensitive to
a shared machine's load. One more polyhal process runs under ``python -X importtime`` and its
slowest imports are written to ``bench/results/later_run<suffix>-importtime.md``.

Target: <= 1 s to the first output (:data:`bench.first_run.WARM_TARGET_S`). ``--quick``: 3
samples; else 9.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time

from bench.first_run import (_ORT, _POLYHAL, JOB, MODEL, ROOT, WARM_TARGET_S, _wait_for_build, bytecode_env,
                             first_output_seconds)
from bench.harness import RESULTS, Row, machine
from bench.import_time import slowest_imports

#: Rows of the -X importtime table kept (the slowest modules, by cumulative time).
IMPORTTIME_ROWS = 40


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds to the first output, CPU seconds of the whole process) of ``argv``."""
    before = _cpu_seconds()
    wall = first_output_seconds(argv, env)
    return wall, _cpu_seconds() - before


def _cpu_cache() -> object:
    """The CPU backend's cache folder in this environment (None: ahead-of-time compilation off)."""
    from polyhal_cpu.native_aot import cache_dir

    return cache_dir()


def _importtime(env: dict[str, str], suffix: str) -> list[tuple[int, int, str]]:
    """The slowest imports of one later process (``python -X importtime``), written as markdown."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", _POLYHAL, *JOB], capture_output=True, text=True,
                         check=True, env=env, cwd=ROOT).stderr
    table = slowest_imports(err, IMPORTTIME_ROWS)
    m = ", ".join(f"{k}: {v}" for k, v in machine().items())
    lines = ["# later_run: python -X importtime of the README's main job (a later process)\n",
             f"Machine: {m}. Run: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average "
             f"{os.getloadavg()[0]:.2f}. The {len(table)} slowest modules by cumulative time (one run; "
             "indentation: who imported whom).\n",
             "| cumulative µs | self µs | module |", "|---|---|---|"]
    lines += [f"| {c} | {s} | `{mod.replace('|', '/')}` |" for s, c, mod in table]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"later_run{suffix}-importtime.md").write_text("\n".join(lines) + "\n")
    return table


def run(args) -> list[Row]:
    if (args.device or "cpu:0") != "cpu:0":
        print("later_run: measures the CPU backend (cpu:0) only")
    env = {**bytecode_env(), "POLYHAL_CPU_AOT_WAIT": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    polyhal_cmd = [sys.executable, "-c", _POLYHAL, *JOB]
    ort_cmd = [sys.executable, "-c", _ORT.format(path=str(MODEL))]
    first_output_seconds(polyhal_cmd, env)  # fills the ONNX cache and the byte code; starts the loops' build if missing
    cache = _cpu_cache()
    build = _wait_for_build(cache) if cache is not None else "off"
    n = 3 if args.quick else 9
    polyhal, anchor = [], []
    for _ in range(n):  # in turn: a busy moment hits both alike
        anchor.append(timed(ort_cmd, env))
        polyhal.append(timed(polyhal_cmd, env))
    load = os.getloadavg()
    table = _importtime(env, args.suffix)
    wall, cpu = statistics.median(w for w, _ in polyhal), statistics.median(c for _, c in polyhal)
    anchor_wall, anchor_cpu = statistics.median(w for w, _ in anchor), statistics.median(c for _, c in anchor)
    return [
        Row("README main job, later process: first output (separate process)", "s", wall, anchor_wall,
            "onnxruntime: import, session, first run", f"<= {WARM_TARGET_S:g} s", wall <= WARM_TARGET_S,
            {"polyhal_s": [round(w, 3) for w, _ in polyhal], "anchor_s": [round(w, 3) for w, _ in anchor],
             "loops_build": build, "load_average": load,
             "slowest_imports_ms": {mod.strip(): round(c / 1e3, 1) for _, c, mod in table[:8]}}),
        Row("README main job, later process: CPU seconds of the whole process", "s", cpu, anchor_cpu,
            "onnxruntime: import, session, first run", "", None,
            {"polyhal_s": [round(c, 3) for _, c in polyhal], "anchor_s": [round(c, 3) for _, c in anchor],
             "load_average": load}),
    ]
