"""Allocator adaptors chosen from the environment, as a built-in ``wrap_allocator`` plugin.

``POLYHAL_ALLOCATOR="pool,limit=512MiB,stats,log=/tmp/alloc.csv"`` wraps the allocator of every
device created afterwards, innermost first (here: a caching pool over the device's allocator, a
limit over the pool, statistics over that, logging outermost). Names are those of
:func:`polyhal.hal.adaptors.parse_adaptor_spec`. Unset, the hook leaves allocators alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Settings, Text, setting
from polyhal.hal.adaptors import parse_adaptor_spec
from polyhal.hookspecs import API_VERSION, hookimpl

POLYHAL_API_VERSION = API_VERSION


@dataclass(frozen=True)
class AllocatorSettings(Settings, component="allocator"):
    """The allocator adaptors the environment asks for, read as each device's allocator is made."""

    adaptors: str = setting(
        "POLYHAL_ALLOCATOR", Text(), "",
        "adaptors over every device's allocator, innermost first: pool[=MAX], limit=SIZE, stats, "
        "log[=PATH], fault=N (e.g. pool,limit=512MiB,stats)")


@hookimpl
def wrap_allocator(device, memory_type, allocator):
    """Stack the adaptors named in ``POLYHAL_ALLOCATOR`` (None when it is unset)."""
    spec = AllocatorSettings.from_env().adaptors
    if not spec:
        return None
    for make in parse_adaptor_spec(spec):
        allocator = make(allocator)
    return allocator
