"""polyhal's own policies, registered as ordinary plugins at the lowest priority."""

from __future__ import annotations

from types import ModuleType


def builtin_plugins() -> list[tuple[str, ModuleType]]:
    """(name, plugin) pairs the registry registers before any entry point."""
    from polyhal.policies import first

    return [("polyhal.policies.first", first)]
