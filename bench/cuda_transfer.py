"""Host <-> device copies of 1 GiB of pageable (ordinary numpy) memory.

Target: at least 40 GB/s both ways for polyhal's staged, double-buffered transfers. Anchors:
cupy's copies of the same pageable array (``ndarray.set`` / ``ndarray.get(out=)``), and of
pinned memory (the bus speed). Figures are GB/s (higher is better; the ratio column is
polyhal / anchor, so above 1 is faster here).
"""

from __future__ import annotations

import numpy as np

from bench.cuda_common import cuda_device, gpu_time
from bench.harness import Row

GIB = 1 << 30


def run(args) -> list[Row]:
    dev = cuda_device(args)  # first: no GPU is DeviceAbsent, before the GPU libraries are imported
    import cupy as cp

    from polyhal.hal.flags import MemoryType

    host = np.random.default_rng(0).integers(0, 256, size=GIB, dtype=np.uint8)
    back = np.empty_like(host)
    back.fill(1)  # touch every page once, as an application's own buffer would be
    buf = dev.allocator.allocate(GIB, MemoryType.DEVICE_LOCAL)
    reps = 3 if args.quick else 11

    def h2d():
        dev.write(buf, 0, host)

    def d2h():
        dev.read(buf, 0, back)

    h2d()
    d2h()
    assert np.array_equal(back[:: 1 << 20], host[:: 1 << 20]) and np.array_equal(back[-4096:], host[-4096:])
    # Three warm-up round trips: on the lent H100 host (a VM) the first transfers of a process
    # ran at 10-26 GB/s and later ones at 40-47 (plugins/cuda/tools/probe.py transfer_trace);
    # the figure wanted is the steady state.
    t_h2d = gpu_time(h2d, number=1, repeat=reps, warmup=3)
    t_d2h = gpu_time(d2h, number=1, repeat=reps, warmup=3)
    with cp.cuda.Device(dev.ordinal):
        arr = cp.empty(GIB, cp.uint8)
        t_c_h2d = gpu_time(lambda: arr.set(host), number=1, repeat=reps, warmup=1)
        t_c_d2h = gpu_time(lambda: arr.get(out=back), number=1, repeat=reps, warmup=1)
        pinned = cp.cuda.alloc_pinned_memory(GIB)
        pview = np.frombuffer(pinned, np.uint8, GIB)
        pview[:] = host
        t_p_h2d = gpu_time(lambda: cp.cuda.runtime.memcpy(arr.data.ptr, pview.ctypes.data, GIB, 1),
                           number=1, repeat=reps, warmup=1)
        t_p_d2h = gpu_time(lambda: cp.cuda.runtime.memcpy(pview.ctypes.data, arr.data.ptr, GIB, 2),
                           number=1, repeat=reps, warmup=1)
    buf.release()
    gbs = lambda t: GIB / t / 1e9  # noqa: E731
    return [
        Row("host->device 1 GiB pageable (staged)", "GB/s", gbs(t_h2d), gbs(t_c_h2d), "cupy ndarray.set (pageable)",
            ">= 40 GB/s", gbs(t_h2d) >= 40, {"pinned_bus_gbs": gbs(t_p_h2d)}),
        Row("device->host 1 GiB pageable (staged)", "GB/s", gbs(t_d2h), gbs(t_c_d2h), "cupy ndarray.get (pageable)",
            ">= 40 GB/s", gbs(t_d2h) >= 40, {"pinned_bus_gbs": gbs(t_p_d2h)}),
        Row("host->device 1 GiB, polyhal pageable vs pinned bus", "GB/s", gbs(t_h2d), gbs(t_p_h2d),
            "cudaMemcpy from pinned memory"),
        Row("device->host 1 GiB, polyhal pageable vs pinned bus", "GB/s", gbs(t_d2h), gbs(t_p_d2h),
            "cudaMemcpy to pinned memory"),
    ]
