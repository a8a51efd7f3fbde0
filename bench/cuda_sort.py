"""Sorting on a GPU: polyhal's CUDA C sort (LSD radix / per-lane bitonic) against cupy.sort.

Targets: a 16M-element float32 sort within 1.2x of cupy.sort; a per-row sort of 65536 x 256
float32 faster than cupy.sort(axis=-1). Both sides produce the same sorted values (checked).
Also reported: argsort of 16M against cupy.argsort and torch.sort.
"""

from __future__ import annotations

import numpy as np

import polyhal
from bench.cuda_common import cuda_device, gpu_time
from bench.harness import Row


def _plan(dev, op, shape, **attrs):
    b = polyhal.ProgramBuilder(op)
    x = b.input("x", shape)
    b.output(b.op(op, x, **attrs))
    return polyhal.compile(b.build(), dev.name)


def run(args) -> list[Row]:
    dev = cuda_device(args)  # first: no GPU is DeviceAbsent, before the GPU libraries are imported
    import cupy as cp

    rows: list[Row] = []
    reps = 5 if args.quick else 15
    rng = np.random.default_rng(0)
    with cp.cuda.Device(dev.ordinal):
        # 1-D sort of 16M float32
        n = 1 << 24
        xh = rng.standard_normal(n).astype(np.float32)
        x = polyhal.asarray(xh, device=dev)
        out = polyhal.empty((n,), "float32", dev)
        plan = _plan(dev, "sort", (n,), axis=0)
        plan(x, out=out)
        cx = cp.asarray(xh)
        assert bool((out.native == cp.sort(cx)).all()), "sort differs from cupy.sort"
        from polyhal.ir.types import TensorType

        tt = TensorType((n,), np.float32)
        kernel = dev.prepare("sort", {"axis": 0}, (tt,), (tt,))  # the kernel alone, no plan call
        xn, on = x.native, out.native
        t_plan = gpu_time(lambda: plan(x, out=out), number=10, repeat=reps)
        t_kernel = gpu_time(lambda: kernel(xn, on), number=10, repeat=reps)
        t_cupy = gpu_time(lambda: cp.sort(cx), number=10, repeat=reps)
        rows.append(Row("sort 16M float32", "ms", t_plan * 1e3, t_cupy * 1e3, "cupy.sort", "<= 1.2x",
                        t_plan <= 1.2 * t_cupy, {"kernel_only_ms": t_kernel * 1e3,
                                                 "path": kernel.inner.plan.path, "radix": kernel.inner.plan.impl}))
        # the same sort through the other radix implementation, for comparison
        from polyhal_cuda import sorting

        other = "onesweep" if sorting.RADIX_IMPL == "classic" else "classic"
        old_impl, sorting.RADIX_IMPL = sorting.RADIX_IMPL, other
        try:
            alt = dev.prepare("sort", {"axis": 0}, (tt,), (tt,))
        finally:
            sorting.RADIX_IMPL = old_impl
        alt(xn, on)
        assert bool((on == cp.sort(cx)).all()), f"{other} sort differs from cupy.sort"
        t_alt = gpu_time(lambda: alt(xn, on), number=10, repeat=reps)
        rows.append(Row(f"sort 16M float32, {other} radix, kernels only", "ms", t_alt * 1e3, t_cupy * 1e3,
                        "cupy.sort"))
        # the classic radix with warp-aggregated digit counting flipped, for comparison
        old_agg, sorting.AGGREGATE = sorting.AGGREGATE, not sorting.AGGREGATE
        old_impl, sorting.RADIX_IMPL = sorting.RADIX_IMPL, "classic"
        try:
            flip = dev.prepare("sort", {"axis": 0}, (tt,), (tt,))
        finally:
            sorting.AGGREGATE, sorting.RADIX_IMPL = old_agg, old_impl
        flip(xn, on)
        assert bool((on == cp.sort(cx)).all()), "sort differs from cupy.sort"
        t_flip = gpu_time(lambda: flip(xn, on), number=10, repeat=reps)
        rows.append(Row(f"sort 16M float32, classic radix with digit-count aggregation "
                        f"{'off' if old_agg else 'on'}, kernels only", "ms", t_flip * 1e3, t_cupy * 1e3, "cupy.sort"))
        # argsort of 16M
        iout = polyhal.empty((n,), "int64", dev)
        aplan = _plan(dev, "argsort", (n,), axis=0)
        aplan(x, out=iout)
        t_arg = gpu_time(lambda: aplan(x, out=iout), number=5, repeat=reps)
        t_carg = gpu_time(lambda: cp.argsort(cx), number=5, repeat=reps)
        rows.append(Row("argsort 16M float32 (stable)", "ms", t_arg * 1e3, t_carg * 1e3, "cupy.argsort"))
        try:
            import torch

            tx = torch.as_tensor(xh, device=f"cuda:{dev.ordinal}")
            t_torch = gpu_time(lambda: torch.sort(tx, stable=True), number=5, repeat=reps)
            rows.append(Row("argsort 16M float32 (stable)", "ms", t_arg * 1e3, t_torch * 1e3,
                            "torch.sort(stable=True) (values+indices)"))
        except ImportError:
            pass
        # per-row sort, 65536 x 256
        shape = (65536, 256)
        yh = rng.standard_normal(shape).astype(np.float32)
        y = polyhal.asarray(yh, device=dev)
        yout = polyhal.empty(shape, "float32", dev)
        rplan = _plan(dev, "sort", shape, axis=-1)
        rplan(y, out=yout)
        cy = cp.asarray(yh)
        assert bool((yout.native == cp.sort(cy, axis=-1)).all()), "row sort differs from cupy.sort"
        t_rows = gpu_time(lambda: rplan(y, out=yout), number=10, repeat=reps)
        t_crows = gpu_time(lambda: cp.sort(cy, axis=-1), number=5, repeat=reps)
        rows.append(Row("per-row sort 65536 x 256 float32", "ms", t_rows * 1e3, t_crows * 1e3,
                        "cupy.sort(axis=-1)", "faster", t_rows < t_crows))
    return rows
