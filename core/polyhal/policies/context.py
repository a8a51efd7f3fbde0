"""What a device policy may read besides its hook arguments, and where it says why it chose.

``select_allocator`` receives (candidates, memory type, usage, flags) and returns an int. A policy
often needs more — the ordered ``--device`` list the program was compiled for (the ``lead``
policy), the op whose results are being placed (the ``cost`` policy), the registry — and explain
needs to know *why* it chose. Both travel through the :class:`Selection` that the core sets up
around every call it makes; a policy reads it with :func:`current` and records its reason with
:func:`record_reason`::

    @polyhal.hookimpl
    def select_allocator(candidates, memory_type, buffer_usage, flags):
        sel = polyhal.policy.current()
        if sel is not None and sel.workload is not None and sel.workload.op == "matmul":
            polyhal.policy.record_reason("matmuls go to the last candidate")
            return len(candidates) - 1
        return None

The selector notes which of ``devices`` / ``workload`` a decision read, so a policy that reads
neither is still computed once per (candidates, memory type, usage, flags): reading them is what
makes a decision depend on them (like an HTTP ``Vary`` header).

The active built-in policy and its settings are a :class:`PolicyConfig` per registry, read from
the environment (:class:`PolicySettings`: ``POLYHAL_POLICY``, ``POLYHAL_DEVICE_LEAD_ALLOCATOR``,
``POLYHAL_OOM_FALLBACK``) on first use and changed with :func:`configure_policy` (which drops every
memoized decision of that registry). Setting the lead allocator without a policy selects the
``lead`` policy (IREE's ``--device_lead_allocator``).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from polyhal.config import Choice, Flag, Integer, Settings, setting
from polyhal.errors import PluginError
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.hal.records import Workload  # noqa: F401  (re-exported: policies take it from here)
from polyhal.registry import Registry, default_registry

if TYPE_CHECKING:
    from polyhal.hal.records import DeviceSpec

#: The built-in policies, by the name ``--policy`` / ``POLYHAL_POLICY`` takes, and their plugin names.
BUILTIN_POLICIES = {
    "first": "polyhal.policies.first",
    "lead": "polyhal.policies.lead",
    "rank": "polyhal.policies.rank",
    "cost": "polyhal.policies.cost",
}
#: The plugin name under which explain reports the core's own last resort (first candidate).
CORE_DEFAULT = "polyhal (core default)"

_UNSET: Any = object()


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PolicyConfig:
    """The active built-in policy of a registry and its settings.

    :param policy: one of :data:`BUILTIN_POLICIES` (``first`` is IREE's default).
    :param lead_allocator: the ``lead`` policy's index into the ``--device`` list (``None``: 0).
    :param oom_fallback: when the chosen device cannot satisfy an allocation, try the other
        candidates (in the policy's order) before raising ``OutOfMemoryError``.
    """

    policy: str = "first"
    lead_allocator: int | None = None
    oom_fallback: bool = False

    def __post_init__(self) -> None:
        if self.policy not in BUILTIN_POLICIES:
            raise PluginError(
                f"unknown device policy {self.policy!r}; the built-in policies are "
                f"{', '.join(BUILTIN_POLICIES)} (a plugin overrides them all by implementing select_allocator)")
        lead = self.lead_allocator
        if lead is not None and (not isinstance(lead, int) or isinstance(lead, bool) or lead < 0):
            raise PluginError(f"the device lead allocator must be a device index >= 0, got {lead!r}")

    @classmethod
    def from_env(cls) -> "PolicyConfig":
        """The configuration :class:`PolicySettings` gives."""
        env = PolicySettings.from_env()
        policy = env.policy or ("lead" if env.lead_allocator is not None else "first")
        return cls(policy, env.lead_allocator, env.oom_fallback)


@dataclass(frozen=True)
class PolicySettings(Settings, component="policy"):
    """The environment's policy settings, read once per registry (:func:`policy_config`)."""

    policy: str | None = setting(
        "POLYHAL_POLICY", Choice(*BUILTIN_POLICIES), None,
        "the built-in device policy that answers after every user plugin has deferred (--policy)",
        shown="first (lead where POLYHAL_DEVICE_LEAD_ALLOCATOR is set)")
    lead_allocator: int | None = setting(
        "POLYHAL_DEVICE_LEAD_ALLOCATOR", Integer(low=0), None,
        "the lead policy's device: the Nth (from 0) of the --device list (--device-lead-allocator)",
        hint="set it to the position (from 0) of a device in the --device list")
    oom_fallback: bool = setting(
        "POLYHAL_OOM_FALLBACK", Flag(), False,
        "when the chosen device is out of memory, try the other candidates in the policy's order")


_configs: "weakref.WeakKeyDictionary[Registry, PolicyConfig]" = weakref.WeakKeyDictionary()
_configs_lock = threading.Lock()


def policy_config(registry: "Registry | None" = None) -> PolicyConfig:
    """The policy configuration of ``registry`` (default: the process-wide one)."""
    if registry is None:
        registry = default_registry()
    found = _configs.get(registry)
    if found is None:
        with _configs_lock:
            found = _configs.get(registry)
            if found is None:
                found = _configs[registry] = PolicyConfig.from_env()
    return found


def configure_policy(registry: "Registry | None" = None, *, policy: str | None = None,
                     lead_allocator: int | None = _UNSET, oom_fallback: bool | None = None) -> PolicyConfig:
    """Change the active built-in policy or its settings; returns the new configuration.

    Arguments left out keep their value. Every memoized decision of the registry is dropped
    (through the registry's change listeners), so allocation sites and later compiles re-decide.
    Giving a ``lead_allocator`` without a ``policy`` selects ``lead``, as the environment does.
    """
    if registry is None:
        registry = default_registry()
    old = policy_config(registry)
    changes: dict[str, Any] = {}
    if policy is not None:
        changes["policy"] = policy.strip().lower()
    if lead_allocator is not _UNSET:
        changes["lead_allocator"] = lead_allocator
        if policy is None and lead_allocator is not None:
            changes["policy"] = "lead"
    if oom_fallback is not None:
        changes["oom_fallback"] = bool(oom_fallback)
    new = replace(old, **changes)  # validates
    if new != old:
        with _configs_lock:
            _configs[registry] = new
        registry._changed()  # the registry's listeners drop memoized decisions
    return new


class Selection:
    """One ``select_allocator`` computation: what a policy may read, and what it reports.

    Read-only for policies: ``registry``, ``config`` (:class:`PolicyConfig`), ``policy`` (the active
    built-in's name), ``candidates``, ``memory_type``, ``buffer_usage``, ``flags``, and — recorded as
    dependencies of the decision when read — ``devices`` (the ordered ``--device`` list of the
    compile, ``()`` outside one) and ``workload`` (:class:`Workload`, ``None`` for a plain
    allocation). Policies report with :meth:`because` / :func:`record_reason`.
    """

    __slots__ = ("registry", "config", "candidates", "memory_type", "buffer_usage", "flags", "_devices",
                 "_workload", "read_devices", "read_workload", "reason", "ranking", "finish")

    def __init__(self, registry: "Registry", config: PolicyConfig, candidates: Sequence[tuple["DeviceSpec", int]],
                 memory_type: MemoryType, buffer_usage: BufferUsage, flags: int, devices: tuple[str, ...],
                 workload: Workload | None) -> None:
        self.registry = registry
        self.config = config
        self.candidates = tuple(candidates)
        self.memory_type = memory_type
        self.buffer_usage = buffer_usage
        self.flags = flags
        self._devices = devices
        self._workload = workload
        self.read_devices = False
        self.read_workload = False
        self.reason: str | None = None
        self.ranking: tuple[int, ...] | None = None
        self.finish: float | None = None

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def devices(self) -> tuple[str, ...]:
        self.read_devices = True
        return self._devices

    @property
    def workload(self) -> Workload | None:
        self.read_workload = True
        return self._workload

    def because(self, reason: str, ranking: Sequence[int] | None = None) -> None:
        """Record why the answer about to be returned was chosen; ``ranking`` (candidate indices,
        best first) is the order the out-of-memory fallback tries."""
        self.reason = str(reason)
        if ranking is not None:
            self.ranking = tuple(int(i) for i in ranking)

    def estimated(self, finish: float) -> None:
        """Report when the op will be done on the chosen candidate (seconds from the start of a
        run): placement keeps it as that device's busy time and its results' ready time, which
        later ops' workloads carry (``Workload.busy`` / ``input_ready``)."""
        self.finish = float(finish)


_tls = threading.local()


def current() -> Selection | None:
    """The selection being computed on this thread, or ``None`` outside ``select_allocator``."""
    return getattr(_tls, "selection", None)


def _enter(selection: Selection | None) -> Selection | None:
    previous = getattr(_tls, "selection", None)
    _tls.selection = selection
    return previous


def record_reason(reason: str, *, ranking: Sequence[int] | None = None) -> None:
    """Say why (for explain) from inside ``select_allocator``; a no-op when called elsewhere
    (e.g. when the hook is called directly through pluggy)."""
    sel = current()
    if sel is not None:
        sel.because(reason, ranking)


__all__ = [
    "BUILTIN_POLICIES", "CORE_DEFAULT", "PolicyConfig", "Selection", "Workload", "configure_policy", "current",
    "policy_config", "record_reason",
]
