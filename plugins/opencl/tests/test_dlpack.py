"""DLPack: OpenCL memory exports as (kDLOpenCL, ordinal); the CPU gets host-visible memory
zero-copy through the mapping and device-only memory by copy; only our own cl_mem imports."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal.dlpack import ImportedTensor
from polyhal.hal.flags import MemoryType


def test_exports_the_cl_mem_as_opencl_memory(dev, rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    t = polyhal.asarray(x, device=dev)
    assert tuple(t.__dlpack_device__()) == (4, dev.ordinal)
    assert dev.buffer_address(t.buffer) == t.buffer.native.int_ptr
    back = polyhal.from_dlpack(t)
    assert back.device is dev and back.buffer.native is t.buffer.native
    np.testing.assert_array_equal(back.numpy(), x)


def test_cpu_consumer_gets_host_visible_memory_without_copy(dev, rng):
    heaps = [h for h in dev.allocator.heaps if h.memory_type & MemoryType.HOST_VISIBLE]
    if not heaps:
        pytest.skip(f"{dev.name} has no host-visible heap")
    x = rng.standard_normal(16).astype(np.float32)
    t = polyhal.asarray(x, device=dev, memory_type=heaps[0].memory_type)
    view = np.from_dlpack(t, device="cpu")
    mapping = dev.allocator.mapping(t.buffer.native)
    assert view.ctypes.data == mapping.ctypes.data  # the persistent mapping itself
    np.testing.assert_array_equal(view, x)


def test_cpu_consumer_gets_device_memory_by_copy(dev, rng):
    x = rng.standard_normal(16).astype(np.float32)
    t = polyhal.asarray(x, device=dev, memory_type=MemoryType.DEVICE_LOCAL)
    np.testing.assert_array_equal(np.from_dlpack(t, device="cpu"), x)
    with pytest.raises(polyhal.DLPackError, match="copy"):
        t.__dlpack__(dl_device=(1, 0), copy=False)


def test_foreign_opencl_memory_is_refused(dev):
    fake = ImportedTensor(data_ptr=0x10, shape=(4,), strides=(1,), dtype=np.dtype("float32"),
                          device=(4, dev.ordinal), readonly=False)
    with pytest.raises(polyhal.DLPackError, match="exported itself"):
        dev.import_dlpack(fake)
    other = ImportedTensor(data_ptr=0x10, shape=(4,), strides=(1,), dtype=np.dtype("float32"),
                           device=(2, 0), readonly=False)
    with pytest.raises(polyhal.DLPackError, match="imports only"):
        dev.import_dlpack(other)


def test_import_at_an_offset_makes_a_sub_buffer(dev):
    align = dev.allocator.heaps[0].alignment
    x = np.arange(4 * align, dtype=np.uint8)
    t = polyhal.asarray(x, device=dev)
    imported = ImportedTensor(data_ptr=t.buffer.native.int_ptr + align, shape=(align,), strides=(1,),
                              dtype=np.dtype("uint8"), device=(4, dev.ordinal), readonly=False)
    buf = dev.import_dlpack(imported)
    out = np.empty(align, np.uint8)
    dev.read(buf, 0, out)
    np.testing.assert_array_equal(out, x[align: 2 * align])
    buf.release()
