"""Tune and break down polyhal-cuda's radix sort on a GPU, in one call: every onesweep tile shape
given, the classic path, cupy.sort; each checked against cupy.sort, then timed as a whole
(median of synchronised samples) and kernel by kernel (events between the launches).

Usage (on the GPU machine, the project installed): ``python plugins/cuda/tools/sort_tune.py
[--n N] [--shape THREADS,ITEMS,MATCH[,HIST_BLOCKS_PER_SM,HIST_PARTS] ...] [--argsort] [--out FILE]``.
Kernel times are medians over 5 runs after the warm-up (the GPU's clock ramps up from idle).
Prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: bench/
from bench.harness import median_time  # noqa: E402


def _time(fn, sync, number=10, repeat=15, warmup=3) -> float:
    """Median seconds per call (the benchmarks' own timing, the device synchronised)."""
    return median_time(fn, repeat=repeat, number=number, warmup=warmup, sync=sync)


def main() -> None:
    import cupy as cp

    import polyhal
    from polyhal.ir.types import TensorType
    from polyhal_cuda import sorting

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 24)
    ap.add_argument("--shape", action="append", default=[])
    ap.add_argument("--argsort", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",") if v) for s in a.shape] or [()]  # "": the defaults
    dev = next(polyhal.get_device(s.name) for s in polyhal.devices() if s.backend == "cuda")
    sync = cp.cuda.runtime.deviceSynchronize
    n = a.n
    rng = np.random.default_rng(1)
    xh = rng.standard_normal(n).astype(np.float32)
    tt, it = TensorType((n,), np.float32), TensorType((n,), np.int64)
    results = []
    with cp.cuda.Device(dev.ordinal):
        cx = cp.asarray(xh)
        ref = cp.sort(cx)
        ref_idx = cp.argsort(cx) if a.argsort else None
        t_cupy = _time(lambda: cp.sort(cx), sync)
        results.append({"case": "cupy.sort", "ms": t_cupy * 1e3})
        if a.argsort:
            results.append({"case": "cupy.argsort", "ms": _time(lambda: cp.argsort(cx), sync, number=5) * 1e3})
        events: list = []
        real_launch = dev.launch

        def traced(kernel, name, grid, block, args, shared_mem=0):
            ev = cp.cuda.Event()
            ev.record(dev.stream)
            events.append((name, ev))
            real_launch(kernel, name, grid, block, args, shared_mem)

        hist0 = (sorting.HISTOGRAM_BLOCKS_PER_SM, sorting.HISTOGRAM_PARTS)
        shapes0 = dict(sorting.ONESWEEP_SHAPES)
        variants = [("classic", None)] + [("onesweep", s) for s in shapes]
        for impl, shape in variants:
            sorting.RADIX_IMPL = impl
            for op in ("sort", "argsort") if a.argsort else ("sort",):
                label = impl
                if shape is not None:  # () = the defaults; else the shape of this op's plan
                    sorting.ONESWEEP_SHAPES.update(shapes0)
                    if shape:
                        sorting.ONESWEEP_SHAPES[4, op == "argsort"] = shape[:3]
                    sorting.HISTOGRAM_BLOCKS_PER_SM, sorting.HISTOGRAM_PARTS = shape[3:5] if len(shape) >= 5 else hist0
                    label += (f" {sorting.ONESWEEP_SHAPES[4, op == 'argsort']} hist {sorting.HISTOGRAM_BLOCKS_PER_SM}/SM"
                              f" x{sorting.HISTOGRAM_PARTS}")
                try:
                    types = ((tt,), (it if op == "argsort" else tt,))
                    dev.launch = traced
                    traced_fn = dev.prepare(op, {"axis": 0}, *types)
                    dev.launch = real_launch
                    fn = dev.prepare(op, {"axis": 0}, *types)
                    out = cp.empty(n, cp.int64 if op == "argsort" else cp.float32)
                    out.fill(7)
                    traced_fn(cx, out)
                    sync()
                    ok = bool((out == (ref_idx if op == "argsort" else ref)).all())
                    for _ in range(5):  # warm the clock
                        traced_fn(cx, out)
                    runs = []
                    for _ in range(5):
                        events.clear()
                        traced_fn(cx, out)
                        end = cp.cuda.Event()
                        end.record(dev.stream)
                        sync()
                        marks = [ev for _, ev in events] + [end]
                        runs.append([cp.cuda.get_elapsed_time(marks[i], marks[i + 1]) for i in range(len(events))])
                    err = getattr(traced_fn.inner, "error_flag", None)
                    if err is not None:
                        mem = cp.cuda.UnownedMemory(err, 4, traced_fn)
                        ok = ok and int(cp.ndarray((1,), cp.uint32, cp.cuda.MemoryPointer(mem, 0))[0]) == 0
                    parts = [(events[i][0].split("<")[0], statistics.median(r[i] for r in runs))
                             for i in range(len(events))]
                    fn(cx, out)
                    sync()
                    ok = ok and bool((out == (ref_idx if op == "argsort" else ref)).all())
                    t = _time(lambda: fn(cx, out), sync, number=5 if op == "argsort" else 10)
                    results.append({"case": f"{op} {label}", "ms": t * 1e3, "ok": ok, "ratio": t / t_cupy,
                                    "parts": [(k, round(v, 4)) for k, v in parts]})
                except Exception as exc:  # keep going: one broken variant must not hide the others
                    dev.launch = real_launch
                    results.append({"case": f"{op} {label}", "error": repr(exc)[:400]})
                print(json.dumps(results[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'case':52s} {'ms':>8s} {'x cupy':>7s} ok")
    for r in results:
        print(f"{r['case']:52s} {r.get('ms', float('nan')):8.4f} {r.get('ratio', float('nan')):7.3f} "
              f"{r.get('ok', r.get('error', ''))}")


if __name__ == "__main__":
    main()
