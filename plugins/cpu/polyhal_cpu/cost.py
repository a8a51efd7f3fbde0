"""The CPU backend's part in the ``cost`` policy: kernel-time estimates for its devices, and the
links between its logical devices.

Figures are deliberately simple: numpy runs an elementwise op on one thread at roughly a few
GB/s, while a matmul's single-threaded BLAS pieces run on every core of the backend's pool
(:mod:`polyhal_cpu.parallel`). Logical CPU devices share the host's memory, so
a transfer between two of them is one memcpy. ``polyhal.policies.cost.measure_link`` replaces the
declared link figure with a measured one.
"""

from __future__ import annotations

import polyhal

#: Bytes per second numpy streams through one core, and per-op dispatch latency.
STREAM_BANDWIDTH = 6e9
LAUNCH_LATENCY = 2e-6
#: FLOP/s of one core: scalar-ish ufuncs vs BLAS (per core; a large product is cut over every core).
UFUNC_FLOPS = 1e9
BLAS_FLOPS_PER_CORE = 16e9
#: A memcpy between logical CPU devices (same memory).
HOST_COPY_BANDWIDTH = 8e9


@polyhal.hookimpl
def estimate_cost(device_spec, workload):
    """Seconds for ``workload`` on a CPU device (None for other backends' devices)."""
    if device_spec.backend != "cpu":
        return None
    if workload.op in ("matmul", "gemm"):
        peak = BLAS_FLOPS_PER_CORE * int(device_spec.limits.get("cores", 1))
    else:
        peak = UFUNC_FLOPS
    moved = workload.input_bytes + workload.output_bytes
    return LAUNCH_LATENCY + max(moved / STREAM_BANDWIDTH, workload.flops / peak)


@polyhal.hookimpl
def link_bandwidth(src, dst):
    """Logical CPU devices copy through shared host memory."""
    if src.backend == dst.backend == "cpu":
        return HOST_COPY_BANDWIDTH
    return None
