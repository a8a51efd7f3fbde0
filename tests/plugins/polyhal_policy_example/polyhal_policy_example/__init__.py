"""An example device policy plugin: device-local buffers go to the last candidate (say, the
accelerator a program lists last), everything else is left to the built-in policy."""

import polyhal
from polyhal import MemoryType

POLYHAL_API_VERSION = polyhal.API_VERSION


@polyhal.hookimpl
def select_allocator(candidates, memory_type, buffer_usage, flags):
    """The last candidate for device-local memory; defer (None) for anything host-visible."""
    if memory_type & MemoryType.HOST_VISIBLE:
        return None
    polyhal.policy.record_reason("polyhal-policy-example: device-local memory goes to the last candidate")
    return len(candidates) - 1
