"""Kernels compiled at run time with hiprtc, for the device's own architecture, and cached.

Sources: polyhal-hip's own (``polyhal_hip/hip/*.hip``) and polyhal-gpu's CUDA C
(``polyhal_gpu/cu/*.cu``: sort, NMS, row-wise softmax / layer norm), which compile unchanged
on HIP behind ``hip/compat.h`` (CUDA's 32-thread warp intrinsics as width-32 HIP shuffles).
Every source is ``compat.h`` + polyhal-gpu's ``common.cuh`` + the file, as one string: hiprtc
gets no include path.

Where: hiprtc runs in a child process by default (``POLYHAL_HIP_COMPILE=process``; one worker
per process, started on the first compile, kept for the next): the comgr library under hiprtc
carries its own LLVM, which aborts the process when another LLVM is already loaded -- PoCL's,
for one, as soon as polyhal's OpenCL backend has run -- and ROCm 5.x's hiprtc aborts for an
architecture it does not know. A child that dies becomes a :class:`HipCompileError` saying how,
and the next compile starts a new one. ``POLYHAL_HIP_COMPILE=inprocess`` compiles in this
process (no worker; for a process that loads no other LLVM).

Cache: a compile is keyed by (source text, options, architecture, runtime version, name
expressions) -- in memory for the process, and on disk under ``POLYHAL_HIP_CACHE_DIR``
(default ``~/.cache/polyhal/hip``; ``off`` disables it), so a later process loads the code
object instead of compiling again. The folder is a :class:`polyhal.codecache.CodeCache`: private
to this user, each code object checked against the sha256 recorded beside it before it is
loaded; a folder or file it refuses is warned about once and the kernel compiled again. A failed compile raises
:class:`~polyhal_hip.errors.HipCompileError` carrying the compiler log, and is not cached.

:func:`compile_isolated` runs one compile in a child process: hiprtc of some ROCm versions
aborts the whole process for an architecture it does not know (ROCm 5.2 and gfx942), so tests
and ``python -m polyhal_hip.selftest`` compile foreign architectures that way.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from polyhal.codecache import CodeCache, default_folder

from polyhal_hip.errors import HipCompileError
from polyhal_hip.runtime import CompileResult, Runtime
from polyhal_hip.settings import HIPSettings

if TYPE_CHECKING:
    pass

#: Options of every compile besides the architecture.
BASE_OPTIONS = ("-O3", "-std=c++17")
#: Sources of polyhal-gpu that HIP compiles unchanged.
CUDA_SOURCES = ("rowwise.cu", "sort.cu", "nms.cu")
#: polyhal-hip's own sources.
HIP_SOURCES = ("elementwise.hip", "reduce.hip", "matmul.hip")


@functools.lru_cache(maxsize=None)
def _read(package: str, folder: str, name: str) -> str:
    return (resources.files(package) / folder / name).read_text()


def source(name: str) -> str:
    """The full text hiprtc compiles for source ``name`` (a ``.cu`` of polyhal-gpu or a ``.hip``
    of this package; ``name`` may also be generated text, given through :func:`wrap`)."""
    if name.endswith(".cu"):
        return wrap(_read("polyhal_gpu", "cu", name))
    return wrap(_read("polyhal_hip", "hip", name))


def wrap(body: str) -> str:
    """``compat.h`` + polyhal-gpu's ``common.cuh`` + ``body``."""
    return _read("polyhal_hip", "hip", "compat.h") + "\n" + _read("polyhal_gpu", "cu", "common.cuh") + "\n" + body


def options_for(arch: str, extra: Sequence[str] = ()) -> tuple[str, ...]:
    """hiprtc options for ``arch`` (a gcnArchName such as ``gfx90a:sramecc+:xnack-``)."""
    return (f"--offload-arch={arch}", *BASE_OPTIONS, *extra)


def cache_dir() -> Path | None:
    """``POLYHAL_HIP_CACHE_DIR`` (``off``: no disk cache)."""
    raw = HIPSettings.from_env().cache_dir
    if raw.lower() in ("off", "0", "none"):
        return None
    if raw:
        return Path(raw)
    return default_folder("hip")


def cache_key(text: str, options: Sequence[str], arch: str, runtime_version: int,
              expressions: Sequence[str] = ()) -> str:
    """The cache key of one compile: its source, options, architecture, runtime version and
    name expressions."""
    h = hashlib.sha256()
    for part in (text, "\0".join(options), arch, str(runtime_version), "\0".join(expressions)):
        h.update(part.encode())
        h.update(b"\1")
    return h.hexdigest()


class Compiler:
    """hiprtc with a memory and disk cache (one per runtime). ``compiles`` counts real compiles."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._memory: dict[str, CompileResult] = {}
        self._lock = threading.Lock()
        self.compiles = 0
        self._version: int | None = None

    @property
    def runtime_version(self) -> int:
        if self._version is None:
            self._version = int(self.runtime.runtime_version())
        return self._version

    def compile(self, text: str, name: str, arch: str, expressions: Sequence[str] = (),
                extra_options: Sequence[str] = ()) -> CompileResult:
        """The code object of ``text`` for ``arch`` (cached); HipCompileError with the log."""
        options = options_for(arch, extra_options)
        key = cache_key(text, options, arch, self.runtime_version, expressions)
        hit = self._memory.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._memory.get(key) or self._load(key)
            if hit is None:
                self.compiles += 1
                hit = self._backend().compile(text, name, options, expressions)
                self._store(key, hit)
            self._memory[key] = hit
            return hit

    def _backend(self):
        """Who compiles: the worker process for the real runtime (unless
        ``POLYHAL_HIP_COMPILE=inprocess``); a stand-in runtime compiles as it likes."""
        from polyhal_hip.runtime import HipPythonRuntime

        if isinstance(self.runtime, HipPythonRuntime) and compile_mode() == "process":
            return worker()
        return self.runtime

    @staticmethod
    def _disk() -> CodeCache | None:
        folder = cache_dir()
        return None if folder is None else CodeCache(folder, "polyhal-hip", "POLYHAL_HIP_CACHE_DIR",
                                                      "kernels are compiled again")

    def _load(self, key: str) -> CompileResult | None:
        disk = self._disk()
        found = None if disk is None else disk.load(f"{key}.co")
        if found is None:
            return None
        code, meta = found
        lowered, log = meta.get("lowered", {}), meta.get("log", "")
        if not (isinstance(lowered, dict) and all(isinstance(v, str) for v in lowered.values())
                and isinstance(log, str)):
            return None  # a record of another shape: compile again (and store over it)
        return CompileResult(code, lowered, log)

    def _store(self, key: str, result: CompileResult) -> None:
        disk = self._disk()
        if disk is None or not disk.ready():
            return
        try:
            disk.store(f"{key}.co", bytes(result.code), {"lowered": result.lowered, "log": result.log})
        except OSError:
            pass  # the disk cache is an optimisation only


_compilers: dict[int, Compiler] = {}


def compiler_for(runtime: Runtime) -> Compiler:
    """The compiler (and its cache) of ``runtime``."""
    c = _compilers.get(id(runtime))
    if c is None or c.runtime is not runtime:
        c = _compilers[id(runtime)] = Compiler(runtime)
    return c


# -- the compile worker ------------------------------------------------------------------------------

def compile_mode() -> str:
    """``POLYHAL_HIP_COMPILE``: ``process`` (default: a worker process) or ``inprocess``."""
    return HIPSettings.from_env().compile


class CompileWorker:
    """A child process that compiles with hiprtc, one request at a time (JSON lines over pipes).
    Has the runtime facade's ``compile`` signature."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._stderr: Any = None
        self._lock = threading.Lock()
        self.started = 0

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            import tempfile

            self._stderr = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen([sys.executable, "-m", "polyhal_hip.compiler", "--serve"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                          text=True, bufsize=1)
            self.started += 1
        return self._proc

    def compile(self, source: str, name: str, options: Sequence[str], expressions: Sequence[str] = ()) -> CompileResult:
        import base64

        arch = next((o.split("=", 1)[1] for o in options if o.startswith("--offload-arch=")), "")
        with self._lock:
            proc = self._ensure()
            line = ""
            try:
                proc.stdin.write(json.dumps({"text": source, "name": name, "options": list(options),
                                             "expressions": list(expressions)}) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                code = proc.wait()
                self._stderr.seek(0)
                err = self._stderr.read()[-2000:]
                self._proc = None
                how = f"signal {-code}" if code < 0 else f"exit status {code}"
                raise HipCompileError(
                    f"the hiprtc worker died ({how}) compiling {name} for {arch or 'the default architecture'}: the "
                    f"compiler may not know the architecture, or another LLVM in the process clashed. stderr:\n{err}",
                    log=err, arch=arch)
        reply = json.loads(line)
        if not reply.get("ok"):
            raise HipCompileError(reply.get("message", "compile failed"), log=reply.get("log", ""), arch=arch)
        return CompileResult(base64.b64decode(reply["code"]), reply.get("lowered", {}), reply.get("log", ""))

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - at exit
                proc.kill()


_worker: CompileWorker | None = None
_worker_lock = threading.Lock()


def worker() -> CompileWorker:
    """The process-wide compile worker (started on its first compile, closed at exit)."""
    global _worker
    if _worker is None:
        with _worker_lock:
            if _worker is None:
                import atexit

                _worker = CompileWorker()
                atexit.register(_worker.close)
    return _worker


def _serve() -> int:
    """The worker's loop: one JSON request per line in, one JSON reply per line out."""
    import base64

    from polyhal_hip.runtime import HipPythonRuntime

    rt = None
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            rt = rt or HipPythonRuntime()
            result = rt.compile(req["text"], req["name"], req["options"], req["expressions"])
            reply = {"ok": True, "code": base64.b64encode(result.code).decode(), "lowered": result.lowered,
                     "log": result.log}
        except HipCompileError as exc:
            reply = {"ok": False, "message": str(exc), "log": exc.log}
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            reply = {"ok": False, "message": f"{type(exc).__name__}: {exc}", "log": ""}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


# -- isolated compiles ------------------------------------------------------------------------------

def compile_isolated(text: str, name: str, arch: str, expressions: Sequence[str] = (),
                     timeout: float = 300) -> CompileResult:
    """Compile in a child process with the real runtime (no cache): a compiler that aborts for
    an unknown architecture raises HipCompileError instead of taking this process down."""
    result = compile_many_isolated([(text, name, tuple(expressions))], arch, timeout)[0]
    if isinstance(result, Exception):
        raise result
    return result


def compile_many_isolated(jobs: Sequence[tuple[str, str, Sequence[str]]], arch: str,
                          timeout: float = 600) -> list[CompileResult | HipCompileError]:
    """Compile several ``(text, name, expressions)`` for ``arch`` in one child process; each
    result is a CompileResult or the HipCompileError of that job. If the compiler aborts the
    child, every job not finished yet gets the abort's HipCompileError."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="polyhal-hip-") as tmp:
        request = {"arch": arch, "jobs": [{"text": t, "name": n, "expressions": list(e), "out": str(Path(tmp) / f"{i}.co")}
                                          for i, (t, n, e) in enumerate(jobs)]}
        proc = subprocess.run([sys.executable, "-m", "polyhal_hip.compiler"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout)
        replies = []
        for line in proc.stdout.splitlines():
            try:
                replies.append(json.loads(line))
            except ValueError:
                continue
        out: list[CompileResult | HipCompileError] = []
        for i, (_text, name, _e) in enumerate(jobs):
            if i < len(replies):
                reply = replies[i]
                if reply.get("ok"):
                    out.append(CompileResult(Path(request["jobs"][i]["out"]).read_bytes(), reply.get("lowered", {}),
                                             reply.get("log", "")))
                else:
                    out.append(HipCompileError(reply.get("message", "compile failed"), log=reply.get("log", ""),
                                               arch=arch))
                continue
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
            out.append(HipCompileError(
                f"hiprtc aborted ({how}) compiling {name} for {arch}: this ROCm runtime's compiler probably does not "
                f"know the architecture. stderr:\n{proc.stderr.strip()[-2000:]}", log=proc.stderr, arch=arch))
        return out


def _main() -> int:
    request = json.loads(sys.stdin.read())
    from polyhal_hip.runtime import HipPythonRuntime

    rt = None
    for job in request["jobs"]:
        try:
            rt = rt or HipPythonRuntime()
            result = rt.compile(job["text"], job["name"], options_for(request["arch"]), job["expressions"])
        except HipCompileError as exc:
            print(json.dumps({"ok": False, "message": str(exc), "log": exc.log}), flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            print(json.dumps({"ok": False, "message": f"{type(exc).__name__}: {exc}", "log": ""}), flush=True)
            continue
        Path(job["out"]).write_bytes(result.code)
        print(json.dumps({"ok": True, "lowered": result.lowered, "log": result.log}), flush=True)
    return 0


#: e_machine of AMD GPU code objects (ELF), and the clang offload bundle magic.
EM_AMDGPU = 0xE0
OFFLOAD_BUNDLE_MAGIC = b"__CLANG_OFFLOAD_BUNDLE__"


#: ELF e_flags machine numbers of some AMD GPUs (EF_AMDGPU_MACH_AMDGCN_*).
AMDGPU_MACH = {"gfx900": 0x2C, "gfx906": 0x2F, "gfx908": 0x30, "gfx90a": 0x3F, "gfx1030": 0x36, "gfx1100": 0x41,
               "gfx940": 0x40, "gfx942": 0x4C}


def code_object_arch(code: bytes) -> str | None:
    """The architecture an AMDGPU ELF code object is for (from its e_flags), if known."""
    if len(code) < 52 or code[:4] != b"\x7fELF":
        return None
    mach = int.from_bytes(code[48:52], "little") & 0xFF
    return next((a for a, m in AMDGPU_MACH.items() if m == mach), None)


def is_code_object(code: bytes) -> bool:
    """True for an AMDGPU ELF code object (or a clang offload bundle of them)."""
    if code.startswith(OFFLOAD_BUNDLE_MAGIC):
        return True
    return len(code) > 20 and code[:4] == b"\x7fELF" and int.from_bytes(code[18:20], "little") == EM_AMDGPU


if __name__ == "__main__":
    sys.exit(_serve() if sys.argv[1:] == ["--serve"] else _main())
