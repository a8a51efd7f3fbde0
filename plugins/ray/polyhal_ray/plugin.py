"""The Ray backend's hooks: every device of every node of a reachable Ray cluster, as a remote device.

A cluster is reachable when ``POLYHAL_RAY_ADDRESS`` names one (``host:port`` of its head, or
``auto``) or when Ray is already initialised in this process (``ray.init(...)`` before polyhal
lists devices). Then each alive node gets a polyhal runtime actor
(:class:`~polyhal_ray.worker.NodeRuntime`), which reports the node's own devices; each becomes
``ray:<node>/<name>`` (``ray:1a2b3c4d/cpu:0``, ``ray:1a2b3c4d/cuda:0``) with the node device's
memory types (as device-local memory the driver cannot map), limits and kernel set, ranked 1000
below it, so below every local device. Nodes whose polyhal differs from the driver's are left
out, and so are nodes that died. When no cluster is reachable nothing is registered and
:func:`report_unavailable` says why. Ray is imported only when a cluster is asked for.
"""

from __future__ import annotations

import functools
import sys
import threading

import polyhal
from polyhal.hal.records import DeviceSpec

from polyhal_ray import worker
from polyhal_ray.settings import RaySettings

POLYHAL_API_VERSION = polyhal.API_VERSION

#: How far below its node's own rank a remote device ranks (local devices rank -100 and up).
RANK_OFFSET = 1000

_lock = threading.Lock()
_cluster = None            # the Cluster of this process, reused by every registry
_unavailable: list[str] = []


def cluster():
    """The connected :class:`~polyhal_ray.cluster.Cluster` (discovering nodes on first use and
    nodes that joined since), or None with the reason in :func:`report_unavailable`."""
    global _cluster
    settings = RaySettings.from_env()
    with _lock:
        if not settings.address and ("ray" not in sys.modules or not sys.modules["ray"].is_initialized()):
            _unavailable[:] = ["no Ray cluster: POLYHAL_RAY_ADDRESS is unset and Ray is not initialised in this "
                               "process (set POLYHAL_RAY_ADDRESS=host:port, or call ray.init() first)"]
            return None
        from polyhal_ray.cluster import Cluster, ClusterUnreachableError, alive_node_ids, connect

        try:
            connect(settings.address, settings.connect_timeout)
        except ClusterUnreachableError as exc:
            _unavailable[:] = [str(exc)]
            return None
        if _cluster is None or set(alive_node_ids()) - set(_cluster.sessions) - _cluster.refused:
            _cluster = Cluster.discover(settings.connect_timeout, _cluster)
        _unavailable[:] = list(_cluster.unavailable)
        return _cluster


def device_specs(found) -> list[DeviceSpec]:
    """The remote devices of every live node of ``found`` (a Cluster)."""
    from polyhal_ray.allocator import remote_heap
    from polyhal_ray.cluster import alive_node_ids
    from polyhal_ray.device import RemoteDevice

    alive = alive_node_ids()
    specs = []
    for node_id, session in found.sessions.items():
        if session.lost is not None or node_id not in alive:
            continue
        memory = session.description["memory_available"]
        for d in session.description["devices"]:
            node_heaps = tuple(d["heaps"])
            limits = dict(d["limits"], node=node_id, node_device=d["name"])
            if "host" in d["capabilities"] and isinstance(memory, int):
                limits["global_mem_size"] = memory  # the node's host memory, as it reported it
            specs.append(DeviceSpec(
                name=f"ray:{session.name}/{d['name']}", backend="ray", rank=d["rank"] - RANK_OFFSET,
                factory=functools.partial(RemoteDevice, session=session, local_name=d["name"],
                                          node_heaps=node_heaps, storage_ops=frozenset(d.get("storage_ops", ()))),
                heaps=tuple(remote_heap(h) for h in node_heaps), workgroup_bytes=d["workgroup_bytes"],
                capabilities=frozenset(d["capabilities"] - {"host", "data-tiling"}) | {"remote"},
                limits=limits, kernel_names=frozenset(d["kernel_names"]),
                description=f"{d['description']} on Ray node {session.name}"))
    return specs


@polyhal.hookimpl
def register_devices():
    """The remote devices of the reachable cluster; none (with a reason) when there is none."""
    if worker.SERVING:
        return []
    found = cluster()
    return device_specs(found) if found is not None else []


@polyhal.hookimpl
def report_unavailable():
    """Why no (or fewer) remote devices were registered: no cluster, an unreachable address,
    nodes whose versions differ from this driver's, nodes lost."""
    if worker.SERVING:
        return []
    lost = [str(s.lost) for s in (_cluster.sessions.values() if _cluster is not None else ()) if s.lost]
    return list(_unavailable) + lost


_links: dict[tuple, float] = {}


def _link_end(spec: DeviceSpec):
    """``spec``'s end of a link for :func:`~polyhal_ray.cluster.measure_bandwidth`: None for a
    device of this process, else its node session, name there and memory type there."""
    if spec.backend != "ray":
        return None
    partial = spec.factory
    return (partial.keywords["session"], partial.keywords["local_name"],
            int(partial.keywords["node_heaps"][0].memory_type))


@polyhal.hookimpl
def link_bandwidth(src, dst):
    """Links to, from and between remote devices, measured once per pair of nodes (this process
    counting as one) by moving 4 MiB the way a plan does, so that the cost policy prices a remote
    device's data movement as it is; None for links of local devices, and between two devices of
    one node (the node's own backend knows those)."""
    if worker.SERVING or "ray" not in (src.backend, dst.backend):
        return None
    a, b = _link_end(src), _link_end(dst)
    key = (a[0].node_id if a else None, b[0].node_id if b else None)
    if key[0] == key[1]:
        return None
    if key not in _links:
        from polyhal_ray.cluster import measure_bandwidth

        _links[key] = measure_bandwidth(a, b)
    return _links[key]
