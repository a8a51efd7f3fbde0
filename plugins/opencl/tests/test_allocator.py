"""CLAllocator: heaps, limits, mapping, the caching pool and coherence of host-visible memory."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.hal.flags import BufferKind, BufferUsage, MemoryAccess, MemoryType
from polyhal_opencl.allocator import BufferPool, is_unified, size_class

HOST_VISIBLE = MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE


def _host_heap(dev):
    heaps = [h for h in dev.allocator.heaps if h.memory_type & MemoryType.HOST_VISIBLE]
    if not heaps:
        pytest.skip(f"{dev.name} has no host-visible heap (not unified memory)")
    return heaps[0]


def test_heaps_follow_the_memory_model(dev):
    device_heap = dev.allocator.heaps[0]
    assert device_heap.memory_type == MemoryType.DEVICE_LOCAL and device_heap.kind == BufferKind.DEVICE
    assert not device_heap.allowed_usage & BufferUsage.MAPPING_SCOPED
    if is_unified(dev.cl_device):
        heap = _host_heap(dev)
        assert heap.kind == BufferKind.HOST and heap.memory_type & MemoryType.HOST_COHERENT
    else:
        assert len(dev.allocator.heaps) == 1


def test_allocation_above_max_names_the_limit(dev):
    limit = dev.cl_device.max_mem_alloc_size
    with pytest.raises(polyhal.IncompatibleBufferError, match=str(limit)):
        dev.allocator.allocate(limit + 1)


def test_mapping_device_only_memory_raises(dev):
    with dev.allocator.allocate(64, MemoryType.DEVICE_LOCAL) as buf:
        assert buf.native.size >= 64
        with pytest.raises(polyhal.MappingError, match="HOST_VISIBLE"):
            buf.map()


def test_size_classes():
    assert size_class(1, 1 << 30) == 256
    assert size_class(4096, 1 << 30) == 4096
    assert size_class(4097, 1 << 30) == 5120  # 1.25 * 4096
    for n in (257, 1000, 3 << 20, 12345678):
        c = size_class(n, 1 << 30)
        assert n <= c <= n * 1.25 + 256
    assert size_class(1000, 1010) == 1010  # never below the request, never above the heap's limit


def test_pool_reuses_and_trim_releases(dev):
    a = dev.allocator
    a.trim()
    buf = a.allocate(3000, MemoryType.DEVICE_LOCAL)
    handle = buf.native.int_ptr
    buf.release()
    assert a.pool.cached_bytes == size_class(3000, 1 << 40)
    again = a.allocate(2900, MemoryType.DEVICE_LOCAL)  # same size class: the same cl_mem
    assert again.native.int_ptr == handle
    again.release()
    assert a.trim() == size_class(3000, 1 << 40) and a.pool.cached_bytes == 0
    assert not a.pool.drain() and handle not in a._maps  # nothing of ours references it any more
    fresh = a.allocate(3000, MemoryType.DEVICE_LOCAL)  # the pool is empty: a new cl_mem
    assert a.pool.misses and fresh.native is not buf.native
    fresh.release()


def test_pool_is_bounded():
    pool = BufferPool(limit_bytes=1000)
    assert pool.give((1, 512), "a") and not pool.give((1, 512), "b")
    assert pool.take((1, 512)) == "a" and pool.take((1, 512)) is None
    assert pool.drain() == []


def test_failed_allocation_trims_and_retries(dev, monkeypatch):
    a = dev.allocator
    a.allocate(5000, MemoryType.DEVICE_LOCAL).release()  # something cached to trim
    real, calls = a._create, []

    def flaky(heap, size):
        calls.append(size)
        if len(calls) == 1:
            raise MemoryError("CL_MEM_OBJECT_ALLOCATION_FAILURE")
        return real(heap, size)

    monkeypatch.setattr(a, "_create", flaky)
    with a.allocate(70000, MemoryType.DEVICE_LOCAL):
        pass
    assert len(calls) == 2 and a.pool.cached_bytes <= size_class(70000, 1 << 40)


def test_out_of_memory_is_reported_with_statistics(dev, monkeypatch):
    def no_memory(heap, size):
        raise MemoryError("CL_MEM_OBJECT_ALLOCATION_FAILURE")

    monkeypatch.setattr(dev.allocator, "_create", no_memory)
    with pytest.raises(polyhal.OutOfMemoryError, match="CL_MEM_OBJECT_ALLOCATION_FAILURE"):
        dev.allocator.allocate(1 << 20, MemoryType.DEVICE_LOCAL)


def test_host_visible_mapping_is_coherent_with_kernels(dev, rng):
    heap = _host_heap(dev)
    x = rng.standard_normal(256).astype(np.float32)
    t = polyhal.asarray(x, device=dev, memory_type=heap.memory_type)
    view = t.buffer.map(MemoryAccess.READ | MemoryAccess.WRITE).view(np.float32)[:256]
    view[:] *= 2  # host writes through the persistent mapping ...
    b = polyhal.ProgramBuilder("neg")
    b.output(b.neg(b.input("x", (256,))))
    out = polyhal.empty((256,), "float32", dev, memory_type=heap.memory_type)
    polyhal.compile(b.build(), dev.name)(t, out=[out])  # ... a kernel reads them and writes out
    got = out.buffer.map(MemoryAccess.READ).view(np.float32)[:256]  # the map waits for the queue
    np.testing.assert_array_equal(got, -2 * x)


def test_close_and_map_with_an_adaptor_installed(cl_spec, monkeypatch):
    """PoCL: with adaptors over the OpenCL allocator (POLYHAL_ALLOCATOR), buffers still map and
    close() still trims, through ``native_allocator``."""
    from polyhal.registry import Registry
    from polyhal_opencl.allocator import CLAllocator

    monkeypatch.setenv("POLYHAL_ALLOCATOR", "pool,stats")
    monkeypatch.setenv("POLYHAL_BACKENDS", "opencl")
    dev = Registry().get_device(cl_spec.name)
    assert isinstance(dev.native_allocator, CLAllocator) and dev.allocator is not dev.native_allocator
    host = np.arange(256, dtype=np.float32)
    visible = next(h.memory_type for h in dev.native_allocator.heaps if h.memory_type & polyhal.MemoryType.HOST_VISIBLE)
    t = polyhal.asarray(host, device=dev, memory_type=visible)
    assert np.array_equal(np.asarray(t.buffer.map()).view(np.float32), host)
    assert np.array_equal(t.numpy(), host)
    t.release()
    dev.close()  # finishes the queue and trims the allocator's cache; an adaptor has no trim()
