"""The OpenCL backend's hooks: one device, ``opencl:<n>``, per OpenCL device of every platform.

Enumeration only asks pyopencl for platforms, devices and their properties: no context, queue
or program is made until the core calls a spec's factory (first use of the device). ``n``
counts devices across platforms in the order the ICD loader reports them.

Rank (higher is preferred by the core): GPU 100, accelerator 50, anything else 5, CPU -10 (PoCL,
Intel's CPU runtime). So a real GPU beats the numpy CPU backend (rank 0), while an OpenCL CPU
device ranks below it: on the CPU, numpy with its BLAS ran the `polyhal demo` MLP block about 28x
faster than PoCL did (0.73 ms against 20.9 ms on a 2-core machine, 2026-11-22).
``POLYHAL_OPENCL_RANK`` overrides: a comma-separated list of ``N`` (every OpenCL device) and
``opencl:<n>=N`` (one device) entries, e.g. ``POLYHAL_OPENCL_RANK=-1`` to rank OpenCL below the
CPU backend, or ``POLYHAL_OPENCL_RANK=opencl:1=200``.

No platform (no ICD installed, or ``OCL_ICD_VENDORS`` pointing at an empty directory) means no
device and a reason from :func:`report_unavailable`; nothing raises.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import polyhal
from polyhal.hal.records import DeviceSpec

from polyhal_opencl.allocator import heaps_for
from polyhal_opencl.codegen import private_bytes
from polyhal_opencl.errors import status_name
from polyhal_opencl.settings import OpenCLSettings

# pyopencl is imported inside the functions that use it: without pyopencl the plugin still imports,
# lists no device and says why (plugin.enumerate_devices). The device and its kernels are imported
# when devices are listed or made, not with the plugin: a process that runs on another backend's
# device (cpu:0) pays nothing for them.

POLYHAL_API_VERSION = polyhal.API_VERSION

#: Rank by OpenCL device type (see the module docstring).
RANK_BY_TYPE = {"gpu": 100, "accelerator": 50, "cpu": -10}
DEFAULT_RANK = 5
INSTALL_HINT = "install an ICD such as Debian's pocl-opencl-icd (CPU) or your GPU vendor's OpenCL driver"


@dataclass(frozen=True)
class Enumeration:
    """What one look at the OpenCL platforms found: device specs, and reasons for anything missing."""

    specs: tuple[DeviceSpec, ...]
    reasons: tuple[str, ...]


def device_kind(cl_device: Any) -> str:
    """``"gpu"``, ``"accelerator"``, ``"cpu"`` or ``"custom"`` for a pyopencl device."""
    import pyopencl as cl

    t = cl_device.type
    for bit, name in ((cl.device_type.GPU, "gpu"), (cl.device_type.ACCELERATOR, "accelerator"),
                      (cl.device_type.CPU, "cpu")):
        if t & bit:
            return name
    return "custom"


def _rank_overrides() -> tuple[int | None, dict[str, int]]:
    raw = OpenCLSettings.from_env().rank
    every, by_name = None, {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        name, _, value = item.rpartition("=")
        try:
            rank = int(value)
        except ValueError:
            raise polyhal.ConfigError(
                f"POLYHAL_OPENCL_RANK entry {item!r} is not 'N' or 'opencl:<n>=N' with an integer N",
                variable="POLYHAL_OPENCL_RANK", value=raw) from None
        if name:
            by_name[name] = rank
        else:
            every = rank
    return every, by_name


def _has_extension(cl_device: Any, name: str) -> bool:
    return name in cl_device.extensions.split()


def capabilities(cl_device: Any) -> frozenset[str]:
    """Capability tags: device kind, ``fp64``, ``fp16`` (arithmetic; half *storage* works
    everywhere through vload_half), ``svm``, ``unified-memory`` and ``images``."""
    caps = {device_kind(cl_device), "fp16-storage"}
    if _has_extension(cl_device, "cl_khr_fp64") or _safe(lambda: cl_device.double_fp_config, 0):
        caps.add("fp64")
    if _has_extension(cl_device, "cl_khr_fp16"):
        caps.add("fp16")
    if _safe(lambda: cl_device.svm_capabilities, 0):
        caps.add("svm")
    if _safe(lambda: cl_device.host_unified_memory, False) or device_kind(cl_device) == "cpu":
        caps.add("unified-memory")
    if _safe(lambda: cl_device.image_support, False):
        caps.add("images")
    return frozenset(caps)


def _safe(get: Any, default: Any) -> Any:
    # Optional or deprecated properties raise on some drivers (e.g. SVM on OpenCL 1.2).
    try:
        return get()
    except Exception:  # noqa: BLE001
        return default


def limits(cl_device: Any, ordinal: int) -> dict[str, Any]:
    """Device limits shown by ``polyhal devices`` and used when generating kernels."""
    return {
        "ordinal": ordinal,
        "platform": cl_device.platform.name.strip(),
        "device": cl_device.name.strip(),
        "vendor": cl_device.vendor.strip(),
        "type": device_kind(cl_device),
        "opencl_version": cl_device.version.strip(),
        "opencl_c_version": _safe(lambda: cl_device.opencl_c_version.strip(), ""),
        "driver_version": cl_device.driver_version.strip(),
        "max_compute_units": cl_device.max_compute_units,
        "max_work_group_size": cl_device.max_work_group_size,
        "local_mem_size": cl_device.local_mem_size,
        "global_mem_size": cl_device.global_mem_size,
        "max_mem_alloc_size": cl_device.max_mem_alloc_size,
        # Per work-item private memory the bufferize pass may place scratch in (OpenCL has no query for it).
        "private_bytes": private_bytes(device_kind(cl_device)),
        # Sub-buffers (global scratch slices of a plan's arena) need origins aligned to this.
        "scratch_alignment": max(int(cl_device.mem_base_addr_align) // 8, 256),
    }


def _create(cl_device: Any, spec: DeviceSpec):
    from polyhal_opencl.device import CLDevice

    return CLDevice(spec, cl_device)


def enumerate_devices() -> Enumeration:
    """Look at every OpenCL platform and device; never raises for a missing driver."""
    try:
        import pyopencl as cl
    except ImportError as exc:
        return Enumeration((), (f"pyopencl cannot be imported ({exc}); pip install pyopencl",))
    try:
        platforms = cl.get_platforms()
    except Exception as exc:  # noqa: BLE001 - the ICD loader reports "no platform" as an error
        detail = status_name(exc.code) if isinstance(exc, cl.Error) else f"{type(exc).__name__}: {exc}"
        return Enumeration((), (f"no OpenCL platform found ({detail}); {INSTALL_HINT}",))
    if not platforms:
        return Enumeration((), (f"no OpenCL platform found; {INSTALL_HINT}",))
    from polyhal_opencl.kernels import KERNEL_NAMES

    every, by_name = _rank_overrides()
    specs, reasons = [], []
    for platform in platforms:
        try:
            devices = platform.get_devices()
        except cl.Error as exc:  # a platform with no device reports CL_DEVICE_NOT_FOUND
            reasons.append(f"OpenCL platform {platform.name.strip()!r} offers no device ({status_name(exc.code)})")
            continue
        for cl_device in devices:
            ordinal = len(specs)
            name = f"opencl:{ordinal}"
            kind = device_kind(cl_device)
            rank = by_name.get(name, every if every is not None else RANK_BY_TYPE.get(kind, DEFAULT_RANK))
            specs.append(DeviceSpec(
                name=name, backend="opencl", rank=rank, factory=functools.partial(_create, cl_device),
                heaps=heaps_for(cl_device), workgroup_bytes=int(cl_device.local_mem_size),
                capabilities=capabilities(cl_device), limits=limits(cl_device, ordinal),
                # Our own buffers come back zero-copy: see CLDevice.import_dlpack.
                dlpack_devices=frozenset({(4, ordinal)}),
                description=f"{cl_device.name.strip()} ({platform.name.strip()}, OpenCL {kind})",
                kernel_names=KERNEL_NAMES,
            ))
    if not specs and not reasons:
        reasons.append(f"OpenCL platforms were found but none offers a device; {INSTALL_HINT}")
    return Enumeration(tuple(specs), tuple(reasons))


@polyhal.hookimpl
def register_devices():
    """One DeviceSpec per OpenCL device; its context and queue are made on first use."""
    return list(enumerate_devices().specs)


@polyhal.hookimpl
def report_unavailable():
    """Why fewer OpenCL devices than expected were registered (no platform, empty platforms)."""
    return list(enumerate_devices().reasons)
