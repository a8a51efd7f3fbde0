"""Tensors: a typed, shaped view of a buffer on a device, exchanged through DLPack."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from polyhal import dlpack
from polyhal.dlpack import row_major_strides
from polyhal.errors import DeviceNotFoundError, DLPackError, LifetimeError, OutOfMemoryError, PolyhalError
from polyhal.hal.flags import BufferUsage, MemoryAccess, MemoryType
from polyhal.hal.transfer import route, transfer_fn
from polyhal.ir.types import TensorType, as_dtype, as_shape

if TYPE_CHECKING:
    from polyhal.hal.buffer import Buffer
    from polyhal.hal.device import Device

_CPU = (int(dlpack.DLDeviceType.CPU), 0)


class Tensor:
    """A tensor on a device: a :class:`TensorType` over a :class:`~polyhal.hal.buffer.Buffer`.

    ``strides`` are in elements (DLPack's convention); ``offset`` is in bytes. Tensors made by
    polyhal are dense row-major; imported ones may be strided.
    """

    __slots__ = ("buffer", "type", "offset", "strides", "readonly", "_native", "_contiguous", "__weakref__")

    def __init__(self, buffer: "Buffer", type: TensorType, offset: int = 0,
                 strides: tuple[int, ...] | None = None, readonly: bool = False) -> None:
        self.buffer = buffer
        self.type = type
        self.offset = offset
        dense = row_major_strides(type.shape)
        self.strides = dense if strides is None else tuple(strides)
        # Known once: plans check it on every tensor they are given.
        self._contiguous = self.strides == dense or type.size <= 1
        self.readonly = readonly
        self._native = None

    # -- properties ------------------------------------------------------------------------------

    shape = property(lambda self: self.type.shape, doc="Dimensions.")
    dtype = property(lambda self: self.type.dtype, doc="Element type (numpy dtype).")
    encoding = property(lambda self: self.type.encoding, doc="Layout encoding, None if dense.")
    device = property(lambda self: self.buffer.device, doc="The device holding the memory.")
    ndim = property(lambda self: len(self.type.shape))
    size = property(lambda self: self.type.size)
    nbytes = property(lambda self: self.type.nbytes)

    @property
    def is_contiguous(self) -> bool:
        """Whether the elements lie dense in row-major order (or there is at most one)."""
        return self._contiguous

    @property
    def native(self) -> Any:
        """The backend's own array object over this tensor's memory (cached)."""
        if self._native is None:
            self._native = self.buffer.device.view(self)
        return self._native

    def __repr__(self) -> str:
        return f"<Tensor {self.type} on {self.device.name}>"

    def release(self) -> None:
        """Release the underlying buffer now (views of it become invalid)."""
        self._native = None
        self.buffer.release()

    def to_device(self, device: "Device | str", /, *, stream: Any = None) -> "Tensor":
        """A copy of this tensor on ``device`` (a :class:`~polyhal.hal.device.Device` or its name),
        or this tensor when it already lives there (the Array API's ``to_device``).

        The bytes move the way a plan's transfer would (:func:`polyhal.hal.transfer.route`: the
        destination's or source's backend where it can copy that pair, else through a host array).
        :class:`~polyhal.errors.DeviceNotFoundError` for a name no plugin registered;
        :class:`~polyhal.errors.OutOfMemoryError` naming both devices when ``device`` cannot hold
        the tensor. ``stream`` is accepted for the Array API and unused (the copy is complete on
        return).
        """
        src = self.device
        dst = device if not isinstance(device, str) else self._find_device(device)
        if dst is src:
            return self
        free = dst.memory_available()
        if free is not None and self.nbytes > free:
            raise OutOfMemoryError(f"moving {self} from {src.name} to {dst.name} needs {self.nbytes} B on {dst.name}, "
                                   f"which has {free} B free; free memory there or move a smaller tensor")
        try:
            out = empty(self.shape, self.dtype, dst)
        except OutOfMemoryError as exc:
            raise OutOfMemoryError(f"moving {self} from {src.name} to {dst.name}: {exc}") from exc
        if not self.is_contiguous:  # transfers move dense bytes: a dense host copy first
            out.device.write(out.buffer, 0, np.ascontiguousarray(self.numpy()))
        elif self.nbytes:
            transfer_fn(route(src, dst), self.shape, self.dtype)(self.native, out.native)
        return out

    def _find_device(self, name: str) -> "Device":
        find = self.device.find_device
        if name == self.device.name:
            return self.device
        if find is None:
            raise DeviceNotFoundError(f"no device {name!r}: {self.device.name} was made outside a registry and "
                                      "knows no other device; pass a Device object")
        return find(name)

    # -- host access -----------------------------------------------------------------------------

    def numpy(self, copy: bool | None = None) -> np.ndarray:
        """A numpy array of the contents: a zero-copy view where the memory is host-addressable and
        ``copy`` is not True, else a copy (refused when ``copy`` is False)."""
        if self.buffer.host_visible and copy is not True and self.device.dlpack_device(self.buffer) == _CPU:
            return self._host_view()
        if copy is False:
            raise DLPackError(
                f"{self} is not host-addressable, so a numpy view would need a copy; call "
                "tensor.numpy() (copy allowed) or allocate it HOST_VISIBLE"
            )
        out = np.empty(self.shape, self.dtype)
        if self.is_contiguous:
            self.device.read(self.buffer, self.offset, out)
        else:
            raise DLPackError(f"copying a strided device tensor to the host is not supported: {self}")
        return out

    def _host_view(self) -> np.ndarray:
        access = MemoryAccess.READ if self.readonly else MemoryAccess.READ | MemoryAccess.WRITE
        raw = self.buffer.map(access)
        if self.is_contiguous:  # a plain view (as_strided costs several microseconds)
            arr = raw[self.offset: self.offset + self.nbytes].view(self.dtype).reshape(self.shape)
            if self.readonly:
                arr.flags.writeable = False
            return arr
        item = self.dtype.itemsize
        extent = sum((d - 1) * s for d, s in zip(self.shape, self.strides) if d > 0) + 1 if self.size else 0
        flat = raw[self.offset: self.offset + extent * item].view(self.dtype)
        return np.lib.stride_tricks.as_strided(
            flat, self.shape, tuple(s * item for s in self.strides), writeable=not self.readonly)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        arr = self.numpy(copy=copy)
        return arr if dtype is None else arr.astype(dtype, copy=False)

    # -- DLPack ----------------------------------------------------------------------------------

    def __dlpack_device__(self) -> tuple[int, int]:
        dev_type, dev_id = self.device.dlpack_device(self.buffer)
        return (dlpack.DLDeviceType(dev_type), dev_id)

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """Export as a DLPack capsule (Array API 2023.12).

        ``max_version`` of 1.x or more gives a versioned capsule, else a legacy one. ``dl_device``
        may ask for the CPU: a host-addressable buffer is exported as is, anything else is copied
        to the host when ``copy`` is not False and refused otherwise. ``copy=True`` always copies.
        ``stream`` is the consumer's stream; backends with streams order the export against it.
        """
        if self.buffer.released:
            raise LifetimeError(f"{self} was released and cannot be exported; export it before releasing it")
        versioned = max_version is not None and max_version[0] >= 1
        here = tuple(int(v) for v in self.device.dlpack_device(self.buffer))
        want = here if dl_device is None else (int(dl_device[0]), int(dl_device[1]))
        if want != here and want != _CPU:
            if copy is not True and self.device.dlpack_alias(self.buffer, want):
                # The same memory, reachable as ``want`` (CUDA managed/pinned memory as kDLCUDA).
                self.device._export_sync(self.buffer, stream)
                return dlpack.export_capsule(
                    data_ptr=self.device.buffer_address(self.buffer), shape=self.shape, strides=self.strides,
                    dtype=self.dtype, device=want, owner=self.buffer.hold(self), readonly=self.readonly,
                    byte_offset=self.offset, versioned=versioned)
            raise DLPackError(f"{self} cannot be exported to DLPack device {want}; it lives on {here}")
        host_ok = self.buffer.host_visible and want == _CPU
        if copy is True or (want != here and not host_ok):
            if copy is False:
                raise DLPackError(
                    f"{self} lives on DLPack device {here}; exporting it to the CPU needs a copy, "
                    "which copy=False forbids. Pass copy=None/True, or call tensor.numpy()")
            host = np.array(self.numpy(copy=True), copy=False)
            return dlpack.export_capsule(
                data_ptr=host.ctypes.data, shape=host.shape, strides=None, dtype=host.dtype,
                device=_CPU, owner=host, readonly=False, versioned=versioned, copied=True)
        self.device._export_sync(self.buffer, stream)
        if want == _CPU and here != _CPU:
            view = self._host_view()
            return dlpack.export_capsule(
                data_ptr=view.ctypes.data, shape=view.shape,
                strides=tuple(s // self.dtype.itemsize for s in view.strides), dtype=self.dtype,
                device=_CPU, owner=self.buffer.hold(self, view), readonly=self.readonly, versioned=versioned)
        return dlpack.export_capsule(
            data_ptr=self.device.buffer_address(self.buffer), shape=self.shape, strides=self.strides,
            dtype=self.dtype, device=here, owner=self.buffer.hold(self), readonly=self.readonly,
            byte_offset=self.offset, versioned=versioned)


# -- constructors ----------------------------------------------------------------------------------
# On a given Device only: naming a device or taking the default one is the registry's business,
# one layer up (polyhal.creation), so that the HAL imports nothing above it.

def empty(shape: Any, dtype: Any, device: "Device",
          memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
          usage: BufferUsage = BufferUsage.DEFAULT) -> Tensor:
    """An uninitialised dense tensor on ``device``."""
    ttype = TensorType(as_shape(shape), as_dtype(dtype))
    # A tensor with no elements still gets a minimal buffer so that it has an address.
    buf = device.allocator.allocate(max(ttype.nbytes, 1), memory_type, usage)
    return Tensor(buf, ttype)


def asarray(obj: Any, dtype: Any, device: "Device",
            memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL) -> Tensor:
    """A new tensor on ``device`` holding a copy of ``obj`` (anything numpy accepts)."""
    host = np.asarray(obj, dtype=dtype, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    if host.dtype == np.float64 and dtype is None and not isinstance(obj, np.ndarray):
        host = host.astype(np.float32)  # Python floats become float32, the runtime's default
    t = empty(host.shape, host.dtype, device, memory_type)
    if host.nbytes:
        t.device.write(t.buffer, 0, host)
    return t


def _consumer_stream(obj: Any, owner_of: "Callable[[tuple[int, int]], Device]") -> Any:
    """The stream of the device that will import ``obj`` (Array API: the consumer passes its
    stream so that the producer orders its pending work before it); None for host memory."""
    try:
        dl_device = obj.__dlpack_device__()
        owner = owner_of((int(dl_device[0]), int(dl_device[1])))
    except Exception:  # noqa: BLE001 - no __dlpack_device__, or nobody imports it: the import reports it
        return None
    return owner.dlpack_consumer_stream()


def from_dlpack(obj: Any, owner_of: "Callable[[tuple[int, int]], Device]", *, device: "Device | None" = None,
                copy: bool | None = None) -> Tensor:
    """Import any DLPack producer (numpy, cupy, torch, jax, a polyhal tensor) without copying.

    ``owner_of`` maps a DLPack (device type, id) to the device that imports such memory (the
    registry's ``device_for_dlpack``). The memory stays owned by the producer (an EXTERNAL
    buffer) and is released when the tensor is. With ``device`` other than where the data
    lives, the data is copied there unless ``copy`` is False.
    """
    if isinstance(obj, Tensor) and copy is not True and (device is None or device is obj.device):
        # Our own tensor: share its buffer directly (the DLPack device type alone cannot say
        # which of several devices with host-visible memory owns it).
        return Tensor(obj.buffer, obj.type, obj.offset, obj.strides, obj.readonly)
    capsule = obj if type(obj).__name__ == "PyCapsule" else dlpack.request_capsule(
        obj, copy=True if copy else None, stream=_consumer_stream(obj, owner_of))
    # A copy the producer made lies outside the memory it exposes, so only a view is bounded.
    imported = dlpack.from_capsule(capsule, within=None if copy else dlpack.producer_bounds(obj))
    try:
        if any(s < 0 for s in imported.strides):
            raise DLPackError(f"the DLPack tensor has negative strides {imported.strides} (a reversed view), which "
                              "polyhal tensors cannot describe; pass a copy (numpy.ascontiguousarray, or copy=True)")
        owner = owner_of(imported.device)
        buf = owner.import_dlpack(imported)
    except PolyhalError:
        imported.release()
        raise
    except Exception as exc:  # a backend's own error for memory it cannot take
        imported.release()
        raise DLPackError(f"cannot import the DLPack tensor (shape {imported.shape}, strides {imported.strides}, "
                          f"device {imported.device}): {type(exc).__name__}: {exc}") from exc
    ttype = TensorType(imported.shape, imported.dtype)
    tensor = Tensor(buf, ttype, strides=imported.strides, readonly=imported.readonly)
    if device is not None and device is not owner:
        if copy is False:
            raise DLPackError(f"data lives on {owner.name}; moving it to {device.name} needs a copy")
        return tensor.to_device(device)  # the route a plan's transfer would take (explain: hal.transfer.route)
    return tensor
