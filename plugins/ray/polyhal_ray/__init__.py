"""polyhal-ray: the devices of every node of a Ray cluster, as remote polyhal devices.

The modules, as in every backend: ``plugin`` (the hooks: which remote devices exist), ``device``
(RemoteDevice: kernels, data movement and queues, as commands of the node's stream),
``allocator`` (RemoteAllocator: memory on the node), plus ``cluster`` (reaching the cluster, one
NodeSession per node: the command stream, its completion and compiled graph), ``worker`` (the
NodeRuntime actor that runs on each node) and ``errors``. See docs/ray.md.
"""

from polyhal_ray.errors import ClusterUnreachableError, NodeLostError, VersionSkewError

__all__ = ["ClusterUnreachableError", "NodeLostError", "VersionSkewError"]
