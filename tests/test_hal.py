"""HAL vocabulary, buffers, tensors and DLPack exchange on the CPU device."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import polyhal
from polyhal import BufferUsage, MemoryAccess, MemoryType
from polyhal.hal.flags import BUFFER_USAGE, HOST_MAPPING_USAGE, MAPPABLE_BUFFER_USAGE, MAPPING_USAGE


def test_flag_values_are_irees():
    assert MemoryType.DEVICE_LOCAL == 0x30 and MemoryType.HOST_LOCAL == 0x46
    assert BufferUsage.DEFAULT == 0xC03 and BufferUsage.MAPPING == (1 << 24 | 1 << 27)
    assert MemoryAccess.DISCARD_WRITE == 6 and MemoryAccess.ALL == 7
    assert (MemoryType.DEVICE_LOCAL | MemoryType.HOST_VISIBLE).describe() == "DEVICE_LOCAL|HOST_VISIBLE"


def test_cpu_heap_is_host_local_and_device_local():
    dev = polyhal.get_device("cpu:0")
    heap = dev.allocator.heaps[0]
    assert heap.memory_type & MemoryType.HOST_LOCAL == MemoryType.HOST_LOCAL
    assert heap.memory_type & MemoryType.DEVICE_LOCAL == MemoryType.DEVICE_LOCAL
    with dev.allocator.allocate(100) as buf:
        assert dev.buffer_address(buf) % 64 == 0


def test_buffer_repr_and_release():
    dev = polyhal.get_device("cpu:0")
    buf = dev.allocator.allocate(10)
    assert "live" in repr(buf)
    buf.release()
    assert "released" in repr(buf)
    with pytest.raises(polyhal.MappingError, match="released"):
        buf.map()


# -- mapping (IREE's iree_hal_buffer_map_range rules) ------------------------------------------------

_HOST = MemoryType.HOST_VISIBLE | MemoryType.HOST_COHERENT | MemoryType.DEVICE_VISIBLE


class _HostMemoryAllocator(polyhal.Allocator):
    """Host memory of the CPU device from the heaps a test names (the CPU device maps numpy bytes)."""

    def _allocate(self, heap, nbytes):
        return np.zeros(nbytes, np.uint8)

    def _free(self, heap, native):
        pass


def _allocator(*heaps):
    return _HostMemoryAllocator(polyhal.get_device("cpu:0"), heaps)


def test_host_visible_heaps_grant_mapping_usage():
    dev = polyhal.get_device("cpu:0")
    with dev.allocator.allocate(16, MemoryType.HOST_VISIBLE, BufferUsage.DEFAULT) as buf:
        assert buf.usage & BufferUsage.DEFAULT == BufferUsage.DEFAULT  # what was asked, never less
        assert buf.usage & HOST_MAPPING_USAGE == HOST_MAPPING_USAGE
        buf.map()[:] = 3
        assert buf.map(MemoryAccess.READ).tolist() == [3] * 16


def test_map_is_refused_without_mapping_usage():
    # Host-visible memory whose heap does not allow mapping (as write-combined memory might not).
    a = _allocator(polyhal.Heap(_HOST, BUFFER_USAGE, 1 << 20, polyhal.BufferKind.HOST))
    with a.allocate(64, MemoryType.HOST_VISIBLE) as buf:
        assert not buf.usage & MAPPING_USAGE
        with pytest.raises(polyhal.MappingError, match=r"BufferUsage\.MAPPING \(MAPPING_SCOPED\)"):
            buf.map()
    with pytest.raises(polyhal.IncompatibleBufferError, match="serves"):
        a.allocate(64, MemoryType.HOST_VISIBLE, BufferUsage.DEFAULT | BufferUsage.MAPPING)


def test_map_is_refused_for_memory_that_is_not_host_visible():
    a = _allocator(polyhal.Heap(MemoryType.DEVICE_LOCAL, BUFFER_USAGE, 1 << 20))
    with a.allocate(64, MemoryType.DEVICE_LOCAL) as buf, pytest.raises(polyhal.MappingError, match="HOST_VISIBLE"):
        buf.map()


def test_mapping_optional_maps_where_it_can():
    device_only = polyhal.Heap(MemoryType.DEVICE_LOCAL, BUFFER_USAGE, 1 << 20)
    host = polyhal.Heap(_HOST, MAPPABLE_BUFFER_USAGE, 1 << 20, polyhal.BufferKind.HOST)
    wish = BufferUsage.DEFAULT | BufferUsage.MAPPING | BufferUsage.MAPPING_OPTIONAL
    # No heap can map: the optional mapping is dropped, the buffer says so and map refuses.
    a = _allocator(device_only)
    assert a.query_buffer_compatibility(MemoryType.DEVICE_LOCAL, wish) & polyhal.BufferCompatibility.ALLOCATABLE
    with a.allocate(64, MemoryType.DEVICE_LOCAL, wish) as buf:
        assert buf.usage == BufferUsage.DEFAULT
        with pytest.raises(polyhal.MappingError):
            buf.map()
    # Without MAPPING_OPTIONAL the same request is refused.
    with pytest.raises(polyhal.IncompatibleBufferError):
        a.allocate(64, MemoryType.DEVICE_LOCAL, wish & ~BufferUsage.MAPPING_OPTIONAL)
    # A heap that can map is preferred, whatever the heaps' order, and its buffer maps.
    for heaps in ((device_only, host), (host, device_only)):
        with _allocator(*heaps).allocate(64, MemoryType.OPTIMAL, wish) as buf:
            assert buf.heap is host and buf.usage & BufferUsage.MAPPING == BufferUsage.MAPPING
            buf.map()[:] = 1


def test_read_only_mapping():
    dev = polyhal.get_device("cpu:0")
    with dev.allocator.allocate(8) as buf:
        buf.map()[:] = 5
        view = buf.map(MemoryAccess.READ)
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0] = 1
        assert buf.map(MemoryAccess.READ).tolist() == [5] * 8
        with pytest.raises(polyhal.MappingError, match="neither READ nor WRITE"):
            buf.map(MemoryAccess.NONE)


def test_read_only_memory_maps_only_for_reading():
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False
    buf = polyhal.from_dlpack(a).buffer
    assert buf.allowed_access == MemoryAccess.READ
    assert np.array_equal(buf.map(MemoryAccess.READ).view(np.float32), a)
    with pytest.raises(polyhal.MappingError, match="map it with MemoryAccess.READ"):
        buf.map(MemoryAccess.WRITE)


@pytest.mark.parametrize("offset, length", [(4, 8), (-1, 2), (0, -1), (9, None), (0, 9), (1.0, 2), (0, "4")])
def test_mapping_range_is_checked(offset, length):
    with polyhal.get_device("cpu:0").allocator.allocate(8) as buf:
        with pytest.raises(polyhal.MappingError, match="outside the buffer of 8 bytes|must be ints"):
            buf.map(offset=offset, length=length)


def test_mapping_ranges_inside_the_buffer():
    with polyhal.get_device("cpu:0").allocator.allocate(8) as buf:
        buf.map()[:] = np.arange(8, dtype=np.uint8)
        assert buf.map(offset=2, length=3).tolist() == [2, 3, 4]
        assert buf.map(offset=5).tolist() == [5, 6, 7]  # length None: to the end
        assert buf.map(offset=np.int64(8), length=0).size == 0  # an empty range at the end is inside


def test_numpy_view_is_zero_copy():
    t = polyhal.asarray(np.arange(10, dtype=np.int32), device="cpu:0")
    v = t.numpy()
    v[0] = 42
    assert t.numpy()[0] == 42
    assert np.asarray(t).ctypes.data == t.device.buffer_address(t.buffer)


def test_from_numpy_dlpack_zero_copy_and_strides():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    t = polyhal.from_dlpack(a)
    assert t.device.name == "cpu:0" and t.buffer.kind == polyhal.BufferKind.EXTERNAL
    assert t.device.buffer_address(t.buffer) == a.ctypes.data
    a[0, 0] = -1
    assert t.numpy()[0, 0] == -1
    s = polyhal.from_dlpack(a[:, ::2])
    assert s.strides == (6, 2) and np.array_equal(s.numpy(), a[:, ::2])


def test_read_only_flag_is_honoured():
    a = np.arange(4, dtype=np.float32)
    a.flags.writeable = False
    t = polyhal.from_dlpack(a)
    assert t.readonly
    with pytest.raises(ValueError):
        t.numpy()[0] = 1
    back = np.from_dlpack(t)
    assert not back.flags.writeable


def test_export_to_numpy_legacy_and_versioned():
    t = polyhal.asarray(np.arange(5, dtype=np.float64), device="cpu:0")
    legacy = t.__dlpack__()  # no max_version: an old consumer gets an unversioned capsule
    assert "dltensor" in repr(legacy) and "versioned" not in repr(legacy)
    legacy_view = np.from_dlpack(type("P", (), {"__dlpack__": lambda s, **k: t.__dlpack__(),
                                                "__dlpack_device__": lambda s: (1, 0)})())
    assert np.array_equal(legacy_view, np.arange(5))
    assert np.from_dlpack(t).ctypes.data == t.device.buffer_address(t.buffer)
    copied = np.from_dlpack(t, copy=True)
    assert copied.ctypes.data != t.device.buffer_address(t.buffer)


def test_imported_buffer_keeps_producer_alive_and_releases():
    import weakref

    a = np.arange(8, dtype=np.float32)
    ref = weakref.ref(a.base if a.base is not None else a)
    t = polyhal.from_dlpack(a)
    del a
    gc.collect()
    assert ref() is not None and t.numpy()[7] == 7
    t.release()
    del t
    gc.collect()
    assert ref() is None


def test_torch_roundtrip_if_installed():
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    x = torch.arange(6, dtype=torch.float32)
    t = polyhal.from_dlpack(x)
    assert t.device.buffer_address(t.buffer) == x.data_ptr()
    y = torch.from_dlpack(t)
    assert y.data_ptr() == x.data_ptr()


def test_is_host_says_whether_a_device_memory_is_the_hosts():
    from polyhal.dlpack import DLDeviceType

    assert polyhal.get_device("cpu:0").is_host
    spec = polyhal.get_device("cpu:0").spec

    class Discrete(polyhal.Device):
        dlpack_device_type = DLDeviceType.CUDA

    assert not Discrete(spec).is_host
