"""A Ray cluster whose nodes all run on this machine and talk over 127.0.0.1 only: how the tests
and ``python -m bench ray`` run several nodes without a second machine, and without a byte
leaving the loopback interface.

Ray gives a node the address of the machine's interface unless told otherwise. The mechanism in
Ray 2.60: ``ray._private.services.get_node_ip_address()`` -- which every ``ray._private.node.Node``
started without ``node_ip_address`` takes, the head's, a worker node's and a joining driver's
alike -- answers ``127.0.0.1`` when ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` is false,
and that constant is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` read *once, when ray is imported*.
Setting the variable after ``import ray`` therefore changes nothing in this process: the nodes
came up on the interface address (192.0.2.2 on the VM this was written on). :func:`use_loopback`
sets both. (Passing ``node_ip_address="127.0.0.1"`` to every node and ``_node_ip_address`` to
``ray.init`` instead, with the constant left on, hung on that VM before the first task ran.)
"""

from __future__ import annotations

import os
import sys

__all__ = ["LOOPBACK", "LOOPBACK_ENV", "use_loopback", "node_addresses"]

#: The address every node of a loopback cluster has.
LOOPBACK = "127.0.0.1"

#: The environment of a loopback cluster's processes: Ray's own cluster mode off (so its address
#: is 127.0.0.1), and no token auth (Ray 2.60 turns it on for a head it starts).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def use_loopback() -> None:
    """Make the Ray nodes this process starts (``ray.cluster_utils.Cluster``, ``ray.init()``)
    and the processes they start take 127.0.0.1 as the machine's address. Call it before the
    first node starts; it works whether or not ``ray`` was imported already."""
    os.environ.update(LOOPBACK_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # read at import: set what the import read
        constants.ENABLE_RAY_CLUSTER = False


def node_addresses() -> dict[str, str]:
    """The address (``NodeManagerAddress``) of each alive node of the connected cluster, by node id."""
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
