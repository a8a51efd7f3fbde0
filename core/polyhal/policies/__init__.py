"""polyhal's own policies, registered as ordinary plugins at the lowest priority.

``first`` (default), ``lead``, ``rank`` and ``cost`` all implement ``select_allocator``; only the
one chosen with ``--policy`` / ``POLYHAL_POLICY`` (see :mod:`polyhal.policies.context`) answers, and
only after every user plugin has deferred. ``adaptors`` wraps allocators as ``POLYHAL_ALLOCATOR``
says.
"""

from __future__ import annotations

from types import ModuleType


def builtin_plugins() -> list[tuple[str, ModuleType]]:
    """(name, plugin) pairs the registry registers before any entry point."""
    from polyhal.policies import adaptors, cost, first, identity_encoding, lead, memory_space, rank

    # memory_space: the default select_memory_space (bufferization policy); first, so it runs last.
    # identity_encoding: the resolve_encoding of last resort (the dense layout for any encoding).
    return [("polyhal.policies.memory_space", memory_space),
            ("polyhal.policies.identity_encoding", identity_encoding),
            ("polyhal.policies.first", first), ("polyhal.policies.lead", lead),
            ("polyhal.policies.rank", rank), ("polyhal.policies.cost", cost),
            ("polyhal.policies.adaptors", adaptors)]
