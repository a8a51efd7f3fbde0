"""The ``polyhal`` command: ``devices``, ``plugins``, ``demo`` (the CPU quick start) and ``explain``
(every allocation decision, the plugin that made it and why)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Any, Sequence

import numpy as np

from polyhal.distribution import install_hint, version
from polyhal.errors import PolyhalError, UsageError
from polyhal.explain import (add_explain_parser, add_policy_arguments, apply_policy_arguments, cmd_explain,
                             demo_program, printable)
from polyhal.ops import OPS
from polyhal.plan import compile
from polyhal.policy import selector_for
from polyhal.progress import configure as configure_progress
from polyhal.registry import Registry, configure_logging, default_registry, iter_plugins


def _create_devices(registry: Registry, args: argparse.Namespace) -> dict[str, str]:
    """Create every device (unless ``--no-create``), so that a device whose factory raises is
    found and listed; device name -> "ok" / "FAILED" / "not created"."""
    status = {}
    for spec in registry.device_specs():
        if getattr(args, "no_create", False):
            status[spec.name] = "not created"
            continue
        with warnings.catch_warnings():  # the failure is listed below, not warned about
            warnings.simplefilter("ignore")
            try:
                registry.get_device(spec.name)
                status[spec.name] = "ok"
            except PolyhalError:
                status[spec.name] = "FAILED"
    return status


def _failure_record(f: Any) -> dict[str, Any]:
    return {"plugin": f.plugin, "reason": f.reason, "stage": f.stage, "device": f.device}


def _device_rows(registry: Registry, status: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for spec in registry.device_specs():
        rows.append({
            "device": spec.name, "status": status.get(spec.name, "not created"), "backend": spec.backend,
            "plugin": spec.plugin, "rank": spec.rank,
            "memory_types": [h.memory_type.describe() for h in spec.heaps],
            "workgroup_bytes": spec.workgroup_bytes,
            "capabilities": sorted(spec.capabilities),
            "limits": {k: v for k, v in spec.limits.items()},
            "description": spec.description,
        })
    return rows


def cmd_devices(args: argparse.Namespace, registry: Registry) -> int:
    rows = _device_rows(registry, _create_devices(registry, args))
    failures = [_failure_record(f) for f in registry.failures]
    unavailable = registry.unavailable_reasons()
    if args.json:
        json.dump({"devices": rows, "failed_plugins": failures, "unavailable": unavailable}, sys.stdout, indent=2,
                  default=str)
        print()
        return 0
    header = ("device", "status", "backend", "rank", "memory types", "workgroup B", "description")
    table = [header] + [(r["device"], r["status"], r["backend"], str(r["rank"]), ", ".join(r["memory_types"]),
                         str(r["workgroup_bytes"]), r["description"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if not rows:
        print(f"(no devices: install a backend, e.g. {install_hint('polyhal-cpu')})")
    for f in failures:
        what = f"device {f['device']!r} of plugin {f['plugin']!r}" if f["device"] else f"plugin {f['plugin']!r}"
        print(f"\n{what} failed: {f['reason']}")
    for plugin, reasons in unavailable.items():
        for reason in reasons:
            print(f"\nplugin {plugin!r}: {reason}")
    return 0


def cmd_plugins(args: argparse.Namespace, registry: Registry) -> int:
    _create_devices(registry, args)
    plugins = []
    for name, hooks in iter_plugins(registry):
        distribution, version = registry.distribution(name) or (None, None)
        plugins.append({"plugin": name, "distribution": distribution, "version": version, "hooks": hooks})
    failures = registry.failures
    if args.json:
        json.dump({"plugins": plugins, "failed_plugins": [_failure_record(f) for f in failures]}, sys.stdout, indent=2)
        print()
        return 0
    for p in plugins:
        source = f" ({p['distribution']} {p['version']})" if p["distribution"] else ""
        print(f"{p['plugin']}{source}: {', '.join(p['hooks']) or '(no hooks)'}")
    for f in failures:
        where = f" (device {f.device})" if f.device else ""
        print(f"{f.plugin}: FAILED{where} — {f.reason}")
    return 0


def cmd_demo(args: argparse.Namespace, registry: Registry) -> int:
    """Build a small MLP block, compile it on the chosen device, run it and check it against numpy."""
    if args.repeat < 1 or args.batch < 1:
        raise UsageError(f"--repeat and --batch must be >= 1, got --repeat {args.repeat} --batch {args.batch}")
    apply_policy_arguments(args, registry)
    rng = np.random.default_rng(0)
    n, d, h = args.batch, 256, 512
    program = demo_program(n)  # the shared definition: d = 256, h = 512
    plan = compile(program, args.device, data_tiling=args.data_tiling)
    feeds = {"x": rng.standard_normal((n, d), np.float32), "w1": rng.standard_normal((d, h), np.float32) / 16,
             "w2": rng.standard_normal((h, d), np.float32) / 22, "gamma": rng.random(d, np.float32) + 0.5,
             "beta": rng.standard_normal(d).astype(np.float32)}
    out = plan(**feeds).numpy()
    t0 = time.perf_counter()
    for _ in range(args.repeat):
        plan(**feeds)
    dt = (time.perf_counter() - t0) / args.repeat
    # float64 numpy reference of the same block
    ref = OPS["gelu"].reference(feeds["x"].astype(np.float64) @ feeds["w1"])[0] @ feeds["w2"] + feeds["x"]
    mu, var = ref.mean(-1, keepdims=True), ref.var(-1, keepdims=True)
    ref = (ref - mu) / np.sqrt(var + 1e-5) * feeds["gamma"] + feeds["beta"]
    ref = np.exp(ref - ref.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    err = float(np.max(np.abs(out - ref)))
    print(program)
    print(plan.explain())
    if args.explain:
        print(selector_for(registry).explain())
    print(f"ran on {plan.placement.value_device[program.outputs[0].id]}: {dt * 1e3:.3f} ms per run, "
          f"max |error| vs float64 numpy = {err:.2e}")
    return 0 if err < 1e-4 else 1


def _cmd_run(args: argparse.Namespace, registry: Registry) -> int:
    """``polyhal run MODEL.onnx``."""
    # Deferred (here and in main): the ONNX front end imports onnx, a heavy import that
    # `import polyhal.cli` does not pay (tests/test_onnx.py holds it to that).
    from polyhal.frontends.onnx.run import cmd_run

    return cmd_run(args, registry)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``polyhal`` command: Ctrl-C anywhere ends it with one line and status
    130 (128 + SIGINT, as shells report an interrupted command), not a traceback."""
    previous = warnings.showwarning
    warnings.showwarning = _one_line_warning
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\npolyhal: interrupted" if sys.stderr.isatty() else "polyhal: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = previous


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as the command's user reads it: one line, ``polyhal: warning: ...``, with no
    source path or line of code (what Python prints by default is for a program's author)."""
    text = str(message).splitlines()[0] if str(message) else category.__name__
    if not text.startswith("polyhal"):
        text = f"{category.__name__}: {text}"
    try:
        print(f"polyhal: warning: {text.removeprefix('polyhal: ')}", file=file or sys.stderr)
    except OSError:  # (a closed stderr: nowhere to say it)
        pass


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="polyhal", description="polyhal: a pluggable heterogeneous runtime")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log to stderr what polyhal does, e.g. each plugin before it is imported "
                             "(as POLYHAL_LOG=debug)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="say nothing on stderr about long work (the CPU backend's first build, slow compiles) "
                             "nor draw progress bars; errors and warnings are still said")
    parser.add_argument("--version", action="version", version=f"polyhal {version()}",
                        help="print polyhal's version and exit (`polyhal plugins` lists the plugins' versions)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices", help="list devices, their ranks, memory types and limits, and failed plugins")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-create", action="store_true",
                   help="only list the devices: do not create them (a device whose creation fails is then not found)")
    p = sub.add_parser("plugins", help="list loaded plugins, the hooks each implements, and failed plugins and devices")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-create", action="store_true", help="do not create devices to find those that fail")
    p = sub.add_parser("demo", help="compile and run a small MLP block and check it against numpy")
    p.add_argument("--device", action="append", default=None,
                   help="device name; repeat it for a --device list (default: every device, best first)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeat", type=int, default=20)
    add_policy_arguments(p)
    p.add_argument("--explain", action="store_true", help="also list every allocation decision and why")
    p.add_argument("--data-tiling", action="store_true", default=None,
                   help="wrap matmul operands in encodings (packed on the CPU; folded on devices without data tiling); "
                        "conv feature maps are always encoded")
    add_explain_parser(sub)
    p = sub.add_parser("run", help="run an ONNX model (random or .npy/.npz inputs) and print outputs and timings")
    from polyhal.frontends.onnx.run import add_arguments as add_run_arguments

    add_run_arguments(p)
    args = parser.parse_args(argv)
    if args.quiet and args.verbose:
        parser.error("-q and -v contradict each other: give one")
    if args.verbose:
        configure_logging("debug")
    if args.quiet:
        configure_progress(False)
    try:
        registry = default_registry()
        return {"devices": cmd_devices, "plugins": cmd_plugins, "demo": cmd_demo,
                "explain": cmd_explain, "run": _cmd_run}[args.command](args, registry)
    except BrokenPipeError:
        # The reader went away (``polyhal devices | head``): nothing more to say, and Python's
        # final flush of stdout must not fail again (the recipe of Python's signal docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except PolyhalError as exc:  # a CLI prints the error, not a traceback
        print(f"polyhal: error: {printable(str(exc))}", file=sys.stderr)  # it may quote a model's names
        return 2
    finally:
        if args.quiet:
            configure_progress(None)  # main() may be called again in this process (tests, scripts)


if __name__ == "__main__":
    raise SystemExit(main())
