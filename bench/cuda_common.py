"""Helpers shared by the CUDA benchmarks (``bench/cuda_*.py``): the device, and GPU timing.

GPU work is asynchronous, so every timing waits for the whole device at its end
(``cudaDeviceSynchronize``: polyhal, cupy and torch may use different streams) and repeats the
call ``number`` times per sample, so that the wait is amortised; the median of the samples is
reported (:func:`bench.harness.median_time`).
"""

from __future__ import annotations

from typing import Callable

import polyhal
from bench.harness import DeviceAbsent, median_time


def cuda_device(args):
    """The polyhal CUDA device to measure (``--device``, default the first CUDA device)."""
    if args.device:
        return polyhal.get_device(args.device)
    for spec in polyhal.devices():
        if spec.backend == "cuda":
            return polyhal.get_device(spec.name)
    reasons = polyhal.default_registry().unavailable_reasons().get("cuda", ["no CUDA device"])
    raise DeviceAbsent("no CUDA device: " + "; ".join(reasons))


def device_sync() -> None:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


def gpu_time(fn: Callable[[], object], *, number: int = 10, repeat: int = 15, warmup: int = 3) -> float:
    """Median seconds per call of ``fn``, the device synchronised around each sample."""
    device_sync()
    return median_time(fn, repeat=repeat, number=number, warmup=warmup, sync=device_sync)
