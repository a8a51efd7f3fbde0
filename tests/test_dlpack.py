"""Tests for polyhal.dlpack: capsule export/import, ownership, dtype mapping, negotiation."""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref

import numpy as np
import pytest

from polyhal import dlpack
from polyhal.dlpack import (
    DLPACK_VERSION,
    DLDeviceType,
    DLManagedTensorVersioned,
    ImportedTensor,
    dlpack_dtype,
    export_capsule,
    from_capsule,
    numpy_dtype,
    request_capsule,
)
from polyhal.errors import DLPackError

CPU = (DLDeviceType.CPU, 0)
#: numpy 2.1 added DLPack 1.0 (``max_version``, versioned capsules, the read-only flag).
NUMPY_DLPACK_1 = np.lib.NumpyVersion(np.__version__) >= "2.1.0"
needs_numpy_dlpack_1 = pytest.mark.skipif(not NUMPY_DLPACK_1, reason="numpy < 2.1: no DLPack 1.0")

_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(
    ("PyCapsule_GetName", ctypes.pythonapi))


class Owner:
    """Stands in for a polyhal buffer: something whose lifetime the capsule must extend."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr


def _capsule(arr: np.ndarray, owner: object | None = None, **kw):
    """Export ``arr``'s memory (element strides) with ``owner`` (default: a fresh Owner)."""
    return export_capsule(
        data_ptr=arr.ctypes.data, shape=arr.shape,
        strides=tuple(s // arr.itemsize for s in arr.strides), dtype=arr.dtype, device=CPU,
        owner=Owner(arr) if owner is None else owner, **kw)


class Exporter:
    """A minimal Array API 2023.12 producer over a numpy array, built on export_capsule."""

    def __init__(self, arr: np.ndarray, readonly: bool = False):
        self.arr, self.readonly = arr, readonly
        self.calls: list[dict] = []
        self.owner_refs: list[weakref.ref] = []

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append(dict(stream=stream, max_version=max_version, dl_device=dl_device,
                               copy=copy))
        owner = Owner(self.arr)
        self.owner_refs.append(weakref.ref(owner))
        versioned = max_version is not None and max_version[0] >= 1
        return _capsule(self.arr, owner, readonly=self.readonly, versioned=versioned)

    def __dlpack_device__(self):
        return CPU

    def owners_alive(self) -> int:
        gc.collect()
        return sum(r() is not None for r in self.owner_refs)


class LegacyExporter(Exporter):
    """A pre-2023.12 producer: __dlpack__ knows only ``stream``."""

    def __dlpack__(self, stream=None):  # type: ignore[override]
        return super().__dlpack__(stream=stream)


# ---------------------------------------------------------------- numpy consuming our capsules

@pytest.mark.parametrize("make_view", [
    lambda a: a,
    lambda a: a[:, ::2],
    lambda a: a.T,
    lambda a: a[1:, 1:3],
    lambda a: a[::-1],
], ids=["contiguous", "step2", "transpose", "offset-slice", "negative-stride"])
def test_numpy_from_dlpack_shares_memory(make_view):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = make_view(base)
    exp = Exporter(view)
    out = np.from_dlpack(exp)
    assert (exp.calls[0]["max_version"] is not None) == NUMPY_DLPACK_1
    assert out.shape == view.shape and out.strides == view.strides
    assert np.shares_memory(out, base)
    np.testing.assert_array_equal(out, view)
    out[0, 0] = -1
    assert view[0, 0] == -1
    assert exp.owners_alive() == 1
    del out
    assert exp.owners_alive() == 0


@needs_numpy_dlpack_1
def test_numpy_sees_readonly_flag():
    arr = np.arange(4.0)
    out = np.from_dlpack(Exporter(arr, readonly=True))
    assert not out.flags.writeable
    assert np.shares_memory(out, arr)


def test_byte_offset_is_applied_by_consumers():
    arr = np.arange(10, dtype=np.int32)
    cap = export_capsule(data_ptr=arr.ctypes.data, byte_offset=3 * 4, shape=(4,), strides=None,
                         dtype=arr.dtype, device=CPU, owner=arr)
    t = from_capsule(cap)
    assert t.data_ptr == arr.ctypes.data + 12 and t.strides == (1,)
    t.release()


# ---------------------------------------------------------------- our consumer

def test_roundtrip_versioned_and_legacy():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    for versioned in (True, False):
        owner = Owner(arr)
        ref = weakref.ref(owner)
        cap = _capsule(arr, owner, versioned=versioned)
        assert _get_name(cap) == (b"dltensor_versioned" if versioned else b"dltensor")
        del owner
        t = from_capsule(cap)
        assert _get_name(cap) == (b"used_dltensor_versioned" if versioned else b"used_dltensor")
        assert (t.data_ptr, t.shape, t.strides, t.dtype) == (arr.ctypes.data, (2, 3), (3, 1),
                                                             np.dtype(np.int16))
        assert t.device == (DLDeviceType.CPU, 0) and not t.readonly and not t.copied
        del cap
        gc.collect()
        assert ref() is not None, "consumed capsule died: the tensor must still hold the owner"
        t.release()
        gc.collect()
        assert ref() is None and t.released


def test_flags_and_device_roundtrip_without_touching_memory():
    cap = export_capsule(data_ptr=0x1000, shape=(2, 2), strides=(1, 2), dtype=np.float64,
                         device=(DLDeviceType.CUDA, 3), owner=None, readonly=True, copied=True)
    t = from_capsule(cap)
    assert t.device == (DLDeviceType.CUDA, 3) and isinstance(t.device[0], DLDeviceType)
    assert t.readonly and t.copied and t.strides == (1, 2) and t.data_ptr == 0x1000
    t.release()


@needs_numpy_dlpack_1
def test_imports_numpy_capsules():
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    t = from_capsule(arr.__dlpack__(max_version=(1, 0)))
    assert (t.data_ptr, t.shape, t.strides, t.dtype) == (arr.ctypes.data, (3, 4), (4, 1),
                                                         arr.dtype)
    assert t.device == CPU and not t.readonly
    t.release()
    legacy = from_capsule(arr.__dlpack__())
    assert legacy.data_ptr == arr.ctypes.data and not legacy.readonly
    legacy.release()


@needs_numpy_dlpack_1
def test_imports_numpy_readonly():
    arr = np.arange(5, dtype=np.uint8)
    arr.flags.writeable = False
    t = from_capsule(arr.__dlpack__(max_version=(1, 0)))
    assert t.readonly
    t.release()
    with pytest.raises(BufferError):  # numpy, like us, refuses a legacy capsule for read-only
        arr.__dlpack__()


@needs_numpy_dlpack_1
@pytest.mark.parametrize("make_view", [lambda a: a[:, ::2], lambda a: a.T, lambda a: a[::-1]],
                         ids=["step2", "transpose", "negative"])
def test_imports_numpy_strided_views(make_view):
    view = make_view(np.arange(24, dtype=np.int32).reshape(4, 6))
    t = from_capsule(view.__dlpack__(max_version=(1, 0)))
    assert t.data_ptr == view.ctypes.data
    assert t.shape == view.shape
    assert t.strides == tuple(s // view.itemsize for s in view.strides)
    t.release()


@needs_numpy_dlpack_1
@pytest.mark.parametrize("arr", [np.array(3.5), np.zeros((0,), np.int8), np.zeros((2, 0, 3))],
                         ids=["0-d", "empty-1d", "empty-3d"])
def test_degenerate_shapes_both_ways(arr):
    t = from_capsule(arr.__dlpack__(max_version=(1, 0)))
    assert t.shape == arr.shape and len(t.strides) == arr.ndim and t.dtype == arr.dtype
    t.release()
    out = np.from_dlpack(Exporter(arr))
    assert out.shape == arr.shape and out.dtype == arr.dtype
    if arr.size:
        assert np.shares_memory(out, arr) and out[()] == arr[()]


DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128"]


@needs_numpy_dlpack_1
@pytest.mark.parametrize("name", DTYPES)
def test_dtypes_map_both_ways(name):
    dt = np.dtype(name)
    code, bits, lanes = dlpack_dtype(dt)
    assert bits == dt.itemsize * 8 and lanes == 1
    assert numpy_dtype(code, bits, lanes) == dt
    arr = np.ones(3, dtype=dt)
    t = from_capsule(arr.__dlpack__(max_version=(1, 0)))
    assert t.dtype == dt
    t.release()
    out = np.from_dlpack(Exporter(arr))
    assert out.dtype == dt and np.shares_memory(out, arr)


def test_dtype_codes():
    assert dlpack_dtype(np.int32) == (0, 32, 1)
    assert dlpack_dtype(np.uint8) == (1, 8, 1)
    assert dlpack_dtype(np.float16) == (2, 16, 1)
    assert dlpack_dtype(np.complex64) == (5, 64, 1)
    assert dlpack_dtype(np.bool_) == (6, 8, 1)


@pytest.mark.parametrize("dtype", [object, "U3", "V4", "M8[s]", np.longdouble, ">i4"])
def test_unsupported_dtype(dtype):
    with pytest.raises(DLPackError, match="DLPack|byte order"):
        dlpack_dtype(np.dtype(dtype))
    with pytest.raises(DLPackError):
        export_capsule(data_ptr=0, shape=(1,), strides=None, dtype=np.dtype(dtype), device=CPU,
                       owner=None)


@pytest.mark.parametrize("code,bits,lanes", [(2, 8, 1), (0, 128, 1), (6, 1, 1), (2, 32, 4),
                                             (99, 32, 1)])
def test_unsupported_dlpack_type(code, bits, lanes):
    with pytest.raises(DLPackError):
        numpy_dtype(code, bits, lanes)


# ---------------------------------------------------------------- ownership and errors

def test_consumed_twice():
    cap = _capsule(np.arange(3.0))
    from_capsule(cap).release()
    with pytest.raises(DLPackError, match="already consumed.*call __dlpack__\\(\\) again"):
        from_capsule(cap)
    numpy_cap = np.arange(3.0).__dlpack__()
    from_capsule(numpy_cap).release()
    with pytest.raises(BufferError, match="already consumed"):  # DLPackError is a BufferError
        from_capsule(numpy_cap)


def test_unconsumed_capsule_releases_owner():
    for versioned in (True, False):
        owner = Owner(np.arange(3.0))
        ref = weakref.ref(owner)
        cap = _capsule(owner.arr, owner, versioned=versioned)
        del owner
        gc.collect()
        assert ref() is not None
        del cap
        gc.collect()
        assert ref() is None


def test_release_is_idempotent_and_deleter_runs_once():
    calls = []
    owner = Owner(np.arange(3.0))
    weakref.finalize(owner, calls.append, "freed")
    cap = _capsule(owner.arr, owner)
    del owner
    t = from_capsule(cap)
    t.release()
    t.release()
    del t, cap
    gc.collect()
    assert calls == ["freed"]


def test_forgotten_tensor_releases_owner():
    owner = Owner(np.arange(3.0))
    ref = weakref.ref(owner)
    t = from_capsule(_capsule(owner.arr, owner))
    del owner, t
    gc.collect()
    assert ref() is None


def test_release_from_another_thread():
    owner = Owner(np.arange(3.0))
    ref = weakref.ref(owner)
    t = from_capsule(_capsule(owner.arr, owner))
    del owner
    th = threading.Thread(target=t.release)
    th.start()
    th.join()
    gc.collect()
    assert ref() is None and t.released


def test_no_records_leak():
    before = len(dlpack._records)
    arr = np.arange(8.0)
    for _ in range(50):
        from_capsule(_capsule(arr)).release()
        _capsule(arr, versioned=False)
        out = np.from_dlpack(Exporter(arr))
        del out
    gc.collect()
    assert len(dlpack._records) == before


def test_major_version_2_rejected():
    owner = Owner(np.arange(3.0))
    ref = weakref.ref(owner)
    cap = _capsule(owner.arr, owner)
    del owner
    managed = DLManagedTensorVersioned.from_address(_get_pointer(cap, b"dltensor_versioned"))
    managed.version.major = 2
    with pytest.raises(DLPackError, match=r"version 2\.0.*max_version=\(1, 0\)"):
        from_capsule(cap)
    assert _get_name(cap) == b"dltensor_versioned", "a rejected capsule must stay unconsumed"
    del cap, managed
    gc.collect()
    assert ref() is None, "the producer's destructor must still free a rejected capsule"


def test_readonly_legacy_export_refused():
    with pytest.raises(DLPackError, match="read-only.*max_version"):
        _capsule(np.arange(3.0), readonly=True, versioned=False)


@pytest.mark.parametrize("kw,match", [
    (dict(shape=(2, -1)), "negative"),
    (dict(strides=(1,)), "one per dimension"),
    (dict(device=(5, 0)), "device"),
    (dict(device="cpu"), "device"),
    (dict(byte_offset=-8), ">= 0"),
])
def test_export_argument_errors(kw, match):
    args = dict(data_ptr=0x1000, shape=(2, 2), strides=None, dtype=np.float32, device=CPU,
                owner=None)
    args.update(kw)
    with pytest.raises(DLPackError, match=match):
        export_capsule(**args)


def test_from_capsule_rejects_non_capsules():
    with pytest.raises(DLPackError, match="expected a DLPack capsule"):
        from_capsule(np.arange(3))
    import datetime
    capi = getattr(datetime, "datetime_CAPI", None)
    if capi is not None:
        with pytest.raises(DLPackError, match="not a DLPack tensor"):
            from_capsule(capi)


class _Unraisable:
    """Collects what sys.unraisablehook is given (pytest's own hook is restored afterwards)."""

    def __init__(self, monkeypatch):
        self.seen: list[BaseException] = []
        monkeypatch.setattr("sys.unraisablehook", lambda u: self.seen.append(u.exc_value))


def test_numpy_rejecting_device_still_frees_owner(monkeypatch):
    # numpy asks for the capsule, then refuses non-CPU memory and drops the capsule with its
    # error already set; the owner must be released anyway. The error itself cannot survive a
    # ctypes callback (see the module docstring): it is reported as unraisable instead.
    unraisable = _Unraisable(monkeypatch)

    class CudaExporter(Exporter):
        def __dlpack__(self, **kw):
            owner = Owner(self.arr)
            self.owner_refs.append(weakref.ref(owner))
            return export_capsule(data_ptr=0x1000, shape=(1,), strides=None, dtype=np.float32,
                                  device=(DLDeviceType.CUDA, 0), owner=owner)

        def __dlpack_device__(self):
            return (DLDeviceType.CUDA, 0)

    exp = CudaExporter(np.zeros(1, np.float32))
    with pytest.raises((BufferError, RuntimeError, SystemError)):
        np.from_dlpack(exp)
    assert exp.owners_alive() == 0
    assert any("device" in str(e).lower() for e in unraisable.seen)


def test_deleter_called_with_exception_pending_still_frees(monkeypatch):
    # numpy frees a failing expression's temporary (and so calls our deleter) after the error
    # is set. The memory must still be released and the error reported somewhere.
    unraisable = _Unraisable(monkeypatch)
    exp = Exporter(np.arange(3.0))
    with pytest.raises((TypeError, SystemError)):
        np.from_dlpack(exp) + "not a number"
    assert exp.owners_alive() == 0
    assert any(isinstance(e, TypeError) for e in unraisable.seen)


# ---------------------------------------------------------------- request_capsule

def test_request_capsule_modern_producer():
    exp = Exporter(np.arange(3.0))
    cap = request_capsule(exp, dl_device=CPU, copy=False)
    assert exp.calls == [dict(stream=None, max_version=DLPACK_VERSION, dl_device=CPU, copy=False)]
    t = from_capsule(cap)
    assert t.data_ptr == exp.arr.ctypes.data
    t.release()


def test_request_capsule_numpy():
    arr = np.arange(3.0)
    t = from_capsule(request_capsule(arr))
    assert t.data_ptr == arr.ctypes.data
    t.release()
    assert _get_name(request_capsule(arr, max_version=None)) == b"dltensor"


def test_request_capsule_falls_back_to_legacy_producer():
    exp = LegacyExporter(np.arange(3.0))
    cap = request_capsule(exp)
    assert _get_name(cap) == b"dltensor"
    assert exp.calls[-1]["max_version"] is None
    t = from_capsule(cap)
    assert t.data_ptr == exp.arr.ctypes.data and not t.readonly
    t.release()
    assert exp.owners_alive() == 0


@pytest.mark.parametrize("kw", [dict(copy=True), dict(dl_device=CPU)])
def test_request_capsule_legacy_producer_cannot_honour(kw):
    with pytest.raises(DLPackError, match="does not accept"):
        request_capsule(LegacyExporter(np.arange(3.0)), **kw)


def test_request_capsule_without_dlpack():
    with pytest.raises(DLPackError, match="no __dlpack__"):
        request_capsule([1, 2, 3])


# ---------------------------------------------------------------- other libraries

def test_torch_roundtrip():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    src = torch.arange(6, dtype=torch.float32).reshape(2, 3)[:, ::2]
    t = from_capsule(request_capsule(src))
    assert t.data_ptr == src.data_ptr() and t.strides == tuple(src.stride())
    t.release()
    arr = np.arange(6, dtype=np.float32)
    out = torch.from_dlpack(Exporter(arr))
    out[0] = 42
    assert arr[0] == 42


def test_imported_tensor_is_a_plain_record():
    t = ImportedTensor(data_ptr=0, shape=(), strides=(), dtype=np.dtype("f4"), device=CPU,
                       readonly=False)
    t.release()  # no deleter: nothing to do
    assert t.released
