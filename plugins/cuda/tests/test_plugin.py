"""The plugin without a GPU: it installs, registers no device and says why; enumeration is
pure and cheap. These run everywhere (CI has no GPU)."""

from __future__ import annotations

import builtins
import sys

import numpy as np
import pytest

import polyhal
from polyhal.hal.flags import BufferKind, MemoryType
from polyhal.ops import OPS, core_ops

from polyhal_cuda import plugin


@pytest.fixture
def no_cupy(monkeypatch):
    """Make ``import cupy`` fail, as on a machine without it, and forget cached enumerations."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    plugin._enumerate.cache_clear()
    yield
    plugin._enumerate.cache_clear()


def test_without_cupy_no_device_and_a_reason(no_cupy):
    assert plugin.register_devices() == []
    (reason,) = plugin.report_unavailable()
    assert "cupy is not installed" in reason and "pip install" in reason


def test_polyhal_devices_shows_the_reason(no_cupy, capsys):
    from polyhal import cli
    from polyhal.registry import Registry, set_default_registry

    old = set_default_registry(Registry())
    try:
        assert cli.main(["devices"]) == 0
    finally:
        set_default_registry(old)
    out = capsys.readouterr().out
    assert "plugin 'cuda'" in out and "cupy is not installed" in out
    assert "cuda:0" not in out


def test_entry_point_is_installed():
    from importlib import metadata

    eps = {ep.name: ep.value for ep in metadata.entry_points(group="polyhal.backends")}
    assert eps.get("cuda") == "polyhal_cuda.plugin"
    assert plugin.POLYHAL_API_VERSION == polyhal.API_VERSION


def test_importing_the_package_does_not_import_cupy(no_cupy):
    import importlib

    import polyhal_cuda

    importlib.reload(polyhal_cuda)  # must not raise without cupy
    assert callable(polyhal_cuda.nms)


def test_bad_pool_setting_is_refused(monkeypatch):
    monkeypatch.setenv("POLYHAL_CUDA_POOL", "bogus")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_CUDA_POOL"):
        plugin.pool_kind()
    monkeypatch.setenv("POLYHAL_CUDA_RANK", "high")
    with pytest.raises(polyhal.ConfigError, match="POLYHAL_CUDA_RANK"):
        plugin._rank()


def _limits(**kw):
    props = {"name": b"Fake GPU", "totalGlobalMem": 80 << 30, "sharedMemPerBlock": 48 << 10,
             "sharedMemPerBlockOptin": 227 << 10, "multiProcessorCount": 132, "major": 9, "minor": 0,
             "managedMemory": 1, "canMapHostMemory": 1, **kw}
    return plugin.limits(props, 0, {"pool": "caching", "async_pool_supported": True})


def test_heaps_cover_every_memory_type_and_kind():
    from polyhal_cuda.allocator import MANAGED_MEMORY, PINNED_MEMORY, heaps_for

    heaps = heaps_for(_limits(), "caching")
    kinds = {h.memory_type: h.kind for h in heaps}
    assert kinds == {MemoryType.DEVICE_LOCAL: BufferKind.DEVICE, MANAGED_MEMORY: BufferKind.MANAGED,
                     PINNED_MEMORY: BufferKind.HOST}
    assert heaps_for(_limits(), "async")[0].kind is BufferKind.ASYNC
    assert len(heaps_for(_limits(managedMemory=0), "caching")) == 2
    lim = _limits()
    assert lim["shared_mem_per_block_optin"] == 227 << 10 and lim["device"] == "Fake GPU"


def test_kernel_table_covers_the_op_set():
    from polyhal_cuda import kernels

    # Every op but the fused forms without a CUDA kernel (a host fallback never serves those).
    assert kernels.KERNEL_NAMES == frozenset(n for n, d in core_ops().items() if not d.fused) | set(kernels.TABLE.builders)
    # The long tail of ops the core gained after this backend runs through the host fallback;
    # the op set this backend was built for has CUDA kernels.
    core = {"add", "matmul", "gemm", "softmax", "layer_norm", "transpose", "gather", "cast", "where",
            "reduce_sum", "argmax", "sort", "argsort", "topk", "non_max_suppression", "concat", "slice"}
    assert not core & kernels.HOST_FALLBACK


def test_cuda_sources_are_packaged():
    from polyhal_cuda.cuda_source import source

    for name in ("sort.cu", "nms.cu", "rowwise.cu"):
        text = source(name)
        assert "FULL_MASK" in text and "__global__" in text


class _FakeDevice:
    def __init__(self, optin=227 << 10, sms=132):
        from polyhal_cuda.allocator import heaps_for

        self.spec = polyhal.DeviceSpec("cuda:0", "cuda", 200, lambda s: None, workgroup_bytes=optin,
                                       heaps=heaps_for(_limits(), "caching"), limits={"multiprocessors": sms})


@pytest.mark.parametrize("shape,axis,op,path", [
    ((65536, 256), -1, "sort", "rows"),        # many short lanes: one block each, shared memory
    ((1 << 24,), 0, "sort", "radix"),          # one long lane: radix over the whole GPU
    ((4000,), 0, "argsort", "rows"),           # small: one block's bitonic network
    ((10_000,), 0, "argsort", "radix"),        # one lane of 16384 padded pairs: radix is faster
    ((100_000,), 0, "argsort", "radix"),
    ((1000,), 0, "argsort", "rows"),
    ((4, 100_000), 1, "topk", "radix"),
    ((300, 12_000), 1, "sort", "rows"),        # fits shared memory and fills the GPU
    ((300, 20_000), 1, "sort", "radix"),       # 32768 padded pairs: too big for shared memory
])
def test_sort_path_choice(shape, axis, op, path):
    from polyhal.ir.types import TensorType

    from polyhal_cuda import sorting

    attrs = {"axis": axis, "descending": False} if op != "topk" else {"axis": axis, "k": 5, "largest": True,
                                                                      "sorted": False}
    plan = sorting.plan_sort(_FakeDevice(), op, attrs, TensorType(shape, np.float32))
    assert plan.path == path
    if path == "radix":
        assert plan.payload == (op != "sort" or plan.lanes > 1)
        assert len(plan.passes) == 4 + (0 if plan.lanes == 1 else -(-(plan.lanes - 1).bit_length() // 8))


def test_sort_scratch_declarations_are_placed_by_the_policy():
    from polyhal.hal.scratch import MemoryLimits, MemorySpace, place_scratch
    from polyhal.ir.types import TensorType

    from polyhal_cuda import sorting

    dev = _FakeDevice()
    small = sorting.scratch_requests(dev, "argsort", {"axis": -1, "descending": True},
                                     (TensorType((64, 256), np.float32),), (TensorType((64, 256), np.int64),))
    policy = polyhal.default_registry().memory_space_policy(dev.spec)
    (a,) = place_scratch(small, MemoryLimits.of(dev.spec), dev.spec.name, policy)
    assert a.space is MemorySpace.WORKGROUP and a.nbytes == 256 * 8
    big = sorting.scratch_requests(dev, "sort", {"axis": 0, "descending": False},
                                   (TensorType((1 << 20,), np.float32),), (TensorType((1 << 20,), np.float32),))
    placed = place_scratch(big, MemoryLimits.of(dev.spec), dev.spec.name, policy)
    assert {p.request.name for p in placed} == ({"keys", "aux"} if sorting.RADIX_IMPL == "onesweep"
                                                else {"keys", "hist", "totals"})
    assert all(p.space is MemorySpace.GLOBAL for p in placed)
