"""The Ray backend's errors, and the polyhal error a node's failure becomes on the driver."""

from __future__ import annotations

import polyhal.errors as core_errors
from polyhal.errors import KernelError, PluginError, PolyhalError


class NodeLostError(PolyhalError, RuntimeError):
    """A Ray node (its polyhal runtime) died or became unreachable while it held work or data.

    ``node`` names it. Devices of other nodes, and local devices, go on working; the lost node's
    devices refuse further work with this error, and later compiles leave them out.
    """

    def __init__(self, message: str, *, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class VersionSkewError(PluginError):
    """A node whose polyhal (or polyhal-ray, or the plugin API) differs from the driver's: its
    devices are not registered. The message names the node and both versions."""


class ClusterUnreachableError(PluginError):
    """``POLYHAL_RAY_ADDRESS`` (or ``polyhal_ray.connect``'s address) names no reachable cluster."""


def rebuild(record: tuple, *, node: str, device: str | None = None) -> PolyhalError:
    """The driver-side error for a node's ``(class name, message)`` record: the same polyhal
    class where there is one (OutOfMemoryError, ShapeError, ...), a NodeLostError for a lost
    peer, else a KernelError naming the device."""
    name, message = record[0], record[1]
    if name == "NodeLostError":  # a peer node: the record names it
        return NodeLostError(message, node=record[2] if len(record) > 2 else node)
    cls = getattr(core_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, PolyhalError) and cls is not KernelError:
        try:
            return cls(message)
        except TypeError:
            pass
    return KernelError(message, device=device, plugin="ray")
