"""Indexing kernels (mirrors :mod:`polyhal.ops.indexing`): expand, pad, gather_elements,
gather_nd, scatter_elements, scatter_nd, cumsum, cumprod and einsum. argmin and reduce_prod are folds of
:mod:`.reduction`.

Out-of-range indices read 0 (gathers) or are skipped (scatters): a kernel cannot raise, and
checking on the host would need a sync on every run; memory outside a tensor is never touched.
Scatters are gathers turned around: one work-item per *output* element scans the updates that
can reach it, in order. That needs no atomics (OpenCL 1.2 has none for floats), is deterministic,
and applies repeated indices in the reference's order.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from polyhal_opencl.codegen import (
    Arg, CType, DeviceTraits, Recipe, accumulator, bits_ctype, bits_literal, broadcast_strides, collapse,
    coord_kernel, ctype, dense_strides, header, index_type, linear_launch, offsets_code, strided_kernel,
)
from polyhal_opencl.ops.elementwise import BINARY
from polyhal_opencl.ops.shape import copy_kernel, gather_body


def expand(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Broadcast both ways: a copy reading x with zero strides on its broadcast dims."""
    x, y = in_types[0], out_types[0]
    src = copy_kernel("expand", y.shape, broadcast_strides(x.shape, y.shape), dense_strides(y.shape),
                      bits_ctype(x.dtype), extent=y.size)
    return Recipe(src, linear_launch("expand", y.size, [Arg(0), Arg(1)], traits))


def pad(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """ONNX Pad: per dim, the output coordinate maps back into the (cropped) input by the mode."""
    x, y = in_types[0], out_types[0]
    rank, mode = x.rank, attrs["mode"]
    pads = [int(v) for v in attrs["pads"]]
    t = bits_ctype(x.dtype)
    strides = dense_strides(x.shape)

    def body(idx: str) -> str:
        lines = [f"  {idx} src = 0;\n  int inside = 1;\n"]
        for d in range(rank):
            b, e = pads[d], pads[d + rank]
            n, crop, lead = x.shape[d] + min(b, 0) + min(e, 0), max(-b, 0), max(b, 0)
            lines.append(f"  {idx} i{d} = c{d} - {lead};\n")
            if mode == "constant":
                lines.append(f"  inside &= (i{d} >= 0 && i{d} < {n});\n")
            elif mode == "edge":
                lines.append(f"  i{d} = clamp(i{d}, ({idx})0, ({idx}){max(n - 1, 0)});\n")
            elif mode == "reflect":  # pads are smaller than the dim: one reflection suffices
                lines.append(f"  if (i{d} < 0) i{d} = -i{d}; else if (i{d} >= {n}) i{d} = {2 * (n - 1)} - i{d};\n")
            else:  # wrap
                lines.append(f"  i{d} = ((i{d} % {n}) + {n}) % {n};\n")
            lines.append(f"  src += (i{d} + {crop}) * {strides[d]};\n")
        fill = bits_literal(attrs["value"], x.dtype)
        lines.append(f"  y[gid] = inside ? x[src] : {fill};")
        return "".join(lines)

    src = coord_kernel("pad", y.shape, [("x", t.store, True), ("y", t.store, False)], body, extent=x.size)
    return Recipe(src, linear_launch("pad", y.size, [Arg(0), Arg(1)], traits))


def gather_elements(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """out[c] = data[c with c[axis] = indices[c]]: gather's body over a per-element index."""
    (data, ind), y = in_types, out_types[0]
    axis = int(attrs["axis"]) % data.rank
    ds = dense_strides(data.shape)
    t, it = bits_ctype(data.dtype), ctype(ind.dtype, traits, op)
    views = [("x", t, [0 if d == axis else s for d, s in enumerate(ds)], True),
             ("ind", it, dense_strides(ind.shape), True), ("y", t, dense_strides(y.shape), False)]
    src = strided_kernel("gather_elements", y.shape, views,
                         lambda o: gather_body(o, t, data.shape[axis], ds[axis]), extent=data.size)
    return Recipe(src, linear_launch("gather_elements", y.size, [Arg(0), Arg(1), Arg(2)], traits))


def gather_nd(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Each index row (k entries) picks a slice of data after the shared batch dims."""
    (data, ind), y = in_types, out_types[0]
    b, k = int(attrs["batch_dims"]), ind.shape[-1]
    ds, is_ = dense_strides(data.shape), dense_strides(ind.shape)
    lead, tail = ind.rank - 1 - b, data.rank - b - k
    t, it = bits_ctype(data.dtype), ctype(ind.dtype, traits, op)
    views = [("x", t, list(ds[:b]) + [0] * lead + list(ds[b + k:]), True),
             ("ind", it, list(is_[:-1]) + [0] * tail, True), ("y", t, dense_strides(y.shape), False)]

    def body(o: dict[str, str]) -> str:
        lines = ["  long off = 0;\n  int ok = 1;\n"]
        for j in range(k):
            dim = data.shape[b + j]
            lines.append(f"  {{ long v = (long)ind[{o['ind']} + {j}]; if (v < 0) v += {dim};"
                         f" ok &= (v >= 0 && v < {dim}); off += v * {ds[b + j]}; }}\n")
        lines.append(f"  y[{o['y']}] = ok ? x[{o['x']} + off] : ({t.store})0;")
        return "".join(lines)

    src = strided_kernel("gather_nd", y.shape, views, body, extent=data.size)
    return Recipe(src, linear_launch("gather_nd", y.size, [Arg(0), Arg(1), Arg(2)], traits))


def _combine(reduction: str, t: CType) -> str:
    """C statement folding update ``u`` into ``acc`` (elementwise's add/mul/maximum/minimum)."""
    if reduction == "none":
        return "acc = u;"
    name = {"add": "add", "mul": "mul", "max": "maximum", "min": "minimum"}[reduction]
    return f"acc = {BINARY[name]('acc', 'u', t)};"


def _scatter_types(data, reduction: str, traits: DeviceTraits, op: str) -> CType:
    # Overwriting moves bits (any type, exactly); combining computes in the element's type.
    return bits_ctype(data.dtype) if reduction == "none" else ctype(data.dtype, traits, op)


def scatter_elements(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Output element c scans the K updates of its lane along ``axis`` (the indices tensor may be
    smaller than data in every dim; elements outside it get no update)."""
    data, ind, upd = in_types
    y = out_types[0]
    axis, reduction = int(attrs["axis"]) % data.rank, attrs["reduction"]
    t, it = _scatter_types(data, reduction, traits, op), ctype(ind.dtype, traits, op)
    is_ = dense_strides(ind.shape)
    dim, lane = data.shape[axis], ind.shape[axis]

    def body(idx: str) -> str:
        inside = " && ".join(f"c{d} < {ind.shape[d]}" for d in range(data.rank) if d != axis) or "1"
        base = " + ".join(f"c{d} * {is_[d]}" for d in range(data.rank) if d != axis) or "0"
        return (
            f"  {t.compute} acc = {t.load('x', 'gid')};\n"
            f"  if ({inside}) {{\n    const {idx} base = {base};\n"
            f"    for ({idx} j = 0; j < {lane}; ++j) {{\n"
            f"      long v = (long)ind[base + j * {is_[axis]}]; if (v < 0) v += {dim};\n"
            f"      if (v == c{axis}) {{ const {t.compute} u = {t.load('upd', f'base + j * {is_[axis]}')}; {_combine(reduction, t)} }}\n"
            f"    }}\n  }}\n  {t.store_stmt('y', 'gid', 'acc')}"
        )

    params = [("x", t.store, True), ("ind", it.store, True), ("upd", t.store, True), ("y", t.store, False)]
    src = header(t) + coord_kernel("scatter_elements", y.shape, params, body, extent=max(data.size, ind.size))
    return Recipe(src, linear_launch("scatter_elements", y.size, [Arg(i) for i in range(4)], traits))


def scatter_nd(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Output element p (slice s = p / inner) scans the N index rows, in order, for those naming s."""
    data, ind, upd = in_types
    y, reduction = out_types[0], attrs["reduction"]
    k = ind.shape[-1]
    rows, inner = math.prod(ind.shape[:-1]), math.prod(data.shape[k:])
    t, it = _scatter_types(data, reduction, traits, op), ctype(ind.dtype, traits, op)

    def body(idx: str) -> str:
        lin = "".join(f"      {{ long v = (long)ind[n * {k} + {j}]; if (v < 0) v += {data.shape[j]};"
                      f" ok &= (v >= 0 && v < {data.shape[j]}); lin = lin * {data.shape[j]} + v; }}\n"
                      for j in range(k))
        return (
            f"  const long s = gid / {max(inner, 1)}, r = gid % {max(inner, 1)};\n"
            f"  {t.compute} acc = {t.load('x', 'gid')};\n"
            f"  for (long n = 0; n < {rows}; ++n) {{\n      long lin = 0; int ok = 1;\n{lin}"
            f"      if (ok && lin == s) {{ const {t.compute} u = {t.load('upd', f'n * {inner} + r')}; {_combine(reduction, t)} }}\n"
            f"  }}\n  {t.store_stmt('y', 'gid', 'acc')}"
        )

    params = [("x", t.store, True), ("ind", it.store, True), ("upd", t.store, True), ("y", t.store, False)]
    src = header(t) + coord_kernel("scatter_nd", (y.size,), params, body, extent=max(data.size, upd.size, ind.size))
    return Recipe(src, linear_launch("scatter_nd", y.size, [Arg(i) for i in range(4)], traits))


def scan(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """cumsum / cumprod: a running sum or product per lane along ``axis``, one work-item per
    lane, accumulating as the reductions do (double for floats where available, wrapping for
    integers); ``exclusive`` writes before folding, so the first result is the identity."""
    x = in_types[0]
    t = ctype(x.dtype, traits, op)
    axis = int(attrs["axis"]) % x.rank
    n, inner = x.shape[axis], math.prod(x.shape[axis + 1:])
    lanes = x.size // n if n else 0
    acc = accumulator(t, traits)
    sym, identity = ("+", 0) if op == "cumsum" else ("*", 1)
    pos = f"({n - 1} - j)" if attrs["reverse"] else "j"
    fold = f"acc {sym}= ({acc})v;"
    step = (f"{t.store_stmt('y', 'e', 'acc')} {fold}" if attrs["exclusive"]
            else f"{fold} {t.store_stmt('y', 'e', 'acc')}")
    idx = index_type(x.size)

    def body(_: str) -> str:
        return (f"  const {idx} base = ({idx})(gid / {inner}) * {n * inner} + ({idx})(gid % {inner});\n"
                f"  {acc} acc = ({acc}){identity};\n  for ({idx} j = 0; j < {n}; ++j) {{\n"
                f"    const {idx} e = base + {pos} * {inner};\n    const {t.compute} v = {t.load('x', 'e')};\n"
                f"    {step}\n  }}")

    params = [("x", t.store, True), ("y", t.store, False)]
    src = header(t, fp64=acc == "double") + coord_kernel(op, (lanes,), params, body, extent=x.size)
    return Recipe(src, linear_launch(op, lanes, [Arg(0), Arg(1)], traits))


# ------------------------------------------------------------------------------------- einsum

def parse_einsum(equation: str, shapes: list[tuple[int, ...]]) -> tuple[list[str], str, dict[str, int]]:
    """The labels of each operand and of the output, one per dim, with '...' expanded into
    digit labels (aligned from the right, as numpy broadcasts), and every label's size."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    ell_rank = max((len(s) - len(t.replace("...", "")) for t, s in zip(terms, shapes) if "..." in t), default=0)
    ell = "".join(str(i) for i in range(ell_rank))
    labels = []
    for term, shape in zip(terms, shapes):
        pre, _, post = term.partition("...")
        n_ell = len(shape) - len(pre) - len(post)
        labels.append(pre + ell[ell_rank - n_ell:] + post)
    if arrow:
        out = rhs.replace("...", ell)
    else:
        letters = "".join(labels)
        out = (ell if "..." in lhs else "") + "".join(sorted(c for c in set(letters) if c.isalpha() and letters.count(c) == 1))
    sizes: dict[str, int] = {}
    for lab, shape in zip(labels, shapes):
        for c, d in zip(lab, shape):
            if sizes.get(c, 1) == 1:  # a size-1 (ellipsis) dim broadcasts to the others
                sizes[c] = d
    return labels, out, sizes


def einsum_recipe(name: str, equation: str, in_types, out_type, traits: DeviceTraits) -> Recipe:
    """Sum of products: one work-item per output element loops over the contracted labels. A label
    repeated within an operand (a diagonal) adds the dims' strides; a broadcast dim gets 0."""
    shapes = [t.shape for t in in_types]
    labels, out, sizes = parse_einsum(equation, shapes)
    t = ctype(in_types[0].dtype, traits, name)
    acc = accumulator(t, traits)
    contracted = [c for c in dict.fromkeys("".join(labels)) if c not in out]

    def strides(lab: str, shape, over: list[str]) -> list[int]:
        dense = dense_strides(shape)
        return [sum(s for c2, d, s in zip(lab, shape, dense) if c2 == c and not (d == 1 and sizes[c] > 1)) for c in over]

    outs = list(out)
    views = [(f"x{i}", t, strides(lab, s, outs), True) for i, (lab, s) in enumerate(zip(labels, shapes))]
    views.append(("y", t, dense_strides(out_type.shape), False))
    rshape = [sizes[c] for c in contracted]
    total_r = math.prod(rshape)
    cshape, cstrides = collapse(rshape, [strides(lab, s, contracted) for lab, s in zip(labels, shapes)])
    idx = index_type(max([out_type.size, total_r] + [t2.size for t2 in in_types]))

    def body(o: dict[str, str]) -> str:
        names = [f"q{i}" for i in range(len(in_types))]
        loads = [t.load(f"x{i}", o[f"x{i}"] + f" + q{i}") for i in range(len(in_types))]
        product = " * ".join(f"({acc}){load}" for load in loads)
        return (f"  {acc} acc = 0;\n  for ({idx} r = 0; r < {total_r}; ++r) {{\n"
                + offsets_code("r", cshape, cstrides, names, idx, tag="r")
                + f"    acc += {product};\n  }}\n  " + t.store_stmt("y", o["y"], "acc"))

    src = header(t, fp64=acc == "double") + strided_kernel(name, out_type.shape, views, body,
                                                           extent=max(t2.size for t2 in in_types))
    return Recipe(src, linear_launch(name, out_type.size, [Arg(i) for i in range(len(in_types) + 1)], traits))


def einsum(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """numpy.einsum (see :func:`einsum_recipe`)."""
    return einsum_recipe("einsum", attrs["equation"], in_types, out_types[0], traits)


GENERATORS = {
    "expand": expand, "pad": pad, "gather_elements": gather_elements, "gather_nd": gather_nd,
    "scatter_elements": scatter_elements, "scatter_nd": scatter_nd, "cumsum": scan, "cumprod": scan,
    "einsum": einsum,
}
