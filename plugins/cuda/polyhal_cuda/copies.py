"""Copies of strided views into dense results, a row at a time: the CUDA ``transpose`` and
``reshape`` that the bufferize pass could not make views.

``cupy.copyto`` of a strided array runs one generic elementwise kernel that works out every
element's source address from the full shape in 64-bit arithmetic: on an H200, ViT-B/16's
(B, S, E) -> (S, B, E) transpose of 9.7 MB took 16-33 us per run, a quarter to a half of the
bandwidth. Where the source's last dim is contiguous -- a transpose that keeps the last axis, the
heads put back by ``permute(2, 0, 1, 3)`` before a reshape -- each result row is one contiguous
run of the source: :func:`prepare` copies such views in words of up to 16 bytes (the widest that
divides the row, the strides and both addresses), finding each row's source from at most four
outer dims. Anything else (the last axis moved, more outer dims than that, sizes past 32-bit
indexing) goes to ``cupy.copyto`` as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from polyhal.hal.device import Device  # the CUDA device; its module imports this one

#: Outer dims (after merging) a row's source address is found from.
OUTER = 4
WORDS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_SOURCE = "".join(f"""
extern "C" __global__ void copy_rows_{w}(const char* __restrict__ src, {t}* __restrict__ dst, unsigned total,
    unsigned words, unsigned n1, unsigned n2, unsigned n3, long long s0, long long s1, long long s2, long long s3) {{
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {{
    unsigned r = i / words;
    const unsigned w = i - r * words;
    const unsigned i3 = r % n3; r /= n3;
    const unsigned i2 = r % n2; r /= n2;
    const unsigned i1 = r % n1;
    const unsigned i0 = r / n1;
    dst[i] = reinterpret_cast<const {t}*>(src + i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3)[w];
  }}
}}
""" for w, t in WORDS.items())


def rows_of(shape: tuple, strides: tuple, itemsize: int) -> tuple[int, tuple, tuple] | None:
    """``(row_bytes, outer_sizes, outer_byte_strides)`` of a view of ``shape`` and byte
    ``strides`` copied a contiguous row at a time (``OUTER`` outer dims, outermost first, padded
    with ones), or None when its last dim is not contiguous or its outer dims do not merge into
    ``OUTER``."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims or dims[-1][1] != itemsize:
        return None
    row = dims[-1][0] * itemsize
    outer: list[tuple[int, int]] = []
    for n, s in dims[:-1]:
        if outer and outer[-1][1] == n * s:
            outer[-1] = (outer[-1][0] * n, s)  # contiguous with the dim outside it: one dim
        else:
            outer.append((n, s))
    while outer and outer[-1][1] == row:  # rows that follow one another: one longer row
        row *= outer.pop()[0]
    if len(outer) > OUTER:
        return None
    outer = [(1, 0)] * (OUTER - len(outer)) + outer
    return row, tuple(n for n, _ in outer), tuple(s for _, s in outer)


def prepare(device: "Device") -> Callable[[Any, Any], None]:
    """``fn(x, out)``: the dense ``out`` (of x's shape) = x (see the module docstring)."""
    import cupy

    copyto = cupy.copyto
    module = device.module(("copy_rows", _SOURCE), lambda: _compiled(cupy))
    kernels = {w: module.get_function(f"copy_rows_{w}") for w in WORDS}
    plans: dict[tuple, tuple | None] = {}

    def plan(x, out) -> tuple | None:
        key = (x.shape, x.strides, x.itemsize, x.data.ptr % 16, out.data.ptr % 16)
        if key not in plans:
            plans[key] = None
            rows = rows_of(x.shape, x.strides, x.itemsize)
            if rows is not None:
                row, sizes, strides = rows
                word = next(w for w in WORDS if not (row % w or x.data.ptr % w or out.data.ptr % w
                                                     or any(s % w for s in strides)))
                words = row // word
                total = words * int(np.prod(sizes))
                if total < 2**31:
                    blocks = min((total + 255) // 256, 65535)
                    args = (np.uint32(total), np.uint32(words)) + tuple(np.uint32(n) for n in sizes[1:]) + tuple(
                        np.int64(s) for s in strides)
                    plans[key] = (kernels[word], blocks, args)
        return plans[key]

    def copy(x, out) -> None:
        p = plan(x, out) if x.size else None
        if p is None:
            copyto(out, x)
            return
        kernel, blocks, args = p
        device.launch(kernel, "copy_rows", (blocks,), (256,), (np.uint64(x.data.ptr), np.uint64(out.data.ptr)) + args)
    return copy


def _compiled(cupy: Any) -> Any:
    mod = cupy.RawModule(code=_SOURCE, options=("-std=c++17",))
    mod.compile()
    return mod
