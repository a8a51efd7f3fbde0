"""The default bufferization policy: the fastest memory space the kernel allows that fits.

Registered as an ordinary plugin before any other, so that any user plugin implementing
``select_memory_space`` answers first. For each scratch it walks the kernel's own order of
preference (``scratch.spaces``; by default private, workgroup, global) and returns the first
space that the data may live in and that has room left (``limits`` already excludes what the
kernel's earlier scratches took). ``None`` when nothing fits: the bufferize pass then raises a
:class:`~polyhal.hal.scratch.ScratchError` naming the kernel, the size and every limit.
"""

from __future__ import annotations

from polyhal.hal.scratch import first_fit
from polyhal.hookspecs import API_VERSION, hookimpl

POLYHAL_API_VERSION = API_VERSION


@hookimpl
def select_memory_space(device, kernel, scratch, limits):
    """First space of ``scratch.spaces`` that ``limits`` fits (private only for unshared data)."""
    return first_fit(scratch, limits)
