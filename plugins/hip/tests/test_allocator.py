"""Every HIP buffer type, allocated and freed by kind -- on FakeHipRuntime (a stand-in, not
ROCm), which records each HIP call and refuses double frees and wrong free calls as HIP does."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest

import polyhal
from polyhal import BufferKind, MemoryType
from polyhal.errors import IncompatibleBufferError, OutOfMemoryError
from polyhal_hip import runtime as hip
from polyhal_hip.allocator import MANAGED_MEMORY, PINNED_MEMORY, PINNED_NONCOHERENT_MEMORY
from polyhal_hip.errors import HipError, HipSymbolNotFound

from fake_runtime import gpu


def _device(make_fake, monkeypatch, pool="device", **props):
    from polyhal.registry import Registry, set_default_registry

    fake = make_fake(devices=[gpu(0, **props)])
    monkeypatch.setenv("POLYHAL_BACKENDS", "hip,cpu")
    monkeypatch.setenv("POLYHAL_HIP_POOL", pool)
    reg = Registry()
    old = set_default_registry(reg)
    return fake, reg.get_device("hip:0"), lambda: set_default_registry(old)


@pytest.fixture
def device_of(make_fake, monkeypatch):
    undo = []

    def make(pool="device", **props):
        fake, dev, restore = _device(make_fake, monkeypatch, pool, **props)
        undo.append(restore)
        return fake, dev

    yield make
    for u in undo:
        u()


def _calls_between(fake, action):
    start = len(fake.calls)
    action()
    return fake.calls[start:]


@pytest.mark.parametrize("memory_type, kind, alloc_call, free_call", [
    (MemoryType.DEVICE_LOCAL, BufferKind.DEVICE, "hipMalloc", "hipFree"),
    (MANAGED_MEMORY, BufferKind.MANAGED, "hipMallocManaged", "hipFree"),
    (PINNED_MEMORY, BufferKind.HOST, "hipHostMalloc", "hipHostFree"),
    (PINNED_NONCOHERENT_MEMORY, BufferKind.HOST, "hipHostMalloc", "hipHostFree"),
])
def test_each_heap_allocates_and_frees_by_kind(fake, fake_device, memory_type, kind, alloc_call, free_call):
    a = fake_device.allocator
    calls = _calls_between(fake, lambda: setattr(test_each_heap_allocates_and_frees_by_kind, "buf",
                                                  a.allocate(4096, memory_type)))
    buf = test_each_heap_allocates_and_frees_by_kind.buf
    del test_each_heap_allocates_and_frees_by_kind.buf
    assert alloc_call in calls and buf.kind is kind and buf.memory_type == memory_type
    assert fake.live()[-1].nbytes == 4096
    freed = _calls_between(fake, buf.release)
    assert freed.count(free_call) == 1
    assert not [b for b in fake.live() if b.addr == buf.native.ptr or b.addr == buf.native.host_ptr]
    assert _calls_between(fake, buf.release) == []  # idempotent: nothing is freed twice


def test_pinned_flags_coherent_and_non_coherent(fake, fake_device):
    a = fake_device.allocator
    coherent = a.allocate(256, PINNED_MEMORY)
    noncoherent = a.allocate(256, MemoryType.HOST_VISIBLE | MemoryType.HOST_CACHED)
    flags = {b.addr: b.flags for b in fake.live("host")}
    fc, fn = flags[coherent.native.host_ptr], flags[noncoherent.native.host_ptr]
    assert fc & hip.HOST_MALLOC_COHERENT and fc & hip.HOST_MALLOC_MAPPED and not fc & hip.HOST_MALLOC_NON_COHERENT
    # hip-python's hipHostMallocNonCoherent is negative; the facade passes it as 0x80000000
    assert fn & hip.HOST_MALLOC_NON_COHERENT and 0 <= fn <= 0xFFFFFFFF and not fn & hip.HOST_MALLOC_COHERENT
    assert noncoherent.native.coherent is False and coherent.native.coherent is True


def test_managed_is_prefetched_to_the_gpu(fake, fake_device):
    calls = _calls_between(fake, lambda: fake_device.allocator.allocate(1024, MANAGED_MEMORY).release())
    assert calls.index("hipMallocManaged") < calls.index("hipMemPrefetchAsync") < calls.index("hipFree")


def test_async_pool_buffers_are_freed_exactly_once(device_of):
    fake, dev = device_of(pool="async")
    a = dev.allocator
    assert a.heaps[0].kind is BufferKind.ASYNC and dev.spec.limits["pool"] == "async"
    # 1. released: one hipFreeAsync on the device's stream
    buf = a.allocate(1 << 16, MemoryType.DEVICE_LOCAL)
    assert buf.kind is BufferKind.ASYNC and "hipMallocFromPoolAsync" in fake.calls
    assert _calls_between(fake, buf.release).count("hipFreeAsync") == 1
    # 2. dealloca (queue-ordered free) then release, then garbage collection: still one free
    buf = a.allocate(1 << 16, MemoryType.DEVICE_LOCAL)
    calls = _calls_between(fake, lambda: (a.dealloca(buf), buf.release(), a.dealloca(buf)))
    assert calls.count("hipFreeAsync") == 1
    del buf
    gc.collect()
    assert fake.calls.count("hipFreeAsync") == 2 and a.frees[BufferKind.ASYNC] == 2
    assert a.statistics.live_count == 0


def test_async_kind_per_allocation_and_dealloca_of_device_memory(fake, fake_device):
    a = fake_device.allocator
    buf = a.allocate(4096, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC)
    assert buf.kind is BufferKind.ASYNC
    assert _calls_between(fake, lambda: (a.dealloca(buf), buf.release())).count("hipFreeAsync") == 1
    dev_buf = a.allocate(4096, MemoryType.DEVICE_LOCAL, kind=BufferKind.DEVICE)
    calls = _calls_between(fake, lambda: (a.dealloca(dev_buf), dev_buf.release()))
    assert calls.count("hipFree") == 1 and "hipFreeAsync" not in calls
    with pytest.raises(IncompatibleBufferError, match="device-local"):
        a.allocate(64, PINNED_MEMORY, kind=BufferKind.ASYNC)
    with pytest.raises(IncompatibleBufferError, match="cannot be asked for"):
        a.allocate(64, MemoryType.DEVICE_LOCAL, kind=BufferKind.MANAGED)


def test_async_without_memory_pools(device_of):
    fake, dev = device_of(pool="async", memory_pools=False)
    assert dev.allocator.heaps[0].kind is BufferKind.DEVICE
    from polyhal_hip import plugin

    assert any("no stream-ordered memory pools" in r for r in plugin.report_unavailable())
    with pytest.raises(IncompatibleBufferError, match="no stream-ordered memory pools"):
        dev.allocator.allocate(64, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC)


def test_managed_needs_concurrent_access_else_pinned_host(device_of):
    fake, dev = device_of(concurrent_managed_access=False)
    kinds = [h.kind for h in dev.allocator.heaps]
    assert BufferKind.MANAGED not in kinds
    buf = dev.allocator.allocate(4096, MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE)
    assert buf.kind is BufferKind.HOST and buf.memory_type == PINNED_MEMORY
    assert "hipHostMalloc" in fake.calls and "hipMallocManaged" not in fake.calls
    buf.map()[:] = 7  # host-visible as promised
    buf.release()


def test_memory_type_the_device_cannot_serve(device_of):
    fake, dev = device_of(concurrent_managed_access=False, can_map_host_memory=False)
    before = dev.allocator.statistics.live_count
    for mt in (MemoryType.HOST_VISIBLE, MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE, MemoryType.HOST_CACHED):
        with pytest.raises(IncompatibleBufferError, match="serves"):
            dev.allocator.allocate(4096, mt)
    assert dev.allocator.statistics.live_count == before
    assert not [c for c in fake.calls if c.startswith(("hipHostMalloc", "hipMallocManaged"))]


def test_host_registered_memory(fake, fake_device):
    host = np.arange(1024, dtype=np.float32)
    a = fake_device.allocator
    buf = a.import_host(host)
    assert buf.kind is BufferKind.HOST_REGISTERED and buf.native.owner is host
    assert fake.calls[-2:] == ["hipHostRegister", "hipHostGetDevicePointer"]
    assert np.shares_memory(np.frombuffer(buf.map(), np.float32), host)
    with pytest.raises(HipError, match="hipErrorHostMemoryAlreadyRegistered"):
        a.import_host(host)
    calls = _calls_between(fake, buf.release)
    assert calls.count("hipHostUnregister") == 1 and "hipHostFree" not in calls
    assert buf.native.owner is None  # the memory stays the array's
    assert a.statistics.live_count == 0


def test_out_of_memory_says_device_and_use(fake, fake_device):
    a = fake_device.allocator
    keep = a.allocate(1000, MemoryType.DEVICE_LOCAL)
    fake.inject("hipMalloc", 2)
    with pytest.raises(OutOfMemoryError, match=r"out of memory on hip:0.*hipErrorOutOfMemory") as info:
        a.allocate(1 << 20, MemoryType.DEVICE_LOCAL)
    assert "1000 B in 1 buffers" in str(info.value)
    assert a.statistics.live_count == 1
    keep.release()


def test_a_refused_free_warns_and_never_raises(fake, fake_device):
    a = fake_device.allocator
    buf = a.allocate(64, MemoryType.DEVICE_LOCAL)
    fake.inject("hipFree", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf.release()
    assert caught and "hipErrorInvalidValue" in str(caught[0].message)
    assert a.free_failures and a.free_failures[0][0] is BufferKind.DEVICE
    assert a.statistics.live_count == 0  # accounting still balances


def test_runtime_too_old_for_a_call(make_fake, fake_registry):
    fake = make_fake(missing={"hipMallocFromPoolAsync"})
    from polyhal.registry import Registry

    dev = Registry().get_device("hip:0")
    with pytest.raises(HipSymbolNotFound, match="hipMallocFromPoolAsync") as info:
        dev.allocator.allocate(64, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC)
    assert info.value.symbol == "hipMallocFromPoolAsync"
    assert dev.allocator.statistics.live_count == 0
    assert fake.live("async") == []


def test_fake_refuses_double_and_wrong_frees(fake):
    """The stand-in checks what HIP checks (so the tests above would catch a double free)."""
    p = fake.malloc(64)
    fake.free(p)
    with pytest.raises(HipError, match="hipErrorInvalidValue"):
        fake.free(p)
    h = fake.host_malloc(64, hip.HOST_MALLOC_MAPPED)
    with pytest.raises(HipError, match="hipErrorInvalidValue"):
        fake.free(h)  # pinned memory needs hipHostFree
    with pytest.raises(OverflowError):
        fake.host_malloc(64, -2147483648)  # hip-python's negative constant, unmasked


def test_statistics_balance_across_kinds(fake, fake_device):
    a = fake_device.allocator
    bufs = [a.allocate(1000 + i, h.memory_type) for i, h in enumerate(a.heaps)]
    bufs.append(a.import_host(np.zeros(100, np.uint8)))
    assert a.statistics.live_count == len(a.heaps) + 1
    del bufs
    gc.collect()
    assert a.statistics.live_count == 0 and a.statistics.live_bytes == 0
    assert not fake.live()


def test_close_and_map_with_an_adaptor_installed(device_of, monkeypatch):
    """Stand-in runtime: with adaptors over the HIP allocator (POLYHAL_ALLOCATOR), buffers still
    map and close() still trims the pool, through ``native_allocator``."""
    from polyhal_hip.allocator import HIPAllocator

    monkeypatch.setenv("POLYHAL_ALLOCATOR", "pool,stats")
    fake, dev = device_of()
    assert isinstance(dev.native_allocator, HIPAllocator) and dev.allocator is not dev.native_allocator
    t = polyhal.asarray(np.arange(64, dtype=np.float32), device=dev, memory_type=PINNED_MEMORY)
    assert np.array_equal(np.asarray(t.buffer.map()).view(np.float32), np.arange(64, dtype=np.float32))
    t.release()
    dev.close()  # trims the HIP pool; an adaptor has no trim()
