"""4096² float32 matmul through a polyhal plan on a GPU against cupy.matmul (cuBLAS both).

Target: within 1.05x of cupy's time. Plan and cupy calls are interleaved so that clock drift
hits both alike.
"""

from __future__ import annotations

import numpy as np

import polyhal
from bench.cuda_common import cuda_device, gpu_time
from bench.harness import Row


def run(args) -> list[Row]:
    dev = cuda_device(args)  # first: no GPU is DeviceAbsent, before the GPU libraries are imported
    import cupy as cp

    n = 4096
    rng = np.random.default_rng(0)
    ah, bh = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    a, b = polyhal.asarray(ah, device=dev), polyhal.asarray(bh, device=dev)
    out = polyhal.empty((n, n), "float32", dev)
    pb = polyhal.ProgramBuilder("matmul")
    x, w = pb.input("a", (n, n)), pb.input("b", (n, n))
    pb.output(pb.matmul(x, w))
    plan = polyhal.compile(pb.build(), dev.name)
    with cp.cuda.Device(dev.ordinal):
        ca, cb = cp.asarray(ah), cp.asarray(bh)
        co = cp.empty((n, n), cp.float32)
        plan(a, b, out=out)
        cp.matmul(ca, cb, out=co)
        err = float(cp.abs(out.native - co).max() / cp.abs(co).max())
        assert err < 1e-5, err
        tp, tc = [], []
        for _ in range(3 if args.quick else 7):
            tp.append(gpu_time(lambda: plan(a, b, out=out), number=5, repeat=3, warmup=1))
            tc.append(gpu_time(lambda: cp.matmul(ca, cb, out=co), number=5, repeat=3, warmup=1))
    tp_, tc_ = float(np.median(tp)), float(np.median(tc))
    flops = 2 * n ** 3
    return [Row("4096² float32 matmul", "ms", tp_ * 1e3, tc_ * 1e3, "cupy.matmul(out=)", "<= 1.05x",
                tp_ <= 1.05 * tc_, {"tflops_polyhal": flops / tp_ / 1e12, "tflops_cupy": flops / tc_ / 1e12})]
