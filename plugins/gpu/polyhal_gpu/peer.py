"""GPU-to-GPU transfers that CUDA and HIP share: peer access per device pair, and the words
explain uses for each path.

Two GPUs of one host copy directly (``cudaMemcpyPeerAsync`` / ``hipMemcpyPeerAsync``) when the
topology allows (``cudaDeviceCanAccessPeer``: NVLink, or PCIe under one root complex); peer
access is then enabled once per pair, from the destination (``cudaDeviceEnablePeerAccess``).
Where it does not, the copy is staged through pinned host memory: device-to-host on the source's
stream, then host-to-device on the destination's.
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["PEER_COPY", "STAGED_NO_PEER", "PeerAccess"]

#: The path of a direct GPU-to-GPU copy, as explain prints it.
PEER_COPY = "peer copy"
#: The path of a GPU-to-GPU copy without peer access, as explain prints it.
STAGED_NO_PEER = "staged through pinned host memory (no peer access)"


class PeerAccess:
    """Whether GPU ``dst`` reads GPU ``src`` directly, asked once per ordered pair and enabled the
    first time: ``can_access(dst, src) -> bool`` is the runtime's ``DeviceCanAccessPeer`` and
    ``enable(dst, src)`` makes ``dst`` current and enables access to ``src`` (an "already
    enabled" status is the caller's to ignore). ``override`` (tests, tools) forces an answer for
    a pair, as a topology without peer access would give."""

    def __init__(self, can_access: Callable[[int, int], bool], enable: Callable[[int, int], None]) -> None:
        self._can_access, self._enable = can_access, enable
        self._known: dict[tuple[int, int], bool] = {}
        self._lock = threading.Lock()
        self.override: dict[tuple[int, int], bool] = {}

    def __call__(self, src: int, dst: int) -> bool:
        forced = self.override.get((src, dst))
        if forced is not None:
            return forced
        known = self._known.get((src, dst))
        if known is None:
            with self._lock:
                known = self._known.get((src, dst))
                if known is None:
                    known = src == dst or bool(self._can_access(dst, src))
                    if known and src != dst:
                        self._enable(dst, src)
                    self._known[(src, dst)] = known
        return known

    def path(self, src: int, dst: int) -> str:
        """How a copy from GPU ``src`` to GPU ``dst`` goes, in explain's words."""
        if src == dst:
            return "device copy"
        return PEER_COPY if self(src, dst) else STAGED_NO_PEER
