"""Plan replay through CUDA graphs.

:meth:`polyhal_cuda.device.CUDADevice.record` wraps a compiled plan's steps in a
:class:`GraphReplay`, which the plan then calls instead of looping over its steps:

1. The first call runs the steps eagerly. That also warms everything a capture must not do:
   NVRTC compilation, cuBLAS handles and workspaces, cupy's kernel caches.
2. The second call captures the steps once, on the device's stream, into a CUDA graph
   (``cupy.cuda.Stream.begin_capture`` / ``end_capture``), with the plan's input and output
   slots pointing at buffers the replay owns. Memory that cupy allocates for temporaries while
   capturing comes from an allocator that keeps every block alive as long as the graph: the
   graph's kernels keep using those addresses on every replay, so the pool must never hand
   them to anyone else.
3. Every call from then on *rebinds without re-capturing*: the caller's inputs (already bound
   in the slots by the plan) are copied into the captured input buffers with
   ``cudaMemcpyAsync``, the graph is launched, and the captured outputs are copied into the
   caller's output arrays. These are device-to-device copies of the inputs and outputs only
   (documented cost: 2-3 µs of host time each, and their bytes at device bandwidth); the
   intermediates, kernels and scratch are the graph's own.
4. The *eager tail*: the last steps that write only program outputs, each output larger than
   a launch's worth of copying (:func:`eager_tail`), are left out of the graph and launched
   after it, straight into the caller's outputs. A language model's logits (GPT-2 at batch 16:
   393 MB) would otherwise be held twice -- in a buffer the graph owns and in the caller's
   result -- and copied from one to the other on every call.

Shapes never change for a compiled plan, so one graph serves every call. A step that cannot be
captured (it synchronises with the host, or calls an API that capture forbids) makes the
capture fail; the replay then stays eager for good and says why in :attr:`GraphReplay.reason`.

When a graph pays: it removes the per-step launch cost (~5-15 µs of Python and driver time per
step) but adds the copies. :func:`worth_capturing` captures when the estimated copy time is
below the estimated launch time saved; ``POLYHAL_CUDA_GRAPHS=0`` disables, ``=1`` forces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from polyhal_cuda.settings import CUDASettings

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Host time one eagerly launched step costs, used by the capture heuristic (seconds).
STEP_LAUNCH_S = 8e-6
#: Device-to-device copy bandwidth assumed by the heuristic (bytes per second).
COPY_BPS = 1.5e12


def graphs_setting() -> str:
    """``POLYHAL_CUDA_GRAPHS``: ``auto`` (default), ``1`` (always capture) or ``0`` (never)."""
    return CUDASettings.from_env().graphs


def worth_capturing(steps: int, io_bytes: int) -> bool:
    """Whether replaying ``steps`` steps as a graph beats launching them, given that a replay
    copies ``io_bytes`` bytes of inputs and outputs (device to device)."""
    setting = graphs_setting()
    if setting in ("0", "1"):
        return setting == "1"
    return steps >= 2 and io_bytes / COPY_BPS < steps * STEP_LAUNCH_S


def eager_tail(steps: Sequence[Callable[[], None]], slots: list, output_slots: Sequence[int]) -> int:
    """How many of the last ``steps`` run after the graph instead of in it: a trailing run of steps
    that write only ``output_slots`` (their ``writes`` attribute), each writing more bytes than
    the copy out of a graph-owned buffer could move in the time an eager launch costs."""
    outputs, n = set(output_slots), 0
    for step in reversed(steps):
        writes = getattr(step, "writes", None)
        if (not writes or not set(writes) <= outputs
                or sum(slots[i].nbytes for i in writes) < STEP_LAUNCH_S * COPY_BPS):
            break
        n += 1
    return n


class _KeepAllocator:
    """cupy allocator used during capture: every block it hands out stays owned by the graph."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.blocks: list = []

    def __call__(self, size: int) -> Any:
        mp = self.pool.malloc(size)
        self.blocks.append(mp)
        return mp


class GraphReplay:
    """Runs a plan's steps: eagerly, then as a captured CUDA graph (see the module docstring).

    ``slots`` is the plan's slot table (native cupy arrays); ``input_slots`` and
    ``output_slots`` index into it. ``mode`` is ``"eager"``, ``"graph"`` or ``"eager (reason)"``.
    """

    def __init__(self, device: "Device", steps: Sequence[Callable[[], None]], slots: list,
                 input_slots: Sequence[int], output_slots: Sequence[int]) -> None:
        self.device = device
        self.steps = list(steps)
        self.slots = slots
        self.input_slots = tuple(dict.fromkeys(input_slots))
        self.output_slots = tuple(dict.fromkeys(output_slots))
        self.graph: Any = None
        self.calls = 0
        self.replays = 0
        self.reason = ""
        self._disabled = False
        self._owned: list = []  # captured input/output buffers and capture-time blocks
        self._inputs: list[tuple[int, Any]] = []
        self._outputs: list[tuple[int, Any]] = []
        self._tail: list[Callable[[], None]] = []  # steps launched after the graph (eager_tail)

    @property
    def mode(self) -> str:
        if self.graph is not None:
            return "graph"
        return f"eager ({self.reason})" if self.reason else "eager"

    def __call__(self) -> None:
        if self.graph is None:
            self.calls += 1
            if self._disabled or self.calls < 2 or not self._try_capture():
                for step in self.steps:
                    step()
                return
        self._replay()

    # -- replay ------------------------------------------------------------------------------------

    def _replay(self) -> None:
        from cupy.cuda import runtime

        slots, stream = self.slots, self.device.stream
        sptr = stream.ptr
        for slot, buf in self._inputs:
            src = slots[slot]
            if src is not buf and buf.nbytes:
                runtime.memcpyAsync(buf.data.ptr, src.data.ptr, buf.nbytes, 4, sptr)
        self.graph.launch(stream)
        for slot, buf in self._outputs:
            dst = slots[slot]
            if dst is not buf and buf.nbytes:
                runtime.memcpyAsync(dst.data.ptr, buf.data.ptr, buf.nbytes, 4, sptr)
        for step in self._tail:
            step()
        self.replays += 1

    # -- capture -----------------------------------------------------------------------------------

    def _try_capture(self) -> bool:
        slots = self.slots
        tail = eager_tail(self.steps, slots, self.output_slots)
        head = self.steps[:len(self.steps) - tail]
        written = {i for step in self.steps[len(head):] for i in step.writes}
        outputs = tuple(i for i in self.output_slots if i not in written)
        io = sum(slots[i].nbytes for i in (*self.input_slots, *outputs) if slots[i] is not None)
        if not worth_capturing(len(head), io):
            self._disable("not worth a graph: few steps or large inputs/outputs (POLYHAL_CUDA_GRAPHS=1 forces)")
            return False
        return self._capture(head, outputs)

    def _capture(self, head: list, outputs: tuple[int, ...]) -> bool:
        """Capture ``head`` (the steps before the eager tail), which writes ``outputs``."""
        import cupy

        dev, slots = self.device, self.slots
        bound = {i: slots[i] for i in (*self.input_slots, *outputs)}
        if any(not getattr(a, "flags", None) or not a.flags.c_contiguous for a in bound.values()):
            self._disable("a bound input or output is not contiguous")
            return False
        keep = _KeepAllocator(dev.cuda_allocator.pool)
        try:
            with dev.activate():
                own = {i: self._owned_like(a) for i, a in bound.items()}
                for i, a in own.items():
                    slots[i] = a
                stream = dev.stream
                graph = None
                # No staged copy of another thread (a concurrent plan's CPU lane reading this GPU)
                # may put work on the stream while it is captured.
                with cupy.cuda.using_allocator(keep), dev.stager.exclusive():
                    stream.begin_capture()
                    try:
                        for step in head:
                            step()
                    finally:
                        # end_capture must run even if a step failed, or the stream stays in
                        # capture mode and every later call on it fails.
                        graph = stream.end_capture()
                graph.upload(stream)
        except Exception as exc:  # noqa: BLE001 - any capture failure means "stay eager"
            for i, a in bound.items():
                slots[i] = a
            self._disable(f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return False
        for i, a in bound.items():
            slots[i] = a
        self._inputs = [(i, own[i]) for i in self.input_slots]
        self._outputs = [(i, own[i]) for i in outputs]
        self._tail = self.steps[len(head):]
        self._owned.extend(keep.blocks)
        self.graph = graph
        return True

    def _owned_like(self, a: Any) -> Any:
        import cupy

        mp = self.device.cuda_allocator.pool.malloc(max(a.nbytes, 1))
        self._owned.append(mp)
        return cupy.ndarray(a.shape, a.dtype, mp)

    def _disable(self, reason: str) -> None:
        self._disabled = True
        self.reason = reason
