"""``polyhal run MODEL.onnx``: run an ONNX model on the installed devices.

::

    polyhal run examples/mlp.onnx                                 # random inputs, CPU default
    polyhal run model.onnx --input x=x.npy --device opencl:0 --device cpu:0 --explain
    polyhal run model.onnx --input inputs.npz --repeat 100 --output out/ --json
    polyhal run model.onnx --repeat 20 --profile --trace run.json   # per-op table, Perfetto trace

Inputs come from ``--input NAME=FILE.npy`` (or ``NAME=FILE.npz``, its only array or the one
called NAME), ``--input FILE.npz`` (every array, by name), or are drawn at random from the
model's declared types (symbolic dims from ``--dim SYMBOL=SIZE`` or ``--shape NAME=D0,D1``,
else 1). Inputs that decide shapes (a Reshape's shape fed as an input, ...) are fixed to the
values read from files. ``--device`` is the ordered device list (as IREE's ``--device``): each
op runs on the first that has its kernel, others taking what it lacks unless ``--strict``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from polyhal.errors import PolyhalError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``run`` subcommand's options."""
    p.add_argument("model", help="path of the .onnx model")
    p.add_argument("--input", "-i", action="append", default=[], metavar="NAME=FILE",
                   help="an input from a .npy/.npz file (repeatable); a bare FILE.npz gives inputs by name")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                   help="shape of a random input with symbolic dims")
    p.add_argument("--dim", action="append", default=[], metavar="SYMBOL=SIZE",
                   help="size of a symbolic dim, by its name in the model (e.g. batch=8)")
    p.add_argument("--seed", type=int, default=0, help="seed of random inputs (default 0)")
    p.add_argument("--device", action="append", default=None, metavar="DEVICE",
                   help="device to run on; repeat for an ordered list (default: every device, best first)")
    p.add_argument("--strict", action="store_true",
                   help="fail if an op has no kernel on the --device list, instead of running it elsewhere")
    try:
        from polyhal.explain import add_policy_arguments
    except ImportError:  # an older core without the policy options
        p.add_argument("--device-lead-allocator", type=int, default=None, metavar="N",
                       help="the Nth --device allocates buffers several devices share")
    else:
        add_policy_arguments(p)
    p.add_argument("--data-tiling", action="store_true", help="compile with data-tiling encodings")
    p.add_argument("--explain", action="store_true",
                   help="print where every op ran, allocation decisions, folded encodes and scratch placement")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="run N times and summarise the timings")
    p.add_argument("--profile", action="store_true",
                   help="time every step and print a per-op table (op, node, device, calls, total, mean, share) "
                        "and one per op type; the runs' timings then include the profiler's")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome/Perfetto trace (JSON) of the runs' steps to FILE (also when a run fails)")
    p.add_argument("--output", "-o", default=None, metavar="DIR", help="write each output to DIR/NAME.npy")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    p.add_argument("--print-limit", type=int, default=3, metavar="N",
                   help="elements shown at each end of printed outputs (default 3)")


# ------------------------------------------------------------------------------------ inputs

def _pairs(items: list[str], what: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise _usage(f"{what} {item!r}: expected NAME=VALUE")
        out.append((name, value))
    return out


def _usage(message: str) -> PolyhalError:
    from polyhal.frontends.onnx.errors import OnnxInputError

    return OnnxInputError(message)


def read_inputs(specs: list[str]) -> dict[str, np.ndarray]:
    """Arrays from ``--input`` arguments (NAME=FILE.npy, NAME=FILE.npz, FILE.npz)."""
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = None, spec
        if not os.path.isfile(path):
            raise _usage(f"--input {spec}: no such file {path!r}")
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:
            raise _usage(f"--input {spec}: cannot read {path!r} as .npy/.npz: {exc}") from None
        if isinstance(data, np.lib.npyio.NpzFile):
            with data:
                if name is None:
                    feeds.update({k: data[k] for k in data.files})
                elif name in data.files:
                    feeds[name] = data[name]
                elif len(data.files) == 1:
                    feeds[name] = data[data.files[0]]
                else:
                    raise _usage(f"--input {spec}: {path} holds {data.files}, none called {name!r}")
        elif name is None:
            raise _usage(f"--input {spec}: a .npy file needs a name (NAME={path})")
        else:
            feeds[name] = data
    return feeds


def random_input(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A random array: standard normal floats, small non-negative integers, fair bools."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    return rng.integers(0, 10, size=shape).astype(dtype)


# --------------------------------------------------------------------------------------- run

def cmd_run(args: argparse.Namespace, registry) -> int:
    """Load, compile and run the model; print (or write) outputs, timings and placement."""
    from polyhal.frontends.onnx.errors import NeedsValue, OnnxInputError
    from polyhal.frontends.onnx.importer import load, read_model

    try:
        from polyhal.explain import apply_policy_arguments
    except ImportError:
        apply_policy_arguments = None
    if apply_policy_arguments is not None:
        apply_policy_arguments(args, registry)
    elif getattr(args, "device_lead_allocator", None) is not None:
        os.environ["POLYHAL_DEVICE_LEAD_ALLOCATOR"] = str(args.device_lead_allocator)
    if args.repeat < 1:
        raise _usage(f"--repeat must be >= 1, got {args.repeat}")

    t0 = time.perf_counter()
    model, _ = read_model(args.model)
    file_feeds = read_inputs(args.input)
    shapes = {k: tuple(int(d) for d in v.split(",") if d.strip()) for k, v in _pairs(args.shape, "--shape")}
    try:
        dims = {k: int(v) for k, v in _pairs(args.dim, "--dim")}
    except ValueError:
        raise _usage("--dim SYMBOL=SIZE needs an integer size") from None
    shapes.update({k: v.shape for k, v in file_feeds.items()})
    fixed: dict[str, np.ndarray] = {}
    while True:
        try:
            program = load(model, shapes={k: v for k, v in shapes.items() if k not in fixed}, values=fixed,
                           dims=dims, default_dim=1, source=args.model)
            break
        except NeedsValue as exc:
            random_ones = sorted(set(exc.inputs) - set(file_feeds))
            if random_ones:
                raise OnnxInputError(f"{exc}\n(input(s) {', '.join(random_ones)} would be random; give them "
                                     f"with --input NAME=FILE.npy)") from None
            if set(exc.inputs) <= set(fixed):
                raise
            fixed.update({k: file_feeds[k] for k in exc.inputs})
    t_load = time.perf_counter() - t0

    rng = np.random.default_rng(args.seed)
    feeds, sources = {}, {}
    for v in program.inputs:
        if v.name in file_feeds:
            feeds[v.name], sources[v.name] = file_feeds[v.name], "file"
        else:
            feeds[v.name], sources[v.name] = random_input(rng, v.type.shape, v.type.dtype), "random"
    known = set(program.input_names) | set(program.frozen)
    extra = [k for k in file_feeds if k not in known]
    if extra:
        raise OnnxInputError(f"{args.model}: --input {extra[0]!r}: the model has no such input; its inputs are "
                             f"{', '.join(program.input_names + list(program.frozen)) or '(none)'}")
    feeds = program.check_feeds(feeds)

    t0 = time.perf_counter()
    options = {"data_tiling": True} if getattr(args, "data_tiling", False) else {}
    plan = program.compile(args.device, strict=args.strict, registry=registry, **options)
    t_compile = time.perf_counter() - t0

    times = []
    progress = _Progress(args.repeat) if args.repeat > 1 else None
    profiling = args.profile or args.trace
    try:
        with (plan.profiling(trace=args.trace) if profiling
              else contextlib.nullcontext()) as profile:
            for i in range(args.repeat):
                t0 = time.perf_counter()
                outputs = program.execute(plan, feeds)
                times.append(time.perf_counter() - t0)
                if progress:
                    progress.update(i + 1)
    except PolyhalError:
        if args.trace:
            print(f"polyhal: the trace of the steps that ran is in {args.trace}", file=sys.stderr)
        raise
    if progress:
        progress.close()

    if args.output:
        out_dir = Path(args.output)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, value in outputs.items():
            np.save(out_dir / f"{_file_name(name)}.npy", value)
    devices_used = sorted({op.device for op in plan.program.ops if op.kind == "dispatch" and op.device})
    timing = {"load_ms": t_load * 1e3, "compile_ms": t_compile * 1e3, "runs": len(times),
              "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3}
    if args.json:
        report = {
            "model": args.model, "opset": program.opset, "devices": devices_used,
            "requested_devices": args.device or [s.name for s in registry.device_specs()],
            "inputs": [{"name": n, "shape": list(x.shape), "dtype": str(x.dtype), "source": sources[n]}
                       for n, x in feeds.items()]
            + [{"name": n, "shape": list(x.shape), "dtype": str(x.dtype), "source": "file (fixed at import)"}
               for n, x in program.frozen.items()],
            "outputs": [_output_record(n, v) for n, v in outputs.items()],
            "timing": timing,
        }
        if args.output:
            report["output_dir"] = str(args.output)
        if args.explain:
            report["placement"] = _placement_records(program, plan)
            report["explain"] = program.explain(plan)
        if args.profile:
            report["profile"] = {"steps": profile.rows(), "by_op": profile.by_op()}
        if args.trace:
            report["trace"] = str(args.trace)
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
        return 0

    print(f"{args.model}: opset {program.opset}, {program.node_count} nodes -> {len(program.ops)} ops on "
          f"{', '.join(devices_used) or '(none)'}")
    for n, x in feeds.items():
        print(f"  input  {n}: {x.dtype}{list(x.shape)} ({sources[n]})")
    for n, x in program.frozen.items():
        print(f"  input  {n}: {x.dtype}{list(x.shape)} (file, fixed at import)")
    with np.printoptions(threshold=2 * args.print_limit, edgeitems=args.print_limit, precision=5, linewidth=100):
        for n, v in outputs.items():
            print(f"  output {n}: {v.dtype}{list(v.shape)}")
            print("    " + np.array2string(v).replace("\n", "\n    "))
    if args.output:
        print(f"outputs written to {args.output}/")
    if args.explain:
        print(program.explain(plan))
    if args.profile:
        print(profile.table())
    if args.trace:
        print(f"trace of {len(profile.events)} steps written to {args.trace} (open it in https://ui.perfetto.dev)")
    if len(times) > 1:
        print(f"{len(times)} runs: median {timing['median_ms']:.3f} ms, min {timing['min_ms']:.3f} ms, "
              f"max {timing['max_ms']:.3f} ms (load {timing['load_ms']:.1f} ms, compile {timing['compile_ms']:.1f} ms)")
    else:
        print(f"1 run: {timing['median_ms']:.3f} ms (load {timing['load_ms']:.1f} ms, compile "
              f"{timing['compile_ms']:.1f} ms; --repeat N for a timing summary)")
    return 0


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "output"


def _output_record(name: str, v: np.ndarray) -> dict[str, Any]:
    rec: dict[str, Any] = {"name": name, "shape": list(v.shape), "dtype": str(v.dtype)}
    if v.size <= 1024:
        rec["values"] = v.tolist()
    if v.size and v.dtype.kind in "fiub":
        f = v.astype(np.float64)
        finite = f[np.isfinite(f)]
        if finite.size:
            rec.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()))
    return rec


def _placement_records(program, plan) -> list[dict[str, Any]]:
    rows = []
    for op in plan.program.ops:
        if op.kind == "dispatch":
            rows.append({"node": program.origin(op), "op": op.name, "device": op.device})
        else:
            rows.append({"transfer": op.inputs[0].name, "to": op.device, "bytes": op.inputs[0].type.nbytes})
    return rows


class _Progress:
    """A progress bar on stderr (redrawn at most 10 times a second; one line when not a tty)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width = total, width
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.start = time.perf_counter()

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if done < self.total and now - self.last < 0.1:
            return
        self.last = now
        if self.tty or done == self.total:
            filled = math.floor(self.width * done / self.total)
            bar = "#" * filled + "-" * (self.width - filled)
            end = "" if self.tty else "\n"
            print(f"\r[{bar}] {done}/{self.total} runs, {now - self.start:.1f} s", end=end, file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)
