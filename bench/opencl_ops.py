"""OpenCL backend against the array library of the same machine, side by side in one run.

``python -m bench opencl_ops [--device opencl:N] [--quick] [--suffix -h100]``

The anchor: on a GPU with cupy importable, cupy on that GPU; otherwise numpy on the host (on a
CPU OpenCL device such as PoCL numpy is the honest anchor: both use the same cores). Rows:

* 16M-element float32 add (``out=`` given to both sides);
* 4096² float32 matmul (2048² with ``--quick`` on a CPU device, where 4096² takes seconds; the
  row's name says which);
* row softmax of a 4096x1024 float32 matrix (numpy/cupy: the max-shifted exp over its row sum);
* per-step overhead of a plan: a chain of 64 adds of 16 elements, time per run / 64, against
  64 ``add(out=)`` calls of the anchor.

Each plan runs with its inputs already on the device; a sample is ``number`` calls followed by
one wait for the device (queue finish; cupy: device synchronize), polyhal and anchor samples
taken alternately (in blocks on a CPU device, see :func:`_interleaved`) so that clock drift
hits both alike; medians are reported. Every result is checked
against the anchor's before timing, and a wrong one is reported as a failed target.

Targets (the OpenCL issue): on a GPU against cupy, the 4096² matmul at >= 50% of cupy's rate
and the 16M add within 1.3x of cupy; on a CPU device against numpy, the 16M add within 1.5x.
"""

from __future__ import annotations

import os
import statistics
import time
from unittest.mock import patch

import numpy as np

import polyhal
from polyhal.testing.settings import BenchSettings
from bench.harness import DeviceAbsent, Row

CHAIN = 64
SMALL = 16


def _device(args) -> polyhal.Device | None:
    if args.device:
        return polyhal.get_device(args.device)
    specs = [s for s in polyhal.devices() if s.backend == "opencl"]
    return polyhal.get_device(max(specs, key=lambda s: s.rank).name) if specs else None


class _Anchor:
    """numpy, or cupy on the GPU: arrays, the device wait, and the operations timed."""

    def __init__(self, gpu: bool) -> None:
        self.xp, self.name = np, "numpy"
        if gpu:
            try:
                import cupy
            except ImportError:
                cupy = None
            if cupy is not None:
                self.xp, self.name = cupy, "cupy"

    def asarray(self, x: np.ndarray):
        return self.xp.asarray(x)

    def numpy(self, x) -> np.ndarray:
        return x.get() if self.name == "cupy" else np.asarray(x)

    def sync(self) -> None:
        if self.name == "cupy":
            self.xp.cuda.runtime.deviceSynchronize()

    def softmax(self, x, out):
        xp = self.xp
        e = xp.exp(x - x.max(axis=-1, keepdims=True))
        xp.divide(e, e.sum(axis=-1, keepdims=True), out=out)


def _interleaved(ours, theirs, ours_sync, theirs_sync, *, rounds: int, number: int, block: int = 1
                 ) -> tuple[float, float]:
    """Median seconds per call of ``ours`` and ``theirs`` over ``rounds`` samples each, taken in
    blocks of ``block`` samples in the order ours, theirs, theirs, ours, ... (drift hits both
    alike). With ``block`` > 1 each block starts with one extra sample that is dropped: on a CPU
    device the two sides share the cores, and the thread pool one side just used (OpenBLAS,
    PoCL) keeps spinning for a while and slows the other side's first call."""
    for fn, sync in ((ours, ours_sync), (theirs, theirs_sync)):  # warm-up (and first-call builds)
        fn()
        sync()
    samples: tuple[list[float], list[float]] = ([], [])
    sides = ((ours, ours_sync), (theirs, theirs_sync))
    i = 0
    while min(len(samples[0]), len(samples[1])) < rounds:
        side = (0, 1, 1, 0)[i % 4]
        i += 1
        fn, sync = sides[side]
        for j in range(block + (block > 1)):
            sync()
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            sync()
            if j or block == 1:
                samples[side].append((time.perf_counter() - t0) / number)
    return statistics.median(samples[0]), statistics.median(samples[1])


def _matmul_variant(dev, n: int) -> str:
    """Which matmul kernel (polyhal_opencl.ops.linalg) an n² float32 product runs on ``dev``."""
    from polyhal.ir.types import TensorType
    from polyhal_opencl import kernels
    from polyhal_opencl.ops import linalg

    f32 = linalg.ctype("float32", dev.traits)
    chosen = linalg.choose(f32, f32, linalg.Problem(n, n, n, 1, (n, 1), (n, 1)), dev.traits)
    t = TensorType((n, n), "float32")
    fn = kernels.prepare(dev, "matmul", {}, (t, t), (t,))  # built already: a cache hit
    if chosen != "portable" and "#define TS " in fn.recipe.source:
        return f"portable (the {chosen} kernel failed to build)"
    return chosen


def _plan(device: polyhal.Device, name: str, build) -> polyhal.Plan:
    b = polyhal.ProgramBuilder(name)
    build(b)
    return polyhal.compile(b.build(), device.name)


def run(args) -> list[Row]:
    dev = _device(args)
    if dev is None:
        reasons = polyhal.default_registry().unavailable_reasons().get("opencl", ["no OpenCL device"])
        raise DeviceAbsent("no OpenCL device (" + "; ".join(reasons) + ")")
    limits = dev.spec.limits
    kind = limits.get("type", "")
    gpu = kind == "gpu"
    anchor = _Anchor(gpu)
    where = f"{dev.name}: {limits.get('device')} ({limits.get('platform')}, driver {limits.get('driver_version')}, OpenCL {kind})"
    if gpu:
        os.environ.setdefault("POLYHAL_BENCH_GPU", str(limits.get("device")))  # named in the machine line
    print(f"opencl_ops: {where}; anchor {anchor.name}" + (" (cupy not importable)" if gpu and anchor.name == "numpy" else ""))
    quick = bool(args.quick)
    rounds = 5 if quick else 15
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    extra_all = {"device": where}

    def measure(case: str, plan, host_inputs: list[np.ndarray], out_shape, theirs_fn, *, number: int,
                check_rtol: float, check_atol: float, unit: str = "ms", scale: float = 1e3, per: int = 1,
                target: str = "", met_if=None, extra: dict | None = None) -> None:
        ins = [polyhal.asarray(x, device=dev) for x in host_inputs]
        out = polyhal.empty(out_shape, "float32", dev)
        a_ins = [anchor.asarray(x) for x in host_inputs]
        a_out = anchor.xp.empty(out_shape, anchor.xp.float32)

        def ours():
            plan(*ins, out=out)

        def theirs():
            theirs_fn(*a_ins, a_out)

        ours()
        theirs()
        dev.synchronize()
        anchor.sync()
        got, want = out.numpy(), anchor.numpy(a_out)
        err = float(np.max(np.abs(got - want) / (np.abs(want) + check_atol / check_rtol))) if got.size else 0.0
        ok = bool(np.allclose(got, want, rtol=check_rtol, atol=check_atol))
        t_ours, t_theirs = _interleaved(ours, theirs, dev.synchronize, anchor.sync, rounds=rounds, number=number,
                                        block=1 if gpu else max(2, rounds // 2))
        t_ours, t_theirs = t_ours / per, t_theirs / per
        met = None if met_if is None else bool(met_if(t_ours, t_theirs))
        if not ok:
            print(f"opencl_ops: {case}: WRONG RESULT (max relative error {err:.3g}); the row fails its target")
            target, met = (target + "; " if target else "") + "result matches the anchor", False
        rows.append(Row(case, unit, t_ours * scale, t_theirs * scale, anchor.name, target, met,
                        {**extra_all, "max_rel_err": err, "result_ok": ok, **(extra or {})}))

    # 1. 16M-element float32 add.
    n_add = 16 * 1024 * 1024
    plan = _plan(dev, "add16m", lambda p: p.output(p.add(p.input("x", (n_add,)), p.input("y", (n_add,)))))
    x, y = rng.standard_normal(n_add, np.float32), rng.standard_normal(n_add, np.float32)
    if anchor.name == "cupy":
        add_target, add_met = "<= 1.3x cupy", (lambda a, b: a <= 1.3 * b)
    elif gpu:
        add_target, add_met = "<= 1.3x cupy (cupy absent: not evaluated)", None
    else:
        add_target, add_met = "<= 1.5x numpy", (lambda a, b: a <= 1.5 * b)
    measure("16M-element float32 add", plan, [x, y], (n_add,), lambda a, b, o: anchor.xp.add(a, b, out=o),
            number=20 if gpu else 3, check_rtol=1e-6, check_atol=1e-6, target=add_target, met_if=add_met)
    row = rows[-1]
    row.extra["gb_per_s_polyhal"] = 3 * 4 * n_add / (row.polyhal / 1e3) / 1e9
    row.extra["gb_per_s_anchor"] = 3 * 4 * n_add / (row.anchor / 1e3) / 1e9
    del x, y

    # 2. float32 matmul: 4096², or 2048² with --quick on a CPU device.
    n = 2048 if quick and not gpu else 4096
    plan = _plan(dev, "matmul", lambda p: p.output(p.matmul(p.input("a", (n, n)), p.input("b", (n, n)))))
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    case = f"{n}² float32 matmul" + (" (--quick: 2048² on a CPU device)" if n != 4096 else "")
    if anchor.name == "cupy":
        mm_target, mm_met = ">= 50% of cupy's rate", (lambda a_, b_: a_ <= 2.0 * b_)
    elif gpu:
        mm_target, mm_met = ">= 50% of cupy's rate (cupy absent: not evaluated)", None
    else:
        mm_target, mm_met = "", None
    measure(case, plan, [a, b], (n, n), lambda a_, b_, o: anchor.xp.matmul(a_, b_, out=o),
            number=5 if gpu else 1, check_rtol=1e-3, check_atol=1e-2 * np.sqrt(n), target=mm_target, met_if=mm_met)
    row = rows[-1]
    flop = 2.0 * n ** 3
    row.extra.update(tflops_polyhal=flop / (row.polyhal / 1e3) / 1e12, tflops_anchor=flop / (row.anchor / 1e3) / 1e12,
                     rate_vs_anchor=row.anchor / row.polyhal)
    row.extra["variant"] = _matmul_variant(dev, n)
    print(f"opencl_ops: the {n}² matmul ran variant {row.extra['variant']} ({row.extra['tflops_polyhal']:.3g} TFLOP/s, "
          f"{anchor.name} {row.extra['tflops_anchor']:.3g})")
    del a, b

    if gpu and BenchSettings.from_env().opencl_sweep:
        _sweep_blocks(dev, n, anchor, rounds)

    # 3. Row softmax, 4096x1024.
    shape = (4096, 1024)
    plan = _plan(dev, "softmax", lambda p: p.output(p.softmax(p.input("x", shape), axis=-1)))
    sx = rng.standard_normal(shape, np.float32)
    measure("row softmax 4096x1024 float32", plan, [sx], shape, anchor.softmax,
            number=20 if gpu else 3, check_rtol=1e-4, check_atol=1e-7)

    # 4. Per-step overhead: a plan of CHAIN tiny adds, per step.
    def chain(p):
        v, w = p.input("x", (SMALL,)), p.input("y", (SMALL,))
        for _ in range(CHAIN):
            v = p.add(v, w)
        p.output(v)

    plan = _plan(dev, "add_chain", chain)
    xs, ys = rng.standard_normal(SMALL, np.float32), rng.standard_normal(SMALL, np.float32)
    temps = [anchor.xp.empty(SMALL, anchor.xp.float32) for _ in range(CHAIN)]

    def anchor_chain(u, w, o):
        v = u
        for t in temps[:-1]:
            anchor.xp.add(v, w, out=t)
            v = t
        anchor.xp.add(v, w, out=o)

    measure(f"plan per-step overhead ({CHAIN} chained {SMALL}-element adds, per add)", plan, [xs, ys], (SMALL,),
            anchor_chain, number=10, check_rtol=1e-4, check_atol=1e-4, unit="µs", scale=1e6, per=CHAIN,
            extra={"dispatches_per_run": plan.dispatch_count})
    return rows


#: Block shapes (BM,BN,BK,TM,TN) tried by the sweep (POLYHAL_BENCH_OPENCL_SWEEP=1, GPUs only).
SWEEP = ("128,128,8,8,8", "128,128,16,8,8", "128,64,16,8,4", "64,128,16,4,8", "64,64,16,4,4", "128,128,16,4,8")


def _sweep_blocks(dev, n: int, anchor: _Anchor, rounds: int) -> None:
    """Print the n² matmul's time for other GPU block shapes (POLYHAL_OPENCL_GPU_BLOCK), for
    tuning on a new GPU; not rows of the report."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    ins = [polyhal.asarray(a, device=dev), polyhal.asarray(b, device=dev)]
    out = polyhal.empty((n, n), "float32", dev)
    want = a.astype(np.float64) @ b.astype(np.float64)
    print(f"opencl_ops: sweep of GPU block shapes for the {n}² matmul (POLYHAL_OPENCL_GPU_BLOCK):")
    with patch.dict(os.environ):  # restored afterwards
        for block in SWEEP:
            os.environ["POLYHAL_OPENCL_GPU_BLOCK"] = block
            try:
                plan = _plan(dev, "matmul_sweep", lambda p: p.output(p.matmul(p.input("a", (n, n)), p.input("b", (n, n)))))
                plan(*ins, out=out)
                dev.synchronize()
                ok = bool(np.allclose(out.numpy(), want, rtol=1e-3, atol=1e-2 * np.sqrt(n)))
                t, _ = _interleaved(lambda: plan(*ins, out=out), lambda: None, dev.synchronize, lambda: None,
                                    rounds=max(3, rounds // 3), number=5)
                print(f"  {block:>16}: {t * 1e3:8.3f} ms  {2.0 * n ** 3 / t / 1e12:6.2f} TFLOP/s"
                      + ("" if ok else "  WRONG RESULT"))
            except Exception as exc:  # noqa: BLE001 - a shape the device cannot run
                print(f"  {block:>16}: failed ({type(exc).__name__}: {exc})".splitlines()[0])
