"""The registry: discovers plugins through entry points, validates and ranks their devices.

Backends are imported on demand: when a device of theirs is named, or when the full device list
is asked (policy plugins and the backends ``POLYHAL_BACKENDS`` names load with the registry). A
backend's policy hooks answer for its own devices; see "Plugins load on demand" in
docs/architecture.md for the contract.

Environment:

``POLYHAL_BACKENDS=cuda,cpu``
    Allow-list of backend entry points, also the order of preference (it overrides ranks).
    A backend named here that is missing or fails to load is an error, not a skip.
``POLYHAL_DISABLE_AUTOLOAD=1``
    Load no entry points at all; register plugins in code.
``POLYHAL_PLUGIN_TIMEOUT=5``
    Seconds one plugin may take to import (default :data:`DEFAULT_PLUGIN_TIMEOUT`; 0: no limit,
    import on the calling thread; ``inf``: no limit, on the loader thread). A plugin still
    importing then is skipped and named in ``polyhal devices``.
``POLYHAL_LOG=debug``
    Log each entry point to stderr before it is imported (``polyhal -v`` does the same), so a
    plugin that kills the process at import is named by the last line. Without it, the next
    process names that plugin (a marker file in the private folder ``$XDG_STATE_HOME/polyhal``,
    written before each entry point is imported and removed after).

One plugin cannot take the others down: a plugin that fails to import, breaks the hook
contract, raises in ``register_devices``, whose device factory raises or returns no Device, or
whose ``wrap_allocator`` fails is recorded with the reason (:attr:`Registry.failures`,
``polyhal devices``) and skipped; the default device falls back to the next one with a warning.
A device name two plugins register belongs to the one :meth:`Registry.owner_key` ranks first;
a policy hook that raises or answers nonsense is left out of that decision
(:meth:`Registry.policy_answer`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
import re
import stat
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import pluggy

from polyhal import hookspecs
from polyhal.config import Flag, Names, Number, Settings, Text, setting
from polyhal.distribution import install_hint
from polyhal.errors import DeviceNotFoundError, PluginError
from polyhal.hal.adaptors import MemoryTypeRouter
from polyhal.hal.allocator import Allocator
from polyhal.hal.device import Device
from polyhal.hal.records import DeviceSpec, Heap
from polyhal.hal.scratch import MemoryLimits, MemorySpacePolicy, ScratchError, ScratchRequest, check_placement
from polyhal.hookcall import HookAnswer, PluginManager

if TYPE_CHECKING:
    from importlib import metadata

#: Entry-point group of backend plugins (filtered by POLYHAL_BACKENDS).
BACKENDS_GROUP = "polyhal.backends"
#: Entry-point group of policy and other non-backend plugins.
PLUGINS_GROUP = "polyhal.plugins"
#: polyhal's own policies, imported by name and registered like any plugin (as pytest loads its
#: built-in plugins), before every other plugin so that they answer last.
BUILTIN_PLUGINS = (
    "polyhal.policies.memory_space",  # the default select_memory_space (bufferization policy)
    "polyhal.policies.identity_encoding",  # the resolve_encoding of last resort
    "polyhal.policies.first", "polyhal.policies.lead", "polyhal.policies.rank", "polyhal.policies.cost",
    "polyhal.policies.adaptors",  # POLYHAL_ALLOCATOR
)
#: polyhal's own backends, in the order that decides who owns a device name that several plugins
#: register when POLYHAL_BACKENDS does not (see Registry.owner_key): the CPU first.
BUILTIN_BACKENDS = ("cpu", "cuda", "hip", "opencl")
#: Seconds a plugin may take to import when POLYHAL_PLUGIN_TIMEOUT is not set. Measured here, the
#: real plugins import in 0.03-0.14 s warm and at most 0.23 s with no bytecode cache (cpu 0.23,
#: opencl 0.14, cuda 0.12, hip 0.10: drivers are opened later, in register_devices). 5 s is 20
#: times that, for slow disks, and keeps `polyhal devices` under 10 s with one plugin hanging.
DEFAULT_PLUGIN_TIMEOUT = 5.0

log = logging.getLogger("polyhal")


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was skipped (or one of its devices), and why.

    ``stage`` says when: ``"load"`` (import, API version, hook contract), ``"register_devices"``,
    ``"device"`` (the device factory raised or returned no Device; ``device`` names it), or the
    name of a policy hook whose answer was left out (``"wrap_allocator"``, ``"select_allocator"``...).
    """

    plugin: str
    reason: str
    stage: str = "load"
    device: str | None = None


@dataclass(frozen=True)
class RegistrySettings(Settings, component="registry"):
    """The registry's environment (see the module's docstring), read by each new Registry."""

    backends: tuple[str, ...] | None = setting(
        "POLYHAL_BACKENDS", Names(), None,
        "allow-list of backend entry points, also the order of preference; a backend named here that "
        "cannot load is an error", shown="every installed backend")
    disable_autoload: bool = setting("POLYHAL_DISABLE_AUTOLOAD", Flag(), False,
                                     "load no entry points at all (register plugins in code)")
    plugin_timeout: float = setting(
        "POLYHAL_PLUGIN_TIMEOUT", Number("seconds", low=0), DEFAULT_PLUGIN_TIMEOUT,
        "seconds one plugin may take to import (0: no limit, on the calling thread; inf: no limit)",
        hint=f"set e.g. {DEFAULT_PLUGIN_TIMEOUT:g}, 0 to import on the calling thread without a limit, "
             "or inf to wait without a limit")
    log: str = setting("POLYHAL_LOG", Text(), "",
                       "log polyhal at this level (debug, info, ...) to stderr, each entry point before its import")


def configure_logging(level: str | int | None = None) -> None:
    """Send polyhal's log to stderr at ``level`` (default: ``POLYHAL_LOG``; unset: no handler)."""
    level = level if level is not None else RegistrySettings.from_env().log
    if not level:
        return
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.DEBUG
    if not any(getattr(h, "_polyhal", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("polyhal: %(message)s"))
        handler._polyhal = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(level)


#: Thread id -> entry point being imported on that thread (default_registry refuses those threads).
_importing: dict[int, str] = {}


def _import_plugin(ep: metadata.EntryPoint) -> Any:
    _importing[threading.get_ident()] = ep.name
    try:
        return ep.load()
    finally:
        del _importing[threading.get_ident()]


def _load_with_timeout(ep: metadata.EntryPoint, timeout: float) -> Any:
    """``ep.load()``, on a worker thread that may take at most ``timeout`` seconds.

    A thread, not a subprocess: the plugin must be imported into this interpreter anyway, and a
    thread adds microseconds where a subprocess adds the whole import twice. A plugin that is still
    importing when the time is up is left running on its (daemon) thread and skipped; its module
    is never registered (a later import of the same module waits for that thread). Timeout 0
    imports on the calling thread: for a plugin that must import on the main thread, or one whose
    import needs a module the calling thread is importing (on a worker it would wait for it, and
    time out).
    """
    if timeout <= 0:
        return _import_plugin(ep)
    box: dict[str, Any] = {}

    def load() -> None:
        try:
            box["plugin"] = _import_plugin(ep)
        except BaseException as exc:  # noqa: BLE001 - SystemExit at import is a failure of that plugin too
            box["error"] = exc

    worker = threading.Thread(target=load, name=f"polyhal-load-{ep.name}", daemon=True)
    worker.start()
    worker.join(None if math.isinf(timeout) else timeout)
    if worker.is_alive():
        raise PluginError(
            f"importing entry point {ep.value!r} did not finish within {timeout:g} s "
            "(POLYHAL_PLUGIN_TIMEOUT); the plugin was skipped. Raise POLYHAL_PLUGIN_TIMEOUT if it is only "
            "slow, set it to 0 if the plugin must import on the calling thread (e.g. it waits for a module "
            "that thread is importing), or uninstall it")
    error = box.get("error")
    if isinstance(error, KeyboardInterrupt):
        # Signals reach only the main thread: this one was raised by the plugin's own code. Passed
        # on, it would fail every registry made in this process the same way.
        raise PluginError(f"importing entry point {ep.value!r} raised KeyboardInterrupt (from the plugin's "
                          "code: no signal reaches polyhal's loader thread)") from error
    if error is not None:
        raise error
    return box["plugin"]


def polyhal_entry_points() -> "metadata.EntryPoints":
    """The entry points of polyhal's groups (``polyhal.backends``, ``polyhal.plugins``), as
    ``importlib.metadata.entry_points()`` finds them: the first distribution of a name on
    ``sys.path`` counts, later copies of it are shadowed. Only the ``entry_points.txt`` files that
    mention a polyhal group are parsed: parsing every installed distribution's took 2-3 ms of a
    process's first session (75 distributions), reading them 0.7 ms."""
    from importlib import metadata  # here, not at import: it costs more than the rest of polyhal's registry

    groups = (BACKENDS_GROUP, PLUGINS_GROUP)
    seen: set[str] = set()
    found: list[metadata.EntryPoint] = []
    for dist in metadata.distributions():
        # (entry_points() shadows by this name: a folder-name parse, no METADATA read)
        name = getattr(dist, "_normalized_name", None) or re.sub(r"[-_.]+", "_", dist.name or "").lower()
        if name in seen:
            continue
        seen.add(name)
        text = dist.read_text("entry_points.txt")
        if text and any(group in text for group in groups):
            found.extend(ep for ep in dist.entry_points if ep.group in groups)
    return metadata.EntryPoints(found)


class ImportBreadcrumbs:
    """Marker files that name the entry point this process is importing, so that the next process
    can name a plugin that ended the process at import (``os._exit``, a crash in native code).

    One file per process (``importing-<pid>``) in a private per-user folder,
    ``$XDG_STATE_HOME/polyhal`` (else ``~/.local/state/polyhal``): created 0700, files 0600.
    A folder or file that is not ours, or that others may write, is not used (one warning):
    only its owner may name a plugin to us. Disk errors turn the breadcrumbs off silently.
    """

    PREFIX = "importing-"

    def __init__(self, folder: str | None = None) -> None:
        if folder is None:
            base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
            folder = os.path.join(base, "polyhal")
        self.folder: str | None = folder
        self.marker = os.path.join(folder, f"{self.PREFIX}{os.getpid()}")
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            info = os.lstat(folder)
        except OSError as exc:
            log.debug("import breadcrumbs off: %s", exc)
            self.folder = None
            return
        problem = self._not_private(info, "folder", stat.S_ISDIR)
        if problem:
            warnings.warn(f"polyhal: not using {folder!r} for import breadcrumbs: {problem}", RuntimeWarning,
                          stacklevel=3)
            self.folder = None

    @staticmethod
    def _not_private(info: os.stat_result, what: str, kind: Callable[[int], bool]) -> str | None:
        if not kind(info.st_mode):
            return f"it is not a {what}"
        if info.st_uid != os.getuid():
            return f"it is owned by user {info.st_uid}, not by you"
        if info.st_mode & 0o077:
            return (f"it is not private (mode {stat.S_IMODE(info.st_mode):04o}); "
                    f"chmod {700 if what == 'folder' else 600} it")
        return None

    def left_by_ended_processes(self) -> list[dict[str, Any]]:
        """What processes that are gone were importing when they ended; their markers are removed."""
        if self.folder is None:
            return []
        found = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        for name in names:
            pid = name[len(self.PREFIX):]
            if not name.startswith(self.PREFIX) or not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            path = os.path.join(self.folder, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    if self._not_private(os.fstat(fd), "file", stat.S_ISREG) is None:
                        found.append(dict(json.loads(os.read(fd, 4096)), pid=int(pid)))
                finally:
                    os.close(fd)
                os.unlink(path)
            except (OSError, ValueError, TypeError) as exc:
                log.debug("import breadcrumb %s not read: %s", path, exc)
        return found

    def importing(self, ep: metadata.EntryPoint) -> None:
        """Write this process's marker: ``ep`` is being imported."""
        if self.folder is None:
            return
        data = json.dumps({"plugin": ep.name, "entry_point": ep.value, "group": ep.group}).encode()
        try:
            fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            log.debug("import breadcrumbs off: %s", exc)
            self.folder = None

    def done(self) -> None:
        """Remove this process's marker (the import ended, well or not)."""
        if self.folder is not None:
            try:
                os.unlink(self.marker)
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


class Registry:
    """Plugins, their devices and the devices created so far.

    ``generation`` increases whenever a plugin is registered or unregistered, so that caches
    built on top (device lists, memoized policy decisions) know to recompute.
    """

    def __init__(self, *, autoload: bool | None = None) -> None:
        #: pluggy's manager; call hooks with ``pm.first_answer`` / ``pm.each_answer`` (see polyhal.hookcall).
        self.pm = PluginManager("polyhal")
        self.pm.add_hookspecs(hookspecs)
        self._failures: list[PluginFailure] = []
        #: plugin name -> (distribution, version) of the plugins loaded from entry points
        #: plugin name -> the distribution that installed it (read for its name and version only
        #: when asked: parsing its METADATA was ~0.8 ms of a process's first session).
        self._distributions: dict[str, metadata.Distribution] = {}
        self.generation = 0
        self._lock = threading.RLock()
        self._specs: list[DeviceSpec] | None = None
        self._backend_specs: dict[str, dict[str, DeviceSpec]] = {}  # see spec()
        self._devices: dict[str, Device] = {}
        self._broken: dict[str, PluginFailure] = {}  # devices whose factory raised
        self._listeners: list[Callable[[], Any]] = []
        #: Backend entry points found but not imported yet, by name (see load_backends).
        self._pending: dict[str, metadata.EntryPoint] = {}
        #: Names of the plugins loaded from the backend group (their place in the hook order).
        self._backend_names: set[str] = set()
        self._crumbs: ImportBreadcrumbs | None = None
        self._plugin_passes: tuple[int, list[tuple[str, Any]]] | None = None  # (generation, records)
        self._settings = settings = RegistrySettings.from_env()  # read (and checked) once, here
        self._preference = list(settings.backends) if settings.backends else None
        #: The memoizing allocator selector of this registry (made by polyhal.policy.selector_for);
        #: kept here so that it lives and dies with its registry.
        self.allocator_selector: Any = None
        configure_logging()
        # Built-in policies are ordinary plugins, registered first so that they run last.
        for name in BUILTIN_PLUGINS:
            self.pm.register(importlib.import_module(name), name=name)
        if autoload is None:
            autoload = not settings.disable_autoload
        if autoload:
            self.load_entry_points()

    # -- loading ---------------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Find the installed plugins. Policy plugins (entry-point group ``polyhal.plugins``) and
        the backends ``POLYHAL_BACKENDS`` names are imported now; every other backend when its
        devices are first asked for (:meth:`load_backends`), so that a program run on ``cpu:0``
        imports no OpenCL, CUDA or HIP plugin. See "Plugins load on demand" in docs/architecture.md."""
        wanted = self._preference
        found = polyhal_entry_points()  # one scan of the installed distributions for both groups
        backends = {ep.name: ep for ep in found.select(group=BACKENDS_GROUP)}
        if wanted is not None:
            missing = [n for n in wanted if n not in backends]
            if missing:
                raise PluginError(
                    f"POLYHAL_BACKENDS names {missing}, which is not installed; installed backends: "
                    f"{sorted(backends) or 'none'}. Install the plugin (e.g. {install_hint('polyhal-' + missing[0])}) "
                    "or remove it from POLYHAL_BACKENDS")
        self._crumbs = crumbs = ImportBreadcrumbs()
        for left in crumbs.left_by_ended_processes():
            warnings.warn(
                f"polyhal: process {left.get('pid')} ended while importing plugin {str(left.get('plugin'))!r} "
                f"(entry point {str(left.get('entry_point'))!r} of {str(left.get('group'))!r}); if this process "
                "ends too, uninstall that plugin or leave it out with POLYHAL_BACKENDS", RuntimeWarning, stacklevel=3)
        with self._lock:
            self._pending.update((n, ep) for n, ep in backends.items()
                                 if (wanted is None or n in wanted) and self.pm.get_plugin(n) is None)
        if wanted is not None:
            self.load_backends(wanted)  # named by the user: imported now, and a failure is loud
        for ep in sorted(found.select(group=PLUGINS_GROUP), key=lambda e: e.name):
            self._load(ep, loud=False, timeout=self._settings.plugin_timeout, crumbs=crumbs)

    def load_backends(self, names: Iterable[str] | None = None) -> None:
        """Import the backend plugins found by :meth:`load_entry_points` and not imported yet:
        those in ``names`` (names that are no pending backend are ignored), or all (``None``).

        Each takes the place in the hook order that loading every plugin at once gives it (after
        polyhal's built-in policies and the backends before it by name, before every other plugin),
        so that when a backend loads does not change which plugin answers a policy hook first.
        """
        with self._lock:
            todo = sorted(self._pending if names is None else (n for n in names if n in self._pending))
            if not todo:
                return
            loud = self._preference is not None
            crumbs = self._crumbs or ImportBreadcrumbs()
            for name in todo:
                self._load(self._pending.pop(name), loud=loud, timeout=self._settings.plugin_timeout,
                           crumbs=crumbs, backend=True)

    def _load(self, ep: metadata.EntryPoint, *, loud: bool, timeout: float, crumbs: ImportBreadcrumbs,
              backend: bool = False) -> None:
        # Logged and marked before the import runs: a plugin that ends the process is the last one named.
        log.debug("loading plugin %r from entry point %r (group %s)", ep.name, ep.value, ep.group)
        crumbs.importing(ep)
        try:
            plugin = _load_with_timeout(ep, timeout)
            self._check_api(plugin, ep.name)
            if backend:
                self._register_backend(plugin, ep.name)
            else:
                self.register(plugin, name=ep.name)
            if ep.dist is not None:
                self._distributions[ep.name] = ep.dist
        except BaseException as exc:  # noqa: BLE001 - no failure of one plugin may take the others down
            if isinstance(exc, KeyboardInterrupt):
                raise
            reason = str(exc) if isinstance(exc, PluginError) else (
                f"failed to load entry point {ep.value!r}: {type(exc).__name__}: {exc}")
            if loud:
                raise PluginError(
                    f"backend {ep.name!r} named in POLYHAL_BACKENDS cannot load: {reason}. Fix or "
                    f"uninstall the plugin package, or remove {ep.name!r} from POLYHAL_BACKENDS") from exc
            log.debug("plugin %r skipped: %s", ep.name, reason)
            self._fail(ep.name, reason)
            return
        finally:
            crumbs.done()
        log.debug("plugin %r loaded", ep.name)

    def _register_backend(self, plugin: Any, name: str) -> None:
        """Register backend ``plugin`` where eager loading would have: pluggy calls the plugins
        registered last first, so the plugins after its place (backends later by name, policy
        plugins, plugins registered in code) are registered again after it, in their order."""
        with self._lock:
            after = [(n, p) for n, p in self.pm.list_name_plugin()
                     if n not in BUILTIN_PLUGINS and not (n in self._backend_names and n < name)]
            for _, p in after:
                self.pm.unregister(p)
            try:
                self.register(plugin, name=name)
            finally:
                for n, p in after:
                    self.pm.register(p, name=n)
            self._backend_names.add(name)
            self._changed()

    @staticmethod
    def _check_api(plugin: Any, name: str) -> None:
        declared = getattr(plugin, "POLYHAL_API_VERSION", None)
        if declared != hookspecs.API_VERSION:
            raise PluginError(
                f"plugin {name!r} declares POLYHAL_API_VERSION={declared!r}, but this polyhal implements "
                f"API version {hookspecs.API_VERSION}; upgrade the plugin (or polyhal) so that they match")

    def distribution(self, plugin: str) -> tuple[str, str] | None:
        """(distribution name, version) of the package that installed ``plugin`` (None for a
        plugin registered in code, or one whose distribution's metadata cannot be read)."""
        dist = self._distributions.get(plugin)
        try:
            return None if dist is None else (dist.name, dist.version)
        except Exception:  # noqa: BLE001 -- unreadable METADATA: the plugin loaded; it is only not named
            return None

    @property
    def failures(self) -> list[PluginFailure]:
        """Plugins skipped at load time, while registering devices or creating a device, with the reason."""
        self.device_specs()  # device registration failures are found when devices are listed
        return list(self._failures)

    def _fail(self, plugin: str, reason: str, stage: str = "load", device: str | None = None) -> PluginFailure:
        failure = PluginFailure(plugin, reason, stage, device)
        self._failures.append(failure)
        return failure

    def register(self, plugin: Any, name: str | None = None) -> str:
        """Register a plugin object or module in code; returns its name.

        Objects without ``POLYHAL_API_VERSION`` are accepted (policy objects written inline);
        a declared mismatching version is an error.
        """
        if hasattr(plugin, "POLYHAL_API_VERSION"):
            self._check_api(plugin, name or repr(plugin))
        with self._lock:
            try:
                registered = self.pm.register(plugin, name=name)
            except ValueError as exc:
                raise PluginError(f"cannot register plugin {name or plugin!r}: {exc}") from exc
            except pluggy.PluginValidationError as exc:
                raise PluginError(f"plugin {name or plugin!r} breaks the hook contract: {exc}") from exc
            self._changed()
            return registered

    def unregister(self, plugin: Any = None, name: str | None = None) -> None:
        """Remove a plugin registered earlier (by object or by name)."""
        with self._lock:
            self.pm.unregister(plugin, name=name)
            self._changed()

    def on_change(self, callback: Callable[[], Any]) -> Callable[[], None]:
        """Call ``callback()`` whenever a plugin is registered or unregistered (caches drop).

        Returns a function that unsubscribes ``callback`` (safe to call more than once).
        """
        self._listeners.append(callback)
        registry = weakref.ref(self)  # an unsubscribe kept around must not keep the registry alive

        def unsubscribe() -> None:
            reg = registry()
            if reg is not None and callback in reg._listeners:
                reg._listeners.remove(callback)

        return unsubscribe

    def _changed(self) -> None:
        self.generation += 1
        self._specs = None
        self._backend_specs.clear()
        self._broken.clear()  # a changed set of plugins may create the device now
        for callback in list(self._listeners):
            callback()

    # -- compile passes ----------------------------------------------------------------------------

    def plugin_passes(self) -> list[tuple[str, Any]]:
        """``(plugin, record)`` for every record the ``register_passes`` hook returned, in
        registration order (read once per registry generation). A plugin whose hook raises is
        recorded as a failure (``polyhal plugins`` shows it) and contributes nothing."""
        with self._lock:
            cached = self._plugin_passes
            if cached is not None and cached[0] == self.generation:
                return list(cached[1])
            answers, failures = self.pm.each_answer("register_passes")
            for plugin, exc in failures:
                reason = f"register_passes raised {type(exc).__name__}: {exc}"
                self._fail(plugin, reason, "passes")
                warnings.warn(f"polyhal: plugin {plugin!r} adds no compile passes: {reason}", RuntimeWarning,
                              stacklevel=3)
            found = [(plugin, record) for plugin, records in answers for record in records]
            self._plugin_passes = (self.generation, found)
            return list(found)

    # -- devices -----------------------------------------------------------------------------------

    def device_specs(self) -> list[DeviceSpec]:
        """Every registered device, best first (POLYHAL_BACKENDS order, then rank, then name)."""
        with self._lock:
            if self._specs is None:
                self.load_backends()  # the full list asks every backend
                self._specs = self._collect_specs()
            return list(self._specs)

    def spec(self, name: str) -> DeviceSpec:
        """The spec of device ``name``; an unknown name raises DeviceNotFoundError listing the devices.

        Until every device has been listed, a name ``<backend>:...`` asks only the plugin
        registered as ``<backend>`` and those :meth:`owner_key` ranks before it (and takes the
        device of that name if one of them has it): a program run on ``cpu:0`` loads no OpenCL
        or CUDA driver. That is the same answer the full list gives (a plugin ranked later can
        never own the name), unless another plugin wraps ``register_devices`` (then the full
        list is asked).
        """
        with self._lock:
            if self._specs is None:
                backend = name.partition(":")[0]
                known = self._backend_specs.get(backend)
                if known is None and self._load_owners(backend):
                    known = self._specs_of_backend(backend)
                found = known.get(name) if known else None
                if found is not None:
                    return found
            for spec in self.device_specs():
                if spec.name == name:
                    return spec
        backend = name.partition(":")[0]
        said = self.unavailable_reasons().get(backend, []) + [f.reason for f in self.failures if f.plugin == backend]
        why = f" (plugin {backend!r}: {'; '.join(said)})" if said else ""
        raise DeviceNotFoundError(
            f"unknown device {name!r}{why}; available: {[s.name for s in self.device_specs()] or 'none'} "
            "(run `polyhal devices` to see every device and plugin)")

    def specs_of_plugin(self, plugin: str) -> list[DeviceSpec]:
        """The devices plugin ``plugin`` registers. Until every device has been listed, only that
        plugin is asked, as :meth:`spec` asks only a device's backend (checking one plugin's
        claims loads no other backend's driver); else, or where that plugin alone cannot answer
        (it registers no device, or another plugin wraps ``register_devices``), the full list."""
        with self._lock:
            if self._specs is None and self._load_owners(plugin):
                found = self._specs_of_backend(plugin)
                if found:
                    return list(found.values())
            return [s for s in self.device_specs() if s.plugin == plugin]

    def specs_by_name(self) -> Mapping[str, DeviceSpec]:
        """A read-only mapping ``device name -> spec`` that looks names up through :meth:`spec`
        (iterating it lists every device)."""
        return _SpecsByName(self)

    def _load_owners(self, backend: str) -> bool:
        """Import backend ``backend`` and every backend :meth:`owner_key` ranks before it (one of
        them would own a device name they share), if not imported yet; whether ``backend`` is a
        plugin at all (else only the full list can say who registers its devices)."""
        if self._pending:
            key = self.owner_key(backend)
            self.load_backends([n for n in self._pending if self.owner_key(n) <= key])
        return self.pm.get_plugin(backend) is not None

    def _specs_of_backend(self, backend: str) -> dict[str, DeviceSpec]:
        found = self._backend_specs.get(backend)
        if found is not None:
            return found
        found: dict[str, DeviceSpec] = {}
        plugin = self.pm.get_plugin(backend)
        impls = self.pm.hook.register_devices.get_hookimpls()
        later = [p for n, p in self.pm.list_name_plugin() if self.owner_key(n) > self.owner_key(backend)]
        if plugin is not None and not any(
                (impl.hookwrapper or impl.wrapper) and impl.plugin_name != backend for impl in impls):
            answers, failed = self.pm.each_answer("register_devices", leave_out=later)
            if not failed:  # a failure is recorded (and reported) by the full listing
                for owner, specs in sorted(answers, key=lambda a: self.owner_key(a[0])):
                    for spec in specs:
                        if self._validate_spec(spec) is None and spec.name not in found:
                            found[spec.name] = dataclasses.replace(spec, plugin=owner)
        self._backend_specs[backend] = found
        return found

    def owner_key(self, plugin: str) -> tuple:
        """Sort key of plugins for owning a device name that several register (smallest owns it):
        the order of POLYHAL_BACKENDS, then polyhal's own backends (:data:`BUILTIN_BACKENDS`, the
        CPU first), then the plugin's name. Never the order plugins happen to register or answer in."""
        pref = self._preference or []
        return (pref.index(plugin) if plugin in pref else len(pref),
                BUILTIN_BACKENDS.index(plugin) if plugin in BUILTIN_BACKENDS else len(BUILTIN_BACKENDS), plugin)

    def _collect_specs(self) -> list[DeviceSpec]:
        self._failures = [f for f in self._failures if f.stage != "register_devices"]
        by_name: dict[str, DeviceSpec] = {}
        answers, failed = self.pm.each_answer("register_devices")  # registration order
        for plugin, exc in failed:
            self._fail(plugin, f"register_devices raised {type(exc).__name__}: {exc}", "register_devices")
        for plugin, specs in sorted(answers, key=lambda a: self.owner_key(a[0])):  # the owner of a name first
            for spec in specs:
                problem = self._validate_spec(spec)
                if problem:
                    self._fail(plugin, f"register_devices: {problem}", "register_devices")
                    continue
                if spec.name in by_name:
                    owner = by_name[spec.name].plugin
                    why = ("POLYHAL_BACKENDS lists it first" if self._preference and owner in self._preference
                           else "polyhal's own backends come first" if owner in BUILTIN_BACKENDS
                           else "the plugin names sort so")
                    reason = (f"register_devices: device name {spec.name!r} belongs to plugin {owner!r} ({why}), "
                              f"not to plugin {plugin!r}, which registers it too; plugin {plugin!r}'s device was "
                              "left out. Rename one device, uninstall one plugin, or order them in POLYHAL_BACKENDS")
                    self._fail(plugin, reason, "register_devices")
                    warnings.warn(f"polyhal: plugin {plugin!r}: {reason}", RuntimeWarning, stacklevel=4)
                    continue
                by_name[spec.name] = dataclasses.replace(spec, plugin=plugin)
        pref = self._preference or []

        def key(s: DeviceSpec) -> tuple:
            order = pref.index(s.backend) if s.backend in pref else len(pref)
            return (order, -s.rank, s.backend, _natural(s.name))

        return sorted(by_name.values(), key=key)

    @staticmethod
    def _validate_spec(spec: Any) -> str | None:
        if not isinstance(spec, DeviceSpec):
            return f"returned {type(spec).__name__} instead of polyhal.DeviceSpec"
        if not spec.name or not isinstance(spec.name, str):
            return f"device spec has no name: {spec!r}"
        if not isinstance(spec.rank, int) or isinstance(spec.rank, bool):
            return f"device {spec.name!r} has a non-integer rank {spec.rank!r}"
        if not callable(spec.factory):
            return f"device {spec.name!r} has no callable factory"
        if not spec.heaps:
            return f"device {spec.name!r} declares no memory heaps"
        if spec.kernel_names is not None and not (isinstance(spec.kernel_names, frozenset)
                                                  and all(isinstance(n, str) for n in spec.kernel_names)):
            return (f"device {spec.name!r} has kernel_names {type(spec.kernel_names).__name__} "
                    "instead of a frozenset of op names")
        return None

    def get_device(self, device: "Device | str | None" = None) -> Device:
        """The created device for a name (``None``: the best-ranked one that can be created);
        creates it on first use.

        A named device whose factory raises is a :class:`~polyhal.errors.PluginError`. The default
        device skips such devices with a warning naming each and why (they are also listed in
        :attr:`failures`), and takes the next.
        """
        if isinstance(device, Device):
            return device
        if device is not None:
            return self._create(self.spec(device))
        specs = self.device_specs()
        if not specs:
            raise DeviceNotFoundError(self._no_device_message())
        skipped = []
        for spec in specs:
            dev = self._devices.get(spec.name)
            if dev is not None:
                return dev
            try:
                return self._create(spec)
            except PluginError as exc:
                skipped.append(str(exc))
        raise DeviceNotFoundError("no device could be created: " + "; ".join(skipped)
                                  + " (run `polyhal devices` to see every device and plugin)")

    def default_devices(self) -> list[str]:
        """Every device not known to be broken or lost (:attr:`Device.lost <polyhal.hal.device.Device.lost>`),
        best first: the default ``--device`` list of a compile. Nothing is created here (placement reads kernel names from the specs); a device
        whose factory raises later is recorded as broken, and :func:`polyhal.compile` then places
        the program again without it (see :meth:`is_broken`)."""
        names = [spec.name for spec in self.device_specs()
                 if spec.name not in self._broken and getattr(self._devices.get(spec.name), "lost", None) is None]
        if not names:
            self.get_device(None)  # raises the "no device" error with its advice
        return names

    def is_broken(self, device: str) -> bool:
        """Whether ``device``'s factory raised (the failure is listed by `polyhal devices`)."""
        return device in self._broken

    def _create(self, spec: DeviceSpec) -> Device:
        """Create ``spec``'s device once (and wrap its allocator); a factory that raises marks the
        device broken, records the failure and warns once, naming the device and why."""
        dev = self._devices.get(spec.name)
        if dev is not None:
            return dev
        with self._lock:
            dev = self._devices.get(spec.name)
            if dev is not None:
                return dev
            broken = self._broken.get(spec.name)
            if broken is not None:
                raise PluginError(broken.reason)
            try:
                dev = spec.factory(spec)
                if not isinstance(dev, Device):
                    raise PluginError(f"its factory returned {'None' if dev is None else type(dev).__name__} instead "
                                      "of a polyhal.Device",
                                      plugin=spec.plugin)
                self._wrap_allocators(dev)  # only polyhal's own wrappers (POLYHAL_ALLOCATOR) raise here
            except Exception as exc:
                plugin = getattr(exc, "plugin", None) or spec.plugin
                what = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"
                reason = (f"plugin {plugin!r} could not create device {spec.name!r}: {what}. Set POLYHAL_BACKENDS "
                          "to skip this backend, or name another device")
                self._broken[spec.name] = self._fail(plugin, reason, "device", spec.name)
                log.debug("%s", reason)
                warnings.warn(f"polyhal: device {spec.name} is not used: {reason}", RuntimeWarning, stacklevel=4)
                raise PluginError(reason, plugin=plugin) from exc
            dev.memory_space_policy = self.memory_space_policy(spec)
            dev.find_device = self.get_device  # Tensor.to_device("name")
            self._devices[spec.name] = dev
            return dev

    def memory_space_policy(self, spec: DeviceSpec) -> MemorySpacePolicy:
        """The memory-space policy of ``spec``'s device: this registry's ``select_memory_space``
        hook (see :mod:`polyhal.hal.scratch`); each device this registry creates places by it."""
        def misplaced(answer: HookAnswer, request: ScratchRequest, limits: MemoryLimits) -> str | None:
            try:
                check_placement(answer.value, answer.plugin or "", request, limits, spec.name)
            except (PluginError, ScratchError) as exc:
                return str(exc)
            return None

        def select(request: ScratchRequest, limits: MemoryLimits) -> tuple[Any, str]:
            # A plugin that raises or places the scratch where it cannot go is skipped, with a warning.
            answer = self.policy_answer(
                "select_memory_space", where=lambda: f"for {request.kernel} scratch {request.name!r}",
                passthrough=(ScratchError,), check=lambda a: misplaced(a, request, limits),
                device=spec, kernel=request.kernel, scratch=request, limits=limits)
            return answer.value, answer.plugin or ""
        return select

    def kernel_names(self, device: str) -> frozenset[str]:
        """The ops device ``device`` has kernels for, from its DeviceSpec: nothing is created,
        unless the spec declares none (``kernel_names=None``); then the device is asked."""
        spec = self.spec(device)  # an unknown name fails here, listing the devices
        if spec.kernel_names is not None:
            return spec.kernel_names
        return self.get_device(device).kernel_names

    def _wrap_allocators(self, device: Device) -> None:
        """Run the ``wrap_allocator`` hook for a just-created device (see hookspecs) and install
        the result: one allocator for all heaps when they agree, a MemoryTypeRouter otherwise.

        Each plugin's step is one pluggy call that leaves the other implementers out, so
        adaptors stack in registration order (earliest innermost) and hook wrappers see each step.
        """
        base = device.allocator
        implementers = [i.plugin for i in self.pm.hook.wrap_allocator.get_hookimpls()
                        if not (i.wrapper or i.hookwrapper)]
        if not implementers or not isinstance(base, Allocator):
            return
        chosen: dict[Heap, Allocator] = {}
        for heap in base.heaps:
            allocator = base
            for plugin in implementers:
                # A plugin whose step fails is left out (warned, recorded): that step keeps the allocator.
                answer = self.policy_answer(
                    "wrap_allocator", leave_out=[p for p in implementers if p is not plugin],
                    where=lambda: f"for {device.name} ({heap.memory_type.describe()})",
                    check=lambda a: None if isinstance(a.value, Allocator) and a.value.device is device else (
                        f"plugin {a.plugin!r} returned {a.value!r} from wrap_allocator for {device.name}; it must "
                        "return an Allocator of that device (e.g. an adaptor over the one it was given) or None"),
                    device=device, memory_type=heap.memory_type, allocator=allocator)
                if answer.value is not None:
                    allocator = answer.value
            chosen[heap] = allocator
        wrapped = {h: a for h, a in chosen.items() if a is not base}
        if not wrapped:
            return
        if len(base.heaps) == 1:
            device.allocator = chosen[base.heaps[0]]
        else:
            device.allocator = MemoryTypeRouter(base, wrapped)

    def policy_answer(self, hook: str, *, where: str | Callable[[], str] = "",
                      check: Callable[[HookAnswer], str | None] | None = None, leave_out: Sequence[object] = (),
                      passthrough: tuple[type[BaseException], ...] = (), **kwargs: Any) -> HookAnswer:
        """Call the firstresult policy ``hook`` (``pm.first_answer``), leaving out each plugin that
        raises or whose answer ``check`` refuses (``check(answer)`` returns what is wrong, or None):
        that plugin is skipped for this decision with a RuntimeWarning naming it (and recorded in
        :attr:`failures`), and the others, in the end polyhal's built-in policy, decide.

        A failure of a built-in plugin (:data:`BUILTIN_PLUGINS`: a bad ``POLYHAL_*`` setting,
        say) is raised as a :class:`~polyhal.errors.PluginError`: nobody is left to decide.
        """
        skipped = list(leave_out)
        while True:
            try:
                answer = self.pm.first_answer(hook, where=where, leave_out=skipped, passthrough=passthrough, **kwargs)
            except PluginError as exc:
                culprit, problem = exc.plugin, str(exc)
                if culprit is None or culprit in BUILTIN_PLUGINS:
                    raise
            else:
                problem = check(answer) if check is not None and answer.value is not None else None
                if problem is None:
                    return answer
                culprit = answer.plugin
                if culprit is None or culprit in BUILTIN_PLUGINS:
                    raise PluginError(problem, plugin=culprit)
            target = kwargs.get("device") or kwargs.get("device_spec")
            failure = PluginFailure(culprit, f"{problem}; skipped", hook, getattr(target, "name", None))
            if failure not in self._failures:
                self._failures.append(failure)
            warnings.warn(f"polyhal: {problem}; plugin {culprit!r} is skipped for this {hook} decision and the "
                          "next plugin (in the end polyhal's built-in policy) decides", RuntimeWarning, stacklevel=3)
            skipped.append(self.pm.get_plugin(culprit))

    def _no_device_message(self) -> str:
        """Why no device is registered: the failures and the reasons plugins gave, else advice to install one."""
        why = [f"plugin {f.plugin!r} failed: {f.reason}" for f in self._failures]
        why += [f"plugin {p!r}: {r}" for p, reasons in self.unavailable_reasons().items() for r in reasons]
        scope = ""
        if self._preference is not None:
            scope = f" among the backends POLYHAL_BACKENDS={','.join(self._preference)} allows"
        if why:
            return (f"no device is available{scope}: " + "; ".join(why)
                    + ". Fix what is named, or allow another backend (POLYHAL_BACKENDS)")
        if self._preference is not None:
            return (f"no device is available{scope}: the backends loaded but registered no device. "
                    "Check `polyhal devices`, or allow another backend (POLYHAL_BACKENDS)")
        return (f"no device is available: install a backend ({install_hint('polyhal-cpu')}) or check "
                "`polyhal devices` for plugins that failed to load")

    def created_devices(self) -> list[Device]:
        """Devices created so far (creation is lazy)."""
        return list(self._devices.values())

    def device_for_dlpack(self, dl_device: tuple[int, int]) -> Device:
        """The device that can import memory of a DLPack (device type, id)."""
        key = (int(dl_device[0]), int(dl_device[1]))
        for spec in self.device_specs():
            if key in spec.dlpack_devices:
                return self.get_device(spec.name)
        raise DeviceNotFoundError(
            f"no installed backend can import DLPack memory of device {key}; install the matching "
            "backend (polyhal-cuda for CUDA, ...) or copy the data to the host first")

    def unavailable_reasons(self) -> dict[str, list[str]]:
        """Per plugin, the reasons it gave (report_unavailable) for registering fewer devices."""
        out: dict[str, list[str]] = {}
        self.load_backends()
        answers, failed = self.pm.each_answer("report_unavailable")
        for plugin, reasons in answers:
            if reasons:
                out.setdefault(plugin, []).extend(str(r) for r in reasons)
        for plugin, exc in failed:
            out.setdefault(plugin, []).append(f"report_unavailable raised {type(exc).__name__}: {exc}")
        return out


def _natural(name: str) -> tuple:
    """Sort key that orders "cpu:2" before "cpu:10"."""
    head, _, tail = name.rpartition(":")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


_default: Registry | None = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry, created (and plugins loaded) on first use.

    A plugin that asks for it while the plugin itself is being imported gets a PluginError:
    the registry imports plugins (when it is made, or when a backend's devices are first asked
    for) while it holds its lock, so it would wait for itself, or be asked about devices half
    registered.
    """
    global _default
    plugin = _importing.get(threading.get_ident())
    if plugin is not None:
        raise PluginError(
            f"plugin {plugin!r} called polyhal's default registry while it was being imported (the registry "
            "imports the plugins, so it would wait for itself); ask for devices in the plugin's "
            "hooks or functions instead of at import", plugin=plugin)
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Registry()
    return _default


def set_default_registry(registry: Registry | None) -> Registry | None:
    """Replace the process-wide registry (tests, embedding); returns the previous one."""
    global _default
    with _default_lock:
        old, _default = _default, registry
    return old


def get_device(device: "Device | str | None" = None) -> Device:
    """Shortcut for ``default_registry().get_device(device)``."""
    return default_registry().get_device(device)


def devices() -> list[DeviceSpec]:
    """Shortcut for ``default_registry().device_specs()``."""
    return default_registry().device_specs()


def iter_plugins(registry: Registry) -> Iterable[tuple[str, list[str]]]:
    """(plugin name, hooks it implements) for every registered plugin."""
    registry.load_backends()
    for name, plugin in registry.pm.list_name_plugin():
        hooks = sorted(h.name for h in registry.pm.get_hookcallers(plugin) or ())
        yield name, hooks


class _SpecsByName(Mapping):
    """Device specs by name, looked up through :meth:`Registry.spec` (see there)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def __getitem__(self, name: str) -> DeviceSpec:
        try:
            return self._registry.spec(name)
        except DeviceNotFoundError:
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return iter([s.name for s in self._registry.device_specs()])

    def __len__(self) -> int:
        return len(self._registry.device_specs())
