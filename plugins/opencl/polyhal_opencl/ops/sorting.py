"""sort, argsort and topk on ``cl/bitonic.cl`` and ``cl/sort.cl``: a bitonic sort in local memory per row where the
row fits, else local tile sorts plus global merge passes through two scratch index buffers."""

from __future__ import annotations

import math
from typing import Any, Mapping

from polyhal_opencl.codegen import (
    Arg, DeviceTraits, Launch, Recipe, bits_ctype, cl_source, ctype, defines, header, next_pow2,
    round_up,
)

#: Bytes of a key in local memory, by compute type (half keys are held as float).
_KEY_BYTES = {"uchar": 1, "char": 1, "ushort": 2, "short": 2, "uint": 4, "int": 4, "float": 4,
              "ulong": 8, "long": 8, "double": 8}
#: Bytes of local memory left unused by the sort (drivers reserve some for their own use).
LOCAL_RESERVE = 1024


def local_sort_size(key_bytes: int, traits: DeviceTraits) -> int:
    """The largest power of two of (key, int index) pairs one work-group sorts in local memory."""
    fit = max((traits.local_mem_size - LOCAL_RESERVE) // (key_bytes + 4), 2)
    return max(2, min(1 << (fit.bit_length() - 1), next_pow2(traits.max_local_sort)))


def _source(x, t, *, n: int, inner: int, k: int, np_: int, wg: int, desc: bool,
            values: bool, indices: bool) -> str:
    vb = bits_ctype(x.dtype).store
    outs = ([("values", vb)] if values else []) + ([("indices", "long")] if indices else [])
    return (
        header(t)
        + defines(N=n, INNER=inner, K=k, KP=min(next_pow2(k), np_), NP=np_, WG=wg, DESC=desc,
                  KEY_T=t.compute, VBITS=vb, HAS_VALUES=values, HAS_INDICES=indices)
        + f"#define X_T {t.store}\n#define LOAD_KEY(p, i) {t.load('(p)', '(i)')}\n"
        + f"#define ISNAN(v) {'isnan(v)' if t.is_float else '0'}\n"
        + f"#define X_PARAM __global const {t.store}* x_base, const ulong x_off\n"
        + f"#define X_PROLOGUE __global const {t.store}* x = x_base + x_off;\n"
        + "#define OUT_KERNEL_PARAMS " + ", ".join(f"__global {ty}* {nm}_base, const ulong {nm}_off" for nm, ty in outs) + "\n"
        + "#define OUT_PROLOGUE " + " ".join(f"__global {ty}* {nm} = {nm}_base + {nm}_off;" for nm, ty in outs) + "\n"
        + "#define OUT_PARAMS " + ", ".join(f"__global {ty}* {nm}" for nm, ty in outs) + "\n"
        + "#define OUT_ARGS " + ", ".join(nm for nm, _ in outs) + "\n"
        + cl_source("bitonic.cl") + cl_source("sort.cl")
    )


def _sort(op: str, x, axis: int, k: int, descending: bool, index_order: bool, values: bool, indices: bool,
          traits: DeviceTraits) -> Recipe:
    t = ctype(x.dtype, traits, op)
    n = x.shape[axis]
    inner = math.prod(x.shape[axis + 1:])
    rows = math.prod(x.shape) // n if n else 0
    if rows == 0 or k == 0:
        return Recipe("")
    cap = local_sort_size(_KEY_BYTES[t.compute], traits)
    outs = [Arg(i + 1) for i in range(values + indices)]  # operand 0 is x, then the outputs
    if next_pow2(n) <= cap:
        np_ = next_pow2(n)
        wg = traits.work_group(np_ // 2)
        src = _source(x, t, n=n, inner=inner, k=k, np_=np_, wg=wg, desc=descending, values=values, indices=indices)
        return Recipe(src, [Launch("sort_rows", (rows * wg,), (wg,), (Arg(0), *outs), (int(index_order),))])
    wg = traits.work_group(cap // 2)
    src = _source(x, t, n=n, inner=inner, k=k, np_=cap, wg=wg, desc=descending, values=values, indices=indices)
    scratch = [rows * n * 4, rows * n * 4]
    bufs = [Arg(0, scratch=True), Arg(1, scratch=True)]
    steps: list[Launch] = []
    cur = 0

    def sort_by(by_index: int, count: int) -> None:
        nonlocal cur
        tiles = -(-count // cap)
        steps.append(Launch("sort_tiles", (tiles * wg, rows), (wg, 1), (Arg(0), bufs[cur]), (by_index, count)))
        width = cap
        while width < count:
            steps.append(Launch("merge_pass", (round_up(count, wg), rows), (wg, 1), (Arg(0), bufs[cur], bufs[1 - cur]),
                                (by_index, count, width)))
            cur, width = 1 - cur, width * 2

    sort_by(0, n)
    if index_order:
        sort_by(1, k)
    steps.append(Launch("emit", (round_up(k, wg), rows), (wg, 1), (Arg(0), bufs[cur], *outs)))
    return Recipe(src, steps, scratch)


def sort(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """sort (values) and argsort (int64 indices) along ``axis``."""
    x = in_types[0]
    axis = int(attrs["axis"]) % x.rank
    values = op == "sort"
    return _sort(op, x, axis, x.shape[axis], bool(attrs["descending"]), False, values, not values, traits)


def topk(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """The first k of the descending (largest) or ascending order; sorted=False re-orders them by index."""
    x = in_types[0]
    axis = int(attrs["axis"]) % x.rank
    return _sort(op, x, axis, int(attrs["k"]), bool(attrs["largest"]), not attrs["sorted"], True, True, traits)


GENERATORS = {"sort": sort, "argsort": sort, "topk": topk}
