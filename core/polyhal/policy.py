"""Memoized allocator selection over affinity sets (IREE's MemoizeDeviceSelection, at run time).

The ``select_allocator`` hook sees candidates, memory type, usage and flags but never the size,
so one decision per distinct key is computed and then reused. Decisions are dropped when the
registry changes (a plugin registered or unregistered).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

from polyhal.errors import PluginError
from polyhal.hal.flags import BufferUsage, MemoryType
from polyhal.hal.records import DeviceSpec
from polyhal.registry import Registry

#: IREE's limit on candidates of one selection.
MAX_CANDIDATES = 64

Candidates = tuple[tuple[DeviceSpec, int], ...]


@dataclass(frozen=True)
class AllocatorDecision:
    """One memoized decision: which candidate allocates, and which plugin chose it."""

    index: int
    candidate: tuple[DeviceSpec, int]
    plugin: str
    memory_type: MemoryType
    buffer_usage: BufferUsage

    @property
    def device_name(self) -> str:
        return self.candidate[0].name


class AllocatorSelector:
    """Calls ``select_allocator`` once per key and validates what the plugin returned."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._memo: dict[tuple, AllocatorDecision] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        #: Increases whenever decisions are dropped, so that allocation sites re-resolve.
        self.epoch = 0
        registry.on_change(self.clear)

    def clear(self) -> None:
        """Forget every decision (the registry calls this when plugins change)."""
        with self._lock:
            self._memo.clear()
            self.epoch += 1

    def site(self, candidates: Sequence[tuple[DeviceSpec, int]], memory_type: MemoryType,
             buffer_usage: BufferUsage = BufferUsage.DEFAULT, flags: int = 0) -> "AllocationSite":
        """An allocation site with constant inputs: its decision is resolved once and then read
        as an attribute (IREE's MemoizeDeviceSelection), until plugins change."""
        return AllocationSite(self, (tuple(candidates), memory_type, buffer_usage, flags))

    def select(self, candidates: Sequence[tuple[DeviceSpec, int]], memory_type: MemoryType,
               buffer_usage: BufferUsage = BufferUsage.DEFAULT, flags: int = 0) -> AllocatorDecision:
        """The decision for this key: from the memo (one dict lookup), or computed once."""
        found = self._memo.get((candidates, memory_type, buffer_usage, flags))
        if found is not None:
            self.hits += 1
            return found
        with self._lock:  # compute once even when several threads miss together
            key = (tuple(candidates), memory_type, buffer_usage, flags)
            found = self._memo.get(key)
            if found is None:
                self.misses += 1
                found = self._memo[key] = self._compute(key[0], memory_type, buffer_usage, flags)
            else:
                self.hits += 1
            return found

    def _compute(self, candidates: Candidates, memory_type: MemoryType, usage: BufferUsage,
                 flags: int) -> AllocatorDecision:
        if not 0 < len(candidates) <= MAX_CANDIDATES:
            raise PluginError(
                f"select_allocator needs 1 to {MAX_CANDIDATES} candidates, got {len(candidates)}; "
                "give the allocation an affinity with at least one device")
        # pluggy's firstresult order, called by hand so that the deciding plugin is known.
        for impl in reversed(self.registry.pm.hook.select_allocator.get_hookimpls()):
            try:
                result = impl.function(candidates=candidates, memory_type=memory_type,
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
            if not 0 <= result < len(candidates):
                raise PluginError(
                    f"plugin {impl.plugin_name!r} returned index {result} from select_allocator, but "
                    f"there are {len(candidates)} candidates ({[c[0].name for c in candidates]})")
            return AllocatorDecision(result, candidates[result], impl.plugin_name, memory_type, usage)
        raise PluginError("no select_allocator implementation returned a choice (is the default policy unregistered?)")

    def decisions(self) -> list[tuple[tuple, AllocatorDecision]]:
        """Every memoized (key, decision), for explain."""
        return list(self._memo.items())


class AllocationSite:
    """A place that allocates with constant (candidates, memory type, usage, flags).

    ``site.decision`` is the memoized decision: a compare and an attribute read while the
    registry is unchanged, a fresh (memoized) selection after it changed.
    """

    __slots__ = ("selector", "key", "_epoch", "_decision")

    def __init__(self, selector: AllocatorSelector, key: tuple) -> None:
        self.selector = selector
        self.key = key
        self._epoch = -1
        self._decision: AllocatorDecision | None = None

    @property
    def decision(self) -> AllocatorDecision:
        if self._epoch == self.selector.epoch:
            return self._decision  # type: ignore[return-value]
        self._epoch = self.selector.epoch
        self._decision = self.selector.select(*self.key)
        return self._decision
