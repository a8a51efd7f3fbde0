"""The CPU backend's one pool: every large kernel runs in pieces on the calling thread and
polyhal's threads, and nothing else runs threads on polyhal's behalf.

**Pieces, one counter.** :func:`run` takes a kernel's pieces (thunks that write disjoint parts
of the output) and runs them on the calling thread and ``active - 1`` pool threads (the thread
budget, :mod:`polyhal_cpu.threads`): every thread takes the next piece from one counter until
none is left, so a pool thread that wakes late finds less work (or none) rather than holding
the caller up, and the caller waits for pieces, never for a thread that found none. Pool
threads are ``SCHED_BATCH`` (:func:`_batch_policy`): on cores that other processes keep busy a
woken pool thread queues rather than preempting the caller, which then takes the pieces itself.
A piece that calls :func:`run` again (a kernel built from other kernels) runs its pieces itself,
one after another: parallelism is never nested.

**Spin, then block.** A thread woken from a futex starts ~30-80 µs later on a VM (an idle vCPU
halts, and waking it is an interrupt through the hypervisor), as long as many a kernel's half.
So, as onnxruntime's pool does, a pool thread that leaves a run spins for the next one for
:data:`SPIN_US` before it blocks on its own lock -- but only while the budget's CPUs are free
of other processes' work (``Budget.active >= 2``); while they are shared it blocks at once, and
nothing spins longer than the bound after the last run. The spin is compiled
(:func:`polyhal_cpu.native.spin_wait`: an atomic load and a ``pause`` a round), with the GIL
released, on a counter the caller bumps to publish a run (and it releases the locks of
threads that blocked). The GIL decides the rest: a thread that asks for it while another
holds it sleeps on a condition variable, and pays the same wake-up. So the caller publishes a
run just before it calls its first piece, and a spinning thread that sees it waits
:data:`LINGER_US` more (the caller's way into the piece's GIL-free code) before it takes the
GIL; a pool thread posts that it left a run from inside its spin, the GIL released, and the
caller waits for that (bounded) before it goes on, so that the two do not run Python at once.
Measured on a 2-core VM whose other users kept it busy (load average 3-4; benchmark and pool
threads at real-time priority; median ms, in one process taking turns: one thread / the pool
blocking / the pool spinning): ResNet-50 b1 104-106 / 74-79 / 70-71, DenseNet-121 b1 84-86 /
73-74 / 71; EfficientNet-B0 and MobileNetV3-large b1 moved by no more than the noise (~3%): few
of their kernels are cut. Two 86 µs GEMM pieces: 172 µs one after another, ~150 µs on the
blocking pool, 107-131 µs spinning. Threaded OpenBLAS (workers that spin in C for ~0.1 s and
need no GIL) stays ahead where kernels are small: 61-85, 55-62, 12.2-13.7 and 7.0 ms.

**What is cut.** BLAS runs single-threaded (:mod:`polyhal_cpu.threads` pins it to one thread), so
a GEMM is cut here: :class:`GemmSplit` cuts the product into blocks of output rows (M) or
columns (N), whichever is longer (each piece packs all of the other operand, the shorter), each
block one single-threaded sgemm on contiguous panels of its operands (numpy's matmul and
:mod:`polyhal_cpu.blas` release the GIL), whole alignment units wide. The compiled loops
(:mod:`polyhal_cpu.native`, GIL released) are cut by their callers into C-contiguous pieces
(images, channel blocks, blocks of output rows: the ahead-of-time loops take only C-contiguous
arrays), and :func:`parallel` wraps the builders of row-wise numpy kernels (softmax,
layer_norm, GELU).

**Grain.** Handing a piece to a pool thread and waiting for it costs ~15-30 µs while it spins,
~50-80 µs when it has blocked (a 2-core VM), so only work of a couple of hundred microseconds
is cut (finer cuts, measured with the spin, made ResNet-50 and MobileNet slower):
GEMM pieces of :data:`GEMM_PIECE_US` estimated microseconds at least, loops from
:data:`MIN_ELEMENTS` output elements times a kernel's ``factor`` (set from each loop's
single-threaded cost per element: an epilogue pass is cut only when very large). Cutting
costs a little even where the pieces run one after another: each GEMM piece packs the shorter
operand again (measured 1-10% more CPU time on ResNet/DenseNet convolutions, ~20% for a 28x28
shifted conv). While the budget is cut to one thread (other processes hold the cores) the
pieces run one after another on the calling thread, and a budget of 1
(``POLYHAL_CPU_THREADS=1``) cuts nothing at prepare time.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from polyhal.ir.types import TensorType

from polyhal_cpu.threads import budget

#: Output elements below which a loop runs on the calling thread only.
MIN_ELEMENTS = 1 << 16
#: Microseconds of single-threaded sgemm a GEMM piece holds at least (a few hand-offs' worth),
#: from its multiply-adds at :data:`GEMM_MACS_PER_US` (~38 GMAC/s on a 2-core AVX-512 VM).
GEMM_PIECE_US, GEMM_MACS_PER_US = 100, 38_000
#: Multiply-adds per byte of operands and result below which a GEMM is not cut: a thin product
#: (a classifier's matrix-vector one, a stem convolution's 27-deep one) is bound by memory, and
#: its halves on two cores took as long as the whole on one (32 x 12544 x 27: 0.3 ms either
#: way; 64 x 3136 x 64 likewise, 2-core VM), where 64 x 3136 x 576 took half the time.
GEMM_MIN_INTENSITY = 10
#: Pieces per thread a GEMM is cut into where it is large enough: more balance better when a
#: pool thread wakes late, fewer pack each panel fewer times (two a thread cost ~5-10% more CPU
#: time than one on 64 x 3136 x 64, and balanced no better once the pool woke in ~40 us).
GEMM_PIECES_PER_THREAD = 1
#: Alignment of a GEMM piece's rows and columns (whole register blocks of sgemm's kernels).
GEMM_ALIGN = 16

#: Microseconds a pool thread spins after its work before it blocks, and the caller at most
#: for the pool threads to leave a run, while the budget has two threads or more (module doc).
SPIN_US = 1000
#: Microseconds a spinning pool thread waits after it saw a run start before it takes the GIL,
#: which the caller holds until its own first piece releases it (see the module doc).
LINGER_US = 8
#: ``flags`` index of the number of the last run published; pool thread ``w`` posts the number
#: of the last run it left at ``8 * w`` (each on a cache line of its own).
_STARTED, _SLOT = 0, 8

_pool: "_Pool | None" = None
_pool_lock = threading.Lock()
_local = threading.local()  # .busy: this thread is running a piece (no nested splitting)


def threads() -> int:
    """How many threads a kernel may use: the thread budget's size (:mod:`polyhal_cpu.threads`)."""
    return budget().size


class _Pool:
    """The pool threads and how they wait for a run (see the module doc). A run is published
    by setting ``job`` and then ``flags[_STARTED]`` to its number; a thread that left the last
    one spins on that flag (compiled, GIL released: :func:`polyhal_cpu.native.spin_wait`) for
    :data:`SPIN_US` while the budget's CPUs are free, then blocks on its own lock, which
    :meth:`start` releases."""

    def __init__(self) -> None:
        from polyhal_cpu.threads import MAX_THREADS

        self.flags = np.zeros(_SLOT * MAX_THREADS, np.int64)
        self.job: tuple[int, Callable[[int], None]] | None = None
        self.threads = 0
        #: Held by the thread whose run the pool serves (another thread's runs go serially).
        self.dispatch = threading.Lock()
        self._sleeping: list[threading.Lock] = []  # gates of blocked threads, to release
        self._mutex = threading.Lock()
        from polyhal_cpu.native import spin_wait

        self._spin = spin_wait()
        per_round = _round_seconds(self._spin) if self._spin else 0.0
        self.rounds = int(SPIN_US * 1e-6 / per_round) if per_round else 0
        self.linger = int(LINGER_US * 1e-6 / per_round) if per_round else 0

    def grow(self, n: int) -> None:
        """Have ``n`` threads at least."""
        while self.threads < n:
            self.threads += 1
            threading.Thread(target=self._serve, args=(self.threads,), name=f"polyhal-cpu-{self.threads}",
                             daemon=True).start()

    def start(self, job: Callable[[int], None], number: int, wake: int) -> None:
        """Publish ``job`` as run ``number`` (to every thread that looks: ``job(w)`` on pool
        thread ``w``) and release up to ``wake`` blocked threads."""
        self.job = number, job
        with self._mutex:  # a thread checks the flag under the mutex before it blocks
            self.flags[_STARTED] = number
            gates, self._sleeping[:wake] = self._sleeping[:wake], []
        for gate in gates:
            gate.release()

    def wait(self, index: int, target: int, post: int = -1, value: int = 0, linger: int = 0) -> None:
        """Spin (bounded, GIL released) until ``flags[index]`` reaches ``target`` if the
        budget's CPUs are free of other work, returning at once when they are not; first store
        ``value`` in ``flags[post]`` (``post`` >= 0) -- with the GIL released, so that a
        thread spinning on it finds the GIL free."""
        if self.rounds and budget().active >= 2:
            self._spin(self.flags, post, value, index, target, self.rounds, linger)
        elif post >= 0:
            self.flags[post] = value

    def _serve(self, w: int) -> None:
        _batch_policy()
        gate = threading.Lock()
        gate.acquire()  # held: acquiring it again blocks until start() releases it
        seen, left = int(self.flags[_STARTED]), -1
        while True:
            self.wait(_STARTED, seen + 1, _SLOT * w if left >= 0 else -1, left, self.linger)
            with self._mutex:
                blocked = self.flags[_STARTED] == seen
                if blocked:
                    self._sleeping.append(gate)
            if blocked:
                gate.acquire()
            seen = int(self.flags[_STARTED])
            if self.job is not None:
                left, job = self.job
                job(w)


def _round_seconds(spin: Callable) -> float:
    """Seconds one round of ``spin`` takes here (the fastest of three timings of 2000: a
    preempted one reads long)."""
    flags, rounds, best = np.zeros(2, np.int64), 2000, float("inf")
    for _ in range(3):
        t = time.perf_counter()
        spin(flags, -1, 0, 0, 1, rounds, 0)
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9) / rounds


def _threads(n: int) -> _Pool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Pool()
        _pool.grow(n - 1)
        return _pool


def _forget_pool() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _batch_policy() -> None:
    """Make the calling pool thread ``SCHED_BATCH`` (Linux): woken, it does not preempt the
    thread that woke it. The scheduler puts a woken thread on an idle CPU if there is one, else
    beside its waker -- which, as an ordinary thread, it would preempt, so that the caller's own
    piece waited while the pool thread ran (measured on a 2-core VM whose other core was busy:
    a GEMM cut in four took 1.35 ms against 1.13 ms whole). As a batch thread it waits there
    instead, and the caller takes the pieces itself."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not allowed: an ordinary thread
        pass


def run(tasks: Sequence[Callable[[], object]]) -> None:
    """Run ``tasks`` (thunks writing disjoint outputs) on the calling thread and the pool, each
    thread taking the next from one counter; one after another on the calling thread when the
    budget is cut to one thread, when there is one task, inside another :func:`run`'s task, or
    while another thread's run holds the pool."""
    count = len(tasks)
    state = budget()
    pool = _threads(state.size) if count > 1 and state.active > 1 and not getattr(_local, "busy", False) else None
    if pool is None or not pool.dispatch.acquire(blocking=False):
        for task in tasks:
            task()
        return
    try:
        _run(pool, tasks, min(state.active, count) - 1)
    finally:
        pool.dispatch.release()


def _run(pool: _Pool, tasks: Sequence[Callable[[], object]], wake: int) -> None:
    count = len(tasks)
    # next() on a count is atomic under the GIL: one counter hands out pieces, one counts
    # those finished, and the thread finishing the last sets ``done``. The caller waits for
    # pieces, never for threads: a pool thread that wakes after the caller took every piece
    # finds none and costs the caller nothing.
    taken, finished, seats = itertools.count(), itertools.count(1), itertools.count()
    done, failed, joined = threading.Event(), [], []
    number = int(pool.flags[_STARTED]) + 1

    def take(publish: bool = False) -> None:
        _local.busy = True
        try:
            for i in iter(taken.__next__, None):
                if i >= count:
                    return
                if publish:  # as late as can be: see LINGER_US
                    pool.start(help, number, wake)
                    publish = False
                try:
                    tasks[i]()
                except BaseException as exc:  # noqa: BLE001 -- raised again on the calling thread
                    failed.append(exc)
                if next(finished) == count:
                    done.set()
        finally:
            _local.busy = False

    def help(w: int) -> None:  # pool thread w's part: the first ``wake`` threads that look take pieces
        if next(seats) < wake:
            joined.append(w)
            take()
    take(publish=True)
    # The pool threads that took part post the run's number once they are back in their spin,
    # the GIL released: waiting for that (bounded) keeps the caller's next Python clear of
    # theirs (a thread that finds the GIL taken sleeps, ~25 us to wake on a VM).
    for w in tuple(joined):
        pool.wait(_SLOT * w, number)
    done.wait()
    pool.job = None  # the tasks' arrays are not kept alive until the next run
    if failed:
        raise failed[0]


def blocks(size: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """``range(size)`` as at most ``parts`` (lo, hi) blocks of near-equal length, every bound but
    the last a multiple of ``align`` (fewer blocks where ``size`` is short)."""
    units = -(-size // align)
    parts = max(1, min(parts, units))
    cuts = [min(size, (units * i // parts) * align) for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def grid(outer: int, inner: int, each: int, factor: float = 1) -> list[tuple[slice, slice]]:
    """(outer, inner) index slices cutting an array laid out as (outer, inner, ``each``
    elements) into pieces that are each C-contiguous: blocks of whole ``outer`` rows (images),
    or, where there are fewer rows than pieces, blocks of ``inner`` (channels, output rows)
    within one row. Pieces hold :data:`MIN_ELEMENTS` (times ``factor``) elements at least,
    twice as many pieces as threads at most; ``[(all, all)]`` (one piece) for small work."""
    n_threads = threads()
    total = outer * inner * each
    parts = 1 if n_threads < 2 else min(2 * n_threads, int(total // max(MIN_ELEMENTS * factor, 1)))
    everything = slice(None)
    if parts < 2:
        return [(everything, everything)]
    if outer >= parts:
        return [(slice(lo, hi), everything) for lo, hi in blocks(outer, parts)]
    per = -(-parts // outer)
    return [(slice(o, o + 1), slice(lo, hi)) for o in range(outer) for lo, hi in blocks(inner, per)]


def gemm_pieces(m: int, n: int, k: int, batch: int = 1, b_size: int | None = None,
                min_intensity: float | None = None) -> int:
    """How many threads' worth of pieces ``batch`` (m, k) @ (k, n) float32 products are worth
    (1: not cut): their estimated single-threaded time in :data:`GEMM_PIECE_US` units, at most
    the thread budget; 1 for products bound by memory (below ``min_intensity`` multiply-adds a
    byte, default :data:`GEMM_MIN_INTENSITY`). ``b_size``: the elements the (k, n) operand is
    read from, where fewer than k * n (a convolution's taps reading one padded image at shifted
    offsets)."""
    n_threads = threads()
    macs = m * n * k
    intensity = GEMM_MIN_INTENSITY if min_intensity is None else min_intensity
    if n_threads < 2 or macs < intensity * 4 * (m * k + (k * n if b_size is None else b_size) + m * n):
        return 1
    return max(1, min(n_threads, int(batch * macs / GEMM_MACS_PER_US // GEMM_PIECE_US)))


class GemmSplit:
    """How an (m, k) @ (k, n) product (``batch`` of them, cut alike) is cut, chosen at prepare
    time from its shape: along ``axis`` (default: the longer of m and n), into
    :func:`gemm_pieces` times :data:`GEMM_PIECES_PER_THREAD` pieces, bounds multiples of
    ``align``. ``axis`` is 0 (rows) or 1 (columns); ``bounds`` the pieces' (lo, hi) along it
    (one piece: not cut)."""

    def __init__(self, m: int, n: int, k: int, axis: int | None = None, batch: int = 1,
                 align: int = GEMM_ALIGN) -> None:
        parts = gemm_pieces(m, n, k, batch) * GEMM_PIECES_PER_THREAD
        self.axis = (0 if m >= n else 1) if axis is None else axis
        self.bounds = blocks(m if self.axis == 0 else n, parts, align)

    def __len__(self) -> int:
        return len(self.bounds)

    def tasks(self, a: np.ndarray, b: np.ndarray, out: np.ndarray,
              call: Callable[[np.ndarray, np.ndarray, np.ndarray], object] | None = None) -> list[Callable[[], object]]:
        """Thunks computing the pieces of ``out = a @ b`` (any leading batch dims) by ``call(a,
        b, out)`` (default ``np.matmul(a, b, out=out)``) on views of the operands."""
        call = call or _matmul
        if self.axis == 0:
            return [partial(call, a[..., lo:hi, :], b, out[..., lo:hi, :]) for lo, hi in self.bounds]
        return [partial(call, a, b[..., lo:hi], out[..., lo:hi]) for lo, hi in self.bounds]


def _matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.matmul(a, b, out=out)


def parallel(fixed_axes: Callable[[dict, tuple], Iterable[int]] = lambda attrs, ins: (),
             split_inputs: Callable[[dict, tuple], tuple[bool, ...]] | None = None,
             factor: float | Callable[[dict, tuple], float] = 1, pieces_per_thread: int = 1):
    """Decorate a builder so that its kernel runs in pieces along one axis (by :func:`run`).

    At prepare time it picks the axis to split (the first of size > 1, so that every piece of
    a C-contiguous output is itself C-contiguous, as kernels require) and builds one kernel per
    piece shape. ``pieces_per_thread`` > 1 cuts finer, which balances better where a thread's
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

            def kernel(*arrays):
                def piece(fn, where):
                    fn(*[a[where] if f else a for a, f in zip(arrays[:n_in], cut)], *[o[where] for o in arrays[n_in:]])
                run([partial(piece, fn, where) for fn, where in pieces])
            return kernel
        build.__wrapped__ = builder
        return build
    return wrap
