"""The loops of :mod:`polyhal_cpu.native_loops` compiled ahead of time into an extension module,
so that a process running them loads no compiler.

numba compiles in process: its first loop, even one loaded from numba's disk cache, costs the
process ~120 MB of resident memory (LLVM's code pages, the JIT engine, numba's typing tables),
more than a MobileNet's weights and activations together. So the loops are compiled once per
machine, in a child process (~15 s), by numba's ahead-of-time compiler (``numba.pycc``) with
the options the JIT uses (fastmath flags, numpy's error model, the GIL released, no bounds
checks) for this host's CPU and the features it reports, into an extension module in the cache
directory; later processes import it (~1 MB) and never import numba. Measured on a 2-core VM
(AVX-512): each loop as fast as the JIT's (depthwise conv, epilogue, pool, GELU, layer norm,
softmax on MobileNet/BERT shapes).

**Signatures.** Each loop is exported with the one signature :func:`polyhal_cpu.native._warm`
compiles it for (a read-only array typed as writable: the loops never write their inputs; a
loop warmed with several signatures stays with the JIT). The compiled code reads arrays by
their declared layout, and its argument conversion checks only the item size, so a call whose
arrays are not of the declared element type (float32; int64 for index arrays), C-contiguous and
of the declared rank goes to the JIT loop instead.

**Cache.** ``$POLYHAL_CPU_CACHE_DIR`` (empty: no ahead-of-time module, the loops are JIT compiled
in process as before), else ``$XDG_CACHE_HOME/polyhal/cpu``, else ``~/.cache/polyhal/cpu``. The
module's name carries a hash of the loops' source, numba's and Python's versions and the CPU's
model and flags. The folder is a :class:`polyhal.codecache.CodeCache`: this user's, ``0700``,
files ``0600``, whatever the umask; a folder or file of another user, or writable by others, is
refused with one warning; the module's sha256, recorded when it was built (with its loops'
signatures, ``<name>.json``), is checked before it is loaded, so a truncated, corrupt or planted
module is never mapped (it is built again). Concurrent processes build it once (a lock file,
waited on for LOCK_TIMEOUT seconds at most; then, as where the lock path is not a file, the
process runs on the JIT). Each build gets a private folder, removed afterwards, and by the next
build where the builder was killed. A failed build (no C compiler, a numba without ``pycc``) is
recorded as ``<name>.failed`` with the reason and warned about once per process; processes run on
the JIT until RETRY_AFTER seconds have passed (or that file is deleted), then try again -- or at
once where the installed packages changed since the failed build began (:func:`_environment`: a
package manager that replaced setuptools while the build ran, as the README's second command does
after a first run, breaks that build and says nothing about the next one). A folder that cannot
be written costs only the module, never the loops.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import site
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from polyhal.codecache import CodeCache, default_folder, warn_once
from polyhal.progress import long_work, say
from polyhal_cpu.settings import CPUSettings

_HERE = Path(__file__).resolve().parent
#: Seconds the child compiling the module may take (~15 s on a loaded 2-core VM).
BUILD_TIMEOUT = 900
#: Seconds a process waits for another one's build of the module (~15-100 s) before it runs on the JIT.
LOCK_TIMEOUT = 180
#: Seconds after a failed build before a process tries again (a C compiler installed since).
RETRY_AFTER = 3600
#: What a process does without the module (the end of every warning about it).
FALLBACK = "the CPU runs on numba's JIT (~3x the resident memory)"
#: The files whose text decides the compiled code (the loops, their signatures, these options).
_SOURCES = ("native_loops.py", "native.py", "queue_layout.py", "rational_erf.py", "native_aot.py")


def cache_dir() -> Path | None:
    """Where the module is kept (None: ahead-of-time compilation off); see the module docstring."""
    raw = CPUSettings.from_env().cache_dir
    if raw is not None:
        return Path(raw) if raw else None
    return default_folder("cpu")


def module_name() -> str:
    """The extension module's name: ``polyhal_cpu_loops_<hash>`` over everything that decides its code."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    for name in _SOURCES:
        digest.update((_HERE / name).read_bytes())
    try:
        numba_version = version("numba")
    except PackageNotFoundError:
        numba_version = "none"
    digest.update(f"{numba_version} {sys.version} {platform.machine()} {_cpu_identity()}".encode())
    return "polyhal_cpu_loops_" + digest.hexdigest()[:16]


def _cpu_identity() -> str:
    """The CPU's model and feature flags (the module is compiled for this host's CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in keep))


class CompiledLoops(dict):
    """name -> callable: the ahead-of-time loops (each behind its argument check), and on first
    use a JIT loop for any name the module lacks."""

    def __init__(self, loops: dict[str, Callable], jit: Callable[[str], Callable], path: Path) -> None:
        super().__init__(loops)
        self._jit = jit
        #: The extension module the loops come from.
        self.path = path

    def __missing__(self, name: str) -> Callable:
        loop = self[name] = self._jit(name)
        return loop


class Pending:
    """The module being built by another process -- the one this process started in the
    background (``builder``), or one found building -- so not loaded by this one."""

    def __init__(self, cache: CodeCache, name: str, builder: subprocess.Popen | None = None) -> None:
        self.cache, self.name, self.builder = cache, name, builder


def load(jit: Callable[[str], Callable], wait: bool | None = None) -> CompiledLoops | Pending | None:
    """The ahead-of-time loops; None where they are off or cannot be had (then the caller JIT
    compiles); :class:`Pending` while this machine's first build runs in the background (then the
    caller runs without them, on library kernels, for the rest of the process). ``jit(name)`` gives the JIT loop ``name``: it
    serves calls the compiled signature does not fit and loops the module lacks.

    Where the module is not built yet, ``wait`` (default ``POLYHAL_CPU_AOT_WAIT``) builds it
    here and now (~1-4 minutes on 2 cores); otherwise a background process builds it, at low
    priority, and this call returns at once (see "Tiers" in :mod:`polyhal_cpu.native`)."""
    folder = cache_dir()
    if folder is None:
        return None
    cache = CodeCache(folder, "polyhal-cpu", "POLYHAL_CPU_CACHE_DIR", FALLBACK)
    if not cache.ready():
        return None
    name = module_name()
    specs = _verified(cache, name)
    if specs is None:
        if wait is None:
            wait = CPUSettings.from_env().aot_wait
        if not wait:
            return _in_background(cache, name)
        specs = _build_once(cache, name)
    if specs is None:
        return None
    path = cache.path(f"{name}.so")
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError) as exc:
        _report_failure(cache, name, f"loading {path}: {exc}", record=True)
        cache.remove(f"{name}.so")
        return None
    loops = {loop: _checked(loop, getattr(module, loop), arg_specs, jit)
             for loop, arg_specs in specs.items() if hasattr(module, loop)}  # a loop it lacks: the JIT's
    return CompiledLoops(loops, jit, path)


def _verified(cache: CodeCache, name: str) -> dict[str, list] | None:
    """The module's loops and their argument specs if the module is there, trusted and as built
    (see :meth:`polyhal.codecache.CodeCache.verify`), and its record well formed; else None."""
    meta = cache.verify(f"{name}.so")
    if meta is None:
        return None
    loops = meta.get("loops")
    if not (isinstance(loops, dict) and all(isinstance(k, str) and _valid_specs(v) for k, v in loops.items())):
        warn_once(f"polyhal-cpu: cached {cache.path(name + '.json')} refused: its loops are not "
                  "{name: [[rank, dtype] or null, ...]}; compiling it again")
        return None
    return loops


def _valid_specs(specs) -> bool:
    """Whether ``specs`` is a loop's argument list as build() records it: [rank, element type]
    of an array, None for a scalar."""
    if not isinstance(specs, list):
        return False
    for spec in specs:
        if spec is None:
            continue
        if not (isinstance(spec, list) and len(spec) == 2 and type(spec[0]) is int and isinstance(spec[1], str)):
            return False
        try:
            np.dtype(spec[1])
        except TypeError:
            return False
    return True


def _checked(name: str, compiled: Callable, specs: list[list | None], jit: Callable[[str], Callable]) -> Callable:
    """``compiled`` behind a check of its array arguments (C-contiguous, of the declared rank
    and element type: float32, or int64 for index arrays); a call that fails it runs the JIT loop."""
    arrays = tuple((i, spec[0], np.dtype(spec[1])) for i, spec in enumerate(specs) if spec is not None)

    def loop(*args):
        for i, ndim, dtype in arrays:
            a = args[i]
            if (a.dtype is not dtype and a.dtype != dtype) or a.ndim != ndim or not a.flags.c_contiguous:
                return jit(name)(*args)
        return compiled(*args)

    loop.__name__ = loop.__qualname__ = name
    return loop


def _build_once(cache: CodeCache, name: str) -> dict[str, list] | None:
    """Build the module in a child process, once across concurrent processes; its loops' specs
    (:func:`_verified`), or None where it cannot be had (warned once)."""
    with cache.lock(f"{name}.lock", LOCK_TIMEOUT) as held:
        if not held:
            return None
        specs = _verified(cache, name)
        if specs is not None:
            return specs  # another process built it while this one waited
        failure = _recent_failure(cache, name)
        if failure is not None:
            _report_failure(cache, name, failure, record=False)
            return None
        cache.remove(f"{name}.so")  # a refused one: never left to be found again
        environment = _environment()  # as the build begins: a change during it voids a failure
        with cache.build_folder(name) as folder, long_work(
                "compiling the CPU backend's loops once for this machine (about a minute)",
                "compiled the CPU backend's loops") as work:
            why = _compile(folder, name)
            if why is not None:
                work.done = "the CPU backend's loops failed to compile (see the warning)"
            if why is None:
                cache.store(f"{name}.so", next(folder.glob(f"{name}*.so")), {"loops": _exported(folder)})
        if why is not None:
            _report_failure(cache, name, why, record=True, environment=environment)
            return None
        cache.path(f"{name}.failed").unlink(missing_ok=True)
        return _verified(cache, name)


def _recent_failure(cache: CodeCache, name: str) -> str | None:
    """Why the last build failed, if it failed less than RETRY_AFTER seconds ago in the same
    environment (the installed packages unchanged since it began); else None."""
    failure = cache.read_record(f"{name}.failed")
    if (failure is not None and isinstance(failure.get("reason"), str)
            and isinstance(failure.get("at"), (int, float)) and time.time() - failure["at"] < RETRY_AFTER
            and failure.get("environment") in (None, _environment())):  # (records before it had none)
        return failure["reason"]
    return None


def _environment() -> str:
    """A fingerprint of the installed packages: the modification times of the site-packages
    folders (installing, upgrading or removing a distribution adds or removes entries there)."""
    folders = [*site.getsitepackages(), site.getusersitepackages()] if hasattr(site, "getsitepackages") else sys.path
    stamps = []
    for folder in folders:
        try:
            stamps.append(f"{folder}:{os.stat(folder).st_mtime_ns}")
        except OSError:
            continue
    return hashlib.sha256("\n".join(stamps).encode()).hexdigest()[:16]


#: Added to the background builder's nice value: the build takes idle cycles, not the user's run.
BUILD_NICENESS = 10


def _in_background(cache: CodeCache, name: str) -> Pending | None:
    """Start the module's build in a background process, unless one is under way (then that one
    is waited for) or the last one failed lately (warned: None, the caller JIT compiles)."""
    failure = _recent_failure(cache, name)
    if failure is not None:
        _report_failure(cache, name, failure, record=False)
        return None
    if cache.building(f"{name}.lock"):
        return Pending(cache, name)
    try:
        # A session of its own: the build outlives this process (a first `polyhal run` ends in
        # seconds) and a Ctrl-C at the terminal does not reach it. Its outcome is in the cache
        # (the module, or <name>.failed with the reason); its output goes nowhere.
        builder = subprocess.Popen([sys.executable, "-m", "polyhal_cpu.native_aot", "build"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True, close_fds=True,
                                   env={**os.environ, "POLYHAL_CPU_CACHE_DIR": str(cache.folder),
                                        "POLYHAL_PROGRESS": "0"})
    except OSError as exc:
        _report_failure(cache, name, f"starting the build: {exc}", record=True)
        return None
    say("building the CPU backend's compiled loops in the background, once for this machine (about a minute); "
        "until then the CPU runs on its library kernels (numpy, BLAS, oneDNN)")
    return Pending(cache, name, builder)


def _build_in_background() -> int:
    """The background builder's work (``python -m polyhal_cpu.native_aot build``): the module
    built once, at low priority; 0 where it is there afterwards."""
    try:
        os.nice(BUILD_NICENESS)
    except OSError:
        pass
    folder = cache_dir()
    if folder is None:
        return 1
    cache = CodeCache(folder, "polyhal-cpu", "POLYHAL_CPU_CACHE_DIR", FALLBACK)
    if not cache.ready():
        return 1
    name = module_name()
    return 0 if (_verified(cache, name) or _build_once(cache, name)) is not None else 1


def _compile(folder: Path, name: str) -> str | None:
    """Run the child that compiles the module into ``folder``; why it failed, or None."""
    try:
        # native's entry point runs build() with native._warm (this module imports no native).
        # TMPDIR: pycc's and the C compiler's own temporary files go in the build folder too.
        proc = subprocess.run([sys.executable, "-m", "polyhal_cpu.native", "build", str(folder), name],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                              env={**os.environ, "TMPDIR": str(folder)})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    if proc.returncode != 0:
        # The exception's line (what failed), else the last line the child wrote.
        return next((line for line in reversed(lines) if "Error" in line.split(":")[0]),
                    lines[-1] if lines else f"exit status {proc.returncode}")
    if not (list(folder.glob(f"{name}*.so")) and isinstance(_exported(folder), dict)):
        return "the build left no module and loops.json"
    return None


def _exported(folder: Path) -> dict | None:
    """The loops.json the child wrote beside the module (None if it is missing or not JSON)."""
    try:
        return json.loads((folder / "loops.json").read_text())
    except (OSError, ValueError):
        return None


#: Advice for a failed build, by a word of its reason.
_FIXES = (("unable to load module", "reinstall setuptools (numba.pycc compiles through its distutils)"),
          ("compiler", "install a C compiler (gcc or clang) or set CC to one"),
          ("pycc", "install a numba that ships numba.pycc"))


def _report_failure(cache: CodeCache, name: str, why: str, record: bool, environment: str | None = None) -> None:
    """Warn once that the module cannot be had and why; ``record``: keep the reason in
    ``<name>.failed`` for later processes (which then skip building until RETRY_AFTER, unless
    the packages differ from ``environment``, the build's)."""
    failed = cache.path(f"{name}.failed")
    if record:
        try:
            cache.write_record(failed.name, {"reason": why, "at": time.time(),
                                             "environment": environment or _environment()})
        except OSError:
            pass
    fix = next((advice for word, advice in _FIXES if word in why.lower()), "see the reason")
    warn_once(f"polyhal-cpu: the compiled loops cannot be had ({why}); {FALLBACK}; to fix: {fix}; a build is "
              f"tried again {RETRY_AFTER // 60} minutes after it failed (at once if {failed} is deleted or "
              "packages are installed)")


def build(folder: Path, name: str, warm: Callable[[dict[str, Callable]], None]) -> None:
    """Compile the loops into ``folder/<name>*.so`` with ``folder/loops.json`` (each exported loop's
    arguments: [rank, element type] of an array, None for a scalar); ``warm(loops)`` calls each JIT
    loop with the argument types kernels pass, which gives the signatures. Runs in a child process
    (it imports numba), in a build folder of the cache that the parent moves the module from."""
    import warnings

    import numba.pycc.compiler as pycc_compiler
    from numba import typeof, types
    from numba.core import codegen
    from numba.core.compiler import Flags
    from numba.pycc import CC

    from polyhal_cpu import native_loops

    loops = {loop: getattr(native_loops, loop) for loop in native_loops.__all__}
    # The signatures are those the warm-up calls each loop with, as recorded here: a dispatcher
    # also gains the ones it is compiled for as a callee of another loop (conv_piece calls
    # gemm_tiles with the arrays it makes from a descriptor), which, with numba's disk cache cold
    # (a fresh machine), left such a loop to the JIT -- and any process calling it loaded numba
    # (~120-300 MB resident).
    called: dict[str, set] = {loop: set() for loop in loops}

    def recording(loop: str, dispatcher: Callable) -> Callable:
        def call(*args):
            called[loop].add(tuple(_writable(typeof(a)) for a in args))
            return dispatcher(*args)
        return call

    warm({loop: recording(loop, dispatcher) for loop, dispatcher in loops.items()})
    exported = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pycc's pending deprecation
        cc = CC(name, source_module=native_loops)
    cc.output_dir, cc.target_cpu = str(folder), "host"
    options = dict(loops["relu"].targetoptions)
    descriptor = loops["relu"].targetdescr
    for loop, dispatcher in loops.items():
        if dict(dispatcher.targetoptions) != options:
            continue  # compiled with other options: left to the JIT
        if len(called[loop]) != 1:
            continue  # warmed with several (or no) signatures: left to the JIT
        (args,) = called[loop]
        result = next(sig.return_type for sig in dispatcher.nopython_signatures
                      if tuple(_writable(t) for t in sig.args) == args)
        cc.export(loop, result(*args))(dispatcher.py_func)
        exported[loop] = [[t.ndim, str(t.dtype)] if isinstance(t, types.Array) else None for t in args]

    def jit_flags() -> Flags:
        # pycc compiles with default flags; these are the JIT's (fastmath, nogil, ...).
        flags = Flags()
        descriptor.options.parse_as_flags(flags, options)
        return flags

    pycc_compiler.Flags = jit_flags
    # pycc's "host" names the CPU model only, whose features LLVM assumes; a VM may hide some
    # (AVX-512 on an AVX-512 model): take the features this host reports, as the JIT does.
    codegen.AOTCPUCodegen._customize_tm_features = lambda self: codegen.get_host_cpu_features()
    cc.compile()
    (folder / "loops.json").write_text(json.dumps(exported))


def _writable(t):
    from numba import types

    return t.copy(readonly=False) if isinstance(t, types.Array) else t


if __name__ == "__main__":  # the background builder started by _in_background
    if sys.argv[1:] != ["build"]:
        sys.exit("usage: python -m polyhal_cpu.native_aot build  (started by polyhal-cpu itself)")
    sys.exit(_build_in_background())
