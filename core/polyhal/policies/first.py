"""The ``first`` policy (default): the first candidate allocates, as in IREE without a device policy.

Active when ``--policy first`` / ``POLYHAL_POLICY=first`` or nothing is set. Like every built-in
policy it answers only after all user plugins have deferred.
"""

from __future__ import annotations

from polyhal.hookspecs import API_VERSION, hookimpl
from polyhal.policies.context import current

POLYHAL_API_VERSION = API_VERSION
NAME = "first"


@hookimpl
def select_allocator(candidates, memory_type, buffer_usage, flags):
    """Choose candidate 0. Outside the selector (a direct pluggy call) it is the answer of last resort."""
    sel = current()
    if sel is not None:
        if sel.policy != NAME:
            return None  # another built-in policy is active
        sel.because("first candidate (the default policy, as IREE's)")
    return 0
