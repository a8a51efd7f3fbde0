"""The registry: discovers plugins through entry points, validates and ranks their devices.

Environment:

``POLYHAL_BACKENDS=cuda,cpu``
    Allow-list of backend entry points, also the order of preference (it overrides ranks).
    A backend named here that is missing or fails to load is an error, not a skip.
``POLYHAL_DISABLE_AUTOLOAD=1``
    Load no entry points at all; register plugins in code.
``POLYHAL_PLUGIN_TIMEOUT=20``
    Seconds one plugin may take to import (default 20; 0: no limit, import on the calling thread).
    A plugin still importing then is skipped and named in ``polyhal devices``.
``POLYHAL_LOG=debug``
    Log each entry point to stderr before it is imported (``polyhal -v`` does the same), so a
    plugin that kills the process at import is named by the last line.

One plugin cannot take the others down: a plugin that fails to import, breaks the hook
contract, raises in ``register_devices`` or whose device factory raises is recorded with the
reason (:attr:`Registry.failures`, ``polyhal devices``) and skipped; the default device falls
back to the next one with a warning.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from importlib import metadata
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator

import pluggy

from polyhal import hookspecs
from polyhal.errors import DeviceNotFoundError, PluginError
from polyhal.hal.adaptors import MemoryTypeRouter
from polyhal.hal.allocator import Allocator
from polyhal.hal.device import Device
from polyhal.hal.records import DeviceSpec, Heap
from polyhal.hookcall import PluginManager

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
#: Seconds a plugin may take to import when POLYHAL_PLUGIN_TIMEOUT is not set.
DEFAULT_PLUGIN_TIMEOUT = 20.0

log = logging.getLogger("polyhal")


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was skipped (or one of its devices), and why.

    ``stage`` says when: ``"load"`` (import, API version, hook contract), ``"register_devices"``
    or ``"device"`` (the device factory raised; ``device`` names it).
    """

    plugin: str
    reason: str
    stage: str = "load"
    device: str | None = None


def configure_logging(level: str | int | None = None) -> None:
    """Send polyhal's log to stderr at ``level`` (default: ``POLYHAL_LOG``; unset: no handler)."""
    level = level if level is not None else os.environ.get("POLYHAL_LOG", "").strip()
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


def _plugin_timeout() -> float:
    raw = os.environ.get("POLYHAL_PLUGIN_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_PLUGIN_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise PluginError(f"POLYHAL_PLUGIN_TIMEOUT={raw!r} is not a number of seconds; "
                          f"set e.g. {DEFAULT_PLUGIN_TIMEOUT:g}, or 0 for no limit") from None
    return max(value, 0.0)


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
        return ep.load()
    box: dict[str, Any] = {}

    def load() -> None:
        try:
            box["plugin"] = ep.load()
        except BaseException as exc:  # noqa: BLE001 - SystemExit at import is a failure of that plugin too
            box["error"] = exc

    worker = threading.Thread(target=load, name=f"polyhal-load-{ep.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise PluginError(
            f"importing entry point {ep.value!r} did not finish within {timeout:g} s "
            "(POLYHAL_PLUGIN_TIMEOUT); the plugin was skipped. Raise POLYHAL_PLUGIN_TIMEOUT if it is only "
            "slow, set it to 0 if the plugin must import on the calling thread (e.g. it waits for a module "
            "that thread is importing), or uninstall it")
    if "error" in box:
        raise box["error"]
    return box["plugin"]


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name, "").strip()
    return [p.strip() for p in raw.split(",") if p.strip()] if raw else None


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
        self.generation = 0
        self._lock = threading.RLock()
        self._specs: list[DeviceSpec] | None = None
        self._backend_specs: dict[str, dict[str, DeviceSpec]] = {}  # see spec()
        self._devices: dict[str, Device] = {}
        self._broken: dict[str, PluginFailure] = {}  # devices whose factory raised
        self._listeners: list[Callable[[], Any]] = []
        self._plugin_passes: tuple[int, list[tuple[str, Any]]] | None = None  # (generation, records)
        self._preference = _env_list("POLYHAL_BACKENDS")
        #: The memoizing allocator selector of this registry (made by polyhal.policy.selector_for);
        #: kept here so that it lives and dies with its registry.
        self.allocator_selector: Any = None
        configure_logging()
        # Built-in policies are ordinary plugins, registered first so that they run last.
        for name in BUILTIN_PLUGINS:
            self.pm.register(importlib.import_module(name), name=name)
        if autoload is None:
            autoload = os.environ.get("POLYHAL_DISABLE_AUTOLOAD", "") not in ("1", "true", "yes")
        if autoload:
            self.load_entry_points()

    # -- loading ---------------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load every backend (respecting POLYHAL_BACKENDS) and every policy plugin."""
        wanted = self._preference
        backends = {ep.name: ep for ep in metadata.entry_points(group=BACKENDS_GROUP)}
        if wanted is not None:
            missing = [n for n in wanted if n not in backends]
            if missing:
                raise PluginError(
                    f"POLYHAL_BACKENDS names {missing}, which is not installed; installed backends: "
                    f"{sorted(backends) or 'none'}. Install the plugin (e.g. pip install polyhal-{missing[0]}) "
                    "or remove it from POLYHAL_BACKENDS")
        timeout = _plugin_timeout()
        for name, ep in sorted(backends.items()):
            if wanted is None or name in wanted:
                self._load(ep, loud=wanted is not None, timeout=timeout)
        for ep in sorted(metadata.entry_points(group=PLUGINS_GROUP), key=lambda e: e.name):
            self._load(ep, loud=False, timeout=timeout)

    def _load(self, ep: metadata.EntryPoint, *, loud: bool, timeout: float) -> None:
        # Logged before the import runs: a plugin that ends the process is the last one named.
        log.debug("loading plugin %r from entry point %r (group %s)", ep.name, ep.value, ep.group)
        try:
            plugin = _load_with_timeout(ep, timeout)
            self._check_api(plugin, ep.name)
            self.register(plugin, name=ep.name)
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
        log.debug("plugin %r loaded", ep.name)

    @staticmethod
    def _check_api(plugin: Any, name: str) -> None:
        declared = getattr(plugin, "POLYHAL_API_VERSION", None)
        if declared != hookspecs.API_VERSION:
            raise PluginError(
                f"plugin {name!r} declares POLYHAL_API_VERSION={declared!r}, but this polyhal implements "
                f"API version {hookspecs.API_VERSION}; upgrade the plugin (or polyhal) so that they match")

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
                self._specs = self._collect_specs()
            return list(self._specs)

    def spec(self, name: str) -> DeviceSpec:
        """The spec of device ``name``; an unknown name raises DeviceNotFoundError listing the devices.

        Until every device has been listed, a name ``<backend>:...`` asks only the plugin
        registered as ``<backend>`` (and takes its device of that name if it has one): a program
        run on ``cpu:0`` loads no OpenCL or CUDA driver. That is the same answer the full list
        gives, unless another plugin wraps ``register_devices`` (then the full list is asked) or
        registers a device of the same name first (the full list reports that duplicate).
        """
        with self._lock:
            if self._specs is None:
                found = self._specs_of_backend(name.partition(":")[0]).get(name)
                if found is not None:
                    return found
            for spec in self.device_specs():
                if spec.name == name:
                    return spec
        raise DeviceNotFoundError(
            f"unknown device {name!r}; available: {[s.name for s in self.device_specs()] or 'none'} "
            "(run `polyhal devices` to see every device and plugin)")

    def specs_of_plugin(self, plugin: str) -> list[DeviceSpec]:
        """The devices plugin ``plugin`` registers. Until every device has been listed, only that
        plugin is asked, as :meth:`spec` asks only a device's backend (checking one plugin's
        claims loads no other backend's driver); else, or where that plugin alone cannot answer
        (it registers no device, or another plugin wraps ``register_devices``), the full list."""
        with self._lock:
            if self._specs is None:
                found = self._specs_of_backend(plugin)
                if found:
                    return list(found.values())
            return [s for s in self.device_specs() if s.plugin == plugin]

    def specs_by_name(self) -> Mapping[str, DeviceSpec]:
        """A read-only mapping ``device name -> spec`` that looks names up through :meth:`spec`
        (iterating it lists every device)."""
        return _SpecsByName(self)

    def _specs_of_backend(self, backend: str) -> dict[str, DeviceSpec]:
        found = self._backend_specs.get(backend)
        if found is not None:
            return found
        found = {}
        plugin = self.pm.get_plugin(backend)
        impls = self.pm.hook.register_devices.get_hookimpls()
        others = [p for n, p in self.pm.list_name_plugin() if n != backend]
        if plugin is not None and not any(
                (impl.hookwrapper or impl.wrapper) and impl.plugin_name != backend for impl in impls):
            answers, failed = self.pm.each_answer("register_devices", leave_out=others)
            if not failed:  # a failure is recorded (and reported) by the full listing
                for _, specs in answers:
                    for spec in specs:
                        if self._validate_spec(spec) is None and spec.name not in found:
                            found[spec.name] = dataclasses.replace(spec, plugin=backend)
        self._backend_specs[backend] = found
        return found

    def _collect_specs(self) -> list[DeviceSpec]:
        self._failures = [f for f in self._failures if f.stage != "register_devices"]
        by_name: dict[str, DeviceSpec] = {}
        answers, failed = self.pm.each_answer("register_devices")  # registration order
        for plugin, exc in failed:
            self._fail(plugin, f"register_devices raised {type(exc).__name__}: {exc}", "register_devices")
        for plugin, specs in answers:
            for spec in specs:
                problem = self._validate_spec(spec)
                if problem:
                    self._fail(plugin, f"register_devices: {problem}", "register_devices")
                    continue
                if spec.name in by_name:
                    self._fail(plugin, (
                        f"register_devices: device name {spec.name!r} is registered by both plugin "
                        f"{by_name[spec.name].plugin!r} and plugin {plugin!r}; kept the first. "
                        "Rename one device or uninstall one plugin"), "register_devices")
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
            except PluginError:
                skipped.append(self._broken[spec.name].reason)
        raise DeviceNotFoundError("no device could be created: " + "; ".join(skipped)
                                  + " (run `polyhal devices` to see every device and plugin)")

    def default_devices(self) -> list[str]:
        """Every device not known to be broken, best first: the default ``--device`` list of a
        compile. Nothing is created here (placement reads kernel names from the specs); a device
        whose factory raises later is recorded as broken, and :func:`polyhal.compile` then places
        the program again without it (see :meth:`is_broken`)."""
        names = [spec.name for spec in self.device_specs() if spec.name not in self._broken]
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
            except Exception as exc:
                reason = (f"plugin {spec.plugin!r} could not create device {spec.name!r}: {type(exc).__name__}: "
                          f"{exc}. Set POLYHAL_BACKENDS to skip this backend, or name another device")
                self._broken[spec.name] = self._fail(spec.plugin, reason, "device", spec.name)
                log.debug("%s", reason)
                warnings.warn(f"polyhal: device {spec.name} is not used: {reason}", RuntimeWarning, stacklevel=4)
                raise PluginError(reason) from exc
            self._wrap_allocators(dev)
            self._devices[spec.name] = dev
            return dev

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
                answer = self.pm.first_answer(
                    "wrap_allocator", leave_out=[p for p in implementers if p is not plugin],
                    where=lambda: f"for {device.name} ({heap.memory_type.describe()})",
                    device=device, memory_type=heap.memory_type, allocator=allocator)
                result = answer.value
                if result is None:
                    continue
                if not isinstance(result, Allocator) or result.device is not device:
                    raise PluginError(
                        f"plugin {answer.plugin!r} returned {result!r} from wrap_allocator for {device.name}; it "
                        "must return an Allocator of that device (e.g. an adaptor over the one it was given) or None")
                allocator = result
            chosen[heap] = allocator
        wrapped = {h: a for h, a in chosen.items() if a is not base}
        if not wrapped:
            return
        if len(base.heaps) == 1:
            device.allocator = chosen[base.heaps[0]]
        else:
            device.allocator = MemoryTypeRouter(base, wrapped)

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
        return ("no device is available: install a backend (pip install polyhal-cpu) or check "
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
    """The process-wide registry, created (and plugins loaded) on first use."""
    global _default
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
