"""``python -m bench NAME [...]``: run benchmarks by name and write bench/results/.

Exit status: 0 when every target was met (or a benchmark's device is absent: its recorded
results stay as they are), 1 when some row missed its target."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path

from bench.harness import DeviceAbsent, report


def run_benchmarks(names: list[str], args: argparse.Namespace) -> int:
    """Run ``names`` in turn and record their results; the number of rows that missed their target."""
    failed = 0
    for name in names:
        try:
            rows = importlib.import_module(f"bench.{name}").run(args)
        except DeviceAbsent as exc:
            print(f"{name}: skipped, {exc}; the recorded results in bench/results/ are left as they are")
            continue
        if not rows:
            print(f"{name}: measured nothing; the recorded results in bench/results/ are left as they are")
            continue
        report(name, rows, args.suffix)
        missed = [r.case for r in rows if r.met is False]
        failed += len(missed)
        for case in missed:
            print(f"{name}: target missed: {case}")
    return failed


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)])
                   if not m.ispkg and m.name not in ("harness", "__main__"))  # packages hold data (bench/models)
    parser = argparse.ArgumentParser(prog="python -m bench", description="side-by-side benchmarks")
    parser.add_argument("names", nargs="+", choices=names, metavar="NAME", help=f"one of {names}")
    parser.add_argument("--device", default=None, help="polyhal device to measure (default: best-ranked)")
    parser.add_argument("--suffix", default="", help="suffix for result files (e.g. -h100)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    parser.add_argument("--models", default="", help="comma-separated subset of a suite's models (real_models, "
                        "gpu_models)")
    parser.add_argument("--budget", type=float, default=None, metavar="S",
                        help="gpu_models: start no new model after S seconds (default 450)")
    parser.add_argument("--loaded", action="store_true",
                        help="real_models: also time each model with one core kept busy by another process")
    args = parser.parse_args(argv)
    return 1 if run_benchmarks(args.names, args) else 0


if __name__ == "__main__":
    raise SystemExit(main())
