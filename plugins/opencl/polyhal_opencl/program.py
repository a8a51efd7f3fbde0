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
else ``$XDG_CACHE_HOME/polyhal/opencl``, else ``~/.cache/polyhal/opencl``. Disk errors (a
read-only home, a full disk) only cost the cache, never the build.

A build failure raises :class:`~polyhal_opencl.errors.CLBuildError` with the full build log.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyhal_opencl.errors import CLBuildError, check, translate

# pyopencl is imported inside the functions that use it: without pyopencl the plugin still imports,
# lists no device and says why (plugin.enumerate_devices).

#: Built programs kept in memory per device.
MEMORY_ENTRIES = 512


def default_cache_dir() -> Path | None:
    """Where program binaries are cached (None: disk cache disabled); see the module docstring."""
    explicit = os.environ.get("POLYHAL_OPENCL_CACHE_DIR")
    if explicit is not None:
        return Path(explicit) if explicit.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "polyhal" / "opencl"


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

    def _path(self, source: str, options: str) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"{self.key(source, options)}.bin"

    def _load(self, source: str, options: str) -> Any | None:
        import pyopencl as cl

        path = self._path(source, options)
        if path is None or not path.is_file():
            return None
        try:
            binary = path.read_bytes()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", cl.CompilerWarning)
                program = cl.Program(self.context, [self.cl_device], [binary]).build(options, cache_dir=False)
        except Exception:  # noqa: BLE001 - a corrupt or foreign binary: forget it, build from source
            self.statistics.disk_errors += 1
            path.unlink(missing_ok=True)
            return None
        self.statistics.disk_hits += 1
        return program

    def _store(self, program: Any, source: str, options: str) -> None:
        import pyopencl as cl

        path = self._path(source, options)
        if path is None:
            return
        try:
            (binary,) = program.get_info(cl.program_info.BINARIES)
            if not binary:
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename, so a concurrent reader never sees half a binary.
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(binary)
            os.replace(tmp, path)
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
