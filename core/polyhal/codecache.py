"""Private on-disk caches of compiled code, which trust nothing they did not make.

Backends keep the code they compile on disk so that a later process loads it instead of
compiling again: the CPU backend its loops' extension module, OpenCL its program binaries, HIP
its code objects. Loading code runs it, so a :class:`CodeCache` hands out an entry only if

* its folder belongs to this user and nobody else may write it: each folder the cache creates
  is made ``0700`` whatever the umask, and a folder owned by another user or writable by its
  group or by all is refused;
* the entry is a regular file (not a link, a FIFO, a folder) of this user that nobody else may
  write (entries are written ``0600``), and so is its record (``a.so``'s is ``a.json``);
* the entry's sha256, recorded when it was stored, matches its content, checked before a byte
  of it is used: a truncated or corrupt file (or one planted under an entry's name) is found
  before it is read into a program or mapped by the loader.

A refusal is one :class:`CacheWarning` line, once per process, saying what was refused, why,
and what happens instead; the entry is then treated as absent (compiled again), the folder as no
cache at all. Every file is written to a temporary name and renamed, so a reader never sees half
of one. :meth:`CodeCache.lock` serialises builds across processes with a deadline, and
:meth:`CodeCache.build_folder` gives a build a private folder that is removed afterwards -- and,
where the builder was killed, by the next build.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: builds are not serialised (entries still move in by renames)
    fcntl = None

__all__ = ["CacheWarning", "CodeCache", "default_folder"]

#: Bytes a record (a JSON file read_record reads) may have; larger ones are refused unread.
RECORD_LIMIT = 1 << 20
#: Seconds between attempts to take a held lock.
LOCK_POLL = 0.1
#: Bits that let someone other than the owner change a file or a folder's entries.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: Never follow a link, never wait on a FIFO, never leak into a child.
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)

_warned: set[str] = set()


class CacheWarning(RuntimeWarning):
    """A cache folder, entry or lock refused, or a cached build that cannot be had."""


def warn_once(message: str) -> None:
    """Warn ``message`` (a :class:`CacheWarning`) unless this process already did."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, CacheWarning, stacklevel=3)


def default_folder(backend: str) -> Path:
    """``$XDG_CACHE_HOME/polyhal/<backend>``, else ``~/.cache/polyhal/<backend>``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "polyhal" / backend


def _distrust(st: os.stat_result, regular: bool) -> str | None:
    """Why a file (``regular``) or folder with status ``st`` is not to be trusted; None: it is."""
    if regular and not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    uid = os.geteuid() if hasattr(os, "geteuid") else st.st_uid  # Windows: no owners to compare
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & _OTHERS_WRITE:
        who = "group- and world" if st.st_mode & _OTHERS_WRITE == _OTHERS_WRITE else (
            "group" if st.st_mode & stat.S_IWGRP else "world")
        return f"{who}-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class CodeCache:
    """A folder of compiled code for one backend (see the module docstring).

    ``label`` starts every warning (``polyhal-cpu``); ``variable`` is the environment variable
    that moves the folder (named in the warnings' advice); ``fallback`` says what a process does
    without the cache (``the CPU runs on numba's JIT``)."""

    def __init__(self, folder: Path, label: str, variable: str, fallback: str) -> None:
        self.folder = Path(folder)
        self.label, self.variable, self.fallback = label, variable, fallback

    # -- the folder ------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether the folder can be used: made (``0700``, each missing parent too) where it is
        missing, and this user's, writable by nobody else. Warns once where it is refused."""
        try:
            self._make(self.folder.absolute())
            st = os.stat(self.folder)  # through a link: ~/.cache may lie on another disk
            why = _distrust(st, regular=False) if stat.S_ISDIR(st.st_mode) else "not a folder"
        except OSError as exc:
            why = f"cannot be made or read ({exc.strerror or exc})"
        if why is not None:
            warn_once(f"{self.label}: cache folder {self.folder} refused: {why}; {self.fallback} (make it "
                      f"yours with mode 700, or set {self.variable} to a private folder)")
        return why is None

    @staticmethod
    def _make(folder: Path) -> None:
        missing = []
        while not os.path.lexists(folder) and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        for made in reversed(missing):
            try:
                os.mkdir(made, 0o700)
            except FileExistsError:
                continue  # another process made it: ready() checks it like any found folder
            os.chmod(made, 0o700)  # a umask such as 0o777 takes bits mkdir's mode asked for

    # -- entries ---------------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        """Where entry ``name`` lies (for a loader that maps it; :meth:`verify` it first)."""
        return self.folder / name

    def verify(self, name: str) -> dict | None:
        """The metadata stored with entry ``name`` if the entry is there, trusted and unchanged
        since it was stored (its sha256 checked); None otherwise (warned once where it was
        there but refused)."""
        found = self._read(name, keep=False)
        return None if found is None else found[1]

    def load(self, name: str) -> tuple[bytes, dict] | None:
        """Entry ``name``'s content and metadata, as :meth:`verify` checks them; None otherwise."""
        return self._read(name, keep=True)

    def store(self, name: str, content: bytes | Path, meta: dict | None = None) -> None:
        """Keep ``content`` as entry ``name``, with ``meta`` (JSON) and its sha256 in its record.
        A :class:`~pathlib.Path` is a file built in one of this cache's :meth:`build_folder`\\ s,
        moved in. Raises OSError where the disk refuses (a cache is an optimisation: callers
        usually ignore it)."""
        if isinstance(content, Path):
            os.chmod(content, 0o600)  # as the compiler left it: 0755 less the umask
            digest, size = _sha256(content)
        else:
            digest, size = hashlib.sha256(content).hexdigest(), len(content)
        self.write_record(_record(name), {"sha256": digest, "size": size, "meta": meta or {}})
        if isinstance(content, Path):
            os.replace(content, self.path(name))
        else:
            self._write(self.path(name), content)

    def remove(self, name: str) -> None:
        """Forget entry ``name`` (its file and record)."""
        for path in (self.path(name), self.path(_record(name))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _read(self, name: str, keep: bool) -> tuple[bytes, dict] | None:
        if not self.ready():
            return None
        record = self.read_record(_record(name))
        if record is None:
            return None
        if not (isinstance(record.get("sha256"), str) and len(record["sha256"]) == 64
                and isinstance(record.get("size"), int) and isinstance(record.get("meta"), dict)):
            return self._refuse(_record(name), "its record is not {sha256, size, meta}")
        opened = self._open(name)
        if opened is None:
            return None
        fd, st = opened
        with os.fdopen(fd, "rb") as f:
            if st.st_size != record["size"]:
                return self._refuse(name, f"{st.st_size} bytes where {record['size']} were stored (truncated "
                                          "or overwritten)")
            digest, content = hashlib.sha256(), []
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                if keep:
                    content.append(chunk)
        if digest.hexdigest() != record["sha256"]:
            return self._refuse(name, "its sha256 differs from the one recorded when it was stored (corrupt)")
        return b"".join(content), record["meta"]

    def _open(self, name: str) -> tuple[int, os.stat_result] | None:
        """An open descriptor and status of file ``name`` if it is trusted; None if it is absent
        or refused. Opened without following a link and without blocking (a FIFO), then checked."""
        try:
            fd = os.open(self.path(name), os.O_RDONLY | _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._refuse(name, exc.strerror or str(exc))
        st = os.fstat(fd)
        why = _distrust(st, regular=True)
        if why is not None:
            os.close(fd)
            return self._refuse(name, why)
        return fd, st

    def _refuse(self, name: str, why: str) -> None:
        warn_once(f"{self.label}: cached {self.path(name)} refused: {why}; compiling it again")
        return None

    # -- records ---------------------------------------------------------------------------------

    def read_record(self, name: str) -> dict | None:
        """The JSON object in file ``name`` if it is trusted and an object; None if it is absent,
        refused or malformed (warned once). Callers check the shape of what they read."""
        opened = self._open(name)
        if opened is None:
            return None
        fd, st = opened
        with os.fdopen(fd, "rb") as f:
            if st.st_size > RECORD_LIMIT:
                return self._refuse(name, f"{st.st_size} bytes, more than a record may have")
            try:
                record = json.loads(f.read())
            except ValueError as exc:
                return self._refuse(name, f"not JSON ({exc})")
        if not isinstance(record, dict):
            return self._refuse(name, f"a JSON {type(record).__name__}, not an object")
        return record

    def write_record(self, name: str, record: dict) -> None:
        """Write ``record`` as JSON to file ``name`` (``0600``, by a rename)."""
        self._write(self.path(name), json.dumps(record).encode())

    def _write(self, path: Path, content: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".", suffix=".tmp")  # mode 0600, whatever the umask
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # -- building --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, name: str, timeout: float) -> Iterator[bool]:
        """Hold the exclusive lock file ``name`` for a build, waiting ``timeout`` seconds at most;
        yields whether it is held. A lock still held at the deadline (a slow or stopped builder)
        and a lock path that is not a regular file of this user (a FIFO, a folder, a link: not
        waited on) are warned about once and yield False: the caller goes without the cache."""
        path, fd, why = self.path(name), -1, None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o600)
            why = _distrust(os.fstat(fd), regular=True)
            if why is None and not _flock(fd, timeout):
                why = f"still held after {timeout:g} s (another process is building, or was stopped while building)"
        except OSError as exc:
            why = exc.strerror or str(exc)
        try:
            if why is not None:
                warn_once(f"{self.label}: build lock {path} refused: {why}; {self.fallback}")
            yield why is None
        finally:
            if fd >= 0:
                os.close(fd)  # releases the lock

    def building(self, name: str) -> bool:
        """Whether another process holds the lock file ``name`` now (a build under way); asks
        once, never waits, never warns. A lock path that cannot be opened is not a build."""
        if fcntl is None:
            return False
        try:
            fd = os.open(self.path(name), os.O_RDONLY | _OPEN_FLAGS)
        except OSError:
            return False
        try:
            if _distrust(os.fstat(fd), regular=True) is not None:
                return False
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False  # free: nobody builds (released at close)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def build_folder(self, name: str) -> Iterator[Path]:
        """A fresh private folder (``0700``) in the cache's folder for building entry ``name``
        (so that what it builds moves in by a rename), removed afterwards. Hold ``name``'s
        :meth:`lock` first: the folders that killed builds of ``name`` left are removed here."""
        for stale in self.folder.glob(f".{name}.build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(prefix=f".{name}.build-", dir=self.folder))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _record(name: str) -> str:
    """The name of entry ``name``'s record: its stem and ``.json``."""
    return f"{Path(name).stem}.json"


def _flock(fd: int, timeout: float) -> bool:
    """Take an exclusive flock on ``fd``, polling until ``timeout`` seconds have passed."""
    if fcntl is None:
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LOCK_POLL)


def _sha256(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size
