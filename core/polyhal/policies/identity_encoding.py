"""The identity encoding resolver (IREE's ``#iree_encoding.identity_resolver``).

Registered before every backend, so it answers ``resolve_encoding`` last: any encoding that no
backend resolver claims -- on a backend without data tiling, or an encoding its resolver does
not know -- gets the dense row-major layout, and MaterializeEncoding folds its encode ops away.
"""

from __future__ import annotations

from polyhal.hookspecs import API_VERSION, hookimpl
from polyhal.ir.encoding import IdentityLayout

POLYHAL_API_VERSION = API_VERSION


@hookimpl(trylast=True)
def resolve_encoding(device, encoding, tensor_type):
    """The identity layout of ``tensor_type``, whatever the device and encoding."""
    return IdentityLayout(tensor_type)
