"""Control flow with a static iteration count, unrolled: Scan, Loop (and If, in tensor.py).

polyhal programs are straight-line, so a loop becomes its body repeated once per iteration.
That needs the count at import time: a Scan iterates over a static axis; a Loop needs its trip
count and every iteration's condition to fold to constants (they usually depend only on the
iteration number, or on inputs fixed with ``values=``). :data:`MAX_UNROLL` bounds the copies.
A Loop that cannot unroll raises :class:`NeedsStaging`: the model then runs staged, the loop
iterating on the host over a plan of its body (:mod:`polyhal.frontends.onnx.staged`).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.tensor import norm_axis, reshape
from polyhal.frontends.onnx.errors import NeedsStaging, NeedsValue, OnnxModelError, OnnxUnsupportedError

#: Most iterations a loop is unrolled to.
MAX_UNROLL = 4096


def _run_body(ctx: NodeContext, body: onnx.GraphProto, bound: list, tag: str) -> list:
    """Convert ``body`` once with its inputs bound to ``bound``; its outputs."""
    if len(bound) != len(body.input):
        raise OnnxModelError(f"the body takes {len(body.input)} inputs, the node gives it {len(bound)}")
    env = collections.ChainMap({}, dict(ctx.env))
    for t in body.initializer:
        env[t.name] = ctx.initializer(t)
    for vi, v in zip(body.input, bound):
        env[vi.name] = v
    ctx.convert_nodes(body.node, env, scope=tag)
    missing = [o.name for o in body.output if o.name not in env]
    if missing:
        raise OnnxModelError(f"the body's output {missing[0]!r} is not computed")
    return [env[o.name] for o in body.output]


def _take(ctx: NodeContext, x, axis: int, index: int):
    """``x[..., index, ...]`` along ``axis``, the axis removed."""
    shape = ctx.shape(x)
    piece = ctx.op("slice", x, starts=[index], ends=[index + 1], axes=[axis], steps=[1])
    return reshape(ctx, piece, shape[:axis] + shape[axis + 1:])


def _stack(ctx: NodeContext, pieces: list, axis: int):
    """The pieces (all of one shape) stacked along a new ``axis``."""
    shape = ctx.shape(pieces[0])
    grown = [reshape(ctx, p, shape[:axis] + (1,) + shape[axis:]) for p in pieces]
    return grown[0] if len(grown) == 1 else ctx.op("concat", *grown, axis=axis)


@converter("Scan")
def _scan(ctx: NodeContext) -> list:
    body = ctx.attr("body")
    m = int(ctx.attr("num_scan_inputs"))
    values = ctx.inputs()
    if ctx.opset < 9:  # opset 8: input 0 is sequence_lens, and every input has a batch axis first
        lens, values = values[0], values[1:]
        if lens is not None:
            lens = ctx.const(0, "sequence_lens")
    n = len(values) - m
    if n < 0:
        raise OnnxModelError(f"num_scan_inputs={m} exceeds the {len(values)} inputs")
    k = len(body.output) - n
    if ctx.opset >= 9:
        return _scan_steps(ctx, body, values[:n], values[n:], k)
    dirs = [int(d) for d in ctx.attr("directions", [0] * m)]
    batch = {ctx.shape(v)[0] for v in values}
    if len(batch) != 1:
        raise OnnxModelError(f"the Scan inputs have different batch sizes: {sorted(batch)}")
    batch = batch.pop()
    steps = {ctx.shape(x)[1] for x in values[n:]}
    if lens is not None and set(np.asarray(lens).reshape(-1).tolist()) - steps:
        raise OnnxUnsupportedError("Scan (opset 8) with sequence_lens shorter than the scan axis")
    rows = [_scan_steps(ctx, body, [_take(ctx, v, 0, b) for v in values[:n]],
                        [_take(ctx, v, 0, b) for v in values[n:]], k, in_dirs=dirs, tag=f"batch{b}/")
            for b in range(batch)]
    return [_stack(ctx, [r[j] for r in rows], 0) for j in range(n + k)]


def _scan_steps(ctx: NodeContext, body, states: list, scans: list, k: int, *, in_dirs: list | None = None,
                tag: str = "") -> list:
    """Scan's iterations unrolled: the final states, then the k scan outputs."""
    m, n = len(scans), len(states)
    in_axes = [int(a) for a in ctx.attr("scan_input_axes", [0] * m)]
    in_dirs = in_dirs or [int(d) for d in ctx.attr("scan_input_directions", [0] * m)]
    out_axes = [int(a) for a in ctx.attr("scan_output_axes", [0] * k)]
    out_dirs = [int(d) for d in ctx.attr("scan_output_directions", [0] * k)]
    in_axes = [norm_axis(a, ctx.rank(x), "scan_input_axes entry") for a, x in zip(in_axes, scans)]
    lengths = {ctx.shape(x)[a] for x, a in zip(scans, in_axes)}
    if len(lengths) != 1:
        raise OnnxModelError(f"the scan inputs have different lengths along their scan axes: {sorted(lengths)}")
    steps = lengths.pop()
    if steps > MAX_UNROLL:
        raise OnnxUnsupportedError(f"Scan over {steps} steps (polyhal unrolls at most {MAX_UNROLL})")
    if steps == 0:
        raise OnnxUnsupportedError("Scan over an empty sequence")
    collected: list[list] = [[] for _ in range(k)]
    for t in range(steps):
        slices = [_take(ctx, x, a, steps - 1 - t if d else t) for x, a, d in zip(scans, in_axes, in_dirs)]
        outs = _run_body(ctx, body, list(states) + slices, f"{tag}step{t}")
        states = outs[:n]
        for j in range(k):
            collected[j].append(outs[n + j])
    results = list(states)
    for j in range(k):
        pieces = collected[j][::-1] if out_dirs[j] else collected[j]
        rank = ctx.rank(pieces[0]) + 1
        results.append(_stack(ctx, pieces, norm_axis(out_axes[j], rank, "scan_output_axes entry")))
    return results


@converter("Loop")
def _loop(ctx: NodeContext) -> list:
    body = ctx.attr("body")
    try:
        trip = ctx.const(0, "the trip count") if ctx.has(0) else None
        cond = ctx.const(1, "the condition") if ctx.has(1) else None
    except NeedsValue:
        raise NeedsStaging("Loop with a trip count or condition computed at run time") from None
    carried = [ctx.input(i) for i in range(2, ctx.num_inputs)]
    limit = MAX_UNROLL + 1 if trip is None else int(np.asarray(trip).reshape(-1)[0])
    going = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
    if trip is None and cond is None:
        raise NeedsStaging("Loop without a trip count or a condition (it ends when its body says so)")
    if limit < 0:
        raise OnnxModelError(f"Loop trip count {limit} is negative; a Loop runs a count of iterations from 0 up")
    k = len(body.output) - 1 - len(carried)
    if k < 0:
        raise OnnxModelError("the Loop body has fewer outputs than loop-carried values")
    collected: list[list] = [[] for _ in range(k)]
    i = 0
    while going and i < limit:
        if i >= MAX_UNROLL:
            raise NeedsStaging(f"Loop of more than {MAX_UNROLL} iterations (too many to unroll)")
        outs = _run_body(ctx, body, [np.array(i, np.int64), np.array(going)] + carried, f"iter{i}")
        cond_out = outs[0]
        if not isinstance(cond_out, np.ndarray):
            raise NeedsStaging("Loop whose condition is computed from run-time data (it cannot be unrolled)")
        going = bool(np.asarray(cond_out).reshape(-1)[0])
        carried = outs[1:1 + len(carried)]
        for j in range(k):
            collected[j].append(outs[1 + len(carried) + j])
        i += 1
    results = list(carried)
    for j in range(k):
        if not collected[j]:
            raise NeedsStaging("Loop that runs no iteration but has scan outputs (their shape is unknown)")
        results.append(_stack(ctx, collected[j], 0))
    return results
