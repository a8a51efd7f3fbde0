"""HAL vocabulary, buffers, tensors and DLPack exchange on the CPU device."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import polyhal
from polyhal import BufferUsage, MemoryAccess, MemoryType


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


def test_read_only_mapping():
    dev = polyhal.get_device("cpu:0")
    with dev.allocator.allocate(8) as buf:
        view = buf.map(MemoryAccess.READ)
        with pytest.raises(ValueError):
            view[0] = 1
        with pytest.raises(polyhal.MappingError, match="outside"):
            buf.map(offset=4, length=8)


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
