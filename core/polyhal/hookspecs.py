"""The whole plugin contract of polyhal, in one module.

A plugin is a module or object with functions marked ``@polyhal.hookimpl`` whose names are the
hooks below. Backends are installed as distributions with an entry point in the group
``polyhal.backends``; policy plugins use the same group, or are registered in code with
``polyhal.default_registry().register(obj)``.

Every plugin module declares ``POLYHAL_API_VERSION = 1`` (see :data:`API_VERSION`); a plugin
declaring another major version is skipped with its reason shown by ``polyhal devices``.

Hooks are grouped under banner comments: device registration, allocation policy. Later issues
add encoding resolution and memory-space selection here, so a plugin author still learns the
whole contract from this one file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import pluggy

if TYPE_CHECKING:
    from polyhal.hal.flags import BufferUsage, MemoryType
    from polyhal.hal.records import DeviceSpec

#: The plugin API version this core implements. Plugins declare the one they were written for.
API_VERSION = 1

hookspec = pluggy.HookspecMarker("polyhal")
hookimpl = pluggy.HookimplMarker("polyhal")


# --------------------------------------------------------------------------------------------------
# Device registration
# --------------------------------------------------------------------------------------------------

@hookspec
def register_devices() -> Iterable["DeviceSpec"]:
    """Register the devices this plugin provides.

    Called for every plugin (not firstresult); results are concatenated. Enumeration must be
    cheap and create nothing: each :class:`~polyhal.hal.records.DeviceSpec` carries a
    ``factory`` that the core calls on first use. A backend that finds no hardware returns an
    empty list and may say why through :func:`report_unavailable`.

    :returns: an iterable of ``DeviceSpec`` records with unique names (conventionally
        ``"<backend>:<index>"``) and a ``rank`` (higher is preferred; CPU 0, OpenCL CPU 10,
        OpenCL/CUDA GPUs 100 and up).

    Example::

        @polyhal.hookimpl
        def register_devices():
            return [DeviceSpec(name="mydev:0", backend="mydev", rank=50, factory=MyDevice,
                               heaps=(Heap(MemoryType.DEVICE_LOCAL, BufferUsage.DEFAULT, 1 << 30),))]
    """


@hookspec
def report_unavailable() -> Iterable[str]:
    """Say why this plugin registered fewer devices than a user might expect.

    Called for every plugin (not firstresult). ``polyhal devices`` prints each reason next to
    the plugin's name, e.g. ``"no OpenCL platform found (install an ICD such as pocl-opencl-icd)"``.

    :returns: an iterable of human-readable reasons (may be empty).

    Example::

        @polyhal.hookimpl
        def report_unavailable():
            return [] if _driver_loaded() else ["libmydev.so not found; install the mydev driver"]
    """


# --------------------------------------------------------------------------------------------------
# Allocation policy
# --------------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def select_allocator(
    candidates: Sequence[tuple["DeviceSpec", int]],
    memory_type: "MemoryType",
    buffer_usage: "BufferUsage",
    flags: int,
) -> int | None:
    """Choose which candidate allocates a buffer that several devices may use (IREE's
    ``hal.allocator.select`` / ``iree_hal_module_device_policy_t``).

    firstresult: implementations are called from the most recently registered to the earliest
    until one returns an ``int``; ``None`` passes to the next. The core's own default (the
    first candidate, as IREE) is registered first, so it runs last.

    The buffer's size is deliberately not a parameter: the decision depends only on the
    arguments below, so the core computes it once per distinct argument tuple and reuses it
    (memoization) — at plan-compile time, never while a plan runs.

    :param candidates: 1 to 64 ``(device spec, queue affinity)`` pairs, in the program's order;
        a queue affinity of -1 means any queue.
    :param memory_type: the :class:`~polyhal.hal.flags.MemoryType` the buffer requires.
    :param buffer_usage: the :class:`~polyhal.hal.flags.BufferUsage` it will see.
    :param flags: reserved for policy flags (0 today).
    :returns: the index into ``candidates`` of the chosen pair, or ``None`` to defer.

    Example (prefer any GPU)::

        @polyhal.hookimpl
        def select_allocator(candidates, memory_type, buffer_usage, flags):
            for i, (spec, _queues) in enumerate(candidates):
                if "gpu" in spec.capabilities:
                    return i
            return None
    """
