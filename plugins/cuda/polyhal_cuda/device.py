"""CUDADevice: one GPU, its stream, allocator, kernels, transfers, DLPack and graph replay.

Queue: one CUDA stream per device, created with the *default* (blocking) flag, so that it also
orders itself after work that other libraries put on the legacy default stream (torch's and
cupy's default). Kernels, copies and frees are issued on it; ``synchronize`` waits for that
stream only, never for the whole device. As a HAL queue (``queues``,
:class:`~polyhal_cuda.queue.CUDAQueue`) it signals timeline semaphores with CUDA events, which
other CUDA queues wait for with ``cudaStreamWaitEvent``.

DLPack, per buffer kind:

=================  ===========================  =================================
kind               exported as                  also exportable (``dl_device=``)
=================  ===========================  =================================
DEVICE, ASYNC      ``(kDLCUDA=2, ordinal)``     —
MANAGED            ``(kDLCUDAManaged=13, n)``   ``(2, n)``, CPU (``(1, 0)``)
HOST (pinned)      ``(kDLCUDAHost=3, n)``       ``(2, n)``, CPU (``(1, 0)``)
EXTERNAL           what the memory is (CUDA reports it through ``cudaPointerGetAttributes``)
=================  ===========================  =================================

Managed and pinned memory are reachable by kernels at the same address (unified addressing),
so exporting them as kDLCUDA for a consumer that asks (torch and cupy read only kDLCUDA /
kDLCUDAManaged) is zero-copy and honest. Stream semantics (Array API): the consumer passes its
stream; we record an event on ours and make the consumer's stream wait on it
(``cudaStreamWaitEvent``), so nothing blocks the host and nothing synchronises the device.
``stream=None`` means the legacy default stream for device memory; for host-visible memory it
means the consumer may be the host, so the host waits for that event (our stream only).
``-1`` asks for no ordering. Anything but an int, and 0 (ambiguous by the standard), is refused.
When polyhal *imports*, the core hands this device's stream to the producer
(:meth:`dlpack_consumer_stream`), so the producer orders its work before ours.
"""

from __future__ import annotations

import ctypes
import threading
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from polyhal.errors import DLPackError
from polyhal.hal.buffer import Buffer
from polyhal.hal.device import Device
from polyhal.hal.flags import BufferKind, MemoryAccess, MemoryType
from polyhal.hal.records import DeviceSpec

from polyhal_cuda.kernels import TABLE
from polyhal_cuda.allocator import MANAGED_MEMORY, PINNED_MEMORY, CUDAAllocator, CUDAMemory
from polyhal_cuda.errors import check, translate
from polyhal_cuda.queue import CUDAQueue
from polyhal_gpu.memory import import_extent
from polyhal_gpu.peer import PeerAccess
from polyhal_gpu.storage import bits_dtype
from polyhal_cuda.transfer import Stager

if TYPE_CHECKING:
    from polyhal.dlpack import ImportedTensor

DL_CPU, DL_CUDA, DL_CUDA_HOST, DL_CUDA_MANAGED = 1, 2, 3, 13
_DLPACK_TYPE = {BufferKind.HOST: DL_CUDA_HOST, BufferKind.MANAGED: DL_CUDA_MANAGED}
#: cudaPointerGetAttributes memory types.
_PTR_HOST, _PTR_DEVICE, _PTR_MANAGED = 1, 2, 3
_STREAM_LEGACY, _STREAM_PER_THREAD = 1, 2


class _Activation:
    """Context manager making the device current and its stream cupy's current stream
    (thread-safe: cupy keeps the stream stack per thread, and the previous device is kept on
    a per-thread stack here)."""

    __slots__ = ("ordinal", "stream", "_tls")

    def __init__(self, ordinal: int, stream: Any) -> None:
        self.ordinal, self.stream, self._tls = ordinal, stream, threading.local()

    def __enter__(self) -> "_Activation":
        from cupy.cuda import runtime

        prev = runtime.getDevice()
        if prev != self.ordinal:
            runtime.setDevice(self.ordinal)
        stack = self._tls.__dict__.setdefault("stack", [])
        stack.append(prev)
        self.stream.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        from cupy.cuda import runtime

        self.stream.__exit__(*exc)
        prev = self._tls.stack.pop()
        if prev != self.ordinal:
            runtime.setDevice(prev)


class CUDADevice(Device):
    """A CUDA GPU as a polyhal device; made by the spec's factory on first use.

    Public for tools and tests: ``stream`` (the cupy stream everything runs on),
    ``allocator`` (:class:`~polyhal_cuda.allocator.CUDAAllocator`), ``stager`` (pinned
    staging for pageable transfers), ``modules`` (compiled CUDA C modules by key).
    """

    dlpack_device_type = DL_CUDA
    # host <-> device transfers: page-locked host memory by one DMA, pageable through the stager
    host_copy_path = "direct for page-locked host memory, else pinned staging"
    kernels = TABLE

    @property
    def kernel_names(self) -> frozenset[str]:
        """The ops its spec declares (:func:`polyhal_cuda.plugin.conv_path`: ``fused_conv`` only
        where cuDNN runs it), so placement and the device agree on what it serves."""
        declared = self.spec.kernel_names
        return declared if declared is not None else TABLE.kernel_names

    def __init__(self, spec: DeviceSpec) -> None:
        import cupy

        super().__init__(spec)
        ordinal = int(spec.limits.get("ordinal", 0))
        with check(f"creating the CUDA context and stream of {spec.name}"), cupy.cuda.Device(ordinal):
            self.stream = cupy.cuda.Stream(non_blocking=False)
            self._export_event = cupy.cuda.Event(disable_timing=True)
        self._scope = _Activation(ordinal, self.stream)
        #: The device's own allocator (``native_allocator``, typed); ``allocator`` may later be
        #: wrapped by adaptors (``wrap_allocator`` hook), so pool-level operations go through this one.
        self.native_allocator = self.allocator = self.cuda_allocator = CUDAAllocator(self, spec.heaps)
        self.stager = Stager(self)
        self.modules: dict[Any, Any] = {}
        self._modules_lock = threading.Lock()

    def activate(self) -> _Activation:
        """``with device.activate():`` — this GPU current, its stream cupy's current stream."""
        return self._scope

    @property
    def queues(self) -> tuple[CUDAQueue, ...]:
        """One :class:`~polyhal_cuda.queue.CUDAQueue` on :attr:`stream` (signals are CUDA events)."""
        queues = self.__dict__.get("_queues")
        if queues is None:
            queues = self.__dict__.setdefault("_queues", (CUDAQueue(self),))
        return queues

    def close(self) -> None:
        """Finish queued work, free staging buffers and give cached memory back to CUDA."""
        self.synchronize()
        self.stager.close()
        self.cuda_allocator.trim()

    # -- kernels ---------------------------------------------------------------------------------

    def prepare(self, op: str, attrs: Mapping[str, Any], in_types, out_types, scratch: Any = None
                ) -> Callable[..., None]:
        """The kernel for one op instance, run on this device's stream (see :mod:`.kernels`);
        ``scratch`` is the plan's :class:`~polyhal.hal.scratch.ScratchBinding` for kernels that
        declared scratch (without one they place and allocate it themselves)."""
        with self.activate():
            fn = super().prepare(op, attrs, in_types, out_types, scratch)
        scope, what = self._scope, f"running {op} on {self.name}"
        name = getattr(fn, "kernel_name", op)

        def run(*arrays: Any) -> None:
            with scope:
                try:
                    fn(*arrays)
                except Exception as exc:  # cupy's CUDA errors become polyhal errors naming the kernel
                    new = translate(exc, what, kernel=name)
                    if new is exc:
                        raise
                    raise new from exc

        run.inner = fn  # type: ignore[attr-defined]
        return run

    def module(self, key: Any, build: Callable[[], Any]) -> Any:
        """The compiled module for ``key``, built once per device by ``build()``."""
        mod = self.modules.get(key)
        if mod is None:
            with self._modules_lock:
                mod = self.modules.get(key)
                if mod is None:
                    with self.activate():
                        mod = self.modules[key] = build()
        return mod

    def launch(self, kernel: Any, name: str, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        """Launch a cupy ``RawKernel`` on this device's stream; failures name the kernel and shape."""
        try:
            kernel(grid, block, args, shared_mem=shared_mem, stream=self.stream)
        except Exception as exc:
            new = translate(exc, f"launching {name} on {self.name} (grid {tuple(grid)}, block {tuple(block)}, "
                                 f"{shared_mem} B dynamic shared memory)", kernel=name)
            if new is exc:
                raise
            raise new from exc

    def view(self, tensor) -> Any:
        """A ``cupy.ndarray`` over the tensor's memory (byte offset and strides honoured); a
        storage-only type (bfloat16, float8, int4, ...), which cupy lacks, as the unsigned
        integers of its width, holding its bits."""
        import cupy

        native: CUDAMemory = tensor.buffer.native
        mem = cupy.cuda.UnownedMemory(native.ptr, native.nbytes, native, native.device_id)
        item = tensor.dtype.itemsize
        return cupy.ndarray(tensor.shape, bits_dtype(tensor.dtype), cupy.cuda.MemoryPointer(mem, tensor.offset),
                            strides=tuple(s * item for s in tensor.strides))

    def synchronize(self) -> None:
        """Wait for this device's stream (not for the whole device)."""
        with check(f"waiting for {self.name}"):
            self.stream.synchronize()

    def profile_timer(self) -> "_EventTimer":
        """Step timing for profiles: CUDA events recorded on this device's stream around each
        step, read once the run's steps are queued (no wait between steps)."""
        return _EventTimer(self)

    def record(self, steps: Sequence[Callable[[], None]], slots: list, input_slots: Sequence[int],
               output_slots: Sequence[int]) -> Callable[[], None]:
        """Replay hook of the core's plans: run the steps eagerly once, then as a CUDA graph
        captured once and replayed with inputs and outputs rebound (see :mod:`.graphs`)."""
        from polyhal_cuda.graphs import GraphReplay

        return GraphReplay(self, steps, slots, input_slots, output_slots)

    # -- data movement ---------------------------------------------------------------------------

    def _map(self, buffer: Buffer, offset: int, length: int, access: MemoryAccess) -> np.ndarray:
        # Host-visible memory (managed, pinned) is addressable by the host at its pointer; wait
        # for this stream's work so that the host sees every kernel's writes.
        self.synchronize()
        if length == 0:
            return np.empty(0, np.uint8)
        return np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(buffer.native.ptr + offset))

    def write(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        self.stager.h2d(buffer.native.ptr + offset, np.ascontiguousarray(host))

    def read(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        self.stager.d2h(host, buffer.native.ptr + offset)

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        from cupy.cuda import runtime

        if nbytes:
            with check(f"copying {nbytes} bytes on {self.name}"):
                runtime.memcpyAsync(dst.native.ptr + dst_offset, src.native.ptr + src_offset, nbytes, 4,
                                    self.stream.ptr)

    def download(self, native: Any, host: np.ndarray) -> None:
        if not native.flags.c_contiguous:
            with self.stager.exclusive(), self.activate():  # (never into a graph another thread captures)
                native = native.copy()
        self.stager.d2h(host, native.data.ptr)

    def upload(self, host: np.ndarray, native: Any) -> None:
        self.stager.h2d(native.data.ptr, np.ascontiguousarray(host))

    # -- transfers (Device.can_copy) ------------------------------------------------------------

    def can_copy(self, src: Device, dst: Device) -> bool:
        """Host memory to and from this GPU (through the pinned :attr:`stager`), and between two
        CUDA GPUs (peer copy where the topology allows, else staged through pinned host memory)."""
        return super().can_copy(src, dst) or (self in (src, dst) and isinstance(src, CUDADevice)
                                               and isinstance(dst, CUDADevice))

    def copy_path(self, src: Device, dst: Device) -> str:
        if src.is_host or dst.is_host:
            return super().copy_path(src, dst)
        return peer_access.path(src.ordinal, dst.ordinal)

    def transfer(self, src: Device, src_native: Any, dst: Device, dst_native: Any, nbytes: int,
                 queued: bool = False) -> None:
        """As :meth:`Device.transfer`. GPU to GPU: ``cudaMemcpyPeerAsync`` on the destination's
        stream where peer access is enabled, else staged through a pinned host buffer. With
        ``queued`` (a concurrent plan ordered the source's work before this on the destination's
        queue, and takes completion from that queue's signal) the peer copy stays queued, and a
        copy to the host leaves this GPU's stream alone (the host queue already waited for the
        source's event); otherwise it waits for the source first and is complete on return."""
        from cupy.cuda import runtime

        if queued and dst.is_host and src is self and src_native.flags.c_contiguous and dst_native.flags.c_contiguous:
            # A concurrent plan's host queue waited for the source's event: copy off the stream.
            self.stager.d2h(dst_native, src_native.data.ptr, ordered=False)
        elif src.is_host or dst.is_host:
            super().transfer(src, src_native, dst, dst_native, nbytes)
        elif not nbytes:
            return
        elif src is dst or peer_access(src.ordinal, dst.ordinal):
            if not queued:
                src.synchronize()  # ordered after the source's pending work
            with check(f"copying {nbytes} bytes from {src.name} to {dst.name}"), dst.activate():
                runtime.memcpyPeerAsync(dst_native.data.ptr, dst.ordinal, src_native.data.ptr, src.ordinal,
                                        nbytes, dst.stream.ptr)
            if not queued:
                dst.synchronize()
        else:
            import cupyx

            with src.activate():
                host = cupyx.empty_pinned(nbytes, np.uint8)
            src.stager.d2h(host, src_native.data.ptr)
            dst.stager.h2d(dst_native.data.ptr, host)

    # -- DLPack ----------------------------------------------------------------------------------

    def dlpack_device(self, buffer: Buffer) -> tuple[int, int]:
        return (_DLPACK_TYPE.get(buffer.native.kind, DL_CUDA), self.ordinal)

    def dlpack_alias(self, buffer: Buffer, dl_device: tuple[int, int]) -> bool:
        """Managed and pinned memory may also be exported as plain CUDA memory of this device
        (kernels reach it at the same address)."""
        return buffer.native.kind in _DLPACK_TYPE and tuple(dl_device) == (DL_CUDA, self.ordinal)

    def dlpack_consumer_stream(self) -> int:
        """The stream a producer must order its work before, when this device imports."""
        return int(self.stream.ptr)

    def buffer_address(self, buffer: Buffer) -> int:
        return buffer.native.ptr

    def _export_sync(self, buffer: Buffer, stream: Any) -> None:
        from cupy.cuda import runtime

        if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
            raise DLPackError(
                f"DLPack stream for CUDA memory must be an int (a cudaStream_t address, 1 for the legacy "
                f"default stream, 2 for the per-thread default stream, -1 for no ordering), got "
                f"{type(stream).__name__} {stream!r}; pass stream.ptr (cupy) or stream.cuda_stream (torch)")
        if stream == 0 or (stream is not None and stream < -1):
            raise DLPackError(f"DLPack stream {stream} is not valid for CUDA: 0 is ambiguous under the Array API "
                              "standard; use 1 (legacy default stream), 2 (per-thread default) or a stream address")
        if stream == -1:
            return
        with check(f"ordering a DLPack export of {self.name} before its consumer"):
            event = self._export_event
            event.record(self.stream)
            if stream is None:
                if buffer.host_visible:
                    event.synchronize()  # the consumer may be the host: wait for our stream only
                    return
                stream = _STREAM_LEGACY
            if stream != self.stream.ptr:
                runtime.streamWaitEvent(stream, event.ptr)

    def import_dlpack(self, imported: "ImportedTensor") -> Buffer:
        """Wrap CUDA memory described by a DLPack capsule as an EXTERNAL buffer (no copy).

        Accepted: ``(kDLCUDA, n)`` and ``(kDLCUDAManaged, n)`` memory of this GPU, and pinned host
        memory ``(kDLCUDAHost, *)``. Strided (non-contiguous) tensors are imported as strided
        views; negative strides are refused. The memory's real kind (device, managed, pinned)
        is asked of CUDA, so managed memory exported by torch as plain CUDA memory is still
        known to be host-visible. A read-only capsule gives a read-only tensor (the core).
        """
        from cupy.cuda import runtime

        dev_type, dev_id = int(imported.device[0]), int(imported.device[1])
        if dev_type not in (DL_CUDA, DL_CUDA_MANAGED, DL_CUDA_HOST):
            raise DLPackError(f"{self.name} cannot import DLPack device type {dev_type}")
        if dev_type != DL_CUDA_HOST and dev_id != self.ordinal:
            raise DLPackError(f"DLPack tensor lives on CUDA device {dev_id}, not on {self.name} (ordinal "
                              f"{self.ordinal}); import it on cuda:{dev_id} or copy it")
        extent = import_extent(imported, self.name)
        kind = {DL_CUDA_HOST: BufferKind.HOST, DL_CUDA_MANAGED: BufferKind.MANAGED}.get(dev_type, BufferKind.DEVICE)
        if imported.data_ptr:
            try:
                with self.activate():
                    attrs = runtime.pointerGetAttributes(imported.data_ptr)
                kind = {_PTR_HOST: BufferKind.HOST, _PTR_MANAGED: BufferKind.MANAGED}.get(attrs.type, kind)
                if attrs.type == 0 and dev_type != DL_CUDA_HOST:
                    raise DLPackError(f"address {imported.data_ptr:#x} is not memory CUDA knows (pointer type "
                                      "unregistered); the producer's DLPack device is wrong")
            except DLPackError:
                raise
            except Exception:  # noqa: BLE001 - attribute queries are advisory
                pass
        memory_type = {BufferKind.HOST: PINNED_MEMORY, BufferKind.MANAGED: MANAGED_MEMORY}.get(kind, MemoryType.DEVICE_LOCAL)
        alloc = self.cuda_allocator
        heap = next((h for h in alloc.heaps if h.memory_type == memory_type), alloc.heaps[0])
        native = CUDAMemory(imported.data_ptr, extent, kind, imported, self.ordinal)
        return Buffer(alloc, heap, extent, native, memory_type=memory_type, kind=BufferKind.EXTERNAL,
                      on_release=lambda *_: imported.release())


class _EventTimer:
    """Marks are timing-enabled CUDA events on a device's stream (see ``profile_timer``)."""

    name = "CUDA events"

    def __init__(self, device: CUDADevice) -> None:
        self._device = device

    def mark(self) -> Any:
        import cupy

        with self._device.activate():
            event = cupy.cuda.Event()
            event.record(self._device.stream)
        return event

    def elapsed_ns(self, start: Any, end: Any) -> int:
        import cupy

        with check(f"reading profile events of {self._device.name}"):
            end.synchronize()
            return int(cupy.cuda.get_elapsed_time(start, end) * 1e6)  # ms -> ns


def _can_access_peer(dst: int, src: int) -> bool:
    from cupy.cuda import runtime

    return bool(runtime.deviceCanAccessPeer(dst, src))


def _enable_peer(dst: int, src: int) -> None:
    import cupy
    from cupy.cuda import runtime

    with cupy.cuda.Device(dst):
        try:
            runtime.deviceEnablePeerAccess(src)
        except runtime.CUDARuntimeError as exc:  # already enabled (by cupy or another caller)
            if "PeerAccessAlreadyEnabled" not in str(exc):
                raise


#: Whether GPU ``dst`` reads GPU ``src`` directly: ``peer_access(src, dst)`` asks
#: ``cudaDeviceCanAccessPeer`` once per pair and enables access the first time
#: (``cudaDeviceEnablePeerAccess`` from ``dst``); ``peer_access.path(src, dst)`` says which path a
#: copy takes; ``peer_access.override[(src, dst)] = False`` forces staging (tests).
peer_access = PeerAccess(_can_access_peer, _enable_peer)
