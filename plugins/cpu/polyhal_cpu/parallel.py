"""Running a kernel's independent pieces on several cores.

numpy releases the GIL inside its loops, so the rows of a row-wise kernel (softmax, layer_norm)
or the pieces of an elementwise one (gelu, sigmoid, erf) run in parallel on a small pool of
threads. :func:`parallel` wraps a kernel *builder*: at prepare time it picks the axis to split
(the first of size > 1, so that every piece of a C-contiguous output is itself C-contiguous, as
kernels require) and builds one kernel per piece shape; the calling thread runs the first piece
and the pool the others.

The pool has one thread fewer than the CPU backend's thread budget (:mod:`polyhal_cpu.threads`;
``POLYHAL_CPU_THREADS``; 1 disables splitting), and while the budget is cut to one thread
because other processes keep the CPUs busy, the pieces run one after another on the calling
thread. The pieces never call BLAS, so BLAS's threads and these never nest.
Kernels smaller than :data:`MIN_ELEMENTS` (times the kernel's ``factor``) run whole: handing a
piece to a thread and waiting for it costs ~30 µs, ~50-80 µs when the thread has gone idle
(a 2-core VM), so a split pays only for work of a few hundred microseconds; kernels that
spend little per element (tanh-GELU, sigmoid) split later than costly ones (erf). Note that
in a plan with matmuls a split can cost more than it saves at any size: OpenBLAS's worker
threads keep spinning on the other cores for a while (~0.1 s) after each BLAS call, and a
piece handed to an idle pool thread right after one waited there for up to a scheduler slice
(median 3x slower than unsplit, measured on a 2-core VM with a 262144-element GELU).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from polyhal.ir.types import TensorType

from polyhal_cpu.threads import budget

#: Output elements below which a kernel runs on the calling thread only.
MIN_ELEMENTS = 1 << 16

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def threads() -> int:
    """How many threads a kernel may use: the thread budget's size (:mod:`polyhal_cpu.threads`)."""
    return budget().size


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < n - 1:  # noqa: SLF001
            _pool = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="polyhal-cpu")
        return _pool


def parallel(fixed_axes: Callable[[dict, tuple], Iterable[int]] = lambda attrs, ins: (),
             split_inputs: Callable[[dict, tuple], tuple[bool, ...]] | None = None,
             factor: float | Callable[[dict, tuple], float] = 1, pieces_per_thread: int = 1):
    """Decorate a builder so that its kernel runs in pieces along one axis on several threads.

    The calling thread and the pool's threads take pieces from one counter until none is
    left, so a pool thread that wakes late finds less work (or none) rather than holding the
    caller up; ``pieces_per_thread`` > 1 cuts finer, which balances better where a thread's
    hand-off costs as much as its piece (a thread that woke late then takes fewer pieces).

    ``fixed_axes(attrs, ins)`` are the output axes that must stay whole (a softmax's axis, a
    layer_norm's normalised axes); ``split_inputs(attrs, ins)`` says which inputs are cut like
    the output (default: those of the output's shape; others, such as a layer_norm's scale,
    are passed whole). Outputs smaller than ``factor`` (or ``factor(attrs, ins)``) times
    :data:`MIN_ELEMENTS` are not split: kernels that cost little per element need more.
    """
    def wrap(builder):
        def build(device, op: str, attrs: dict, ins: tuple, outs: tuple, scratch):
            n = threads()
            out = outs[0]
            least = MIN_ELEMENTS * (factor(attrs, ins) if callable(factor) else factor)
            if n < 2 or out.size < least:
                return builder(device, op, attrs, ins, outs, scratch)
            rank = out.rank
            fixed = {a % rank for a in fixed_axes(attrs, ins)} if rank else set()
            axis = next((i for i, d in enumerate(out.shape) if d > 1), None)
            # every output is cut along the same axis (a second output may have fewer dims after it)
            if (axis is None or axis in fixed or out.shape[axis] < 2
                    or any(o.shape[:axis + 1] != out.shape[:axis + 1] for o in outs)):
                return builder(device, op, attrs, ins, outs, scratch)
            cut = split_inputs(attrs, ins) if split_inputs else tuple(t.shape == out.shape for t in ins)
            parts = min(n * max(pieces_per_thread, 1), out.shape[axis])
            size = out.shape[axis]
            bounds = [(size * i // parts, size * (i + 1) // parts) for i in range(parts)]
            kernels = {}

            def piece_types(types, flags, length):
                return tuple(TensorType(t.shape[:axis] + (length,) + t.shape[axis + 1:], t.dtype) if f else t
                             for t, f in zip(types, flags))

            for lo, hi in bounds:
                if hi - lo not in kernels:
                    kernels[hi - lo] = builder(device, op, attrs, piece_types(ins, cut, hi - lo),
                                               piece_types(outs, (True,) * len(outs), hi - lo), scratch)
            head = (slice(None),) * axis
            pieces = [(kernels[hi - lo], head + (slice(lo, hi),)) for lo, hi in bounds]
            n_in = len(ins)
            pool = _executor(n)
            state = budget()

            def kernel(*arrays):
                def run(fn, where):
                    fn(*[a[where] if f else a for a, f in zip(arrays[:n_in], cut)], *[o[where] for o in arrays[n_in:]])
                if state.active < 2:  # other processes hold the other cores: no hand-offs
                    for piece in pieces:
                        run(*piece)
                    return
                taken = itertools.count()  # next() on it is atomic under the GIL

                def take() -> None:
                    for i in iter(taken.__next__, None):
                        if i >= len(pieces):
                            return
                        run(*pieces[i])
                futures = [pool.submit(take) for _ in range(min(n, len(pieces)) - 1)]
                take()
                for f in futures:
                    f.result()
            return kernel
        build.__wrapped__ = builder
        return build
    return wrap
