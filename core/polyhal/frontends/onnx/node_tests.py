"""ONNX's backend node tests on every polyhal device: how much of the standard runs correctly.

::

    python -m polyhal.frontends.onnx.node_tests                  # every device
    python -m polyhal.frontends.onnx.node_tests --device cpu:0 -k gemm

The cases are built in memory by the ``onnx`` package (``onnx.backend.test.loader``), each a small
model with inputs and expected outputs. Each runs through :class:`~polyhal.frontends.onnx.backend.
PolyhalBackend` with strict placement on one device and is classified:

* **pass**: every output matches (ONNX's own comparison, with the case's tolerances);
* **unsupported**: polyhal refused the model cleanly (an op, element type or feature it lacks:
  :class:`~polyhal.frontends.onnx.errors.OnnxUnsupportedError`, or no kernel on the device);
* **fail**: a wrong result, or any other error.

Results go to ``bench/results/onnx_node_tests.md`` (and ``.json``): totals per device, then per
op. A case never takes the process down: every exception is caught and classified.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner, _normalize_tensor

from polyhal import __version__
from polyhal.errors import KernelNotFoundError
from polyhal.frontends.onnx.backend import PolyhalBackend
from polyhal.frontends.onnx.errors import OnnxUnsupportedError
from polyhal.registry import devices as registered_devices

#: Where the report goes by default (the repository's bench results).
DEFAULT_OUTPUT = Path(__file__).resolve().parents[4] / "bench" / "results" / "onnx_node_tests.md"


@dataclass
class CaseResult:
    """One case on one device."""

    name: str
    op: str
    device: str
    status: str  # "pass", "fail" or "unsupported"
    reason: str = ""
    seconds: float = 0.0


def load_cases(pattern: str | None = None) -> list:
    """ONNX's node test cases (optionally those whose name matches regex ``pattern``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators' own overflow warnings
        cases = load_model_tests(kind="node")
    if pattern:
        rx = re.compile(pattern)
        cases = [c for c in cases if rx.search(c.name)]
    return cases


def op_of_cases(cases: Sequence) -> dict[str, str]:
    """The ONNX op each case tests: its node's op for one-node models; for function-expanded
    models ("..._expanded") the op of the unexpanded case; else the last node's op."""
    single = {}
    for c in cases:
        nodes = c.model.graph.node
        if len(nodes) == 1:
            single[c.name] = nodes[0].op_type
    ops = {}
    for c in cases:
        if c.name in single:
            ops[c.name] = single[c.name]
            continue
        base = re.sub(r"_expanded(_ver\d+)?$", "", c.name)
        nodes = c.model.graph.node
        ops[c.name] = single.get(base) or (nodes[-1].op_type if nodes else "?")
    return ops


def run_case(case, device: str) -> tuple[str, str]:
    """(status, reason) of one case on ``device``; never raises."""
    try:
        with warnings.catch_warnings(), _quiet_numpy():
            warnings.simplefilter("ignore")
            rep = PolyhalBackend.prepare(case.model, device)
            for inputs, expected in case.data_sets:
                outputs = rep.run([_normalize_tensor(x) for x in inputs])
                Runner.assert_similar_outputs([_normalize_tensor(x) for x in expected], outputs,
                                              rtol=case.rtol, atol=case.atol)
        return "pass", ""
    except (OnnxUnsupportedError, KernelNotFoundError) as exc:
        return "unsupported", _short(exc)
    except AssertionError as exc:
        return "fail", "wrong result: " + _short(exc)
    except RecursionError as exc:
        return "fail", f"RecursionError: {_short(exc)}"
    except Exception as exc:  # noqa: BLE001  (a case must never stop the run)
        return "fail", f"{type(exc).__name__}: {_short(exc)}"


class _quiet_numpy:
    def __enter__(self):
        self._old = np.seterr(all="ignore")

    def __exit__(self, *exc):
        np.seterr(**self._old)


def _short(exc: BaseException, limit: int = 240) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run(devices: Sequence[str], pattern: str | None = None, *, progress: bool = False,
        cases: Sequence | None = None) -> list[CaseResult]:
    """Run the (matching) node tests on each of ``devices``."""
    cases = load_cases(pattern) if cases is None else cases
    ops = op_of_cases(cases)
    results = []
    for device in devices:
        t_dev = time.perf_counter()
        for i, case in enumerate(cases):
            t0 = time.perf_counter()
            status, reason = run_case(case, device)
            results.append(CaseResult(case.name, ops[case.name], device, status, reason, time.perf_counter() - t0))
            if progress and (i % 50 == 0 or i == len(cases) - 1):
                done = sum(r.status == "pass" for r in results if r.device == device)
                print(f"\r{device}: {i + 1}/{len(cases)} cases, {done} pass", end="", file=sys.stderr, flush=True)
        if progress:
            print(f" ({time.perf_counter() - t_dev:.1f} s)", file=sys.stderr)
    return results


def summarize(results: Iterable[CaseResult]) -> dict[str, collections.Counter]:
    """Status counts per device."""
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        out[r.device][r.status] += 1
    return out


def report(results: list[CaseResult], output: Path | None = DEFAULT_OUTPUT) -> str:
    """The markdown report; written to ``output`` (and a .json beside it) unless None."""
    devices = list(dict.fromkeys(r.device for r in results))
    totals = summarize(results)
    lines = [
        "# ONNX backend node tests",
        "",
        f"ONNX {onnx.__version__} (opset {onnx.defs.onnx_opset_version()}), polyhal {__version__}. "
        f"Run: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}. Generated by "
        "`python -m polyhal.frontends.onnx.node_tests`.",
        "",
        "Each case runs with strict placement on one device: **pass** = outputs match ONNX's expected "
        "outputs (its own tolerances); **unsupported** = polyhal refused cleanly (an op, element type "
        "or feature it lacks, or no kernel on that device); **fail** = a wrong result or another error.",
        "",
        "| device | pass | fail | unsupported | total | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for d in devices:
        t = totals[d]
        secs = sum(r.seconds for r in results if r.device == d)
        lines.append(f"| {d} | {t['pass']} | {t['fail']} | {t['unsupported']} | {sum(t.values())} | {secs:.1f} |")
    by_op: dict[str, dict[str, collections.Counter]] = collections.defaultdict(
        lambda: collections.defaultdict(collections.Counter))
    for r in results:
        by_op[r.op][r.device][r.status] += 1
    lines += ["", "## Per op (pass / fail / unsupported)", "",
              "| op | " + " | ".join(devices) + " |", "|---|" + "---|" * len(devices)]
    for op in sorted(by_op):
        cells = [f"{c['pass']} / {c['fail']} / {c['unsupported']}" for c in (by_op[op][d] for d in devices)]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", "## Failures", ""]
    fails = [r for r in results if r.status == "fail"]
    if not fails:
        lines.append("None.")
    for r in fails:
        lines.append(f"- `{r.name}` on {r.device}: {r.reason}")
    lines += ["", "## Unsupported, by reason (first device)", ""]
    first = devices[0] if devices else None
    reasons = collections.Counter(_reason_key(r.reason) for r in results if r.device == first and r.status == "unsupported")
    for reason, n in reasons.most_common():
        lines.append(f"- {n} × {reason}")
    text = "\n".join(lines) + "\n"
    if output is not None:
        output = Path(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
        # Compact: totals, per-op counts, and the cases that did not pass (with why).
        output.with_suffix(".json").write_text(json.dumps(
            {"totals": {d: dict(totals[d]) for d in devices},
             "per_op": {op: {d: dict(c) for d, c in per.items()} for op, per in sorted(by_op.items())},
             "not_passing": [{"name": r.name, "op": r.op, "device": r.device, "status": r.status,
                              "reason": r.reason} for r in results if r.status != "pass"]}, indent=1))
    return text


def _reason_key(reason: str) -> str:
    """A reason with the model and node names taken out, so that like reasons group."""
    text = re.sub(r"^\S+: node .*?\(\w+\): ", "", reason)
    text = re.sub(r"^[^:]*: ", "", text) if text.startswith("test_") else text
    text = re.sub(r"'[^']*'", "'…'", text)
    return text[:160]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the node tests on the chosen devices and write the report."""
    parser = argparse.ArgumentParser(prog="python -m polyhal.frontends.onnx.node_tests",
                                     description="ONNX's backend node tests on polyhal devices")
    parser.add_argument("--device", action="append", default=[], help="device to test (repeatable; default: all)")
    parser.add_argument("-k", "--pattern", default=None, help="only cases whose name matches this regex")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help="markdown report path ('-': none)")
    parser.add_argument("--show-failures", action="store_true", help="print every failing case")
    args = parser.parse_args(argv)
    devices = args.device or [s.name for s in registered_devices()]
    results = run(devices, args.pattern, progress=True)
    report(results, None if args.output == "-" else Path(args.output))
    for d, t in summarize(results).items():
        print(f"{d}: {t['pass']} pass, {t['fail']} fail, {t['unsupported']} unsupported of {sum(t.values())}")
    if args.show_failures:
        for r in results:
            if r.status == "fail":
                print(f"FAIL {r.name} on {r.device}: {r.reason}")
    if args.output != "-":
        print(f"report: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
