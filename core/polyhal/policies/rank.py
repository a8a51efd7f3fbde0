"""The ``rank`` policy: the candidate of highest ``DeviceSpec.rank`` allocates (decentralised
ranking: each backend ranks its own devices when it registers them).

Ties go to the earlier candidate, so the program's order still decides among equals. The
out-of-memory fallback tries the others from highest rank down.
"""

from __future__ import annotations

from polyhal.hookspecs import API_VERSION, hookimpl
from polyhal.policies.context import current

POLYHAL_API_VERSION = API_VERSION
NAME = "rank"


@hookimpl
def select_allocator(candidates, memory_type, buffer_usage, flags):
    """The highest-ranked candidate; the earliest among equals."""
    sel = current()
    if sel is None or sel.policy != NAME:
        return None
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i][0].rank, i))
    best = order[0]
    ranks = ", ".join(f"{spec.name}={spec.rank}" for spec, _ in candidates)
    tie = sum(spec.rank == candidates[best][0].rank for spec, _ in candidates) > 1
    sel.because(f"highest rank {candidates[best][0].rank} ({ranks})" + ("; earliest of equals" if tie else ""), order)
    return best
