"""The default allocation policy: the first candidate allocates (IREE's default)."""

from __future__ import annotations

from polyhal.hookspecs import API_VERSION, hookimpl

POLYHAL_API_VERSION = API_VERSION


@hookimpl
def select_allocator(candidates, memory_type, buffer_usage, flags):
    """Choose candidate 0, as IREE does when no device policy is set."""
    return 0
