"""The ``cost`` policy: the candidate that finishes the op first allocates (and so runs the op).

For each candidate device the estimate is a finish time on the plan's schedule (a list
scheduler's *earliest finish time*, as HEFT computes it):

    start  = max(when the device is free, when the operands are ready)
             + for each operand living elsewhere: latency + bytes / link bandwidth
    finish = start + kernel time on that device

Devices of a concurrent plan run side by side (:class:`polyhal.plan.ConcurrentSchedule`), so a
device that is busy with one branch makes another device the earlier finish for an
independent branch: two equally heavy branches go to two GPUs, a CPU-only op beside a GPU chain
overlaps it. Placement carries the schedule in the workload (``Workload.busy``,
``input_ready``) from the finish times this policy reports (``Selection.estimated``); a user's
``select_allocator`` answers before it and overrides it.

* **Kernel time** is, in order: measured (:func:`measure_kernels` times a plan's steps on their
  devices and keeps the median per device and op signature), the ``estimate_cost`` hook (a
  backend answers for its own devices; a user plugin may override any), or a roofline from
  ``DeviceSpec.limits`` (``memory_bandwidth`` B/s, ``peak_flops``, ``launch_latency`` s) with
  conservative defaults.
* **Link bandwidth** between two devices is, in order: measured (:func:`measure_link`), declared
  by a plugin (``link_bandwidth`` hook), declared in ``limits["link_bandwidth"]`` (the smaller of
  the two ends), or :data:`DEFAULT_LINK_BANDWIDTH`.

A plain allocation (no op) costs the same everywhere, so the highest rank wins, then the earlier
candidate. Decisions are memoized per workload (op signature, operand placement and schedule),
never per run; measuring drops them.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import ChainMap
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from polyhal.hal.tensor import empty
from polyhal.hal.transfer import route, transfer_fn
from polyhal.hookspecs import API_VERSION, hookimpl
from polyhal.policies.context import Workload, current

if TYPE_CHECKING:
    from polyhal.hal.records import DeviceSpec
    from polyhal.registry import Registry

POLYHAL_API_VERSION = API_VERSION
NAME = "cost"

#: Defaults of the roofline used when no plugin estimates a device (a modest CPU core's worth).
DEFAULT_MEMORY_BANDWIDTH = 10e9
DEFAULT_PEAK_FLOPS = 20e9
DEFAULT_LAUNCH_LATENCY = 5e-6
#: Bytes per second between two devices when nothing better is known (PCIe 3 x8-ish).
DEFAULT_LINK_BANDWIDTH = 6e9
DEFAULT_LINK_LATENCY = 10e-6

_measured: "weakref.WeakKeyDictionary[Registry, dict[tuple[str, str], float]]" = weakref.WeakKeyDictionary()
_measured_lock = threading.Lock()


def _first_answer(registry: "Registry", hook: str, **kwargs: Any) -> tuple[Any, str | None]:
    """The firstresult ``hook``'s answer as seconds or bytes per second, and the plugin that gave it;
    a plugin that raises or answers no number >= 0 (NaN included) is skipped with a warning."""
    answer = registry.policy_answer(hook, check=lambda a: _not_a_cost(hook, a), **kwargs)
    if answer.value is None:
        return None, None
    return float(answer.value), answer.plugin


def _not_a_cost(hook: str, answer: Any) -> str | None:
    value = answer.value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        return (f"plugin {answer.plugin!r} returned {value!r} from {hook}; it must return a number >= 0 "
                "(math.inf for 'cannot'), or None to defer")
    if hook == "link_bandwidth" and value == 0:
        return (f"plugin {answer.plugin!r} declared a link bandwidth of 0; return math.inf for free links and a "
                "positive number otherwise")
    return None


_kernels_measured: "weakref.WeakKeyDictionary[Registry, dict[tuple[str, tuple], float]]" = weakref.WeakKeyDictionary()


def kernel_time(registry: "Registry", spec: "DeviceSpec", workload: Workload) -> tuple[float, str]:
    """Estimated seconds of ``workload`` on ``spec``'s device, and who estimated it."""
    measured = _kernels_measured.get(registry, {}).get((spec.name, workload.signature()))
    if measured is not None:
        return measured, "measurement"
    value, plugin = _first_answer(registry, "estimate_cost", device_spec=spec, workload=workload)
    if value is not None:
        return value, f"{plugin}'s estimate_cost"
    limits = spec.limits
    bandwidth = float(limits.get("memory_bandwidth") or DEFAULT_MEMORY_BANDWIDTH)
    peak = float(limits.get("peak_flops") or DEFAULT_PEAK_FLOPS)
    latency = float(limits.get("launch_latency", DEFAULT_LAUNCH_LATENCY))
    moved = workload.input_bytes + workload.output_bytes
    return latency + max(moved / bandwidth, workload.flops / peak), "the roofline of DeviceSpec.limits"


def link_bandwidth(registry: "Registry", src: "DeviceSpec", dst: "DeviceSpec") -> tuple[float, str]:
    """Bytes per second from ``src`` to ``dst``: measured, else declared, else the default."""
    measured = _measured.get(registry, {}).get((src.name, dst.name))
    if measured is not None:
        return measured, "measured"
    value, plugin = _first_answer(registry, "link_bandwidth", src=src, dst=dst)
    if value is not None:
        return value, f"declared by {plugin}"
    declared = [float(s.limits["link_bandwidth"]) for s in (src, dst) if s.limits.get("link_bandwidth")]
    if declared:
        return min(declared), "declared in DeviceSpec.limits"
    return DEFAULT_LINK_BANDWIDTH, "default"


def measure_link(registry: "Registry", src: str, dst: str, nbytes: int = 4 << 20, repeat: int = 3) -> float:
    """Time copying ``nbytes`` from device ``src`` to ``dst`` along the route a plan's transfer
    takes (:func:`polyhal.hal.transfer.route`: a backend's copy -- peer, pinned staging -- or a
    trip through a host array); remember the best of ``repeat`` as the link's bandwidth (B/s)
    for the cost policy and drop the registry's memoized decisions. Returns the bandwidth."""
    s_dev, d_dev = registry.get_device(src), registry.get_device(dst)
    a, b = empty((nbytes,), "uint8", s_dev), empty((nbytes,), "uint8", d_dev)
    move = transfer_fn(route(s_dev, d_dev), (nbytes,), np.uint8)
    best = math.inf
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        move(a.native, b.native)
        d_dev.synchronize()
        best = min(best, time.perf_counter() - t0)
    a.release()
    b.release()
    bandwidth = nbytes / best if best > 0 else math.inf
    with _measured_lock:
        _measured.setdefault(registry, {})[(src, dst)] = bandwidth
    registry._changed()
    return bandwidth


def measure_kernels(plan: Any, *inputs: Any, runs: int = 3) -> dict[tuple[str, str], float]:
    """Run ``plan`` (a compiled :class:`polyhal.plan.Plan`) ``runs`` times on ``inputs`` under its
    profiler and remember each dispatch's median time on its device, per op signature, as the
    kernel time the cost policy uses from then on (memoized decisions are dropped, so the next
    compile places with them). Compile the program once per device you want measured (e.g.
    ``polyhal.compile(p, "cuda:1")``) and measure each. Returns ``{(device, op): seconds}``.
    """
    registry = plan.registry
    profile = plan.profile(*inputs, runs=runs)
    times: dict[int, list[int]] = {}
    for event in profile.events:
        if event.error is None:
            times.setdefault(event.step, []).append(event.duration_ns)
    found: dict[tuple[str, tuple], float] = {}
    summary: dict[tuple[str, str], float] = {}
    for i, op in enumerate(plan._step_ops):
        if op.kind != "dispatch" or i not in times:
            continue
        seconds = float(np.median(times[i])) * 1e-9
        key = Workload(op.name, tuple(v.type for v in op.inputs), tuple(v.type for v in op.outputs),
                       op.attrs).signature()
        found[(op.device, key)] = seconds
        summary[(op.device, op.name)] = summary.get((op.device, op.name), 0.0) + seconds
    with _measured_lock:
        _kernels_measured.setdefault(registry, {}).update(found)
    registry._changed()
    return summary


def measured_kernels(registry: "Registry") -> dict[tuple[str, tuple], float]:
    """The kernel times measured so far for ``registry`` ((device, op signature) -> seconds)."""
    return dict(_kernels_measured.get(registry, {}))


def measured_links(registry: "Registry") -> dict[tuple[str, str], float]:
    """The link bandwidths measured so far for ``registry`` ((src, dst) -> B/s)."""
    return dict(_measured.get(registry, {}))


def estimate(registry: "Registry", spec: "DeviceSpec", workload: Workload | None,
             specs: Mapping[str, "DeviceSpec"]) -> tuple[float, str]:
    """(finish time in seconds, explanation) of running ``workload`` on ``spec``'s device after
    the work the schedule already holds (``workload.busy``, ``input_ready``), moves included."""
    if workload is None:
        return 0.0, "no op"
    kernel, why = kernel_time(registry, spec, workload)
    free = dict(workload.busy).get(spec.name, 0.0)
    ready = max(workload.input_ready, default=0.0)
    start = max(free, ready)
    parts = [f"kernel {_fmt_s(kernel)} by {why}"]
    if start > 0:
        parts.insert(0, f"starts at {_fmt_s(start)} ({'device busy' if free >= ready else 'operands ready'})")
    for src, nbytes in workload.bytes_from(spec.name).items():
        src_spec = specs.get(src)
        if src_spec is None:
            continue
        bandwidth, how = link_bandwidth(registry, src_spec, spec)
        latency = float(spec.limits.get("link_latency", DEFAULT_LINK_LATENCY))
        t = latency + nbytes / bandwidth
        start += t
        parts.append(f"{_fmt_s(t)} moving {nbytes} B from {src} at {bandwidth / 1e9:.3g} GB/s ({how})")
    return start + kernel, " + ".join(parts)


def _fmt_s(seconds: float) -> str:
    if math.isinf(seconds):
        return "inf"
    return f"{seconds * 1e6:.3g} µs" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


@hookimpl
def select_allocator(candidates, memory_type, buffer_usage, flags):
    """The candidate of lowest estimated time; ties to the higher rank, then the earlier candidate."""
    sel = current()
    if sel is None or sel.policy != NAME:
        return None
    registry = sel.registry
    workload = sel.workload
    specs = ChainMap({spec.name: spec for spec, _ in candidates}, registry.specs_by_name())
    costs = [estimate(registry, spec, workload, specs) for spec, _ in candidates]
    order = sorted(range(len(candidates)), key=lambda i: (costs[i][0], -candidates[i][0].rank, i))
    best = order[0]
    if workload is None:
        sel.because(f"cost: a plain allocation costs the same everywhere; highest rank, then first "
                    f"({candidates[best][0].name})", order)
        return best
    if math.isinf(costs[best][0]):
        sel.because(f"cost: every candidate estimated {workload.op} as impossible (inf); first candidate", order)
        return 0
    ranked = "; ".join(f"{candidates[i][0].name} done at {_fmt_s(costs[i][0])} = {costs[i][1]}" for i in order[:4])
    sel.because(f"cost of {workload.op}: {ranked}", order)
    sel.estimated(costs[best][0])
    return best
