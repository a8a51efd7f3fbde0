"""Plans specialized per concrete input shape, kept in a bounded LRU cache.

A shape-polymorphic program (an ONNX model whose inputs have symbolic dims, say) cannot be
compiled once: polyhal plans have static shapes, so that buffers are planned and kernels
prepared ahead of the run. Instead a plan is specialized for each concrete shape signature on
its first use and cached; later calls with that signature cost one dict lookup (the *shape
dispatch*: a tuple of the inputs' shapes as the key).

:class:`SpecializationCache` is that cache, front-end neutral: the key is whatever the caller
derives from the inputs, the value whatever it compiled. It is bounded (least recently used
specializations are evicted first, so a caller feeding ever-new shapes does not grow memory
without limit) and counts hits, misses and evictions for explain.

The capacity is ``capacity=`` where the cache is made, else ``POLYHAL_SHAPE_CACHE``, else
:data:`DEFAULT_CAPACITY`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, Hashable, TypeVar

from polyhal.config import Integer, Settings, setting
from polyhal.errors import ProgramError

__all__ = ["DEFAULT_CAPACITY", "Specialization", "SpecializationCache", "cache_capacity"]

#: Specializations kept per polymorphic plan unless told otherwise: a serving process sees a
#: handful of batch sizes; each specialization holds its plan's arenas, so the bound is memory.
DEFAULT_CAPACITY = 16

V = TypeVar("V")


@dataclass(frozen=True)
class ShapeCacheSettings(Settings, component="shape cache"):
    """The environment's capacity of the caches made without one (read as each cache is made)."""

    capacity: int = setting("POLYHAL_SHAPE_CACHE", Integer(low=1), DEFAULT_CAPACITY,
                            "shape specializations (compiled plans) kept per polymorphic program")


@dataclass(frozen=True)
class Specialization:
    """One concrete shape signature: the program specialized to it and its compiled plan."""

    program: Any  # polyhal.ir.program.Program (or a front end's subclass)
    plan: Any  # polyhal.plan.Plan


def cache_capacity(value: int | str | None = None) -> int:
    """The capacity to use: ``value`` if given, else ``POLYHAL_SHAPE_CACHE``, else the default."""
    if value is None:
        return ShapeCacheSettings.from_env().capacity
    try:
        capacity = int(value)
    except (TypeError, ValueError):
        capacity = 0
    if capacity < 1:
        raise ProgramError(f"shape cache capacity {value!r} is not a positive integer; give e.g. 16 "
                           "(cache_size=, POLYHAL_SHAPE_CACHE)")
    return capacity


class SpecializationCache(Generic[V]):
    """A bounded LRU map from a shape key to its specialization, with statistics.

    :meth:`get` is the hot path (one lookup and a move to the recent end). :meth:`get_or_make`
    makes a missing entry with ``make(key)`` outside of any lock held by callers' runs, so two
    threads that miss on the same key at once may both compile; the second result wins, which
    costs time but never correctness.
    """

    def __init__(self, capacity: int | str | None = None) -> None:
        self.capacity = cache_capacity(capacity)
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: Hashable) -> V | None:
        """The specialization for ``key``, or None (counted as a hit or not at all: a caller
        that then makes it counts the miss through :meth:`put`)."""
        entries = self._entries
        found = entries.get(key)
        if found is not None:
            self.hits += 1
            try:
                entries.move_to_end(key)
            except KeyError:  # evicted by another thread in between: still a valid result
                pass
        return found

    def put(self, key: Hashable, value: V) -> V:
        """Store ``value`` for ``key`` (a miss), evicting the least recently used beyond capacity."""
        with self._lock:
            self.misses += 1
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.evictions += 1
        return value

    def get_or_make(self, key: Hashable, make: Callable[[Hashable], V]) -> V:
        """The specialization for ``key``, made by ``make(key)`` and stored on a miss."""
        found = self.get(key)
        return found if found is not None else self.put(key, make(key))

    def keys(self) -> list[Hashable]:
        """Cached keys, least recently used first."""
        return list(self._entries)

    def values(self) -> list[V]:
        """Cached specializations, least recently used first."""
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every specialization (statistics are kept)."""
        with self._lock:
            self._entries.clear()

    def stats(self) -> dict[str, Any]:
        """``{"capacity", "size", "hits", "misses", "evictions"}``."""
        return {"capacity": self.capacity, "size": len(self._entries), "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}

    def explain(self, describe: Callable[[Hashable], str] = str) -> str:
        """One line of statistics, then one per cached key (most recent last) as ``describe`` writes it."""
        s = self.stats()
        lines = [f"shape cache: {s['size']} specialization(s) of at most {s['capacity']}; {s['hits']} hits, "
                 f"{s['misses']} misses (each one compile), {s['evictions']} evictions"]
        lines.extend(f"  {describe(k)}" for k in self._entries)
        return "\n".join(lines)
