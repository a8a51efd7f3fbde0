"""The HIP backend's settings from the environment (:class:`HIPSettings`, read where each is
used), and those of its test suite (:class:`HIPTestSettings`)."""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Choice, Integer, Names, Settings, Text, setting

__all__ = ["DEFAULT_RANK", "HIPSettings", "HIPTestSettings", "POOLS"]

#: Default rank of every AMD GPU (as CUDA GPUs).
DEFAULT_RANK = 200
#: Where device-local buffers come from.
POOLS = ("device", "async")


@dataclass(frozen=True)
class HIPSettings(Settings, component="HIP backend"):
    """What the environment says about the HIP backend."""

    rank: int = setting("POLYHAL_HIP_RANK", Integer(), DEFAULT_RANK, "rank of every AMD GPU")
    pool: str = setting(
        "POLYHAL_HIP_POOL", Choice(*POOLS), "device",
        "where device-local buffers come from: hipMalloc, or the device's stream-ordered pool (where supported)")
    compile: str = setting("POLYHAL_HIP_COMPILE", Choice("process", "inprocess"), "process",
                           "where hiprtc compiles: in a worker process, or in this one")
    cache_dir: str = setting("POLYHAL_HIP_CACHE_DIR", Text(), "",
                             "folder of the compiled code objects (off, 0 or none: no disk cache)",
                             shown="the per-user cache folder")
    host_dlpack: str = setting(
        "POLYHAL_HIP_HOST_DLPACK", Choice("cpu", "rocm_host", aliases={"rocmhost": "rocm_host", "11": "rocm_host"}),
        "cpu", "DLPack device type of pinned host memory: kDLCPU, or kDLROCMHost (which many consumers reject)")


@dataclass(frozen=True)
class HIPTestSettings(Settings, component="HIP tests"):
    """How much of the HIP backend its tests compile and run (CI runs a subset)."""

    ops: str = setting("POLYHAL_HIP_TEST_OPS", Choice("ci", "all"), "ci",
                       "kernel tests on a GPU: one op per kernel family, or every op")
    archs: tuple[str, ...] = setting("POLYHAL_HIP_TEST_ARCHS", Names(), ("gfx90a", "gfx908", "gfx1030"),
                                     "the AMD architectures hiprtc compiles every kernel source for")
    compile: str = setting("POLYHAL_HIP_TEST_COMPILE", Choice("ci", "all"), "ci",
                           "compile tests: representative instances, or every kernel instance")
