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

**GEMMs without Python.** A pool thread needs the GIL to start a piece of :func:`run`, and one
that finds it taken sleeps (~25 us to wake on a VM): a product cut in two paid ~80-100 us for
it, as much as its halves saved on sub-millisecond products. So float32 products (linear,
fused_linear, gemm, matmul, and unmasked attention as two GEMMs a piece with a softmax between)
and layer norms go through a compiled queue instead (:func:`run_gemms`; its layout in
:mod:`polyhal_cpu.queue_layout`): each piece a row of descriptors
(operands' addresses, sizes, bias, residual, activation) that compiled code computes by
calling BLAS's ``cblas_sgemm`` (``cblas_sgemv`` for one row) through its address, the caller
from :func:`polyhal_cpu.native_loops.drive_gemms` and a spinning pool thread from inside its
spin (:func:`polyhal_cpu.native_loops.serve_gemms`), neither taking the GIL; a blocked pool
thread is woken as for :func:`run`. Pieces are taken by a compare-and-swap on a counter tagged
with the run's number, so a thread that looked at an older run takes nothing of a newer one.
Measured on a 2-core VM (median, one process, the machine otherwise quiet): the MLP example
0.64-0.87 -> 0.44-0.47 ms, the transformer block 1.38-1.80 -> 1.04-1.10 ms; a 256^3 product
with bias 335 us whole, 196 us in two pieces (294 us on :func:`run`).

**Convolutions on the queue.** The channels-last convolutions' loops (1x1 tiles, depthwise,
a first conv over the image; :func:`polyhal_cpu.native_loops.conv_piece`) take the same queue:
a piece's descriptor holds its arrays' addresses and shapes (queue_layout's ``V_`` fields), the
table made at prepare time and its addresses filled per call (:class:`PieceTable`), so that
at batch 1 convolutions of a few tens of microseconds are cut too, from their estimated time
(:func:`queue_parts`: blocks of output rows, images or pixels). Measured on a 2-core VM, whole /
two pieces: MobileNetV3's 16 -> 64 1x1 conv at 112x112 374 / 193 us, 112x112x16 3x3 depthwise
217 / 116 us, EfficientNet's 28x28x120 5x5 depthwise 138 / 82 us; on ``polyhal run --profile``
most of MobileNetV3-large's b1 convolutions took 0.6-0.7x their one-thread time (those before,
handed out by :func:`run` or not cut, ~1.0x), the model 8.1-9.3 -> 5.8-6.5 ms (onnxruntime,
two threads: 3.8-4.3 ms), EfficientNet-B0 b1 15.3 -> 9.6 ms (7.5-8.3 ms).

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

import ctypes
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from polyhal.ir.types import TensorType

from polyhal_cpu import native
from polyhal_cpu import queue_layout as layout
from polyhal_cpu.threads import budget

#: Output elements below which a loop runs on the calling thread only.
MIN_ELEMENTS = 1 << 16
#: Microseconds of single-threaded sgemm a GEMM piece holds at least (a few hand-offs' worth),
#: from its multiply-adds at :data:`GEMM_MACS_PER_US` (~38 GMAC/s on a 2-core AVX-512 VM).
GEMM_PIECE_US, GEMM_MACS_PER_US = 100, 38_000
#: Microseconds of single-threaded sgemm a piece run on the compiled GEMM queue holds at least
#: (:func:`run_gemms`: its hand-off costs a few microseconds while the pool spins). Measured
#: on a 2-core VM (AVX-512), whole / two pieces, with bias: 64 x 128 x 128 30 / 22 us, 256 x
#: 128 x 128 92 / 60 us, 256 x 256 x 256 340 / 200 us.
GEMM_QUEUE_PIECE_US = 15
#: :data:`GEMM_MIN_INTENSITY` for the GEMM queue's pieces: thin products are cut too, their
#: halves taking less than the whole once handing them off costs little (2-core VM, whole / two
#: pieces: 256 x 16 x 256 33 / 23 us; 1 x 1280 x 1000 with B in cache 68 / 44 us, from memory
#: 385 / 357 us).
GEMM_QUEUE_MIN_INTENSITY = 0
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

#: Microseconds the caller of a GEMM run spins for the pool threads' pieces to finish before it
#: yields its CPU between looks: a pool thread's piece still running then may be one that waits
#: for this CPU (the other one busy elsewhere), and a spinning caller would hold it up for its
#: whole spin (measured: DistilBERT 91-197 ms against 163 ms of run()'s blocking wait, with a
#: 1 ms spin, one core busy elsewhere).
GEMM_WAIT_US = 30
#: Seconds between looks at a pool thread's unfinished piece once run_gemms was interrupted.
GEMM_POLL_S = 50e-6
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
        self._spin = native.spin_wait()
        #: The compiled GEMM queue (see :func:`run_gemms`): its loops (None: off) and its vector.
        self.gemms = native.gemm_queue() if self._spin else None
        self.queue = np.zeros(layout.Q_SIZE, np.int64)
        per_round = _round_seconds(self._spin) if self._spin else 0.0
        self.rounds = int(SPIN_US * 1e-6 / per_round) if per_round else 0
        self.linger = int(LINGER_US * 1e-6 / per_round) if per_round else 0
        self.finish = int(GEMM_WAIT_US * 1e-6 / per_round) if per_round else 0

    def grow(self, n: int) -> None:
        """Have ``n`` threads at least."""
        while self.threads < n:
            self.threads += 1
            threading.Thread(target=self._serve, args=(self.threads,), name=f"polyhal-cpu-{self.threads}",
                             daemon=True).start()

    def start(self, job: Callable[[int], None] | None, number: int, wake: int) -> None:
        """Publish ``job`` as run ``number`` (to every thread that looks: ``job(w)`` on pool
        thread ``w``; None for a GEMM run, published in :attr:`queue` first) and release up to
        ``wake`` blocked threads."""
        self.job = None if job is None else (number, job)
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
        # Pieces compute IEEE results (inf, nan) silently, as on the calling thread (the plan runs
        # under np.errstate there; numpy's error state is per thread, and this thread is polyhal's).
        np.seterr(all="ignore")
        gate = threading.Lock()
        gate.acquire()  # held: acquiring it again blocks until start() releases it
        seen, left = int(self.flags[_STARTED]), -1
        while True:
            post = _SLOT * w if left >= 0 else -1
            if self.gemms is not None and self.rounds and budget().active >= 2:
                # GEMM runs are served inside the spin, without the GIL (see run_gemms)
                seen = self.gemms["serve_gemms"](self.flags, self.queue, post, left, _STARTED, seen, self.rounds,
                                                 self.linger)
            else:
                self.wait(_STARTED, seen + 1, post, left, self.linger)
            with self._mutex:
                blocked = self.flags[_STARTED] == seen
                if blocked:
                    self._sleeping.append(gate)
            if blocked:
                gate.acquire()
            seen = int(self.flags[_STARTED])
            if self.gemms is not None and self.queue[layout.Q_RUN] == seen:
                self.gemms["take_gemms"](self.queue, seen)
            elif self.job is not None:
                left, job = self.job
                job(w)


def stop_spinning() -> None:
    """From now on, pool threads block right after a run instead of spinning for the next one:
    another runtime's threads (oneDNN's OpenMP workers, :mod:`polyhal_cpu.onednn`) share the
    budget's CPUs, and a pool thread spinning on one of them holds up each of that runtime's
    parallel regions for a scheduler slice (measured on the 2-core VM: MobileNetV3-large b1 took
    1.5-3 s instead of ~30 ms, its 1x1 convs ~20 ms each)."""
    global SPIN_US
    SPIN_US = 0
    with _pool_lock:
        if _pool is not None:
            _pool.rounds = 0


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


def run_gemms(table: np.ndarray) -> None:
    """Compute the GEMM pieces of ``table`` (rows of descriptors, :meth:`GemmSplit.table`; or
    (pieces, steps, descriptor): pieces of GEMMs run one after another) on
    the calling thread and the pool, as :func:`run` does its tasks, but in compiled code: the
    caller takes pieces from the queue in :func:`polyhal_cpu.native_loops.drive_gemms` and a
    spinning pool thread from inside its spin, so neither runs Python, or needs the GIL, between
    a piece and the next. (Handed out by :func:`run`, each piece cost ~80-100 us on a 2-core
    VM: a pool thread takes the GIL to start its piece, and a thread that finds it taken sleeps
    ~25 us.) A pool thread blocked on its lock is woken as for :func:`run`, and takes pieces
    once it is back, the GIL released; a pool thread's piece the caller waits for, spinning for
    :data:`GEMM_WAIT_US`, then yielding its CPU between looks."""
    count = len(table)
    state = budget()
    pool = _threads(state.size) if count > 1 and state.active > 1 and not getattr(_local, "busy", False) else None
    if pool is None or pool.gemms is None or not pool.dispatch.acquire(blocking=False):
        _serial()(table.reshape(-1, layout.G_FIELDS))
        return
    queue, number, drive = pool.queue, int(pool.flags[_STARTED]) + 1, pool.gemms["drive_gemms"]
    try:
        _publish(queue, table, number)
        pool.start(None, number, min(state.active, count) - 1)
        while not drive(queue, number, pool.finish):
            os.sched_yield()  # the pool thread may be waiting for this very CPU
    finally:
        # Pool threads read the table and write the operands through raw addresses: even when
        # interrupted (KeyboardInterrupt in the sleep), return only once their pieces are done.
        done = (number << layout.RUN_SHIFT) + count
        while queue[layout.Q_FINISHED] < done and queue[layout.Q_RUN] == number:
            time.sleep(GEMM_POLL_S)
        pool.dispatch.release()


_pieces: Callable[[np.ndarray], None] | None = None


def _serial() -> Callable[[np.ndarray], None]:
    """The compiled loop computing a table's pieces one after another on the calling thread."""
    global _pieces
    if _pieces is None:
        _pieces = native.gemm_queue()["gemm_pieces"]
    return _pieces


def _publish(queue: np.ndarray, table: np.ndarray, number: int) -> None:
    """Make ``table`` GEMM run ``number`` of ``queue`` (its number last: a thread that sees it
    finds the rest in place)."""
    queue[layout.Q_DESC], queue[layout.Q_COUNT] = address(table), len(table)
    queue[layout.Q_STEPS] = table.shape[1] if table.ndim == 3 else 1
    queue[layout.Q_FINISHED] = queue[layout.Q_TAKEN] = number << layout.RUN_SHIFT
    queue[layout.Q_RUN] = number


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
                piece_us: float | None = None, min_intensity: float | None = None) -> int:
    """How many threads' worth of pieces ``batch`` (m, k) @ (k, n) float32 products are worth
    (1: not cut): their estimated single-threaded time in :data:`GEMM_PIECE_US` units, at most
    the thread budget; 1 for products bound by memory (:data:`GEMM_MIN_INTENSITY`). ``b_size``:
    the elements the (k, n) operand is read from, where fewer than k * n (a convolution's taps
    reading one padded image at shifted offsets). ``piece_us``: the least estimated microseconds
    of a piece (default :data:`GEMM_PIECE_US`); ``min_intensity``: default :data:`GEMM_MIN_INTENSITY`."""
    n_threads = threads()
    macs = m * n * k
    intensity = GEMM_MIN_INTENSITY if min_intensity is None else min_intensity
    if n_threads < 2 or macs < intensity * 4 * (m * k + (k * n if b_size is None else b_size) + m * n):
        return 1
    least = GEMM_PIECE_US if piece_us is None else piece_us
    return max(1, min(n_threads, int(batch * macs / GEMM_MACS_PER_US // least)))


#: Multiply-adds up to which an uncut product is :attr:`GemmSplit.small`: a kernel then calls
#: numpy's product itself, as the GEMM queue's table (an address per operand at ~0.6 us each)
#: costs more than the product (a scikit-learn model's [1, 10] x [10, 4] at batch 1).
SMALL_PRODUCT = 1 << 14


class GemmSplit:
    """How an (m, k) @ (k, n) product (``batch`` of them, cut alike) is cut, chosen at prepare
    time from its shape: along ``axis`` (default: the longer of m and n), into
    :func:`gemm_pieces` times :data:`GEMM_PIECES_PER_THREAD` pieces, bounds multiples of
    ``align``. ``axis`` is 0 (rows) or 1 (columns); ``bounds`` the pieces' (lo, hi) along it
    (one piece: not cut)."""

    def __init__(self, m: int, n: int, k: int, axis: int | None = None, batch: int = 1,
                 align: int = GEMM_ALIGN, queued: bool = False) -> None:
        # pieces for the GEMM queue (queued: the caller runs them by run_gemms where it can)
        # hand off in microseconds: they are cut finer, thin products too
        if queued and gemm_fn() is not None:
            parts = gemm_pieces(m, n, k, batch, piece_us=GEMM_QUEUE_PIECE_US, min_intensity=GEMM_QUEUE_MIN_INTENSITY)
        else:
            parts = gemm_pieces(m, n, k, batch) * GEMM_PIECES_PER_THREAD
        self.axis = (0 if m >= n else 1) if axis is None else axis
        self.bounds = blocks(m if self.axis == 0 else n, parts, align)
        self._lo, self._hi = (np.array(e, np.int64) for e in zip(*self.bounds)) if self.bounds else ((), ())
        self._tables: dict[tuple, tuple[np.ndarray, tuple] | None] = {}  # table()'s templates, by strides
        #: One piece of at most SMALL_PRODUCT multiply-adds: cheaper without the queue.
        self.small = len(self.bounds) == 1 and batch * m * n * k <= SMALL_PRODUCT

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

    def table(self, a: np.ndarray, b: np.ndarray, out: np.ndarray, alpha: float = 1.0, beta: float = 0.0,
              bias: np.ndarray | None = None, residual: np.ndarray | None = None, act: int = 0,
              act_alpha: float = 0.0, act_beta: float = 0.0) -> np.ndarray | None:
        """The pieces of ``out = act(alpha a @ b + beta bias + residual)`` for :func:`run_gemms`
        (2-D float32 operands; ``bias`` broadcasts to ``out``'s shape: ``out`` is set to it
        first, and BLAS adds ``alpha a @ b`` to ``beta`` times it; ``residual`` has ``out``'s
        shape; ``act`` is a :func:`polyhal_cpu.native.activation_code`), or None where the
        compiled queue is off, or an operand's strides are not ones BLAS reads in place (then
        the caller computes it another way). Made from a template kept per operand strides:
        a call costs a few microseconds (each operand's address, each piece's row)."""
        operands = (a, b, out, bias, residual)
        key = (a.strides, b.strides, out.strides, a.shape, b.shape,
               None if bias is None else (bias.shape, bias.strides), None if residual is None else residual.strides,
               alpha, beta, act, act_alpha, act_beta)
        made = self._tables.get(key, False)
        if made is False:
            made = self._tables[key] = self._template(*operands, alpha, beta, act, act_alpha, act_beta)
        if made is None:
            return None
        template, fields = made
        t = template.copy()
        for field, x, offsets in fields:
            at = address(operands[x])
            for p, offset in enumerate(offsets):
                t[p, field] = at + offset
        return t

    def piece_table(self, a, b, out, alpha: float = 1.0, beta: float = 0.0, bias: np.ndarray | None = None,
                    residual: np.ndarray | None = None, act: int = 0, act_alpha: float = 0.0, act_beta: float = 0.0,
                    batch: int = 1, steps: Sequence[int] = (0, 0, 0, 0, 0)) -> PieceTable | None:
        """:meth:`table`'s pieces made once, when a kernel is prepared, for ``batch`` products that
        lie one after another: arrays of the operands' shapes and strides stand for them here,
        product n's operand i lies ``n * steps[i]`` bytes after the first's, and the table is
        called with the first's operands (a, b, out, bias, residual) on each run (kept while the
        same arrays come). None where :meth:`table` would give None."""
        made = self._template(a, b, out, bias, residual, alpha, beta, act, act_alpha, act_beta)
        if made is None:
            return None
        template, fields = made
        return PieceTable(np.tile(template, (batch, 1)),
                          [(field, x, [o + n * steps[x] for n in range(batch) for o in offsets])
                           for field, x, offsets in fields])

    def _template(self, a, b, out, bias, residual, alpha, beta, act, act_alpha, act_beta):
        """:meth:`table`'s descriptors but the operands' addresses, and (field, operand, each
        piece's offset in bytes) to fill them in; None where the strides do not do."""
        fn = gemm_fn()
        if fn is None or out.dtype != np.float32 or a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
            return None
        from polyhal_cpu import blas

        la, lb, lc = blas.layout2(a), blas.layout2(b), blas.layout2(out)
        if la is None or lb is None or lc is None or lc[0] != blas.NO_TRANS:
            return None
        if bias is not None:  # its strides as broadcast to out's shape (0 along a broadcast dim)
            if bias.ndim > 2 or bias.dtype != np.float32:
                return None
            padded = (1,) * (2 - bias.ndim) + bias.shape, (0,) * (2 - bias.ndim) + bias.strides
            bias_strides = tuple(0 if d == 1 else st for d, st in zip(*padded))
        strides = [a.strides, b.strides, out.strides, bias_strides if bias is not None else (0, 0),
                   residual.strides if residual is not None else (0, 0)]
        if any(s % 4 or s < 0 for pair in strides for s in pair) or (residual is not None and strides[4][1] != 4):
            return None
        t = np.zeros((len(self.bounds), layout.G_FIELDS), np.int64)
        lo, hi, axis = self._lo, self._hi, self.axis
        t[:, layout.G_FN], t[:, layout.G_WIDE], t[:, layout.G_GEMV] = fn
        t[:, layout.G_TA], t[:, layout.G_LDA], t[:, layout.G_TB], t[:, layout.G_LDB] = *la, *lb
        t[:, layout.G_LDC] = lc[1]
        (m, k), n = a.shape, b.shape[1]
        t[:, layout.G_M], t[:, layout.G_N], t[:, layout.G_K] = m, n, k
        t[:, layout.G_M if axis == 0 else layout.G_N] = hi - lo
        t[:, layout.G_ALPHA], t[:, layout.G_BETA] = float_bits(alpha), float_bits(beta if bias is not None else 0.0)
        t[:, layout.G_ACT] = act
        t[:, layout.G_ACT_ALPHA], t[:, layout.G_ACT_BETA] = float_bits(act_alpha), float_bits(act_beta)
        t[:, layout.G_BIAS_ROW], t[:, layout.G_BIAS_COL] = strides[3][0] // 4, strides[3][1] // 4
        t[:, layout.G_LDR] = strides[4][0] // 4
        # each piece starts at element (lo, 0) of A, C, bias and residual (blocks of rows), or
        # at (0, lo) of B, C, bias and residual (blocks of columns)
        cut = (axis == 0, axis == 1, True, True, True)
        present = (True, True, True, bias is not None, residual is not None)
        fields = [(field, x, [int(v) * strides[x][axis] if cut[x] else 0 for v in lo])
                  for x, field in enumerate((layout.G_A, layout.G_B, layout.G_C, layout.G_BIAS, layout.G_RES))
                  if present[x]]
        return t, fields


#: Taps of a depthwise conv's output elements computed per microsecond single-threaded (2-core
#: VM, AVX-512: EfficientNet's 56x56x144 3x3 280 us, 28x28x240 5x5 200 us), to estimate its time.
DEPTHWISE_TAPS_PER_US = 15_000
#: Pieces per thread :func:`queue_parts` cuts work into at most.
QUEUE_PIECES_PER_THREAD = 1


def queue_parts(us: float) -> int:
    """How many pieces work of ``us`` estimated single-threaded microseconds is cut into on the
    compiled queue (:func:`run_gemms`): pieces of :data:`GEMM_QUEUE_PIECE_US` at least, as many
    as the thread budget at most (1: not cut)."""
    n_threads = threads()
    if n_threads < 2 or native.gemm_queue() is None:
        return 1
    return max(1, min(n_threads * QUEUE_PIECES_PER_THREAD, int(us // GEMM_QUEUE_PIECE_US)))


def cuts(outer: int, inner: int, parts: int) -> list[tuple[int, int, int, int]]:
    """(outer, inner) ranges ``(o0, o1, i0, i1)`` cutting an (outer, inner, ...) C-contiguous
    array into at most ``parts`` C-contiguous blocks: of whole outer rows (images) where there
    are enough, else of inner rows (output rows) within each outer one."""
    if outer >= parts:
        return [(o0, o1, 0, inner) for o0, o1 in blocks(outer, parts)]
    per = -(-parts // outer)
    return [(o, o + 1, i0, i1) for o in range(outer) for i0, i1 in blocks(inner, per)]


class PieceTable:
    """Descriptor rows for :func:`run_gemms` made at prepare time, but for their operands'
    addresses: ``fields`` are (field, operand, each row's offset in bytes), and a call with the
    operands (None: absent, its field left 0) gives the rows with their addresses filled in
    (~6 us; a read-only operand's address -- a plan's weights -- kept while the same array
    comes, and the whole table while all of them do: ~1 us).
    ``keep``: the arrays whose addresses ``rows`` already hold (scratch, offsets), kept alive."""

    def __init__(self, rows: np.ndarray, fields: Iterable[tuple[int, int, Sequence[int]]],
                 keep: Sequence[np.ndarray] = ()) -> None:
        self.rows, self.keep = rows, tuple(keep)
        self.fields = [(field, x, [int(v) for v in offsets]) for field, x, offsets in fields]
        self._constants: dict[int, tuple[np.ndarray, int]] = {}  # operand -> (read-only array, its address)
        self._last: tuple[tuple, np.ndarray] | None = None  # (the last call's operands, weakly; its table)

    def __len__(self) -> int:
        return len(self.rows)

    def __call__(self, *operands: np.ndarray | None) -> np.ndarray:
        # A plan passes a kernel the same arrays on every run: their table is made once (the
        # arrays are only referred to weakly, so a caller's temporaries are not kept alive).
        last = self._last
        if last is not None and all(a is None if r is None else r() is a for r, a in zip(last[0], operands)):
            return last[1]
        t = self.rows.copy()
        at = {}
        for i, a in enumerate(operands):
            if a is None:
                continue
            if a.flags.writeable:
                at[i] = address(a)
                continue
            kept = self._constants.get(i)
            if kept is None or kept[0] is not a:
                kept = self._constants[i] = (a, address(a))
            at[i] = kept[1]
        # (item by item: numpy's vectorised ops cost ~1 us each on arrays this small)
        for field, x, offsets in self.fields:
            base = at.get(x)
            if base is not None:
                for p, offset in enumerate(offsets):
                    t[p, field] = base + offset
        self._last = (tuple(None if a is None else weakref.ref(a) for a in operands), t)
        return t


def address(a: np.ndarray) -> int:
    """The address of ``a``'s first element (~0.6 us for a writable array, where numpy's
    ``ctypes.data`` costs ~2 us)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):  # read-only, or not a single segment
        return a.ctypes.data


def float_bits(x: float) -> int:
    """The bits of float32 ``x``, as the GEMM queue's descriptors hold a float."""
    return int(np.float32(x).view(np.int32))


_fn: tuple[int, int, int] | None | bool = False


def gemm_fn() -> tuple[int, int, int] | None:
    """:func:`polyhal_cpu.blas.gemm_address` for the GEMM queue, or None where the queue is off
    (no compiled loops, or no BLAS this backend can call)."""
    global _fn
    if _fn is False:
        from polyhal_cpu import blas

        _fn = blas.gemm_address() if native.gemm_queue() is not None else None
    return _fn


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
