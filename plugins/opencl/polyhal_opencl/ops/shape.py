"""Data-movement kernels: transpose, slice, concat and gather are strided copies of raw bits
(so they work for every element type, float64 included without fp64); reshape is a buffer copy.
"""

from __future__ import annotations

from typing import Any, Mapping

from polyhal.ops import normalize_slice

from polyhal_opencl.codegen import (
    Arg, Copy, DeviceTraits, Recipe, bits_ctype, ctype, dense_strides, linear_launch, strided_kernel,
)


def copy_kernel(name: str, shape, src_strides, dst_strides, t, src_base: int = 0, dst_base: int = 0,
                 extent: int = 0) -> str:
    """dst[view] = src[view]: both views over ``shape``, with constant element base offsets;
    ``extent`` bounds every element offset (it picks 32- or 64-bit index math)."""
    views = [("x", t, src_strides, True), ("y", t, dst_strides, False)]

    def body(o: dict[str, str]) -> str:
        return f"  y[{o['y']} + {dst_base}] = x[{o['x']} + {src_base}];"

    return strided_kernel(name, shape, views, body, extent=extent)


def transpose(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Output dim i reads input dim perm[i]: the input's strides, permuted."""
    x, y = in_types[0], out_types[0]
    perm = attrs["perm"]
    perm = tuple(reversed(range(x.rank))) if perm is None else tuple(int(p) % max(x.rank, 1) for p in perm)
    src = dense_strides(x.shape)
    t = bits_ctype(x.dtype)
    source = copy_kernel("transpose", y.shape, [src[p] for p in perm], dense_strides(y.shape), t)
    return Recipe(source, linear_launch("transpose", y.size, [Arg(0), Arg(1)], traits))


def byte_copy(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """Same bytes, new type (reshape: new shape; bitcast: new element type of the same width):
    one queue-ordered buffer copy, as plans give every value its own buffer."""
    return Recipe("", [Copy(0, 1, out_types[0].nbytes)])


def slice_(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """ONNX Slice (normalised by the core's ``normalize_slice``): a view with start offsets and
    stride * step (negative for negative steps)."""
    x, y = in_types[0], out_types[0]
    slices = normalize_slice(x.shape, attrs["starts"], attrs["ends"], attrs["axes"], attrs["steps"])
    src = dense_strides(x.shape)
    ranges = [sl.indices(d) for sl, d in zip(slices, x.shape)]  # (start, stop, step) per dim
    base = sum(r[0] * s for r, s in zip(ranges, src)) if y.size else 0
    strides = [s * r[2] for s, r in zip(src, ranges)]
    source = copy_kernel("slice", y.shape, strides, dense_strides(y.shape), bits_ctype(x.dtype),
                          src_base=base, extent=x.size)
    return Recipe(source, linear_launch("slice", y.size, [Arg(0), Arg(1)], traits))


def concat(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """One copy kernel per operand into its band of the output along ``axis``."""
    y = out_types[0]
    axis = int(attrs["axis"]) % y.rank
    dst = dense_strides(y.shape)
    t = bits_ctype(y.dtype)
    source, steps, start = "", [], 0
    for i, x in enumerate(in_types):
        name = f"concat{i}"
        source += copy_kernel(name, x.shape, dense_strides(x.shape), dst, t, dst_base=start * dst[axis],
                               extent=y.size)
        steps += linear_launch(name, x.size, [Arg(i), Arg(len(in_types))], traits)
        start += x.shape[axis]
    return Recipe(source, steps)


def gather(op: str, attrs: Mapping[str, Any], in_types, out_types, traits: DeviceTraits) -> Recipe:
    """out[pre, i..., post] = data[pre, indices[i...], post]. Negative indices count from the end;
    an index still outside the axis gives 0 (a kernel cannot raise, and reporting it would need
    a host sync on every run), never a read outside the buffer."""
    (data, idx), y = in_types, out_types[0]
    axis = int(attrs["axis"]) % data.rank
    dim = data.shape[axis]
    d_str, i_str = dense_strides(data.shape), dense_strides(idx.shape)
    k = idx.rank
    # Three views over the output shape: data without the gathered axis, the indices, the output.
    data_view = list(d_str[:axis]) + [0] * k + list(d_str[axis + 1:])
    idx_view = [0] * axis + list(i_str) + [0] * (data.rank - axis - 1)
    t, it = bits_ctype(data.dtype), ctype(idx.dtype, traits, op)
    views = [("x", t, data_view, True), ("ind", it, idx_view, True), ("y", t, dense_strides(y.shape), False)]
    source = strided_kernel("gather", y.shape, views, lambda o: gather_body(o, t, dim, d_str[axis]), extent=data.size)
    return Recipe(source, linear_launch("gather", y.size, [Arg(0), Arg(1), Arg(2)], traits))


def gather_body(o: dict[str, str], t, dim: int, stride: int) -> str:
    """y = x[j * stride] for the index j read at ``ind`` (negative counts from the end of a dim
    of ``dim``; out of range gives 0): the body shared by gather and gather_elements."""
    return (f"  long j = (long)ind[{o['ind']}];\n  if (j < 0) j += {dim};\n"
            f"  y[{o['y']}] = (j >= 0 && j < {dim}) ? x[{o['x']} + j * {stride}] : ({t.store})0;")


GENERATORS = {"transpose": transpose, "reshape": byte_copy, "slice": slice_, "concat": concat, "gather": gather}
