"""Plugin commons of the CUDA and HIP backends: the enumeration record. (Their settings from
the environment are records of their own: ``polyhal_cuda.settings``, ``polyhal_hip.settings``.)"""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.hal.records import DeviceSpec


@dataclass(frozen=True)
class Enumeration:
    """What one look at a backend's devices found: device specs, and why any are missing."""

    specs: tuple[DeviceSpec, ...]
    reasons: tuple[str, ...]
