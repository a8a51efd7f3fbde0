"""Reductions (reduce_sum/mean/max/min/prod, argmax, argmin) from one table of folds, and the
row normalisations softmax and layer_norm.

A reduction maps each output element (the kept dims) to a lane (the reduced dims, any set of
axes). Two strategies, chosen per instance by ``DeviceTraits.lane_per_work_item``: a *serial*
kernel (one work-item folds a whole lane: short lanes, where a work-group would idle, and many
lanes on a CPU device) and a *group* kernel (one work-group per lane: work-items fold
interleaved elements, then a tree in local memory merges their accumulators). softmax and
layer_norm choose the same way (a group of one work-item is the serial form).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from polyhal.ops._base import normalize_axes

from polyhal_opencl.codegen import (
    Arg, CType, DeviceTraits, Launch, Recipe, accumulator, collapse, ctype, dense_strides,
    group_reduce_fn, header, index_type, offsets_code, param, prologue, round_up,
)

@dataclass(frozen=True)
class Fold:
    """An associative fold over a lane, as C code on an accumulator struct ``a``.

    ``fields``: the struct's members (C declarations); ``init``: statements initialising ``a``;
    ``fold``: statements folding value ``v`` at lane position ``r`` into ``a``; ``merge``:
    statements merging accumulator ``b`` into ``a``; ``result``: the C expression stored.
    """

    fields: str
    init: str
    fold: str
    merge: str
    result: str


def _nan_extremum(t: CType, op: str, identity: str) -> Fold:
    """max/min: nan wins (numpy propagates nan); integers and bool use the plain comparison."""
    if t.is_float:
        take = "if (!isnan(a.v) && (isnan({x}) || {x} %s a.v)) a.v = {x};" % op
    else:
        take = "if ({x} %s a.v) a.v = {x};" % op
    return Fold(f"{t.compute} v;", f"a.v = {identity};", take.format(x="v"), take.format(x="b.v"), "a.v")


def _arg_extremum(t: CType, cmp: str) -> Fold:
    """argmax (``cmp`` ">") / argmin ("<"): (value, index) pairs; the better value wins, nan
    beats every number (numpy: nan is both the max and the min), ties (and nans) keep the lower
    index; i < 0 marks an empty accumulator. Merging compares indices, so order is irrelevant."""
    nan = "(isnan({v}) ? 1 : 0)" if t.is_float else "0"
    better = (  # is (v1, i1) better than a?
        "(a.i < 0 || (({n1}) != ({n2}) ? ({n1}) : (({n1}) || {v1} == a.v) ? {i1} < a.i : {v1} %s a.v))" % cmp)
    cond = lambda v1, i1: better.format(  # noqa: E731
        v1=v1, i1=i1, n1=nan.format(v=v1), n2=nan.format(v="a.v"))
    return Fold(f"{t.compute} v; long i;", f"a.v = {t.lowest()}; a.i = -1;",
                f"if ({cond('v', 'r')}) {{ a.v = v; a.i = r; }}",
                f"if (b.i >= 0 && {cond('b.v', 'b.i')}) {{ a.v = b.v; a.i = b.i; }}", "a.i")


def _fold(op: str, t: CType, traits: DeviceTraits, lane: int) -> Fold:
    acc = accumulator(t, traits)
    if op in ("reduce_sum", "reduce_mean"):
        result = f"(a.v / ({acc}){max(lane, 1)})" if op == "reduce_mean" else "a.v"
        return Fold(f"{acc} v;", f"a.v = ({acc})0;", f"a.v += ({acc})v;", "a.v += b.v;", result)
    if op == "reduce_prod":
        return Fold(f"{acc} v;", f"a.v = ({acc})1;", f"a.v *= ({acc})v;", "a.v *= b.v;", "a.v")
    if op == "reduce_max":
        return _nan_extremum(t, ">", t.lowest())
    if op == "reduce_min":
        return _nan_extremum(t, "<", t.highest())
    return _arg_extremum(t, ">" if op == "argmax" else "<")


def reduce(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """reduce_* over ``axes`` and argmax/argmin over ``axis``: one output per lane."""
    x, y = in_types[0], out_types[0]
    axes = (int(attrs["axis"]) % x.rank,) if op in ("argmax", "argmin") else normalize_axes(attrs["axes"], x.rank)
    t, out_t = ctype(x.dtype, traits, op), ctype(y.dtype, traits, op)
    strides = dense_strides(x.shape)
    kept = [i for i in range(x.rank) if i not in axes]
    kshape, (kstr,) = collapse([x.shape[i] for i in kept], [[strides[i] for i in kept]])
    rshape, (rstr,) = collapse([x.shape[i] for i in axes], [[strides[i] for i in axes]])
    lanes, lane = math.prod(x.shape[i] for i in kept), math.prod(x.shape[i] for i in axes)
    if lanes == 0:
        return Recipe("")
    fold = _fold(op, t, traits, lane)
    idx = index_type(x.size)
    serial = traits.lane_per_work_item(lanes, lane)
    wg = traits.work_group(min(lanes, 64) if serial else lane)
    acc_fp64 = "double" in fold.fields
    src = header(t, out_t, fp64=acc_fp64) + (
        f"typedef struct {{ {fold.fields} }} acc_t;\n"
        f"inline acc_t acc_init(void) {{ acc_t a; {fold.init} return a; }}\n"
        f"inline acc_t acc_fold(acc_t a, {t.compute} v, long r) {{ {fold.fold} return a; }}\n"
        f"inline acc_t acc_merge(acc_t a, acc_t b) {{ {fold.merge} return a; }}\n"
        f"__kernel __attribute__((reqd_work_group_size({wg}, 1, 1)))\n"
        f"void reduce({param('x', t.store, True)}, {param('y', out_t.store)}) {{\n"
        + prologue(("x", t.store, True), ("y", out_t.store, False))
    )
    lane_offset = offsets_code("r", rshape, [rstr], ["o_r"], idx, tag="r")
    if serial:
        src += (
            f"  const size_t o = get_global_id(0);\n  if (o >= {lanes}) return;\n"
            + offsets_code("o", kshape, [kstr], ["o_x"], idx, tag="k")
            + f"  acc_t a = acc_init();\n  for ({idx} r = 0; r < {lane}; ++r) {{\n"
            + lane_offset + f"    a = acc_fold(a, {t.load('x', 'o_x + o_r')}, r);\n  }}\n"
            + "  " + out_t.store_stmt("y", "o", fold.result) + "\n}\n"
        )
        gsize = round_up(lanes, wg)
    else:
        src += (
            f"  __local acc_t part[{wg}];\n  const size_t o = get_group_id(0);\n  const int lid = get_local_id(0);\n"
            + offsets_code("o", kshape, [kstr], ["o_x"], idx, tag="k")
            + f"  acc_t a = acc_init();\n  for ({idx} r = lid; r < {lane}; r += {wg}) {{\n"
            + lane_offset + f"    a = acc_fold(a, {t.load('x', 'o_x + o_r')}, r);\n  }}\n"
            + "  part[lid] = a;\n  barrier(CLK_LOCAL_MEM_FENCE);\n"
            + f"  for (int k = {wg // 2}; k > 0; k >>= 1) {{\n"
            + "    if (lid < k) part[lid] = acc_merge(part[lid], part[lid + k]);\n"
            + "    barrier(CLK_LOCAL_MEM_FENCE);\n  }\n"
            + "  if (lid == 0) { a = part[0]; " + out_t.store_stmt("y", "o", fold.result) + " }\n}\n"
        )
        gsize = lanes * wg
    return Recipe(src, [Launch("reduce", (gsize,), (wg,), (Arg(0), Arg(1)))])


# ------------------------------------------------------------------------- softmax, layer_norm

def _row_kernel(name: str, t: CType, traits: DeviceTraits, lanes: int, lane: int, extra: tuple[str, ...],
                body: str) -> tuple[str, int]:
    """A kernel with one work-group per lane: ``body`` sees ``lid``, the group size ``WG``,
    ``group_sum`` and ``group_max`` (over the accumulator type ``acc``), and the buffers
    ``x``, ``y`` and ``extra`` (read-only inputs of type ``t``). Where one work-item per lane is
    better (see the module docstring) the group has one work-item."""
    wg = 1 if traits.lane_per_work_item(lanes, lane) else traits.work_group(lane)
    acc = accumulator(t, traits)
    params = [param("x", t.store, True)] + [param(e, t.store, True) for e in extra] + [param("y", t.store)]
    src = header(t, fp64=acc == "double") + (
        f"#define WG {wg}\ntypedef {acc} acc;\n"
        + group_reduce_fn("group_sum", "acc", lambda a, b: f"{a} + {b}", wg)
        + group_reduce_fn("group_max", "acc", lambda a, b: f"((isnan({a}) || {a} > {b}) ? {a} : {b})", wg)
        + f"__kernel __attribute__((reqd_work_group_size({wg}, 1, 1)))\nvoid {name}({', '.join(params)}) {{\n"
        + prologue(("x", t.store, True), *((e, t.store, True) for e in extra), ("y", t.store, False))
        + "  __local acc scratch[WG];\n  const long o = get_group_id(0);\n  const int lid = get_local_id(0);\n"
        + body + "}\n"
    )
    return src, wg


def softmax(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """exp(x - max) / sum along ``axis``: three passes over each lane (max, sum, write)."""
    x = in_types[0]
    t = ctype(x.dtype, traits, op)
    axis = int(attrs["axis"]) % x.rank
    lane, inner = x.shape[axis], math.prod(x.shape[axis + 1:])
    lanes = math.prod(x.shape) // max(lane, 1)
    if lanes == 0 or lane == 0:
        return Recipe("")
    load, c = t.load("x", "e"), t.compute
    # exp in the compute type (a double exp costs several times a float one), sums in acc.
    body = (
        f"  const long base = (o / {inner}) * {lane * inner} + o % {inner};\n"
        f"  acc m = -INFINITY;\n"
        f"  for (int j = lid; j < {lane}; j += WG) {{ const long e = base + (long)j * {inner}; acc v = (acc){load};"
        f" if (!isnan(m) && (isnan(v) || v > m)) m = v; }}\n"
        f"  const {c} mx = ({c})group_max(m, scratch);\n  acc s = 0;\n"
        f"  for (int j = lid; j < {lane}; j += WG) {{ const long e = base + (long)j * {inner}; s += (acc)exp({load} - mx); }}\n"
        f"  const {c} inv = ({c})((acc)1 / group_sum(s, scratch));\n"
        f"  for (int j = lid; j < {lane}; j += WG) {{ const long e = base + (long)j * {inner};"
        f" {t.store_stmt('y', 'e', f'exp({load} - mx) * inv')} }}\n"
    )
    src, wg = _row_kernel("softmax", t, traits, lanes, lane, (), body)
    return Recipe(src, [Launch("softmax", (lanes * wg,), (wg,), (Arg(0), Arg(1)))])


def layer_norm(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Normalise each lane of the trailing dims from ``axis`` (two passes: mean, then the variance
    of the centred values, which is exact where E[x^2] - mean^2 cancels), then scale and shift."""
    x = in_types[0]
    t = ctype(x.dtype, traits, op)
    axis = int(attrs["axis"]) % x.rank
    lane = math.prod(x.shape[axis:])
    lanes = math.prod(x.shape[:axis])
    if lanes == 0 or lane == 0:
        return Recipe("")
    eps = float(attrs["epsilon"])
    load = t.load("x", "base + j")
    body = (
        f"  const long base = o * {lane};\n  acc s = 0;\n"
        f"  for (int j = lid; j < {lane}; j += WG) s += (acc){load};\n"
        f"  const acc mean = group_sum(s, scratch) / (acc){lane};\n  acc q = 0;\n"
        f"  for (int j = lid; j < {lane}; j += WG) {{ const acc d = (acc){load} - mean; q += d * d; }}\n"
        f"  const acc inv = (acc)1 / sqrt(group_sum(q, scratch) / (acc){lane} + (acc){eps!r});\n"
        f"  for (int j = lid; j < {lane}; j += WG) {{\n"
        f"    const acc v = ((acc){load} - mean) * inv * (acc){t.load('scale', 'j')} + (acc){t.load('bias', 'j')};\n"
        f"    {t.store_stmt('y', 'base + j', 'v')}\n  }}\n"
    )
    src, wg = _row_kernel("layer_norm", t, traits, lanes, lane, ("scale", "bias"), body)
    return Recipe(src, [Launch("layer_norm", (lanes * wg,), (wg,), (Arg(0), Arg(1), Arg(2), Arg(3)))])


GENERATORS = {
    **dict.fromkeys(("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"),
                    reduce),
    "softmax": softmax, "layer_norm": layer_norm,
}
