"""DLPack as ROCm consumers expect it -- on FakeHipRuntime (a stand-in, not ROCm): device types
per buffer kind, the ROCm stream rules, exports of released buffers, imports."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal import BufferKind, MemoryType
from polyhal.dlpack import from_capsule
from polyhal.errors import DLPackError, LifetimeError
from polyhal_hip.allocator import MANAGED_MEMORY, PINNED_MEMORY, PINNED_NONCOHERENT_MEMORY


def _tensor(device, memory_type, n=8):
    return polyhal.asarray(np.arange(n, dtype=np.float32), device=device, memory_type=memory_type)


@pytest.mark.parametrize("memory_type, expected", [
    (MemoryType.DEVICE_LOCAL, (10, 0)),
    (MANAGED_MEMORY, (10, 0)),
    (PINNED_MEMORY, (1, 0)),
    (PINNED_NONCOHERENT_MEMORY, (1, 0)),
])
def test_export_device_type_per_kind(fake_device, memory_type, expected):
    t = _tensor(fake_device, memory_type)
    assert tuple(int(v) for v in t.__dlpack_device__()) == expected
    imported = from_capsule(t.__dlpack__(max_version=(1, 0)))
    assert tuple(int(v) for v in imported.device) == expected
    assert imported.data_ptr == fake_device.buffer_address(t.buffer)
    imported.release()


def test_every_buffer_type_exports(fake_device):
    """IREE's HIP bug: a device-local buffer from the stream-ordered pool could not be exported
    ("Unavailable HIP buffer type"). Here every kind exports, the async one included."""
    a = fake_device.allocator
    bufs = [a.allocate(64, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC),
            a.allocate(64, MemoryType.DEVICE_LOCAL, kind=BufferKind.DEVICE),
            a.allocate(64, MANAGED_MEMORY), a.allocate(64, PINNED_MEMORY), a.allocate(64, PINNED_NONCOHERENT_MEMORY),
            a.import_host(np.zeros(16, np.float32))]
    kinds = set()
    for buf in bufs:
        t = polyhal.Tensor(buf, polyhal.TensorType((16,), np.float32))
        imported = from_capsule(t.__dlpack__(max_version=(1, 0)))
        assert imported.data_ptr == fake_device.buffer_address(buf)
        imported.release()
        kinds.add(buf.kind)
    assert kinds == {BufferKind.ASYNC, BufferKind.DEVICE, BufferKind.MANAGED, BufferKind.HOST, BufferKind.HOST_REGISTERED}


def test_pinned_host_as_rocm_host_on_request(fake_device, monkeypatch):
    t = _tensor(fake_device, PINNED_MEMORY)
    imported = from_capsule(t.__dlpack__(max_version=(1, 0), dl_device=(11, 0)))
    assert tuple(int(v) for v in imported.device) == (11, 0)
    imported.release()
    imported = from_capsule(t.__dlpack__(max_version=(1, 0), dl_device=(10, 0)))
    assert tuple(int(v) for v in imported.device) == (10, 0)
    imported.release()
    monkeypatch.setenv("POLYHAL_HIP_HOST_DLPACK", "rocm_host")
    assert tuple(int(v) for v in t.__dlpack_device__()) == (11, 0)
    with pytest.raises(DLPackError, match="cannot be exported"):
        _tensor(fake_device, MemoryType.DEVICE_LOCAL).__dlpack__(dl_device=(11, 0), copy=False)


def test_pinned_host_reaches_cpu_consumers_without_copy(fake_device):
    t = _tensor(fake_device, PINNED_MEMORY)
    view = np.from_dlpack(t)
    assert view.ctypes.data == fake_device.buffer_address(t.buffer)
    np.testing.assert_array_equal(view, np.arange(8, dtype=np.float32))
    torch = pytest.importorskip("torch")
    tt = torch.from_dlpack(t)  # torch's CPU (and ROCm) builds reject kDLROCMHost; CPU is accepted
    assert tt.data_ptr() == fake_device.buffer_address(t.buffer)
    assert tt.tolist() == list(range(8))


def test_device_memory_to_cpu_is_a_copy(fake_device):
    t = _tensor(fake_device, MemoryType.DEVICE_LOCAL)
    host = np.from_dlpack(t, device="cpu")
    np.testing.assert_array_equal(host, np.arange(8, dtype=np.float32))
    assert host.ctypes.data != fake_device.buffer_address(t.buffer)
    with pytest.raises(DLPackError, match="copy=False"):
        t.__dlpack__(dl_device=(1, 0), copy=False)


@pytest.mark.parametrize("stream", [1, 2])
def test_rocm_forbids_streams_1_and_2(fake_device, stream):
    t = _tensor(fake_device, MemoryType.DEVICE_LOCAL)
    with pytest.raises(DLPackError, match="forbidden for ROCm"):
        t.__dlpack__(stream=stream)


@pytest.mark.parametrize("stream", ["0", 1.0, True, -7])
def test_stream_values_that_are_no_stream(fake_device, stream):
    t = _tensor(fake_device, MemoryType.DEVICE_LOCAL)
    with pytest.raises(DLPackError):
        t.__dlpack__(stream=stream)


def test_stream_ordering(fake, fake_device):
    t = _tensor(fake_device, MemoryType.DEVICE_LOCAL)
    ours = fake.handle(fake_device.stream)
    event = fake_device._event.id

    def export(stream):
        fake.waits.clear()
        before = fake.event_syncs
        from_capsule(t.__dlpack__(stream=stream)).release()
        return list(fake.waits), fake.event_syncs - before

    assert export(None) == ([(0, event)], 0)          # legacy default stream waits, the host does not
    assert export(0) == ([(0, event)], 0)             # default stream
    assert export(0xABC000) == ([(0xABC000, event)], 0)  # a hipStream_t address
    assert export(ours) == ([], 0)                    # our own stream: already ordered
    assert export(-1) == ([], 0)                      # no ordering asked
    pinned = _tensor(fake_device, PINNED_MEMORY)
    fake.waits.clear()
    before = fake.event_syncs
    from_capsule(pinned.__dlpack__(stream=None)).release()
    assert fake.waits == [] and fake.event_syncs == before + 1  # a host consumer: the host waits for our stream


def test_exporting_a_freed_buffer(fake_device):
    t = _tensor(fake_device, MemoryType.DEVICE_LOCAL)
    t.buffer.release()
    with pytest.raises((DLPackError, LifetimeError), match="released"):
        t.__dlpack__()
    with pytest.raises((DLPackError, LifetimeError), match="released"):
        t.__dlpack_device__()
    async_buf = fake_device.allocator.allocate(64, MemoryType.DEVICE_LOCAL, kind=BufferKind.ASYNC)
    fake_device.allocator.dealloca(async_buf)
    with pytest.raises((DLPackError, LifetimeError), match="released"):
        polyhal.Tensor(async_buf, polyhal.TensorType((16,), np.float32)).__dlpack__()


def test_roundtrip_comes_back_to_the_same_device_zero_copy(fake_device):
    for mt in (MemoryType.DEVICE_LOCAL, MANAGED_MEMORY, PINNED_MEMORY):
        t = _tensor(fake_device, mt)
        back = polyhal.from_dlpack(t)
        assert back.device is fake_device
        assert fake_device.buffer_address(back.buffer) == fake_device.buffer_address(t.buffer)
        np.testing.assert_array_equal(back.numpy(), np.arange(8, dtype=np.float32))


def test_rocm_capsules_import_as_external(fake, fake_device):
    for mt in (MemoryType.DEVICE_LOCAL, MANAGED_MEMORY):
        t = _tensor(fake_device, mt)
        back = polyhal.from_dlpack(t.__dlpack__(max_version=(1, 0)))
        assert back.device is fake_device and back.buffer.kind is BufferKind.EXTERNAL
        assert back.buffer.host_visible == (mt == MANAGED_MEMORY)  # what HIP says the memory is
        np.testing.assert_array_equal(back.numpy(), np.arange(8, dtype=np.float32))
        frees = len([c for c in fake.calls if "Free" in c])
        back.release()  # external: the producer's deleter runs, HIP frees nothing
        assert len([c for c in fake.calls if "Free" in c]) == frees and not t.buffer.released


def test_import_what_hip_knows_only(fake, fake_device):
    from polyhal.dlpack import export_capsule

    stranger = np.arange(4, dtype=np.float32)  # pageable memory HIP never saw
    for device_type, match in ((10, "not memory HIP knows"), (1, "does not know"), (11, "does not know")):
        capsule = export_capsule(data_ptr=stranger.ctypes.data, shape=(4,), strides=None, dtype=np.float32,
                                 device=(device_type, 0), owner=stranger)
        with pytest.raises(DLPackError, match=match):
            fake_device.import_dlpack(from_capsule(capsule))
    other = export_capsule(data_ptr=stranger.ctypes.data, shape=(4,), strides=None, dtype=np.float32,
                           device=(10, 3), owner=stranger)
    with pytest.raises(DLPackError, match="ROCm device 3"):
        fake_device.import_dlpack(from_capsule(other))
    registered = fake_device.allocator.import_host(stranger)
    capsule = export_capsule(data_ptr=stranger.ctypes.data, shape=(4,), strides=None, dtype=np.float32,
                             device=(1, 0), owner=stranger)
    buf = fake_device.import_dlpack(from_capsule(capsule))
    assert buf.kind is BufferKind.EXTERNAL and buf.native.kind is BufferKind.HOST and buf.host_visible
    buf.release()
    registered.release()


def test_consumer_stream_is_handed_to_producers(fake, fake_device):
    seen = []

    class Producer:
        def __init__(self, t):
            self.t = t

        def __dlpack_device__(self):
            return (10, 0)

        def __dlpack__(self, stream=None, **kw):
            seen.append(stream)
            return self.t.__dlpack__(stream=-1, **kw)

    t = _tensor(fake_device, MemoryType.DEVICE_LOCAL)
    back = polyhal.from_dlpack(Producer(t))
    assert seen == [fake.handle(fake_device.stream)] and back.device is fake_device
