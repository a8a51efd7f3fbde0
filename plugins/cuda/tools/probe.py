"""Stage-by-stage timings on a GPU, for tuning (not a benchmark: no anchor, no targets).

``python plugins/cuda/tools/probe.py transfer nms`` prints, for pageable transfers, the host's
own copy rate into pinned memory and the staged rate for several (workers, chunk) settings, and
for NMS of 10,000 boxes the time of each pipeline stage (device events) and of the whole call.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: bench/
from bench.harness import median_time  # noqa: E402

GIB = 1 << 30


def _median(fn, reps=5, warm=1):
    """Median seconds of one call, the whole device synchronised after each."""
    import cupy as cp

    return median_time(fn, repeat=reps, number=1, warmup=warm, sync=cp.cuda.runtime.deviceSynchronize)


def transfer(dev) -> None:
    import cupy as cp
    from concurrent.futures import ThreadPoolExecutor

    from polyhal.hal.flags import MemoryType
    from polyhal_cuda import transfer as tr

    host = np.random.default_rng(0).integers(0, 256, size=GIB, dtype=np.uint8)
    back = np.empty_like(host)
    back.fill(1)
    # the host alone: pageable -> pinned ring, T threads, chunk C
    for threads, chunk in [(1, 64 << 20), (8, 2 << 20), (16, 2 << 20), (16, 64 << 20)]:
        rings = [np.frombuffer(cp.cuda.alloc_pinned_memory(chunk), np.uint8, chunk) for _ in range(threads)]
        pool = ThreadPoolExecutor(threads)

        def work(j):
            for s in range(j * chunk, GIB, threads * chunk):
                np.copyto(rings[j][:min(chunk, GIB - s)], host[s:s + chunk])

        t = _median(lambda: list(pool.map(work, range(threads))), reps=3)
        print(f"host copy pageable->pinned threads={threads} chunk={chunk >> 20}MiB: {GIB / t / 1e9:.1f} GB/s", flush=True)
        pool.shutdown()
    buf = dev.allocator.allocate(GIB, MemoryType.DEVICE_LOCAL)
    configs = [(16, 4 << 20), (8, 4 << 20), (8, 8 << 20), (12, 8 << 20), (16, 8 << 20), (16, 16 << 20), (6, 16 << 20)]
    results = {c: ([], []) for c in configs}
    for rnd in range(5):  # rounds over every setting: the host's noise spreads over all of them
        for c in configs:
            dev.stager.close()
            tr.WORKERS, tr.CHUNK = c
            dev.write(buf, 0, host)
            results[c][0].append(_median(lambda: dev.write(buf, 0, host), reps=3, warm=0))
            results[c][1].append(_median(lambda: dev.read(buf, 0, back), reps=3, warm=0))
    ok = np.array_equal(back[::4097], host[::4097]) and np.array_equal(back[-5000:], host[-5000:])
    for (workers, chunk), (th, td) in results.items():
        print(f"staged workers={workers} chunk={chunk >> 20}MiB: h2d median {GIB / np.median(th) / 1e9:.1f} "
              f"(min {GIB / max(th) / 1e9:.1f}, max {GIB / min(th) / 1e9:.1f}) GB/s, d2h median "
              f"{GIB / np.median(td) / 1e9:.1f} (min {GIB / max(td) / 1e9:.1f}, max {GIB / min(td) / 1e9:.1f}) GB/s, "
              f"correct={ok}", flush=True)
    buf.release()


def nms(dev) -> None:
    import cupy as cp
    import torch
    import torchvision

    from polyhal_cuda import suppression
    from polyhal_gpu import nms as pnms

    for n in (10_000, 100_000):
        gen = torch.Generator(device=f"cuda:{dev.ordinal}").manual_seed(0)
        xy = torch.rand(n, 2, device=f"cuda:{dev.ordinal}", generator=gen) * 1000
        wh = torch.rand(n, 2, device=f"cuda:{dev.ordinal}", generator=gen) * 100 + 1
        boxes = torch.cat([xy, xy + wh], 1).contiguous()
        scores = (torch.randperm(n, device=f"cuda:{dev.ordinal}", generator=gen).float() / n).contiguous()
        ref = torchvision.ops.nms(boxes, scores, 0.5)
        from polyhal_cuda import sorting

        for threads, path in ((None, "radix"), (512, "radix"), (256, "radix")):
            suppression._cache.clear()
            old = pnms.reduce_threads
            if threads:
                pnms.reduce_threads = lambda w, t=threads: t
            sorting.FORCE_PATH = path
            try:
                keep = suppression.nms(boxes, scores, 0.5, device=dev.name)
                same = bool(cp.array_equal(keep, cp.from_dlpack(ref)))
                t = _median(lambda: suppression.nms(boxes, scores, 0.5, device=dev.name), reps=30 if n <= 10_000 else 5, warm=3 if n <= 10_000 else 1)
                pipe = next(iter(suppression._cache.values()))
                b = cp.from_dlpack(boxes)
                s = cp.from_dlpack(scores).reshape(1, 1, n)
                g, launch = pipe.g, dev.launch
                stages = {
                    "argsort": lambda: pipe.argsort(s, pipe.order),
                    "boxes": lambda: launch(pipe.k_boxes, "nms_boxes", pipe.boxes_grid, (256,), (b, s, pipe.order) + pipe.boxes_args),
                    "mask": lambda: launch(pipe.k_mask, "nms_mask", (g.words, g.words, g.problems), (64,), pipe.mask_args),
                    "reduce": lambda: launch(pipe.k_reduce, "nms_reduce", (g.problems,), pipe.reduce_block, pipe.reduce_args, pipe.reduce_smem),
                }
                parts = []
                with dev.activate():
                    for name, fn in stages.items():
                        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                        fn()
                        e0.record(dev.stream)
                        for _ in range(20):
                            fn()
                        e1.record(dev.stream)
                        e1.synchronize()
                        parts.append(f"{name} {cp.cuda.get_elapsed_time(e0, e1) / 20 * 1e3:.0f}us")
                print(f"nms n={n} reduce_threads={threads or 'default ' + str(old(g.words))}: call {t * 1e3:.3f} ms, "
                      f"kept {keep.size}, identical={same}; " + ", ".join(parts), flush=True)
                cp.cuda.runtime.deviceSynchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    pipe.run(b, s)
                t_host = (time.perf_counter() - t0) / 20
                cp.cuda.runtime.deviceSynchronize()
                print(f"   argsort path {path or 'default'}: pipe.run enqueue {t_host * 1e6:.0f}us (host)", flush=True)
            finally:
                pnms.reduce_threads = old
                sorting.FORCE_PATH = None
        if n <= 10_000:
            tt = _median(lambda: torchvision.ops.nms(boxes, scores, 0.5), reps=20, warm=3)
            print(f"torchvision n={n}: {tt * 1e3:.3f} ms", flush=True)


def transfer_trace(dev) -> None:
    """The bench's 1 GiB transfers, repeated, with where the workers' time went (host copies,
    waits for the copy engine) and the CPU's steal time, for several worker settings."""
    import ctypes
    import os
    import threading

    import cupy as cp

    from polyhal.hal.flags import MemoryType
    from polyhal_cuda import transfer as tr

    print("affinity", sorted(os.sched_getaffinity(0)), "load", open("/proc/loadavg").read().strip(), flush=True)
    host = np.random.default_rng(0).integers(0, 256, size=GIB, dtype=np.uint8)
    back = np.empty_like(host)
    back.fill(1)
    buf = dev.allocator.allocate(GIB, MemoryType.DEVICE_LOCAL)
    spent = {"copy": 0.0, "wait": 0.0}
    lock = threading.Lock()

    class TimedNumpy:
        def __init__(self, memmove: bool) -> None:
            self.memmove = memmove

        def __getattr__(self, name):
            return getattr(np, name)

        def copyto(self, dst, src):
            t = time.perf_counter()
            if self.memmove:
                ctypes.memmove(dst.ctypes.data, src.ctypes.data, dst.nbytes)
            else:
                np.copyto(dst, src)
            with lock:
                spent["copy"] += time.perf_counter() - t

    def steal():
        f = open("/proc/stat").readline().split()
        return int(f[8]) if len(f) > 8 else 0

    for workers, chunk, memmove in [(16, 4 << 20, False), (8, 4 << 20, False), (16, 4 << 20, True),
                                    (8, 8 << 20, False), (16, 4 << 20, False), (4, 16 << 20, True)]:
        dev.stager.close()
        tr.WORKERS, tr.CHUNK = workers, chunk
        tr.np = TimedNumpy(memmove)
        try:
            for direction in ("h2d", "d2h"):
                rates = []
                spent["copy"] = 0.0
                s0 = steal()
                for _ in range(6):
                    fn = (lambda: dev.write(buf, 0, host)) if direction == "h2d" else (lambda: dev.read(buf, 0, back))
                    cp.cuda.runtime.deviceSynchronize()
                    t = time.perf_counter()
                    fn()
                    cp.cuda.runtime.deviceSynchronize()
                    rates.append(GIB / (time.perf_counter() - t) / 1e9)
                print(f"workers={workers} chunk={chunk >> 20}MiB memmove={memmove} {direction}: GB/s "
                      + " ".join(f"{r:.0f}" for r in rates)
                      + f"; host copy thread-seconds per GiB {spent['copy'] / 6 * 1e3:.0f} ms"
                      + f"; steal ticks {steal() - s0}", flush=True)
        finally:
            tr.np = np
    ok = np.array_equal(back[::4097], host[::4097])
    print("correct", ok, flush=True)
    buf.release()


if __name__ == "__main__":
    import polyhal

    dev = next(polyhal.get_device(s.name) for s in polyhal.devices() if s.backend == "cuda")
    for what in sys.argv[1:] or ["transfer", "nms"]:
        globals()[what](dev)
