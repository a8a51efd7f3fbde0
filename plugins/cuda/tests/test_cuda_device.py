"""Devices, allocators of every memory type, out-of-memory, transfers, launch errors (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.flags import BufferKind, MemoryAccess, MemoryType

from polyhal_cuda.allocator import MANAGED_MEMORY, PINNED_MEMORY


def test_enumeration_and_limits(cuda, cp):
    spec = cuda.spec
    assert spec.rank == 200 and spec.name == f"cuda:{cuda.ordinal}"
    props = cp.cuda.runtime.getDeviceProperties(cuda.ordinal)
    assert spec.limits["global_mem_bytes"] == props["totalGlobalMem"]
    assert spec.limits["shared_mem_per_block_optin"] == props["sharedMemPerBlockOptin"]
    assert spec.limits["registers_per_block"] == props["regsPerBlock"]
    assert spec.workgroup_bytes == props["sharedMemPerBlockOptin"]
    assert {(2, cuda.ordinal), (3, cuda.ordinal), (13, cuda.ordinal)} <= spec.dlpack_devices
    assert "cuda-graphs" in spec.capabilities


@pytest.mark.parametrize("memory_type,kind", [
    (MemoryType.DEVICE_LOCAL, None), (MANAGED_MEMORY, BufferKind.MANAGED), (PINNED_MEMORY, BufferKind.HOST)])
def test_every_memory_type_records_its_kind(cuda, cp, memory_type, kind):
    a = cuda.allocator
    before = a.statistics.live_bytes
    buf = a.allocate(1 << 20, memory_type)
    want = kind or a.heaps[0].kind
    assert buf.kind is want and buf.native.kind is want
    attrs = cp.cuda.runtime.pointerGetAttributes(buf.native.ptr)
    assert attrs.type == {BufferKind.DEVICE: 2, BufferKind.ASYNC: 2, BufferKind.MANAGED: 3, BufferKind.HOST: 1}[want]
    data = np.arange(1 << 18, dtype=np.uint32)
    t = polyhal.Tensor(buf, polyhal.TensorType((1 << 18,), "uint32"))
    cuda.write(buf, 0, data)
    assert np.array_equal(t.numpy(), data)
    if buf.host_visible:
        assert np.array_equal(buf.map(MemoryAccess.READ).view(np.uint32), data)
    buf.release()
    assert a.statistics.live_bytes == before


def test_async_pool_buffers(cuda, cp):
    if not cuda.spec.limits.get("async_pool_supported"):
        pytest.skip("no stream-ordered pool on this device")
    buf = cuda.allocator.allocate(4096, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC)
    assert buf.kind is BufferKind.ASYNC
    t = polyhal.Tensor(buf, polyhal.TensorType((1024,), "float32"))
    t.native[...] = 3.0
    assert float(t.native.sum()) == 3.0 * 1024
    buf.release()
    with pytest.raises(polyhal.IncompatibleBufferError):
        cuda.allocator.allocate(4096, MANAGED_MEMORY, kind=BufferKind.ASYNC)


def test_out_of_memory_names_device_request_and_use_and_leaks_nothing(cuda, cp):
    import gc

    a = cuda.allocator
    total = cuda.spec.limits["global_mem_bytes"]
    gc.collect()  # buffers of earlier tests waiting in cycles would otherwise go mid-test
    before = (a.statistics.live_bytes, a.statistics.live_count)
    keep = a.allocate(int(total * 0.6), MemoryType.DEVICE_LOCAL)
    with pytest.raises(polyhal.OutOfMemoryError) as info:
        a.allocate(int(total * 0.6), MemoryType.DEVICE_LOCAL)
    msg = str(info.value)
    assert cuda.name in msg and str(int(total * 0.6)) in msg and "in use by polyhal" in msg and "bytes free" in msg
    keep.release()
    assert (a.statistics.live_bytes, a.statistics.live_count) == before
    again = a.allocate(int(total * 0.6), MemoryType.DEVICE_LOCAL)  # the pool still works
    again.release()
    a.trim()


def test_managed_memory_is_never_oversubscribed(cuda, cp):
    a = cuda.allocator
    free, total = a.memory_info()
    before = a.statistics.live_bytes
    with pytest.raises(polyhal.OutOfMemoryError, match="managed memory"):
        a.allocate(total - (64 << 20), MANAGED_MEMORY)  # more than is free: refused before CUDA is asked
    assert a.statistics.live_bytes == before


@pytest.mark.parametrize("nbytes", [1, 4095, 3 << 20, (5 << 20) + 3, (64 << 20) + 12345, (130 << 20) + 7])
def test_pageable_transfers_roundtrip(cuda, rng, nbytes):
    host = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    t = polyhal.asarray(host, device=cuda)
    back = np.empty_like(host)
    cuda.read(t.buffer, 0, back)
    assert np.array_equal(back, host), f"seed {rng.seed_value}"
    assert np.array_equal(t.numpy(), host)


def test_kernel_launch_error_is_readable(cuda, cp):
    from polyhal_cuda.cuda_source import function
    from polyhal_cuda.errors import KernelLaunchError

    fn = function(cuda, "rowwise.cu", ["softmax_rows<float>"], "softmax_rows<float>")
    x = cp.ones((4, 8), cp.float32)
    with pytest.raises(KernelLaunchError) as info:
        cuda.launch(fn, "softmax_rows<float>", (4,), (4096,), (x, x, np.int64(4), np.int32(8)))
    assert "softmax_rows<float>" in str(info.value) and "block (4096,)" in str(info.value)
    assert info.value.kernel == "softmax_rows<float>"
    cuda.launch(fn, "softmax_rows<float>", (4,), (32,), (x, x, np.int64(4), np.int32(8)))  # the context lives on
    assert np.allclose(cp.asnumpy(x), 1 / 8)


def test_synchronize_is_per_stream(cuda, cp):
    t = polyhal.asarray(np.ones(1024, np.float32), device=cuda)
    cuda.synchronize()
    assert cuda.stream.done
    del t
