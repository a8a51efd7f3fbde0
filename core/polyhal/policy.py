"""Memoized allocator selection over affinity sets (IREE's MemoizeDeviceSelection, at run time).

The ``select_allocator`` hook sees candidates, memory type, usage and flags but never the size,
so one decision per distinct key is computed and then reused. Decisions are dropped when the
registry changes (a plugin registered or unregistered, the policy reconfigured).

Beyond the hook's arguments a policy may read the compile's ``--device`` list and the op being
placed (:func:`current`); a decision is keyed on those only when its policy read them, so the
``first``, ``rank`` and ``lead`` policies still compute one decision per (candidates, memory type,
usage, flags). Every decision keeps the plugin that made it and why (:func:`record_reason`), for
``plan.explain()``, :meth:`AllocatorSelector.explain` and ``polyhal explain``.

This module is also the policy API: :func:`configure_policy`, :func:`policy_config`,
:func:`current`, :func:`record_reason`, :class:`Workload`, :func:`allocate`.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from polyhal.errors import IncompatibleBufferError, OutOfMemoryError, PluginError
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.hal.records import DeviceSpec
from polyhal.policies.context import (
    BUILTIN_POLICIES, CORE_DEFAULT, PolicyConfig, Selection, Workload, _enter, configure_policy, current,
    policy_config, record_reason,
)
from polyhal.registry import Registry

if TYPE_CHECKING:
    from polyhal.hal.buffer import Buffer
    from polyhal.ir.types import Affinity

__all__ = [
    "AllocationSite", "AllocatorDecision", "AllocatorSelector", "BUILTIN_POLICIES", "OOMFallback", "PolicyConfig",
    "Selection", "Workload", "allocate", "configure_policy", "current", "explain", "policy_config",
    "record_reason", "selector_for",
]

#: IREE's limit on candidates of one selection.
MAX_CANDIDATES = 64

Candidates = tuple[tuple[DeviceSpec, int], ...]


@dataclass(frozen=True)
class AllocatorDecision:
    """One memoized decision: which candidate allocates, which plugin chose it and why.

    ``index`` is into the ``candidates`` the caller gave; ``fallbacks`` are the other serving
    candidates in the order the out-of-memory fallback tries them (the policy's ranking, else
    the program's order); ``excluded`` the (device, why) candidates that cannot serve the
    memory type / usage; ``depends_on`` which of ``"devices"`` / ``"workload"`` the policies read.
    """

    index: int
    candidate: tuple[DeviceSpec, int]
    plugin: str
    memory_type: MemoryType
    buffer_usage: BufferUsage
    reason: str = ""
    policy: str = "first"
    candidates: tuple[tuple[DeviceSpec, int], ...] = ()
    flags: int = 0
    fallbacks: tuple[tuple[DeviceSpec, int], ...] = ()
    excluded: tuple[tuple[str, str], ...] = ()
    devices: tuple[str, ...] = ()
    workload: Workload | None = None
    depends_on: tuple[str, ...] = ()
    #: The selector epoch it was computed in; allocation sites compare it to spot stale decisions.
    epoch: int = field(default=-1, compare=False, repr=False)

    @property
    def device_name(self) -> str:
        return self.candidate[0].name

    def __str__(self) -> str:
        return f"{self.device_name} by {self.plugin}: {self.reason}"


@dataclass(frozen=True)
class OOMFallback:
    """An allocation that the chosen device could not satisfy and another candidate did."""

    decision: AllocatorDecision
    device: str
    nbytes: int
    errors: tuple[str, ...]


class AllocatorSelector:
    """Calls ``select_allocator`` once per key and validates what the plugin returned."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._memo: dict[tuple, AllocatorDecision] = {}
        #: (candidates, memory type, usage, flags) -> decisions computed for it, each reusable for
        #: any devices / workload it did not read.
        self._vary: dict[tuple, list[AllocatorDecision]] = {}
        self._computed: list[AllocatorDecision] = []
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        #: Increases whenever decisions are dropped, so that allocation sites re-resolve.
        self.epoch = 0
        #: Recent allocations served by a fallback candidate (out of memory on the chosen one).
        self.oom_events: collections.deque[OOMFallback] = collections.deque(maxlen=256)
        registry.on_change(self.clear)

    def clear(self) -> None:
        """Forget every decision (the registry calls this when plugins or the policy change)."""
        # Lock-free on purpose: the registry calls this holding its own lock, while a policy
        # computing under self._lock may be waiting for that lock (device_specs). A computation
        # in flight stores into the dicts it started with, which are dropped here, and its
        # decision carries the epoch it started in, which sites see is stale.
        self.epoch += 1
        self._memo = {}
        self._vary = {}
        self._computed = []

    def site(self, candidates: Sequence[tuple[DeviceSpec, int]], memory_type: MemoryType,
             buffer_usage: BufferUsage = BufferUsage.DEFAULT, flags: int = 0, *,
             devices: Sequence[str] = (), workload: Workload | None = None) -> "AllocationSite":
        """An allocation site with constant inputs: its decision is resolved once and then read
        as an attribute (IREE's MemoizeDeviceSelection), until plugins or the policy change."""
        return AllocationSite(self, (tuple(candidates), memory_type, buffer_usage, flags, tuple(devices), workload))

    def select(self, candidates: Sequence[tuple[DeviceSpec, int]], memory_type: MemoryType,
               buffer_usage: BufferUsage = BufferUsage.DEFAULT, flags: int = 0, *,
               devices: Sequence[str] = (), workload: Workload | None = None) -> AllocatorDecision:
        """The decision for this key: from the memo (one dict lookup), or computed once.

        ``devices`` is the ordered ``--device`` list of the compile (the ``lead`` policy reads
        it) and ``workload`` the op whose results are allocated (the ``cost`` policy reads it).
        """
        try:
            found = self._memo.get((candidates, memory_type, buffer_usage, flags, devices, workload))
        except TypeError:  # lists given: normalise once, then the key hashes
            found = None
        if found is not None:
            self.hits += 1
            return found
        with self._lock:  # compute once even when several threads miss together
            epoch = self.epoch
            memo, vary, computed = self._memo, self._vary, self._computed
            key = (tuple(candidates), memory_type, buffer_usage, flags, tuple(devices), workload)
            found = memo.get(key)
            if found is None:
                for d in vary.get(key[:4], ()):
                    if ("devices" not in d.depends_on or d.devices == key[4]) and \
                            ("workload" not in d.depends_on or d.workload == workload):
                        found = d
                        break
                if found is None:
                    self.misses += 1
                    found = self._compute(*key, epoch=epoch)
                    vary.setdefault(key[:4], []).append(found)
                    computed.append(found)
                else:
                    self.hits += 1
                memo[key] = found
            else:
                self.hits += 1
            return found

    def _ordered_impls(self, config: PolicyConfig) -> list[Any]:
        """User plugins in pluggy's firstresult order, then the active built-in policy only."""
        impls = list(reversed(self.registry.pm.hook.select_allocator.get_hookimpls()))
        builtin = set(BUILTIN_POLICIES.values())
        active = BUILTIN_POLICIES[config.policy]
        return [i for i in impls if i.plugin_name not in builtin] + [i for i in impls if i.plugin_name == active]

    def _compute(self, candidates: Candidates, memory_type: MemoryType, usage: BufferUsage, flags: int,
                 devices: tuple[str, ...] = (), workload: Workload | None = None, *, epoch: int = -1
                 ) -> AllocatorDecision:
        if not 0 < len(candidates) <= MAX_CANDIDATES:
            raise PluginError(
                f"select_allocator needs 1 to {MAX_CANDIDATES} candidates, got {len(candidates)}; "
                "give the allocation an affinity with at least one device")
        config = policy_config(self.registry)
        # The core keeps only candidates that can serve the request, so that no policy has to
        # check (IREE's allocator selection queries buffer compatibility the same way).
        serving, excluded = [], []
        for i, (spec, _queues) in enumerate(candidates):
            why = _cannot_serve(spec, memory_type, usage)
            if why is None:
                serving.append(i)
            else:
                excluded.append((spec.name, why))
        if not serving:
            raise IncompatibleBufferError(
                f"no candidate can allocate {MemoryType(memory_type).describe()} memory for "
                f"{BufferUsage(usage).describe()}: " + "; ".join(f"{n} {why}" for n, why in excluded)
                + ". Ask for a memory type one of them serves, or add a device that serves it "
                "(`polyhal devices` lists memory types)")
        offered = tuple(candidates[i] for i in serving)
        sel = Selection(self.registry, config, offered, memory_type, usage, flags, devices, workload)
        previous = _enter(sel)
        try:
            # pluggy's firstresult order, called by hand so that the deciding plugin is known.
            for impl in self._ordered_impls(config):
                sel.reason, sel.ranking = None, None
                try:
                    result = impl.function(candidates=offered, memory_type=memory_type,
                                           buffer_usage=usage, flags=flags)
                except Exception as exc:
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} raised in select_allocator: {type(exc).__name__}: {exc}"
                    ) from exc
                if result is None:
                    continue
                if not isinstance(result, int) or isinstance(result, bool):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} returned {result!r} from select_allocator; it must "
                        "return an int index into candidates, or None to defer")
                if not 0 <= result < len(offered):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} returned index {result} from select_allocator, but "
                        f"there are {len(offered)} candidates ({[c[0].name for c in offered]})")
                plugin = impl.plugin_name
                break
            else:
                result, plugin = 0, CORE_DEFAULT
                sel.reason = "no select_allocator plugin answered; the core takes the first candidate"
        finally:
            _enter(previous)
        ranking = [i for i in (sel.ranking or ()) if 0 <= i < len(offered)]
        order = list(dict.fromkeys(ranking + list(range(len(offered)))))  # the ranking, then the rest
        index = serving[result]
        reason = sel.reason or f"chosen by {plugin} (it gave no reason: polyhal.policy.record_reason adds one)"
        depends = tuple(n for n, read in (("devices", sel.read_devices), ("workload", sel.read_workload)) if read)
        return AllocatorDecision(
            index, candidates[index], plugin, memory_type, usage, reason=reason, policy=config.policy,
            candidates=candidates, flags=flags, fallbacks=tuple(offered[i] for i in order if i != result),
            excluded=tuple(excluded), devices=devices, workload=workload, depends_on=depends, epoch=epoch)

    def decisions(self) -> list[tuple[tuple, AllocatorDecision]]:
        """Every memoized (key, decision); several keys may share one decision."""
        return list(self._memo.items())

    def computed(self) -> list[AllocatorDecision]:
        """Every decision computed since the last invalidation, in order (each one hook round)."""
        return list(self._computed)

    def explain(self) -> str:
        """Every decision: candidates, the chosen device, the plugin that chose it and why."""
        from polyhal.explain import format_decisions

        return format_decisions(self)

    # -- allocating through a decision -------------------------------------------------------------

    def _allocator(self, device: str) -> Any:
        dev = self.registry._devices.get(device) or self.registry.get_device(device)
        return dev.allocator

    def _fallback(self, decision: AllocatorDecision, nbytes: int, exc: OutOfMemoryError,
                  fallback: bool | None) -> "Buffer":
        enabled = policy_config(self.registry).oom_fallback if fallback is None else fallback
        others = [spec.name for spec, _q in decision.fallbacks]
        if not enabled or not others:
            hint = ""
            if others:
                hint = (f" The other candidates {others} were not tried: enable the out-of-memory fallback "
                        "(POLYHAL_OOM_FALLBACK=1, --oom-fallback, or polyhal.policy.configure_policy(oom_fallback=True))")
            raise OutOfMemoryError(f"{exc} [{decision.device_name} was chosen by {decision.plugin}: "
                                   f"{decision.reason}].{hint}") from exc
        errors = [f"{decision.device_name}: {exc}"]
        for spec, _q in decision.fallbacks:
            try:
                buf = self._allocator(spec.name).allocate(nbytes, decision.memory_type, decision.buffer_usage)
            except OutOfMemoryError as again:
                errors.append(f"{spec.name}: {again}")
                continue
            self.oom_events.append(OOMFallback(decision, spec.name, nbytes, tuple(errors)))
            return buf
        raise OutOfMemoryError(
            f"out of memory on every candidate for {nbytes} bytes of {MemoryType(decision.memory_type).describe()} "
            f"(tried in the policy's order): " + " | ".join(errors)) from exc


class AllocationSite:
    """A place that allocates with constant (candidates, memory type, usage, flags).

    ``site.decision`` is the memoized decision: a compare and an attribute read while the
    registry is unchanged, a fresh (memoized) selection after it changed.
    """

    __slots__ = ("selector", "key", "_decision")

    def __init__(self, selector: AllocatorSelector, key: tuple) -> None:
        self.selector = selector
        self.key = key
        self._decision: AllocatorDecision = _UNRESOLVED

    @property
    def decision(self) -> AllocatorDecision:
        # One load of the decision, which carries its epoch: threads resolving the same site
        # across an invalidation can never pair a new epoch with an old decision.
        d = self._decision
        if d.epoch == self.selector.epoch:
            return d
        candidates, memory_type, usage, flags, devices, workload = self.key
        d = self._decision = self.selector.select(candidates, memory_type, usage, flags, devices=devices,
                                                  workload=workload)
        return d

    def allocate(self, nbytes: int, *, fallback: bool | None = None) -> "Buffer":
        """Allocate ``nbytes`` on the decided device. When it is out of memory and the fallback is
        on (``fallback``, else the policy configuration), try the other candidates in the policy's
        order; otherwise raise an ``OutOfMemoryError`` that says who chose the device and why."""
        decision = self.decision
        try:
            return self.selector._allocator(decision.device_name).allocate(nbytes, self.key[1], self.key[2])
        except OutOfMemoryError as exc:
            return self.selector._fallback(decision, nbytes, exc, fallback)


#: What a site holds before its first resolution (an epoch no selector has).
_UNRESOLVED: Any = type("_Unresolved", (), {"epoch": -1})()


def _cannot_serve(spec: DeviceSpec, memory_type: MemoryType, usage: BufferUsage) -> str | None:
    """None when one of ``spec``'s heaps serves the request, else what the device does serve."""
    wanted = BufferUsage(usage) & ~BufferUsage.MAPPING_OPTIONAL
    if any(h.serves(memory_type, wanted) for h in spec.heaps):
        return None
    return "serves only " + ", ".join(f"{h.memory_type.describe()} ({h.allowed_usage.describe()})" for h in spec.heaps)


_selectors: dict[int, AllocatorSelector] = {}
_selectors_lock = threading.Lock()


def selector_for(registry: Registry | None = None) -> AllocatorSelector:
    """The memoizing allocator selector of a registry (one per registry; default: the process-wide)."""
    if registry is None:
        from polyhal.registry import default_registry

        registry = default_registry()
    sel = _selectors.get(id(registry))
    if sel is None or sel.registry is not registry:
        with _selectors_lock:
            sel = _selectors.get(id(registry))
            if sel is None or sel.registry is not registry:
                sel = _selectors[id(registry)] = AllocatorSelector(registry)
    return sel


def allocate(nbytes: int, affinity: "Affinity | str | Sequence[str]",
             memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
             buffer_usage: BufferUsage = BufferUsage.DEFAULT, *, registry: Registry | None = None,
             fallback: bool | None = None) -> "Buffer":
    """Allocate on one device of ``affinity`` (``Optimal("cpu:0", "cpu:1")``, a name or names),
    chosen by the memoized ``select_allocator`` decision (with the out-of-memory fallback as
    configured). For a hot loop, keep an :class:`AllocationSite` from :meth:`AllocatorSelector.site`."""
    from polyhal.ir.types import Affinity

    if isinstance(affinity, str):
        affinity = Affinity((affinity,))
    elif not isinstance(affinity, Affinity):
        affinity = Affinity(tuple(affinity))
    selector = selector_for(registry)
    specs = {s.name: s for s in selector.registry.device_specs()}
    candidates = []
    for name in affinity.devices:  # an unknown name fails in get_device, listing the devices
        spec = specs.get(name) or selector.registry.get_device(name).spec
        candidates.append((spec, affinity.queue_affinity))
    return selector.site(candidates, memory_type, buffer_usage).allocate(nbytes, fallback=fallback)


def explain(registry: Registry | None = None) -> str:
    """Every allocation decision of ``registry``'s selector, with the plugin that made it and why."""
    return selector_for(registry).explain()
