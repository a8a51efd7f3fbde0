"""Plugin commons of the CUDA and HIP backends: the enumeration record and the settings that
come from the environment (rank, pool)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import polyhal
from polyhal.hal.records import DeviceSpec


@dataclass(frozen=True)
class Enumeration:
    """What one look at a backend's devices found: device specs, and why any are missing."""

    specs: tuple[DeviceSpec, ...]
    reasons: tuple[str, ...]


def rank_from_env(variable: str, default: int) -> int:
    """The integer in environment ``variable`` (one rank for every device of the backend), or
    ``default`` where it is unset; a :class:`~polyhal.PluginError` where it is not an integer."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise polyhal.PluginError(f"{variable}={raw!r} is not an integer") from None


def choice_from_env(variable: str, choices: Sequence[str], default: str) -> str:
    """Environment ``variable`` (case-insensitive) if it is one of ``choices``, ``default``
    where it is unset or empty; a :class:`~polyhal.PluginError` otherwise."""
    raw = os.environ.get(variable, default).strip().lower() or default
    if raw not in choices:
        raise polyhal.PluginError(f"{variable}={raw!r}; use one of {tuple(choices)}")
    return raw
