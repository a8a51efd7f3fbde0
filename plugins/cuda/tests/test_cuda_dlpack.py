"""DLPack with cupy and torch for every buffer kind, stream semantics, and bad input (GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import polyhal
from polyhal import dlpack
from polyhal.hal.flags import BufferKind, MemoryType

from polyhal_cuda.allocator import MANAGED_MEMORY, PINNED_MEMORY

KINDS = ["device", "async", "managed", "host"]


def _tensor(cuda, kind: str, host: np.ndarray) -> polyhal.Tensor:
    mt = {"device": MemoryType.DEVICE_LOCAL, "async": MemoryType.DEVICE_LOCAL, "managed": MANAGED_MEMORY,
          "host": PINNED_MEMORY}[kind]
    extra = {"kind": BufferKind.ASYNC} if kind == "async" else {"kind": BufferKind.DEVICE} if kind == "device" else {}
    if kind == "async" and not cuda.spec.limits.get("async_pool_supported"):
        pytest.skip("no stream-ordered pool")
    buf = cuda.allocator.allocate(host.nbytes, mt, **extra)
    t = polyhal.Tensor(buf, polyhal.TensorType(host.shape, host.dtype))
    cuda.write(buf, 0, host)
    return t


def _expected_type(kind: str) -> int:
    return {"device": 2, "async": 2, "managed": 13, "host": 3}[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_roundtrip_through_polyhal(cuda, rng, kind):
    host = rng.standard_normal((7, 5)).astype(np.float32)
    t = _tensor(cuda, kind, host)
    assert t.__dlpack_device__() == (_expected_type(kind), cuda.ordinal)
    back = polyhal.from_dlpack(t)  # the core shares a polyhal tensor's buffer directly
    assert back.device is cuda and back.buffer.native.ptr == t.buffer.native.ptr
    assert np.array_equal(back.numpy(), host)
    through = polyhal.from_dlpack(t.__dlpack__(max_version=(1, 0)))  # a real capsule: imported
    assert through.device is cuda and through.buffer.kind is BufferKind.EXTERNAL
    # the imported memory's kind is what CUDA says it is (stream-ordered pool memory is device memory)
    want = BufferKind.DEVICE if kind == "async" else t.buffer.native.kind
    assert through.buffer.native.ptr == t.buffer.native.ptr and through.buffer.native.kind is want
    assert np.array_equal(through.numpy(), host)


@pytest.mark.parametrize("kind", KINDS)
def test_cupy_zero_copy_both_ways(cuda, cp, rng, kind):
    host = rng.standard_normal((6, 4)).astype(np.float32)
    t = _tensor(cuda, kind, host)
    # cupy reads kDLCUDA and kDLCUDAManaged itself; pinned memory is exported as plain CUDA memory
    # of this device when the consumer asks (the same address: unified addressing).
    if kind == "host":
        a = cp.from_dlpack(t.__dlpack__(dl_device=(2, cuda.ordinal), stream=cp.cuda.get_current_stream().ptr or 1,
                                        max_version=(1, 0)))
    else:
        a = cp.from_dlpack(t)
    assert a.data.ptr == t.buffer.native.ptr
    assert np.array_equal(cp.asnumpy(a), host)
    a *= 2  # cupy writes, polyhal sees it: same memory
    cp.cuda.get_current_stream().synchronize()
    assert np.array_equal(t.numpy(), host * 2)
    back = polyhal.from_dlpack(a)  # and back
    assert back.buffer.native.ptr == a.data.ptr and back.device is cuda
    expect = BufferKind.MANAGED if kind == "managed" else BufferKind.HOST if kind == "host" else BufferKind.DEVICE
    assert back.buffer.native.kind is expect  # the real kind, asked of CUDA


@pytest.mark.parametrize("kind", KINDS)
def test_torch_zero_copy_both_ways(cuda, torch_cuda, rng, kind):
    torch = torch_cuda
    host = rng.standard_normal((5, 3)).astype(np.float32)
    t = _tensor(cuda, kind, host)
    stream = torch.cuda.current_stream(cuda.ordinal).cuda_stream or 1
    if kind in ("device", "async"):
        x = torch.from_dlpack(t)
    else:
        # torch reads kDLCUDA and kDLCPU only: managed and pinned memory go as plain CUDA memory
        x = torch.from_dlpack(t.__dlpack__(dl_device=(2, cuda.ordinal), stream=stream, max_version=(1, 0)))
    assert x.is_cuda and x.data_ptr() == t.buffer.native.ptr
    assert np.array_equal(x.cpu().numpy(), host)
    back = polyhal.from_dlpack(x)
    assert back.buffer.native.ptr == x.data_ptr() and back.device is cuda
    if kind in ("managed", "host"):
        c = torch.from_dlpack(t.__dlpack__(dl_device=(1, 0), max_version=(1, 0)))  # host view, no copy
        assert not c.is_cuda and c.data_ptr() == t.buffer.native.ptr
        assert np.array_equal(c.numpy(), host)
    if kind == "host":
        assert torch.from_dlpack(t.__dlpack__(dl_device=(1, 0), max_version=(1, 0))).is_pinned()


def test_import_of_torch_and_cupy_owned_memory(cuda, cp, torch_cuda):
    torch = torch_cuda
    x = torch.arange(12, dtype=torch.float32, device=f"cuda:{cuda.ordinal}").reshape(3, 4)
    t = polyhal.from_dlpack(x)
    assert t.buffer.native.ptr == x.data_ptr() and t.buffer.kind is BufferKind.EXTERNAL
    assert np.array_equal(t.numpy(), x.cpu().numpy())
    m = cp.cuda.memory.ManagedMemory(64)
    a = cp.ndarray((16,), cp.float32, cp.cuda.MemoryPointer(m, 0))
    a[...] = 5
    ta = polyhal.from_dlpack(a)
    assert ta.__dlpack_device__() == (13, cuda.ordinal) and ta.buffer.host_visible
    assert np.array_equal(ta.numpy(), np.full(16, 5, np.float32))


def test_consumer_stream_waits_on_an_event(cuda, cp):
    """The export orders our pending work before the consumer's stream without blocking the host:
    a long kernel on our stream, then a consumer stream that reads the result."""
    b = polyhal.ProgramBuilder("slow")
    x = b.input("x", (2048, 2048))
    b.output(b.matmul(b.matmul(b.matmul(x, x), x), x))
    plan = polyhal.compile(b.build(), cuda.name)
    host = np.full((2048, 2048), 1.0 / 2048, np.float32)
    out = plan(host)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        a = cp.from_dlpack(out)  # cupy passes consumer.ptr
        s = float(a.sum())
    assert s == pytest.approx(2048.0, rel=1e-3)  # every product of these matrices is the same matrix


def test_wrong_stream_arguments_are_refused(cuda):
    t = polyhal.asarray(np.ones(8, np.float32), device=cuda)
    for bad in ("stream", 1.5, object()):
        with pytest.raises(polyhal.DLPackError, match="must be an int"):
            t.__dlpack__(stream=bad)
    with pytest.raises(polyhal.DLPackError, match="ambiguous"):
        t.__dlpack__(stream=0)
    with pytest.raises(polyhal.DLPackError, match="not valid"):
        t.__dlpack__(stream=-7)
    t.__dlpack__(stream=-1)  # no ordering asked: fine


def test_consumer_on_another_device_is_refused(cuda):
    t = polyhal.asarray(np.ones(8, np.float32), device=cuda)
    with pytest.raises(polyhal.DLPackError, match="cannot be exported"):
        t.__dlpack__(dl_device=(2, cuda.ordinal + 1))
    other = dlpack.export_capsule(data_ptr=t.buffer.native.ptr, shape=(8,), strides=None, dtype=np.float32,
                                  device=(2, cuda.ordinal + 1), owner=t)
    with pytest.raises(polyhal.DLPackError):
        cuda.import_dlpack(dlpack.from_capsule(other))


def test_non_contiguous_and_read_only_imports(cuda, cp):
    a = cp.arange(48, dtype=cp.float32).reshape(6, 8)
    view = a[::2, 1::3]  # strided
    t = polyhal.from_dlpack(view)
    assert not t.is_contiguous and t.strides == (16, 3)
    assert np.array_equal(cp.asnumpy(t.native), cp.asnumpy(view))
    assert t.native.data.ptr == view.data.ptr
    rev = dlpack.export_capsule(data_ptr=a.data.ptr + 7 * 4, shape=(6, 8), strides=(8, -1), dtype=np.float32,
                                device=(2, cuda.ordinal), owner=a)  # a[:, ::-1], as DLPack allows
    with pytest.raises(polyhal.DLPackError, match="negative strides"):
        polyhal.from_dlpack(rev)
    ro = dlpack.export_capsule(data_ptr=a.data.ptr, shape=a.shape, strides=None, dtype=np.float32,
                               device=(2, cuda.ordinal), owner=a, readonly=True)
    tr = polyhal.from_dlpack(ro)
    assert tr.readonly
    again = dlpack.from_capsule(tr.__dlpack__(max_version=(1, 0)))
    assert again.readonly
    with pytest.raises(polyhal.DLPackError, match="read-only"):
        tr.__dlpack__(max_version=None)  # a legacy capsule cannot say read-only
