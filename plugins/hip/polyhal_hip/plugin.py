"""The HIP backend's hooks: one device, ``hip:<n>``, per AMD GPU that the ROCm runtime reports.

Enumeration calls ``hipRuntimeGetVersion``, ``hipGetDeviceCount`` and, per GPU,
``hipGetDeviceProperties`` / ``hipDeviceGetAttribute`` through the runtime facade
(:mod:`polyhal_hip.runtime`); a stream, the allocator's pools and compiled kernels are made
when the core first uses a device (its spec's factory). ``n`` is the HIP ordinal, so
``HIP_VISIBLE_DEVICES`` renumbers devices as it does for every HIP program.

Where no device is registered, :func:`report_unavailable` says exactly why, and nothing raises:

* the bindings (hip-python) are not installed, or the runtime library ``libamdhip64.so`` is not;
* the runtime reports no GPU (``hipErrorNoDevice``; e.g. no ``/dev/kfd`` access);
* the bindings were made for another major ROCm version than the runtime's (HIP's ABI changes
  between majors), or the runtime lacks a function the bindings call.

Rank: 200 (as CUDA GPUs), ``POLYHAL_HIP_RANK`` overrides. ``POLYHAL_HIP_POOL`` chooses where
device-local buffers come from: ``device`` (default, ``hipMalloc``, kind DEVICE) or ``async``
(the device's stream-ordered pool, ``hipMallocFromPoolAsync``, kind ASYNC; only where the
device reports memory-pool support, else ``device`` and a reason).
"""

from __future__ import annotations

import functools

import polyhal
from polyhal.hal.records import DeviceSpec

from polyhal_gpu.enumeration import Enumeration
from polyhal_hip import runtime
from polyhal_hip.settings import DEFAULT_RANK, POOLS, HIPSettings  # noqa: F401  (re-exported)

POLYHAL_API_VERSION = polyhal.API_VERSION

#: DLPack device types of ROCm memory (kDLROCM, kDLROCMHost).
DL_ROCM, DL_ROCM_HOST = 10, 11


def _rank() -> int:
    return HIPSettings.from_env().rank


def pool_kind() -> str:
    """``POLYHAL_HIP_POOL``: ``device`` (default) or ``async``."""
    return HIPSettings.from_env().pool


def _create(spec: DeviceSpec):
    from polyhal_hip.device import HIPDevice  # kernels and the runtime are loaded on first use only

    return HIPDevice(spec)


def limits_of(props, pool: str, runtime_version: int) -> dict:
    """Device limits shown by ``polyhal devices`` and used for kernels and scratch."""
    from polyhal_hip.runtime import version_tuple

    return {
        "ordinal": props.ordinal, "device": props.name, "arch": props.arch, "arch_base": props.base_arch,
        "multiprocessors": props.multiprocessors, "global_mem_bytes": props.total_memory,
        "shared_mem_per_block": props.shared_mem_per_block, "warp_size": props.warp_size,
        "max_threads_per_block": props.max_threads_per_block, "l2_cache_bytes": props.l2_cache_bytes,
        "managed_memory": props.managed_memory, "concurrent_managed_access": props.concurrent_managed_access,
        "can_map_host_memory": props.can_map_host_memory, "integrated": props.integrated,
        "memory_pools": props.memory_pools, "pool": pool, "pci_bus_id": props.pci_bus_id,
        "runtime_version": ".".join(map(str, version_tuple(runtime_version))),
    }


@functools.lru_cache(maxsize=8)
def _enumerate(pool: str, rank: int) -> Enumeration:
    from polyhal_hip.errors import HipError, HipNoDevice, HipUnavailable, HipVersionMismatch
    from polyhal_hip.runtime import get_runtime

    try:
        rt = get_runtime()
        version = rt.runtime_version()
    except HipUnavailable as exc:
        return Enumeration((), (f"ROCm runtime missing: {exc}",))
    except HipError as exc:
        return Enumeration((), (f"the ROCm runtime does not answer: {exc}",))
    mismatch = ""
    try:
        rt.match()
    except HipVersionMismatch as exc:
        mismatch = f"runtime version does not match the bindings: {exc}"
    except HipError as exc:
        mismatch = f"cannot compare runtime and binding versions: {exc}"
    try:
        count = rt.device_count()
    except HipNoDevice as exc:
        return Enumeration((), (f"no AMD GPU: {exc}",) + ((mismatch,) if mismatch else ()))
    except HipError as exc:
        return Enumeration((), (f"ROCm reports no usable GPU: {exc}",) + ((mismatch,) if mismatch else ()))
    if count == 0:
        return Enumeration((), ("no AMD GPU: hipGetDeviceCount returned 0; check HIP_VISIBLE_DEVICES",))
    if mismatch:
        return Enumeration((), (mismatch,))
    from polyhal_hip.allocator import heaps_for

    # The kernel table is imported when devices are listed, not with the plugin: a process that
    # runs on another backend's device (cpu:0) pays nothing for it.
    from polyhal_hip.kernels import KERNEL_NAMES

    specs, reasons = [], []
    for ordinal in range(count):
        try:
            props = rt.device_properties(ordinal)
        except HipError as exc:
            reasons.append(f"hip:{ordinal}: {exc}")
            continue
        use_pool = pool if props.memory_pools else "device"
        if pool == "async" and not props.memory_pools:
            reasons.append(f"hip:{ordinal}: POLYHAL_HIP_POOL=async, but the device reports no stream-ordered "
                           "memory pools; its device-local buffers come from hipMalloc")
        lim = limits_of(props, use_pool, version)
        caps = {"gpu", "hip", "rocm", props.base_arch, "fp16", "fp64",
                "wave64" if props.warp_size == 64 else "wave32"}
        if props.concurrent_managed_access:
            caps.add("managed-memory")
        if props.memory_pools:
            caps.add("async-pool")
        if props.integrated:
            caps.add("unified-memory")
        if rt.is_fake:
            caps.add("fake-runtime")
        where = " -- FAKE runtime (a stand-in, not ROCm)" if rt.is_fake else ""
        specs.append(DeviceSpec(
            name=f"hip:{ordinal}", backend="hip", rank=rank, factory=_create,
            heaps=heaps_for(props, use_pool), workgroup_bytes=props.shared_mem_per_block,
            capabilities=frozenset(caps), limits=lim,
            dlpack_devices=frozenset({(DL_ROCM, ordinal), (DL_ROCM_HOST, ordinal)}),
            description=(f"{props.name or 'AMD GPU'} (HIP, {props.arch}, {props.multiprocessors} CUs, "
                         f"{props.total_memory / 2**30:.0f} GiB, ROCm {lim['runtime_version']}){where}"),
            kernel_names=KERNEL_NAMES,
        ))
    return Enumeration(tuple(specs), tuple(reasons))


def enumerate_devices() -> Enumeration:
    """Look at every AMD GPU (cached per configuration); never raises for a missing runtime."""
    return _enumerate(pool_kind(), _rank())


def forget_enumeration() -> None:
    """Drop the cached enumeration (the runtime facade was replaced)."""
    _enumerate.cache_clear()


runtime._on_replace.append(forget_enumeration)  # set_runtime() calls it


@polyhal.hookimpl
def register_devices():
    """One DeviceSpec per AMD GPU; its stream, pools and kernels are made on first use."""
    return list(enumerate_devices().specs)


@polyhal.hookimpl
def report_unavailable():
    """Why fewer AMD GPUs than expected were registered (no runtime, no GPU, versions)."""
    return list(enumerate_devices().reasons)
