"""Plan replay on a GPU against calling cupy and torch op by op.

Target (issue: CUDA backend): a replayed plan of 100 tiny (16-element) elementwise steps costs at
most 3 µs per step. The anchors run the same 100 ops one by one (cupy with ``out=``, torch
in-place-free ops), as a Python program calling a GPU library would. Also: the same plan run
eagerly (no graph), and the `polyhal demo` MLP block against torch op by op.
"""

from __future__ import annotations

import numpy as np

import polyhal
from bench.cuda_common import cuda_device, gpu_time
from bench.harness import Row

STEPS = 100


def _chain(n: int) -> polyhal.Program:
    b = polyhal.ProgramBuilder("tiny_chain")
    x, y = b.input("x", (n,)), b.input("y", (n,))
    v = x
    for i in range(STEPS):
        v = b.add(v, y) if i % 2 == 0 else b.mul(v, y)
    b.output(v)
    return b.build()


def _ref(x, y):
    v = x.astype(np.float64)
    for i in range(STEPS):
        v = v + y if i % 2 == 0 else v * y
    return v


def run(args) -> list[Row]:
    dev = cuda_device(args)  # first: no GPU is DeviceAbsent, before the GPU libraries are imported
    import cupy as cp

    rows: list[Row] = []
    rng = np.random.default_rng(0)
    n = 16
    xh, yh = rng.standard_normal(n).astype(np.float32), rng.uniform(0.9, 1.1, n).astype(np.float32)
    x, y = polyhal.asarray(xh, device=dev), polyhal.asarray(yh, device=dev)
    out = polyhal.empty((n,), "float32", dev)
    plan = polyhal.compile(_chain(n), dev.name)
    for _ in range(3):
        plan(x, y, out=out)
    assert plan.replay.mode == "graph", plan.replay.mode
    np.testing.assert_allclose(out.numpy(), _ref(xh, yh), rtol=1e-4)
    reps = 5 if args.quick else 15
    t_plan = gpu_time(lambda: plan(x, y, out=out), number=50, repeat=reps) / STEPS

    eager = polyhal.compile(_chain(n), dev.name)
    eager.replay._disable("graphs off, for comparison")
    t_eager = gpu_time(lambda: eager(x, y, out=out), number=10, repeat=reps) / STEPS

    with cp.cuda.Device(dev.ordinal):
        cx, cy = cp.asarray(xh), cp.asarray(yh)
        bufs = [cp.empty(n, cp.float32) for _ in range(STEPS)]

        def cupy_chain():
            v = cx
            for i, o in enumerate(bufs):
                (cp.add if i % 2 == 0 else cp.multiply)(v, cy, out=o)
                v = o

        cupy_chain()
        np.testing.assert_allclose(cp.asnumpy(bufs[-1]), _ref(xh, yh), rtol=1e-4)
        t_cupy = gpu_time(cupy_chain, number=10, repeat=reps) / STEPS
    rows.append(Row("100 tiny (16-element) elementwise steps, replayed plan, per step", "µs", t_plan * 1e6,
                    t_cupy * 1e6, "cupy op by op (out=)", "<= 3 µs", t_plan * 1e6 <= 3.0,
                    {"eager_plan_us_per_step": t_eager * 1e6}))
    try:
        import torch

        tx, ty = torch.as_tensor(xh, device=f"cuda:{dev.ordinal}"), torch.as_tensor(yh, device=f"cuda:{dev.ordinal}")

        def torch_chain():
            v = tx
            for i in range(STEPS):
                v = v + ty if i % 2 == 0 else v * ty
            return v

        t_torch = gpu_time(torch_chain, number=10, repeat=reps) / STEPS
        rows.append(Row("100 tiny elementwise steps, replayed plan, per step", "µs", t_plan * 1e6, t_torch * 1e6,
                        "torch op by op", "<= 3 µs", t_plan * 1e6 <= 3.0))
    except ImportError:
        torch = None
    rows.append(Row("100 tiny elementwise steps, eager plan (graphs off), per step", "µs", t_eager * 1e6,
                    t_cupy * 1e6, "cupy op by op (out=)"))

    # The demo MLP block: matmul, gelu, matmul, add, layer_norm, softmax (64 x 256, hidden 512).
    if torch is not None:
        nb, d, h = 64, 256, 512
        b = polyhal.ProgramBuilder("mlp")
        xi = b.input("x", (nb, d))
        w1, w2 = b.input("w1", (d, h)), b.input("w2", (h, d))
        g, be = b.input("g", (d,)), b.input("b", (d,))
        b.output(b.softmax(b.layer_norm(b.add(b.matmul(b.gelu(b.matmul(xi, w1)), w2), xi), g, be), axis=-1))
        mlp = polyhal.compile(b.build(), dev.name)
        feeds = [rng.standard_normal(s).astype(np.float32) / 16 for s in [(nb, d), (d, h), (h, d), (d,), (d,)]]
        dev_feeds = [polyhal.asarray(f, device=dev) for f in feeds]
        mout = polyhal.empty((nb, d), "float32", dev)
        for _ in range(3):
            mlp(*dev_feeds, out=mout)
        tf = [torch.as_tensor(f, device=f"cuda:{dev.ordinal}") for f in feeds]
        F = torch.nn.functional

        def torch_mlp():
            y = F.gelu(tf[0] @ tf[1]) @ tf[2] + tf[0]
            return torch.softmax(F.layer_norm(y, (d,), tf[3], tf[4]), -1)

        np.testing.assert_allclose(mout.numpy(), torch_mlp().cpu().numpy(), rtol=1e-3, atol=1e-5)
        t_mlp = gpu_time(lambda: mlp(*dev_feeds, out=mout), number=20, repeat=reps)
        t_tmlp = gpu_time(torch_mlp, number=20, repeat=reps)
        rows.append(Row("MLP block (polyhal demo, 64x256), whole program", "µs", t_mlp * 1e6, t_tmlp * 1e6,
                        "torch op by op", "faster", t_mlp < t_tmlp, {"replay": mlp.replay.mode}))
    return rows
