"""The CUDA backend's hooks: one device, ``cuda:<n>``, per NVIDIA GPU that CUDA enumerates.

Enumeration calls only ``cudaGetDeviceCount`` and ``cudaGetDeviceProperties`` (through
cupy's runtime bindings), which create no CUDA context: a context, a stream and pools are made
when the core first uses a device (its spec's factory). ``n`` is the CUDA device ordinal, so
``CUDA_VISIBLE_DEVICES`` renumbers devices exactly as it does for cupy and torch.

Rank (higher is preferred): 200, above OpenCL GPUs (100) and the numpy CPU (0), because on the
same GPU this backend runs the op set through cuBLAS, cupy's kernels and its own CUDA C, and
replays plans as CUDA graphs. ``POLYHAL_CUDA_RANK`` overrides it (one integer for every GPU).

``POLYHAL_CUDA_POOL`` picks where device-local buffers come from (a policy choice, see
:mod:`polyhal_cuda.allocator`): ``caching`` (default; cupy's caching pool, buffers of kind
DEVICE) or ``async`` (CUDA's stream-ordered pool, ``cudaMallocFromPoolAsync``, kind ASYNC).

Without cupy, without a driver, or without a GPU, no device is registered and
:func:`report_unavailable` says why; nothing raises (the plugin installs everywhere).
"""

from __future__ import annotations

import functools
from typing import Any

import polyhal
from polyhal.distribution import install_hint
from polyhal.hal.records import DeviceSpec

from polyhal_cuda import cudnn
from polyhal_cuda.layout import resolve_encoding  # noqa: F401  (hook: channels-last conv chains)
from polyhal_cuda.settings import DEFAULT_RANK, POOLS, CUDASettings  # noqa: F401  (re-exported)
from polyhal_gpu.enumeration import Enumeration

POLYHAL_API_VERSION = polyhal.API_VERSION

#: DLPack device types (kDLCUDA, kDLCUDAHost, kDLCUDAManaged).
DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 2, 3, 13


def install_hint_for_cupy() -> str:
    """What to install for cupy, the way polyhal was installed (a checkout or an index)."""
    return (f"install cupy for your CUDA driver: {install_hint('polyhal-cuda', 'cuda13')} "
            "(or [cuda12]), i.e. cupy-cuda13x / cupy-cuda12x")

def _rank() -> int:
    return CUDASettings.from_env().rank


def pool_kind() -> str:
    """``POLYHAL_CUDA_POOL``: ``caching`` (default) or ``async``."""
    return CUDASettings.from_env().pool


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def limits(props: dict, ordinal: int, extra: dict) -> dict[str, Any]:
    """Device limits shown by ``polyhal devices`` and used when sizing kernels and scratch."""
    return {
        "ordinal": ordinal,
        "device": _text(props.get("name", "")).strip(),
        "compute_capability": f"{props.get('major', 0)}.{props.get('minor', 0)}",
        "multiprocessors": int(props.get("multiProcessorCount", 0)),
        "global_mem_bytes": int(props.get("totalGlobalMem", 0)),
        "l2_cache_bytes": int(props.get("l2CacheSize", 0)),
        "shared_mem_per_block": int(props.get("sharedMemPerBlock", 0)),
        "shared_mem_per_block_optin": int(props.get("sharedMemPerBlockOptin", 0) or props.get("sharedMemPerBlock", 0)),
        "shared_mem_per_multiprocessor": int(props.get("sharedMemPerMultiprocessor", 0)),
        "registers_per_block": int(props.get("regsPerBlock", 0)),
        "registers_per_multiprocessor": int(props.get("regsPerMultiprocessor", 0)),
        "max_threads_per_block": int(props.get("maxThreadsPerBlock", 1024)),
        "warp_size": int(props.get("warpSize", 32)),
        "managed_memory": bool(props.get("managedMemory", 0)),
        "concurrent_managed_access": bool(props.get("concurrentManagedAccess", 0)),
        "can_map_host_memory": bool(props.get("canMapHostMemory", 1)),
        "pci_bus_id": f"{int(props.get('pciDomainID', 0)):04x}:{int(props.get('pciBusID', 0)):02x}:"
                      f"{int(props.get('pciDeviceID', 0)):02x}",
        **extra,
    }


def _create(spec: DeviceSpec):
    # Imported here: the device module pulls in kernels and cupy, which enumeration avoids.
    from polyhal_cuda.device import CUDADevice

    return CUDADevice(spec)


def conv_path(conv: tuple[str | None, str]) -> tuple[dict[str, str], frozenset[str]]:
    """``limits["conv"]`` and the kernel set for cuDNN's :func:`~polyhal_cuda.cudnn.status`
    ``conv``: ``fused_conv`` only where cuDNN runs it (else the compile keeps convs unfused)."""
    # The kernel table is imported when devices are listed, not with the plugin: a process that
    # runs on another backend's device (cpu:0) pays nothing for it.
    from polyhal_cuda.kernels import KERNEL_NAMES

    version, why = conv
    if version is not None:
        return {"conv": f"{version}, fp32 without TF32"}, KERNEL_NAMES
    return {"conv": f"im2col + cuBLAS fallback: {why}"}, KERNEL_NAMES - {"fused_conv"}


@functools.lru_cache(maxsize=8)
def _enumerate(pool: str, rank: int, conv: tuple[str | None, str] = (None, "")) -> Enumeration:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import runtime
    except ImportError as exc:
        return Enumeration((), (f"cupy is not installed ({exc}); {install_hint_for_cupy()}",))
    except Exception as exc:  # noqa: BLE001 - a broken cupy install must not break polyhal
        return Enumeration((), (f"cupy cannot be imported ({type(exc).__name__}: {exc}); {install_hint_for_cupy()}",))
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device, driver too old
        return Enumeration((), (f"CUDA reports no usable GPU ({type(exc).__name__}: {exc}); install the NVIDIA "
                                "driver, check CUDA_VISIBLE_DEVICES, or match cupy's CUDA version to the driver",))
    if count == 0:
        return Enumeration((), ("CUDA found no GPU (cudaGetDeviceCount returned 0); check CUDA_VISIBLE_DEVICES",))
    from polyhal_cuda.allocator import heaps_for

    specs, reasons = [], []
    for ordinal in range(count):
        try:
            props = runtime.getDeviceProperties(ordinal)
            try:  # cudaDevAttrMemoryPoolsSupported
                async_ok = bool(runtime.deviceGetAttribute(115, ordinal))
            except Exception:  # noqa: BLE001
                async_ok = False
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"cuda:{ordinal}: cudaGetDeviceProperties failed ({type(exc).__name__}: {exc})")
            continue
        conv_limits, kernel_names = conv_path(conv)
        lim = limits(props, ordinal, {"pool": pool if async_ok else "caching", "async_pool_supported": async_ok,
                                      **conv_limits})
        # ftz: cupy compiles every kernel with -ftz=true (fixed in cupy.cuda.compiler), and
        # polyhal's own CUDA C goes through the same compiler, so float32 denormals flush to zero.
        caps = {"gpu", "cuda", "fp16", "fp64", "cuda-graphs", "ftz", f"sm_{props.get('major', 0)}{props.get('minor', 0)}"}
        if lim["managed_memory"]:
            caps.add("managed-memory")
        if async_ok:
            caps.add("async-pool")
        if conv[0] is not None:
            caps.add("cudnn")
        if props.get("major", 0) >= 8:  # Ampere and later: TF32 tensor cores (precision="tf32")
            caps.add("tf32")
        specs.append(DeviceSpec(
            name=f"cuda:{ordinal}", backend="cuda", rank=rank, factory=_create,
            # A block may use up to the opt-in maximum of shared memory (kernels opt in as needed).
            heaps=heaps_for(lim, lim["pool"]), workgroup_bytes=lim["shared_mem_per_block_optin"],
            capabilities=frozenset(caps), limits=lim,
            dlpack_devices=frozenset({(DL_CUDA, ordinal), (DL_CUDA_MANAGED, ordinal), (DL_CUDA_HOST, ordinal)}),
            description=(f"{lim['device']} (CUDA, sm_{props.get('major', 0)}{props.get('minor', 0)}, "
                         f"{lim['multiprocessors']} SMs, {lim['global_mem_bytes'] / 2**30:.0f} GiB)"),
            kernel_names=kernel_names,
        ))
        if pool == "async" and not async_ok:
            reasons.append(f"cuda:{ordinal}: POLYHAL_CUDA_POOL=async, but the device has no stream-ordered "
                           "memory pools; using the caching pool")
    return Enumeration(tuple(specs), tuple(reasons))


def enumerate_devices() -> Enumeration:
    """Look at every CUDA device (cached per configuration); never raises for a missing driver."""
    # cuDNN's status is part of the key: POLYHAL_CUDA_CUDNN may change it (the library loads once).
    return _enumerate(pool_kind(), _rank(), cudnn.status())


@polyhal.hookimpl
def register_devices():
    """One DeviceSpec per CUDA GPU; its context, stream and pools are made on first use."""
    return list(enumerate_devices().specs)


@polyhal.hookimpl
def report_unavailable():
    """Why fewer CUDA devices than expected were registered (no cupy, no driver, no GPU)."""
    return list(enumerate_devices().reasons)
