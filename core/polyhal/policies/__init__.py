"""polyhal's own policies, registered as ordinary plugins at the lowest priority.

``first`` (default), ``lead``, ``rank`` and ``cost`` all implement ``select_allocator``; only the
one chosen with ``--policy`` / ``POLYHAL_POLICY`` (see :mod:`polyhal.policies.context`) answers, and
only after every user plugin has deferred. ``memory_space`` is the default ``select_memory_space``,
``identity_encoding`` the ``resolve_encoding`` of last resort, and ``adaptors`` wraps allocators as
``POLYHAL_ALLOCATOR`` says. The registry imports them by name (``polyhal.registry.BUILTIN_PLUGINS``)
and registers them before any other plugin, so that they answer last.
"""
