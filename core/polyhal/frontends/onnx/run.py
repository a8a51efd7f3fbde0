"""``polyhal run MODEL.onnx``: run an ONNX model on the installed devices.

::

    polyhal run examples/mlp.onnx                                 # random inputs, CPU default
    polyhal run model.onnx --input x=x.npy --device opencl:0 --device cpu:0 --explain
    polyhal run model.onnx --input inputs.npz --repeat 100 --output out/ --json
    polyhal run model.onnx --repeat 20 --profile --trace run.json   # per-op table, Perfetto trace

Inputs come from ``--input NAME=FILE.npy`` (or ``NAME=FILE.npz``, its only array or the one
called NAME), ``--input FILE.npz`` (every array, by name), or are drawn at random from the
model's declared types (symbolic dims from ``--dim SYMBOL=SIZE`` or ``--shape NAME=D0,D1``,
else 1, which the output says). Inputs that decide shapes (a Reshape's shape fed as an input, ...) are fixed to the
values read from files. ``--device`` is the ordered device list (as IREE's ``--device``): each
op runs on the first that has its kernel, others taking what it lacks unless ``--strict``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import secrets
import stat
import statistics
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from polyhal.errors import PolyhalError
from polyhal.explain import add_policy_arguments, apply_policy_arguments, printable
from polyhal.frontends.onnx.errors import NeedsValue, OnnxInputError
from polyhal.frontends.onnx.importer import load, read_model
from polyhal.frontends.onnx.proto import np_dtype_of, pb
from polyhal.frontends.onnx.settings import OnnxSettings
from polyhal.frontends.onnx.staged import StagedOnnxProgram
from polyhal.frontends.onnx.types import STRING_DTYPE
from polyhal.hal.device import host_memory_available
from polyhal.progress import shown


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
    add_policy_arguments(p)
    p.add_argument("--data-tiling", action="store_true", default=None,
                   help="compile with data-tiling encodings for matmuls too (conv feature maps always have them)")
    p.add_argument("--precision", default=None, metavar="P",
                   help="how float32 work may compute: fp32 (float32, no TF32), tf32 (float32 contractions on TF32 "
                        "tensor cores), fp16 (float16 where safe, float32 accumulation); default POLYHAL_PRECISION, "
                        "else fp32")
    p.add_argument("--no-fuse", dest="fuse", action="store_false",
                   help="compile without the fusion passes (attention, linear)")
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


def _sizes(text: str, what: str, one: bool = False) -> tuple[int, ...]:
    """``"4,8"`` -> (4, 8); OnnxInputError for anything but non-negative integers."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not all(p.isdigit() for p in parts) or (one and len(parts) != 1):
        raise _usage(f"{what}: expected {'a size' if one else 'sizes'} as non-negative integer(s)"
                     f"{'' if one else ' separated by commas (e.g. 4,128)'}")
    return tuple(int(p) for p in parts)


def _usage(message: str) -> PolyhalError:
    return OnnxInputError(message)


#: ``POLYHAL_INPUT_LIMIT``: the most bytes the ``--input`` files may expand to in all (e.g.
#: ``8GiB``); by default the host's available memory, or the process's memory limit where that
#: is smaller (``ulimit -v``).
INPUT_LIMIT_VARIABLE = "POLYHAL_INPUT_LIMIT"


def read_inputs(specs: list[str]) -> dict[str, np.ndarray]:
    """Arrays from ``--input`` arguments (NAME=FILE.npy, NAME=FILE.npz, FILE.npz).

    Each file's sizes are checked before anything is decompressed or allocated (see
    :func:`input_nbytes`): the arrays of all of them together must fit the input limit
    (:data:`INPUT_LIMIT_VARIABLE`), so that a small .npz that expands to gigabytes is refused
    in a line instead of exhausting memory."""
    feeds: dict[str, np.ndarray] = {}
    limit, total = _input_limit(), 0
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = None, spec
        if not os.path.isfile(path):
            raise _usage(f"--input {spec}: no such file {path!r}")
        total += input_nbytes(path, spec)
        if limit is not None and total > limit:
            raise _usage(f"--input {spec}: the input files expand to {total} bytes, more than the input limit of "
                         f"{limit} bytes ({_limit_source()}); set {INPUT_LIMIT_VARIABLE} (e.g. 8GiB) if they "
                         "are meant to be that large")
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError, MemoryError, zipfile.BadZipFile) as exc:
            raise _usage(f"--input {spec}: cannot read {path!r} as .npy/.npz: {exc}") from None
        if isinstance(data, np.lib.npyio.NpzFile):
            try:
                with data:
                    if name is None:
                        feeds.update({k: data[k] for k in data.files})
                    elif name in data.files:
                        feeds[name] = data[name]
                    elif len(data.files) == 1:
                        feeds[name] = data[data.files[0]]
                    else:
                        raise _usage(f"--input {spec}: {path} holds {data.files}, none called {name!r}")
            except (OSError, ValueError, EOFError, MemoryError, zipfile.BadZipFile) as exc:  # a corrupt member
                raise _usage(f"--input {spec}: cannot read {path!r} as .npz: {exc}") from None
        elif name is None:
            raise _usage(f"--input {spec}: a .npy file needs a name (NAME={path})")
        else:
            feeds[name] = data
    return feeds


def input_nbytes(path: str, spec: str = "") -> int:
    """The bytes that ``np.load(path)`` would allocate, read from the file's declared sizes
    without decompressing or allocating anything: a .npz's members' uncompressed sizes as its zip
    directory declares them (Python's zipfile never inflates a member past that), a .npy's
    header shape times item size. A header that declares more data than its file (or zip member)
    holds is refused: numpy would allocate what the header says before finding the data short."""
    what = f"--input {spec or path}"
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
            if magic[:4] not in (b"PK\x03\x04", b"PK\x05\x06") and magic != np.lib.format.MAGIC_PREFIX:
                raise _usage(f"{what}: {printable(path)} is not a .npy or .npz file (it does not start as NumPy's "
                             "files do); write inputs with numpy.save('x.npy', array) or numpy.savez")
            if magic[:4] in (b"PK\x03\x04", b"PK\x05\x06"):  # a zip: what np.load takes as .npz
                f.seek(0)
                with zipfile.ZipFile(f) as zf:
                    total = 0
                    for info in zf.infolist():
                        total += info.file_size
                        if info.filename.endswith(".npy"):
                            with zf.open(info) as member:
                                _npy_data_nbytes(member, info.file_size, f"{what}: member {info.filename!r}")
                    return total
            f.seek(0)
            return _npy_data_nbytes(f, os.fstat(f.fileno()).st_size, what)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        if isinstance(exc, OnnxInputError):
            raise
        raise _usage(f"{what}: cannot read {path!r} as .npy/.npz: {exc}") from None


def _npy_data_nbytes(f, size: int, what: str) -> int:
    """The data bytes that the .npy header at the start of ``f`` declares, checked against the
    ``size`` bytes the file holds in all."""
    version = np.lib.format.read_magic(f)
    # Version 3.0 differs from 2.0 only in the header's text encoding (UTF-8 field names), which
    # changes no shape or item size.
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _fortran, dtype = read_header(f)
    nbytes = math.prod(shape) * dtype.itemsize
    held = size - f.tell()
    if not dtype.hasobject and nbytes > held:
        raise _usage(f"{what}: its header declares a {dtype}{list(shape)} array of {nbytes} bytes, but only {held} "
                     "bytes of data follow it; the file is truncated or forged")
    return nbytes


def _input_limit() -> int | None:
    """The input limit in bytes (see :data:`INPUT_LIMIT_VARIABLE`); None when it is unknown."""
    limit = OnnxSettings.from_env().input_limit
    return _memory_for_inputs() if limit is None else limit


def _memory_for_inputs() -> int | None:
    """The host's available memory, or less where the process's address space or data segment
    is limited (``ulimit -v`` / ``-d``): what the arrays can take at most."""
    limits = [host_memory_available()]
    try:
        import resource

        limits += [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, resource.RLIMIT_DATA)]
        limits = [n for n in limits if n != resource.RLIM_INFINITY]
    except (ImportError, OSError, ValueError):  # no resource module (Windows)
        pass
    known = [n for n in limits if n is not None]
    return min(known) if known else None


def _limit_source() -> str:
    return (INPUT_LIMIT_VARIABLE if OnnxSettings.from_env().input_limit is not None
            else f"the memory this process may use; {INPUT_LIMIT_VARIABLE} sets another")


#: Elements drawn per step by :func:`random_input`: its temporaries stay a few MiB at any size.
RANDOM_CHUNK = 1 << 20


def random_input(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A random array: standard normal floats, small non-negative integers, fair bools.

    Drawn straight into an array of ``dtype``, :data:`RANDOM_CHUNK` elements at a time, so no
    float64 copy of the whole input is ever made.
    """
    dtype = np.dtype(dtype)
    out = np.empty(shape, dtype)
    flat = out.reshape(-1)
    for start in range(0, flat.size, RANDOM_CHUNK):
        part = flat[start: start + RANDOM_CHUNK]
        if dtype.kind == "f":
            if dtype in (np.float32, np.float64):
                rng.standard_normal(part.size, dtype=dtype, out=part)
            else:
                part[...] = rng.standard_normal(part.size, dtype=np.float32)
        elif dtype.kind == "b":
            part[...] = rng.random(part.size, dtype=np.float32) < 0.5
        else:
            part[...] = rng.integers(0, 10, size=part.size, dtype=np.int64 if dtype.kind == "i" else np.uint64)
    return out


def check_input_memory(program, file_feeds: dict, registry, devices: list[str] | None) -> None:
    """Refuse random inputs that the host, or the first device they would go to, cannot hold."""
    random = [(n, shape, dtype) for n, shape, dtype in program.feed_types() if n not in file_feeds]
    random_bytes = sum(int(np.prod(shape)) * dtype.itemsize for _, shape, dtype in random)
    if not random_bytes:
        return
    names = devices or [s.name for s in registry.device_specs()][:1]
    places = [("the host", host_memory_available())]
    places += [(n, registry.get_device(n).memory_available()) for n in names[:1]]
    for where, available in places:
        if available is not None and random_bytes > available:
            shapes = ", ".join(f"{n} {dtype}{list(shape)}" for n, shape, dtype in random)
            raise _usage(f"the random inputs ({shapes}) take {random_bytes} bytes, more than {where} has "
                         f"available ({available} bytes); use smaller --dim/--shape values")


def default_dims(model, shapes: dict, dims: dict) -> list[dict[str, Any]]:
    """The dynamic dims of ``model``'s inputs that neither ``shapes`` (from --shape and --input
    files) nor ``dims`` (--dim) size, so that the run draws them at :data:`DEFAULT_DIM`: one
    record per named symbol (``{"dim": "batch", "size": 1}``), one per unnamed dim
    (``{"dim": "x[0]", ...}``)."""
    initialized = {t.name for t in model.graph.initializer}
    sized = {d.dim_param for vi in model.graph.input if vi.name in shapes
             for d in vi.type.tensor_type.shape.dim if d.dim_param}  # the importer takes these from shapes
    out: dict[str, dict[str, Any]] = {}
    for vi in model.graph.input:
        if vi.name in initialized or vi.name in shapes or vi.type.WhichOneof("value") != "tensor_type":
            continue
        for axis, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value") or d.dim_param in dims or d.dim_param in sized:
                continue
            name = d.dim_param or f"{vi.name}[{axis}]"
            out.setdefault(name, {"dim": name, "size": DEFAULT_DIM})
    return list(out.values())


#: The size ``polyhal run`` gives a dynamic dim that no option sizes: 1, the batch of one that
#: every model with a batch dim accepts.
DEFAULT_DIM = 1


# --------------------------------------------------------------------------------------- run

def _print_outputs(outputs: dict, print_limit: int) -> None:
    """Each output's type and values, ``print_limit`` elements at each end: tensors, sequences
    (a staged model's) element by element, and empty optionals."""
    with np.printoptions(threshold=2 * print_limit, edgeitems=print_limit, precision=5, linewidth=100):
        for n, v in outputs.items():
            if v is None:
                print(f"  output {printable(n)}: optional, empty")
            elif isinstance(v, list):
                print(f"  output {printable(n)}: sequence of {len(v)} tensors")
                for i, e in enumerate(v):
                    print(f"    [{i}] {np.asarray(e).dtype}{list(np.shape(e))}: "
                          + np.array2string(np.asarray(e)).replace("\n", "\n      "))
            else:
                v = np.asarray(v)
                print(f"  output {printable(n)}: {v.dtype}{list(v.shape)}")
                print("    " + np.array2string(v).replace("\n", "\n    "))


def cmd_run(args: argparse.Namespace, registry) -> int:
    """Load, compile and run the model; print (or write) outputs, timings and placement."""
    apply_policy_arguments(args, registry)
    if args.repeat < 1:
        raise _usage(f"--repeat must be >= 1, got {args.repeat}")

    if args.output:  # before the work: an unwritable --output should not cost a run
        os.close(_open_output_dir(args.output))
    if args.print_limit < 0:
        raise _usage(f"--print-limit must be >= 0 (elements shown at each end of an output), got {args.print_limit}")
    if args.trace:
        check_trace_path(args.trace)

    t0 = time.perf_counter()
    model, _ = read_model(args.model)
    file_feeds = read_inputs(args.input)
    shapes = {k: _sizes(v, f"--shape {k}={v}") for k, v in _pairs(args.shape, "--shape")}
    dims = {k: _sizes(v, f"--dim {k}={v}", one=True)[0] for k, v in _pairs(args.dim, "--dim")}
    shapes.update({k: v.shape for k, v in file_feeds.items()})
    fixed: dict[str, np.ndarray] = {}
    while True:
        try:
            program = load(model, shapes={k: v for k, v in shapes.items() if k not in fixed}, values=fixed,
                           dims=dims, default_dim=DEFAULT_DIM, source=args.model)
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
    if isinstance(program, StagedOnnxProgram):  # control flow or sequences decided by data
        return _run_staged(args, model, program, file_feeds, shapes, dims, registry, t_load)
    defaulted = default_dims(model, shapes, dims)

    check_input_memory(program, file_feeds, registry, args.device)
    rng = np.random.default_rng(args.seed)
    feeds, sources = {}, {}
    for name, shape, dtype in program.feed_types():
        if name in file_feeds:
            feeds[name], sources[name] = file_feeds[name], "file"
        elif dtype == STRING_DTYPE:  # no random text means anything to a model's vocabulary
            raise OnnxInputError(f"{args.model}: input {name!r} ({program.declared_inputs.get(name)}) holds "
                                 f"strings, which polyhal run cannot draw at random; give it with --input "
                                 f"{name}=FILE.npy (np.save('FILE.npy', np.array([...], dtype=str)))")
        else:
            feeds[name], sources[name] = random_input(rng, shape, dtype), "random"
    known = set(program.input_names) | set(program.frozen)
    extra = [k for k in file_feeds if k not in known]
    if extra:
        raise OnnxInputError(f"{args.model}: --input {extra[0]!r}: the model has no such input; its inputs are "
                             f"{', '.join(program.input_names + list(program.frozen)) or '(none)'}")
    feeds = program.check_feeds(feeds)

    t0 = time.perf_counter()
    plan = program.compile(args.device, strict=args.strict, registry=registry, **_compile_options(args))
    t_compile = time.perf_counter() - t0

    profiling = args.profile or args.trace
    try:
        with (plan.profiling(trace=args.trace) if profiling
              else contextlib.nullcontext()) as profile:
            outputs, times = _run_repeatedly(program, plan, feeds, args.repeat)
    except PolyhalError:
        if args.trace:
            print(f"polyhal: the trace of the steps that ran is in {args.trace}", file=sys.stderr)
        raise

    if args.output:
        write_outputs(args.output, outputs)
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
            "default_dims": defaulted,
            "outputs": [_output_record(n, v) for n, v in outputs.items()],
            "timing": timing,
        }
        if args.output:
            report["output_dir"] = str(args.output)
        if args.explain:
            report["placement"] = _placement_records(program, plan)
            report["explain"] = program.explain(plan)
        if args.profile:
            report["profile"] = {"steps": profile.rows(), "by_op": profile.by_op(),
                                 "passes": [dataclasses.asdict(r) for r in _pass_records(plan)]}
        if args.trace:
            report["trace"] = str(args.trace)
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
        return 0

    print(f"{args.model}: opset {program.opset}, {program.node_count} nodes -> {len(program.ops)} ops on "
          f"{', '.join(devices_used) or '(none)'}")
    for n, x in feeds.items():
        print(f"  input  {printable(n)}: {x.dtype}{list(x.shape)} ({sources[n]})")
    for n, x in program.frozen.items():
        print(f"  input  {printable(n)}: {x.dtype}{list(x.shape)} (file, fixed at import)")
    for d in defaulted:
        print(f"  dim    {printable(d['dim'])} = {d['size']} (default; give --dim/--shape to change it)")
    _print_outputs(outputs, args.print_limit)
    if args.output:
        print(f"outputs written to {args.output}/")
    if args.explain:
        print(printable(program.explain(plan)))
    if args.profile:
        print(printable(profile.table()))
        records = _pass_records(plan)
        if records:
            print(f"compile passes ({sum(r.seconds for r in records) * 1e3:.1f} ms):")
            for r in records:
                print(f"  {r.explain()}")
    if args.trace:
        print(f"trace of {len(profile.events)} steps written to {args.trace} (open it in https://ui.perfetto.dev)")
    if len(times) > 1:
        print(f"{len(times)} runs: median {timing['median_ms']:.3f} ms, min {timing['min_ms']:.3f} ms, "
              f"max {timing['max_ms']:.3f} ms (load {timing['load_ms']:.1f} ms, compile {timing['compile_ms']:.1f} ms)")
    else:
        print(f"1 run: {timing['median_ms']:.3f} ms (load {timing['load_ms']:.1f} ms, compile "
              f"{timing['compile_ms']:.1f} ms; --repeat N for a timing summary)")
    return 0


def _run_staged(args, model, program: StagedOnnxProgram, file_feeds: dict, shapes: dict, dims: dict, registry,
                t_load: float) -> int:
    """``polyhal run`` of a model that runs staged (device plans joined by host control flow):
    inputs from files or drawn at random (dynamic dims from --shape/--dim, else 1), the plan
    run ``--repeat`` times, tensor outputs printed or saved; sequences and optionals print as
    such. Per-step profiles cover single plans, so --profile/--trace are refused here."""
    if args.profile or args.trace:
        raise _usage(f"{args.model}: the model runs staged (device plans joined by host control flow: an If or "
                     "Loop decided by data, data-dependent shapes, sequences or optionals); --profile and --trace "
                     "time the steps of one plan and are not available for it (--explain shows the segments)")
    extra = [k for k in file_feeds if k not in program.input_names]
    if extra:
        raise OnnxInputError(f"{args.model}: --input {extra[0]!r}: the model has no such input; its inputs are "
                             f"{', '.join(program.input_names) or '(none)'}")
    rng = np.random.default_rng(args.seed)
    feeds, sources, defaulted = {}, {}, []
    declared = {vi.name: vi for vi in model.graph.input}
    for name in program.input_names:
        if name in file_feeds:
            feeds[name], sources[name] = file_feeds[name], "file"
            continue
        tensor = declared[name].type.tensor_type if declared[name].type.WhichOneof("value") == "tensor_type" \
            else None
        if tensor is None or not tensor.elem_type or tensor.elem_type == pb.TensorProto.STRING:
            raise OnnxInputError(f"{args.model}: input {name!r} ({program.declared_inputs[name]}) is not a tensor "
                                 "of numbers, which polyhal run cannot draw at random; give it with --input "
                                 f"{name}=FILE.npy, or run the model from Python (polyhal.onnx.load(path).run(...))")
        shape = shapes.get(name)
        if shape is None:
            shape = []
            for axis, d in enumerate(tensor.shape.dim):
                if d.HasField("dim_value"):
                    shape.append(d.dim_value)
                    continue
                size = dims.get(d.dim_param, DEFAULT_DIM)
                if d.dim_param not in dims:
                    defaulted.append({"dim": d.dim_param or f"{name}[{axis}]", "size": size})
                shape.append(size)
        feeds[name] = random_input(rng, tuple(shape), np_dtype_of(tensor.elem_type))
        sources[name] = "random"
    feeds = program.check_feeds(feeds)
    t0 = time.perf_counter()
    plan = program.compile(args.device, strict=args.strict, registry=registry, **_compile_options(args))
    t_compile = time.perf_counter() - t0
    outputs, times = _run_repeatedly(program, plan, feeds, args.repeat)
    flat = {}  # tensors by file name: a sequence's elements as NAME.0, NAME.1, ...
    for name, value in outputs.items():
        if isinstance(value, list):
            flat.update((f"{name}.{i}", np.asarray(v)) for i, v in enumerate(value))
        elif value is not None:
            flat[name] = np.asarray(value)
    if args.output:
        write_outputs(args.output, flat)
    timing = {"load_ms": t_load * 1e3, "compile_ms": t_compile * 1e3, "runs": len(times),
              "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3}
    if args.json:
        report = {"model": args.model, "opset": program.opset, "staged": True,
                  "requested_devices": args.device or [s.name for s in registry.device_specs()],
                  "inputs": [{"name": n, "shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype),
                              "source": sources[n]} for n, x in feeds.items()],
                  "default_dims": defaulted,
                  "outputs": [dict(_output_record(n, v), kind=_kind(outputs.get(n.rsplit(".", 1)[0], v)))
                              for n, v in flat.items()]
                  + [{"name": n, "kind": "optional", "value": None} for n, v in outputs.items() if v is None],
                  "timing": timing}
        if args.output:
            report["output_dir"] = str(args.output)
        if args.explain:
            report["explain"] = program.explain(plan)
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
        return 0
    print(f"{args.model}: opset {program.opset}, staged (device plans joined by host control flow)")
    for n, x in feeds.items():
        print(f"  input  {printable(n)}: {np.asarray(x).dtype}{list(np.shape(x))} ({sources[n]})")
    for d in defaulted:
        print(f"  dim    {printable(d['dim'])} = {d['size']} (default; give --dim/--shape to change it)")
    _print_outputs(outputs, args.print_limit)
    if args.output:
        print(f"outputs written to {args.output}/")
    if args.explain:
        print(printable(program.explain(plan)))
    print(f"{len(times)} run(s): median {timing['median_ms']:.3f} ms (load {timing['load_ms']:.1f} ms, first "
          f"segment compiles {timing['compile_ms']:.1f} ms; segments compile on first use)")
    return 0


def _compile_options(args: argparse.Namespace) -> dict[str, Any]:
    """The compile options ``polyhal run``'s flags give (static and staged models alike)."""
    return {"data_tiling": getattr(args, "data_tiling", None), "fuse": getattr(args, "fuse", True),
            "precision": getattr(args, "precision", None)}


def _run_repeatedly(program, plan, feeds: dict, repeat: int) -> tuple[dict, list[float]]:
    """The last run's outputs and the seconds of each of ``repeat`` runs (a progress line on a
    terminal for more than one)."""
    times = []
    progress = _Progress(repeat) if repeat > 1 else None
    for i in range(repeat):
        t0 = time.perf_counter()
        outputs = program.execute(plan, feeds)
        times.append(time.perf_counter() - t0)
        if progress:
            progress.update(i + 1)
    if progress:
        progress.close()
    return outputs, times


# ------------------------------------------------------------------------------------ output

def _open_output_dir(path: str) -> int:
    """Create the ``--output`` folder (and its parents) and open it; a usage error where it cannot
    be, is not writable, or where a component of the path is a symbolic link that another user
    (not root) owns: such a link, planted in a shared folder, would send the outputs anywhere."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _usage(f"--output {path}: cannot create the directory ({exc.strerror or exc})") from None
    prefix = Path(os.getcwd(), path)  # as given: ".." must be resolved by the kernel, through the links
    for depth in range(1, len(prefix.parts) + 1):
        try:
            info = os.lstat(Path(*prefix.parts[:depth]))
        except OSError as exc:
            raise _usage(f"--output {path}: cannot inspect it ({exc.strerror or exc})") from None
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (os.getuid(), 0):
            raise _usage(f"--output {path}: {printable(str(Path(*prefix.parts[:depth])))} is a symbolic link owned "
                         f"by another user (uid {info.st_uid}), which polyhal does not write through; choose a folder "
                         "you own")
    if not os.access(path, os.W_OK):
        raise _usage(f"--output {path}: the directory is not writable")
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def check_trace_path(path: str) -> None:
    """A usage error, before any work, where ``--trace`` cannot be written: its folder missing or
    not writable, the path a folder, or a symbolic link (not written through, as ``--output``)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.islink(path):
        raise _usage(f"--trace {printable(path)}: the path is a symbolic link, which polyhal does not write "
                     "through; remove it or choose another file")
    if os.path.isdir(path):
        raise _usage(f"--trace {printable(path)}: the path is a folder; give a file name (e.g. run.json)")
    if not os.path.isdir(folder):
        raise _usage(f"--trace {printable(path)}: no such folder {printable(folder)}; create it first")
    if not os.access(folder, os.W_OK):
        raise _usage(f"--trace {printable(path)}: the folder {printable(folder)} is not writable")


def write_outputs(path: str, arrays: dict[str, Any]) -> None:
    """Save each array as ``path/NAME.npy`` (string tensors as numpy ``str``, readable without
    pickle). Each file is written to a fresh name (``O_EXCL | O_NOFOLLOW``) in the opened folder
    and renamed over ``NAME.npy``, so neither a symbolic link nor a hard link planted there is
    written through; a symbolic link at ``NAME.npy`` is refused."""
    folder = _open_output_dir(path)
    try:
        for name, value in arrays.items():
            value = np.asarray(value)
            if value.dtype == STRING_DTYPE:
                value = value.astype(np.str_)
            file = f"{_file_name(name)}.npy"
            try:
                if stat.S_ISLNK(os.lstat(file, dir_fd=folder).st_mode):
                    raise _usage(f"--output {path}: {file} is a symbolic link, which polyhal does not write "
                                 "through; remove it or choose another folder")
            except FileNotFoundError:
                pass
            temporary = f".{file}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=folder)
                with os.fdopen(fd, "wb") as f:
                    np.save(f, value)
                os.replace(temporary, file, src_dir_fd=folder, dst_dir_fd=folder)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=folder)
                raise _usage(f"--output {path}: cannot write {name!r}: {exc.strerror or exc}") from None
    finally:
        os.close(folder)


def _kind(value: Any) -> str:
    return "sequence" if isinstance(value, list) else "tensor"


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
    labels = program.node_labels(plan)
    for op in plan.program.ops:
        if op.kind == "dispatch":
            rows.append({"node": labels.get(op.outputs[0].id, "(import)"), "op": op.name, "device": op.device})
        else:
            rows.append({"transfer": op.inputs[0].name, "to": op.device, "bytes": op.inputs[0].type.nbytes})
    return rows


class _Progress:
    """A progress bar on stderr where progress is shown (a terminal, ``polyhal -v``, not ``-q``;
    :func:`polyhal.progress.shown`), redrawn at most 10 times a second; one line at the end
    where stderr is no terminal but progress was asked for (``POLYHAL_PROGRESS=1``)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width = total, width
        self.shown = shown()
        self.tty = self.shown and sys.stderr.isatty()
        self.last = 0.0
        self.start = time.perf_counter()

    def update(self, done: int) -> None:
        if not self.shown:
            return
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


def _pass_records(plan: Any) -> list:
    """The compile pipeline's records of ``plan`` (each pass's time and what it changed); none for
    a plan compiled per input shape (dynamic dims), which compiles at run time."""
    compilation = getattr(plan, "compilation", None)
    return list(compilation.records) if compilation is not None else []
