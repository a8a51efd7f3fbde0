"""Profiles of plan runs: the time of every step, as a table and as a Chrome/Perfetto trace.

A :class:`Profile` is filled by a plan's profiled loop (:meth:`polyhal.Plan.profiling`,
:meth:`polyhal.Plan.profile`, ``polyhal run MODEL --profile --trace FILE``): one
:class:`StepEvent` per step and run. :meth:`Profile.table` prints a row per step (op, the
source node, device, calls, total and mean time, share of the whole) and the same grouped by
op type; :meth:`Profile.write_trace` writes the Trace Event Format that chrome://tracing and
https://ui.perfetto.dev open, one complete ("X") event per step and run, a track per device.

**What a step's time is.** On a device whose ``profile_timer`` gives event timing (CUDA: events
recorded on the device's stream around each step, read after the run) it is the device's own
time for the step. Elsewhere it is the host clock around the step followed by the device's
``synchronize`` (the CPU's does nothing; OpenCL's waits for the queue), so that queued work is
counted in the step that queued it -- at the cost of the overlap between steps that an
unprofiled run has.

A profile of a run that raised keeps the steps that finished, and the failing step with the
error in its arguments; the trace is still written (see :meth:`polyhal.Plan.profiling`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Profile", "StepEvent", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """One step of a plan: its index in the run order, the op (``kind`` ``"dispatch"`` or
    ``"transfer"``), the source node it came from (an ONNX node name; else the op's result
    value), the device it runs on, and how its time is taken (``timing``: the device timer's
    ``name``, such as ``"CUDA events"``, or ``"host clock + synchronize"``)."""

    index: int
    op: str
    node: str
    device: str
    kind: str = "dispatch"
    timing: str = "host clock + synchronize"


@dataclass
class StepEvent:
    """One run of one step: when it started (ns after the profile began, host clock), how long
    it took (ns; the device's time where the device gives one), and the error if it raised."""

    step: int
    run: int
    start_ns: int
    duration_ns: int
    host_ns: int
    error: str | None = None


@dataclass
class Profile:
    """Step times of one plan's profiled runs (see the module doc).

    ``steps`` describe the plan's steps; ``events`` hold one :class:`StepEvent` per step and
    run, in the order they ran; ``runs`` counts the runs begun; ``error`` is set when a run
    raised.
    """

    plan: str
    steps: list[StepInfo]
    events: list[StepEvent] = field(default_factory=list)
    runs: int = 0
    error: str | None = None
    origin_ns: int = field(default_factory=time.perf_counter_ns)

    @property
    def timing(self) -> str:
        """How the steps' times were taken (see :class:`StepInfo`), per device."""
        return "; ".join(dict.fromkeys(f"{s.device}: {s.timing}" for s in self.steps))

    # -- tables ----------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """A record per step that ran: ``step``, ``op``, ``node``, ``device``, ``calls``,
        ``total_ms``, ``mean_us``, ``share`` (of all steps' time), most costly first."""
        calls: dict[int, int] = {}
        totals: dict[int, int] = {}
        for e in self.events:
            calls[e.step] = calls.get(e.step, 0) + 1
            totals[e.step] = totals.get(e.step, 0) + e.duration_ns
        whole = sum(totals.values()) or 1
        rows = [{"step": i, "op": self.steps[i].op, "node": self.steps[i].node, "device": self.steps[i].device,
                 "calls": calls[i], "total_ms": totals[i] / 1e6, "mean_us": totals[i] / calls[i] / 1e3,
                 "share": totals[i] / whole} for i in calls]
        return sorted(rows, key=lambda r: (-r["total_ms"], r["step"]))

    def by_op(self) -> list[dict[str, Any]]:
        """The rows grouped by op type: ``op``, ``steps``, ``calls``, ``total_ms``, ``mean_us``
        (per call), ``share``; most costly first."""
        groups: dict[str, dict[str, Any]] = {}
        for r in self.rows():
            g = groups.setdefault(r["op"], {"op": r["op"], "steps": 0, "calls": 0, "total_ms": 0.0, "share": 0.0})
            g["steps"] += 1
            g["calls"] += r["calls"]
            g["total_ms"] += r["total_ms"]
            g["share"] += r["share"]
        for g in groups.values():
            g["mean_us"] = g["total_ms"] * 1e3 / g["calls"]
        return sorted(groups.values(), key=lambda g: -g["total_ms"])

    def table(self) -> str:
        """The per-step table and the per-op-type table, as text."""
        total = sum(e.duration_ns for e in self.events) / 1e6
        lines = [f"profile of @{self.plan}: {self.runs} run(s), {len(self.steps)} steps, {total:.3f} ms in steps "
                 f"({self.timing})"]
        if self.error:
            lines.append(f"  the last run raised: {self.error}")
        per_step = [("step", "op", "node", "device", "calls", "total ms", "mean us", "share")]
        per_step += [(str(r["step"]), r["op"], r["node"], r["device"], str(r["calls"]), f"{r['total_ms']:.3f}",
                      f"{r['mean_us']:.1f}", f"{100 * r['share']:.1f}%") for r in self.rows()]
        per_op = [("op", "steps", "calls", "total ms", "mean us", "share")]
        per_op += [(g["op"], str(g["steps"]), str(g["calls"]), f"{g['total_ms']:.3f}", f"{g['mean_us']:.1f}",
                    f"{100 * g['share']:.1f}%") for g in self.by_op()]
        lines += _columns(per_step, right=(0, 4, 5, 6, 7))
        lines += ["", "by op type:"] + _columns(per_op, right=(1, 2, 3, 4, 5))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # -- trace -----------------------------------------------------------------------------------

    def trace(self) -> dict[str, Any]:
        """The profile in the Trace Event Format (a dict ready for ``json.dump``): a complete
        event per step and run on its device's track."""
        devices = list(dict.fromkeys(s.device for s in self.steps))
        tid = {d: i for i, d in enumerate(devices)}
        events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0,
                                         "args": {"name": f"polyhal plan @{self.plan}"}}]
        events += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid[d], "args": {"name": d}} for d in devices]
        for e in self.events:
            s = self.steps[e.step]
            args: dict[str, Any] = {"step": e.step, "run": e.run, "node": s.node, "host_us": e.host_ns / 1e3}
            if e.error:
                args["error"] = e.error
            events.append({"name": s.op, "cat": s.kind, "ph": "X", "pid": 0, "tid": tid[s.device],
                           "ts": e.start_ns / 1e3, "dur": e.duration_ns / 1e3, "args": args})
        meta = {"plan": self.plan, "runs": self.runs, "timing": self.timing}
        if self.error:
            meta["error"] = self.error
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}

    def write_trace(self, path) -> None:
        """Write :meth:`trace` as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.trace(), f)


def _columns(rows: list[tuple[str, ...]], right: tuple[int, ...]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
