"""Per-step cost of a compiled plan against numpy called directly, and the cost of a memoized
``select_allocator`` decision against a plain pluggy hook call (CPU device).

Targets (issue 2): 16-element add at most 2 µs per step; 1024x1024 float32 matmul within 1.05x
of numpy's own; a memoized decision at most 0.2 µs.
"""

from __future__ import annotations

import numpy as np

import polyhal
from bench.harness import Row, median_time
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.policy import selector_for

CHAIN = 64  # steps per plan run, so that per-run costs (binding, fresh outputs) are amortised


def _add_chain(device: str):
    b = polyhal.ProgramBuilder("add_chain")
    x, y = b.input("x", (16,)), b.input("y", (16,))
    v = x
    for _ in range(CHAIN):
        v = b.add(v, y)
    b.output(v)
    return polyhal.compile(b.build(), device)


def run(args) -> list[Row]:
    rng = np.random.default_rng()
    dev = polyhal.get_device(args.device)
    repeat = 5 if args.quick else 50
    rows = []

    # 16-element add: a plan of CHAIN adds against CHAIN direct np.add(out=) calls.
    plan = _add_chain(dev.name)
    x, y = rng.standard_normal(16, np.float32), rng.standard_normal(16, np.float32)
    out = polyhal.empty((16,), "float32", dev)
    t_plan = median_time(lambda: plan(x, y, out=out), repeat=repeat, number=20) / CHAIN
    bufs = [np.empty(16, np.float32) for _ in range(CHAIN)]

    def numpy_chain():
        v = x
        for o in bufs:
            np.add(v, y, out=o)
            v = o

    t_np = median_time(numpy_chain, repeat=repeat, number=20) / CHAIN
    ref = x + CHAIN * y
    assert np.allclose(out.numpy(), ref, rtol=1e-4), "add chain result is wrong"
    rows.append(Row("16-element add, per step", "µs", t_plan * 1e6, t_np * 1e6, "numpy np.add(out=)",
                    "<= 2 µs", t_plan * 1e6 <= 2.0))

    # One-op plan called per op (what eager use pays per call), for scale.
    b = polyhal.ProgramBuilder("add1")
    p, q = b.input("x", (16,)), b.input("y", (16,))
    b.output(b.add(p, q))
    plan1 = polyhal.compile(b.build(), dev.name)
    out1 = polyhal.empty((16,), "float32", dev)
    t1 = median_time(lambda: plan1(x, y, out=out1), repeat=repeat, number=200)
    t1np = median_time(lambda: np.add(x, y), repeat=repeat, number=200)
    rows.append(Row("16-element add, one-op plan call", "µs", t1 * 1e6, t1np * 1e6, "numpy x + y"))

    # 1024x1024 float32 matmul through a plan against np.matmul(out=).
    n = 1024
    b = polyhal.ProgramBuilder("matmul")
    a_, w_ = b.input("a", (n, n)), b.input("w", (n, n))
    b.output(b.matmul(a_, w_))
    mplan = polyhal.compile(b.build(), dev.name)
    a, w = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    mout, nout = polyhal.empty((n, n), "float32", dev), np.empty((n, n), np.float32)
    reps = 3 if args.quick else 41
    # Interleave the two so that clock/thermal drift hits both alike.
    tp, tn = [], []
    for _ in range(reps):
        tp.append(median_time(lambda: mplan(a, w, out=mout), repeat=1, number=1, warmup=1))
        tn.append(median_time(lambda: np.matmul(a, w, out=nout), repeat=1, number=1, warmup=1))
    tp, tn = float(np.median(tp)), float(np.median(tn))
    assert np.allclose(mout.numpy(), nout, rtol=1e-4, atol=1e-3), "matmul result is wrong"
    rows.append(Row("1024² float32 matmul", "ms", tp * 1e3, tn * 1e3, "numpy np.matmul(out=)", "<= 1.05x",
                    tp <= 1.05 * tn, {"gflops_polyhal": 2 * n**3 / tp / 1e9}))

    # A memoized select_allocator decision against a plain pluggy hook call.
    reg = polyhal.default_registry()
    sel = selector_for(reg)
    cands = tuple((s, -1) for s in reg.device_specs()[:1])
    mt, usage = MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT
    site = sel.site(cands, mt, usage, 0)
    assert site.decision.index == sel.select(cands, mt, usage, 0).index == 0
    hook = reg.pm.hook.select_allocator
    t_hook = median_time(lambda: hook(candidates=cands, memory_type=mt, buffer_usage=usage, flags=0),
                         repeat=repeat, number=2000)
    t_site = median_time(lambda: site.decision, repeat=repeat, number=2000)
    rows.append(Row("memoized select_allocator decision (allocation site)", "µs", t_site * 1e6, t_hook * 1e6,
                    "pluggy hook call", "<= 0.2 µs", t_site * 1e6 <= 0.2))
    t_key = median_time(lambda: sel.select(cands, mt, usage, 0), repeat=repeat, number=2000)
    rows.append(Row("memoized decision by key lookup (selector.select)", "µs", t_key * 1e6, t_hook * 1e6,
                    "pluggy hook call"))
    return rows
