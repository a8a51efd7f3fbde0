"""The registry: discovers plugins through entry points, validates and ranks their devices.

Environment:

``POLYHAL_BACKENDS=cuda,cpu``
    Allow-list of backend entry points, also the order of preference (it overrides ranks).
    A backend named here that is missing or fails to load is an error, not a skip.
``POLYHAL_DISABLE_AUTOLOAD=1``
    Load no entry points at all; register plugins in code.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import traceback
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Iterable

import pluggy

from polyhal import hookspecs
from polyhal.errors import DeviceNotFoundError, PluginError
from polyhal.hal.device import Device
from polyhal.hal.records import DeviceSpec

#: Entry-point group of backend plugins (filtered by POLYHAL_BACKENDS).
BACKENDS_GROUP = "polyhal.backends"
#: Entry-point group of policy and other non-backend plugins.
PLUGINS_GROUP = "polyhal.plugins"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that was skipped, and why."""

    plugin: str
    reason: str


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name, "").strip()
    return [p.strip() for p in raw.split(",") if p.strip()] if raw else None


class Registry:
    """Plugins, their devices and the devices created so far.

    ``generation`` increases whenever a plugin is registered or unregistered, so that caches
    built on top (device lists, memoized policy decisions) know to recompute.
    """

    def __init__(self, *, autoload: bool | None = None) -> None:
        self.pm = pluggy.PluginManager("polyhal")
        self.pm.add_hookspecs(hookspecs)
        self._failures: list[PluginFailure] = []
        self.generation = 0
        self._lock = threading.RLock()
        self._specs: list[DeviceSpec] | None = None
        self._devices: dict[str, Device] = {}
        self._listeners: list[Any] = []
        self._preference = _env_list("POLYHAL_BACKENDS")
        # Built-in policies are ordinary plugins, registered first so that they run last.
        from polyhal.policies import builtin_plugins

        for name, plugin in builtin_plugins():
            self.pm.register(plugin, name=name)
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
        for name, ep in sorted(backends.items()):
            if wanted is None or name in wanted:
                self._load(ep, loud=wanted is not None)
        for ep in sorted(metadata.entry_points(group=PLUGINS_GROUP), key=lambda e: e.name):
            self._load(ep, loud=False)

    def _load(self, ep: metadata.EntryPoint, *, loud: bool) -> None:
        try:
            plugin = ep.load()
            self._check_api(plugin, ep.name)
        except Exception as exc:  # any import-time failure must not take the others down
            reason = f"failed to load entry point {ep.value!r}: {type(exc).__name__}: {exc}"
            if isinstance(exc, PluginError):
                reason = str(exc)
            if loud:
                raise PluginError(
                    f"backend {ep.name!r} named in POLYHAL_BACKENDS cannot load: {reason}. Fix or "
                    f"uninstall the plugin package, or remove {ep.name!r} from POLYHAL_BACKENDS") from exc
            self._fail(ep.name, reason)
            return
        self.register(plugin, name=ep.name)

    @staticmethod
    def _check_api(plugin: Any, name: str) -> None:
        declared = getattr(plugin, "POLYHAL_API_VERSION", None)
        if declared != hookspecs.API_VERSION:
            raise PluginError(
                f"plugin {name!r} declares POLYHAL_API_VERSION={declared!r}, but this polyhal implements "
                f"API version {hookspecs.API_VERSION}; upgrade the plugin (or polyhal) so that they match")

    @property
    def failures(self) -> list[PluginFailure]:
        """Plugins skipped at load time or while registering devices, with the reason."""
        self.device_specs()  # device registration failures are found when devices are listed
        return list(self._failures)

    def _fail(self, plugin: str, reason: str) -> None:
        self._failures.append(PluginFailure(plugin, reason))

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

    def on_change(self, callback: Any) -> None:
        """Call ``callback()`` whenever a plugin is registered or unregistered (caches drop)."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        self.generation += 1
        self._specs = None
        for callback in self._listeners:
            callback()

    # -- devices -----------------------------------------------------------------------------------

    def device_specs(self) -> list[DeviceSpec]:
        """Every registered device, best first (POLYHAL_BACKENDS order, then rank, then name)."""
        with self._lock:
            if self._specs is None:
                self._specs = self._collect_specs()
            return list(self._specs)

    def _collect_specs(self) -> list[DeviceSpec]:
        self._failures = [f for f in self._failures if not f.reason.startswith("register_devices")]
        by_name: dict[str, DeviceSpec] = {}
        for impl in self.pm.hook.register_devices.get_hookimpls():  # registration order
            try:
                specs = list(impl.function() or ())
            except Exception as exc:
                self._fail(impl.plugin_name, f"register_devices raised {type(exc).__name__}: {exc}\n"
                           + "".join(traceback.format_exception_only(exc)).strip())
                continue
            for spec in specs:
                problem = self._validate_spec(spec)
                if problem:
                    self._fail(impl.plugin_name, f"register_devices: {problem}")
                    continue
                if spec.name in by_name:
                    self._fail(impl.plugin_name, (
                        f"register_devices: device name {spec.name!r} is registered by both plugin "
                        f"{by_name[spec.name].plugin!r} and plugin {impl.plugin_name!r}; kept the first. "
                        "Rename one device or uninstall one plugin"))
                    continue
                by_name[spec.name] = dataclasses.replace(spec, plugin=impl.plugin_name)
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
        """The created device for a name (``None``: the best-ranked one); creates it on first use."""
        if isinstance(device, Device):
            return device
        specs = self.device_specs()
        if device is None:
            if not specs:
                raise DeviceNotFoundError(
                    "no device is available: install a backend (pip install polyhal-cpu) or check "
                    "`polyhal devices` for plugins that failed to load")
            spec = specs[0]
        else:
            found = [s for s in specs if s.name == device]
            if not found:
                raise DeviceNotFoundError(
                    f"unknown device {device!r}; available: {[s.name for s in specs] or 'none'} "
                    "(run `polyhal devices` to see every device and plugin)")
            spec = found[0]
        with self._lock:
            dev = self._devices.get(spec.name)
            if dev is None:
                try:
                    dev = spec.factory(spec)
                except Exception as exc:
                    raise PluginError(
                        f"plugin {spec.plugin!r} could not create device {spec.name!r}: "
                        f"{type(exc).__name__}: {exc}. Set POLYHAL_BACKENDS to skip this backend") from exc
                from polyhal.hal.adaptors import apply_allocator_hooks

                apply_allocator_hooks(self, dev)  # plugins may wrap the allocator (wrap_allocator hook)
                self._devices[spec.name] = dev
            return dev

    def kernel_names(self, device: str) -> frozenset[str]:
        """The ops device ``device`` has kernels for, from its DeviceSpec: nothing is created,
        unless the spec declares none (``kernel_names=None``); then the device is asked."""
        for spec in self.device_specs():
            if spec.name == device:
                if spec.kernel_names is not None:
                    return spec.kernel_names
                break
        return self.get_device(device).kernel_names  # an unknown name fails here, listing the devices

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
        for impl in self.pm.hook.report_unavailable.get_hookimpls():
            try:
                reasons = list(impl.function() or ())
            except Exception as exc:
                reasons = [f"report_unavailable raised {type(exc).__name__}: {exc}"]
            if reasons:
                out[impl.plugin_name] = reasons
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
