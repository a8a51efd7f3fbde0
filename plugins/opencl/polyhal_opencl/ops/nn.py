"""Convolution and pooling (mirrors :mod:`polyhal.ops.nn`), layout (batch, channels, spatial...).

Direct kernels: one work-item per output element loops over its window, with every extent,
stride, pad and dilation a literal, so the compiler unrolls what it likes. No im2col buffer, so
nothing to allocate; a tiled variant through local memory is the obvious next step for speed.
``linear`` (x @ w + b) is a matmul and lives in :mod:`.linalg`.
"""

from __future__ import annotations

from typing import Any, Mapping

from polyhal_opencl.codegen import (
    Arg, CType, DeviceTraits, Recipe, coord_kernel, ctype, dense_strides, header, linear_launch,
)


def _window(rank: int, attrs: Mapping[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """strides, pads (begins then ends) and dilations with the ONNX defaults filled in."""
    n = rank - 2
    s = [int(v) for v in attrs.get("strides") or [1] * n]
    p = [int(v) for v in attrs.get("pads") or [0] * (2 * n)]
    d = [int(v) for v in attrs.get("dilations") or [1] * n]
    return s, p, d


def _taps(n: int, kernel: list[int], body: str, tap: str, idx: str, indent: str = "  ") -> str:
    """Nested loops over kernel positions k0..k{n-1}; ``tap(i)`` is C code computing ``i<i>``
    (the input coordinate of dim i) and ending with ``continue`` when it is outside."""
    code, close = "", ""
    for i in range(n):
        pad = indent + "  " * i
        code += f"{pad}for ({idx} k{i} = 0; k{i} < {kernel[i]}; ++k{i}) {{\n{pad}  {tap(i)}\n"
        close = f"{pad}}}\n" + close
    return code + indent + "  " * n + body + "\n" + close


def conv(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """out[n, m, o] = bias[m] + sum over c of the group, k: x[n, c, o*s - p + k*d] * w[m, c, k]."""
    x, w = in_types[:2]
    has_bias = len(in_types) > 2
    y = out_types[0]
    t = ctype(x.dtype, traits, op)
    n = x.rank - 2
    s, p, d = _window(x.rank, attrs)
    group = int(attrs["group"])
    cg, mg = w.shape[1], w.shape[0] // group
    xs, ws = dense_strides(x.shape), dense_strides(w.shape)

    def tap(i: int) -> str:
        return (f"const long i{i} = c{i + 2} * {s[i]} - {p[i]} + k{i} * {d[i]};"
                f" if (i{i} < 0 || i{i} >= {x.shape[2 + i]}) continue;")

    def body(idx: str) -> str:
        xo = " + ".join(f"i{i} * {xs[2 + i]}" for i in range(n))
        wo = " + ".join(f"k{i} * {ws[2 + i]}" for i in range(n))
        inner = f"acc += {t.load('x', f'xc + {xo}')} * {t.load('w', f'wc + {wo}')};"
        return (f"  const long g = c1 / {mg};\n"
                f"  {t.compute} acc = {t.load('b', 'c1') if has_bias else '0'};\n"
                f"  for (long ci = 0; ci < {cg}; ++ci) {{\n"
                f"    const long xc = c0 * {xs[0]} + (g * {cg} + ci) * {xs[1]}, wc = c1 * {ws[0]} + ci * {ws[1]};\n"
                + _taps(n, list(w.shape[2:]), inner, tap, "long", "    ")
                + f"  }}\n  {t.store_stmt('y', 'gid', 'acc')}")

    return _recipe("conv", y, t, in_types, body, traits, has_bias)


def conv_transpose(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """The gather form of the scatter ONNX describes: output o takes x[n, c, i] * w[c, m, k] for
    every tap k with o + p - k*d = i*s for an input position i."""
    x, w = in_types[:2]
    has_bias = len(in_types) > 2
    y = out_types[0]
    t = ctype(x.dtype, traits, op)
    n = x.rank - 2
    s, p, d = _window(x.rank, attrs)
    group = int(attrs["group"])
    cg, mg = x.shape[1] // group, w.shape[1]
    xs, ws = dense_strides(x.shape), dense_strides(w.shape)

    def tap(i: int) -> str:
        return (f"const long t{i} = c{i + 2} + {p[i]} - k{i} * {d[i]};"
                f" if (t{i} < 0 || t{i} % {s[i]}) continue;"
                f" const long i{i} = t{i} / {s[i]}; if (i{i} >= {x.shape[2 + i]}) continue;")

    def body(idx: str) -> str:
        xo = " + ".join(f"i{i} * {xs[2 + i]}" for i in range(n))
        wo = " + ".join(f"k{i} * {ws[2 + i]}" for i in range(n))
        inner = f"acc += {t.load('x', f'xc + {xo}')} * {t.load('w', f'wc + {wo}')};"
        return (f"  const long g = c1 / {mg}, mm = c1 % {mg};\n"
                f"  {t.compute} acc = {t.load('b', 'c1') if has_bias else '0'};\n"
                f"  for (long ci = 0; ci < {cg}; ++ci) {{\n"
                f"    const long c = g * {cg} + ci;\n"
                f"    const long xc = c0 * {xs[0]} + c * {xs[1]}, wc = c * {ws[0]} + mm * {ws[1]};\n"
                + _taps(n, list(w.shape[2:]), inner, tap, "long", "    ")
                + f"  }}\n  {t.store_stmt('y', 'gid', 'acc')}")

    return _recipe("conv_transpose", y, t, in_types, body, traits, has_bias)


def _recipe(name: str, y, t: CType, in_types, body, traits: DeviceTraits, has_bias: bool) -> Recipe:
    params = [("x", t.store, True), ("w", t.store, True)] + ([("b", t.store, True)] if has_bias else [])
    params.append(("y", t.store, False))
    extent = max(tt.size for tt in (*in_types, y))
    src = header(t) + coord_kernel(name, y.shape, params, body, extent=extent)
    return Recipe(src, linear_launch(name, y.size, [Arg(i) for i in range(len(params))], traits))


def pool(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """max (nan wins, padding never does), avg (over taps inside the input, or the padded input
    with count_include_pad) and lp ((sum |x|^p)^(1/p)) over each window."""
    x, y = in_types[0], out_types[0]
    t = ctype(x.dtype, traits, op)
    n = x.rank - 2
    s, pads, d = _window(x.rank, attrs)
    k = [int(v) for v in attrs["kernel_shape"]]
    xs = dense_strides(x.shape)
    kind = op.split("_")[0]

    def tap(i: int) -> str:
        return (f"const long i{i} = c{i + 2} * {s[i]} - {pads[i]} + k{i} * {d[i]};"
                f" if (i{i} < 0 || i{i} >= {x.shape[2 + i]}) continue;")

    def body(idx: str) -> str:
        off = f"c0 * {xs[0]} + c1 * {xs[1]} + " + " + ".join(f"i{i} * {xs[2 + i]}" for i in range(n))
        v = f"const {t.compute} v = {t.load('x', off)};"
        if kind == "max":
            take = "if (!isnan(acc) && (isnan(v) || v > acc)) acc = v;" if t.is_float else "if (v > acc) acc = v;"
            return (f"  {t.compute} acc = {t.lowest()};\n" + _taps(n, k, f"{v} {take}", tap, "long")
                    + f"  {t.store_stmt('y', 'gid', 'acc')}")
        if kind == "lp":
            power = int(attrs["p"])
            return (f"  {t.compute} acc = 0;\n" + _taps(n, k, f"{v} acc += pown(fabs(v), {power});", tap, "long")
                    + f"  {t.store_stmt('y', 'gid', f'rootn(acc, {power})')}")
        count = "count"
        pre = f"  {t.compute} acc = 0;\n  long count = 0;\n"
        if attrs["count_include_pad"]:  # taps inside the padded input, per dim, multiplied
            count = " * ".join(f"cnt{i}" for i in range(n))
            for i in range(n):
                lo, hi = -pads[i], x.shape[2 + i] + pads[i + n]
                pre += (f"  long cnt{i} = 0;\n  for (long k = 0; k < {k[i]}; ++k) {{ const long q = c{i + 2} * {s[i]}"
                        f" - {pads[i]} + k * {d[i]}; cnt{i} += (q >= {lo} && q < {hi}); }}\n")
        return (pre + _taps(n, k, f"{v} acc += v; ++count;", tap, "long")
                + f"  {t.store_stmt('y', 'gid', f'acc / ({t.compute})({count})')}")

    params = [("x", t.store, True), ("y", t.store, False)]
    src = header(t) + coord_kernel(op, y.shape, params, body, extent=x.size)
    return Recipe(src, linear_launch(op, y.size, [Arg(0), Arg(1)], traits))


GENERATORS = {"conv": conv, "conv_transpose": conv_transpose, "max_pool": pool, "avg_pool": pool, "lp_pool": pool}
