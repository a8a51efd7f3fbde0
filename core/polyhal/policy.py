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
from polyhal.ir.types import Affinity
from polyhal.policies.context import (
    BUILTIN_POLICIES, CORE_DEFAULT, PolicyConfig, Selection, Workload, _enter, configure_policy, current,
    policy_config, record_reason,
)
from polyhal.registry import Registry, default_registry

if TYPE_CHECKING:
    from polyhal.hal.buffer import Buffer

__all__ = [
    "AllocationSite", "AllocatorDecision", "AllocatorSelector", "BUILTIN_POLICIES", "OOMFallback", "PolicyConfig",
    "Selection", "Workload", "allocate", "configure_policy", "current", "explain", "policy_config",
    "decision_record", "explain_records", "format_decisions", "record_reason", "selector_for",
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
    #: When the op is estimated to be done on the chosen device (``Selection.estimated``), or None.
    finish: float | None = field(default=None, compare=False)

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
            # User plugins answer first (registered later); of the built-ins only the active policy answers.
            # A plugin that raises or answers out of range is skipped, with a warning.
            answer = self.registry.policy_answer(
                "select_allocator", where=lambda: f"for {MemoryType(memory_type).describe()} memory",
                check=lambda a: _bad_index(a, offered), candidates=offered, memory_type=memory_type,
                buffer_usage=usage, flags=flags)
        finally:
            _enter(previous)
        result, plugin = answer.value, answer.plugin
        if result is None:
            result, plugin = 0, CORE_DEFAULT
            sel.reason = "no select_allocator plugin answered; the core takes the first candidate"
        elif answer.changed_by_wrapper:
            sel.reason = (f"{plugin}'s hook wrapper replaced {answer.answered}'s answer"
                          + (f" ({sel.reason})" if sel.reason else ""))
        ranking = [i for i in (sel.ranking or ()) if 0 <= i < len(offered)]
        order = list(dict.fromkeys(ranking + list(range(len(offered)))))  # the ranking, then the rest
        index = serving[result]
        reason = sel.reason or f"chosen by {plugin} (it gave no reason: polyhal.policy.record_reason adds one)"
        depends = tuple(n for n, read in (("devices", sel.read_devices), ("workload", sel.read_workload)) if read)
        return AllocatorDecision(
            index, candidates[index], plugin, memory_type, usage, reason=reason, policy=config.policy,
            candidates=candidates, flags=flags, fallbacks=tuple(offered[i] for i in order if i != result),
            excluded=tuple(excluded), devices=devices, workload=workload, depends_on=depends, epoch=epoch,
            finish=None if answer.changed_by_wrapper else sel.finish)

    def decisions(self) -> list[tuple[tuple, AllocatorDecision]]:
        """Every memoized (key, decision); several keys may share one decision."""
        return list(self._memo.items())

    def computed(self) -> list[AllocatorDecision]:
        """Every decision computed since the last invalidation, in order (each one hook round)."""
        return list(self._computed)

    def explain(self) -> str:
        """Every decision: candidates, the chosen device, the plugin that chose it and why."""
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


def _bad_index(answer: Any, offered: Candidates) -> str | None:
    """What is wrong with a select_allocator answer (None: a valid index into ``offered``)."""
    result = answer.value
    if not isinstance(result, int) or isinstance(result, bool):
        return (f"plugin {answer.plugin!r} returned {result!r} from select_allocator; it must return an int "
                "index into candidates, or None to defer")
    if not 0 <= result < len(offered):
        return (f"plugin {answer.plugin!r} returned index {result} from select_allocator, but there are "
                f"{len(offered)} candidates ({[c[0].name for c in offered]})")
    return None


def _cannot_serve(spec: DeviceSpec, memory_type: MemoryType, usage: BufferUsage) -> str | None:
    """None when one of ``spec``'s heaps serves the request, else what the device does serve."""
    if any(h.serves(memory_type, usage) for h in spec.heaps):
        return None
    return "serves only " + ", ".join(f"{h.memory_type.describe()} ({h.allowed_usage.describe()})" for h in spec.heaps)


_selector_lock = threading.Lock()


def selector_for(registry: Registry | None = None) -> AllocatorSelector:
    """The memoizing allocator selector of a registry (one per registry; default: the process-wide).

    It is kept on the registry (``registry.allocator_selector``), so it lives exactly as long.
    """
    if registry is None:
        registry = default_registry()
    sel = registry.allocator_selector
    if sel is None:
        with _selector_lock:
            sel = registry.allocator_selector
            if sel is None:
                sel = registry.allocator_selector = AllocatorSelector(registry)
    return sel


def allocate(nbytes: int, affinity: "Affinity | str | Sequence[str]",
             memory_type: MemoryType = MemoryType.OPTIMAL | MemoryType.DEVICE_LOCAL,
             buffer_usage: BufferUsage = BufferUsage.DEFAULT, *, registry: Registry | None = None,
             fallback: bool | None = None) -> "Buffer":
    """Allocate on one device of ``affinity`` (``Optimal("cpu:0", "cpu:1")``, a name or names),
    chosen by the memoized ``select_allocator`` decision (with the out-of-memory fallback as
    configured). For a hot loop, keep an :class:`AllocationSite` from :meth:`AllocatorSelector.site`."""
    if isinstance(affinity, str):
        affinity = Affinity((affinity,))
    elif not isinstance(affinity, Affinity):
        affinity = Affinity(tuple(affinity))
    selector = selector_for(registry)
    specs = selector.registry.specs_by_name()
    candidates = []
    for name in affinity.devices:  # an unknown name fails in get_device, listing the devices
        spec = specs.get(name) or selector.registry.get_device(name).spec
        candidates.append((spec, affinity.queue_affinity))
    return selector.site(candidates, memory_type, buffer_usage).allocate(nbytes, fallback=fallback)


def explain(registry: Registry | None = None) -> str:
    """Every allocation decision of ``registry``'s selector, with the plugin that made it and why."""
    return selector_for(registry).explain()


# --------------------------------------------------------------------------------------------------
# Explaining decisions (polyhal.policy.explain, polyhal explain, polyhal demo --explain)
# --------------------------------------------------------------------------------------------------

def decision_record(d: AllocatorDecision) -> dict[str, Any]:
    """One decision as plain data (for ``--json`` and tests)."""
    return {
        "candidates": [spec.name for spec, _ in d.candidates],
        "queue_affinities": [q for _, q in d.candidates],
        "memory_type": MemoryType(d.memory_type).describe(),
        "buffer_usage": BufferUsage(d.buffer_usage).describe(),
        "flags": d.flags,
        "devices": list(d.devices) if "devices" in d.depends_on else None,
        "op": str(d.workload) if d.workload is not None and "workload" in d.depends_on else None,
        "chosen": d.device_name,
        "index": d.index,
        "plugin": d.plugin,
        "policy": d.policy,
        "reason": d.reason,
        "excluded": [{"device": n, "why": why} for n, why in d.excluded],
        "fallbacks": [spec.name for spec, _ in d.fallbacks],
        "depends_on": list(d.depends_on),
    }


def explain_records(selector: AllocatorSelector) -> dict[str, Any]:
    """The selector's configuration, counters, decisions and out-of-memory fallbacks as data."""
    cfg = policy_config(selector.registry)
    return {
        "policy": cfg.policy,
        "lead_allocator": cfg.lead_allocator,
        "oom_fallback": cfg.oom_fallback,
        "hits": selector.hits,
        "misses": selector.misses,
        "decisions": [decision_record(d) for d in selector.computed()],
        "oom_fallbacks": [{"chosen": e.decision.device_name, "allocated_on": e.device, "nbytes": e.nbytes,
                           "errors": list(e.errors)} for e in selector.oom_events],
    }


def format_decisions(selector: AllocatorSelector) -> str:
    """Every decision of ``selector`` as text (``AllocatorSelector.explain``)."""
    data = explain_records(selector)
    head = f"device policy {data['policy']!r}"
    if data["policy"] == "lead":
        head += f" (lead allocator {data['lead_allocator'] or 0})"
    head += (f"; out-of-memory fallback {'on' if data['oom_fallback'] else 'off'}; "
             f"{len(data['decisions'])} decisions computed, {data['misses']} hook rounds, {data['hits']} memo hits")
    lines = [head]
    for i, r in enumerate(data["decisions"]):
        what = r["op"] or "any allocation"
        lines.append(f"  [{i}] {what}: {r['memory_type']} for {r['buffer_usage']} among "
                     f"[{', '.join(r['candidates'])}] -> {r['chosen']}")
        lines.append(f"      by {r['plugin']}: {r['reason']}")
        if r["devices"] is not None:
            lines.append(f"      read the --device list {r['devices']}")
        for ex in r["excluded"]:
            lines.append(f"      excluded {ex['device']}: {ex['why']}")
        if r["fallbacks"]:
            lines.append(f"      if {r['chosen']} is out of memory: "
                         + (" then ".join(r["fallbacks"]) if data["oom_fallback"] else "error (fallback off)"))
    for e in data["oom_fallbacks"]:
        lines.append(f"  out of memory on {e['chosen']}: {e['nbytes']} B allocated on {e['allocated_on']} instead")
    return "\n".join(lines)
