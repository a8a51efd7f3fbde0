"""The CPU backend's hooks: one device per logical CPU device (``POLYHAL_CPU_DEVICES``, default 1).

Several logical CPU devices share the host's memory and cores; they exist so that multi-device
placement and every device policy can be exercised on a machine without accelerators.

Data tiling (:mod:`polyhal_cpu.encoding`): ``POLYHAL_CPU_DATA_TILING`` is ``all`` (default),
``none``, or a comma-separated list of the CPU devices that tile (``cpu:0``); the others resolve
every encoding to the identity layout. ``POLYHAL_CPU_DATA_TILE`` bounds the tile size (default
:data:`~polyhal_cpu.settings.DEFAULT_TILE`). Every variable: :class:`~polyhal_cpu.settings.CPUSettings`.

Threads: numpy's BLAS, numba and the backend's own pool share one budget, the CPUs this process
may use, cut while other processes keep them busy (``POLYHAL_CPU_THREADS`` overrides; see
:mod:`polyhal_cpu.threads`).
"""

from __future__ import annotations

import os
import sys

import polyhal
from polyhal.hal.records import DeviceSpec

from polyhal_cpu import onednn
from polyhal_cpu.allocator import host_heap
from polyhal_cpu.cost import estimate_cost, link_bandwidth  # noqa: F401  (hooks of the cost policy)
from polyhal_cpu.device import CPUDevice
from polyhal_cpu.encoding import resolve_encoding  # noqa: F401  (hook: the data-tiling resolver)
from polyhal_cpu.kernels import KERNEL_NAMES
from polyhal_cpu.settings import CPUSettings

POLYHAL_API_VERSION = polyhal.API_VERSION


def _data_tiling(names: list[str]) -> tuple[set[str], int]:
    """The CPU devices that tile (POLYHAL_CPU_DATA_TILING), and the tile bound."""
    settings = CPUSettings.from_env()
    raw = settings.data_tiling.strip()
    if raw.lower() in ("all", "1", "yes", "true"):
        tiled = set(names)
    elif raw.lower() in ("none", "0", "no", "false", ""):
        tiled = set()
    else:
        tiled = {n.strip() for n in raw.split(",") if n.strip()}
        unknown = sorted(tiled - set(names))
        if unknown:
            raise polyhal.ConfigError(f"POLYHAL_CPU_DATA_TILING names {unknown}, which are not CPU devices "
                                      f"({names}); use all, none or a list such as cpu:0",
                                      variable="POLYHAL_CPU_DATA_TILING", value=raw)
    return tiled, settings.data_tile


@polyhal.hookimpl
def register_devices():
    """One DeviceSpec per logical CPU device; creating the device is deferred to first use."""
    heap = host_heap()
    names = [f"cpu:{i}" for i in range(CPUSettings.from_env().devices)]
    tiled, tile = _data_tiling(names)
    onednn_words, onednn_story = onednn.listed()
    return [
        DeviceSpec(
            name=f"cpu:{i}", backend="cpu", rank=0, factory=CPUDevice, heaps=(heap,),
            workgroup_bytes=0,
            capabilities=frozenset({"host", "fp16", "fp64"} | ({"data-tiling"} if f"cpu:{i}" in tiled else set())),
            limits={"ordinal": i, "cores": os.cpu_count() or 1, "max_allocation_bytes": heap.max_allocation_size,
                    "data_tile": tile, "onednn": onednn_story},
            dlpack_devices=frozenset({(1, 0)}) if i == 0 else frozenset(),
            description=f"numpy on the host CPU ({os.cpu_count()} cores; {onednn_words})", kernel_names=KERNEL_NAMES,
        )
        for i in range(len(names))
    ]


@polyhal.hookimpl
def register_passes():
    """The CPU's own fusion (a conv's prologue, ``cpu.scale_shift_conv``: see :mod:`polyhal_cpu.fusions`),
    and explain's account of which convs and matmuls oneDNN runs (:mod:`polyhal_cpu.onednn_kernels`,
    :mod:`polyhal_cpu.onednn_int8`)."""
    # Imported here, at the first compile: fusion passes build on the compiler, which listing
    # devices (`polyhal devices`) does not load.
    from polyhal import Pass, PassRegistration
    from polyhal_cpu import fusions

    reports = [PassRegistration(Pass(f"cpu-{name}-report", _report_where_imported(f"polyhal_cpu.{module}"),
                                     requires=("buffers-planned",), provides=(f"cpu-{name}-reported",)),
                                after="bufferize")
               for name, module in (("onednn", "onednn_kernels"), ("onednn-int8", "onednn_int8"))]
    return fusions.registrations() + reports


def _report_where_imported(module: str):
    """The pass that runs ``module``'s explain report (``report(compilation, target)``: which
    convs and matmuls oneDNN runs, :mod:`polyhal_cpu.onednn_kernels`; which quantized contractions,
    :mod:`polyhal_cpu.onednn_int8`) where the module was imported: bufferize, before it, asked every
    dispatch's scratch, which imports the modules of the kernels it has; a program without such a
    dispatch imports nothing for the report."""
    def report(compilation, target) -> None:
        loaded = sys.modules.get(module)
        if loaded is not None:
            loaded.report(compilation, target)
    report.__qualname__ = f"report[{module}]"
    return report
