"""The Ray backend's settings from the environment (:class:`RaySettings`), read when devices are
registered (the address) and when a node is reached (the timeouts)."""

from __future__ import annotations

from dataclasses import dataclass

from polyhal.config import Number, Settings, Text, setting

__all__ = ["RaySettings"]


@dataclass(frozen=True)
class RaySettings(Settings, component="Ray backend"):
    """What the environment says about the Ray backend."""

    address: str | None = setting(
        "POLYHAL_RAY_ADDRESS", Text(), None,
        "the Ray cluster whose nodes' devices polyhal registers as remote devices (host:port of its GCS, "
        "or 'auto'); unset: only a Ray already initialised in the process",
        shown="none (a Ray initialised in the process, else no remote devices)")
    connect_timeout: float = setting(
        "POLYHAL_RAY_CONNECT_TIMEOUT", Number("seconds", low=0), 10.0,
        "seconds to reach the cluster and each node's runtime before its devices are left out")
