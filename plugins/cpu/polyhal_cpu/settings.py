"""The CPU backend's settings from the environment (:class:`CPUSettings`), read where each is used:
the device count and data tiling at device registration, the thread budget when it is (re)made,
the native loops' switch when a kernel is prepared."""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Flag, Integer, Settings, Text, setting

__all__ = ["CPUSettings", "DEFAULT_TILE", "MAX_DEVICES", "MAX_THREADS"]

#: Tile bound when a device does not say (``limits["data_tile"]``). numpy's unit of fast work
#: is a BLAS call, not a register tile, so tiles are BLAS-sized (IREE's CPU tiles, 16x16, would
#: make one Python-level call per 256 elements).
DEFAULT_TILE = 256
#: Most logical CPU devices.
MAX_DEVICES = 64
#: Largest budget (and polyhal pool) this backend uses.
MAX_THREADS = 64


@dataclass(frozen=True)
class CPUSettings(Settings, component="CPU backend"):
    """What the environment says about the CPU backend."""

    devices: int = setting("POLYHAL_CPU_DEVICES", Integer(1, MAX_DEVICES), 1,
                           "logical CPU devices (they share the host's memory and cores)")
    data_tiling: str = setting(
        "POLYHAL_CPU_DATA_TILING", Text(keep_blank=True), "all",
        "the CPU devices that tile data: all, none (or blank), or a list such as cpu:0,cpu:1")
    data_tile: int = setting("POLYHAL_CPU_DATA_TILE", Integer(low=1), DEFAULT_TILE, "largest data tile (elements a side)")
    threads: int | None = setting(
        "POLYHAL_CPU_THREADS", Integer(low=1), None,
        f"threads numpy's BLAS, numba and the backend's pool share (at most {MAX_THREADS})",
        shown="the CPUs this process may use, cut while others are busy",
        hint="set it to the number of threads the CPU backend may use (e.g. POLYHAL_CPU_THREADS=1), "
             "or unset it for the CPUs this process may use")
    onednn: bool = setting("POLYHAL_CPU_ONEDNN", Flag(), True,
                           "run convolutions and matmuls as oneDNN primitives where the library is installed")
    onednn_timed: bool = setting(
        "POLYHAL_CPU_ONEDNN_TIMED", Flag(), True,
        "time each small conv's oneDNN primitive against the CPU's own kernel when a plan is compiled and run the "
        "faster (0: oneDNN runs every conv it serves)")
    onednn_library: str | None = setting(
        "POLYHAL_CPU_ONEDNN_LIBRARY", Text(), None, "the oneDNN library file to load (libdnnl.so.3)",
        shown="the environment's lib/libdnnl.so.3 (the onednn-cpu-gomp wheel's)")
    native: bool = setting("POLYHAL_CPU_NATIVE", Flag(), True, "run the numba-compiled loops where they apply")
    cache_dir: str | None = setting(
        "POLYHAL_CPU_CACHE_DIR", Text(keep_blank=True), None,
        "folder of the ahead-of-time compiled loops module (blank: none, the loops are JIT compiled)",
        shown="the per-user cache folder")
    aot_wait: bool = setting(
        "POLYHAL_CPU_AOT_WAIT", Flag(), False,
        "wait for the first build of the compiled loops module (~1-4 min on 2 cores) instead of running on the "
        "library kernels (numpy, BLAS, oneDNN) while it builds in the background")
