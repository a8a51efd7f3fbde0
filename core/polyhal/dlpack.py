"""DLPack exchange: export polyhal memory as DLPack capsules and import other libraries' capsules.

Pure Python over ``ctypes``: the structs follow ``dlpack.h`` v1.0 and capsules are made and read
through the CPython C API. Producers get versioned (``"dltensor_versioned"``, DLPack 1.x) or legacy
(``"dltensor"``) capsules; consumers accept both, as the Array API standard (2023.12) asks.

Ownership: :func:`export_capsule` keeps ``owner`` alive in a registry until the consumer calls the
deleter, or until the capsule is garbage collected without being consumed. :func:`from_capsule`
marks a capsule used and returns an :class:`ImportedTensor` whose :meth:`~ImportedTensor.release`
calls the producer's deleter once; keep the ImportedTensor alive while the memory is in use.

Known limitation of doing this without a compiled extension: our deleter and capsule destructor
are ``ctypes`` callbacks, and a ``ctypes`` callback that runs while an exception is pending cannot
hand that exception back. C consumers do call deleters with an error pending: numpy frees the
temporary in ``np.from_dlpack(t) + "x"`` after setting the TypeError, and drops the capsule after
setting its error when it rejects a device. The memory is still released, but the caller sees
``SystemError: error return without exception set`` and the real error is printed to stderr as
"Exception ignored on calling ctypes callback function". A C deleter that saves and restores the
error (as in the DLPack spec's example) would remove this, should it ever matter.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import math
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polyhal.errors import DLPackError
from polyhal.ir.types import STORAGE_DTYPES, storage_dtype

try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds  # numpy >= 2
except ImportError:  # numpy 1.26
    from numpy import byte_bounds as _byte_bounds

__all__ = [
    "DLPACK_VERSION", "DLPACK_FLAG_BITMASK_READ_ONLY", "DLPACK_FLAG_BITMASK_IS_COPIED",
    "DLDeviceType", "ImportedTensor", "MAX_NDIM", "dlpack_dtype", "export_capsule", "from_capsule",
    "numpy_dtype", "producer_bounds", "request_capsule", "reshaped_strides", "row_major_strides",
]

#: The (major, minor) DLPack version this module produces; it reads any 1.x.
DLPACK_VERSION = (1, 0)
DLPACK_FLAG_BITMASK_READ_ONLY = 1
DLPACK_FLAG_BITMASK_IS_COPIED = 2


class DLDeviceType(enum.IntEnum):
    """DLPack's ``DLDeviceType`` codes."""

    CPU = 1
    CUDA = 2
    CUDA_HOST = 3
    OPENCL = 4
    VULKAN = 7
    METAL = 8
    VPI = 9
    ROCM = 10
    ROCM_HOST = 11
    EXT_DEV = 12
    CUDA_MANAGED = 13
    ONE_API = 14


# ---------------------------------------------------------------- dlpack.h v1.0 structs

class DLDevice(ctypes.Structure):
    """``DLDevice``: device type and ordinal."""

    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    """``DLDataType``: type code, bits per lane, lanes."""

    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    """``DLTensor``: the described memory."""

    _fields_ = [
        ("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
        ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


# One prototype serves both struct kinds: the argument is just the struct's address.
_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    """Legacy (pre-1.0) ``DLManagedTensor``, carried in a ``"dltensor"`` capsule."""

    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]


class DLPackVersion(ctypes.Structure):
    """``DLPackVersion``: ABI major and minor."""

    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """``DLManagedTensorVersioned`` (DLPack 1.x), carried in a ``"dltensor_versioned"`` capsule."""

    _fields_ = [
        ("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter),
        ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor),
    ]


# ---------------------------------------------------------------- CPython capsule API

def _capi(name: str, restype: Any, *argtypes: Any) -> Any:
    # Private prototypes: setting argtypes on ctypes.pythonapi.X would change it for everyone.
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = _capi("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                     _CapsuleDestructor)
_capsule_get_name = _capi("PyCapsule_GetName", ctypes.c_char_p, ctypes.py_object)
_capsule_get_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object,
                             ctypes.c_char_p)
_capsule_set_name = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
# A capsule being destroyed is passed by address: a py_object argument would resurrect it.
_raw_is_valid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)
_raw_get_pointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
_err_occurred = _capi("PyErr_Occurred", ctypes.c_void_p)  # raises whatever exception is pending
_py_incref = _capi("Py_IncRef", None, ctypes.py_object)

# Capsules keep a bare ``const char*`` to their name, so these must outlive every capsule.
_NAME_VERSIONED, _USED_VERSIONED = b"dltensor_versioned", b"used_dltensor_versioned"
_NAME_LEGACY, _USED_LEGACY = b"dltensor", b"used_dltensor"

_records: dict[int, tuple] = {}  # manager_ctx id -> (owner, managed struct, shape, strides)
_records_lock = threading.Lock()
_consume_lock = threading.Lock()
_ids = itertools.count(1)


def _make_callbacks(records: dict, lock: threading.Lock) -> tuple:
    # What the callbacks use is bound here, not looked up as module globals, because C
    # consumers may call them during interpreter shutdown, after module globals are cleared.
    read_ptr = ctypes.c_void_p.from_address
    ctx_versioned = DLManagedTensorVersioned.manager_ctx.offset
    ctx_legacy = DLManagedTensor.manager_ctx.offset
    names = ((_NAME_VERSIONED, ctx_versioned), (_NAME_LEGACY, ctx_legacy))
    is_valid, get_pointer, err_occurred = _raw_is_valid, _raw_get_pointer, _err_occurred

    def release(managed_ptr: int, ctx_offset: int) -> None:
        with lock:
            record = records.pop(read_ptr(managed_ptr + ctx_offset).value, None)
        del record  # drops the owner outside the lock: its finaliser may export again

    def free_unconsumed(capsule_ptr: int) -> None:
        for name, ctx_offset in names:
            if is_valid(capsule_ptr, name):  # unconsumed, so nobody else will call the deleter
                release(get_pointer(capsule_ptr, name), ctx_offset)
                return

    def guarded(work: Any, *args: Any) -> None:
        # With an exception pending every C call here would fail, so take it out first (a
        # PYFUNCTYPE call raises it), free the memory, then raise it again for ctypes to report
        # as "ignored": a callback has no way to hand it back to its C caller.
        pending = None
        try:
            err_occurred()
        except BaseException as exc:  # noqa: BLE001
            pending = exc
        try:
            work(*args)
        except BaseException:  # noqa: BLE001 - nothing useful can be raised into C
            pass
        if pending is not None:
            raise pending

    return (_Deleter(lambda ptr: guarded(release, ptr, ctx_versioned)),
            _Deleter(lambda ptr: guarded(release, ptr, ctx_legacy)),
            _CapsuleDestructor(lambda ptr: guarded(free_unconsumed, ptr)))


_DELETER_VERSIONED, _DELETER_LEGACY, _CAPSULE_DESTRUCTOR = _make_callbacks(_records, _records_lock)
# One leaked reference each makes these immortal: capsules and consumers keep raw pointers to
# the names and callback thunks, possibly until after this module is torn down.
for _immortal in (_NAME_VERSIONED, _NAME_LEGACY, _USED_VERSIONED, _USED_LEGACY,
                  _DELETER_VERSIONED, _DELETER_LEGACY, _CAPSULE_DESTRUCTOR):
    _py_incref(_immortal)
_PROBE = ctypes.c_int(0)
_CAPSULE_TYPE = type(_capsule_new(ctypes.addressof(_PROBE), None, _CapsuleDestructor()))


# ---------------------------------------------------------------- dtypes

_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6
_KIND_CODES = {"i": _INT, "u": _UINT, "f": _FLOAT, "c": _COMPLEX, "b": _BOOL}
_NUMPY_TYPES = {
    (_INT, 8): np.int8, (_INT, 16): np.int16, (_INT, 32): np.int32, (_INT, 64): np.int64,
    (_UINT, 8): np.uint8, (_UINT, 16): np.uint16, (_UINT, 32): np.uint32, (_UINT, 64): np.uint64,
    (_FLOAT, 16): np.float16, (_FLOAT, 32): np.float32, (_FLOAT, 64): np.float64,
    (_COMPLEX, 64): np.complex64, (_COMPLEX, 128): np.complex128, (_BOOL, 8): np.bool_,
}
#: ml_dtypes' types that DLPack (1.1) names: bfloat16 and the one-byte float8 codes. (Its
#: float4 and sub-byte integers are packed, two to a byte; ml_dtypes holds one per byte.)
#: By name, so that ml_dtypes is imported only when one of them is met.
_ML_TYPES = {
    (_BFLOAT, 16): "bfloat16", (10, 8): "float8_e4m3fn", (11, 8): "float8_e4m3fnuz", (12, 8): "float8_e5m2",
    (13, 8): "float8_e5m2fnuz", (14, 8): "float8_e8m0fnu",
}
_ML_CODES = {name: key for key, name in _ML_TYPES.items()}
_SUPPORTED = ("bool, (u)int8-64, float16/32/64, bfloat16, float8 (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, e8m0fnu) or "
              "complex64/128")


def dlpack_dtype(dtype: Any) -> tuple[int, int, int]:
    """DLPack ``(code, bits, lanes)`` of a numpy dtype; raise DLPackError if DLPack has none."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise DLPackError(f"{dtype!r} is not a numpy dtype; pass e.g. numpy.dtype('float32')"
                          ) from exc
    if dt in STORAGE_DTYPES and dt.name in _ML_CODES:
        return (*_ML_CODES[dt.name], 1)
    code = _KIND_CODES.get(dt.kind) if dt.kind != "V" else None
    if code is None or (code, dt.itemsize * 8) not in _NUMPY_TYPES:
        # int4, float4, ...: ml_dtypes keeps one element per byte, DLPack's 4-bit codes are packed.
        raise DLPackError(f"element type {dt} has no DLPack equivalent; convert to {_SUPPORTED} "
                          "first (astype)")
    if not dt.isnative:
        raise DLPackError(f"element type {dt.str} is not in native byte order, which DLPack "
                          "requires; convert with astype(dtype.newbyteorder('='))")
    return (code, dt.itemsize * 8, 1)


def numpy_dtype(code: int, bits: int, lanes: int) -> np.dtype:
    """numpy dtype of a DLPack ``(code, bits, lanes)``; raise DLPackError if numpy has none."""
    if lanes != 1:
        raise DLPackError(f"DLPack vector types (lanes={lanes}) are not supported; have the "
                          "producer export lanes=1 with a trailing dimension instead")
    if (code, bits) in _ML_TYPES:
        return storage_dtype(_ML_TYPES[(code, bits)])
    if (code, bits) not in _NUMPY_TYPES:
        raise DLPackError(f"DLPack element type (code={code}, bits={bits}) is not supported; "
                          f"convert to {_SUPPORTED} on the producer side")
    return np.dtype(_NUMPY_TYPES[(code, bits)])


# ---------------------------------------------------------------- export

def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of the dense row-major layout of ``shape``."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def reshaped_strides(shape: tuple[int, ...], strides: tuple[int, ...], new_shape: tuple[int, ...]
              ) -> tuple[int, ...] | None:
    """Element strides that lay ``new_shape`` over the elements of a ``shape`` with element
    ``strides`` in the same (row-major) order, or None when only a copy can (numpy's no-copy
    reshape: dims merge only where they are contiguous among themselves)."""
    if math.prod(shape) != math.prod(new_shape):
        return None
    if math.prod(shape) == 0:
        return tuple(row_major_strides(new_shape))
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    out = [0] * len(new_shape)
    oi = ni = 0
    while ni < len(new_shape) and oi < len(old):
        oj, nj = oi + 1, ni + 1
        o_size, n_size = old[oi][0], new_shape[ni]
        while o_size != n_size:
            if n_size < o_size:
                n_size *= new_shape[nj]
                nj += 1
            else:
                o_size *= old[oj][0]
                oj += 1
        for k in range(oi, oj - 1):  # the merged old dims must be contiguous among themselves
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        out[nj - 1] = old[oj - 1][1]
        for k in range(nj - 1, ni, -1):
            out[k - 1] = out[k] * new_shape[k]
        oi, ni = oj, nj
    for k in range(ni, len(new_shape)):  # trailing dims of size 1
        out[k] = 1
    return tuple(out)


def export_capsule(*, data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None,
                   dtype: Any, device: tuple[int, int], owner: object, readonly: bool = False,
                   byte_offset: int = 0, versioned: bool = True, copied: bool = False) -> Any:
    """Wrap memory in a DLPack capsule, keeping ``owner`` alive until the consumer is done.

    ``strides`` are in elements (None means row-major; the capsule always carries explicit
    strides, since some consumers mishandle NULL). ``versioned=True`` makes a DLPack 1.0
    ``"dltensor_versioned"`` capsule with the read-only / is-copied flags; ``versioned=False`` a
    legacy ``"dltensor"`` capsule. A legacy capsule cannot mark memory read-only, so
    ``readonly=True, versioned=False`` raises DLPackError (the Array API asks producers to refuse
    what they cannot honour); ``copied`` is dropped for legacy capsules, which cannot say it.
    """
    code, bits, lanes = dlpack_dtype(dtype)
    try:
        dev_type, dev_id = DLDeviceType(int(device[0])), int(device[1])
    except (TypeError, ValueError, IndexError) as exc:
        raise DLPackError(f"device {device!r} is not a (DLDeviceType, device_id) pair; known "
                          f"types: {', '.join(t.name for t in DLDeviceType)}") from exc
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise DLPackError(f"shape {shape} has a negative extent")
    strides = row_major_strides(shape) if strides is None else tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise DLPackError(f"strides {strides} do not match shape {shape}: give one per dimension")
    if data_ptr < 0 or byte_offset < 0:
        raise DLPackError(f"data_ptr ({data_ptr}) and byte_offset ({byte_offset}) must be >= 0")
    if readonly and not versioned:
        raise DLPackError("cannot export read-only memory in a legacy (unversioned) DLPack "
                          "capsule, which has no read-only flag; the consumer should ask with "
                          "max_version=(1, 0), or export a writable copy")
    ndim = len(shape)
    shape_arr = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides_arr = (ctypes.c_int64 * max(ndim, 1))(*strides)
    if versioned:
        managed: Any = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = ((DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0)
                         | (DLPACK_FLAG_BITMASK_IS_COPIED if copied else 0))
        managed.deleter, name = _DELETER_VERSIONED, _NAME_VERSIONED
    else:
        managed = DLManagedTensor()
        managed.deleter, name = _DELETER_LEGACY, _NAME_LEGACY
    rid = managed.manager_ctx = next(_ids)
    t = managed.dl_tensor
    t.data = data_ptr or None
    t.device = DLDevice(dev_type, dev_id)
    t.ndim = ndim
    t.dtype = DLDataType(code, bits, lanes)
    t.shape = ctypes.cast(shape_arr, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides_arr, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = byte_offset
    with _records_lock:
        _records[rid] = (owner, managed, shape_arr, strides_arr)
    try:
        return _capsule_new(ctypes.addressof(managed), name, _CAPSULE_DESTRUCTOR)
    except BaseException:
        with _records_lock:
            _records.pop(rid, None)
        raise


# ---------------------------------------------------------------- import

def _call_deleter(deleter_ptr: int, managed_ptr: int) -> None:
    _Deleter(deleter_ptr)(managed_ptr)


@dataclass(eq=False)
class ImportedTensor:
    """A consumed DLPack tensor: a borrowed view of memory the producer owns.

    ``data_ptr`` already includes the producer's byte offset, which is also kept in
    ``byte_offset`` for handles that are not addresses (OpenCL's ``cl_mem``: the handle is
    ``data_ptr - byte_offset``); ``strides`` are in elements;
    ``device`` is ``(DLDeviceType or int, device_id)``; ``copied`` is the producer's IS_COPIED
    flag (always False for legacy capsules). The memory stays valid until :meth:`release` is
    called or this object is garbage collected.
    """

    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    device: tuple[int, int]
    readonly: bool
    copied: bool = False
    byte_offset: int = 0
    _finalizer: Any = field(default=None, init=False, repr=False)

    @property
    def released(self) -> bool:
        """True once the producer's deleter has been called (or if there is none)."""
        return self._finalizer is None or not self._finalizer.alive

    def release(self) -> None:
        """Call the producer's deleter; later calls do nothing."""
        if self._finalizer is not None:
            self._finalizer()


def from_capsule(capsule: Any, *, within: tuple[int, int] | None = None) -> ImportedTensor:
    """Consume a ``"dltensor_versioned"`` or ``"dltensor"`` capsule and describe its memory.

    The capsule is renamed ``"used_..."`` so the producer's destructor leaves the memory alone;
    from then on the returned tensor is responsible for calling the deleter. A tensor the
    producer describes impossibly (see :data:`MAX_NDIM`, negative extents, a NULL data pointer
    with elements, bytes past the end of the address space, or outside ``within``, the
    ``[start, end)`` addresses of the memory the producer exposes, where that is known: see
    :func:`producer_bounds`) raises DLPackError and leaves the capsule unconsumed.
    """
    if type(capsule) is not _CAPSULE_TYPE:
        raise DLPackError(f"expected a DLPack capsule, got {type(capsule).__name__}; "
                          "pass the result of obj.__dlpack__() (or use request_capsule)")
    with _consume_lock:  # check-and-rename must be atomic, or two consumers could both win
        name = _capsule_get_name(capsule)
        if name == _NAME_VERSIONED:
            managed_ptr = _capsule_get_pointer(capsule, name)
            managed: Any = DLManagedTensorVersioned.from_address(managed_ptr)
            major, minor = managed.version.major, managed.version.minor
            if major > DLPACK_VERSION[0]:
                raise DLPackError(
                    f"DLPack capsule has ABI version {major}.{minor}, but polyhal reads only "
                    f"{DLPACK_VERSION[0]}.x; ask the producer for max_version={DLPACK_VERSION} "
                    "(request_capsule does) or upgrade polyhal")
            flags, used = managed.flags, _USED_VERSIONED
        elif name == _NAME_LEGACY:
            managed_ptr = _capsule_get_pointer(capsule, name)
            managed = DLManagedTensor.from_address(managed_ptr)
            flags, used = 0, _USED_LEGACY
        elif name in (_USED_VERSIONED, _USED_LEGACY):
            raise DLPackError("this capsule was already consumed; DLPack capsules can be consumed "
                              "once: call __dlpack__() again for a new one")
        else:
            raise DLPackError(f"capsule named {name!r} is not a DLPack tensor; expected "
                              "'dltensor_versioned' or 'dltensor'")
        # Read and check everything before renaming: on error the capsule stays unconsumed
        # and the producer's destructor frees it.
        t = managed.dl_tensor
        dtype = numpy_dtype(t.dtype.code, t.dtype.bits, t.dtype.lanes)
        shape, strides = _checked_layout(t, dtype.itemsize, within)
        dev_type = t.device.device_type
        if dev_type in DLDeviceType._value2member_map_:
            dev_type = DLDeviceType(dev_type)
        deleter_ptr = ctypes.c_void_p.from_address(
            managed_ptr + type(managed).deleter.offset).value
        data_ptr = (t.data or 0) + t.byte_offset
        if _capsule_set_name(capsule, used) != 0:
            raise DLPackError("could not mark the DLPack capsule as used")
    imported = ImportedTensor(
        data_ptr=data_ptr, shape=shape, strides=strides, dtype=dtype,
        device=(dev_type, t.device.device_id), readonly=bool(flags & DLPACK_FLAG_BITMASK_READ_ONLY),
        copied=bool(flags & DLPACK_FLAG_BITMASK_IS_COPIED), byte_offset=int(t.byte_offset))
    if deleter_ptr:  # DLPack allows a NULL deleter when there is nothing to free
        imported._finalizer = weakref.finalize(imported, _call_deleter, deleter_ptr, managed_ptr)
    return imported


#: The most dimensions an imported tensor may have: numpy's (``NPY_MAXDIMS``), past which numpy
#: refuses a DLPack tensor too, and a bound on how far a lying ``ndim`` makes us read.
MAX_NDIM = 64
_ADDRESS_END = 1 << (8 * ctypes.sizeof(ctypes.c_void_p))


def _checked_layout(t: DLTensor, itemsize: int, within: tuple[int, int] | None
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and element strides of ``t``, refused (DLPackError) where the producer's
    description cannot be right: what numpy's ``from_dlpack`` refuses (too many dimensions,
    negative extents, more bytes than an address space holds), and the bytes the element
    strides reach lying outside the address space or outside ``within``."""
    ndim = t.ndim
    if not 0 <= ndim <= MAX_NDIM or (ndim and not t.shape):
        raise DLPackError(f"malformed DLPack tensor: ndim={ndim} with a {'set' if t.shape else 'NULL'} shape "
                          f"pointer (polyhal, like numpy, reads 0 to {MAX_NDIM} dimensions); the producer is broken")
    shape = tuple(t.shape[:ndim])
    if any(n < 0 for n in shape):
        raise DLPackError(f"malformed DLPack tensor: shape {shape} has a negative extent; the producer is broken")
    strides = tuple(t.strides[:ndim]) if t.strides else row_major_strides(shape)
    size = math.prod(shape)
    if math.prod(max(n, 1) for n in shape) * itemsize > sys.maxsize:  # even when empty, as numpy
        raise DLPackError(f"malformed DLPack tensor: shape {shape} of {itemsize}-byte elements is more memory "
                          "than an address space holds; the producer is broken")
    if any(abs(s) * itemsize > sys.maxsize for s in strides):  # numpy's byte strides would overflow
        raise DLPackError(f"malformed DLPack tensor: element strides {strides} of {itemsize}-byte elements "
                          "step further than an address space holds; the producer is broken")
    if not size:
        return shape, strides  # no byte is read, so the pointer and strides cannot mislead
    if not t.data:
        raise DLPackError(f"malformed DLPack tensor: a NULL data pointer for {size} elements (shape {shape}); "
                          "the producer is broken")
    start = t.data + t.byte_offset
    first = start + itemsize * sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    end = start + itemsize * (sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + 1)
    lo, hi = within if within is not None else (0, _ADDRESS_END)
    if first < lo or end > hi or end - first > sys.maxsize:  # the last: no ssize_t can index it
        where = (f"outside the memory its producer exposes [{lo:#x}, {hi:#x})" if within is not None
                 else "more than an address space holds" if lo <= first and end <= hi
                 else "outside the address space")
        raise DLPackError(f"malformed DLPack tensor: shape {shape} with element strides {strides} from address "
                          f"{start:#x} (byte_offset {t.byte_offset}) reaches bytes [{first:#x}, {end:#x}), {where}; "
                          "the producer is broken")
    return shape, strides


def producer_bounds(obj: Any) -> tuple[int, int] | None:
    """The ``[start, end)`` addresses of the memory ``obj`` exposes, where that is known (a numpy
    array's, whose ``__dlpack__`` exports exactly that memory); None otherwise. Passed to
    :func:`from_capsule` as ``within``, it refuses a producer whose capsule reaches further."""
    if not isinstance(obj, np.ndarray):
        return None
    return _byte_bounds(obj)


def request_capsule(obj: Any, *, max_version: tuple[int, int] | None = DLPACK_VERSION,
                    dl_device: tuple[int, int] | None = None, copy: bool | None = None,
                    stream: Any = None) -> Any:
    """Ask ``obj`` for a DLPack capsule with the Array API 2023.12 ``__dlpack__`` keywords.

    ``max_version`` and ``stream`` are always passed (``max_version=None`` asks for a legacy
    capsule); ``dl_device`` and ``copy`` only when set. A producer that predates the keywords
    raises TypeError; then the legacy call (``__dlpack__(stream=stream)``, or no arguments) is
    tried, unless ``dl_device`` or ``copy`` was asked for, which a legacy producer cannot honour.
    """
    dlpack = getattr(obj, "__dlpack__", None)
    if dlpack is None:
        raise DLPackError(f"{type(obj).__name__} does not support DLPack (no __dlpack__ method); "
                          "convert it to a numpy array or another DLPack producer first")
    kwargs: dict[str, Any] = {}
    if max_version is not None:
        kwargs["max_version"] = tuple(max_version)
    if dl_device is not None:
        kwargs["dl_device"] = tuple(dl_device)
    if copy is not None:
        kwargs["copy"] = copy
    if kwargs:
        try:
            return dlpack(stream=stream, **kwargs)
        except TypeError as exc:
            if dl_device is not None or copy is not None:
                raise DLPackError(
                    f"{type(obj).__name__}.__dlpack__ does not accept the Array API 2023.12 "
                    f"keywords (dl_device={dl_device!r}, copy={copy!r}): {exc}; upgrade the "
                    "producer, or do not ask for a device or a copy") from exc
    return dlpack(stream=stream) if stream is not None else dlpack()
