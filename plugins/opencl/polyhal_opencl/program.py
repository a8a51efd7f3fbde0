"""Building OpenCL programs, cached in memory and on disk.

Generated kernels are specialised per shape, so the same source comes back whenever a plan for
the same shapes is compiled again, in this process or a later one. :class:`ProgramCache` keeps

* in memory, per device (one cache per :class:`~polyhal_opencl.device.CLDevice`): the built
  ``cl.Program`` by (source, options), bounded (least recently used go first);
* on disk: the program *binary* under ``<cache dir>/<sha256>.bin``, where the hash covers the
  source, the options, the device, its driver and platform versions and pyopencl's version, so
  a driver upgrade never loads a stale binary. A binary the driver rejects is deleted and the
  program rebuilt from source.

The cache directory is ``$POLYHAL_OPENCL_CACHE_DIR`` if set (empty disables the disk cache),
else ``$XDG_CACHE_HOME/polyhal/opencl``, else ``~/.cache/polyhal/opencl``. It is a
:class:`polyhal.codecache.CodeCache` (a binary may hold host code -- PoCL's are shared
libraries it loads): private to this user, each binary checked against the sha256 recorded
beside it before the driver sees it; a folder or binary it refuses is warned about once and
the program built from source. Disk errors (a read-only home, a full disk) only cost the cache,
never the build.

A build failure raises :class:`~polyhal_opencl.errors.CLBuildError` with the full build log.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyhal.codecache import CodeCache, default_folder

from polyhal_opencl.errors import CLBuildError, check, translate
from polyhal_opencl.settings import OpenCLSettings

# pyopencl is imported inside the functions that use it: without pyopencl the plugin still imports,
# lists no device and says why (plugin.enumerate_devices).

#: Built programs kept in memory per device.
MEMORY_ENTRIES = 512


def default_cache_dir() -> Path | None:
    """Where program binaries are cached (None: disk cache disabled); see the module docstring."""
    explicit = OpenCLSettings.from_env().cache_dir
    if explicit is not None:
        return Path(explicit) if explicit else None
    return default_folder("opencl")


@dataclass
class CacheStatistics:
    """How programs were obtained: built from source, or found in memory or on disk."""

    builds: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    disk_writes: int = 0
    disk_errors: int = 0


class ProgramCache:
    """Built programs for one context and device (see the module docstring)."""

    def __init__(self, context: Any, cl_device: Any, cache_dir: Path | None = None) -> None:
        import pyopencl as cl

        self.context, self.cl_device, self.cache_dir = context, cl_device, cache_dir
        self._disk = None if cache_dir is None else CodeCache(
            cache_dir, "polyhal-opencl", "POLYHAL_OPENCL_CACHE_DIR", "programs are built from source")
        self.statistics = CacheStatistics()
        self._programs: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        d = cl_device
        self._identity = "\0".join([d.name, d.version, d.driver_version, d.platform.name, d.platform.version,
                                    cl.VERSION_TEXT])

    def key(self, source: str, options: str) -> str:
        """The disk-cache key of a program: sha256 over source, options and device identity."""
        return hashlib.sha256("\0".join([source, options, self._identity]).encode()).hexdigest()

    def get(self, source: str, options: str = "") -> Any:
        """The built ``cl.Program`` for ``source`` compiled with ``options``."""
        mem_key = (source, options)
        with self._lock:
            program = self._programs.get(mem_key)
            if program is not None:
                self._programs.move_to_end(mem_key)
                self.statistics.memory_hits += 1
                return program
        program = self._load(source, options) or self._build(source, options)
        with self._lock:
            self._programs[mem_key] = program
            while len(self._programs) > MEMORY_ENTRIES:
                self._programs.popitem(last=False)
        return program

    # -- disk ------------------------------------------------------------------------------------

    def _load(self, source: str, options: str) -> Any | None:
        import pyopencl as cl

        if self._disk is None:
            return None
        name = f"{self.key(source, options)}.bin"
        if not self._disk.path(name).exists():
            return None
        found = self._disk.load(name)
        if found is None:  # refused (warned): build from source, and store over it
            self.statistics.disk_errors += 1
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", cl.CompilerWarning)
                program = cl.Program(self.context, [self.cl_device], [found[0]]).build(options, cache_dir=False)
        except Exception:  # noqa: BLE001 - a binary the driver rejects: forget it, build from source
            self.statistics.disk_errors += 1
            self._disk.remove(name)
            return None
        self.statistics.disk_hits += 1
        return program

    def _store(self, program: Any, source: str, options: str) -> None:
        import pyopencl as cl

        if self._disk is None:
            return
        try:
            (binary,) = program.get_info(cl.program_info.BINARIES)
            if binary and self._disk.ready():
                self._disk.store(f"{self.key(source, options)}.bin", bytes(binary))
                self.statistics.disk_writes += 1
        except Exception:  # noqa: BLE001 - the disk cache is an optimisation only
            self.statistics.disk_errors += 1

    # -- source builds ---------------------------------------------------------------------------

    def _build(self, source: str, options: str) -> Any:
        import pyopencl as cl

        device = self.cl_device
        with check(f"creating an OpenCL program on {device.name.strip()}"):
            program = cl.Program(self.context, source)
        try:
            with warnings.catch_warnings():
                # Build logs of successful builds are noise to a user; failures carry theirs.
                warnings.simplefilter("ignore", cl.CompilerWarning)
                program.build(options, devices=[device], cache_dir=False)
        except cl.Error as exc:
            try:
                log = program.get_build_info(device, cl.program_build_info.LOG) or ""
            except Exception:  # noqa: BLE001
                log = str(exc)
            if exc.code not in (-11, -43):  # BUILD_PROGRAM_FAILURE, INVALID_BUILD_OPTIONS
                raise translate(exc, f"building an OpenCL program on {device.name.strip()}") from exc
            raise CLBuildError(
                f"OpenCL program failed to build on {device.name.strip()} with options {options!r}; "
                f"this is a kernel generator bug, please report it with the log:\n{log.strip()}",
                log=log, options=options, source=source, device=device.name.strip()) from exc
        self.statistics.builds += 1
        self._store(program, source, options)
        return program
