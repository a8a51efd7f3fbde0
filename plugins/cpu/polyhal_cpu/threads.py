"""One thread budget for everything the CPU backend runs: numpy's BLAS, numba and its own pool.

**How many.** The budget is the number of CPUs this process may use: its affinity set
(``os.sched_getaffinity``, what ``taskset`` or a container's cpuset allows) capped by its
cgroup CPU quota (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in
v1, rounded up: a container limited to 2 CPUs on a 64-core host gets 2, where
``os.cpu_count()`` -- and OpenBLAS's own default -- say 64, and 64 spinning BLAS threads spend
the quota in a few milliseconds and are throttled for the rest of each 100 ms period). A thread
count the user already gave BLAS (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ...) caps it
too. ``POLYHAL_CPU_THREADS=N`` overrides all of this.

**One pool, never nested.** Everything polyhal runs in parallel goes through one pool
(:mod:`polyhal_cpu.parallel`): a large kernel -- a GEMM of a convolution or a matmul, a
compiled loop (depthwise convolution, im2col, epilogue, pooling), a row-wise numpy kernel -- is
cut into pieces that the calling thread and budget - 1 pool threads take from one counter. BLAS
itself is pinned to one thread (numpy's OpenBLAS through its own setter, others through
threadpoolctl) and each GEMM piece is one single-threaded sgemm; the numba loops are serial
(no ``prange``), so numba's own pool never starts on polyhal's behalf, and
``NUMBA_NUM_THREADS`` is set to the budget before polyhal imports numba (unless the user set
it), so that one started by other code stays within it too.

**Why not BLAS's threads.** A threaded OpenBLAS GEMM splits the product between its threads,
which wait on each other's progress (busy-waiting, in its ``level3_thread.c``) several times
per call, and its idle workers spin (on x86-64 a loop of no-ops, not ``sched_yield``) for
2^28 cycles, ~0.1-0.2 s, after every call. While other processes keep the budget's CPUs busy, a
worker that was descheduled holds up the whole call for scheduler slices, and the spinning ones
take cores from everyone else -- polyhal's own pool threads included: a piece handed to a pool
thread right after a BLAS call waited behind a spinning BLAS worker (median 3x slower than
unsplit, a 2-core VM). Measured on a 2-core VM with other processes running (load average ~9):
a 128 x 512 x 512 sgemm took a median of 112 ms on two BLAS threads against 0.7 ms on one.
And BLAS's threads served only the GEMMs, while the loops between them ran on one core. The
price of pieces handed out in Python: a pool thread needs the GIL to start a piece, and one that
finds it taken sleeps (~25 µs to wake on a VM), where a BLAS worker starts at once; pool threads
spin for the next run while the budget's CPUs are free (:mod:`polyhal_cpu.parallel`), which
saves the wake-up from a blocked thread but not the GIL, so kernels under ~0.2 ms run on one
core -- but for float32 GEMMs and attention, whose pieces the pool computes in compiled code
without the GIL (:func:`polyhal_cpu.parallel.run_gemms`), cut from ~15 us of work. Measured on a
2-core VM with the benchmark at real-time priority (the machine otherwise busy), median ms,
threaded BLAS before / this pool before it spun / one thread: ResNet-50 b1 57 / 61-63 / 102,
DenseNet-121 b1 55 / 62 / 84, DistilBERT 83 / 92 / 135; MobileNetV3-large b1, whose kernels are
~0.1-0.3 ms, 6.8 / 9.3-9.9 / 9.3 (the spin: see polyhal_cpu.parallel). With other processes
running, threaded BLAS took 3-8x longer (ResNet-50 b1 540-740 ms against 110-170 ms).

**Shared cores.** :meth:`Budget.adjust`, called once per plan run, looks every
:data:`SAMPLE_SECONDS` at how busy the budget's CPUs were with *other* processes' work
(``/proc/stat`` for those CPUs minus this process's own CPU time) and uses as many threads as
there are CPUs left free (at least 1): with one of two cores busy elsewhere, the pool's pieces
run one after another on the calling thread and nothing waits on a descheduled thread; when
the other work ends, the next sample restores the budget. A sample (reading the two files)
takes ~60 µs, at most five times a second; a run between samples pays a clock reading (~0.2 µs).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from polyhal_cpu.settings import MAX_THREADS, CPUSettings  # noqa: F401  (MAX_THREADS re-exported)

#: Environment variables through which a user may already have limited BLAS/OpenMP threads.
BLAS_ENVS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS")
#: Seconds between two looks at how busy the budget's CPUs are.
SAMPLE_SECONDS = 0.2


# ---------------------------------------------------------------------------- the budget's size

def cgroup_cpu_limit(proc_cgroup: str, read: Callable[[str], str | None], root: str = "/sys/fs/cgroup"
                     ) -> float | None:
    """CPUs allowed by the cgroup quota of the process whose ``/proc/<pid>/cgroup`` text is
    ``proc_cgroup`` (``None``: no quota). ``read(path)`` returns a file's text or ``None``.

    Every level from the process's own group up to the hierarchy's root is looked at (a quota
    on a parent limits its children) and the smallest quota wins; the mount's root is read too,
    for containers whose namespace shows their own group as ``/``.
    """
    limits = []
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: "0::/path"
            for d in _levels(root, path):
                text = read(f"{d}/cpu.max")
                if text:
                    quota, _, period = text.strip().partition(" ")
                    if quota != "max" and period:
                        limits.append(int(quota) / int(period))
        elif "cpu" in controllers.split(","):  # cgroup v1: "4:cpu,cpuacct:/path"
            for mount in (f"{root}/cpu", f"{root}/cpu,cpuacct", f"{root}/cpuacct,cpu"):
                for d in _levels(mount, path):
                    quota, period = read(f"{d}/cpu.cfs_quota_us"), read(f"{d}/cpu.cfs_period_us")
                    if quota and period and int(quota) > 0 and int(period) > 0:
                        limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def _levels(mount: str, path: str) -> list[str]:
    parts = [p for p in path.strip().split("/") if p]
    return [mount + "".join("/" + p for p in parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def available_cpus(affinity: Iterable[int] | None = None, quota: float | None = None) -> int:
    """How many CPUs this process may use: its affinity set capped by its cgroup quota (both
    read from this process when not given; ``quota`` rounded up, at least 1)."""
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except (AttributeError, OSError):  # not Linux
            affinity = range(os.cpu_count() or 1)
    n = max(1, len(set(affinity)))
    if quota is None:
        quota = cgroup_cpu_limit(_read("/proc/self/cgroup") or "", _read)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return n


def budget_size(environ: Mapping[str, str] | None = None, cpus: int | None = None) -> int:
    """The budget: ``POLYHAL_CPU_THREADS`` if set, else :func:`available_cpus` capped by any of
    :data:`BLAS_ENVS` that is set. A ``POLYHAL_CPU_THREADS`` that is not a positive integer is
    an error that says what to write."""
    environ = os.environ if environ is None else environ
    n = CPUSettings.from_env(environ).threads
    if n is not None:
        return min(n, MAX_THREADS)
    n = available_cpus() if cpus is None else cpus
    for name in BLAS_ENVS:
        try:
            user = int(environ.get(name, "").split(",")[0])
        except ValueError:
            continue
        if user >= 1:
            n = min(n, user)
    return max(1, min(n, MAX_THREADS))


# ------------------------------------------------------------------------ shared-core sampling

def cpu_busy_seconds(proc_stat: str, cpus: Iterable[int], tick: float) -> float:
    """Busy seconds (all but idle and iowait; steal too) since boot of ``cpus``, from
    ``/proc/stat`` text."""
    want = {f"cpu{c}" for c in cpus}
    busy = 0
    for line in proc_stat.splitlines():
        fields = line.split()
        if fields and fields[0] in want:
            ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy * tick


def free_cpus(cpus: int, others_busy: float, size: int) -> int:
    """Threads to use when other processes kept ``others_busy`` of the budget's ``cpus`` CPUs
    busy (in CPUs, averaged over the last sample): the CPUs left, rounded, between 1 and ``size``."""
    return max(1, min(size, math.floor(cpus - others_busy + 0.5)))


class Budget:
    """The CPU backend's thread budget and the threads in use now (see the module doc).

    ``size`` is the budget; ``active`` the threads polyhal's pool uses at present (``size``, or
    fewer while other processes keep the budget's CPUs busy). Made on first use by
    :func:`budget`; BLAS runs on one thread from then on.
    """

    def __init__(self, size: int, cpus: Iterable[int] | None, adaptive: bool) -> None:
        self.size = size
        self.active = size
        self._cpus = sorted(cpus) if cpus is not None else None
        self._adaptive = adaptive and size > 1 and self._cpus is not None and os.path.exists("/proc/stat")
        self._tick = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
        self._last: tuple[float, float, float] | None = None  # wall, busy, own CPU seconds
        self._next = 0.0
        self._blas = None
        self._lock = threading.Lock()
        self._pin_blas()
        if self._adaptive:  # the first sample now, so that the first run (after compiling) decides
            self._next = 0.0
            self.adjust()

    def adjust(self, now: float | None = None) -> int:
        """Re-sample at most every :data:`SAMPLE_SECONDS` and set ``active``; returns it.
        Costs a clock read when not due."""
        if not self._adaptive:
            return self.active
        now = time.monotonic() if now is None else now
        if now < self._next:
            return self.active
        with self._lock:
            self._next = now + SAMPLE_SECONDS
            stat = _read("/proc/stat")
            if stat is None:
                return self.active
            t = os.times()
            sample = (now, cpu_busy_seconds(stat, self._cpus, self._tick), t.user + t.system)
            last = self._last
            if last is not None and sample[0] - last[0] < SAMPLE_SECONDS / 4:
                return self.active  # too short a window to say anything: keep the older sample
            self._last = sample
            if last is None:
                return self.active
            others = max(0.0, (sample[1] - last[1]) - (sample[2] - last[2])) / (sample[0] - last[0])
            active = free_cpus(len(self._cpus), others, self.size)
            if active != self.active:
                self.active = active
        return self.active

    def refresh(self) -> None:
        """Find the process's BLAS libraries again and pin them all to one thread (a library
        loaded since, such as scipy's OpenBLAS, which importing numba brings, starts with a
        thread per core). A scan takes a few milliseconds: called after polyhal imports numba
        (the budget, when made, pins numpy's own BLAS, or scans where it cannot find it)."""
        self._blas = None
        self._pin_blas(scan=True)

    def _pin_blas(self, scan: bool = False) -> None:
        """Pin BLAS to one thread: numpy's own OpenBLAS, the one polyhal's kernels call, without a
        ``scan`` where it is found (:func:`polyhal_cpu.blas.limit_numpy_threads`: ~0.1 ms, where
        threadpoolctl's import and scan of every loaded library took ~3 ms of a process's first
        session); else, and on :meth:`refresh`, every BLAS threadpoolctl finds in the process."""
        if not scan and self._blas is None:
            from polyhal_cpu.blas import limit_numpy_threads

            if limit_numpy_threads(1):
                return
        try:
            if self._blas is None:
                from threadpoolctl import ThreadpoolController

                self._blas = ThreadpoolController().select(user_api="blas")
            if self._blas:
                self._blas.limit(limits=1)
        except Exception:  # noqa: BLE001 -- no threadpoolctl, or it cannot inspect this process
            self._blas = False


_budget: Budget | None = None
_budget_lock = threading.Lock()


def budget() -> Budget:
    """The process's :class:`Budget`, made (and BLAS pinned to one thread) on first call.

    ``POLYHAL_CPU_THREADS`` fixes it: with the override no sampling happens and the size is
    used as given."""
    global _budget
    if _budget is None:
        with _budget_lock:
            if _budget is None:
                fixed = CPUSettings.from_env().threads is not None
                try:
                    cpus = os.sched_getaffinity(0)
                except (AttributeError, OSError):
                    cpus = None
                _budget = Budget(budget_size(), cpus, adaptive=not fixed)
    return _budget


def reset() -> None:
    """Forget the budget (tests; a changed ``POLYHAL_CPU_THREADS``): the next :func:`budget`
    recomputes it and pins BLAS again."""
    global _budget
    with _budget_lock:
        _budget = None


def configure_numba() -> None:
    """Before polyhal imports numba: give numba's pool (which polyhal's serial loops never
    start) the budget as its size, unless the user chose one."""
    import sys

    if "numba" not in sys.modules and "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(budget().size)
