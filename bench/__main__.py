"""``python -m bench NAME [...]``: run benchmarks by name and write bench/results/."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path

from bench.harness import report


def main() -> int:
    here = Path(__file__).resolve().parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)])
                   if not m.ispkg and m.name not in ("harness", "__main__"))  # packages hold data (bench/models)
    parser = argparse.ArgumentParser(prog="python -m bench", description="side-by-side benchmarks")
    parser.add_argument("names", nargs="+", choices=names, metavar="NAME", help=f"one of {names}")
    parser.add_argument("--device", default=None, help="polyhal device to measure (default: best-ranked)")
    parser.add_argument("--suffix", default="", help="suffix for result files (e.g. -h100)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    parser.add_argument("--models", default="", help="comma-separated subset of a suite's models (real_models)")
    args = parser.parse_args()
    failed = 0
    for name in args.names:
        rows = importlib.import_module(f"bench.{name}").run(args)
        report(name, rows, args.suffix)
        failed += sum(r.met is False for r in rows)
    if failed:
        print(f"{failed} target(s) missed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
