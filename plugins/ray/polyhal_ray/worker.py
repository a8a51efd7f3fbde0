"""NodeRuntime: the Ray actor that runs one node's devices with a polyhal runtime of its own.

The driver never calls a node per op. It sends *submissions*: lists of commands (allocate, free,
write, read, copy, prepare a kernel, dispatch a prepared kernel), numbered per node. The actor
runs each submission whole, in the order of its number (a submission that arrives early waits
for its predecessor: ordinary actor calls, a compiled graph and node-to-node receives may reach
the actor on different threads), and answers with what its reads produced. Buffers and prepared
kernels stay resident here between submissions, named by ids the driver chose, so that a plan
part replayed on the node sends only its command list.

Commands are plain tuples whose first item is an opcode (:data:`ALLOC` ...); tensors are named by
*view keys* ``(buffer id, byte offset, shape, dtype, element strides)``. A replayed plan is
*recorded* on the node once (:data:`RECORD`: its dispatches, with the kernels and intermediate
tensors resolved there); each run then sends one :data:`REPLAY` naming the run's input and output
tensors, so that the node looks nothing up but those and the driver pickles no step.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

# Opcodes of the commands a submission holds (see NodeRuntime._command).
ALLOC, FREE, WRITE, READ, COPY, FILL, PREPARE, DISPATCH, RELEASE, TRANSFER, RECORD, REPLAY, FORGET = range(13)
#: Freed buffers a node keeps per (device, size, memory type, usage), for the next allocation alike.
SPARES = 4

#: True in a process that serves a node (a NodeRuntime lives here): there the node's devices are
#: local, and the Ray plugin registers no remote devices (it would reach its own node again).
SERVING = False
#: Commands that run even after an earlier command of the same submission failed: what frees
#: memory, so that a failed submission leaks nothing on the node.
CLEANUP = frozenset({FREE, RELEASE, FORGET})


def runtime_versions() -> dict[str, str]:
    """The versions a driver and a node must agree on (read from installed metadata, so that a
    node whose environment holds another polyhal says so before anything of it is used)."""
    import platform
    from importlib import metadata  # here: it costs more to import than the rest of this plugin

    import ray

    def dist(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    from polyhal.hookspecs import API_VERSION

    return {"polyhal": dist("polyhal"), "polyhal-ray": dist("polyhal-ray"), "polyhal API": str(API_VERSION),
            "ray": ray.__version__, "python": platform.python_version()}


def error_record(exc: BaseException, where: str) -> tuple[str, str]:
    """``exc`` as (class name, message) for the driver: polyhal errors keep their class
    (:func:`polyhal_ray.errors.rebuild` makes them again), others become a KernelError."""
    return type(exc).__name__, f"{where}: {type(exc).__name__}: {exc}"


class NodeRuntime:
    """The actor: one per node, holding that node's polyhal registry, buffers and kernels."""

    def __init__(self, node: str) -> None:
        global SERVING
        SERVING = True
        from polyhal import Registry

        self.node = node
        self.registry = Registry()
        self.buffers: dict[int, Any] = {}      # buffer id -> polyhal Buffer on a local device
        self.kernels: dict[int, tuple[Any, tuple]] = {}  # kernel id -> (prepared fn, scratch tensors)
        # buffer id -> {view key less the id: the local device's native object}; a freed buffer
        # kept as a spare keeps its views, so that a replayed plan's new outputs find theirs made.
        self.views: dict[int, dict[tuple, Any]] = {}
        self.programs: dict[int, Callable[[tuple], None]] = {}  # recorded plans, by id
        self.allocated: dict[int, tuple] = {}  # buffer id -> (device, nbytes, memory type, usage) asked
        self.spares: dict[tuple, list] = {}    # freed buffers kept for the next allocation of the same kind
        self._done = 0                         # number of the last submission that ran
        self._order = threading.Condition()

    # -- what the driver asks once ----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Versions and device records (spec fields that cross the wire) of this node."""
        specs = []
        for spec in self.registry.device_specs():
            names = self.registry.kernel_names(spec.name)
            table = getattr(spec.factory, "kernels", None)  # the device class's table: nothing is created
            storage = frozenset(op for op in names if table is not None and table.holds_storage(op))
            specs.append(dict(name=spec.name, backend=spec.backend, rank=spec.rank, heaps=spec.heaps,
                              workgroup_bytes=spec.workgroup_bytes, capabilities=spec.capabilities,
                              limits=dict(spec.limits), description=spec.description,
                              kernel_names=names, storage_ops=storage))
        from polyhal.hal.device import host_memory_available

        return {"versions": runtime_versions(), "devices": specs, "memory_available": host_memory_available(),
                "failures": [f"{f.plugin}: {f.reason}" for f in self.registry.failures]}

    def statistics(self) -> dict[str, Any]:
        """What is resident: buffer, kernel and cached view counts, and live bytes per device."""
        live: dict[str, int] = {}
        for buf in self.buffers.values():
            live[buf.device.name] = live.get(buf.device.name, 0) + buf.nbytes
        return {"buffers": len(self.buffers), "kernels": len(self.kernels), "programs": len(self.programs),
                "views": sum(map(len, self.views.values())),
                "live_bytes": live, "spare_buffers": sum(map(len, self.spares.values())), "done": self._done}

    # -- submissions ------------------------------------------------------------------------------

    def submit(self, seq: int, commands: list, timeout: float = 60.0) -> tuple[list, Any]:
        """Run submission ``seq`` (after ``seq - 1``); return (read results, error or None)."""
        self._await_turn(seq, timeout)
        try:
            return self._run(commands)
        finally:
            self._finish(seq)

    def execute(self, packed: tuple) -> tuple[list, Any]:
        """The compiled graph's entry: ``packed`` is ``(seq, commands)``. Reads come back as
        bytes: an array would be a zero-copy view of the graph's channel, which Ray cannot
        reuse for the next answer while the driver holds it (the next read would wait forever)."""
        results, error = self.submit(*packed)
        return [r.tobytes() for r in results], error

    def send(self, seq: int, key: tuple, timeout: float = 60.0) -> tuple[list, Any]:
        """Submission ``seq`` that puts the tensor ``key`` in this node's object store; returns
        ``([ObjectRef], None)`` (the receiver pulls the bytes from here, node to node)."""
        import ray

        self._await_turn(seq, timeout)
        try:
            buf = self.buffers[key[0]]
            if buf.device.is_host:  # host memory goes into the store straight from the buffer
                return [ray.put(np.ascontiguousarray(self._native(key)))], None
            host = np.empty(key[2], key[3])  # device memory (a GPU's): read to the host first
            buf.device.read(buf, key[1], host)
            return [ray.put(host)], None
        finally:
            self._finish(seq)

    def recv(self, seq: int, sent: list, key: tuple, source: str, timeout: float = 60.0) -> tuple[list, Any]:
        """Submission ``seq`` that copies what another node's :meth:`send` put (``sent`` holds its
        ObjectRef, unresolved) into the tensor ``key``."""
        import ray

        self._await_turn(seq, timeout)
        try:
            try:
                (inner,), _ = ray.get(sent[0], timeout=timeout)
                data = ray.get(inner, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 -- the sender's node died: say so, this node goes on
                return [], ("NodeLostError", f"node {self.node} could not receive from node {source}, which was "
                                             f"lost ({type(exc).__name__}: {str(exc).splitlines()[0]})", source)
            try:
                buf = self.buffers[key[0]]
                if buf.device.is_host:
                    np.copyto(self._native(key), data.reshape(key[2]), casting="no")
                else:
                    buf.device.write(buf, key[1], np.ascontiguousarray(data))
                buf.device.synchronize()
            except Exception as exc:  # noqa: BLE001
                return [], error_record(exc, f"node {self.node}, receive")
            return [], None
        finally:
            self._finish(seq)

    def _await_turn(self, seq: int, timeout: float) -> None:
        with self._order:
            if not self._order.wait_for(lambda: self._done >= seq - 1, timeout):
                raise TimeoutError(f"node {self.node}: submission {seq} waited {timeout:g} s for submission "
                                   f"{seq - 1}, which never came")

    def _finish(self, seq: int) -> None:
        with self._order:
            self._done = max(self._done, seq)
            self._order.notify_all()

    def _run(self, commands: list) -> tuple[list, Any]:
        results: list = []
        error = None
        for cmd in commands:
            if error is not None and cmd[0] not in CLEANUP:
                continue
            try:
                out = self._command(cmd)
            except Exception as exc:  # noqa: BLE001 -- reported to the driver, typed there
                error = error_record(exc, f"node {self.node}, {self._describe(cmd)}")
                continue
            if cmd[0] == READ:
                results.append(out)
        # A submission is complete when its device work is (a GPU's kernels run asynchronously).
        for device in self.registry.created_devices():
            try:
                device.synchronize()
            except Exception as exc:  # noqa: BLE001
                error = error or error_record(exc, f"node {self.node}, finishing the work on {device.name}")
        return results, error

    def _command(self, cmd: tuple) -> Any:
        op = cmd[0]
        if op == REPLAY:  # the hot path first
            self.programs[cmd[1]](cmd[2])
        elif op == DISPATCH:
            native = self._native
            self.kernels[cmd[1]][0](*[native(k) for k in cmd[2]])
        elif op == ALLOC:
            _, bid, device, nbytes, memory_type, usage = cmd
            spare = self.spares.get(cmd[2:])
            if spare:
                self.buffers[bid], self.views[bid] = spare.pop()
            else:
                self.buffers[bid] = self.registry.get_device(device).allocator.allocate(nbytes, memory_type, usage)
            self.allocated[bid] = cmd[2:]
        elif op == FREE:
            buf = self.buffers.pop(cmd[1], None)
            if buf is not None:
                views = self.views.pop(cmd[1], {})
                spare = self.spares.setdefault(self.allocated.pop(cmd[1]), [])
                if len(spare) < SPARES:
                    spare.append((buf, views))  # a replayed plan frees and allocates its outputs' sizes on every run
                else:
                    buf.release()
        elif op == RECORD:
            self.programs[cmd[1]] = self._record(*cmd[2:])
        elif op == FORGET:
            self.programs.pop(cmd[1], None)
        elif op == WRITE:
            _, bid, offset, data = cmd
            if isinstance(data, bytes):  # a small upload, in the submission
                data = np.frombuffer(data, np.uint8)
            elif not isinstance(data, np.ndarray):  # an ObjectRef: a large upload, from the object store
                import ray

                data = ray.get(data)
            buf = self.buffers[bid]
            buf.device.write(buf, offset, data)
        elif op == READ:
            _, bid, offset, nbytes = cmd
            buf = self.buffers[bid]
            host = np.empty(nbytes, np.uint8)
            buf.device.read(buf, offset, host)
            return host
        elif op == COPY:
            _, sb, so, db, do, nbytes = cmd
            src, dst = self.buffers[sb], self.buffers[db]
            if src.device is dst.device:
                src.device.copy(src, so, dst, do, nbytes)
            else:  # two devices of this node: through a host array
                host = np.empty(nbytes, np.uint8)
                src.device.read(src, so, host)
                dst.device.write(dst, do, host)
        elif op == FILL:
            _, bid, offset, nbytes, pattern = cmd
            buf = self.buffers[bid]
            buf.device.queues[0].fill(buf, offset, nbytes, pattern)
        elif op == PREPARE:
            self._prepare(*cmd[1:])
        elif op == RELEASE:
            fn_scratch = self.kernels.pop(cmd[1], None)
            if fn_scratch is not None:
                for t in fn_scratch[1]:
                    t.release()
        elif op == TRANSFER:
            from polyhal.hal.transfer import route, transfer_fn

            _, src_key, dst_key = cmd
            src, dst = self.buffers[src_key[0]].device, self.buffers[dst_key[0]].device
            transfer_fn(route(src, dst), dst_key[2], dst_key[3])(self._native(src_key), self._native(dst_key))
        else:
            raise ValueError(f"unknown command {op}")
        return None

    def _prepare(self, kid: int, device: str, op: str, attrs: dict, in_types: tuple, out_types: tuple) -> None:
        """Prepare a kernel on a local device; its global scratch is allocated here, on the node
        (the driver sees none: scratch never crosses the wire)."""
        from polyhal.hal.scratch import MemorySpace, ScratchBinding
        from polyhal.hal.tensor import empty

        dev = self.registry.get_device(device)
        requests = dev.scratch(op, attrs, in_types, out_types)
        held: list = []
        extra = {}
        if requests:
            placed = dev.place_scratch(requests)
            bound = {}
            for a in placed:
                if a.space is MemorySpace.GLOBAL:
                    t = empty((max(a.nbytes, 1),), np.uint8, dev)
                    held.append(t)
                    bound[(a.request.kernel.name, a.request.name)] = t.native
            extra["scratch"] = ScratchBinding(placed, bound)
        try:
            fn = dev.prepare(op, attrs, in_types, out_types, **extra)
        except BaseException:
            for t in held:
                t.release()
            raise
        self.kernels[kid] = (fn, tuple(held), f"kernel {op!r} on {device}")

    def _record(self, steps: tuple) -> Callable[[tuple], None]:
        """A replayed plan's run: ``steps`` are ``(kernel id, args)``, each arg a view key (an
        intermediate tensor, the same every run) or the index of a *binding* (an input or output,
        another tensor each run); the run's ``bindings`` are the view keys of those."""
        native = self._native
        program = []
        for kid, args in steps:
            fixed = [None if isinstance(a, int) else native(a) for a in args]
            bound = tuple((pos, a) for pos, a in enumerate(args) if isinstance(a, int))
            program.append((self.kernels[kid][0], fixed, bound))

        def run(bindings: tuple) -> None:
            keys = [native(key) for key in bindings]
            for fn, fixed, bound in program:
                argv = fixed.copy()
                for pos, i in bound:
                    argv[pos] = keys[i]
                fn(*argv)

        return run

    def _describe(self, cmd: tuple) -> str:
        """What ``cmd`` was, for an error message."""
        op = cmd[0]
        if op == DISPATCH:
            return self.kernels[cmd[1]][2] if cmd[1] in self.kernels else "dispatch of a released kernel"
        if op == ALLOC:
            return f"allocation of {cmd[3]} B on {cmd[2]}"
        if op == PREPARE:
            return f"preparing the kernel of {cmd[3]!r} on {cmd[2]}"
        return {FREE: "free", WRITE: "upload", READ: "download", COPY: "copy", FILL: "fill", RELEASE: "kernel release",
                TRANSFER: "transfer between the node's devices", RECORD: "recording a replayed plan",
                REPLAY: "a replayed plan's run", FORGET: "forgetting a replayed plan"}.get(op, f"command {op}")

    def _native(self, key: tuple) -> Any:
        """The local device's native object for view key ``(bid, offset, shape, dtype, strides)``."""
        views = self.views.get(key[0])
        native = views.get(key[1:]) if views is not None else None
        if native is None:
            from polyhal.hal.tensor import Tensor
            from polyhal.ir.types import TensorType

            bid, offset, shape, dtype, strides = key
            native = Tensor(self.buffers[bid], TensorType(shape, np.dtype(dtype)), offset, strides).native
            self.views.setdefault(bid, {})[key[1:]] = native
        return native
