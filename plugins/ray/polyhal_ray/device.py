"""RemoteDevice: one device of a Ray node, driven from here through the node's command stream.

Nothing here computes: every operation becomes a command of the node's
:class:`~polyhal_ray.cluster.NodeSession`. A prepared kernel is a :class:`RemoteKernel` whose call
appends one dispatch to the stream (a list append, no round trip), so a plan part on the node
becomes one submission, sent when its data is needed elsewhere (a read, a transfer, a
synchronize) or, for a plan that lives entirely on the node, at the end of each run -- through a
Ray compiled graph, compiled once when the plan is built (:meth:`RemoteDevice.record`).

Native objects are *view keys* ``(buffer id, byte offset, shape, dtype, element strides)``:
what the node needs to find the tensor among its resident buffers.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from polyhal import Buffer, Device, MemoryAccess
from polyhal.errors import DLPackError, KernelNotFoundError
from polyhal.hal.queue import InlineQueue, SemaphoreList, fail_all, signal_all, wait_all

from polyhal_ray.allocator import RemoteAllocator
from polyhal_ray.cluster import send_to
from polyhal_ray.worker import (CLEANUP, COPY, DISPATCH, FILL, FORGET, PREPARE, READ, RECORD, RELEASE, REPLAY,
                                TRANSFER, WRITE)

if TYPE_CHECKING:
    from polyhal import DeviceSpec

    from polyhal_ray.cluster import NodeSession

#: DLPack's kDLExtDev: memory of a device DLPack does not list (here: another process's memory).
DLPACK_EXT_DEV = 12


class RemoteKernel:
    """A kernel prepared on the node; calling it queues one dispatch (it runs with the stream's
    next submission). Released on the node when this object goes."""

    __slots__ = ("op", "kid", "_enqueue", "__weakref__")

    def __init__(self, session: "NodeSession", kid: int, op: str) -> None:
        self.op, self.kid = op, kid
        self._enqueue = session._pending.append  # the hot path: one deque append per step
        weakref.finalize(self, session.discard, (RELEASE, kid)).atexit = False

    def __call__(self, *args: tuple) -> None:
        self._enqueue((DISPATCH, self.kid, args))


class NodeKernels:
    """What the driver knows of a node device's kernel table (:attr:`RemoteDevice.kernels`):
    its op names and which of them take the storage-only element types. Preparing goes to the
    node (:meth:`RemoteDevice.prepare`); views are never taken (operands move dense)."""

    def __init__(self, kernel_names: frozenset[str], storage_ops: frozenset[str]) -> None:
        self.kernel_names = kernel_names
        self._storage = storage_ops

    def holds_storage(self, op: str) -> bool:
        """Whether the node's kernel for ``op`` takes the storage-only element types."""
        return op in self._storage

    def accepts_view(self, *args: Any) -> bool:
        return False


class RemoteQueue(InlineQueue):
    """The device's queue: each submission waits for its wait list on the host, is queued on the
    node's stream and flushed, and returns at once; its signal semaphores are signalled when the
    node answers (failed with :class:`~polyhal_ray.errors.NodeLostError` if the node dies)."""

    device: "RemoteDevice"

    def _submit(self, work: Callable[[], Any], wait: SemaphoreList, signal: SemaphoreList) -> Any:
        session = self.device.session
        try:
            wait_all(wait, self.timeout)
            result = work()
            seq = session.flush()
        except BaseException as exc:
            fail_all(signal, exc)
            raise
        signal = tuple(signal)
        session.notify(seq, lambda: signal_all(signal), lambda exc: fail_all(signal, exc))
        return result


    def fill(self, buffer: Buffer, offset: int, nbytes: int, pattern: bytes,
             wait: SemaphoreList = (), signal: SemaphoreList = ()) -> None:
        """The pattern is repeated on the node (only its bytes are sent)."""
        if len(pattern) not in (1, 2, 4) or nbytes % len(pattern):
            raise ValueError(f"{self.name}: fill pattern must be 1, 2 or 4 bytes and divide the length "
                             f"({nbytes} B), got {len(pattern)} bytes")
        self._submit(lambda: self.device.fill(buffer, offset, nbytes, pattern), wait, signal)


class RemoteDevice(Device):
    """A device of a Ray node (``ray:<node>/<its name there>``), made by its spec's factory."""

    dlpack_device_type = DLPACK_EXT_DEV

    def __init__(self, spec: "DeviceSpec", *, session: "NodeSession", local_name: str, node_heaps: tuple,
                 storage_ops: frozenset[str] = frozenset()) -> None:
        super().__init__(spec)
        self.kernels = NodeKernels(spec.kernel_names or frozenset(), storage_ops)  # type: ignore[assignment]
        if session.lost is not None:
            raise session._told_lost()
        self.session = session
        #: The device's name on its node.
        self.local_name = local_name
        self.native_allocator = self.allocator = RemoteAllocator(self, spec.heaps, node_heaps)

    @property
    def lost(self) -> BaseException | None:
        """The node's :class:`~polyhal_ray.errors.NodeLostError` once it died, else None."""
        return self.session.lost

    @property
    def queues(self) -> tuple[RemoteQueue, ...]:
        queues = self.__dict__.get("_queues")
        if queues is None:
            queues = self.__dict__["_queues"] = (RemoteQueue(self),)
        return queues

    def memory_available(self) -> int | None:
        total = self.spec.limits.get("global_mem_size")
        return None if not isinstance(total, int) else max(total - self.allocator.statistics.live_bytes, 0)

    # -- kernels ----------------------------------------------------------------------------------

    def prepare(self, op, attrs, in_types, out_types, scratch=None) -> RemoteKernel:
        """Prepare the kernel on the node now (one round trip, so that what the node refuses is
        refused at compile time); the result queues a dispatch per call."""
        if op not in self.kernel_names:
            raise KernelNotFoundError(f"{self.name} (Ray node {self.session.name}) has no kernel for op {op!r}; "
                                      "the node's backends do not offer it. Place the op on another device")
        kid = self.session.new_id()
        self.session.call((PREPARE, kid, self.local_name, op, dict(attrs), tuple(in_types), tuple(out_types)))
        return RemoteKernel(self.session, kid, op)

    def scratch(self, op, attrs, in_types, out_types) -> Sequence:
        """None here: a kernel's scratch is declared, placed and allocated on its node."""
        return ()

    def view(self, tensor) -> tuple:
        return (tensor.buffer.native, tensor.offset, tensor.shape, tensor.dtype, tensor.strides)

    def synchronize(self) -> None:
        self.session.synchronize()

    def record(self, steps, slots, input_slots, output_slots) -> Callable[[], None] | None:
        """A plan (or a plan part) that lives entirely on this device is recorded on the node
        once: its dispatches, with the kernels and intermediate tensors resolved there. Each run
        then queues one replay command naming the run's inputs and outputs, and is sent as one
        submission through the node's Ray compiled graph (compiled here, once, and kept while
        the plan lives)."""
        session = self.session
        steps = tuple(steps)
        bindings = tuple(dict.fromkeys((*input_slots, *output_slots)))
        recorded = _capture(session, steps, slots, bindings)
        if recorded is None:  # a step that is not one of this node's dispatches: replayed step by step
            return None
        pid = session.new_id()
        session.call((RECORD, pid, recorded))
        release = session.use_graph()
        enqueue, flush = session._pending.append, session.flush

        def replay() -> None:
            enqueue((REPLAY, pid, tuple([_wire_key(slots[i]) for i in bindings])))
            flush()

        def forget(steps=steps) -> None:  # (the steps hold the kernels the node's program calls)
            session.discard((FORGET, pid))
            release()

        # Not at interpreter exit: Ray tears its graphs down itself then, and a wait here could outlast it.
        weakref.finalize(replay, forget).atexit = False
        return replay

    # -- data movement ----------------------------------------------------------------------------

    def _map(self, buffer: Buffer, offset: int, length: int, access: MemoryAccess) -> np.ndarray:
        raise DLPackError(f"{self.name} is memory of Ray node {self.session.name}; read it with tensor.numpy()")

    def write(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        self.session.enqueue((WRITE, buffer.native, offset, _snapshot(host)))

    def read(self, buffer: Buffer, offset: int, host: np.ndarray) -> None:
        (data,) = self.session.call((READ, buffer.native, offset, host.nbytes))
        host.reshape(-1).view(np.uint8)[...] = np.frombuffer(data, np.uint8)

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        self.session.enqueue((COPY, src.native, src_offset, dst.native, dst_offset, nbytes))

    def fill(self, buffer: Buffer, offset: int, nbytes: int, pattern: bytes) -> None:
        """Repeat ``pattern`` over ``nbytes`` of ``buffer`` on the node (queue-ordered)."""
        self.session.enqueue((FILL, buffer.native, offset, nbytes, pattern))

    def download(self, native: tuple, host: np.ndarray) -> None:
        bid, offset, shape, dtype, _ = native
        (data,) = self.session.call((READ, bid, offset, host.nbytes))
        host[...] = np.frombuffer(data, np.dtype(dtype)).reshape(shape)

    def upload(self, host: np.ndarray, native: tuple) -> None:
        bid, offset, _, _, _ = native
        self.session.enqueue((WRITE, bid, offset, _snapshot(host)))

    # -- transfers --------------------------------------------------------------------------------

    def can_copy(self, src: Device, dst: Device) -> bool:
        """Host <-> this device, and this device <-> any Ray device (same node: on the node; two
        nodes: node to node through Ray's object store)."""
        other = dst if src is self else src
        return (src is self or dst is self) and (other.is_host or isinstance(other, RemoteDevice))

    def copy_path(self, src: Device, dst: Device) -> str:
        if isinstance(src, RemoteDevice) and isinstance(dst, RemoteDevice):
            if src.session is dst.session:
                return f"on node {src.session.name}"
            return f"node {src.session.name} to node {dst.session.name} through Ray's object store"
        return "upload to the node" if dst is self else "download from the node"

    def transfer(self, src: Device, src_native: Any, dst: Device, dst_native: Any, nbytes: int) -> None:
        if not (isinstance(src, RemoteDevice) and isinstance(dst, RemoteDevice)):
            super().transfer(src, src_native, dst, dst_native, nbytes)
        elif src.session is dst.session:
            src.session.enqueue((TRANSFER, src_native, dst_native))
        else:
            send_to(src.session, src_native, dst.session, dst_native)

    # -- DLPack -----------------------------------------------------------------------------------

    def buffer_address(self, buffer: Buffer) -> int:
        raise DLPackError(f"{self.name} is memory of Ray node {self.session.name}, which DLPack cannot address "
                          "from here; move the tensor first (tensor.to_device('cpu:0')) or read it (tensor.numpy())")


class _Binding:
    """Stands in a binding slot (an input or output of the plan) while its steps are captured."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _capture(session: "NodeSession", steps: tuple, slots: list, bindings: tuple) -> tuple | None:
    """Run ``steps`` with markers in the ``bindings`` slots and take back what they queued:
    ``((kernel id, args), ...)``, each arg a view key or a binding's index. None when a step
    did anything but queue one dispatch of this node (it is then replayed step by step)."""
    saved = [slots[i] for i in bindings]
    for n, i in enumerate(bindings):
        slots[i] = _Binding(n)
    pending = session._pending
    with session._lock:  # no flush (another thread's) sends the markers meanwhile
        before = len(pending)
        try:
            for step in steps:
                step()
            failed = False
        except Exception:  # noqa: BLE001 -- not a kernel of this node: it cannot take a marker
            failed = True
        finally:
            for i, value in zip(bindings, saved):
                slots[i] = value
        queued = [pending.pop() for _ in range(len(pending) - before)][::-1]
        # A buffer's or kernel's finalizer may have queued its free meanwhile: it goes back.
        pending.extend(c for c in queued if c[0] in CLEANUP)
    captured = [c for c in queued if c[0] not in CLEANUP]
    if failed or len(captured) != len(steps) or any(c[0] != DISPATCH for c in captured):
        return None
    return tuple((kid, tuple(a.index if isinstance(a, _Binding) else a for a in args)) for _, kid, args in captured)


def _wire_key(key: tuple) -> tuple:
    """A view key as a replay sends it: a numpy dtype as its string (a dtype object pickles
    slowly); others (ml_dtypes' bfloat16, whose string ``|V2`` says nothing) as they are."""
    dtype = key[3]
    return (key[0], key[1], key[2], dtype.str if dtype.isbuiltin == 1 else dtype, key[4])


#: Uploads this large go through Ray's object store (one copy into it, here, and the node reads
#: it from there); smaller ones ride in the submission as a copy of their bytes.
OBJECT_STORE_BYTES = 1 << 20


def _snapshot(host: np.ndarray) -> Any:
    """The bytes of ``host`` as they are now (the caller may change its array once a write
    returns, before the stream is sent): an ObjectRef for large arrays, else a ``bytes`` copy
    (through a compiled graph's channel a 16 KiB ``bytes`` took about half the time of the same
    bytes as an array, which Ray serializes out of band: measured on the busy 2-core VM)."""
    flat = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    if flat.nbytes >= OBJECT_STORE_BYTES:
        import ray

        return ray.put(flat)
    return flat.tobytes()
