"""Where the concurrency benchmark's time goes (issue 28): each branch alone, the combined
program serial and concurrent, per-part timestamps of the concurrent run, and each direction
of the 256 MiB host round trip. Run on the GPU machine: python3 plugins/cuda/tools/overlap_probe.py"""

import cProfile
import pstats
import sys
import time

import numpy as np

import polyhal
from bench.concurrency import _branches, _orthogonal  # noqa: F401
from bench.harness import median_time
from polyhal.hal.transfer import route, transfer_fn

gpu_name = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
gpu = polyhal.get_device(gpu_name)
cpu = polyhal.get_device("cpu:0")
cpu_n, gpu_n = (1024, 4096) if gpu.spec.backend == "cuda" else (256, 256)
cs, gs = (43, 28) if gpu.spec.backend == "cuda" else (20, 20)
rng = np.random.default_rng(5)
x = rng.standard_normal((cpu_n, cpu_n)).astype(np.float32)
y = rng.standard_normal((gpu_n, gpu_n)).astype(np.float32)


def sync():
    gpu.synchronize()


def t(label, fn, reps=5):
    s = median_time(lambda: (fn(), sync()), repeat=reps, warmup=2)
    print(f"{label:60s} {s * 1e3:9.2f} ms", flush=True)
    return s


for label, c, g in (("cpu branch only (multi-device compile)", cs, 0), ("gpu branch only (multi-device compile)", 0, gs),
                    ("both", cs, gs)):
    prog = _branches(cpu_n, max(c, 0), gpu_name, gpu_n, max(g, 0))
    t0 = time.perf_counter()
    ser = polyhal.compile(prog, ["cpu:0", gpu_name], concurrent=False)
    con = polyhal.compile(prog, ["cpu:0", gpu_name], concurrent=True)
    print(f"{label}: two compiles {time.perf_counter() - t0:.1f} s", flush=True)
    t(f"{label}: serial", lambda: ser(x, y))
    t(f"{label}: concurrent", lambda: con(x, y))
    if label == "both":
        print("\n".join(con.explain().splitlines()[-40:]) if hasattr(con, "explain") else "")
        sched = con.schedule
        stamps = []
        for p in sched.parts:
            work = p.work

            def wrap(f, p=p):
                def g(*a, **k):
                    t0 = time.perf_counter()
                    r = f(*a, **k)
                    stamps.append((p.lane, p.ordinal, p.mode, t0, time.perf_counter()))
                    return r
                return g
            p.work = tuple(wrap(f) for f in work) if p.mode != "steps" else tuple(work)
        T0 = time.perf_counter()
        con(x, y)
        sync()
        T1 = time.perf_counter()
        print(f"one concurrent run {1e3 * (T1 - T0):.1f} ms; part stamps (lane, part, mode, start ms, end ms):")
        for s in stamps:
            print(f"  {s[0]} {s[1]} {s[2]} {1e3 * (s[3] - T0):8.1f} {1e3 * (s[4] - T0):8.1f}")
        prof = ser.profile(x, y, runs=2)
        print(prof.table()[-2500:])
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3):
            ser(x, y)
            sync()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)

if gpu.spec.backend == "cuda":
    n = 256 << 20
    a = polyhal.asarray(np.random.default_rng(6).integers(0, 256, n, dtype=np.uint8), device=gpu)
    h = polyhal.empty((n,), "uint8", cpu)
    back = polyhal.empty((n,), "uint8", gpu)
    h.numpy().fill(1)
    down = transfer_fn(route(gpu, cpu), (n,), np.uint8)
    up = transfer_fn(route(cpu, gpu), (n,), np.uint8)
    d = t("256 MiB down", lambda: down(a.native, h.native), 7)
    u = t("256 MiB up", lambda: up(h.native, back.native), 7)
    print(f"down {n / d / 1e9:.1f} GB/s, up {n / u / 1e9:.1f} GB/s")
    hp = np.empty(n, np.uint8)
    hp.fill(1)
    d = t("256 MiB down into a fresh np.empty (touched)", lambda: gpu.download(a.native, hp), 7)
    print(f"stager workers: {gpu.stager.__class__.__module__}", __import__('polyhal_cuda.transfer', fromlist=['x']).WORKERS,
          __import__('polyhal_cuda.transfer', fromlist=['x']).CHUNK)
