"""The OpenCL backend's settings from the environment (:class:`OpenCLSettings`), read where each
is used: ranks at device registration, the pool bound when a device's allocator is made, the
cache folder when a device's program cache is, the matmul choices when a matmul is prepared."""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Choice, Settings, Size, Text, setting

__all__ = ["MATMUL_VARIANTS", "OpenCLSettings"]

#: The matmul variants (see :mod:`polyhal_opencl.ops.linalg`).
MATMUL_VARIANTS = ("gpu128", "gpu64", "cpu_outer", "cpu_dot", "portable")


@dataclass(frozen=True)
class OpenCLSettings(Settings, component="OpenCL backend"):
    """What the environment says about the OpenCL backend."""

    rank: str = setting(
        "POLYHAL_OPENCL_RANK", Text(), "",
        "rank overrides: N (every OpenCL device) and opencl:<n>=N (one device), comma-separated",
        shown="GPU 100, accelerator 50, other 5, CPU -10")
    pool_bytes: int | None = setting(
        "POLYHAL_OPENCL_POOL_BYTES", Size(), None, "most bytes each device's buffer pool keeps cached",
        shown="256MiB or an eighth of the device's memory, the smaller")
    cache_dir: str | None = setting(
        "POLYHAL_OPENCL_CACHE_DIR", Text(keep_blank=True), None,
        "folder of the built program binaries (blank: no disk cache)", shown="the per-user cache folder")
    matmul: str | None = setting(
        "POLYHAL_OPENCL_MATMUL", Choice(*MATMUL_VARIANTS), None,
        "force this float32 matmul variant where it applies", shown="chosen per device and shape")
    gpu_block: str = setting(
        "POLYHAL_OPENCL_GPU_BLOCK", Text(), "",
        "BM,BN,BK,TM,TN: the GPU matmul variants' block shape (tuning)", shown="per variant")
