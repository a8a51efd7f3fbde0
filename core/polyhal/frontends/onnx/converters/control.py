"""Control flow with a static iteration count, unrolled: Scan, Loop (and If, in tensor.py).

polyhal programs are straight-line, so a loop becomes its body repeated once per iteration --
except a Scan whose iterations do not depend on each other (its states pass through the body
unchanged) and whose body is elementwise ops and reductions: that body is converted once, over
every step at once (:func:`_scan_batched`). scikit-learn's nearest-neighbour models (skl2onnx's
``cdist``: a Scan over the training rows, each step a Sub and a ReduceSumSquare) are such Scans;
unrolled, 2,000 training rows made 8,000 nodes and a 9-second first call.
That needs the count at import time: a Scan iterates over a static axis; a Loop needs its trip
count and every iteration's condition to fold to constants (they usually depend only on the
iteration number, or on inputs fixed with ``values=``). :data:`MAX_UNROLL` bounds the copies.
A Loop that cannot unroll raises :class:`NeedsStaging`: the model then runs staged, the loop
iterating on the host over a plan of its body (:mod:`polyhal.frontends.onnx.staged`).
"""

from __future__ import annotations

import collections

import numpy as np

from polyhal.frontends.onnx.converters.context import NodeContext
from polyhal.frontends.onnx.converters.registry import converter
from polyhal.frontends.onnx.converters.tensor import norm_axis, reshape
from polyhal.frontends.onnx.errors import NeedsStaging, NeedsValue, OnnxModelError, OnnxUnsupportedError
from polyhal.frontends.onnx.proto import onnx_package, pb

#: Most iterations a loop is unrolled to.
MAX_UNROLL = 4096


def _run_body(ctx: NodeContext, body: pb.GraphProto, bound: list, tag: str) -> list:
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
    if axis == 0 and shape and len(pieces) > 1:
        # Joined along their own first axis, then reshaped: the concat's operands are the
        # pieces themselves, which buffer planning writes in place into its result, so an
        # unrolled loop's step outputs are not each a buffer live to the end (with n of them
        # live at once, placing them took time quadratic in n: 2,000 steps, 6 s).
        return reshape(ctx, ctx.op("concat", *pieces, axis=0), (len(pieces),) + tuple(shape))
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
    batched = _scan_batched(ctx, body, states, scans, k, in_axes, in_dirs, out_axes, out_dirs, tag)
    if batched is not None:
        return batched
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


#: Body ops :func:`_scan_batched` evaluates over every step at once: elementwise (the steps
#: broadcast as a leading axis) ...
_ELEMENTWISE = frozenset({"Abs", "Add", "Cast", "Div", "Exp", "Identity", "Log", "Max", "Min", "Mul", "Neg", "Pow",
                          "Reciprocal", "Relu", "Sigmoid", "Sqrt", "Sub", "Tanh"})
#: ... and reductions (their axes move past the leading one).
_REDUCTIONS = frozenset({"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                         "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare"})


def _scan_batched(ctx: NodeContext, body, states: list, scans: list, k: int, in_axes: list, in_dirs: list,
                  out_axes: list, out_dirs: list, tag: str) -> list | None:
    """Scan's results from one evaluation of its body over every step at once, or None where the
    body does not allow it (then it is unrolled).

    It allows it when every state output is its state input (through Identity nodes: no step
    depends on another) and every node is of :data:`_ELEMENTWISE` or :data:`_REDUCTIONS`. Each
    scan input is bound with its scan axis first (reversed for a reverse direction): a value
    computed from one holds every step's value along a leading axis, and a node reading one
    gets its operands of lower rank reshaped to put that axis first (ONNX broadcasts from the
    last axis) and its reduction axes moved by one. The same arithmetic as the unrolled steps,
    on a larger tensor."""
    n = len(states)
    names = [vi.name for vi in body.input]
    alias = {node.output[0]: node.input[0] for node in body.node if node.op_type == "Identity"}

    def source(name: str) -> str:
        while name in alias:
            name = alias[name]
        return name

    if any(source(o.name) != names[j] for j, o in enumerate(body.output[:n])):
        return None
    if any(node.op_type not in _ELEMENTWISE | _REDUCTIONS or node.domain not in ("", "ai.onnx")
           for node in body.node):
        return None
    env = collections.ChainMap({}, dict(ctx.env))
    for t in body.initializer:
        env[t.name] = ctx.initializer(t)
    for name, v in zip(names, states):
        env[name] = v
    stepped: set[str] = set()
    for name, x, axis, reverse in zip(names[n:], scans, in_axes, in_dirs):
        if axis:
            perm = [axis] + [a for a in range(ctx.rank(x)) if a != axis]
            x = ctx.op("transpose", x, perm=perm)
        if reverse:
            x = ctx.op("slice", x, starts=[-1], ends=[-(ctx.shape(x)[0] + 1)], axes=[0], steps=[-1])
        env[name] = x
        stepped.add(name)
    steps = ctx.shape(scans[0])[in_axes[0]]
    for i, node in enumerate(body.node):
        inputs = [name for name in node.input if name]
        if not any(name in stepped for name in inputs):
            ctx.convert_nodes([node], env, scope=f"{tag}steps")
            continue
        rewritten = pb.NodeProto()
        rewritten.CopyFrom(node)
        if node.op_type in _REDUCTIONS:
            if inputs[0] not in stepped:
                return None  # a reduction of a loop-invariant value by stepped axes: unroll instead
            rank = ctx.rank(env[inputs[0]]) - 1
            attr = next((a for a in rewritten.attribute if a.name == "axes"), None)
            given = (list(attr.ints) if attr is not None else
                     np.asarray(env[node.input[1]]).reshape(-1).tolist() if len(node.input) > 1 and node.input[1]
                     and isinstance(env[node.input[1]], np.ndarray) else None)
            if given is None and len(node.input) > 1 and node.input[1]:
                return None  # axes computed at run time
            if not given and any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute):
                given = None  # reduces nothing: an identity, stepped as it is
                axes = []
            else:
                axes = [norm_axis(a, rank, "axes entry") + 1 for a in given] if given else list(range(1, rank + 1))
            if attr is not None:
                del attr.ints[:]
                attr.ints.extend(axes)
            elif len(node.input) > 1 and node.input[1]:
                env[f"{tag}axes{i}"] = np.array(axes, np.int64)
                rewritten.input[1] = f"{tag}axes{i}"
            elif axes:
                if ctx.opset >= 18 or (node.op_type == "ReduceSum" and ctx.opset >= 13):
                    env[f"{tag}axes{i}"] = np.array(axes, np.int64)
                    rewritten.input.append(f"{tag}axes{i}")
                else:
                    rewritten.attribute.append(onnx_package().helper.make_attribute("axes", axes))
        else:
            rank = max(ctx.rank(env[name]) - (name in stepped) for name in inputs)
            for j, name in enumerate(rewritten.input):
                if name in stepped and ctx.rank(env[name]) - 1 < rank:
                    shape = ctx.shape(env[name])
                    env[f"{tag}{name}:{rank}"] = reshape(ctx, env[name], (shape[0],) + (1,) * (rank + 1 - len(shape))
                                                        + tuple(shape[1:]))
                    rewritten.input[j] = f"{tag}{name}:{rank}"
        ctx.convert_nodes([rewritten], env, scope=f"{tag}steps")
        stepped.update(name for name in node.output if name)
    results = list(states)
    for j, o in enumerate(body.output[n:]):
        v = env[o.name]
        if o.name not in stepped:  # the same every step
            v = ctx.op("expand", v, shape=[steps, *ctx.shape(v)])
        if out_dirs[j]:
            v = ctx.op("slice", v, starts=[-1], ends=[-(steps + 1)], axes=[0], steps=[-1])
        axis = norm_axis(out_axes[j], ctx.rank(v), "scan_output_axes entry")
        if axis:
            perm = list(range(1, ctx.rank(v)))
            perm.insert(axis, 0)
            v = ctx.op("transpose", v, perm=perm)
        results.append(v)
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
