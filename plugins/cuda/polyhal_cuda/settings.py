"""The CUDA backend's settings from the environment. :class:`CUDASettings` is read where each
setting is used (device registration, allocator creation, conv and attention preparation, plan
capture); :class:`CUDATuningSettings`, the sort and staging knobs, once, when their modules are
imported (they become module constants that tests and tools may replace)."""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Choice, Flag, Integer, Settings, Size, setting

__all__ = ["CUDASettings", "CUDATuningSettings", "DEFAULT_RANK", "LAYOUTS", "POOLS"]

#: Default rank of every CUDA GPU (see :mod:`polyhal_cuda.plugin`).
DEFAULT_RANK = 200
#: Where device-local buffers come from.
POOLS = ("caching", "async")
#: Conv layouts (see :mod:`polyhal_cuda.layout`).
LAYOUTS = ("auto", "nhwc", "nchw")
_SWITCH = {"true": "1", "yes": "1", "on": "1", "false": "0", "no": "0", "off": "0"}


@dataclass(frozen=True)
class CUDASettings(Settings, component="CUDA backend"):
    """What the environment says about the CUDA backend."""

    rank: int = setting("POLYHAL_CUDA_RANK", Integer(), DEFAULT_RANK, "rank of every CUDA GPU")
    pool: str = setting(
        "POLYHAL_CUDA_POOL", Choice(*POOLS), "caching",
        "where device-local buffers come from: cupy's caching pool, or CUDA's stream-ordered pool")
    layout: str = setting("POLYHAL_CUDA_LAYOUT", Choice(*LAYOUTS), "auto",
                          "conv chain layout: auto (where channels-last measured faster), nhwc or nchw")
    cudnn: bool = setting("POLYHAL_CUDA_CUDNN", Flag(), True, "convolve through cuDNN where it is installed")
    cudnn_autotune: bool = setting("POLYHAL_CUDA_CUDNN_AUTOTUNE", Flag(), True,
                                   "time cuDNN's candidate plans and keep the fastest (0: the first correct one)")
    sdpa: bool = setting("POLYHAL_CUDA_SDPA", Flag(), True, "run attention through cuDNN's SDPA where it applies")
    graphs: str = setting(
        "POLYHAL_CUDA_GRAPHS", Choice("auto", "1", "0", aliases=_SWITCH), "auto",
        "replay plans as CUDA graphs: auto (where launches saved outweigh the copies), 1 always, 0 never")


@dataclass(frozen=True)
class CUDATuningSettings(Settings, component="CUDA backend"):
    """The CUDA sort's and host staging's knobs (read when their modules are imported)."""

    radix: str = setting("POLYHAL_CUDA_RADIX", Choice("onesweep", "classic"), "onesweep",
                         "radix sort implementation")
    radix_aggregate: bool = setting("POLYHAL_CUDA_RADIX_AGG", Flag(), False,
                                    "warp-aggregated digit counting in the classic radix upsweep")
    staging_chunk: int = setting("POLYHAL_CUDA_STAGING_CHUNK", Size(), 4 << 20,
                                 "bytes per pinned staging buffer of pageable host copies")
    staging_threads: int | None = setting("POLYHAL_CUDA_STAGING_THREADS", Integer(low=1), None,
                                          "host threads that stage a large pageable copy",
                                          shown="the CPU count, at most 16")
