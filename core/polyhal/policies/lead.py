"""The ``lead`` policy: one lead device allocates whatever several devices share (IREE's
``--device_lead_allocator``).

``--device-lead-allocator=N`` / ``POLYHAL_DEVICE_LEAD_ALLOCATOR=N`` names the Nth device (from 0)
of the ``--device`` list the program was compiled for (``polyhal.compile(program, devices=[...])``;
outside a compile, the registry's device order as ``polyhal devices`` lists it). When that device
is one of the candidates it allocates; otherwise the first candidate does. An index beyond the
list is an error, not a silent fallback: it is a typo in a flag.
"""

from __future__ import annotations

from polyhal.errors import PluginError
from polyhal.hookspecs import API_VERSION, hookimpl
from polyhal.policies.context import current

POLYHAL_API_VERSION = API_VERSION
NAME = "lead"


@hookimpl
def select_allocator(candidates, memory_type, buffer_usage, flags):
    """The lead device when it is a candidate, else the first candidate."""
    sel = current()
    if sel is None or sel.policy != NAME:
        return None
    n = sel.config.lead_allocator or 0
    devices, source = sel.devices, "--device list"
    if not devices:
        devices, source = tuple(s.name for s in sel.registry.device_specs()), "registry's device list"
    if n >= len(devices):
        raise PluginError(
            f"the device lead allocator is {n} (--device-lead-allocator / POLYHAL_DEVICE_LEAD_ALLOCATOR), but "
            f"the {source} has {len(devices)} device(s) {list(devices)}; use an index from 0 to {len(devices) - 1}")
    lead = devices[n]
    names = [spec.name for spec, _ in candidates]
    if lead in names:
        i = names.index(lead)
        sel.because(f"lead allocator: {lead} is device {n} of the {source} and a candidate",
                    [i] + [j for j in range(len(names)) if j != i])
        return i
    sel.because(f"lead allocator {lead} (device {n} of the {source}) is not a candidate; first candidate")
    return 0
